"""Data-parallel PPO for Atari in one file: every process steps its own envs, gradients are averaged.

One GPU (or a CPU-only machine, gloo on the CPU):
    python ppo_atari_multigpu.py --env-id BreakoutNoFrameskip-v4

One node, 8 GPUs (one process per GPU, NCCL):
    torchrun --standalone --nnodes=1 --nproc_per_node=8 ppo_atari_multigpu.py --env-id BreakoutNoFrameskip-v4

Two nodes with 8 GPUs each (run on every node, with its own --node-rank):
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=8 --master-addr=10.0.0.1 --master-port=29500 \
        ppo_atari_multigpu.py --env-id BreakoutNoFrameskip-v4

Preemptible machines: let torchrun restart the group and continue from the latest checkpoint:
    torchrun --standalone --nproc_per_node=8 --max-restarts=3 ppo_atari_multigpu.py --resume auto

Evaluate a saved policy:
    python ppo_atari_multigpu.py --eval-checkpoint checkpoints/<env_id>__<exp_name>__<seed>/final_model.pt

The global batch is world_size * local_num_envs * num_steps: adding processes adds environments,
so a run with N processes does the same number of updates on N times as much data per update.
"""

import hashlib
import os
import random
import signal
import socket
import sys
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass
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
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment: network init, action sampling and env seeds all derive from it"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True` (and no cuDNN autotuning)"""
    cuda: bool = True
    """if toggled, use CUDA when it is available"""
    device_ids: tuple[int, ...] = ()
    """one CUDA device id per local process; empty means cuda:<LOCAL_RANK>"""
    backend: Optional[Literal["gloo", "nccl", "mpi"]] = None
    """torch.distributed backend; None picks nccl on GPUs and gloo on the CPU"""
    capture_video: bool = False
    """whether to record videos of one env of global rank 0 (to `videos/<run_name>`)"""

    # Algorithm specific arguments
    env_id: str = "BreakoutNoFrameskip-v4"
    """the id of the Atari environment"""
    total_timesteps: int = 10_000_000
    """total agent steps of the experiment, summed over all processes"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    local_num_envs: int = 8
    """the number of parallel environments in each process"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing (linear, to zero at the last iteration)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches per epoch (each process takes 1/num_minibatches of its local batch)"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """toggles advantages normalization (per minibatch)"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function, as per the paper"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: Optional[float] = None
    """the target KL divergence threshold: stop the update epochs early when the mean KL over ranks exceeds it"""

    # Speed: how the same algorithm is computed
    vector_env: Literal["sync", "async"] = "sync"
    """step the envs in this process (sync) or each in its own subprocess (async: uses more cores)"""
    precision: Literal["fp32", "bf16"] = "fp32"
    """network forward/backward in fp32, or under bf16 autocast (weights, optimiser, losses stay fp32)"""

    # Long runs: checkpoints, resume, evaluation
    checkpoint_interval_minutes: float = 5.0
    """minutes between checkpoints in `checkpoints/<env_id>__<exp_name>__<seed>` (0: only at the end)"""
    checkpoint_keep: int = 3
    """how many of the most recent checkpoints to keep"""
    resume: Optional[str] = None
    """a checkpoint to continue from, or `auto`: the latest checkpoint of this run, if there is one"""
    eval_checkpoint: Optional[str] = None
    """evaluate this checkpoint (or final model) instead of training"""
    eval_episodes: int = 10
    """number of full games to play when evaluating"""
    eval_final: bool = False
    """after training, play eval_episodes games with the final model (global rank 0)"""
    cost_per_hour: Optional[float] = None
    """price per hour of the whole job, to report the run's cost in the summary"""


class ConfigError(Exception):
    """A setting that cannot work; reported as one line, before any process waits on another."""


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
    local_batch_size = args.local_num_envs * args.num_steps
    batch_size = num_envs * args.num_steps
    return BatchSizes(
        num_envs=num_envs,
        local_batch_size=local_batch_size,
        local_minibatch_size=local_batch_size // args.num_minibatches,
        batch_size=batch_size,
        minibatch_size=batch_size // args.num_minibatches,
        num_iterations=args.total_timesteps // batch_size,
    )


def check_args(args: Args, world_size: int, local_world_size: int, cuda_device_count: int) -> str:
    """Refuse settings that cannot work; return the backend to use. `cuda_device_count` is 0 without CUDA."""
    for name in ("total_timesteps", "local_num_envs", "num_steps", "num_minibatches", "update_epochs"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.eval_episodes <= 0 or args.checkpoint_keep <= 0 or args.checkpoint_interval_minutes < 0:
        raise ConfigError("--eval-episodes and --checkpoint-keep must be positive, "
                          "--checkpoint-interval-minutes at least 0")
    if args.eval_checkpoint and world_size > 1:
        raise ConfigError("--eval-checkpoint runs in one process: start it with python, not torchrun")
    for name in ("learning_rate", "clip_coef", "max_grad_norm"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("gamma", "gae_lambda"):
        if not 0 <= getattr(args, name) <= 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    sizes = batch_sizes(args, world_size)
    if sizes.local_batch_size % args.num_minibatches:
        raise ConfigError(
            f"the local batch (local_num_envs * num_steps = {sizes.local_batch_size}) is not divisible by "
            f"--num-minibatches {args.num_minibatches}; pick sizes that divide evenly"
        )
    if sizes.num_iterations == 0:
        raise ConfigError(
            f"--total-timesteps {args.total_timesteps} is smaller than one global batch ({sizes.batch_size} = "
            f"{world_size} processes x {args.local_num_envs} envs x {args.num_steps} steps): the run would train "
            f"nothing; raise --total-timesteps or shrink the batch"
        )
    if args.device_ids and len(args.device_ids) != local_world_size:
        raise ConfigError(
            f"--device-ids names {len(args.device_ids)} devices but this node runs {local_world_size} processes; "
            f"give exactly one id per local process"
        )
    backend = args.backend or ("nccl" if cuda_device_count else "gloo")
    if backend == "nccl" and not cuda_device_count:
        raise ConfigError("--backend nccl needs CUDA, which is unavailable (or --no-cuda was given); use --backend gloo")
    if cuda_device_count:
        ids = list(args.device_ids) or list(range(local_world_size))
        if max(ids) >= cuda_device_count or min(ids) < 0:
            raise ConfigError(
                f"device ids {ids} do not all exist: this node has {cuda_device_count} CUDA devices; "
                f"run at most {cuda_device_count} processes per node or pass valid --device-ids"
            )
        if backend == "nccl" and len(set(ids)) < len(ids):
            raise ConfigError(
                f"NCCL cannot run two processes on one GPU (device ids {ids}); "
                f"run one process per GPU, or use --backend gloo to share GPUs"
            )
    elif args.device_ids:
        raise ConfigError("--device-ids was given but CUDA is unavailable (or --no-cuda was given); drop --device-ids")
    if not dist.is_backend_available(backend):
        raise ConfigError(f"this torch build has no '{backend}' backend; use --backend gloo")
    return backend


# ---------------------------------------------------------------------------------------------------
# Environment: the DeepMind Atari preprocessing. gymnasium 1.x has max-and-skip, resize and frame
# stacking; noop reset, episodic life and fire reset are written here.
# ---------------------------------------------------------------------------------------------------
class NoopReset(gym.Wrapper):
    """After a reset, play a random number (1..noop_max) of no-ops so that episodes start in different states."""

    def __init__(self, env: gym.Env, noop_max: int = 30):
        super().__init__(env)
        assert env.unwrapped.get_action_meanings()[0] == "NOOP"
        self.noop_max = noop_max

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        for _ in range(self.unwrapped.np_random.integers(1, self.noop_max + 1)):
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


class EpisodicLife(gym.Wrapper):
    """End the learning episode when a life is lost, but restart the game only when it is really over.

    On a life loss `step` reports terminated=True; the vector env then calls `reset`, which continues the
    same game with one no-op instead of restarting the emulator.
    """

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.lives = 0
        self.game_over = True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = terminated or truncated
        lives = self.unwrapped.ale.lives()
        if 0 < lives < self.lives:
            terminated = True
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs):
        if self.game_over:
            obs, info = self.env.reset(**kwargs)
        else:
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset()
        self.game_over = False
        self.lives = self.unwrapped.ale.lives()
        return obs, info


class FireReset(gym.Wrapper):
    """Press FIRE, then action 2, after every reset (including after a lost life): some games wait for it."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        assert env.unwrapped.get_action_meanings()[1] == "FIRE"

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


def check_env_id(env_id: str) -> None:
    """Refuse ids that are unknown, not Atari, or not discrete, with a one-line reason."""
    try:
        spec = gym.spec(env_id)
    except gym.error.Error as e:
        raise ConfigError(f"unknown env id {env_id!r}: {str(e).splitlines()[0]}") from None
    if spec.entry_point != "ale_py.env:AtariEnv":
        env = gym.make(env_id)
        action_space = env.action_space
        env.close()
        if not isinstance(action_space, gym.spaces.Discrete):
            raise ConfigError(f"{env_id} has a non-discrete action space ({action_space}); PPO here needs Discrete")
        raise ConfigError(f"{env_id} is not an Atari (ALE) environment; use e.g. BreakoutNoFrameskip-v4")


def classic_settings_note(env_id: str) -> Optional[str]:
    """Ids that skip frames or repeat actions themselves are run with the classic settings; say so."""
    kwargs = gym.spec(env_id).kwargs
    if kwargs.get("frameskip", 1) != 1 or kwargs.get("repeat_action_probability", 0.0) != 0.0:
        return (
            f"note: {env_id} registers frameskip={kwargs.get('frameskip')} and sticky actions "
            f"{kwargs.get('repeat_action_probability')}; running it with the classic settings instead "
            f"(frameskip 1 + max-and-skip 4, no sticky actions), as BreakoutNoFrameskip-v4 style ids do"
        )
    return None


def make_env(env_id: str, record_video_dir: Optional[str] = None):
    def thunk():
        env = gym.make(
            env_id,
            obs_type="grayscale",  # ALE's own luminance, taken before the max over frames (as gymnasium's AtariPreprocessing)
            frameskip=1,
            repeat_action_probability=0.0,
            render_mode="rgb_array" if record_video_dir else None,
        )
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
        env = gym.wrappers.FrameStackObservation(env, 4)
        return env

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

    def hidden(self, obs: torch.Tensor) -> torch.Tensor:
        """`obs` is the uint8 frame stack; scaling to [0, 1] happens here so rollouts store bytes."""
        # Channels-last convolutions; the layout change is cheapest on the uint8 bytes, before the float cast.
        x = obs.contiguous(memory_format=torch.channels_last).to(torch.float32).div_(255.0)
        return self.network(x)

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.hidden(obs)).float()

    def get_action_and_value(self, obs: torch.Tensor, action: Optional[torch.Tensor] = None):
        hidden = self.hidden(obs)
        probs = Categorical(logits=self.actor(hidden).float(), validate_args=False)  # validation syncs on GPU
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden).float()


# ---------------------------------------------------------------------------------------------------
# Algorithm pieces that the tests reach directly.
# ---------------------------------------------------------------------------------------------------
def compute_advantages(rewards, values, dones, next_value, next_done, gamma: float, gae_lambda: float):
    """GAE(lambda) over a rollout of shape (num_steps, num_envs); returns (advantages, returns).

    `dones[t]` is 1 when observation t starts a new episode (the transition before it ended one);
    `next_value` / `next_done` describe the observation after the last step.
    """
    next_values = torch.cat([values[1:], next_value.unsqueeze(0)])
    next_nonterminal = 1.0 - torch.cat([dones[1:], next_done.unsqueeze(0)])
    deltas = rewards + gamma * next_values * next_nonterminal - values
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        last_gae = deltas[t] + gamma * gae_lambda * next_nonterminal[t] * last_gae
        advantages[t] = last_gae
    return advantages, advantages + values


def flat_gradient_buffer(model: nn.Module) -> torch.Tensor:
    """Make every parameter's .grad a view into one flat tensor, so the all-reduce needs no copies.

    Each view keeps its parameter's strides (channels_last convolutions), as autograd expects.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat.as_strided(p.shape, p.stride(), offset)
        offset += p.numel()
    return flat


def all_reduce_mean_(flat_grad: torch.Tensor, world_size: int) -> None:
    """One all-reduce for the whole model: every rank ends with the mean of the ranks' gradients."""
    if world_size > 1:
        dist.all_reduce(flat_grad, op=dist.ReduceOp.SUM)
        flat_grad.div_(world_size)


def parameter_digest(model: nn.Module) -> str:
    """A short hash of the exact parameter bytes, to compare ranks."""
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def env_seeds(seed: int, rank: int, local_num_envs: int) -> list[int]:
    """Seeds of this rank's envs: consecutive blocks per global rank, so no two envs of a job share one."""
    return [seed + rank * local_num_envs + i for i in range(local_num_envs)]


class SectionTimer:
    """Sums the time spent in a code section; on CUDA it records events, so timing adds no host sync."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds_on_host = 0.0
        self.cuda_events = []

    @contextmanager
    def __call__(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.cuda_events.append((start, end))
        else:
            start_time = time.perf_counter()
            yield
            self.seconds_on_host += time.perf_counter() - start_time

    def pop_seconds(self) -> float:
        """The total since the last call (waits for the GPU on CUDA), then starts again from zero."""
        total = self.seconds_on_host + sum(s.elapsed_time(e) for s, e in self.cuda_events) / 1000
        self.seconds_on_host, self.cuda_events = 0.0, []
        return total


# ---------------------------------------------------------------------------------------------------
# Checkpoints: written by global rank 0, atomically, so a crash leaves the old file or the new one.
# ---------------------------------------------------------------------------------------------------
EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, EXIT_NON_FINITE = 2, 3, 4


def atomic_save(obj, path: Path) -> None:
    """Write to a temporary file in the same folder, flush it to disk, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def save_checkpoint(state: dict, directory: Path, keep: int) -> Path:
    path = directory / f"checkpoint_{state['global_step']:012d}.pt"
    atomic_save(state, path)
    for old in sorted(directory.glob("checkpoint_*.pt"))[:-keep]:
        old.unlink()
    return path


def latest_checkpoint(directory: Path) -> Optional[Path]:
    checkpoints = sorted(directory.glob("checkpoint_*.pt"))
    return checkpoints[-1] if checkpoints else None


def load_checkpoint(path: Path, required=("model", "args")) -> dict:
    """Load a checkpoint on the CPU, refusing unreadable or incomplete files with a one-line reason."""
    if not path.is_file():
        raise ConfigError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch reports truncation and corruption with several exception types
        raise ConfigError(f"checkpoint {path} is unreadable (truncated or corrupted?): {str(e).splitlines()[0]}") from None
    missing = [key for key in required if not isinstance(state, dict) or key not in state]
    if missing:
        raise ConfigError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
    return state


def check_resume(saved: dict, args: Args, world_size: int) -> list:
    """Refuse a resume that cannot continue the same run; return notes on the settings that changed."""
    old = saved["args"]
    if old["env_id"] != args.env_id:
        raise ConfigError(f"cannot resume: the checkpoint trained {old['env_id']}, not {args.env_id}")
    old_batch = old["local_num_envs"] * old["num_steps"] * saved["world_size"]
    new_batch = batch_sizes(args, world_size).batch_size
    if old_batch != new_batch:
        raise ConfigError(f"cannot resume: the checkpoint's global batch was {old_batch} transitions, this run's is "
                          f"{new_batch}; keep processes x local_num_envs x num_steps the same")
    run_local = {"resume", "eval_checkpoint", "eval_episodes", "eval_final", "cost_per_hour", "capture_video",
                 "checkpoint_interval_minutes", "checkpoint_keep", "device_ids", "backend", "cuda", "vector_env"}
    notes = [f"{key} {old[key]} -> {value}" for key, value in asdict(args).items()
             if key not in run_local and key in old and old[key] != value]
    if saved["world_size"] != world_size:
        notes.append(f"world size {saved['world_size']} -> {world_size} (action sampling reseeded)")
    return notes


def rng_state(device: torch.device) -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    """Records SIGTERM / SIGINT / SIGUSR1; training stops at the end of the iteration, on every rank, after a
    checkpoint. A process stuck in C++ (a collective whose peer died) cannot run this handler: torchrun's
    SIGKILL, 30 s after its SIGTERM, ends it."""

    def __init__(self):
        self.signal_name = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name


# ---------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------
def evaluate(model_path: str, episodes: int, num_envs: int, device: torch.device, seed: int,
             video_dir: Optional[str] = None) -> list:
    """Play `episodes` full games with the saved policy (actions sampled from it); print and return the returns."""
    state = load_checkpoint(Path(model_path))
    env_id = state["args"]["env_id"]
    envs = make_vector_env(env_id, min(num_envs, episodes), video_dir)
    agent = Agent(envs.single_action_space.n).to(device, memory_format=torch.channels_last)
    agent.load_state_dict(state["model"])
    agent.eval()
    torch.manual_seed(seed)
    # A fixed quota of games per env: taking the first N games to finish would favour short games.
    quota = [episodes // envs.num_envs + (i < episodes % envs.num_envs) for i in range(envs.num_envs)]
    played = [0] * envs.num_envs
    returns = []
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


def report_error(message: str, local_rank: int) -> None:
    if local_rank == 0:  # one line per node; every rank exits non-zero
        print(f"{os.path.basename(__file__)}: error: {message}", file=sys.stderr, flush=True)


def main() -> None:
    args = tyro.cli(Args)
    # Set by torchrun; a plain `python` launch is a job of one process.
    RANK = int(os.environ.get("RANK", 0))
    LOCAL_RANK = int(os.environ.get("LOCAL_RANK", 0))
    WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))
    LOCAL_WORLD_SIZE = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    distributed = "WORLD_SIZE" in os.environ
    master_process = RANK == 0

    # Every check that can fail runs before the process group exists: a rank that refuses its settings
    # exits at once, and no rank is left waiting for it in a collective.
    try:
        cuda_device_count = torch.cuda.device_count() if args.cuda and torch.cuda.is_available() else 0
        backend = check_args(args, WORLD_SIZE, LOCAL_WORLD_SIZE, cuda_device_count)
        if args.capture_video:
            _require_moviepy()
        if args.eval_checkpoint:
            device = torch.device("cuda" if cuda_device_count else "cpu")
            evaluate(args.eval_checkpoint, args.eval_episodes, args.local_num_envs, device, args.seed,
                     f"videos/eval__{Path(args.eval_checkpoint).stem}" if args.capture_video else None)
            return
        check_env_id(args.env_id)
    except ConfigError as e:
        report_error(str(e), LOCAL_RANK)
        sys.exit(EXIT_CONFIG_ERROR)

    sizes = batch_sizes(args, WORLD_SIZE)
    run_id = f"{args.env_id}__{args.exp_name}__{args.seed}"
    run_name = f"{run_id}__{int(time.time())}"
    # Envs (and their subprocesses, with --vector-env async) start before the process group's threads.
    # Async env workers inherit an ignored SIGINT: Ctrl-C then reaches the training process alone, which
    # stops cleanly, instead of killing the env workers under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    envs = make_vector_env(args.env_id, args.local_num_envs,
                           f"videos/{run_name}" if args.capture_video and master_process else None, args.vector_env)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    if cuda_device_count:
        device = torch.device("cuda", args.device_ids[LOCAL_RANK] if args.device_ids else LOCAL_RANK)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if distributed:
        # torchrun keeps one store across elastic restarts: key each attempt apart, or a restarted rank can
        # read the dead attempt's addresses (gloo then fails with "Connection refused").
        store, _, _ = next(dist.rendezvous("env://"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store), rank=RANK,
                                world_size=WORLD_SIZE)
    try:
        exit_code = train(args, sizes, envs, run_id, run_name, device, backend, RANK, WORLD_SIZE, master_process)
    except ConfigError as e:  # a refused resume: every rank received the same verdict from rank 0
        report_error(str(e), LOCAL_RANK)
        exit_code = EXIT_CONFIG_ERROR
    finally:
        envs.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    # Every rank knows its exit code. When a peer exits first with a non-zero one, torchrun sends SIGTERM to the
    # rest; Python restores the default handlers while it shuts down, so that signal would replace our code.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(exit_code)


def train(args: Args, sizes: BatchSizes, envs: gym.vector.VectorEnv, run_id: str, run_name: str,
          device: torch.device, backend: str, rank: int, world_size: int, master_process: bool) -> int:
    """The training loop; returns the process exit code (0 finished, 3 interrupted, 4 non-finite)."""
    checkpoint_dir = Path("checkpoints") / run_id

    # ---- Resume: rank 0 reads and checks the checkpoint, every rank gets the same state (or refusal) ----
    resumed = None
    if args.resume:
        verdict = [None]
        if master_process:
            try:
                path = latest_checkpoint(checkpoint_dir) if args.resume == "auto" else Path(args.resume)
                if path is not None:
                    saved = load_checkpoint(path, required=("model", "optimizer", "iteration", "global_step",
                                                            "args", "world_size", "rng", "run_name"))
                    verdict = [(path, saved, check_resume(saved, args, world_size))]
            except ConfigError as e:
                verdict = [e]
        if world_size > 1:
            dist.broadcast_object_list(verdict, src=0)
        if isinstance(verdict[0], ConfigError):
            raise verdict[0]
        resumed = verdict[0]

    # A resumed run gets fresh env seeds, still distinct across the job.
    seed_offset = resumed[1]["iteration"] * sizes.num_envs if resumed else 0
    seeds = env_seeds(args.seed + seed_offset, rank, args.local_num_envs)
    this_rank = (rank, socket.gethostname(), str(device), seeds)
    ranks = [this_rank]
    if world_size > 1:
        ranks = [None] * world_size
        dist.all_gather_object(ranks, this_rank)
    if master_process:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
        print(f"torch {torch.__version__} | CUDA {torch.version.cuda or '-'} | NCCL {nccl} | "
              f"backend {backend if world_size > 1 else '- (single process)'} | world size {world_size}")
        for r, host, dev, s in ranks:
            print(f"rank {r}: host {host}, device {dev}, env seeds {s[0]}..{s[-1]}")
        print(f"num_envs {sizes.num_envs} ({world_size} x {args.local_num_envs}) | batch {sizes.batch_size} "
              f"(local {sizes.local_batch_size}) | minibatch {sizes.minibatch_size} "
              f"(local {sizes.local_minibatch_size}) | iterations {sizes.num_iterations}", flush=True)
        note = classic_settings_note(args.env_id)
        if note:
            print(note, flush=True)

    # Same seed on every rank: identical initial weights (and a broadcast to be sure across machines).
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.backends.cudnn.benchmark = not args.torch_deterministic

    agent = Agent(envs.single_action_space.n).to(device, memory_format=torch.channels_last)
    if world_size > 1:
        for p in agent.parameters():
            dist.broadcast(p.data, src=0)
    flat_grad = flat_gradient_buffer(agent)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    # From here on the ranks differ: each samples its own actions.
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    start_iteration, global_step, elapsed_before = 1, 0, 0.0
    recent_returns = deque(maxlen=100)
    if resumed:
        path, saved, notes = resumed
        agent.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start_iteration, global_step = saved["iteration"] + 1, saved["global_step"]
        elapsed_before, run_name = saved["elapsed"], saved["run_name"]
        recent_returns.extend(saved["recent_returns"])
        if saved["world_size"] == world_size:
            set_rng_state(saved["rng"][rank], device)
        else:
            torch.manual_seed(args.seed + rank + saved["iteration"] * world_size)
        if master_process:
            print(f"resumed from {path} at iteration {saved['iteration']} (global step {global_step:,}), "
                  f"parameter digest {parameter_digest(agent)}", flush=True)
            for note in notes:
                print(f"note: resuming with a changed setting: {note}", flush=True)

    writer = None
    if master_process:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops what an interrupted run logged after its last checkpoint: no duplicated steps.
        writer = SummaryWriter(f"runs/{run_name}", purge_step=global_step + 1 if resumed else None)
        if not resumed:
            writer.add_text(
                "hyperparameters",
                "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in {**asdict(args), **asdict(sizes),
                                                                              "world_size": world_size}.items()),
            )

    # Rollout storage; observations stay uint8 (the network scales them).
    obs = torch.zeros((args.num_steps, args.local_num_envs) + envs.single_observation_space.shape,
                      dtype=torch.uint8, device=device)
    actions = torch.zeros((args.num_steps, args.local_num_envs), dtype=torch.long, device=device)
    logprobs = torch.zeros((args.num_steps, args.local_num_envs), device=device)
    rewards = torch.zeros((args.num_steps, args.local_num_envs), device=device)
    dones = torch.zeros((args.num_steps, args.local_num_envs), device=device)
    values = torch.zeros((args.num_steps, args.local_num_envs), device=device)

    env_timer, allreduce_timer = SectionTimer(torch.device("cpu")), SectionTimer(device)
    start_time = time.time()
    start_step = global_step
    last_print, last_checkpoint_time = 0.0, time.time()
    last_checkpoint = latest_checkpoint(checkpoint_dir)
    exit_code = 0
    next_obs_np, _ = envs.reset(seed=seeds)
    next_obs = torch.as_tensor(next_obs_np, device=device)
    next_done = torch.zeros(args.local_num_envs, device=device)

    def checkpoint_state(iteration: int) -> Optional[dict]:
        """Everything needed to continue; a collective (every rank's RNG state), complete on rank 0 only."""
        this_rng = rng_state(device)
        rng = [this_rng]
        if world_size > 1:
            rng = [None] * world_size if master_process else None
            dist.gather_object(this_rng, rng, dst=0)
        if not master_process:
            return None
        return {"model": agent.state_dict(), "optimizer": optimizer.state_dict(), "iteration": iteration,
                "global_step": global_step, "args": asdict(args), "world_size": world_size, "rng": rng,
                "run_name": run_name, "elapsed": elapsed_before + time.time() - start_time,
                "recent_returns": list(recent_returns)}

    # Signals are caught from here on; before, they end a process that has nothing to save yet.
    stop = StopRequest()
    iteration = start_iteration - 1
    for iteration in range(start_iteration, sizes.num_iterations + 1):
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / sizes.num_iterations
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        # ---- Rollout: num_steps steps in each of this rank's envs ----
        rollout_start = time.perf_counter()
        episodes = []  # (global_step, return, length) of games that ended on this rank
        # One autocast region for the whole rollout: under bf16 the weights are cast once, not at every step.
        with torch.no_grad(), autocast():
            for step in range(args.num_steps):
                global_step += sizes.num_envs
                obs[step] = next_obs
                dones[step] = next_done
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
                actions[step] = action
                logprobs[step] = logprob

                with env_timer():
                    next_obs_np, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
                # A time-limit truncation is not a real end: bootstrap from the value of the final observation.
                truncated_only = truncations & ~terminations
                if truncated_only.any():
                    final_obs = torch.as_tensor(np.stack(infos["final_obs"][truncated_only]), device=device)
                    reward[truncated_only] += args.gamma * agent.get_value(final_obs).flatten().cpu().numpy()
                rewards[step] = torch.as_tensor(reward, device=device)
                next_obs = torch.as_tensor(next_obs_np, device=device)
                next_done = torch.as_tensor(terminations | truncations, dtype=torch.float32, device=device)
                if "final_info" in infos and "episode" in infos["final_info"]:
                    finished = infos["final_info"]["_episode"]
                    for r, l in zip(infos["final_info"]["episode"]["r"][finished],
                                    infos["final_info"]["episode"]["l"][finished]):
                        episodes.append((global_step, float(r), int(l)))

        rollout_time = time.perf_counter() - rollout_start

        # ---- Advantages ----
        with torch.no_grad(), autocast():
            next_value = agent.get_value(next_obs).flatten()
            advantages, returns = compute_advantages(rewards, values, dones, next_value, next_done,
                                                     args.gamma, args.gae_lambda)

        b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        # ---- Update: update_epochs passes over the local batch; gradients averaged over all ranks ----
        update_start = time.perf_counter()
        stats = torch.zeros(6, device=device)  # pg, v, entropy, old kl, kl, clipfrac summed over minibatches
        num_updates = 0
        finite = torch.ones((), dtype=torch.bool, device=device)
        for epoch in range(args.update_epochs):
            b_inds = torch.randperm(sizes.local_batch_size, device=device)
            for start in range(0, sizes.local_batch_size, sizes.local_minibatch_size):
                mb_inds = b_inds[start : start + sizes.local_minibatch_size]
                with autocast():
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()
                with torch.no_grad():
                    old_approx_kl = (-logratio).mean()
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()

                mb_advantages = b_advantages[mb_inds]
                if args.norm_adv:
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

                # Policy loss
                pg_loss1 = -mb_advantages * ratio
                pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                pg_loss = torch.max(pg_loss1, pg_loss2).mean()

                # Value loss
                newvalue = newvalue.view(-1)
                if args.clip_vloss:
                    v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                    v_clipped = b_values[mb_inds] + torch.clamp(
                        newvalue - b_values[mb_inds], -args.clip_coef, args.clip_coef
                    )
                    v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                    v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
                else:
                    v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()

                entropy_loss = entropy.mean()
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

                flat_grad.zero_()
                loss.backward()
                with allreduce_timer():
                    all_reduce_mean_(flat_grad, world_size)
                grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
                finite &= torch.isfinite(loss) & torch.isfinite(grad_norm)  # checked once per iteration
                stats += torch.stack([pg_loss.detach(), v_loss.detach(), entropy_loss.detach(),
                                      old_approx_kl, approx_kl, clipfrac])
                num_updates += 1

            if args.target_kl is not None:
                # Decided on the mean over ranks, so every rank leaves the epoch loop together.
                mean_kl = approx_kl.clone()
                all_reduce_mean_(mean_kl, world_size)
                if mean_kl.item() > args.target_kl:
                    break

        if device.type == "cuda":
            torch.cuda.synchronize(device)
        update_time = time.perf_counter() - update_start
        env_time, allreduce_time = env_timer.pop_seconds(), allreduce_timer.pop_seconds()

        # ---- Bookkeeping: agree on stopping / checkpointing, gather finished games, log on rank 0 ----
        checkpoint_due = (args.checkpoint_interval_minutes > 0
                          and time.time() - last_checkpoint_time >= 60 * args.checkpoint_interval_minutes)
        control = torch.tensor([stop.signal_name is not None, checkpoint_due and master_process, not finite],
                               dtype=torch.int32, device=device)
        if world_size > 1:
            dist.all_reduce(control, op=dist.ReduceOp.MAX)
        stop_now, checkpoint_now, non_finite = control.tolist()
        if non_finite:
            # The weights may already hold NaN: write nothing, so the last checkpoint stays the last good one.
            if master_process:
                print(f"error: non-finite loss or gradient at iteration {iteration} (global step {global_step:,}); "
                      f"stopping without writing a checkpoint. Last good checkpoint: {last_checkpoint or 'none'}",
                      file=sys.stderr, flush=True)
            exit_code = EXIT_NON_FINITE
            break
        if world_size > 1:
            gathered = [None] * world_size if master_process else None
            dist.gather_object(episodes, gathered, dst=0)
            episodes = [e for rank_episodes in gathered for e in rank_episodes] if master_process else []
        if checkpoint_now or stop_now:
            state = checkpoint_state(iteration)
            if master_process:
                last_checkpoint = save_checkpoint(state, checkpoint_dir, args.checkpoint_keep)
            last_checkpoint_time = time.time()
        if master_process:
            for step_at_end, episodic_return, episodic_length in sorted(episodes):
                writer.add_scalar("charts/episodic_return", episodic_return, step_at_end)
                writer.add_scalar("charts/episodic_length", episodic_length, step_at_end)
                recent_returns.append(episodic_return)
            pg, v, ent, old_kl, kl, clipfrac_mean = (stats / num_updates).tolist()
            y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
            var_y = np.var(y_true)
            explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
            sps = int((global_step - start_step) / (time.time() - start_time))
            metrics = {
                "charts/learning_rate": optimizer.param_groups[0]["lr"], "charts/SPS": sps,
                "losses/value_loss": v, "losses/policy_loss": pg, "losses/entropy": ent,
                "losses/old_approx_kl": old_kl, "losses/approx_kl": kl, "losses/clipfrac": clipfrac_mean,
                "losses/explained_variance": explained_var,
                "perf/rollout_time": rollout_time, "perf/env_time": env_time, "perf/update_time": update_time,
                "perf/allreduce_time": allreduce_time,
            }
            for tag, value in metrics.items():
                writer.add_scalar(tag, value, global_step)
            now = time.time()
            if now - last_print >= 10 or iteration in (start_iteration, sizes.num_iterations):
                last_print = now
                eta = (now - start_time) / (iteration - start_iteration + 1) * (sizes.num_iterations - iteration)
                mean_return = f"{np.mean(recent_returns):.1f}" if recent_returns else "-"
                print(f"iter {iteration}/{sizes.num_iterations} | step {global_step:,} | {sps:,} steps/s | "
                      f"return {mean_return} (last {len(recent_returns)}) | eta {_format_duration(eta)}", flush=True)
        if stop_now:
            if master_process:
                print(f"stopping on {stop.signal_name or 'a signal to another rank'} after iteration {iteration}; "
                      f"resume with --resume auto", flush=True)
            exit_code = EXIT_INTERRUPTED
            break

    if exit_code == 0:
        # The end of the run: a last checkpoint (to resume with more steps) and the final model.
        state = checkpoint_state(iteration)
        if master_process:
            last_checkpoint = save_checkpoint(state, checkpoint_dir, args.checkpoint_keep)
            atomic_save({"model": state["model"], "args": state["args"], "global_step": global_step},
                        checkpoint_dir / "final_model.pt")
        # Data parallelism is only correct while every rank holds the same weights: check it at the end.
        digest = parameter_digest(agent)
        digests = [digest]
        if world_size > 1:
            digests = [None] * world_size
            dist.all_gather_object(digests, digest)
        if len(set(digests)) > 1:
            raise RuntimeError(f"ranks ended with different parameters: {digests}")
        if master_process:
            print("final parameter digest per rank: " + " ".join(f"{r}:{d}" for r, d in enumerate(digests)), flush=True)

    if master_process:
        wall = elapsed_before + time.time() - start_time
        status = {0: "finished", EXIT_INTERRUPTED: "interrupted", EXIT_NON_FINITE: "stopped (non-finite)"}[exit_code]
        mean_return = f"{np.mean(recent_returns):.2f}" if recent_returns else "-"
        cost = f" | cost {args.cost_per_hour * wall / 3600:.2f}" if args.cost_per_hour is not None else ""
        print(f"summary: {status} | {global_step:,} / {sizes.num_iterations * sizes.batch_size:,} steps | wall "
              f"{_format_duration(wall)} | {global_step / max(wall, 1e-9):,.0f} steps/s | return {mean_return} "
              f"(last {len(recent_returns)} games) | checkpoint {last_checkpoint or 'none'}{cost}", flush=True)
        writer.close()
        if exit_code == 0 and args.eval_final:
            evaluate(str(checkpoint_dir / "final_model.pt"), args.eval_episodes, args.local_num_envs, device,
                     args.seed + 10_000)
    if world_size > 1:
        dist.barrier()  # no rank exits (and makes torchrun stop the others) before rank 0 has saved and reported
    return exit_code


def _require_moviepy() -> None:
    try:
        import moviepy  # noqa: F401
    except ImportError:
        raise ConfigError("--capture-video needs moviepy: pip install moviepy") from None


def _format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


if __name__ == "__main__":
    main()
