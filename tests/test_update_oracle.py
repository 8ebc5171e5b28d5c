"""One whole PPO update of the script against a textbook one written here in plain PyTorch: one process holding
the whole batch, functional NCHW layers, per-parameter gradients, clipping by global norm and Adam by hand. The
script's update (channels-last, flat gradient views, fused Adam; on 2 ranks each holding half the envs, its
share of every minibatch, the all-reduce and the advantage statistics over both) must end at the same parameters.

Both run in float64: in float32 the two convolution algorithms' gradients differ by up to ~1e-6, which
Adam (eps 1e-5) turns into steps of opposite sign for a few weights, and the comparison would need a
tolerance loose enough to hide real mistakes."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import ppo_atari_multigpu as ppo
from conftest import free_port

NUM_ACTIONS, SEED = 4, 123
LAYERS = [("network.0", 4), ("network.2", 2), ("network.4", 1)]  # the Nature CNN's convolutions and strides


def oracle_forward(params: dict, obs, actions):
    x = obs.double() / 255.0
    for name, stride in LAYERS:
        x = F.relu(F.conv2d(x, params[f"{name}.weight"], params[f"{name}.bias"], stride=stride))
    x = F.relu(F.linear(x.flatten(1), params["network.7.weight"], params["network.7.bias"]))
    log_probs = F.log_softmax(F.linear(x, params["actor.weight"], params["actor.bias"]), dim=1)
    value = F.linear(x, params["critic.weight"], params["critic.bias"]).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(1)
    return log_probs.gather(1, actions[:, None]).squeeze(1), entropy, value


def oracle_loss(args, params, batch, steps, envs):
    """The clipped PPO objective as the paper and CleanRL write it, over the samples (steps[i], envs[i]) of a
    (num_steps, num_envs) batch; returns the loss and its statistics."""
    logprob, entropy, value = oracle_forward(params, batch["obs"][steps, envs], batch["actions"][steps, envs])
    log_ratio = logprob - batch["logprobs"][steps, envs]
    ratio = torch.exp(log_ratio)
    adv = batch["advantages"][steps, envs]
    if args.norm_adv:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    policy_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
    returns, old_value = batch["returns"][steps, envs], batch["values"][steps, envs]
    if args.clip_vloss:
        clipped = old_value + (value - old_value).clamp(-args.clip_coef, args.clip_coef)
        value_loss = 0.5 * torch.maximum((value - returns) ** 2, (clipped - returns) ** 2).mean()
    else:
        value_loss = 0.5 * ((value - returns) ** 2).mean()
    loss = policy_loss - args.ent_coef * entropy.mean() + args.vf_coef * value_loss
    stats = {"policy_loss": policy_loss.item(), "value_loss": value_loss.item(), "entropy": entropy.mean().item(),
             "approx_kl": ((ratio - 1) - log_ratio).mean().item()}
    return loss, stats


def shuffled_steps(num_envs: int, num_steps: int, epochs: int) -> torch.Tensor:
    """orders[epoch][env]: a random order of that env's steps."""
    g = torch.Generator().manual_seed(SEED)
    return torch.stack([torch.stack([torch.randperm(num_steps, generator=g) for _ in range(num_envs)])
                        for _ in range(epochs)])


def oracle_update(args, initial: dict, batch: dict, orders: torch.Tensor, lr: float):
    """`update_epochs` passes over the whole (num_steps, num_envs) batch; minibatch k of an epoch takes the
    k-th slice of every env's order of steps. Returns the parameters, the mean statistics, Adam's first moments
    and every minibatch's gradient norm (before clipping)."""
    params = {name: t.detach().clone().contiguous().requires_grad_() for name, t in initial.items()}
    m = {name: torch.zeros_like(p) for name, p in params.items()}
    v = {name: torch.zeros_like(p) for name, p in params.items()}
    num_envs, num_steps = orders.shape[1:]
    per_env = num_steps // args.num_minibatches
    beta1, beta2, eps, step, stats, norms = 0.9, 0.999, 1e-5, 0, [], []
    for epoch in range(args.update_epochs):
        for k in range(args.num_minibatches):
            samples = [(int(t), env) for env in range(num_envs) for t in orders[epoch, env, k * per_env:(k + 1) * per_env]]
            steps, envs = (torch.tensor(column) for column in zip(*samples))
            loss, mb_stats = oracle_loss(args, params, batch, steps, envs)
            stats.append(mb_stats)
            grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
            norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads.values()))
            norms.append(norm)
            scale = min(1.0, args.max_grad_norm / (norm + 1e-6))
            step += 1
            with torch.no_grad():
                for name, p in params.items():
                    g = grads[name] * scale
                    m[name] = beta1 * m[name] + (1 - beta1) * g
                    v[name] = beta2 * v[name] + (1 - beta2) * g * g
                    m_hat, v_hat = m[name] / (1 - beta1 ** step), v[name] / (1 - beta2 ** step)
                    p -= lr * m_hat / (v_hat.sqrt() + eps)
    means = {key: sum(s[key] for s in stats) / len(stats) for key in stats[0]}
    return {name: p.detach() for name, p in params.items()}, means, m, norms


def make_batch(initial: dict, num_steps: int, num_envs: int, seed: int) -> dict:
    """A (num_steps, num_envs) batch of random frames and actions; old log-probabilities and values near the
    initial policy's, so that ratios and value changes fall on both sides of the clip range. Advantages of
    mean 0.5: normalising with another minibatch's mean would show."""
    g = torch.Generator().manual_seed(seed)
    size = num_steps * num_envs
    obs = torch.randint(0, 256, (size, 4, 84, 84), dtype=torch.uint8, generator=g)
    actions = torch.randint(0, NUM_ACTIONS, (size,), generator=g)
    with torch.no_grad():
        logprob, _, value = oracle_forward(initial, obs, actions)
    batch = {"obs": obs, "actions": actions, "logprobs": logprob + 0.3 * torch.randn(size, generator=g),
             "values": value + 0.3 * torch.randn(size, generator=g),
             "returns": value + torch.randn(size, generator=g), "advantages": 0.5 + torch.randn(size, generator=g)}
    return {key: value.view(num_steps, num_envs, *value.shape[1:]) for key, value in batch.items()}


def local_batch(batch: dict, envs: slice) -> dict:
    """A process's batch as the script holds it: its envs' columns, flattened step by step."""
    return {key: value[:, envs].flatten(0, 1) for key, value in batch.items()}


def script_update(args, initial: dict, batch: dict, orders: torch.Tensor, world_size: int, rank: int, lr: float):
    agent, optimizer, flat_grad = ppo.make_learner(NUM_ACTIONS, torch.device("cpu"), lr)  # as train() builds it
    agent.load_state_dict(initial)
    num_envs, num_steps = orders.shape[1:]
    minibatches = orders.view(args.update_epochs, num_envs, args.num_minibatches, -1).transpose(1, 2)
    local = ppo.local_minibatches(minibatches, rank * args.local_num_envs, args.local_num_envs)
    envs = slice(rank * args.local_num_envs, (rank + 1) * args.local_num_envs)
    losses, finite, epochs = ppo.ppo_update(args, agent, optimizer, flat_grad, local_batch(batch, envs), local,
                                            world_size, torch.autocast("cpu", enabled=False))
    assert bool(finite) and epochs == args.update_epochs
    first_moments = {name: optimizer.state[p]["exp_avg"].clone() for name, p in agent.named_parameters()}
    return {name: p.detach().clone() for name, p in agent.named_parameters()}, losses, first_moments


def initial_weights() -> dict:
    torch.manual_seed(0)
    return {name: t.clone() for name, t in ppo.Agent(NUM_ACTIONS).state_dict().items()}


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


ARGS = dict(local_num_envs=8, num_steps=8, num_minibatches=4, update_epochs=4)  # 64 samples, 4 x 16 per epoch
ORDERS = shuffled_steps(num_envs=8, num_steps=8, epochs=4)
TOLERANCE = 2e-7  # measured differences: up to 1e-8 (the script computes its loss terms in float32)


def assert_same_update(final, expected, initial, moments, expected_moments):
    moved = max(float((expected[name] - initial[name]).abs().max()) for name in expected)
    assert moved > 1000 * TOLERANCE  # the update really changed the weights
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=0, atol=TOLERANCE, msg=name)
        # Adam's first moment keeps the scale of the gradients that Adam's steps are blind to
        torch.testing.assert_close(moments[name], expected_moments[name], rtol=1e-4, atol=1e-9, msg=name)


@pytest.mark.parametrize("options", [{}, {"norm_adv": False, "clip_vloss": False, "max_grad_norm": 0.05}])
def test_update_matches_the_textbook_update(options):
    torch.set_num_threads(1)
    args = ppo.Args(**ARGS, **options)
    initial = initial_weights()
    batch = make_batch(initial, 8, 8, seed=1)
    final, losses, moments = script_update(args, initial, batch, ORDERS, world_size=1, rank=0, lr=2.5e-4)
    expected, oracle_stats, expected_moments, _ = oracle_update(args, initial, batch, ORDERS, lr=2.5e-4)
    assert_same_update(final, expected, initial, moments, expected_moments)
    for name, value in oracle_stats.items():  # the logged statistics: means over the 16 minibatches
        assert losses[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert 0 < losses["clipfrac"] < 1


def worker(rank: int, port: int, initial: dict, batch: dict, results, max_grad_norm: float):
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # half the envs per rank: the same 64 samples in all
    args = ppo.Args(**{**ARGS, "local_num_envs": 4, "max_grad_norm": max_grad_norm})
    results[rank] = script_update(args, initial, batch, ORDERS, world_size=2, rank=rank, lr=2.5e-4)
    dist.destroy_process_group()



# 100: gradient norms stay below it, unclipped, so that a sum over ranks instead of the mean shows in Adam's moments.
# 0.05: every minibatch's gradient is clipped, so that clipping each process's gradient before the all-reduce
# (rather than their mean after it) shows.
@pytest.mark.parametrize("max_grad_norm", [100.0, 0.05])
def test_two_gloo_ranks_match_the_textbook_update_of_the_whole_batch(max_grad_norm):
    torch.set_num_threads(1)
    initial = initial_weights()
    whole = make_batch(initial, 8, 8, seed=2)
    results = mp.Manager().dict()
    mp.spawn(worker, args=(free_port(), initial, whole, results, max_grad_norm), nprocs=2, join=True)
    expected, oracle_stats, expected_moments, norms = oracle_update(
        ppo.Args(**{**ARGS, "max_grad_norm": max_grad_norm}), initial, whole, ORDERS, lr=2.5e-4)
    assert max(norms) < max_grad_norm if max_grad_norm == 100.0 else min(norms) > max_grad_norm
    for rank in range(2):
        final, losses, moments = results[rank]
        assert_same_update(final, expected, initial, moments, expected_moments)
        for name, value in oracle_stats.items():  # logged: the whole minibatches' statistics, on every rank
            assert losses[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert all(torch.equal(results[0][0][name], results[1][0][name]) for name in expected)  # bitwise equal ranks


def kl_worker(rank: int, port: int, initial: dict, whole: dict, results):
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    args = ppo.Args(**{**ARGS, "local_num_envs": 4, "target_kl": 0.01})
    agent, optimizer, flat_grad = ppo.make_learner(NUM_ACTIONS, torch.device("cpu"), 0.0)  # lr 0: the policy stays
    agent.load_state_dict(initial)
    minibatches = ORDERS.view(args.update_epochs, 8, args.num_minibatches, -1).transpose(1, 2)
    local = ppo.local_minibatches(minibatches, rank * 4, 4)
    losses, _, epochs = ppo.ppo_update(args, agent, optimizer, flat_grad, local_batch(whole, slice(4 * rank, 4 * rank + 4)),
                                       local, 2, torch.autocast("cpu", enabled=False))
    results[rank] = losses, epochs
    dist.destroy_process_group()


# log(new / old) = d on every sample of a process: its KL estimators are old_approx_kl = -d and
# approx_kl = (e^d - 1) - d. With d = 0.2 on process 0 and -0.1 on process 1 (equal shares of every minibatch):
# approx_kl = ((1.2214028 - 1.2) + (0.9048374 - 0.9)) / 2 = 0.0131201 > 0.01: stop after the first epoch, though
# old_approx_kl = (-0.2 + 0.1) / 2 = -0.05 says go on (and process 1's own approx_kl, 0.0048374, too). With
# d = -0.1 on both: approx_kl = 0.0048374 < 0.01, all 4 epochs, though old_approx_kl = 0.1 says stop.
@pytest.mark.parametrize("shifts, approx_kl, old_approx_kl, epochs", [
    ((0.2, -0.1), 0.0131201, -0.05, 1),
    ((-0.1, -0.1), 0.0048374, 0.1, 4),
])
def test_early_stop_reads_approx_kl_over_both_processes(shifts, approx_kl, old_approx_kl, epochs):
    torch.set_num_threads(1)
    initial = initial_weights()
    whole = make_batch(initial, 8, 8, seed=3)
    with torch.no_grad():
        logprob, _, _ = oracle_forward(initial, whole["obs"].flatten(0, 1), whole["actions"].flatten())
    shift = torch.tensor([shifts[0]] * 4 + [shifts[1]] * 4).expand(8, 8)  # (steps, envs): envs 0-3 on process 0
    whole["logprobs"] = logprob.view(8, 8) - shift
    results = mp.Manager().dict()
    mp.spawn(kl_worker, args=(free_port(), initial, whole, results), nprocs=2, join=True)
    for rank in range(2):
        losses, ran = results[rank]
        assert ran == epochs
        assert losses["approx_kl"] == pytest.approx(approx_kl, abs=1e-6)
        assert losses["old_approx_kl"] == pytest.approx(old_approx_kl, abs=1e-6)
