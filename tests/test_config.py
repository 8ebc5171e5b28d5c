"""Batch-size derivation and refusal of bad input: one clear line, non-zero exit on every rank, no hang."""

import dataclasses
import re
from typing import Optional

import pytest

import ppo_atari_multigpu as ppo
from conftest import ROOT, TINY, run_python, run_torchrun

ERROR_LINE = re.compile(r"^ppo_atari_multigpu\.py: error: .+$", re.MULTILINE)


def test_batch_sizes_scale_with_world_size():
    args = ppo.Args(local_num_envs=8, num_steps=128, num_minibatches=4, total_timesteps=10_000_000)
    one = ppo.batch_sizes(args, world_size=1)
    assert (one.num_envs, one.batch_size, one.minibatch_size) == (8, 1024, 256)
    assert (one.local_batch_size, one.local_minibatch_size, one.num_iterations) == (1024, 256, 9765)
    four = ppo.batch_sizes(args, world_size=4)
    assert (four.num_envs, four.batch_size, four.minibatch_size) == (32, 4096, 1024)
    assert (four.local_batch_size, four.local_minibatch_size, four.num_iterations) == (1024, 256, 2441)


def test_backend_is_chosen_only_for_a_group():
    # One process needs no process group, so no backend: a CUDA build without NCCL still trains on one GPU.
    assert ppo.choose_backend(None, world_size=1, cuda_ids=[0], nccl_available=False) == (None, None)
    assert ppo.choose_backend(None, world_size=2, cuda_ids=[], nccl_available=False) == ("gloo", None)
    assert ppo.choose_backend(None, world_size=2, cuda_ids=[0, 1], nccl_available=True) == ("nccl", None)
    backend, note = ppo.choose_backend(None, world_size=2, cuda_ids=[0, 1], nccl_available=False)
    assert backend == "gloo" and "no NCCL" in note
    # Two processes per GPU (as CleanRL's users run them): NCCL refuses it, so gloo is picked and said.
    backend, note = ppo.choose_backend(None, world_size=4, cuda_ids=[0, 0, 1, 1], nccl_available=True)
    assert backend == "gloo" and "share GPUs" in note
    assert ppo.choose_backend("gloo", world_size=2, cuda_ids=[0, 1], nccl_available=True) == ("gloo", None)


def test_check_args_returns_the_backend():
    args = ppo.Args()
    assert ppo.check_args(args, world_size=1, local_world_size=1, cuda_device_count=0) == (None, None)
    assert ppo.check_args(args, world_size=2, local_world_size=2, cuda_device_count=0) == ("gloo", None)
    backend, note = ppo.check_args(ppo.Args(device_ids=(0, 0)), world_size=2, local_world_size=2, cuda_device_count=1)
    assert backend == "gloo" and "share GPUs" in note


def test_devices_follow_device_ids():
    assert ppo.select_device(ppo.Args(), local_rank=1, cuda_device_count=2) == ppo.torch.device("cuda", 1)
    assert ppo.select_device(ppo.Args(device_ids=(2, 3)), local_rank=1, cuda_device_count=4) == ppo.torch.device("cuda", 3)
    # --eval-checkpoint runs as local rank 0 and honours --device-ids too
    assert ppo.select_device(ppo.Args(device_ids=(3,)), local_rank=0, cuda_device_count=4) == ppo.torch.device("cuda", 3)
    assert ppo.select_device(ppo.Args(device_ids=(3,)), local_rank=0, cuda_device_count=0) == ppo.torch.device("cpu")


def test_bf16_is_refused_on_gpus_without_it_and_noted_on_cpus_without_it():
    with pytest.raises(ppo.ConfigError, match="compute capability 8.0 or newer; this one has 7.0"):
        ppo.check_bf16("bf16", (7, 0), cpu_bf16=False)  # V100
    assert ppo.check_bf16("bf16", (8, 0), cpu_bf16=False) is None  # A100: the CPU does not matter
    assert ppo.check_bf16("fp32", (7, 5), cpu_bf16=False) is None
    assert ppo.check_bf16("bf16", None, cpu_bf16=True) is None  # a CPU with AVX-512 bf16 or AMX
    assert "no native bf16" in ppo.check_bf16("bf16", None, cpu_bf16=False)  # emulated: runs, with a note
    assert ppo.check_bf16("fp32", None, cpu_bf16=False) is None


FLOAT_ARGUMENTS = [f.name for f in dataclasses.fields(ppo.Args) if f.type in (float, Optional[float])]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_every_float_argument_must_be_finite(value):
    assert {"learning_rate", "gamma", "vf_coef", "ent_coef", "target_kl", "cost_per_hour"} <= set(FLOAT_ARGUMENTS)
    for name in FLOAT_ARGUMENTS:
        args = dataclasses.replace(ppo.Args(), **{name: value})
        with pytest.raises(ppo.ConfigError, match=f"--{name.replace('_', '-')} must be a finite number"):
            ppo.check_args(args, world_size=1, local_world_size=1, cuda_device_count=0)


def test_env_seeds_never_overlap_across_ranks():
    seeds = [s for rank in range(16) for s in ppo.env_seeds(seed=1, first=rank * 8, count=8)]
    assert len(seeds) == len(set(seeds)) == 128


def test_experiment_seeds_have_disjoint_env_seeds():
    # Seed 1 keeps env j -> 1 + j (its published results were computed so); seed s starts at 1 + (s - 1) * 2^20,
    # seed 0 at the last of the 2,048 blocks: 1 + 2047 * 1,048,576 = 2,146,435,073.
    assert ppo.env_seeds(1, 0, 3) == [1, 2, 3] and ppo.env_seeds(1, 80, 2) == [81, 82]
    assert ppo.env_seeds(2, 0, 2) == [1_048_577, 1_048_578] and ppo.env_seeds(3, 5, 1) == [2_097_158]
    assert ppo.env_seeds(0, 0, 1) == [2_146_435_073] and ppo.env_seeds(0, 2**20 - 2, 1) == [2**31 - 1]
    # A 10M-step run of 8 envs draws 8 fresh seeds at each of its 9,765 possible resumes: still disjoint.
    drawn = {s: set(ppo.env_seeds(s, 0, 9_766 * 8)) for s in (0, 1, 2, 3)}
    assert all(drawn[a].isdisjoint(drawn[b]) for a in drawn for b in drawn if a < b)


@pytest.mark.parametrize("settings, message", [
    ({"seed": 2048}, "--seed must be in 0..2047"), ({"seed": -1}, "--seed must be in 0..2047"),
    # 131,072 iterations x 8 envs could draw env seeds up to 1,048,575 past the first: one too many for seed 0's
    # block, whose last seed is 2^31 - 1; 131,071 iterations fit.
    ({"total_timesteps": 131_072 * 1024}, "could draw 1,048,576 env seeds .*more than the 1,048,575"),
])
def test_seeds_beyond_the_env_seed_blocks_are_refused(settings, message):
    with pytest.raises(ppo.ConfigError, match=message):
        ppo.check_args(ppo.Args(**settings), world_size=1, local_world_size=1, cuda_device_count=0)
    if "total_timesteps" in settings:
        ppo.check_args(ppo.Args(total_timesteps=131_071 * 1024), world_size=1, local_world_size=1, cuda_device_count=0)


@pytest.mark.parametrize(
    "device_ids, device_count, backend, message",
    [
        ((0, 0), 1, "nccl", "NCCL cannot run two processes on one GPU"),
        ((), 1, None, "do not all exist"),  # default cuda:<LOCAL_RANK> with 2 processes on a 1-GPU node
        ((0, 3), 2, "nccl", "do not all exist"),
    ],
)
def test_gpu_placement_is_checked(device_ids, device_count, backend, message):
    # The placement check is pure: it is shown here for a 1- and 2-GPU node; on CPU nodes it never applies.
    args = ppo.Args(device_ids=device_ids, backend=backend)
    with pytest.raises(ppo.ConfigError, match=message):
        ppo.check_args(args, world_size=2, local_world_size=2, cuda_device_count=device_count)


def test_gloo_may_share_a_gpu():
    args = ppo.Args(device_ids=(0, 0), backend="gloo")
    assert ppo.check_args(args, world_size=2, local_world_size=2, cuda_device_count=1) == ("gloo", None)


@pytest.mark.parametrize(
    "cli, message",
    [
        (["--backend", "nccl"], "--backend nccl needs CUDA"),
        (["--num-minibatches", "3"], "--num-minibatches 3 does not divide --num-steps 32"),
        (["--total-timesteps", "32"], "smaller than one global batch"),
        (["--local-num-envs", "0"], "--local-num-envs must be positive"),
        (["--num-steps", "-5"], "--num-steps must be positive"),
        (["--backend", "mpi"], "no 'mpi' backend"),
        (["--env-id", "NoSuchGameNoFrameskip-v4"], "unknown env id"),
        (["--env-id", "Pendulum-v1"], "Pendulum-v1 is not an Atari (ALE) environment"),
        (["--env-id", "HalfCheetah-v5"], "HalfCheetah-v5 is not an Atari"),  # mujoco is not installed
        (["--env-id", "CartPole-v1"], "not an Atari"),
        (["--device-ids", "0"], "--device-ids was given but CUDA is unavailable"),
        (["--vector-env", "double", "--local-num-envs", "1", "--num-minibatches", "1"], "must be at least 2"),
        (["--torch-threads", "0"], "--torch-threads must be positive"),
        (["--vf-coef", "nan"], "--vf-coef must be a finite number, got nan"),
        (["--target-kl", "-1"], "--target-kl must be positive, got -1.0"),
        (["--vector-env", "ale", "--env-threads", "0"], "--env-threads must be positive, got 0"),
        (["--vector-env", "ale", "--env-threads", "-2"], "--env-threads must be positive, got -2"),
        (["--env-threads", "2"], "--env-threads sets the threads of --vector-env ale or ale-double"),
        (["--vector-env", "ale", "--capture-video"], "ale-py's vector env renders no frames"),
    ],
)
def test_bad_input_single_process(tmp_path, cli, message):
    result = run_python([*TINY, "--total-timesteps", "1024", *cli], cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    errors = ERROR_LINE.findall(result.stderr)
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "cli, message",
    [
        (["--device-ids", "0", "1", "2"], "--device-ids names 3 devices but this node runs 2 processes"),
        # 64 steps would be one batch for one process, but the global batch of two is 128.
        (["--total-timesteps", "64"], "smaller than one global batch (128 = 2 processes"),
    ],
)
def test_bad_input_fails_every_rank_under_torchrun(tmp_path, cli, message):
    result = run_torchrun(2, [*TINY, "--total-timesteps", "1024", *cli], cwd=tmp_path, timeout=90)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output  # torchrun's own code for a failed worker: it does not pass ours on
    errors = ERROR_LINE.findall(output)
    assert len(errors) == 1 and message in errors[0], output  # one line for the node
    # torchrun's failure report gives each rank's exit code: every rank refused (2), none was stopped by the
    # SIGTERM torchrun sends the rest when the first exits. Neither rank ran on or hung.
    exit_codes = {int(rank): int(code) for rank, code in
                  re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", output)}
    assert exit_codes == {0: 2, 1: 2}, output
    assert 'ppo_atari_multigpu.py", line' not in output  # no traceback from the script itself


def slow_launcher(tmp_path, before_main: str):
    """A launcher around the unchanged script that runs `before_main` first (Python source)."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(f"""import os, sys, time
sys.path.insert(0, {str(ROOT)!r})
{before_main}
import ppo_atari_multigpu as ppo
ppo.main()
""")
    return launcher


def test_refusal_is_printed_when_local_rank_0_starts_late(tmp_path):
    # Local rank 1 refuses and exits while local rank 0 is still starting; torchrun then stops rank 0 with
    # SIGTERM before it can print. The reason must still reach the user, once.
    launcher = slow_launcher(tmp_path, 'if os.environ["LOCAL_RANK"] == "0":\n    time.sleep(60)')
    result = run_torchrun(2, [*TINY, "--total-timesteps", "64"], cwd=tmp_path, timeout=90, script=launcher)
    output = result.stdout + result.stderr
    errors = ERROR_LINE.findall(output)
    assert len(errors) == 1 and "smaller than one global batch" in errors[0], output
    exit_codes = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", output))
    assert exit_codes == {"1": "2", "0": "-15"}, output  # rank 0 was stopped while it slept
