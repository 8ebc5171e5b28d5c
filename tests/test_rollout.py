"""The rollout: double-buffered env groups store exactly what one synchronous vector env stores."""

import numpy as np
import pytest
import torch

import ppo_atari_multigpu as ppo


def deterministic_policy(num_actions: int):
    """Actions that depend on the observation alone, so two rollouts can be compared step by step."""
    def policy(obs, gumbel):
        pixels = obs.reshape(len(obs), -1).to(torch.int64)
        action = (pixels * torch.arange(1, pixels.shape[1] + 1)).sum(1) % num_actions
        return action, -action.float(), pixels.float().mean(1)
    return policy


def run_rollout(vector_env: str, num_envs: int, num_steps: int, seeds: list):
    args = ppo.Args(local_num_envs=num_envs, vector_env=vector_env)
    groups = ppo.make_env_groups(args)
    rollout = ppo.Rollout.allocate(num_steps, num_envs, (4, 84, 84), torch.device("cpu"))
    for group in groups:
        rollout.set_next_obs(group.index, group.envs.reset(seed=seeds[group.index])[0])
    value_of = lambda obs: obs.reshape(len(obs), -1).float().mean(1)  # noqa: E731
    episodes = []
    for _ in range(2):  # two rollouts: the second starts from where the first left the envs
        gumbel = torch.zeros(num_steps, num_envs, 4)
        episodes += ppo.collect_rollout(deterministic_policy(4), value_of, groups, rollout, gumbel, 0.99)
        snapshot = {name: (value.clone() if isinstance(value, torch.Tensor) else value.copy())
                    for name, value in vars(rollout).items() if name != "next_obs_host"}
    for group in groups:
        group.envs.close()
    return snapshot, episodes, len(groups)


@pytest.mark.parametrize("single, double", [("sync", "double"), ("ale", "ale-double")])
def test_double_buffered_rollout_stores_the_transitions_of_the_single_one(single, double):
    seeds = list(range(10, 16))
    sync, sync_episodes, sync_groups = run_rollout(single, 6, 250, seeds)
    double, double_episodes, double_groups = run_rollout(double, 6, 250, seeds)
    assert (sync_groups, double_groups) == (1, 2)
    for name in ("obs", "actions", "logprobs", "values", "next_obs"):
        assert torch.equal(sync[name], double[name]), name
    for name in ("rewards", "dones", "next_done"):
        np.testing.assert_array_equal(sync[name], double[name], err_msg=name)
    # Games did end (whole games, with their returns), and each rollout saw lives lost and episodes restart.
    assert sync_episodes and sorted(sync_episodes) == sorted(double_episodes)
    assert sync["dones"].sum() > 0


@pytest.mark.parametrize("noise", ["drawn by the sampler", "the job's shared noise"])
def test_sampler_draws_each_action_with_the_policy_probability(noise):
    probabilities = torch.tensor([0.05, 0.15, 0.3, 0.5])
    logits = (probabilities.log() + 1.7).expand(200_000, 4)  # any shift of the logits is the same policy
    torch.manual_seed(0)
    if noise == "drawn by the sampler":  # as in evaluation
        actions = ppo.sample_action(logits)
    else:  # as in training: 200,000 steps of one env
        actions = ppo.sample_action(logits, ppo.draw_gumbel(torch.Generator().manual_seed(0), 200_000, 1, 4)[:, 0])
    frequencies = torch.bincount(actions, minlength=4).double() / len(actions)
    # Within 5 standard errors of each probability, and a chi-square far below its 0.1% point for 3 dof (16.3).
    standard_errors = (probabilities * (1 - probabilities) / len(actions)).sqrt()
    assert ((frequencies - probabilities).abs() < 5 * standard_errors).all(), frequencies
    expected = probabilities * len(actions)
    chi_square = ((torch.bincount(actions, minlength=4) - expected) ** 2 / expected).sum()
    assert chi_square < 16.3, chi_square
    # Each row is drawn on its own: different rows of the same logits get different actions.
    assert len(set(actions[:100].tolist())) == 4


def test_ale_rollout_has_the_layout_of_the_python_one():
    python, _, _ = run_rollout("sync", 4, 64, [1, 2, 3, 4])
    ale, ale_episodes, _ = run_rollout("ale", 4, 64, [1, 2, 3, 4])
    for name, value in python.items():
        assert (value.shape, value.dtype) == (ale[name].shape, ale[name].dtype), name
    assert ale["obs"].max() > 0 and ale["dones"].sum() > 0  # real frames; lives were lost
