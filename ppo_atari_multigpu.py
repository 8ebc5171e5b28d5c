"""Data-parallel PPO for Atari in one file: every process steps its own envs, gradients are averaged.

One GPU, or a CPU machine as 2 processes x 4 envs (the same 8 envs, the same experiment):
    python ppo_atari_multigpu.py --env-id BreakoutNoFrameskip-v4
    torchrun --standalone --nproc_per_node=2 ppo_atari_multigpu.py --env-id BreakoutNoFrameskip-v4 --local-num-envs 4
One node, 8 GPUs (NCCL; 8 envs each, 64 in all, which learn less per sample than the published 8 of --local-num-envs 1):
    torchrun --standalone --nnodes=1 --nproc_per_node=8 ppo_atari_multigpu.py --env-id BreakoutNoFrameskip-v4
Two nodes with 8 GPUs each (run on every node, with its own --node-rank):
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=8 --master-addr=10.0.0.1 --master-port=29500 \
        ppo_atari_multigpu.py --env-id BreakoutNoFrameskip-v4
Preemptible machines (torchrun restarts the group, which continues from the latest checkpoint):
    torchrun --standalone --nproc_per_node=8 --max-restarts=3 ppo_atari_multigpu.py --resume auto
Evaluate a saved policy (final_model.pt, or any checkpoint_*.pt):
    python ppo_atari_multigpu.py --eval-checkpoint checkpoints/<env_id>__<exp_name>__<seed>/final_model.pt

The global batch is world_size * local_num_envs * num_steps. With the same envs in the job (world_size *
local_num_envs), every split of them across processes computes the same experiment: env j draws the same action
noise and lands in the same minibatches wherever it runs, so the number of processes only changes the speed.
The algorithm comes first; below the "Machinery" divider is what changes nothing it computes.
"""

import hashlib
import os
import random
import shlex
import signal
import socket
import sys
import time
import traceback
from collections import deque
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal, Optional

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro
from torch.distributions.categorical import Categorical

gym.register_envs(ale_py)


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # the name of this experiment (part of the run name)
    seed: int = 1  # seed of the experiment: network init, action noise, minibatches and env seeds derive from it
    torch_deterministic: bool = True  # if toggled, `torch.backends.cudnn.deterministic=True`: reruns of a seed repeat
    cuda: bool = True  # if toggled, use CUDA when it is available
    device_ids: tuple[int, ...] = ()  # one CUDA device id per local process; empty means cuda:<LOCAL_RANK>
    backend: Optional[Literal["gloo", "nccl", "mpi"]] = None  # None: nccl on GPUs, gloo on the CPU
    track: bool = False  # if toggled, also log to Weights & Biases (global rank 0; needs `pip install wandb`)
    wandb_project_name: str = "ppo_atari_multigpu"  # the Weights & Biases project
    wandb_entity: Optional[str] = None  # the Weights & Biases entity (team)
    capture_video: bool = False  # record videos of one env of global rank 0

    # Algorithm specific arguments
    env_id: str = "BreakoutNoFrameskip-v4"  # the id of the Atari environment
    total_timesteps: int = 10_000_000  # total agent steps of the experiment, summed over all processes
    learning_rate: float = 2.5e-4  # the learning rate of the optimizer
    local_num_envs: int = 8  # the number of parallel environments in each process
    num_steps: int = 128  # the number of steps to run in each environment per policy rollout
    anneal_lr: bool = True  # toggle learning rate annealing (linear: the full rate first, lr / num_iterations last)
    gamma: float = 0.99  # the discount factor gamma
    gae_lambda: float = 0.95  # the lambda for the general advantage estimation
    num_minibatches: int = 4  # minibatches per epoch; each takes num_steps / num_minibatches steps of every env
    update_epochs: int = 4  # the K epochs to update the policy
    norm_adv: bool = True  # toggles advantages normalization (per minibatch, with the whole minibatch's statistics)
    clip_coef: float = 0.1  # the surrogate clipping coefficient
    clip_vloss: bool = True  # toggles a clipped loss for the value function, as per the paper
    ent_coef: float = 0.01  # coefficient of the entropy
    vf_coef: float = 0.5  # coefficient of the value function
    max_grad_norm: float = 0.5  # the maximum norm for the gradient clipping
    target_kl: Optional[float] = None  # stop an iteration's epochs when a minibatch's KL (over all ranks) exceeds it

    # Speed: how the same algorithm is computed
    vector_env: Literal["sync", "async", "double", "ale", "ale-double"] = "sync"
    """sync: envs step in this process; async: each in a subprocess; double: async in two halves, one half
    stepping while the network picks the other half's actions; ale: ale-py's C++ vector env (threads, no
    Python per step); ale-double: ale in two halves, as double"""
    env_threads: Optional[int] = None  # threads of --vector-env ale per process (default: its share of the cores)
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast for the network (weights, optimiser, losses stay fp32)
    tf32: bool = False  # allow TF32 in fp32 convolutions and matmuls on GPUs (off: IEEE fp32, as on the CPU)
    torch_threads: Optional[int] = None  # torch threads per process (default: OMP_NUM_THREADS; torchrun sets 1)

    # Long runs: checkpoints, resume, evaluation
    checkpoint_interval_minutes: float = 5.0  # minutes between checkpoints (0: only at the end)
    checkpoint_keep: int = 3  # how many of the most recent checkpoints to keep
    resume: Optional[str] = None  # a checkpoint to continue, or `auto`: this run's latest, if any
    eval_checkpoint: Optional[str] = None  # evaluate this checkpoint (or final model) instead of training
    eval_episodes: int = 10  # number of full games to play when evaluating
    eval_final: bool = False  # after training, play eval_episodes games with the final model (global rank 0)
    eval_protocol: Optional[Literal["python", "ale"]] = None  # resets to evaluate under; None: the trained ones
    cost_per_hour: Optional[float] = None  # price per hour of the whole job, for the summary


@dataclass(frozen=True)
class BatchSizes:
    num_envs: int  # environments in the whole job
    local_batch_size: int
    local_minibatch_size: int
    batch_size: int
    minibatch_size: int
    num_iterations: int


def batch_sizes(args: Args, world_size: int) -> BatchSizes:
    num_envs = args.local_num_envs * world_size
    batch_size = num_envs * args.num_steps
    local_batch_size = args.local_num_envs * args.num_steps
    return BatchSizes(num_envs, local_batch_size, local_batch_size // args.num_minibatches, batch_size,
                      batch_size // args.num_minibatches, args.total_timesteps // batch_size)


# ---------------------------------------------------------------------------------------------------
# Environment: the DeepMind Atari preprocessing. gymnasium 1.x has max-and-skip, resize and frame
# stacking; noop reset, episodic life and fire reset are written here.
# ---------------------------------------------------------------------------------------------------
def play(env: gym.Env, actions) -> tuple:
    """Step `actions` in turn, starting a new game if one ends; return the last observation and info."""
    for action in actions:
        obs, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            obs, info = env.reset()
    return obs, info


class NoopReset(gym.Wrapper):
    """After a reset, play a random number (1..noop_max) of no-ops so that episodes start in different states."""

    def __init__(self, env: gym.Env, noop_max: int = 30):
        super().__init__(env)
        assert env.unwrapped.get_action_meanings()[0] == "NOOP"
        self.noop_max = noop_max

    def reset(self, **kwargs):
        self.env.reset(**kwargs)
        return play(self.env, [0] * self.unwrapped.np_random.integers(1, self.noop_max + 1))


class EpisodicLife(gym.Wrapper):
    """A lost life ends the learning episode (terminated=True); the vector env's reset then continues the
    same game with one no-op, and only a real game over restarts the emulator."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.lives, self.game_over = 0, True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = terminated or truncated
        lives = self.unwrapped.ale.lives()
        terminated = terminated or 0 < lives < self.lives
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs) if self.game_over else play(self.env, [0])
        self.game_over, self.lives = False, self.unwrapped.ale.lives()
        return obs, info


class FireReset(gym.Wrapper):
    """Press FIRE, then action 2, after every reset (including after a lost life): some games wait for it."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        assert env.unwrapped.get_action_meanings()[1] == "FIRE"

    def reset(self, **kwargs):
        self.env.reset(**kwargs)
        return play(self.env, (1, 2))


def make_env(env_id: str, record_video_dir: Optional[str] = None):
    def thunk():
        # Grey from ALE's own luminance, before the max over frames (as AtariPreprocessing). Frameskip 1 (the
        # wrappers skip 4 frames), the id's own sticky actions, drawn on every emulator frame: 0.25 for v5 ids.
        env = gym.make(env_id, obs_type="grayscale", frameskip=1, repeat_action_probability=sticky_actions(env_id),
                       render_mode="rgb_array" if record_video_dir else None)
        if record_video_dir:
            env = gym.wrappers.RecordVideo(env, record_video_dir, disable_logger=True)
        env = gym.wrappers.RecordEpisodeStatistics(env)  # innermost: whole-game, unclipped returns
        env = NoopReset(env, noop_max=30)
        env = gym.wrappers.MaxAndSkipObservation(env, skip=4)
        env = EpisodicLife(env)
        if "FIRE" in env.unwrapped.get_action_meanings():
            env = FireReset(env)
        env = gym.wrappers.TransformReward(env, lambda r: float(np.sign(r)))
        env = gym.wrappers.ResizeObservation(env, (84, 84))
        return gym.wrappers.FrameStackObservation(env, 4)

    return thunk


def make_vector_env(env_id: str, num_envs: int, record_video_dir: Optional[str] = None,
                    kind: str = "sync") -> gym.vector.VectorEnv:
    # SAME_STEP autoreset: the observation returned with done=True is already the next episode's first,
    # so every stored transition is real (NEXT_STEP would insert a fake one after every episode end).
    thunks = [make_env(env_id, record_video_dir if i == 0 else None) for i in range(num_envs)]
    vector_env = gym.vector.AsyncVectorEnv if kind == "async" else gym.vector.SyncVectorEnv
    return vector_env(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


# ---------------------------------------------------------------------------------------------------
# Network: the Nature CNN with separate actor and critic heads.
# ---------------------------------------------------------------------------------------------------
def layer_init(layer: nn.Module, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Module:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, num_actions: int):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype: float32 (bf16 autocast leaves them so); the tests' exact comparisons use float64."""
        return self.critic.weight.dtype

    def hidden(self, obs: torch.Tensor) -> torch.Tensor:
        # Rollouts store uint8 frames; channels-last is cheapest to make on the bytes, before the cast.
        x = obs.contiguous(memory_format=torch.channels_last).to(self.dtype).div_(255.0)
        return self.network(x)

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.hidden(obs)).to(self.dtype)

    def get_action_and_value(self, obs: torch.Tensor, action: Optional[torch.Tensor] = None,
                             gumbel: Optional[torch.Tensor] = None):
        hidden = self.hidden(obs)
        # ALGO LOGIC: action selection
        logits = self.actor(hidden).to(self.dtype)
        probs = Categorical(logits=logits, validate_args=False)  # validation would wait for the GPU
        if action is None:
            action = sample_action(logits, gumbel)
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden).to(self.dtype)


def sample_action(logits: torch.Tensor, gumbel: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A sample of Categorical(logits) by the Gumbel-max trick, which (unlike multinomial) never waits for the GPU.
    Training passes env j's noise (`draw_gumbel`), so env j acts alike wherever it runs; evaluation draws its own."""
    if gumbel is None:
        gumbel = -torch.empty_like(logits).exponential_().log()
    return torch.argmax(logits + gumbel, dim=-1)


def draw_gumbel(generator: torch.Generator, num_steps: int, num_envs: int, num_actions: int) -> torch.Tensor:
    """The whole job's action noise for one rollout, (num_steps, num_envs, num_actions) float32 on the CPU (590 KB
    at 64 envs x 128 steps x 18 actions): every process draws all of it and keeps its own envs' columns."""
    return -torch.empty(num_steps, num_envs, num_actions, dtype=torch.float32).exponential_(generator=generator).log()


# ---------------------------------------------------------------------------------------------------
# Algorithm: rollout, advantages, the data-parallel PPO update, the training loop.
# ---------------------------------------------------------------------------------------------------
@dataclass
class Rollout:
    """One rollout of one process. Observations stay uint8 on the device; rewards and dones stay on the
    host until the rollout ends, so that a step waits for nothing but its actions."""

    obs: torch.Tensor  # (num_steps, num_envs, 4, 84, 84)
    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    rewards: np.ndarray  # the transition's reward (plus gamma * V(final obs) after a time-limit truncation)
    dones: np.ndarray  # dones[t] = 1: observation t starts a new episode
    next_obs: torch.Tensor  # the observation after the last step, on the device
    next_obs_host: torch.Tensor  # its staging copy (pinned on CUDA; the same tensor on the CPU)
    next_done: np.ndarray

    @staticmethod
    def allocate(num_steps: int, num_envs: int, obs_shape: tuple, device: torch.device) -> "Rollout":
        step_shape = (num_steps, num_envs)
        next_obs = torch.zeros((num_envs,) + obs_shape, dtype=torch.uint8, device=device)
        return Rollout(torch.zeros(step_shape + obs_shape, dtype=torch.uint8, device=device),
                       torch.zeros(step_shape, dtype=torch.long, device=device),
                       torch.zeros(step_shape, device=device), torch.zeros(step_shape, device=device),
                       np.zeros(step_shape, np.float32), np.zeros(step_shape, np.float32), next_obs,
                       next_obs if device.type == "cpu" else torch.zeros_like(next_obs, device="cpu").pin_memory(),
                       np.zeros(num_envs, np.float32))

    def set_next_obs(self, index: slice, obs: np.ndarray) -> None:
        self.next_obs_host[index] = torch.from_numpy(obs)
        if self.next_obs_host is not self.next_obs:
            self.next_obs[index].copy_(self.next_obs_host[index], non_blocking=True)


def collect_rollout(policy, value_of, groups: list, rollout: Rollout, gumbel: torch.Tensor, gamma: float) -> list:
    """Step every env `num_steps` times with actions from `policy(obs, gumbel) -> (action, logprob, value)`,
    `gumbel[step, env]` the action noise of this process's envs; return the finished games as (step index,
    return, length). `groups` hold this process's envs (`EnvGroup`, below the divider): usually one; with
    two, one group's envs step (in worker processes) while the policy computes the other's actions, each
    action still from the current policy."""
    episodes = []

    def receive(group, step: int):
        i = group.index
        next_obs, reward, terminations, truncations, infos = group.receive()
        # A time-limit truncation is not a real end: bootstrap from the value of the final observation.
        truncated_only = truncations & ~terminations
        if truncated_only.any():
            final_obs = torch.as_tensor(np.stack(infos["final_obs"][truncated_only]), device=rollout.obs.device)
            reward[truncated_only] += gamma * value_of(final_obs).flatten().cpu().numpy()
        rollout.rewards[step, i] = reward
        rollout.next_done[i] = terminations | truncations
        rollout.set_next_obs(i, next_obs)
        if "final_info" in infos and "episode" in infos["final_info"]:
            finished, games = infos["final_info"]["_episode"], infos["final_info"]["episode"]
            episodes.extend((step, float(r), int(l)) for r, l in zip(games["r"][finished], games["l"][finished]))

    for step in range(rollout.obs.shape[0]):
        for group in groups:
            if step > 0:
                receive(group, step - 1)
            i = group.index
            rollout.obs[step, i] = rollout.next_obs[i]
            rollout.dones[step, i] = rollout.next_done[i]
            action, logprob, value = policy(rollout.next_obs[i], gumbel[step, i])
            rollout.values[step, i] = value.flatten()
            rollout.actions[step, i] = action
            rollout.logprobs[step, i] = logprob
            group.send(action.cpu().numpy())  # the one wait of a step: the actions, for the envs
    for group in groups:
        receive(group, rollout.obs.shape[0] - 1)
    return episodes


def compute_advantages(rewards, values, dones, next_value, next_done, *, gamma: float, gae_lambda: float):
    """GAE(lambda) over a (num_steps, num_envs) rollout; returns (advantages, returns). `dones[t]` is 1 when
    observation t starts a new episode; `next_value` / `next_done` describe the observation after the last step."""
    # ALGO LOGIC: advantages
    next_values = torch.cat([values[1:], next_value.unsqueeze(0)])
    next_nonterminal = 1.0 - torch.cat([dones[1:], next_done.unsqueeze(0)])
    deltas = rewards + gamma * next_values * next_nonterminal - values
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        last_gae = deltas[t] + gamma * gae_lambda * next_nonterminal[t] * last_gae
        advantages[t] = last_gae
    return advantages, advantages + values


def flat_gradient_buffer(parameters) -> torch.Tensor:
    """Make every parameter's .grad a view into one flat tensor, so the all-reduce needs no copies.
    Each view keeps its parameter's strides (channels_last convolutions), as autograd expects."""
    params = [p for p in parameters if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat.as_strided(p.shape, p.stride(), offset)
        offset += p.numel()
    return flat


def make_learner(num_actions: int, device: torch.device, learning_rate: float) -> tuple:
    """The agent (channels-last), its fused Adam (eps 1e-5) and the flat buffer the gradients of everything the
    optimizer steps live in."""
    agent = Agent(num_actions).to(device, memory_format=torch.channels_last)
    # ALGO LOGIC: what is trained. A parameter outside the agent joins here, as a param group of its own, before
    # the flat buffer is made: its gradient is then all-reduced, clipped, scheduled and compared like the agent's.
    optimizer = torch.optim.Adam(agent.parameters(), lr=learning_rate, eps=1e-5, fused=True)
    return agent, optimizer, flat_gradient_buffer(trained_parameters(optimizer))


def trained_parameters(optimizer: torch.optim.Optimizer) -> list:
    """Everything the optimizer steps, in the order of its param groups."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def get_lr(iteration: int, num_iterations: int, learning_rate: float, anneal: bool) -> float:
    """The rate of 1-based `iteration`: linear from the full rate at the first to 1/num_iterations of it at the last."""
    # ALGO LOGIC: learning-rate schedule
    return (1.0 - (iteration - 1.0) / num_iterations) * learning_rate if anneal else learning_rate


def all_reduce_sum_(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """One all-reduce, in place: every rank ends with the sum over ranks."""
    if world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_mean_(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """One all-reduce, in place: every rank ends with the mean over ranks (the whole model's gradient, in one go)."""
    return all_reduce_sum_(tensor, world_size).div_(world_size) if world_size > 1 else tensor


def draw_minibatches(generator: torch.Generator, epochs: int, num_envs: int, num_steps: int,
                     num_minibatches: int) -> torch.Tensor:
    """Env-stratified minibatches of one update (CleanRL permutes the whole batch), the same on every process: each
    epoch permutes every env's steps (an argsort of uniforms: one uniform permutation per (epoch, env), in one draw)
    and minibatch m takes the m-th slice of each. Shape (epochs, num_minibatches, num_envs, steps per minibatch)."""
    # ALGO LOGIC: minibatches
    noise = torch.rand(epochs, num_envs, num_steps, generator=generator, dtype=torch.float64)
    order = noise.argsort(dim=-1, stable=True)
    return order.view(epochs, num_envs, num_minibatches, -1).transpose(1, 2)


def local_minibatches(minibatches: torch.Tensor, first_env: int, local_num_envs: int) -> torch.Tensor:
    """This process's equal share of every minibatch: its envs' steps, as indices into its batch flattened
    step-major, (num_steps, local_num_envs).flatten(0, 1): step t of local env e is row t * local_num_envs + e.
    Shape (epochs, num_minibatches, local_num_envs * steps per minibatch)."""
    steps = minibatches[:, :, first_env:first_env + local_num_envs]
    return (steps * local_num_envs + torch.arange(local_num_envs).unsqueeze(1)).flatten(2)


def advantage_stats(advantages: torch.Tensor, world_size: int) -> torch.Tensor:
    """Mean and sample std of every global minibatch's advantages (as CleanRL's per-minibatch ones, never a process's
    share's), from each process's share (`advantages`: (..., share)); returns (..., 2). One float64 all-reduce."""
    a = advantages.double()
    sums = all_reduce_sum_(torch.stack([torch.full_like(a[..., 0], a.shape[-1]), a.sum(-1), a.square().sum(-1)]),
                           world_size)
    count, total, total_of_squares = sums
    mean = total / count
    variance = ((total_of_squares - total * mean) / (count - 1)).clamp(min=0)
    return torch.stack([mean, variance.sqrt()], -1).to(advantages.dtype)


def ppo_loss(newlogprob, oldlogprob, advantages, newvalue, oldvalue, returns, entropy, *, adv_stats,
             clip_coef: float, clip_vloss: bool, ent_coef: float, vf_coef: float):
    """The PPO objective of one minibatch (tensors of shape (minibatch,)): the loss to minimise and the
    statistics logged as losses/<name> (a new term is one more entry there). `adv_stats`: the (mean, sample
    std) of the whole global minibatch's advantages to normalise them with; None (--no-norm-adv): as given."""
    # ALGO LOGIC: the PPO loss
    logratio = newlogprob - oldlogprob
    ratio = logratio.exp()
    if adv_stats is not None:
        mean, std = adv_stats
        advantages = (advantages - mean) / (std + 1e-8)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

    v_loss_unclipped = (newvalue - returns) ** 2
    if clip_vloss:
        v_clipped = oldvalue + torch.clamp(newvalue - oldvalue, -clip_coef, clip_coef)
        v_loss = 0.5 * torch.max(v_loss_unclipped, (v_clipped - returns) ** 2).mean()
    else:
        v_loss = 0.5 * v_loss_unclipped.mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef
    with torch.no_grad():
        stats = {"policy_loss": pg_loss, "value_loss": v_loss, "entropy": entropy_loss,
                 "old_approx_kl": (-logratio).mean(), "approx_kl": ((ratio - 1) - logratio).mean(),
                 "clipfrac": ((ratio - 1.0).abs() > clip_coef).float().mean()}
    return loss, stats


def ppo_update(args: Args, agent: Agent, optimizer: torch.optim.Optimizer, flat_grad: torch.Tensor,
               batch: dict, minibatches: torch.Tensor, world_size: int, autocast):
    """`update_epochs` passes over this rank's share of the global minibatches (`local_minibatches`). Every
    rank holds an equal share, so the mean over ranks of their mean losses' gradients is the gradient of the
    whole minibatch's mean loss. Returns the loss statistics (means over all ranks and minibatches), whether
    all were finite, and the epochs run."""
    adv_stats = advantage_stats(batch["advantages"][minibatches], world_size) if args.norm_adv else None
    totals, num_updates, finite = 0, 0, torch.ones((), dtype=torch.bool, device=flat_grad.device)
    trained = trained_parameters(optimizer)
    for epoch in range(args.update_epochs):
        for m, mb in enumerate(minibatches[epoch]):
            with autocast:
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(batch["obs"][mb], batch["actions"][mb])
            loss, stats = ppo_loss(newlogprob, batch["logprobs"][mb], batch["advantages"][mb], newvalue.view(-1),
                                   batch["values"][mb], batch["returns"][mb], entropy,
                                   adv_stats=None if adv_stats is None else adv_stats[epoch, m],
                                   clip_coef=args.clip_coef, clip_vloss=args.clip_vloss, ent_coef=args.ent_coef,
                                   vf_coef=args.vf_coef)

            # TRY NOT TO MODIFY: the data-parallel step. Zero the flat buffer in place: optimizer.zero_grad()
            # would set every .grad to None, detaching it from flat_grad; the all-reduce would then average
            # zeros and each process would step on its own gradient.
            flat_grad.zero_()
            loss.backward()
            with ALLREDUCE_TIMER(flat_grad.device):
                all_reduce_mean_(flat_grad, world_size)
            grad_norm = nn.utils.clip_grad_norm_(trained, args.max_grad_norm)
            optimizer.step()
            finite &= torch.isfinite(loss) & torch.isfinite(grad_norm)  # checked once per iteration
            totals = totals + torch.stack([value.detach() for value in stats.values()])
            num_updates += 1

        # ALGO LOGIC: early stop, decided on the last minibatch's KL over all ranks: every rank leaves together
        if args.target_kl is not None:
            if all_reduce_mean_(stats["approx_kl"].clone(), world_size).item() > args.target_kl:
                break
    return dict(zip(stats, all_reduce_mean_(totals / num_updates, world_size).tolist())), finite, epoch + 1


def train(args: Args, groups: list, device: torch.device, backend: Optional[str], rank: int, world_size: int,
          resume_hint: str) -> int:
    """The training loop; returns the process exit code (0 finished, 3 interrupted, 4 non-finite, 5 the
    processes' weights differ). `resume_hint`: the command that continues the run, printed at a stop."""
    # TRY NOT TO MODIFY: resume, seeding, the learner
    sizes = batch_sizes(args, world_size)
    checkpoint_dir = Path("checkpoints") / run_id(args)
    resumed = load_resume_state(args, checkpoint_dir, rank, world_size)  # None for a fresh run
    # A resumed run gets fresh env seeds, still distinct across the job and from every other experiment seed's.
    seeds = env_seeds(args.seed, (resumed["iteration"] * sizes.num_envs if resumed else 0) + rank * args.local_num_envs,
                      args.local_num_envs)
    print_banner(args, sizes, backend, device, seeds, rank=rank, world_size=world_size,
                 env_threads=sum(getattr(group.envs, "num_threads", 0) for group in groups))

    # Same seed on every rank: identical initial weights (and a broadcast to be sure across machines).
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.backends.cudnn.benchmark = not args.torch_deterministic
    fp32_precision = "tf32" if args.tf32 else "ieee"  # stated, not inherited: PyTorch's defaults differ per op
    torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = fp32_precision
    num_actions = groups[0].envs.single_action_space.n
    agent, optimizer, flat_grad = make_learner(num_actions, device, args.learning_rate)
    base_lrs = [group["lr"] for group in optimizer.param_groups]  # each group's full rate, annealed alike
    # Every tensor the processes must hold equal: what the optimizer steps and the agent's buffers.
    trained = trained_parameters(optimizer)
    shared_state = trained + list(agent.buffers())
    outside_agent = [p for p in trained if all(p is not q for q in agent.parameters())]
    if world_size > 1:
        for tensor in shared_state:
            dist.broadcast(tensor.data, src=0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    # The shared stream: every process draws the whole job's random numbers from it in the same order (action
    # noise, then minibatches) and uses its envs' part, so every split of the envs is the same experiment. Draw new
    # noise (augmentation, epsilon-greedy) from it too: torch's default generator repeats alike on every process.
    shared_rng = torch.Generator().manual_seed(int(np.random.SeedSequence(args.seed).generate_state(1)[0]))
    local_envs = slice(rank * args.local_num_envs, (rank + 1) * args.local_num_envs)
    if resumed:  # continue exactly: the weights, Adam's moments and the shared stream
        agent.load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
        for p, saved in zip(outside_agent, resumed.get("other_parameters", [])):
            p.data.copy_(saved)
        shared_rng.set_state(resumed["shared_rng"])

    def checkpoint(iteration: int) -> dict:
        """Everything needed to continue, as a plain dict."""
        return {"model": agent.state_dict(), "optimizer": optimizer.state_dict(), "iteration": iteration,
                "other_parameters": [p.detach().cpu() for p in outside_agent],
                "global_step": global_step, "args": asdict(args), "world_size": world_size,
                "shared_rng": shared_rng.get_state(), "run_name": progress.run_name,
                "elapsed": progress.elapsed_before + time.time() - progress.start_time,  # over every part of the run
                "recent_returns": list(progress.recent_returns)}

    def policy(obs, gumbel):
        action, logprob, _, value = agent.get_action_and_value(obs, gumbel=gumbel)
        return action, logprob, value

    rollout = Rollout.allocate(args.num_steps, args.local_num_envs, groups[0].envs.single_observation_space.shape,
                               device)
    for group in groups:
        rollout.set_next_obs(group.index, group.envs.reset(seed=seeds[group.index])[0])
    progress = Progress(args, sizes, groups, rank, world_size, checkpoint_dir, resumed, shared_state,  # catches signals
                        resume_hint)
    global_step, exit_code, iteration = progress.global_step, 0, progress.start_iteration - 1
    for iteration in range(progress.start_iteration, sizes.num_iterations + 1):
        for group, base_lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = get_lr(iteration, sizes.num_iterations, base_lr, args.anneal_lr)

        rollout_start = time.perf_counter()
        gumbel = draw_gumbel(shared_rng, args.num_steps, sizes.num_envs, num_actions)[:, local_envs].to(device)
        # One autocast region for the whole rollout: under bf16 the weights are cast once, not at every step.
        with torch.no_grad(), autocast:
            episodes = collect_rollout(policy, agent.get_value, groups, rollout, gumbel, args.gamma)
        episodes = [(global_step + (step + 1) * sizes.num_envs, r, l) for step, r, l in episodes]
        global_step += args.num_steps * sizes.num_envs
        rollout_time = time.perf_counter() - rollout_start

        rewards = torch.as_tensor(rollout.rewards, device=device)  # one host-to-device copy per rollout
        dones = torch.as_tensor(rollout.dones, device=device)
        next_done = torch.as_tensor(rollout.next_done, device=device)
        with torch.no_grad(), autocast:
            next_value = agent.get_value(rollout.next_obs).flatten()
            advantages, returns = compute_advantages(rewards, rollout.values, dones, next_value, next_done,
                                                     gamma=args.gamma, gae_lambda=args.gae_lambda)
        # Flattened step-major: row t * local_num_envs + e is step t of env e (local_minibatches relies on it).
        batch = {"obs": rollout.obs.flatten(0, 1), "actions": rollout.actions.flatten(),
                 "values": rollout.values.flatten(), "logprobs": rollout.logprobs.flatten(),
                 "advantages": advantages.flatten(), "returns": returns.flatten()}

        update_start = time.perf_counter()
        minibatches = draw_minibatches(shared_rng, args.update_epochs, sizes.num_envs, args.num_steps,
                                       args.num_minibatches)
        minibatches = local_minibatches(minibatches, local_envs.start, args.local_num_envs).to(device)
        losses, finite, epochs = ppo_update(args, agent, optimizer, flat_grad, batch, minibatches, world_size,
                                            autocast)
        losses["explained_variance"] = explained_variance(batch["values"], batch["returns"], world_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        update_time = time.perf_counter() - update_start

        # TRY NOT TO MODIFY: every rank stops, checkpoints and logs together
        exit_code = progress.end_iteration(iteration, global_step, shared_state, checkpoint, finite, episodes, epochs,
                                           losses, optimizer.param_groups[0]["lr"], rollout_time, update_time)
        if exit_code:
            break
    if exit_code == 0:  # a last checkpoint (to resume with more steps) and the final model
        exit_code = progress.save(shared_state, checkpoint(iteration), final=True)
    progress.finish(exit_code, global_step)
    return exit_code


def main() -> None:
    args = tyro.cli(Args)
    # TRY NOT TO MODIFY: set by torchrun; a plain `python` launch is a job of one process.
    RANK = int(os.environ.get("RANK", 0))
    LOCAL_RANK = int(os.environ.get("LOCAL_RANK", 0))
    WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))
    LOCAL_WORLD_SIZE = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    # Every check that can fail runs before the process group exists: a rank that refuses its settings
    # exits at once, and no rank is left waiting for it in a collective.
    store = None
    if WORLD_SIZE > 1:
        # torchrun keeps one store across elastic restarts: key each attempt apart, or a restarted rank can
        # read the dead attempt's addresses (gloo then fails with "Connection refused").
        store, _, _ = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    try:
        cuda_device_count = torch.cuda.device_count() if args.cuda and torch.cuda.is_available() else 0
        backend, backend_note = check_args(args, WORLD_SIZE, LOCAL_WORLD_SIZE, cuda_device_count)
        device = select_device(args, LOCAL_RANK, cuda_device_count)
        cpu_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        bf16_note = check_bf16(args.precision, torch.cuda.get_device_capability(device) if device.type == "cuda"
                               else None, cpu_bf16)
        for note in (backend_note, bf16_note):
            if note and RANK == 0:
                print(f"note: {note}", flush=True)
        if args.eval_checkpoint:
            evaluate(args.eval_checkpoint, args.eval_episodes, args.local_num_envs, device, args.seed,
                     f"videos/eval__{Path(args.eval_checkpoint).stem}" if args.capture_video else None,
                     args.eval_protocol)
            return
        check_env_id(args.env_id)
        if WORLD_SIZE > 1:
            agree_on_backend(store, backend, RANK, WORLD_SIZE)
    except ConfigError as e:
        report_error(str(e), store, WORLD_SIZE)
        sys.exit(EXIT_CONFIG_ERROR)

    # Envs (and their subprocesses) start before the process group's threads. Env worker processes inherit
    # an ignored SIGINT: Ctrl-C then reaches the training process alone, which stops cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    video_dir = f"videos/{run_id(args)}__{int(time.time())}"
    env_threads = args.env_threads or max(1, len(os.sched_getaffinity(0)) // LOCAL_WORLD_SIZE)  # a fair share
    groups = make_env_groups(args, video_dir if args.capture_video and RANK == 0 else None, env_threads)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if WORLD_SIZE > 1:
        dist.init_process_group(backend, store=store, rank=RANK, world_size=WORLD_SIZE,
                                device_id=device if backend == "nccl" else None)
    try:
        exit_code = train(args, groups, device, backend, RANK, WORLD_SIZE,
                          resume_command(sys.argv, WORLD_SIZE, LOCAL_WORLD_SIZE))
    except ConfigError as e:  # a refused resume: every rank received the same verdict from rank 0
        report_error(str(e), store, WORLD_SIZE)
        exit_code = EXIT_CONFIG_ERROR
    except Exception:
        # Leave at once: a barrier or destroy_process_group here could wait forever on peers inside a collective.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    for group in groups:
        group.envs.close()
    if WORLD_SIZE > 1:
        dist.barrier()  # no rank exits (and makes torchrun stop the others) before rank 0 has saved and reported
        dist.destroy_process_group()
    # After the group is gone: the other ranks exit now instead of waiting (and timing out) in a collective.
    if RANK == 0 and exit_code == 0 and args.eval_final:
        evaluate(str(Path("checkpoints") / run_id(args) / "final_model.pt"), args.eval_episodes, args.local_num_envs,
                 device, args.seed + 10_000, protocol=args.eval_protocol)
    # torchrun sends SIGTERM to the rest when a peer exits first with a non-zero code: keep this rank's exit code.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # Leave without the interpreter's teardown (all is written and closed): torch._dynamo (imported by torch.optim)
    # keeps gloo's threads alive past destroy_process_group, and teardown under them can abort a rank (SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


# ===================================================================================================
# Machinery: faster env stepping, input validation, checkpoints and resume, preemption, evaluation, reports.
# TRY NOT TO MODIFY: nothing below changes what the algorithm computes.
# ===================================================================================================
# Faster env stepping (same games, same learning episodes): subprocesses, two halves in turn, ale-py's C++ envs.
class AtariVectorGames(gym.vector.VectorWrapper):
    """ale-py's C++ vector env (its threads run the emulators and the 84x84 grey, max-and-skip 4, 4-frame
    preprocessing) with the learning episodes of the Python stack: a lost life ends the learning episode while
    the game goes on, the learner sees sign-clipped rewards, and finished games are reported whole and
    unclipped under infos["final_info"]["episode"] (length in frames: 4 per agent step)."""

    def __init__(self, env_id: str, num_envs: int, num_threads: int):
        kwargs = gym.spec(env_id).kwargs
        # episodic_life=False: ale-py's own episodic life restarts the game at a lost life; lives are watched here.
        super().__init__(ale_py.AtariVectorEnv(
            kwargs["game"], num_envs, num_threads=num_threads, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
            max_num_frames_per_episode=kwargs.get("max_num_frames_per_episode", 108_000), frameskip=4,
            repeat_action_probability=sticky_actions(env_id), noop_max=30, use_fire_reset=True, episodic_life=False,
            reward_clipping=False))
        self.num_threads = num_threads
        self.returns, self.steps, self.lives = np.zeros(num_envs), np.zeros(num_envs, np.int64), None

    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=None if seed is None else np.asarray(seed), options=options)
        self.returns[:], self.steps[:], self.lives = 0, 0, info["lives"]
        return obs, info

    def step_async(self, actions: np.ndarray) -> None:
        self.env.send(actions)  # the C++ threads step the envs meanwhile

    def step_wait(self):
        obs, rewards, terminations, truncations, info = self.env.recv()
        game_over = terminations | truncations  # the env has already started the next game (SAME_STEP)
        self.returns += rewards
        self.steps += 1
        life_lost = ~game_over & (info["lives"] < self.lives)
        self.lives = info["lives"]
        if game_over.any():
            info["final_info"] = {"episode": {"r": self.returns.copy(), "l": 4 * self.steps}, "_episode": game_over}
            self.returns[game_over], self.steps[game_over] = 0, 0
        return obs, np.sign(rewards).astype(np.float32), terminations | life_lost, truncations, info

    def step(self, actions: np.ndarray):
        self.step_async(actions)
        return self.step_wait()


class EnvGroup:
    """Some of a process's envs, stepped as one: `send` the actions, `receive` the results. It sums the time
    spent waiting for them (perf/env_time)."""

    def __init__(self, envs: gym.vector.VectorEnv, index: slice):
        self.envs, self.index, self.actions, self.wait_seconds = envs, index, None, 0.0

    def send(self, actions: np.ndarray) -> None:
        self.actions = actions
        if hasattr(self.envs, "step_async"):
            self.envs.step_async(actions)  # the envs step in worker processes or C++ threads meanwhile

    def receive(self):
        start = time.perf_counter()
        result = self.envs.step_wait() if hasattr(self.envs, "step_async") else self.envs.step(self.actions)
        self.wait_seconds += time.perf_counter() - start
        return result


def make_env_groups(args: Args, record_video_dir: Optional[str] = None, env_threads: int = 1) -> list:
    """This process's envs: one vector env, or (--vector-env double, ale-double) two halves that step in turn."""
    n = args.local_num_envs
    parts = ((0, n // 2), (n // 2, n)) if args.vector_env.endswith("double") else ((0, n),)

    def vector_env(start: int, stop: int) -> gym.vector.VectorEnv:
        if args.vector_env.startswith("ale"):
            return AtariVectorGames(args.env_id, stop - start, max(1, env_threads // len(parts)))
        return make_vector_env(args.env_id, stop - start, record_video_dir if start == 0 else None,
                               "sync" if args.vector_env == "sync" else "async")

    return [EnvGroup(vector_env(start, stop), slice(start, stop)) for start, stop in parts]


ENV_SEEDS_PER_SEED, MAX_SEEDS = 2**20, 2048  # MAX_SEEDS * ENV_SEEDS_PER_SEED = 2^31: int32, as ale-py needs
EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, EXIT_NON_FINITE, EXIT_RANKS_DISAGREE = 2, 3, 4, 5
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class ConfigError(Exception):
    """A setting that cannot work; reported as one line, before any process waits on another."""


def report_error(message: str, store=None, world_size: int = 1) -> None:
    """One line per node, from whichever of its processes refuses first. Every rank refuses the same settings:
    each then waits (10 s at most) for the others, deaf to the SIGTERM torchrun sends the rest as soon as one
    exits, so that every rank exits with code 2 and torchrun reports none as killed."""
    if store is None or store.add(f"refused/node_{os.environ.get('GROUP_RANK', '0')}", 1) == 1:
        print(f"{os.path.basename(__file__)}: error: {message}", file=sys.stderr, flush=True)
    if store is not None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if store.add("refused/ranks", 1) == world_size:
            store.set("refused/all", "")
        with suppress(dist.DistStoreError):  # a timeout: some rank did not refuse, and torchrun stops it
            store.wait(["refused/all"], timedelta(seconds=10))


def check_args(args: Args, world_size: int, local_world_size: int, cuda_device_count: int) -> tuple:
    """Refuse settings that cannot work; return the backend (None: one process, no group) and a note on it.
    `cuda_device_count` is 0 without CUDA."""
    for name, value in asdict(args).items():
        if isinstance(value, float) and not np.isfinite(value):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    positive = ["total_timesteps", "local_num_envs", "num_steps", "num_minibatches", "update_epochs", "eval_episodes",
                "checkpoint_keep", "learning_rate", "clip_coef", "max_grad_norm"]
    optional = [name for name in ("torch_threads", "target_kl", "env_threads") if getattr(args, name) is not None]
    for name in positive + optional:
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name, low, high in (("gamma", 0, 1), ("gae_lambda", 0, 1), ("checkpoint_interval_minutes", 0, float("inf"))):
        if not low <= getattr(args, name) <= high:
            raise ConfigError(f"--{name.replace('_', '-')} must be in [{low}, {high}], got {getattr(args, name)}")
    sizes = batch_sizes(args, world_size)
    ids = (list(args.device_ids) or list(range(local_world_size))) if cuda_device_count else []
    refusals = [  # (refused, why); the first that holds is reported
        (args.eval_checkpoint and world_size > 1, "--eval-checkpoint runs in one process: start it with python, "
         "not torchrun"),
        (args.num_steps % args.num_minibatches, f"--num-minibatches {args.num_minibatches} does not divide "
         f"--num-steps {args.num_steps}: each minibatch takes num_steps / num_minibatches steps of every env; pick "
         f"sizes that divide evenly"),
        (not 0 <= args.seed < MAX_SEEDS, f"--seed must be in 0..{MAX_SEEDS - 1}, got {args.seed}: each seed owns "
         f"{ENV_SEEDS_PER_SEED:,} env seeds of its own below 2^31, the limit of ale-py's vector env"),
        (sizes.num_iterations * sizes.num_envs >= ENV_SEEDS_PER_SEED, f"--total-timesteps {args.total_timesteps} "
         f"/ --num-steps {args.num_steps} could draw {sizes.num_iterations * sizes.num_envs:,} env seeds (a resumed "
         f"run draws fresh ones), more than the {ENV_SEEDS_PER_SEED - 1:,} a seed may use: raise --num-steps"),
        (sizes.num_iterations == 0, f"--total-timesteps {args.total_timesteps} is smaller than one global batch "
         f"({sizes.batch_size} = {world_size} processes x {args.local_num_envs} envs x {args.num_steps} steps): the "
         f"run would train nothing; raise --total-timesteps or shrink the batch"),
        (args.device_ids and len(args.device_ids) != local_world_size, f"--device-ids names {len(args.device_ids)} "
         f"devices but this node runs {local_world_size} processes; give exactly one id per local process"),
        (args.vector_env.endswith("double") and args.local_num_envs < 2, f"--vector-env {args.vector_env} steps two "
         "halves of a process's envs: --local-num-envs must be at least 2"),
        (args.env_threads is not None and not args.vector_env.startswith("ale"), "--env-threads sets the threads of "
         "--vector-env ale or ale-double; drop it, or add --vector-env ale"),
        (args.capture_video and args.vector_env.startswith("ale"), "--capture-video records the Python envs: ale-py's "
         "vector env renders no frames; use another --vector-env"),
        (args.backend == "nccl" and not cuda_device_count, "--backend nccl needs CUDA, which is unavailable (or "
         "--no-cuda was given); use --backend gloo"),
        (ids and not 0 <= min(ids) <= max(ids) < cuda_device_count, f"device ids {ids} do not all exist: this node "
         f"has {cuda_device_count} CUDA devices; run fewer processes per node or pass valid --device-ids"),
        (args.backend == "nccl" and len(set(ids)) < len(ids), f"NCCL cannot run two processes on one GPU (device "
         f"ids {ids}); run one process per GPU, or use --backend gloo to share GPUs"),
        (args.device_ids and not cuda_device_count, "--device-ids was given but CUDA is unavailable (or --no-cuda "
         "was given); drop --device-ids"),
        (args.backend and not dist.is_backend_available(args.backend), f"this torch build has no '{args.backend}' "
         "backend; use --backend gloo"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(why)
    for option, package in (("capture_video", "moviepy"), ("track", "wandb")):
        try:
            if getattr(args, option):
                __import__(package)
        except ImportError:
            raise ConfigError(f"--{option.replace('_', '-')} needs {package}: pip install {package}") from None
    return choose_backend(args.backend, world_size, ids, dist.is_nccl_available())


def choose_backend(requested: Optional[str], world_size: int, cuda_ids: list, nccl_available: bool) -> tuple:
    """The process group's backend (None: one process needs no group), and a note when it is not the obvious one."""
    if world_size == 1:
        return None, None
    if requested or not cuda_ids:
        return requested or "gloo", None
    if len(set(cuda_ids)) < len(cuda_ids):
        return "gloo", f"processes share GPUs (device ids {cuda_ids}), which NCCL refuses: using gloo"
    if not nccl_available:
        return "gloo", "this torch build has no NCCL: using gloo"
    return "nccl", None


def select_device(args: Args, local_rank: int, cuda_device_count: int) -> torch.device:
    if not cuda_device_count:
        return torch.device("cpu")
    return torch.device("cuda", args.device_ids[local_rank] if args.device_ids else local_rank)


def check_bf16(precision: str, cuda_capability: Optional[tuple], cpu_bf16: bool) -> Optional[str]:
    """bf16 autocast is refused on GPUs older than compute capability 8.0 (Ampere). A CPU without native bf16
    (AVX-512 bf16 or AMX) runs it emulated, several times slower than fp32: it runs, with a note."""
    if precision == "bf16" and cuda_capability is not None and tuple(cuda_capability) < (8, 0):
        raise ConfigError(f"--precision bf16 needs a GPU of compute capability 8.0 or newer; this one has "
                          f"{'.'.join(map(str, cuda_capability))}: use --precision fp32")
    if precision == "bf16" and cuda_capability is None and not cpu_bf16:
        return ("this CPU has no native bf16 (no AVX-512 bf16, no AMX): --precision bf16 is emulated and much "
                "slower than fp32 here")
    return None


def agree_on_backend(store, backend: str, rank: int, world_size: int) -> None:
    """Through torchrun's store, before any collective: a node whose CUDA is broken would pick gloo while
    the others pick NCCL, and the job would hang in its first collective."""
    store.set(f"backend/{rank}", f"{backend} {socket.gethostname()}")
    choices = [store.get(f"backend/{r}").decode().split() for r in range(world_size)]
    for r, (other, host) in enumerate(choices):
        if other != choices[0][0]:
            raise ConfigError(f"the nodes chose different backends: rank {r} on {host} chose {other}, rank 0 on "
                              f"{choices[0][1]} chose {choices[0][0]} (is CUDA broken on {host}?); pass --backend")


def check_env_id(env_id: str) -> None:
    """Refuse ids that are unknown or not Atari (whose actions are all discrete), with a one-line reason."""
    try:
        spec = gym.spec(env_id)
    except gym.error.Error as e:
        raise ConfigError(f"unknown env id {env_id!r}: {str(e).splitlines()[0]}") from None
    if spec.entry_point != "ale_py.env:AtariEnv":  # checked without making it: other envs may need other packages
        raise ConfigError(f"{env_id} is not an Atari (ALE) environment; use e.g. BreakoutNoFrameskip-v4")


def run_id(args: Args) -> str:
    """The run's name without its start time: checkpoints of the same env, experiment and seed share it."""
    return f"{args.env_id}__{args.exp_name}__{args.seed}"


def resume_command(argv: list, world_size: int, local_world_size: int) -> str:
    """The command that continues this run: the same launch and arguments, with `--resume auto`."""
    args = [arg for i, arg in enumerate(argv[1:]) if not arg.startswith("--resume") and argv[i] != "--resume"]
    launch = ("python" if world_size == 1 else f"torchrun --standalone --nproc_per_node={world_size}"
              if local_world_size == world_size else "torchrun <this job's launch options>")
    return f"{launch} {shlex.join([argv[0], *args, '--resume', 'auto'])}"


def env_seeds(seed: int, first: int, count: int) -> list[int]:
    """Env seeds `first .. first + count - 1` of experiment `seed`. Each experiment seed owns its own block of
    ENV_SEEDS_PER_SEED (seed 1: 1, 2, 3, ...; seed s: from 1 + (s - 1) * 2^20; seed 0 the last block), so no two
    envs of a job, and no two experiment seeds, share one. ale-py's vector env takes int32 seeds: 2,048 blocks."""
    return [1 + (seed - 1) % MAX_SEEDS * ENV_SEEDS_PER_SEED + first + i for i in range(count)]


def all_gather(obj, world_size: int) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if world_size == 1:
        return [obj]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def print_banner(args: Args, sizes: BatchSizes, backend: Optional[str], device: torch.device, seeds: list, *,
                 rank: int, world_size: int, env_threads: int) -> None:
    """Rank 0 prints the versions, where each rank runs with which env seeds, and the derived sizes."""
    threads = f"{torch.get_num_threads()} torch threads" + (f", {env_threads} env threads" if env_threads else "")
    ranks = all_gather((rank, socket.gethostname(), str(device), threads, seeds), world_size)
    if rank != 0:
        return
    nccl = f" | NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}" if backend == "nccl" else ""
    print(f"torch {torch.__version__} | CUDA {torch.version.cuda or '-'}{nccl} | "
          f"backend {backend or '- (single process)'} | world size {world_size}")
    for r, host, dev, threads, s in ranks:
        print(f"rank {r}: host {host}, device {dev}, {threads}, env seeds {s[0]}..{s[-1]}")
    adam_steps = f"{'at most ' if args.target_kl else ''}{args.update_epochs * args.num_minibatches} Adam steps"
    print(f"experiment: {sizes.num_envs} envs x {args.num_steps} steps = batch {sizes.batch_size:,} | minibatch "
          f"{sizes.minibatch_size:,} | {adam_steps} per iteration ({args.update_epochs} epochs x "
          f"{args.num_minibatches} minibatches) | {sizes.num_iterations:,} iterations")
    print(f"split: {world_size} processes x {args.local_num_envs} envs | local batch {sizes.local_batch_size:,} | "
          f"local minibatch {sizes.local_minibatch_size:,}", flush=True)
    print(protocol(args.env_id), flush=True)


def sticky_actions(env_id: str) -> float:
    """The probability of repeating the previous action, as the id registers it: 0.25 for v5, 0 for v4 ids."""
    return gym.spec(env_id).kwargs.get("repeat_action_probability", 0.0)


def protocol(env_id: str) -> str:
    """The banner's line on the dynamics an id runs with."""
    frameskip, sticky = gym.spec(env_id).kwargs.get("frameskip", 1), sticky_actions(env_id)
    return (f"protocol: {env_id}, 4 frames per step (max-and-skip 4"
            + (f", in place of the id's frameskip {frameskip}" if frameskip != 1 else "") + "), "
            + (f"sticky actions {sticky} on every frame (Machado et al. 2018)" if sticky else
               "no sticky actions (the DeepMind protocol of the published PPO results)"))


def open_writer(args: Args, sizes: BatchSizes, run_name: str, world_size: int, global_step: int, continued: bool):
    """TensorBoard on global rank 0 (and Weights & Biases with --track, mirroring the same scalars)."""
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                   config=vars(args), name=run_name, id=run_name, resume="allow", save_code=True)
    from torch.utils.tensorboard import SummaryWriter

    # purge_step drops what an interrupted run logged after its last checkpoint: no duplicated steps.
    writer = SummaryWriter(f"runs/{run_name}", purge_step=global_step + 1 if continued else None)
    if not continued:
        table = {**asdict(args), **asdict(sizes), "world_size": world_size}
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in table.items()))
    return writer


def explained_variance(values: torch.Tensor, returns: torch.Tensor, world_size: int) -> float:
    """1 - Var(returns - values) / Var(returns) over the whole job's batch (population variances; nan when the
    returns do not vary), from one all-reduce of float64 sums."""
    y, error = returns.double(), (returns - values).double()
    sums = torch.stack([y.new_tensor(y.numel()), y.sum(), y.square().sum(), error.sum(), error.square().sum()])
    count, y_sum, y_squares, error_sum, error_squares = all_reduce_sum_(sums, world_size).tolist()
    var_y = y_squares / count - (y_sum / count) ** 2
    return np.nan if var_y <= 0 else 1 - (error_squares / count - (error_sum / count) ** 2) / var_y


class SectionTimer:
    """Sums the time spent in a code section; on CUDA it records events, so timing adds no host sync."""

    def __init__(self):
        self.seconds, self.events = 0.0, []

    @contextmanager
    def __call__(self, device: torch.device):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
        else:
            start_time = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - start_time

    def pop_seconds(self) -> float:
        """The total since the last call (waits for the GPU on CUDA), then starts again from zero."""
        total = self.seconds + sum(s.elapsed_time(e) for s, e in self.events) / 1000
        self.seconds, self.events = 0.0, []
        return total


ALLREDUCE_TIMER = SectionTimer()  # the gradient all-reduces (perf/allreduce_time)


def parameter_digest(tensors) -> str:
    """A short hash of the exact bytes of `tensors` (each in its logical order, of any dtype), to compare ranks."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def atomic_save(obj, path: Path) -> None:
    """Write to a temporary file in the same folder, flush it to disk, then rename it over `path`: a crash
    leaves the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(dir_fd)  # make the rename itself durable
    os.close(dir_fd)


def save_checkpoint(state: dict, directory: Path, keep: int) -> Path:
    path = directory / f"checkpoint_{state['global_step']:012d}.pt"
    atomic_save(state, path)
    for old in sorted(directory.glob("checkpoint_*.pt"))[:-keep]:
        old.unlink()
    return path


def latest_checkpoint(directory: Path) -> Optional[Path]:
    return max(directory.glob("checkpoint_*.pt"), default=None)  # zero-padded steps: the newest sorts last


def load_checkpoint(path: Path, required=("model", "args")) -> dict:
    """Load a checkpoint on the CPU as data only (torch's safe unpickler: tensors, dicts, lists, numbers,
    strings), refusing files that would run code, unreadable or incomplete ones with a one-line reason."""
    if not path.is_file():
        raise ConfigError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch reports truncation and corruption with several exception types
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        code = next((line for line in lines if "unsupported GLOBAL" in line), None)
        if code:  # the safe unpickler met something other than data
            raise ConfigError(f"checkpoint {path} is refused: it is not plain data, and unpickling it would run code "
                              f"({code}); checkpoints are loaded as data only") from None
        # The safe unpickler's own errors name what it met on their third line, after a preamble.
        reason = lines[2] if lines[0].startswith("Weights only load failed") and len(lines) > 2 else lines[0]
        raise ConfigError(f"checkpoint {path} is unreadable (truncated or corrupted?): {reason}") from None
    missing = [key for key in required if not isinstance(state, dict) or key not in state]
    if missing:
        raise ConfigError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
    return state


def load_resume_state(args: Args, checkpoint_dir: Path, rank: int, world_size: int) -> Optional[dict]:
    """Rank 0 reads and checks the checkpoint to resume; every rank gets the same state (or the same refusal).
    The state is the saved dict plus `path` and `notes` (the settings that changed). A fresh run never starts
    in a folder holding another run's checkpoints: its rotation would delete them."""
    verdict = [None]
    if rank == 0:
        try:
            latest, final = latest_checkpoint(checkpoint_dir), checkpoint_dir / "final_model.pt"
            if args.resume == "auto" and latest is None:
                print(f"note: --resume auto found no checkpoint in {checkpoint_dir}: starting a new run", flush=True)
            path = latest if args.resume == "auto" else Path(args.resume) if args.resume else None
            saved = path and load_checkpoint(path, required=("model", "optimizer", "iteration", "global_step", "args",
                                                             "world_size", "shared_rng", "run_name"))
            # A fork (another run's checkpoint, or another --exp-name or --seed) is a new run in a folder of its own.
            fork = bool(saved) and (path.resolve().parent != checkpoint_dir.resolve()
                                    or saved["run_name"].rsplit("__", 1)[0] != run_id(args))
            if (not saved or fork) and (latest or final.exists()):
                raise ConfigError(f"{checkpoint_dir} holds the checkpoints of an earlier run of this env, --exp-name "
                                  f"and --seed: " + (f"a fork of {path} needs a folder of its own" if fork else
                                  "continue it with --resume auto") + ", or name this run with another --exp-name")
            if saved:
                verdict = [{**saved, "path": path, "fork": fork, "notes": check_resume(saved, args, world_size)}]
                if not fork:
                    set_aside_newer(checkpoint_dir, path)
        except ConfigError as e:
            verdict = [e]
    if world_size > 1:
        dist.broadcast_object_list(verdict, src=0)
    if isinstance(verdict[0], ConfigError):
        raise verdict[0]
    return verdict[0]


def set_aside_newer(checkpoint_dir: Path, path: Path) -> None:
    """Resuming an older checkpoint of this folder abandons the newer ones: move them (and the final model) into
    a folder of their own, so that `--resume auto` continues the line resumed last."""
    newer = [p for p in checkpoint_dir.glob("checkpoint_*.pt") if p.name > path.name]
    if newer:
        aside = checkpoint_dir / f"abandoned_{int(time.time())}"
        aside.mkdir()
        for old in newer + [p for p in [checkpoint_dir / "final_model.pt"] if p.exists()]:
            old.rename(aside / old.name)
        print(f"note: {path.name} is older than the latest checkpoint: the {len(newer)} newer ones of the line it "
              f"abandons (and its final model, if any) are set aside in {aside}", flush=True)


def check_resume(saved: dict, args: Args, world_size: int) -> list:
    """Refuse a resume that cannot continue the same run; return notes on the settings that changed."""
    old = saved["args"]
    if old["env_id"] != args.env_id:
        raise ConfigError(f"cannot resume: the checkpoint trained {old['env_id']}, not {args.env_id}")
    old_envs, sizes = old["local_num_envs"] * saved["world_size"], batch_sizes(args, world_size)
    if old_envs * old["num_steps"] != sizes.batch_size:
        processes = f"{world_size} process{'es' if world_size > 1 else ''}"
        fix = (f"--local-num-envs {old_envs // world_size} keeps the job's {old_envs} envs on {processes}"
               if old_envs % world_size == 0 else f"no --local-num-envs keeps the job's {old_envs} envs on "
               f"{processes}: use a number of processes that divides {old_envs}")
        raise ConfigError(f"cannot resume: the checkpoint's global batch was {old_envs * old['num_steps']} transitions "
                          f"({old_envs} envs x {old['num_steps']} steps), this run's is {sizes.batch_size} "
                          f"({sizes.num_envs} x {args.num_steps}); {fix}"
                          + (f", with --num-steps {old['num_steps']}" if old["num_steps"] != args.num_steps else ""))
    # The split of the envs across processes is a speed setting: only the job's env count is part of the run.
    run_local = {"resume", "eval_checkpoint", "eval_episodes", "eval_final", "eval_protocol", "cost_per_hour",
                 "capture_video", "track", "checkpoint_interval_minutes", "checkpoint_keep", "device_ids", "backend",
                 "cuda", "vector_env", "local_num_envs"}
    notes = [f"{key} {old[key]} -> {value}" for key, value in asdict(args).items()
             if key not in run_local and key in old and old[key] != value]
    if old_envs != sizes.num_envs:
        notes.append(f"envs in the job {old_envs} -> {sizes.num_envs}")
    old_iterations = old["total_timesteps"] // sizes.batch_size
    if args.anneal_lr and old_iterations != sizes.num_iterations:
        iteration = saved["iteration"] + 1
        notes.append(f"the annealed learning rate follows the new total's schedule: at iteration {iteration} it is "
                     f"{get_lr(iteration, sizes.num_iterations, args.learning_rate, True):.4g}, not "
                     f"{get_lr(iteration, old_iterations, args.learning_rate, True):.4g}")
    old_vector_env = old.get("vector_env", "sync")
    if old_vector_env.startswith("ale") != args.vector_env.startswith("ale"):
        notes.append(f"vector_env {old_vector_env} -> {args.vector_env}: ale-py's resets differ from the Python "
                     f"stack's (see the README), another experiment")
    return notes


class Progress:
    """The loop's bookkeeping: where the run stands (step, last 100 games, time), the end-of-iteration
    agreement of the ranks, checkpoints, and the logs (TensorBoard and the console, on global rank 0)."""

    def __init__(self, args: Args, sizes: BatchSizes, groups: list, rank: int, world_size: int, checkpoint_dir: Path,
                 resumed: Optional[dict], shared_state: list, resume_hint: str):
        self.args, self.sizes, self.groups, self.rank, self.world_size = args, sizes, groups, rank, world_size
        self.resume_hint = resume_hint
        self.master, self.checkpoint_dir = rank == 0, checkpoint_dir
        self.start_iteration, self.global_step, self.elapsed_before = (
            (resumed["iteration"] + 1, resumed["global_step"], resumed["elapsed"]) if resumed else (1, 0, 0.0))
        continued = resumed is not None and not resumed["fork"]  # the same run: its name, events and W&B run
        self.run_name = resumed["run_name"] if continued else f"{run_id(args)}__{int(time.time())}"
        self.recent_returns = deque(resumed["recent_returns"] if resumed else [], maxlen=100)
        if resumed and self.master:
            print(f"resumed from {resumed['path']} at iteration {resumed['iteration']} (global step "
                  f"{self.global_step:,}), parameter digest {parameter_digest(shared_state)}", flush=True)
            if resumed["fork"]:
                print(f"forked from run {resumed['run_name']}: a new run, {self.run_name}", flush=True)
            for note in resumed["notes"]:
                print(f"note: resuming with a changed setting: {note}", flush=True)
        self.writer = (open_writer(args, sizes, self.run_name, world_size, self.global_step, continued)
                       if self.master else None)
        self.last_checkpoint_time, self.last_checkpoint = time.time(), latest_checkpoint(checkpoint_dir)
        self.start_time, self.start_step, self.last_print = time.time(), self.global_step, 0.0
        # SIGTERM / SIGINT / SIGUSR1 are caught from here on (before, they end a process with nothing to save): the
        # run stops after this iteration, on every rank, with a checkpoint. A process stuck in C++ (a collective
        # whose peer died) cannot run the handler: torchrun's SIGKILL, 30 s after its SIGTERM, ends it.
        self.signal_name = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, frame: setattr(self, "signal_name", signal.Signals(signum).name))

    def end_iteration(self, iteration: int, global_step: int, shared_state: list, checkpoint, finite: torch.Tensor,
                      episodes: list, epochs: int, losses: dict, learning_rate: float, rollout_time: float,
                      update_time: float) -> int:
        """One all-reduce decides for every rank whether to stop (a signal, on any rank, or a non-finite loss)
        and whether to checkpoint; then rank 0 logs every rank's games. Returns the exit code to stop with, or 0."""
        args = self.args
        checkpoint_due = (args.checkpoint_interval_minutes > 0
                          and time.time() - self.last_checkpoint_time >= 60 * args.checkpoint_interval_minutes)
        control = torch.tensor([self.signal_name is not None, checkpoint_due and self.master, not finite],
                               dtype=torch.int32, device=finite.device)
        if self.world_size > 1:
            dist.all_reduce(control, op=dist.ReduceOp.MAX)
        stop_now, checkpoint_now, non_finite = control.tolist()
        if non_finite:
            # The weights may already hold NaN: write nothing, so the last checkpoint stays the last good one.
            if self.master:
                print(f"error: non-finite loss or gradient at iteration {iteration} (global step {global_step:,}); "
                      f"stopping without writing a checkpoint. Last good checkpoint: {self.last_checkpoint or 'none'}",
                      file=sys.stderr, flush=True)
            return EXIT_NON_FINITE
        per_rank = all_gather((episodes, epochs), self.world_size)
        env_time, allreduce_time = sum(group.wait_seconds for group in self.groups), ALLREDUCE_TIMER.pop_seconds()
        for group in self.groups:
            group.wait_seconds = 0.0
        if self.master:  # every rank's finished games, then this iteration's scalars
            if len({e for _, e in per_rank}) > 1:
                raise RuntimeError(f"ranks ran different numbers of update epochs: {[e for _, e in per_rank]}")
            for step, episodic_return, episodic_length in sorted(game for games, _ in per_rank for game in games):
                self.writer.add_scalar("charts/episodic_return", episodic_return, step)
                self.writer.add_scalar("charts/episodic_length", episodic_length, step)
                self.recent_returns.append(episodic_return)
            sps = int((global_step - self.start_step) / (time.time() - self.start_time))
            for tag, value in {"charts/learning_rate": learning_rate, "charts/SPS": sps,
                               "perf/rollout_time": rollout_time, "perf/env_time": env_time,
                               "perf/update_time": update_time, "perf/allreduce_time": allreduce_time,
                               "charts/update_epochs": epochs,
                               **{f"losses/{name}": value for name, value in losses.items()}}.items():
                self.writer.add_scalar(tag, value, global_step)
            if time.time() - self.last_print >= 10 or iteration in (self.start_iteration, self.sizes.num_iterations):
                self.last_print = time.time()
                eta = ((self.last_print - self.start_time) / (iteration - self.start_iteration + 1)
                       * (self.sizes.num_iterations - iteration))
                mean_return = f"{np.mean(self.recent_returns):.1f}" if self.recent_returns else "-"
                print(f"iter {iteration}/{self.sizes.num_iterations} | step {global_step:,} | {sps:,} steps/s | "
                      f"return {mean_return} (last {len(self.recent_returns)}) | eta {timedelta(seconds=int(eta))}",
                      flush=True)
        # After this iteration's games and scalars: a checkpoint holds all that was logged up to its step.
        if (checkpoint_now or stop_now) and self.save(shared_state, checkpoint(iteration)):
            return EXIT_RANKS_DISAGREE
        if stop_now:
            if self.master:
                print(f"stopping on {self.signal_name or 'a signal to another rank'} after iteration "
                      f"{iteration}; resume with: {self.resume_hint}", flush=True)
            return EXIT_INTERRUPTED
        return 0

    def save(self, shared_state: list, state: dict, final: bool = False) -> int:
        """Check that every rank holds the same weights, then write the checkpoint (and the final model).
        Returns the exit code: 0, or EXIT_RANKS_DISAGREE with nothing written."""
        digests = all_gather(parameter_digest(shared_state), self.world_size)  # data parallelism needs equal weights
        differ = [r for r, digest in enumerate(digests) if digest != digests[0]]
        if differ:
            if self.master:
                print(f"error: processes {', '.join(map(str, differ))} hold parameters different from process 0's "
                      f"after iteration {state['iteration']} (digests {' '.join(digests)}); stopping without "
                      f"writing a checkpoint. Last good checkpoint: {self.last_checkpoint or 'none'}",
                      file=sys.stderr, flush=True)
            return EXIT_RANKS_DISAGREE
        if self.master:
            self.last_checkpoint = save_checkpoint(state, self.checkpoint_dir, self.args.checkpoint_keep)
            if final:
                atomic_save({"model": state["model"], "args": state["args"], "global_step": state["global_step"]},
                            self.checkpoint_dir / "final_model.pt")
                print("final parameter digest per rank: " + " ".join(f"{r}:{d}" for r, d in enumerate(digests)))
        self.last_checkpoint_time = time.time()
        return 0

    def finish(self, exit_code: int, global_step: int) -> None:
        """Rank 0 prints the run's summary and closes its logs."""
        if not self.master:
            return
        status = {0: "finished", EXIT_INTERRUPTED: "interrupted", EXIT_NON_FINITE: "stopped (non-finite)",
                  EXIT_RANKS_DISAGREE: "stopped (the processes' weights differ)"}[exit_code]
        wall, returns = self.elapsed_before + time.time() - self.start_time, self.recent_returns
        cost = f" | cost {self.args.cost_per_hour * wall / 3600:.2f}" if self.args.cost_per_hour is not None else ""
        print(f"summary: {status} | {global_step:,} / {self.sizes.num_iterations * self.sizes.batch_size:,} steps | "
              f"wall {timedelta(seconds=int(wall))} | {global_step / max(wall, 1e-9):,.0f} steps/s | return "
              f"{f'{np.mean(returns):.2f}' if returns else '-'} (last {len(returns)} games) | checkpoint "
              f"{self.last_checkpoint or 'none'}{cost}", flush=True)
        self.writer.close()
        if self.args.track:
            import wandb

            wandb.finish()


def eval_quotas(episodes: int, num_envs: int) -> list:
    """Games per env, summing to `episodes`: a fixed quota, as the first games to finish would favour short ones."""
    return [episodes // num_envs + (i < episodes % num_envs) for i in range(num_envs)]


def evaluate(model_path: str, episodes: int, num_envs: int, device: torch.device, seed: int,
             video_dir: Optional[str] = None, protocol: Optional[str] = None) -> list:
    """Play `episodes` full games with the saved policy (actions sampled from it) under the resets of `protocol`
    ("python" or "ale"; None: those it was trained with); print and return the returns."""
    state = load_checkpoint(Path(model_path))
    env_id, trained_on = state["args"]["env_id"], state["args"].get("vector_env", "sync")
    protocol = protocol or ("ale" if trained_on.startswith("ale") else "python")
    if protocol == "ale" and video_dir:
        raise ConfigError("--capture-video records the Python envs: evaluate with --eval-protocol python")
    envs = (AtariVectorGames(env_id, min(num_envs, episodes), len(os.sched_getaffinity(0))) if protocol == "ale"
            else make_vector_env(env_id, min(num_envs, episodes), video_dir))
    print(f"eval: {episodes} games of a policy trained with --vector-env {trained_on}, under the {protocol} resets "
          f"({'ale-py' if protocol == 'ale' else 'the Python stack'}'s; see the README)", flush=True)
    agent = Agent(envs.single_action_space.n).to(device, memory_format=torch.channels_last)
    agent.load_state_dict(state["model"])
    agent.eval()
    torch.manual_seed(seed)
    quota = eval_quotas(episodes, envs.num_envs)
    played, returns = [0] * envs.num_envs, []
    next_obs, _ = envs.reset(seed=[seed + i for i in range(envs.num_envs)])
    with torch.no_grad():
        while len(returns) < episodes:
            action, _, _, _ = agent.get_action_and_value(torch.as_tensor(next_obs, device=device))
            next_obs, _, _, _, infos = envs.step(action.cpu().numpy())
            if "final_info" in infos and "episode" in infos["final_info"]:
                for i in np.flatnonzero(infos["final_info"]["_episode"]):
                    if played[i] < quota[i]:
                        played[i] += 1
                        returns.append(float(infos["final_info"]["episode"]["r"][i]))
                        print(f"eval episode {len(returns)}/{episodes}: return {returns[-1]:.1f}", flush=True)
    envs.close()
    print(f"eval {env_id} ({model_path}): {np.mean(returns):.2f} +- {np.std(returns):.2f} over {episodes} games",
          flush=True)
    return returns


if __name__ == "__main__":
    main()
