"""A run's records stay true across resumes and forks: a run stopped, resumed from an older checkpoint (the
newer ones abandoned), stopped again and resumed with --resume auto logs what the same run logs straight (the
learning rate of every iteration, each iteration once, nothing kept from the abandoned part), and its console
counts its games and time over every part; a resume that changes the run's identity is a new run."""

import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ppo_atari_multigpu as ppo
from conftest import SCRIPT, run_python, scalars, script_env, wait_until

RUN_ID = "BreakoutNoFrameskip-v4__ppo_atari_multigpu__1"
ITERATIONS, BATCH = 40, 64  # 1 process x 2 envs x 32 steps
# A checkpoint at every iteration, all kept, so that the test can resume any of them.
JOB = ["--local-num-envs", "2", "--num-steps", "32", "--num-minibatches", "2",
       "--total-timesteps", str(ITERATIONS * BATCH), "--checkpoint-interval-minutes", "0.0001",
       "--checkpoint-keep", "1000"]


def checkpoint(cwd, iteration: int) -> Path:
    return cwd / "checkpoints" / RUN_ID / f"checkpoint_{iteration * BATCH:012d}.pt"


def run_until(cwd, args, stop_when) -> str:
    """Start the script, SIGTERM it once `stop_when()` holds, and return its output (it must stop with code 3)."""
    process = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=cwd, env=script_env(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(stop_when, timeout=240, interval=0.05)
        process.terminate()
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == ppo.EXIT_INTERRUPTED, output
    return output


def summary(output: str) -> re.Match:
    return re.search(r"^summary: (\w+) \| ([\d,]+) / [\d,]+ steps \| wall (\d+):(\d\d):(\d\d) \| .* \| return "
                     r"(-?[\d.]+|-) \(last (\d+) games\)", output, re.M)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("straight")
    result = run_python(JOB, cwd=cwd, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd, result.stdout


def test_a_stopped_and_resumed_run_logs_what_the_straight_run_logs(straight, tmp_path):
    straight_dir, _ = straight
    expected = scalars(straight_dir)
    games = expected["charts/episodic_return"]

    first = run_until(tmp_path, JOB, lambda: len(list(checkpoint(tmp_path, 0).parent.glob("checkpoint_*"))) >= 30)
    stopped_at = int(re.search(r"^stopping on SIGTERM after iteration (\d+)", first, re.M).group(1))
    # The checkpoint to go back to: a game ended in its iteration (its games must be in the checkpoint's last
    # 100), and the abandoned part after it is long enough to be told apart.
    ended_in = {math.ceil(step / BATCH) for step, _ in games}
    back_to = max(i for i in ended_in if 20 <= i <= stopped_at - 4)
    abandoned_line = sorted(p.name for p in checkpoint(tmp_path, 0).parent.glob("checkpoint_*")
                            if p.name > checkpoint(tmp_path, back_to).name)
    assert len(abandoned_line) >= 4

    second = run_until(tmp_path, [*JOB, "--resume", str(checkpoint(tmp_path, back_to))],
                       lambda: list(checkpoint(tmp_path, 0).parent.glob("abandoned_*"))  # the old line moved,
                       and checkpoint(tmp_path, back_to + 1).exists())  # then a checkpoint of the new one
    assert f"the {len(abandoned_line)} newer ones of the line it abandons" in second, second
    (aside,) = checkpoint(tmp_path, 0).parent.glob("abandoned_*")
    assert sorted(p.name for p in aside.glob("checkpoint_*")) == abandoned_line
    resumed_at = int(re.search(r"^stopping on SIGTERM after iteration (\d+)", second, re.M).group(1))
    assert resumed_at < stopped_at

    # --resume auto continues the line resumed last, not the abandoned one's newer checkpoints.
    started = time.monotonic()
    last_part = subprocess.run([sys.executable, str(SCRIPT), *JOB, "--resume", "auto"], cwd=tmp_path,
                               env=script_env(), text=True, capture_output=True, timeout=300)
    last_part_seconds = time.monotonic() - started
    assert last_part.returncode == 0, last_part.stderr[-3000:]
    assert f"resumed from {checkpoint(tmp_path, resumed_at).relative_to(tmp_path)} at iteration {resumed_at} " \
           in last_part.stdout, last_part.stdout

    logged = scalars(tmp_path)
    # The schedule of every iteration, as the straight run's: no restart at any resume.
    assert logged["charts/learning_rate"] == expected["charts/learning_rate"]
    assert [step for step, _ in logged["charts/learning_rate"]] == [BATCH * i for i in range(1, ITERATIONS + 1)]
    # Every iteration logged once; nothing kept from the abandoned part (its events were on disk: the stop
    # closed the log).
    for tag in expected:
        if not tag.startswith("charts/episodic"):
            assert [step for step, _ in logged[tag]] == [step for step, _ in expected[tag]], tag
    # Up to the checkpoint resumed, the same games as the straight run; after it, the resumed envs' own.
    before = [game for game in games if game[0] <= back_to * BATCH]
    resumed_games = logged["charts/episodic_return"]
    assert resumed_games[:len(before)] == before
    assert all(step > back_to * BATCH for step, _ in resumed_games[len(before):])

    # The console counts the last 100 games of every part, as logged.
    status, steps, hours, minutes, seconds, mean_return, count = summary(last_part.stdout).groups()
    recent = [value for _, value in resumed_games][-100:]
    assert (status, steps, int(count)) == ("finished", f"{ITERATIONS * BATCH:,}", len(recent))
    assert float(mean_return) == pytest.approx(sum(recent) / len(recent), abs=0.005)
    # The wall time is that of every part up to the checkpoint continued, plus the last part's.
    earlier = torch.load(checkpoint(tmp_path, resumed_at), weights_only=False)["elapsed"]
    assert earlier > torch.load(checkpoint(tmp_path, back_to), weights_only=False)["elapsed"]  # part two's time
    wall = 3600 * int(hours) + 60 * int(minutes) + int(seconds)
    assert int(earlier) <= wall <= earlier + last_part_seconds
    assert earlier > last_part_seconds  # so that a wall time of the last part alone would fail the line above


def test_a_fork_is_a_new_run_and_leaves_the_source_run_as_it_was(straight, tmp_path):
    for folder in ("runs", "checkpoints"):  # the source run's folder, to fork in
        shutil.copytree(straight[0] / folder, tmp_path / folder)
    straight_dir, source = tmp_path, checkpoint(tmp_path, 20)
    source_run = torch.load(source, weights_only=False)["run_name"]
    source_events = {p: p.read_bytes() for p in (straight_dir / "runs" / source_run).iterdir()}
    fork = run_python([*JOB, "--exp-name", "forked", "--resume", str(source)], cwd=straight_dir, timeout=300)
    assert fork.returncode == 0, fork.stderr[-3000:]
    new_run = re.search(r"^forked from run (\S+): a new run, (\S+)$", fork.stdout, re.M)
    assert new_run and new_run.group(1) == source_run and new_run.group(2).startswith(
        "BreakoutNoFrameskip-v4__forked__1__"), fork.stdout
    # The source's TensorBoard folder is untouched (no purge written into it); the fork has its own, from the
    # step after the one it forked at.
    assert {p: p.read_bytes() for p in (straight_dir / "runs" / source_run).iterdir()} == source_events
    assert sorted(p.name for p in (straight_dir / "runs").iterdir()) == sorted([source_run, new_run.group(2)])
    forked = scalars_of(straight_dir / "runs" / new_run.group(2))
    assert [step for step, _ in forked["charts/learning_rate"]] == [BATCH * i for i in range(21, ITERATIONS + 1)]
    assert (straight_dir / "checkpoints" / "BreakoutNoFrameskip-v4__forked__1" / "final_model.pt").is_file()

    # A fork into a folder that holds another run's checkpoints is refused, as a fresh run there would be.
    again = run_python([*JOB, "--exp-name", "forked", "--resume", str(source)], cwd=straight_dir, timeout=120)
    assert again.returncode == ppo.EXIT_CONFIG_ERROR
    assert f"a fork of {source} needs a folder of its own" in again.stderr, again.stderr


def scalars_of(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
