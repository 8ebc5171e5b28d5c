"""Checkpoints, resume, preemption, elastic restarts, numerical faults and evaluation, with real processes
and real signals."""

import hashlib
import os
import re
import shutil
import signal

import numpy as np
import pytest
import torch

import ppo_atari_multigpu as ppo
from conftest import (TINY, broken_copy, final_digests, run_python, run_torchrun, scalars, start_torchrun,
                      wait_until, worker_pids)

RUN_ID = "BreakoutNoFrameskip-v4__ppo_atari_multigpu__1"
GLOBAL_BATCH = 128  # 2 processes x 2 envs x 32 steps


def logged_steps(cwd) -> list:
    try:
        return [step for step, _ in scalars(cwd).get("losses/value_loss", [])]
    except (AssertionError, KeyError):
        return []


def checkpoints(cwd) -> list:
    return sorted((cwd / "checkpoints" / RUN_ID).glob("checkpoint_*.pt"))


def digest_of(path) -> str:
    agent = ppo.Agent(num_actions=4)
    agent.load_state_dict(torch.load(path, map_location="cpu", weights_only=False)["model"])
    return ppo.parameter_digest(agent.parameters())


def torchrun_exit_codes(output: str) -> dict:
    return {int(rank): int(code) for rank, code in
            re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", output)}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished single-process run of 2 iterations: its checkpoint, final model and output."""
    cwd = tmp_path_factory.mktemp("finished")
    result = run_python([*TINY, "--total-timesteps", "128", "--cost-per-hour", "3.6"], cwd=cwd)
    assert result.returncode == 0, result.stderr
    return cwd, result


def test_finished_run_saves_checkpoint_final_model_and_summary(finished_run):
    cwd, result = finished_run
    (checkpoint,) = checkpoints(cwd)
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert state["iteration"] == 2 and state["global_step"] == 128 and state["args"]["env_id"] == "BreakoutNoFrameskip-v4"
    assert {"model", "optimizer", "shared_rng", "run_name", "elapsed"} <= set(state)
    assert (cwd / "checkpoints" / RUN_ID / "final_model.pt").is_file()
    assert not list((cwd / "checkpoints" / RUN_ID).glob(".*.tmp"))  # no half-written leftovers
    summary = next(line for line in result.stdout.splitlines() if line.startswith("summary:"))
    assert "finished | 128 / 128 steps" in summary and str(checkpoint.relative_to(cwd)) in summary
    assert re.search(r"cost \d+\.\d\d", summary)


def test_signal_to_one_rank_stops_every_rank_and_resume_reaches_the_exact_total(tmp_path):
    total_iterations = 12
    args = [*TINY, "--total-timesteps", str(total_iterations * GLOBAL_BATCH), "--checkpoint-interval-minutes", "0"]
    launcher = start_torchrun(2, args, tmp_path)
    wait_until(lambda: len(logged_steps(tmp_path)) >= 2, timeout=120)
    os.kill(worker_pids(launcher.pid)[1], signal.SIGUSR1)  # only rank 1 is told
    output, _ = launcher.communicate(timeout=60)
    assert "stopping on a signal to another rank" in output  # rank 0 learnt it through the collective
    # Both ranks leave with the "interrupted" code, even the one torchrun sends SIGTERM to when the other exits first.
    assert torchrun_exit_codes(output) == {0: ppo.EXIT_INTERRUPTED, 1: ppo.EXIT_INTERRUPTED}, output
    assert "summary: interrupted" in output
    (checkpoint,) = checkpoints(tmp_path)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert 2 <= saved["iteration"] < total_iterations
    saved_digest = digest_of(checkpoint)

    result = run_torchrun(2, [*args, "--resume", "auto"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resumed from {checkpoint.relative_to(tmp_path)} at iteration {saved['iteration']}" in result.stdout
    assert f"parameter digest {saved_digest}" in result.stdout  # the parameters right after resume are the saved ones
    # Fresh env seeds: the job's 4 envs (2 x 2) used 1..4; after iteration i they take 1 + 4i .. 4 + 4i.
    first = 1 + 4 * saved["iteration"]
    assert f"rank 1: " in result.stdout and f"env seeds {first + 2}..{first + 3}\n" in result.stdout
    # One TensorBoard run, every iteration exactly once: nothing lost, nothing logged twice.
    assert logged_steps(tmp_path) == [GLOBAL_BATCH * i for i in range(1, total_iterations + 1)]
    assert f"summary: finished | {total_iterations * GLOBAL_BATCH:,} / {total_iterations * GLOBAL_BATCH:,} steps" in result.stdout
    assert len(set(final_digests(result.stdout).values())) == 1


def test_a_fresh_run_never_overwrites_an_earlier_runs_checkpoints(finished_run, tmp_path):
    shutil.copytree(finished_run[0], tmp_path, dirs_exist_ok=True)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "checkpoints" / RUN_ID).iterdir()}
    # The same env, --exp-name and seed, without --resume: a sweep's second run, on 2 processes here.
    result = run_torchrun(2, [*TINY, "--total-timesteps", "384", "--checkpoint-interval-minutes", "0.0001"], cwd=tmp_path)
    assert torchrun_exit_codes(result.stderr) == {0: ppo.EXIT_CONFIG_ERROR, 1: ppo.EXIT_CONFIG_ERROR}
    assert [line for line in result.stderr.splitlines() if "error:" in line] == [
        f"ppo_atari_multigpu.py: error: checkpoints/{RUN_ID} holds the checkpoints of an earlier run of this env, "
        "--exp-name and --seed: continue it with --resume auto, or name this run with another --exp-name"]
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "checkpoints" / RUN_ID).iterdir()}
    assert after == before and len(list((tmp_path / "runs").iterdir())) == 1  # nothing written, nothing deleted
    # --resume auto with nothing to continue says so, then starts.
    result = run_python([*TINY, "--total-timesteps", "64", "--resume", "auto", "--exp-name", "other"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ("note: --resume auto found no checkpoint in checkpoints/BreakoutNoFrameskip-v4__other__1: starting a new "
            "run\n") in result.stdout


def test_sigterm_to_the_launcher_checkpoints_and_exits_within_seconds(tmp_path):
    launcher = start_torchrun(2, [*TINY, "--total-timesteps", str(40 * GLOBAL_BATCH)], tmp_path)
    wait_until(lambda: len(logged_steps(tmp_path)) >= 1, timeout=120)
    launcher.send_signal(signal.SIGTERM)  # what a cloud preemption or a scheduler sends
    output, _ = launcher.communicate(timeout=30)
    assert launcher.returncode != 0
    assert "stopping on SIGTERM" in output and "summary: interrupted" in output
    assert len(checkpoints(tmp_path)) == 1


def test_killed_rank_is_restarted_by_torchrun_and_the_run_finishes(tmp_path):
    total_iterations = 10
    args = [*TINY, "--total-timesteps", str(total_iterations * GLOBAL_BATCH), "--resume", "auto",
            "--checkpoint-interval-minutes", "0.0001"]  # a checkpoint after every iteration
    launcher = start_torchrun(2, args, tmp_path, extra=("--standalone", "--nnodes=1", "--max-restarts=1"))
    wait_until(lambda: len(checkpoints(tmp_path)) >= 1 and len(logged_steps(tmp_path)) >= 3, timeout=120)
    os.kill(worker_pids(launcher.pid)[1], signal.SIGKILL)  # no warning, no checkpoint from this rank
    output, _ = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, output
    assert "resumed from checkpoints/" in output
    assert f"summary: finished | {total_iterations * GLOBAL_BATCH:,} / {total_iterations * GLOBAL_BATCH:,} steps" in output
    assert logged_steps(tmp_path) == [GLOBAL_BATCH * i for i in range(1, total_iterations + 1)]


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_checkpoint_is_refused(finished_run, tmp_path, damage):
    (checkpoint,) = checkpoints(finished_run[0])
    damaged = tmp_path / "damaged.pt"
    data = checkpoint.read_bytes()
    damaged.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    result = run_python([*TINY, "--total-timesteps", "256", "--resume", str(damaged)], cwd=tmp_path)
    assert result.returncode == ppo.EXIT_CONFIG_ERROR
    assert re.search(r"^ppo_atari_multigpu\.py: error: checkpoint .*damaged\.pt is unreadable", result.stderr, re.M)
    assert "Traceback" not in result.stderr


class RunsCode:
    """Unpickling it calls os.system: what a checkpoint from an untrusted source can hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_checkpoint_that_would_run_code_is_refused(finished_run, tmp_path):
    marker = tmp_path / "code-ran"
    (checkpoint,) = checkpoints(finished_run[0])
    hostile = tmp_path / "hostile.pt"
    torch.save({**torch.load(checkpoint, weights_only=True), "model": RunsCode(marker)}, hostile)
    torch.load(hostile, weights_only=False)  # the loader the script used before: it runs the file's code
    assert marker.exists()
    marker.unlink()
    for cli in (["--eval-checkpoint", str(hostile)], [*TINY, "--total-timesteps", "256", "--resume", str(hostile)]):
        result = run_python(cli, cwd=tmp_path)
        assert result.returncode == ppo.EXIT_CONFIG_ERROR
        assert [line for line in result.stderr.splitlines() if "error" in line] == [
            f"ppo_atari_multigpu.py: error: checkpoint {hostile} is refused: it is not plain data, and unpickling it "
            "would run code (Trying to load unsupported GLOBAL posix.system whose module posix is blocked.); "
            "checkpoints are loaded as data only"]
        assert not marker.exists()


@pytest.mark.parametrize("cli, message", [
    (["--env-id", "PongNoFrameskip-v4"], "cannot resume: the checkpoint trained BreakoutNoFrameskip-v4"),
    (["--num-steps", "16"], "cannot resume: the checkpoint's global batch was 64 transitions (2 envs x 32 steps), "
     "this run's is 32 (2 x 16); --local-num-envs 2 keeps the job's 2 envs on 1 process, with --num-steps 32"),
    (["--local-num-envs", "1"], "this run's is 32 (1 x 32); --local-num-envs 2 keeps the job's 2 envs on 1 process\n"),
])
def test_incompatible_resume_is_refused(finished_run, tmp_path, cli, message):
    (checkpoint,) = checkpoints(finished_run[0])
    result = run_python([*TINY, "--total-timesteps", "256", "--resume", str(checkpoint), *cli], cwd=tmp_path)
    assert result.returncode == ppo.EXIT_CONFIG_ERROR
    assert message in result.stderr and "Traceback" not in result.stderr


def test_refused_resume_names_the_local_num_envs_for_this_number_of_processes():
    saved = {"args": ppo.asdict(ppo.Args(local_num_envs=3, num_steps=32)), "world_size": 2}  # 6 envs
    with pytest.raises(ppo.ConfigError, match=r"\(6 envs x 32 steps\), this run's is 128 \(4 x 32\); "
                       r"--local-num-envs 3 keeps the job's 6 envs on 2 processes$"):
        ppo.check_resume(saved, ppo.Args(local_num_envs=2, num_steps=32), world_size=2)
    with pytest.raises(ppo.ConfigError, match=r"no --local-num-envs keeps the job's 6 envs on 4 processes: use a "
                       r"number of processes that divides 6$"):
        ppo.check_resume(saved, ppo.Args(local_num_envs=1, num_steps=32), world_size=4)
    assert ppo.check_resume(saved, ppo.Args(local_num_envs=6, num_steps=32), world_size=1) == []  # the same job


def test_resume_says_where_the_experiment_changes():
    job = dict(local_num_envs=2, num_steps=32)  # 64 steps per iteration
    saved = {"args": ppo.asdict(ppo.Args(**job, total_timesteps=2560)), "world_size": 1, "iteration": 20}
    # 40 iterations, resumed at iteration 21 with 80: the new schedule gives it (1 - 20/80) * 2.5e-4 = 1.875e-4,
    # up from the old schedule's (1 - 20/40) * 2.5e-4 = 1.25e-4.
    assert ppo.check_resume(saved, ppo.Args(**job, total_timesteps=5120), world_size=1) == [
        "total_timesteps 2560 -> 5120",
        "the annealed learning rate follows the new total's schedule: at iteration 21 it is 0.0001875, not 0.000125"]
    assert ppo.check_resume(saved, ppo.Args(**job, total_timesteps=5120, anneal_lr=False), world_size=1) == [
        "total_timesteps 2560 -> 5120", "anneal_lr True -> False"]
    # ale-py's resets are another experiment; the Python stack's speed options are not.
    assert ppo.check_resume(saved, ppo.Args(**job, total_timesteps=2560, vector_env="ale"), world_size=1) == [
        "vector_env sync -> ale: ale-py's resets differ from the Python stack's (see the README), another experiment"]
    assert ppo.check_resume(saved, ppo.Args(**job, total_timesteps=2560, vector_env="double"), world_size=1) == []


def test_processes_whose_weights_differ_stop_before_a_checkpoint(tmp_path):
    # A copy whose process 1 steps on a slightly different gradient: the weights drift apart from the first
    # update, and the check before the first checkpoint (after iteration 1) must stop the run there.
    broken = broken_copy(tmp_path, "                all_reduce_mean_(flat_grad, world_size)\n",
                         "                all_reduce_mean_(flat_grad, world_size).add_(1e-3 * dist.get_rank())\n")
    (tmp_path / "run").mkdir()
    result = run_torchrun(2, [*TINY, "--total-timesteps", "512", "--checkpoint-interval-minutes", "0.0001"],
                          cwd=tmp_path / "run", script=broken)
    assert torchrun_exit_codes(result.stderr) == {0: ppo.EXIT_RANKS_DISAGREE, 1: ppo.EXIT_RANKS_DISAGREE}
    assert re.search(r"^error: processes 1 hold parameters different from process 0's after iteration 1 \(digests "
                     r"\w+ \w+\); stopping without writing a checkpoint. Last good checkpoint: none$", result.stderr, re.M)
    assert 'ppo_atari_multigpu.py", line' not in result.stderr  # no traceback from the processes themselves
    assert not list((tmp_path / "run" / "checkpoints").rglob("*.pt"))


def test_resume_with_more_steps_is_allowed_and_said(finished_run, tmp_path):
    shutil.copytree(finished_run[0], tmp_path, dirs_exist_ok=True)
    result = run_python([*TINY, "--total-timesteps", "256", "--resume", "auto"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "note: resuming with a changed setting: total_timesteps 128 -> 256" in result.stdout
    assert logged_steps(tmp_path) == [64, 128, 192, 256]


def test_non_finite_loss_stops_without_overwriting_the_last_good_checkpoint(finished_run, tmp_path):
    shutil.copytree(finished_run[0], tmp_path, dirs_exist_ok=True)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "checkpoints" / RUN_ID).iterdir()}
    # An absurd learning rate drives the weights to infinity within the first update.
    result = run_python([*TINY, "--total-timesteps", "512", "--resume", "auto", "--learning-rate", "1e30",
                         "--checkpoint-interval-minutes", "0.0001"], cwd=tmp_path)
    assert result.returncode == ppo.EXIT_NON_FINITE
    assert re.search(r"non-finite loss or gradient at iteration 3 \(global step 192\)", result.stderr)
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "checkpoints" / RUN_ID).iterdir()}
    assert after == before


def test_evaluation_prints_a_return_per_game(finished_run):
    cwd, _ = finished_run
    result = run_python(["--eval-checkpoint", str(cwd / "checkpoints" / RUN_ID / "final_model.pt"),
                         "--eval-episodes", "2", "--local-num-envs", "2"], cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert len(re.findall(r"^eval episode \d/2: return -?\d+\.\d$", result.stdout, re.M)) == 2
    assert re.search(r"^eval BreakoutNoFrameskip-v4 .*: -?\d+\.\d\d \+- \d+\.\d\d over 2 games$", result.stdout, re.M)


def test_capture_video_without_moviepy_names_the_package(tmp_path):
    # moviepy is a test dependency, so its absence is simulated: a package of that name that fails to import.
    hidden = tmp_path / "hide"
    (hidden / "moviepy").mkdir(parents=True)
    (hidden / "moviepy" / "__init__.py").write_text("raise ImportError('No module named moviepy')\n")
    result = run_python([*TINY, "--total-timesteps", "128", "--capture-video"], cwd=tmp_path,
                        extra_env={"PYTHONPATH": str(hidden)})
    assert result.returncode == ppo.EXIT_CONFIG_ERROR
    assert "--capture-video needs moviepy: pip install moviepy" in result.stderr


def test_capture_video_records_rank_0_in_training_and_every_evaluation_game(tmp_path):
    result = run_torchrun(2, [*TINY, "--total-timesteps", "128", "--capture-video"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    (training_videos,) = (tmp_path / "videos").iterdir()  # one folder: only global rank 0 records
    assert training_videos.name.startswith(RUN_ID) and list(training_videos.glob("*.mp4"))
    final_model = tmp_path / "checkpoints" / RUN_ID / "final_model.pt"
    result = run_python(["--eval-checkpoint", str(final_model), "--eval-episodes", "2", "--local-num-envs", "1",
                         "--capture-video"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    videos = sorted((tmp_path / "videos" / "eval__final_model").glob("*.mp4"))
    assert len(videos) == 2 and all(v.stat().st_size > 1000 for v in videos)


class GameLog(ppo.gym.vector.VectorWrapper):
    """The real vector env, noting which env finished each game, in order."""

    def __init__(self, env):
        super().__init__(env)
        self.games = []

    def step(self, actions):
        result = self.env.step(actions)
        final = result[4].get("final_info", {})
        if "episode" in final:
            self.games += [(int(i), float(final["episode"]["r"][i])) for i in np.flatnonzero(final["_episode"])]
        return result


def test_evaluation_takes_a_fixed_quota_of_games_from_every_env(tmp_path, monkeypatch):
    # An untrained policy, 4 games on 2 envs: 2 from each. With evaluation seed 1, env 1 finishes three games
    # before env 0 finishes its second; taking the first 4 games to end would count env 1's third game (short
    # games would be over-represented) and drop env 0's second.
    torch.manual_seed(0)
    model = tmp_path / "untrained.pt"
    torch.save({"model": ppo.Agent(4).state_dict(), "args": ppo.asdict(ppo.Args())}, model)
    logs, make = [], ppo.make_vector_env
    monkeypatch.setattr(ppo, "make_vector_env", lambda *a, **k: logs.append(GameLog(make(*a, **k))) or logs[-1])
    returns = ppo.evaluate(str(model), 4, 2, torch.device("cpu"), seed=1)
    order = [env for env, _ in logs[0].games]
    assert order.index(0, order.index(0) + 1) > [i for i, env in enumerate(order) if env == 1][2]  # the case above
    quota = [(env, r) for n, (env, r) in enumerate(logs[0].games) if order[:n + 1].count(env) <= 2]
    assert returns == [r for _, r in quota] and len(returns) == 4


def test_evaluation_plays_the_resets_the_policy_was_trained_with(tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    model = tmp_path / "trained_on_ale.pt"
    torch.save({"model": ppo.Agent(4).state_dict(), "args": ppo.asdict(ppo.Args(vector_env="ale"))}, model)
    built, ale_games = [], ppo.AtariVectorGames
    monkeypatch.setattr(ppo, "AtariVectorGames", lambda *args: built.append(args) or ale_games(*args))
    assert len(ppo.evaluate(str(model), 2, 2, torch.device("cpu"), seed=1)) == 2
    assert [args[:2] for args in built] == [("BreakoutNoFrameskip-v4", 2)]
    assert "under the ale resets" in capsys.readouterr().out
    assert len(ppo.evaluate(str(model), 2, 2, torch.device("cpu"), seed=1, protocol="python")) == 2
    assert len(built) == 1 and "under the python resets" in capsys.readouterr().out


def test_evaluation_quotas_sum_to_the_games_asked_for():
    # The remainder goes one game each to the first envs: 5 on 2 -> 3 + 2; 4 on 3 -> 2 + 1 + 1; 30 on 8 -> 6 x 4 + 2 x 3.
    assert ppo.eval_quotas(5, 2) == [3, 2]
    assert ppo.eval_quotas(4, 3) == [2, 1, 1]
    assert ppo.eval_quotas(30, 8) == [4, 4, 4, 4, 4, 4, 3, 3]
    assert ppo.eval_quotas(2, 2) == [1, 1]
