"""What `train` hands to the algorithm's pieces, read from a real run (2 processes x 2 envs, float64, recorded by
tests/launch.py): GAE gets the run's gamma and lambda and the value of the observation after the last step, and
every rollout step acts on that step's own column of the job's action noise."""

import subprocess
import sys

import pytest
import torch

import ppo_atari_multigpu as ppo
from conftest import ROOT, SCRIPT, TINY, script_env

ITERATIONS, LOCAL_ENVS, NUM_STEPS = 2, 2, 32  # TINY's sizes


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("wiring")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
               str(ROOT / "tests" / "launch.py"), str(SCRIPT), *TINY, "--total-timesteps", str(ITERATIONS * 128),
               "--gamma", "0.9", "--gae-lambda", "0.8"]  # not the defaults: a hard-coded 0.99 or 0.95 would show
    env = {**script_env(), "PPO_TEST_DTYPE": "float64", "PPO_TEST_RECORD": str(cwd / "record")}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [torch.load(cwd / "record" / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def test_gae_gets_the_runs_gamma_lambda_and_the_value_after_the_last_step(records):
    for record in records:
        assert len(record["advantages"]) == len(record["model"]) == len(record["next_obs"]) == ITERATIONS
        for given, weights, next_obs in zip(record["advantages"], record["model"], record["next_obs"]):
            assert given["gamma"] == 0.9 and given["gae_lambda"] == 0.8
            agent = ppo.Agent(num_actions=4).double()
            agent.load_state_dict(weights)  # the weights of that iteration's rollout: the update comes after
            with torch.no_grad():
                expected = agent.get_value(next_obs).flatten()
            torch.testing.assert_close(given["next_value"], expected, rtol=0, atol=1e-12)
            assert given["rewards"].shape == given["values"].shape == given["dones"].shape == (NUM_STEPS, LOCAL_ENVS)
        # The next iteration's first step starts where this one's rollout ended.
        assert torch.equal(record["advantages"][1]["dones"][0], record["advantages"][0]["next_done"])


def test_each_rollout_step_acts_on_its_own_column_of_the_jobs_noise(records):
    for rank, record in enumerate(records):
        assert len(record["noise"]) == ITERATIONS * NUM_STEPS and len(record["gumbel"]) == ITERATIONS
        for iteration, job_noise in enumerate(record["gumbel"]):  # (steps, the job's 4 envs, actions)
            for step in range(NUM_STEPS):
                given = record["noise"][iteration * NUM_STEPS + step]
                assert torch.equal(given, job_noise[step, rank * LOCAL_ENVS:(rank + 1) * LOCAL_ENVS]), (iteration, step)
