"""PPO's arithmetic with chosen numbers: every expected value below is worked out by hand from the formula."""

import math

import gymnasium as gym
import numpy as np
import pytest
import torch

import ppo_atari_multigpu as ppo
from conftest import TINY, run_python, scalars

# Five samples, clip 0.2. Ratios 1.5 and 0.5 lie outside [0.8, 1.2], 1.1 inside; advantages of both signs.
RATIOS = [1.5, 0.5, 1.5, 0.5, 1.1]
ADVANTAGES = [2.0, 1.0, -1.0, -2.0, 3.0]
OLD_LOGPROBS = [-1.0, -2.0, -0.5, -1.5, -3.0]
# Values: new - old is 0.5 (clipped to 0.2), 0.1 (inside), -0.5 (clipped to -0.2), 0.5 (clipped, but the
# unclipped error is the larger), 0.0.
OLD_VALUES = [1.0, 1.0, 0.0, 0.0, 2.0]
NEW_VALUES = [1.5, 1.1, -0.5, 0.5, 2.0]
RETURNS = [2.0, 0.0, -1.0, 0.0, 3.0]
ENTROPY = [1.0, 1.2, 0.8, 1.4, 0.6]
CLIP, ENT_COEF, VF_COEF = 0.2, 0.1, 0.25


def loss_of(*, clip_vloss=True, adv_stats=None, advantages=ADVANTAGES, ratios=RATIOS):
    new_logprob = torch.tensor([old + math.log(r) for old, r in zip(OLD_LOGPROBS, ratios)], requires_grad=True)
    new_value = torch.tensor(NEW_VALUES, requires_grad=True)
    entropy = torch.tensor(ENTROPY, requires_grad=True)
    loss, stats = ppo.ppo_loss(new_logprob, torch.tensor(OLD_LOGPROBS), torch.tensor(advantages), new_value,
                               torch.tensor(OLD_VALUES), torch.tensor(RETURNS), entropy, adv_stats=adv_stats,
                               clip_coef=CLIP, clip_vloss=clip_vloss, ent_coef=ENT_COEF, vf_coef=VF_COEF)
    loss.backward()
    grads = {"logprob": new_logprob.grad.tolist(), "value": new_value.grad.tolist(), "entropy": entropy.grad.tolist()}
    return loss.item(), {name: value.item() for name, value in stats.items()}, grads


def test_policy_loss_is_the_pessimistic_clipped_surrogate():
    _, stats, grads = loss_of()
    # max(-A r, -A clip(r)) per sample:
    #   r 1.5, A  2: max(-3.0, -2.4) = -2.4 (clipped)     r 0.5, A  1: max(-0.5, -0.8) = -0.5
    #   r 1.5, A -1: max( 1.5,  1.2) =  1.5               r 0.5, A -2: max( 1.0,  1.6) =  1.6 (clipped)
    #   r 1.1, A  3: max(-3.3, -3.3) = -3.3
    assert stats["policy_loss"] == pytest.approx((-2.4 - 0.5 + 1.5 + 1.6 - 3.3) / 5, abs=1e-6)
    # d/d log pi of the mean: 0 where the clipped term is taken, -A r / 5 where the unclipped one is.
    expected = [0.0, -1.0 * 0.5 / 5, 1.0 * 1.5 / 5, 0.0, -3.0 * 1.1 / 5]
    assert grads["logprob"] == pytest.approx(expected, abs=1e-6)


def test_clipped_value_loss():
    _, stats, grads = loss_of(clip_vloss=True)
    # max((new - R)^2, (old + clip(new - old, -0.2, 0.2) - R)^2):
    #   max(0.25, (1.2 - 2)^2 = 0.64) = 0.64    max(1.21, 1.21) = 1.21    max(0.25, (-0.2 + 1)^2 = 0.64) = 0.64
    #   max(0.25, (0.2 - 0)^2 = 0.04) = 0.25    max(1.0, 1.0) = 1.0
    assert stats["value_loss"] == pytest.approx(0.5 * (0.64 + 1.21 + 0.64 + 0.25 + 1.0) / 5, abs=1e-6)
    # The gradient reaches the new value only where the unclipped error counts: vf * 0.5 * 2 (new - R) / 5.
    expected = [0.0, VF_COEF * (1.1 - 0.0) / 5, 0.0, VF_COEF * (0.5 - 0.0) / 5, VF_COEF * (2.0 - 3.0) / 5]
    assert grads["value"] == pytest.approx(expected, abs=1e-6)


def test_unclipped_value_loss():
    _, stats, grads = loss_of(clip_vloss=False)
    assert stats["value_loss"] == pytest.approx(0.5 * (0.25 + 1.21 + 0.25 + 0.25 + 1.0) / 5, abs=1e-6)
    expected = [VF_COEF * (1.5 - 2.0) / 5, VF_COEF * 1.1 / 5, VF_COEF * (-0.5 + 1.0) / 5, VF_COEF * 0.5 / 5,
                VF_COEF * (2.0 - 3.0) / 5]
    assert grads["value"] == pytest.approx(expected, abs=1e-6)


def test_entropy_bonus_and_total_loss():
    loss, stats, grads = loss_of()
    assert stats["entropy"] == pytest.approx(1.0, abs=1e-6)
    policy_loss, value_loss = (-2.4 - 0.5 + 1.5 + 1.6 - 3.3) / 5, 0.5 * (0.64 + 1.21 + 0.64 + 0.25 + 1.0) / 5
    # policy loss - entropy coefficient * entropy + value coefficient * value loss
    assert loss == pytest.approx(-0.62 - 0.1 * 1.0 + 0.25 * 0.374, abs=1e-6)
    assert loss == pytest.approx(policy_loss - ENT_COEF * 1.0 + VF_COEF * value_loss, abs=1e-6)
    assert grads["entropy"] == pytest.approx([-ENT_COEF / 5] * 5, abs=1e-7)  # more entropy lowers the loss


def test_kl_estimates_and_clip_fraction():
    _, stats, _ = loss_of()
    # old_approx_kl = mean(-log r); approx_kl = mean((r - 1) - log r), the low-variance estimator (k3).
    log_ratios = [math.log(1.5), math.log(0.5), math.log(1.5), math.log(0.5), math.log(1.1)]
    assert stats["old_approx_kl"] == pytest.approx(-sum(log_ratios) / 5, abs=1e-6)
    k3 = [(0.5 - math.log(1.5)), (-0.5 - math.log(0.5)), (0.5 - math.log(1.5)), (-0.5 - math.log(0.5)),
          (0.1 - math.log(1.1))]
    assert stats["approx_kl"] == pytest.approx(sum(k3) / 5, abs=1e-6)
    assert stats["clipfrac"] == pytest.approx(4 / 5)  # |r - 1| > 0.2 for all but r = 1.1


def test_advantages_are_normalised_per_minibatch_with_sample_std():
    advantages = [1.0, 2.0, 3.0, 4.0, 10.0]  # mean 4; sample std sqrt((9 + 4 + 1 + 0 + 36) / 4) = sqrt(12.5)
    # Two minibatches at once (the second: mean 1, sample std sqrt((1 + 1 + 1 + 1 + 16) / 4) = sqrt(5)).
    adv_stats = ppo.advantage_stats(torch.tensor([advantages, [0.0, 0.0, 0.0, 0.0, 5.0]]), world_size=1)
    assert adv_stats.flatten().tolist() == pytest.approx([4.0, math.sqrt(12.5), 1.0, math.sqrt(5.0)], abs=1e-6)
    normalised = [(a - 4.0) / (math.sqrt(12.5) + 1e-8) for a in advantages]
    pessimistic = [max(-a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP)) for a, r in zip(normalised, RATIOS)]
    _, stats, _ = loss_of(adv_stats=adv_stats[0], advantages=advantages)
    assert stats["policy_loss"] == pytest.approx(sum(pessimistic) / 5, abs=1e-6)
    _, raw, _ = loss_of(adv_stats=None, advantages=advantages)  # --no-norm-adv: the advantages as given
    unnormalised = [max(-a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP)) for a, r in zip(advantages, RATIOS)]
    assert raw["policy_loss"] == pytest.approx(sum(unnormalised) / 5, abs=1e-6)


def test_advantage_normalisation_epsilon():
    # Advantages 0, 1e-8, 2e-8: mean 1e-8, sample std 1e-8. With epsilon 1e-8 they become -0.5, 0, 0.5
    # (without it -1, 0, 1). Ratio 1 everywhere, so the policy loss is -mean(A) = 0 and its gradient -A / 3.
    logprob = torch.zeros(3, requires_grad=True)
    advantages = torch.tensor([0.0, 1e-8, 2e-8], dtype=torch.float64)
    adv_stats = ppo.advantage_stats(advantages, world_size=1)
    assert adv_stats.tolist() == pytest.approx([1e-8, 1e-8], rel=1e-9)
    loss, _ = ppo.ppo_loss(logprob, torch.zeros(3), advantages.float(), torch.zeros(3), torch.zeros(3),
                           torch.zeros(3), torch.zeros(3), adv_stats=adv_stats.float(), clip_coef=CLIP,
                           clip_vloss=True, ent_coef=0.0, vf_coef=0.0)
    loss.backward()
    assert logprob.grad.tolist() == pytest.approx([0.5 / 3, 0.0, -0.5 / 3], abs=1e-4)


def test_learning_rate_schedule():
    lr = 2.5e-4
    assert ppo.get_lr(1, 100, lr, anneal=True) == lr  # the full rate in the first iteration
    assert ppo.get_lr(2, 100, lr, anneal=True) == pytest.approx(lr * 99 / 100, rel=1e-12)
    assert ppo.get_lr(100, 100, lr, anneal=True) == pytest.approx(lr / 100, rel=1e-12)  # never 0
    assert [ppo.get_lr(i, 100, lr, anneal=False) for i in (1, 2, 100)] == [lr, lr, lr]


@pytest.mark.parametrize("anneal, expected", [(True, [2.5e-4, 2.5e-4 * 2 / 3, 2.5e-4 / 3]),
                                              (False, [2.5e-4, 2.5e-4, 2.5e-4])])
def test_training_uses_the_schedule(tmp_path, anneal, expected):
    flag = "--anneal-lr" if anneal else "--no-anneal-lr"
    result = run_python([*TINY, "--total-timesteps", "192", "--num-minibatches", "1", flag], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    logged = [value for _, value in scalars(tmp_path)["charts/learning_rate"]]
    assert logged == pytest.approx(expected, rel=1e-6)  # logged as float32


def test_learner_rewards_are_the_sign_of_the_raw_rewards():
    # Space Invaders pays 5 to 30 points per alien; the learner must see -1, 0 or +1, while the episode
    # statistics (innermost wrapper) keep the raw points.
    env = ppo.make_env("SpaceInvadersNoFrameskip-v4")()
    env.reset(seed=5)
    rng = np.random.default_rng(5)
    raw_rewards, learner_rewards = [], []
    while len(raw_rewards) < 600:
        before = env.get_wrapper_attr("episode_returns")
        _, reward, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
        raw_rewards.append(env.get_wrapper_attr("episode_returns") - before)
        learner_rewards.append(reward)
        if terminated or truncated:
            env.reset()
    env.close()
    assert max(raw_rewards) >= 5  # raw points were scored
    assert learner_rewards == [float(np.sign(r)) for r in raw_rewards]


SHORT_BREAKOUT = "TestBreakoutShort-v0"  # the real ALE game, truncated after 400 frames (100 agent steps)


@pytest.mark.parametrize("vector_env", ["sync", "ale"])
def test_truncation_is_bootstrapped_and_termination_is_not(vector_env):
    def make_envs():
        if vector_env == "ale":
            return ppo.AtariVectorGames(SHORT_BREAKOUT, num_envs, num_threads=1)
        return ppo.make_vector_env(SHORT_BREAKOUT, num_envs)

    if SHORT_BREAKOUT not in gym.registry:
        gym.register(SHORT_BREAKOUT, entry_point="ale_py.env:AtariEnv",
                     kwargs={"game": "breakout", "max_num_frames_per_episode": 400})
    num_envs, num_steps, gamma, seeds = 2, 300, 0.9, [21, 22]
    value_of = lambda obs: obs.reshape(len(obs), -1).float().mean(1) / 10  # noqa: E731 - a known "critic"

    def policy(obs, gumbel):
        action = obs.reshape(len(obs), -1).to(torch.int64).sum(1) % 4
        return action, torch.zeros(len(obs)), value_of(obs)

    envs = make_envs()
    rollout = ppo.Rollout.allocate(num_steps, num_envs, (4, 84, 84), torch.device("cpu"))
    rollout.set_next_obs(slice(0, num_envs), envs.reset(seed=seeds)[0])
    group = ppo.EnvGroup(envs, slice(0, num_envs))
    gumbel = torch.zeros(num_steps, num_envs, 4)
    ppo.collect_rollout(policy, value_of, [group], rollout, gumbel, gamma)
    envs.close()

    # The same envs stepped with the same actions, by hand: what each step returned.
    twin = make_envs()
    twin.reset(seed=seeds)
    truncations = terminations = 0
    for step in range(num_steps):
        _, reward, terminated, truncated, infos = twin.step(rollout.actions[step].numpy())
        for i in range(num_envs):
            if truncated[i] and not terminated[i]:  # a time limit: reward + gamma * V(final observation)
                final_value = value_of(torch.as_tensor(infos["final_obs"][i][None])).item()
                assert rollout.rewards[step, i] == pytest.approx(reward[i] + gamma * final_value, abs=1e-5)
                truncations += 1
            else:  # a lost life or game over ends the return: no value added
                assert rollout.rewards[step, i] == reward[i]
                terminations += bool(terminated[i])
    twin.close()
    assert truncations >= 2 and terminations >= 2
    # Both kinds of end start a new episode for GAE (the last step's ends are in next_done).
    assert rollout.dones.sum() + rollout.next_done.sum() == truncations + terminations


def test_orthogonal_init_with_the_nature_gains():
    # Orthogonal rows scaled by the gain: W W^T = gain^2 I (every layer here has fewer rows than columns).
    # Gains: sqrt(2) for the ReLU trunk, 0.01 for the actor head (a near-uniform first policy), 1 for the critic.
    agent = ppo.Agent(num_actions=4)
    layers = {"network.0": 2.0, "network.2": 2.0, "network.4": 2.0, "network.7": 2.0, "actor": 0.01 ** 2, "critic": 1.0}
    params = dict(agent.named_parameters())
    for name, gain_squared in layers.items():
        weight = params[f"{name}.weight"].detach().flatten(1)
        torch.testing.assert_close(weight @ weight.T, gain_squared * torch.eye(len(weight)), rtol=0,
                                   atol=1e-5 * gain_squared)
        assert torch.count_nonzero(params[f"{name}.bias"]) == 0


def test_minibatches_take_an_equal_slice_of_every_envs_shuffled_steps():
    # 3 envs x 8 steps, 4 minibatches, 2 epochs: each minibatch holds 2 steps of each env; per epoch and env the
    # 4 minibatches' steps are 0..7 once each; the two epochs and the envs are shuffled differently.
    minibatches = ppo.draw_minibatches(torch.Generator().manual_seed(0), epochs=2, num_envs=3, num_steps=8,
                                       num_minibatches=4)
    assert minibatches.shape == (2, 4, 3, 2)
    for epoch in range(2):
        for env in range(3):
            assert sorted(minibatches[epoch, :, env].flatten().tolist()) == list(range(8))
    assert not torch.equal(minibatches[0], minibatches[1])
    assert not torch.equal(minibatches[0, :, 0], minibatches[0, :, 1])
    assert minibatches[0, :, 0].flatten().tolist() != list(range(8))  # shuffled, not in step order

    # A process with envs 1 and 2 (of 3) holds, in its (steps x 2 envs) batch flattened row by row, the
    # sample of step t and its env e (0 or 1) at index 2 t + e.
    local = ppo.local_minibatches(minibatches, first_env=1, local_num_envs=2)
    assert local.shape == (2, 4, 4)
    for epoch in range(2):
        for m in range(4):
            steps_env1, steps_env2 = minibatches[epoch, m, 1].tolist(), minibatches[epoch, m, 2].tolist()
            expected = [2 * t for t in steps_env1] + [2 * t + 1 for t in steps_env2]
            assert sorted(local[epoch, m].tolist()) == sorted(expected)


def test_minibatches_are_the_same_whatever_the_split():
    # Global minibatch m is the union of the processes' shares: 2 x 2 envs hold exactly what 1 x 4 holds.
    minibatches = ppo.draw_minibatches(torch.Generator().manual_seed(3), epochs=1, num_envs=4, num_steps=6,
                                       num_minibatches=3)
    whole = ppo.local_minibatches(minibatches, first_env=0, local_num_envs=4)
    halves = [ppo.local_minibatches(minibatches, first_env=2 * r, local_num_envs=2) for r in range(2)]
    for m in range(3):
        from_whole = sorted((int(i) // 4, int(i) % 4) for i in whole[0, m])  # (step, global env)
        from_halves = sorted((int(i) // 2, 2 * r + int(i) % 2) for r in range(2) for i in halves[r][0, m])
        assert from_whole == from_halves and len(from_whole) == 8


def test_explained_variance_over_the_batch():
    # returns 1, 2, 3, 6: mean 3, population variance (4 + 1 + 0 + 9) / 4 = 3.5.
    # values 1, 1, 4, 4: errors 0, 1, -1, 2, mean 0.5, variance (0.25 + 0.25 + 2.25 + 2.25) / 4 = 1.25.
    # 1 - 1.25 / 3.5 = 0.642857...
    values, returns = torch.tensor([1.0, 1.0, 4.0, 4.0]), torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert ppo.explained_variance(values, returns, world_size=1) == pytest.approx(1 - 1.25 / 3.5, abs=1e-12)
    assert ppo.explained_variance(returns, returns, world_size=1) == pytest.approx(1.0, abs=1e-12)  # perfect critic
    assert math.isnan(ppo.explained_variance(values, torch.full((4,), 2.0), world_size=1))  # returns do not vary
