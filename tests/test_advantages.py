"""GAE against a plain per-environment implementation written from the paper's definition."""

import numpy as np
import torch

import ppo_atari_multigpu as ppo


def reference_gae(rewards, values, episode_ends, last_value, gamma, lam):
    """rewards/values/episode_ends: lists over time for one env; episode_ends[t] = the step t ended an episode."""
    T = len(rewards)
    advantages = [0.0] * T
    for t in range(T):
        # A_t = sum_k (gamma * lam)^k * delta_{t+k}, stopping at the end of the episode.
        total, discount = 0.0, 1.0
        for k in range(t, T):
            value_next = 0.0 if episode_ends[k] else (values[k + 1] if k + 1 < T else last_value)
            delta = rewards[k] + gamma * value_next - values[k]
            total += discount * delta
            if episode_ends[k]:
                break
            discount *= gamma * lam
        advantages[t] = total
    return advantages


def test_gae_matches_reference_with_episode_ends():
    rng = np.random.default_rng(0)
    num_steps, num_envs, gamma, lam = 40, 5, 0.99, 0.95
    rewards = rng.normal(size=(num_steps, num_envs)).astype(np.float32)
    values = rng.normal(size=(num_steps, num_envs)).astype(np.float32)
    episode_ends = rng.random((num_steps, num_envs)) < 0.1  # step t ended an episode
    episode_ends[-1, 0] = True  # an episode that ends on the last step of the rollout
    next_value = rng.normal(size=num_envs).astype(np.float32)

    # The script's convention: dones[t] marks observation t as the first of a new episode.
    dones = np.zeros_like(rewards)
    dones[1:] = episode_ends[:-1]
    next_done = episode_ends[-1].astype(np.float32)
    advantages, returns = ppo.compute_advantages(
        torch.tensor(rewards), torch.tensor(values), torch.tensor(dones), torch.tensor(next_value),
        torch.tensor(next_done), gamma=gamma, gae_lambda=lam,
    )
    assert episode_ends.sum() > 10
    for env in range(num_envs):
        expected = reference_gae(rewards[:, env], values[:, env], episode_ends[:, env], next_value[env], gamma, lam)
        np.testing.assert_allclose(advantages[:, env].numpy(), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(returns.numpy(), advantages.numpy() + values, rtol=1e-6)


def test_gae_with_lambda_one_is_discounted_return_minus_value():
    rewards = torch.tensor([[1.0], [0.0], [2.0], [1.0]])
    values = torch.tensor([[0.5], [0.2], [0.1], [0.3]])
    dones = torch.tensor([[0.0], [0.0], [1.0], [0.0]])  # the episode ends after step 1
    advantages, returns = ppo.compute_advantages(rewards, values, dones, torch.tensor([4.0]), torch.tensor([0.0]),
                                                 gamma=0.5, gae_lambda=1.0)
    expected_returns = [1.0 + 0.5 * 0.0, 0.0, 2.0 + 0.5 * (1.0 + 0.5 * 4.0), 1.0 + 0.5 * 4.0]
    np.testing.assert_allclose(returns[:, 0].numpy(), expected_returns, rtol=1e-6)
