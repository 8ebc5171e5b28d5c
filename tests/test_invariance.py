"""The number of processes is a speed setting: 1 x 4, 2 x 2 and 4 x 1 processes x envs compute the same
experiment (the same games, losses and parameters), and a run resumed on another number of processes draws what
the uninterrupted run would have drawn. Real torchrun, gloo and ALE; tests/launch.py runs the script in float64
(so that the order of floating-point sums, which differs between splits, stays below 1e-12) and records what
each rank drew from the job's shared random stream."""

import math
import subprocess
import sys

import pytest
import torch

import ppo_atari_multigpu as ppo
from conftest import ROOT, SCRIPT, scalars, script_env

LAUNCHER = ROOT / "tests" / "launch.py"
NUM_STEPS, NUM_MINIBATCHES, ITERATIONS, ENVS = 64, 2, 3, 4
COMMON = ["--num-steps", str(NUM_STEPS), "--num-minibatches", str(NUM_MINIBATCHES)]
RUN_ID = "BreakoutNoFrameskip-v4__ppo_atari_multigpu__1"


def run_split(cwd, nproc: int, *extra, iterations=ITERATIONS, dtype="float64", envs=ENVS, shape=COMMON):
    """Run the script as `nproc` processes x envs / nproc envs; return its folder (TensorBoard log,
    checkpoints, the console in console.txt, and what each rank recorded under record/)."""
    num_steps = int(shape[shape.index("--num-steps") + 1])
    args = [*shape, "--local-num-envs", str(envs // nproc), "--total-timesteps", str(iterations * envs * num_steps),
            *extra]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}",
               str(LAUNCHER), str(SCRIPT), *args]
    env = {**script_env(), "PPO_TEST_DTYPE": dtype, "PPO_TEST_RECORD": str(cwd / "record")}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (cwd / "console.txt").write_text(result.stdout)
    return cwd


def recorded(cwd, rank: int) -> dict:
    return torch.load(cwd / "record" / f"rank{rank}.pt", weights_only=False)


def final_parameters(cwd) -> dict:
    return torch.load(cwd / "checkpoints" / RUN_ID / "final_model.pt", weights_only=False)["model"]


def assert_same_experiment(a, b, batch=ENVS * NUM_STEPS, iterations=ITERATIONS, games_end=True):
    """The same games at the same steps, every logged loss within 1e-9, final parameters within 1e-9."""
    logged_a, logged_b = scalars(a), scalars(b)
    games = logged_a.get("charts/episodic_return", [])
    assert bool(games) == games_end, "no game ended: the comparison of games would be empty"
    for tag in ("charts/episodic_return", "charts/episodic_length"):
        assert logged_a.get(tag) == logged_b.get(tag), tag
    tags = [tag for tag in logged_a if tag.startswith("losses/")] + ["charts/update_epochs"]
    assert len(tags) == 8
    for tag in tags:
        steps_a, values_a = zip(*logged_a[tag])
        steps_b, values_b = zip(*logged_b[tag])
        assert steps_a == steps_b == tuple(batch * i for i in range(1, iterations + 1)), tag
        assert values_a == pytest.approx(values_b, rel=0, abs=1e-9), tag
    final_a, final_b = final_parameters(a), final_parameters(b)
    for name in final_a:
        torch.testing.assert_close(final_a[name], final_b[name], rtol=0, atol=1e-9, msg=name)
    return logged_a


_runs = {}


def run_once(tmp_path_factory, name: str, nproc: int, *extra, **kwargs):
    """Each configuration runs once per test session; the tests compare the folders."""
    if name not in _runs:
        _runs[name] = run_split(tmp_path_factory.mktemp(name), nproc, *extra, **kwargs)
    return _runs[name]


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_split_of_the_envs_computes_the_same_experiment(tmp_path_factory, nproc):
    one = run_once(tmp_path_factory, "1x4", 1)
    split = run_once(tmp_path_factory, f"{nproc}x{ENVS // nproc}", nproc)
    logged = assert_same_experiment(one, split)
    assert max(kl for _, kl in logged["losses/approx_kl"]) > 1e-5  # the updates did move the policy
    # Rank r's actions are the 1-process run's actions of envs r * n .. (r + 1) * n - 1, in every iteration.
    whole = recorded(one, 0)["actions"]
    parts = [recorded(split, rank)["actions"] for rank in range(nproc)]
    for iteration in range(ITERATIONS):
        assert torch.equal(whole[iteration], torch.cat([p[iteration] for p in parts], dim=1))


@pytest.mark.parametrize("nproc", [2, 8])
def test_64_envs_of_16_steps_are_one_experiment_on_1_2_or_8_processes(tmp_path_factory, nproc):
    """The published batch with 64 envs: 64 x 16 steps = 1,024, 4 minibatches of 256, 4 epochs, 16 Adam steps
    per iteration, whether 1 x 64, 2 x 32 or 8 x 8 processes x envs compute it. Two iterations: too short for a
    game to end, so the actions stand for the games."""
    shape = ["--num-steps", "16", "--num-minibatches", "4"]
    one = run_once(tmp_path_factory, "1x64x16", 1, iterations=2, envs=64, shape=shape)
    split = run_once(tmp_path_factory, f"{nproc}x{64 // nproc}x16", nproc, iterations=2, envs=64, shape=shape)
    for run, processes in ((one, 1), (split, nproc)):
        banner = (run / "console.txt").read_text()
        assert ("experiment: 64 envs x 16 steps = batch 1,024 | minibatch 256 | 16 Adam steps per iteration "
                "(4 epochs x 4 minibatches) | 2 iterations") in banner
        assert f"split: {processes} processes x {64 // processes} envs | local batch {1024 // processes:,} | " in banner
    logged = assert_same_experiment(one, split, batch=1024, iterations=2, games_end=False)
    assert max(kl for _, kl in logged["losses/approx_kl"]) > 1e-5  # the updates did move the policy
    whole = recorded(one, 0)["actions"]
    for iteration in range(2):
        parts = torch.cat([recorded(split, rank)["actions"][iteration] for rank in range(nproc)], dim=1)
        assert parts.shape == (16, 64) and torch.equal(whole[iteration], parts)
        assert len(parts.unique()) == 4  # sampled, not one action everywhere


def test_double_buffered_envs_compute_the_same_experiment(tmp_path_factory):
    one = run_once(tmp_path_factory, "1x4", 1)
    assert_same_experiment(one, run_once(tmp_path_factory, "2x2-double", 2, "--vector-env", "double"))


def test_ale_vector_env_splits_compute_the_same_experiment(tmp_path_factory):
    one = run_once(tmp_path_factory, "1x4-ale", 1, "--vector-env", "ale")
    assert_same_experiment(one, run_once(tmp_path_factory, "2x2-ale", 2, "--vector-env", "ale"))


def test_early_stop_on_the_global_kl_is_the_same_in_every_split(tmp_path_factory):
    one = run_once(tmp_path_factory, "1x4-kl", 1, "--target-kl", "0.0001")
    logged = assert_same_experiment(one, run_once(tmp_path_factory, "2x2-kl", 2, "--target-kl", "0.0001"))
    assert min(epochs for _, epochs in logged["charts/update_epochs"]) < 4  # it did stop early


def test_float32_splits_take_the_same_actions_and_end_within_rounding(tmp_path_factory):
    one = run_once(tmp_path_factory, "1x4-fp32", 1, iterations=1, dtype="float32")
    two = run_once(tmp_path_factory, "2x2-fp32", 2, iterations=1, dtype="float32")
    actions = recorded(one, 0)["actions"][0]
    assert torch.equal(actions, torch.cat([recorded(two, rank)["actions"][0] for rank in range(2)], dim=1))
    assert len(actions.unique()) == 4  # sampled, not one action everywhere
    # In float32 the two differ only in the order of sums. One iteration is 4 epochs x 2 minibatches = 8 Adam
    # steps. After each, a weight can round to float32 differently by one unit in the last place (|w| < 1:
    # at most 2^-24 ~ 6e-8), at most 5e-7 over 8 steps. A relative rounding difference r of a gradient (float32
    # sums of at most ~1e4 terms: r ~ 1e-6) moves Adam's step lr * m / (sqrt(v) + eps) by at most about lr * r
    # = 2.5e-10 per step. So the parameters agree within ~5e-7 (measured: 5e-8). The tolerance is 20 times that,
    # and 1/25 of lr = 2.5e-4, the size of a step that a per-process shuffle or normalisation would change.
    tolerance = 1e-5
    final_one, final_two = final_parameters(one), final_parameters(two)
    torch.manual_seed(1)  # the script's initial weights (--seed 1)
    initial = ppo.Agent(num_actions=4).state_dict()
    assert max(float(p.abs().max()) for p in final_one.values()) < 1
    assert max(float((final_one[name] - initial[name]).abs().max()) for name in initial) > 100 * tolerance
    assert max(float((final_one[name] - final_two[name]).abs().max()) for name in initial) < tolerance


def resumed_draws(run) -> dict:
    """What rank 0 drew in the first iteration of a run."""
    record = recorded(run, 0)
    return {"gumbel": record["gumbel"][0], "minibatches": record["minibatches"][0]}


@pytest.mark.parametrize("nproc", [1, 4])
def test_resume_on_another_number_of_processes_continues_the_run(tmp_path_factory, nproc):
    uninterrupted = run_once(tmp_path_factory, "2x2", 2)
    stopped = run_once(tmp_path_factory, "2x2-stopped", 2, iterations=ITERATIONS - 1)
    (checkpoint,) = (stopped / "checkpoints" / RUN_ID).glob("checkpoint_*.pt")
    resumed = run_split(tmp_path_factory.mktemp(f"resumed-{nproc}x{ENVS // nproc}"), nproc, "--resume", str(checkpoint))
    # Iteration 3 of the resumed run drew the noise and minibatches of iteration 3 of the uninterrupted one.
    expected = recorded(uninterrupted, 0)
    for rank in range(nproc):
        record = recorded(resumed, rank)
        assert len(record["gumbel"]) == len(record["minibatches"]) == 1
        assert torch.equal(record["gumbel"][0], expected["gumbel"][ITERATIONS - 1])
        assert torch.equal(record["minibatches"][0], expected["minibatches"][ITERATIONS - 1])
        assert not torch.equal(record["gumbel"][0], expected["gumbel"][ITERATIONS - 2])  # a fresh draw each iteration
        # Every process continues with the saved optimizer: Adam's step count and moments.
        saved = torch.load(checkpoint, weights_only=False)["optimizer"]["state"]
        assert len(record["optimizer"]) == len(saved)
        for index, state in enumerate(record["optimizer"]):
            assert float(state["step"]) == float(saved[index]["step"]) == 4 * NUM_MINIBATCHES * (ITERATIONS - 1)
            assert torch.equal(state["exp_avg"], saved[index]["exp_avg"])
            assert torch.equal(state["exp_avg_sq"], saved[index]["exp_avg_sq"])
    assert math.isfinite(scalars(resumed)["losses/value_loss"][-1][1])
