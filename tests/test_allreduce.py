"""The single flat all-reduce gives every rank the mean of the ranks' gradients, and the statistics taken over
all ranks are those of the whole batch (two real gloo processes)."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ppo_atari_multigpu as ppo
from conftest import free_port

WORLD_SIZE = 2


def batch_for(rank: int):
    generator = torch.Generator().manual_seed(100 + rank)
    obs = torch.randint(0, 256, (8, 4, 84, 84), dtype=torch.uint8, generator=generator)
    actions = torch.randint(0, 4, (8,), generator=generator)
    return obs, actions


def loss_of(agent, obs, actions):
    _, logprob, entropy, value = agent.get_action_and_value(obs, actions)
    return -(logprob.mean()) + value.pow(2).mean() - 0.01 * entropy.mean()


def make_agent(state_dict=None):
    agent = ppo.Agent(num_actions=4).to(memory_format=torch.channels_last)
    if state_dict is not None:
        agent.load_state_dict(state_dict)
    return agent


def worker(rank: int, port: int, state_dict, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    agent = make_agent(state_dict)
    flat_grad = ppo.flat_gradient_buffer(agent.parameters())
    loss_of(agent, *batch_for(rank)).backward()
    ppo.all_reduce_mean_(flat_grad, WORLD_SIZE)
    results[rank] = {name: p.grad.clone() for name, p in agent.named_parameters()}
    dist.destroy_process_group()


def test_flat_all_reduce_is_the_mean_of_rank_gradients():
    # Initial weights are passed explicitly: orthogonal init differs in the last bits with the thread count.
    agent = make_agent()
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(worker, args=(free_port(), agent.state_dict(), results), nprocs=WORLD_SIZE, join=True)

    # The same gradients computed one rank at a time, without any process group.
    per_rank = []
    for rank in range(WORLD_SIZE):
        agent.zero_grad()
        loss_of(agent, *batch_for(rank)).backward()
        per_rank.append({name: p.grad.clone() for name, p in agent.named_parameters()})

    for name, _ in agent.named_parameters():
        expected = (per_rank[0][name] + per_rank[1][name]) / 2
        assert not torch.allclose(per_rank[0][name], per_rank[1][name])  # the ranks really differed
        torch.testing.assert_close(results[0][name], expected, rtol=1e-5, atol=1e-7)
        assert torch.equal(results[0][name], results[1][name])  # bitwise identical on both ranks


def test_gradient_views_alias_the_flat_buffer():
    agent = make_agent()
    flat_grad = ppo.flat_gradient_buffer(agent.parameters())
    assert flat_grad.numel() == sum(p.numel() for p in agent.parameters())
    loss_of(agent, *batch_for(0)).backward()
    assert flat_grad.abs().sum() > 0
    flat_grad.zero_()
    assert all(p.grad.abs().sum() == 0 for p in agent.parameters())  # backward wrote into the flat buffer
    for p in agent.parameters():
        assert p.grad.stride() == p.stride()  # layouts match: no hidden copies in autograd


def statistics_worker(rank: int, port: int, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    shares = [[1.0, 2.0, 3.0], [4.0, 10.0, 4.0]]  # one minibatch of 6 advantages, half on each rank
    adv_stats = ppo.advantage_stats(torch.tensor([shares[rank]]), WORLD_SIZE)
    values, returns = [[1.0, 1.0], [4.0, 4.0]][rank], [[1.0, 2.0], [3.0, 6.0]][rank]
    results[rank] = adv_stats.tolist(), ppo.explained_variance(torch.tensor(values), torch.tensor(returns), WORLD_SIZE)
    dist.destroy_process_group()


def test_normalisation_and_explained_variance_are_over_every_rank():
    results = mp.Manager().dict()
    mp.spawn(statistics_worker, args=(free_port(), results), nprocs=WORLD_SIZE, join=True)
    # Advantages 1, 2, 3 | 4, 10, 4: mean 24 / 6 = 4, sample variance (9 + 4 + 1 + 0 + 36 + 0) / 5 = 10.
    # Returns 1, 2 | 3, 6 and values 1, 1 | 4, 4: Var(returns) 3.5, Var(returns - values) 1.25 (as over one rank).
    for rank in range(WORLD_SIZE):
        ((mean, std),) = results[rank][0]
        assert (mean, std) == pytest.approx((4.0, math.sqrt(10.0)), abs=1e-6)
        assert results[rank][1] == pytest.approx(1 - 1.25 / 3.5, abs=1e-12)
