"""The README's quick start, run as written: train under torchrun, stop it as Ctrl-C does, continue it, watch it in
TensorBoard, evaluate the final model and report the run. The commands are read from the README itself, so an
edit that breaks one fails here; the test only appends a tiny budget to each."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request

from conftest import ROOT, SCRIPT, free_port, script_env, wait_until

TINY_RUN = ["--total-timesteps", "4096", "--num-steps", "32", "--num-minibatches", "2"]  # 2 x 4 envs: 16 iterations
RUN_ID = "BreakoutNoFrameskip-v4__ppo_atari_multigpu__1"


def quick_start_commands() -> dict:
    """The quick start's commands by role, as the README writes them (one per line of its bash blocks)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start"):readme.index("\n## ", readme.index("## Quick start") + 1)]
    lines = [line.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)
             for line in block.splitlines()]
    roles = {"train": lambda c: c.startswith("torchrun") and "--resume" not in c,
             "resume": lambda c: c.startswith("torchrun") and "--resume auto" in c,
             "tensorboard": lambda c: c.startswith("tensorboard "),
             "evaluate": lambda c: c.startswith("python ppo_atari_multigpu.py --eval-checkpoint"),
             "report": lambda c: c.startswith("python benchmarks/report.py")}
    commands = {role: [line for line in lines if matches(line)] for role, matches in roles.items()}
    assert all(len(found) == 1 for found in commands.values()), commands
    return {role: shlex.split(found[0]) for role, found in commands.items()}


def as_run_here(command: list) -> list:
    """The same command with this interpreter: torchrun and tensorboard as the modules their entry points run."""
    launcher = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"],
                "tensorboard": [sys.executable, "-m", "tensorboard.main"]}[command[0]]
    return launcher + command[1:]


def test_the_quick_start_runs_as_written(tmp_path):
    commands = quick_start_commands()
    shutil.copy(SCRIPT, tmp_path)
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "report.py", tmp_path / "benchmarks")
    env = script_env()

    # Train, then Ctrl-C: the terminal sends SIGINT to torchrun and its workers (one process group).
    train = subprocess.Popen(as_run_here(commands["train"]) + TINY_RUN, cwd=tmp_path, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    output = []
    try:
        for line in train.stdout:
            output.append(line)
            if line.startswith("iter 1/16"):
                break
        os.killpg(train.pid, signal.SIGINT)
        output += train.stdout.readlines()
        returncode = train.wait(timeout=120)
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
    stopped = "".join(output)
    # The script's own lines end with its summary; torchrun then re-raises the signal it got and exits 1.
    assert returncode == 1, stopped
    summary = next(i for i, line in enumerate(output) if line.startswith("summary: interrupted"))
    assert "SignalException" in "".join(output[summary:]) and "Traceback" not in "".join(output[:summary]), stopped
    hint = re.search(r"^stopping on SIGINT after iteration \d+; resume with: (.*)$", stopped, re.M).group(1)
    assert shlex.split(hint) == commands["resume"][:-2] + TINY_RUN + ["--resume", "auto"], hint

    # Continue it to the end, as the README writes it.
    resumed = subprocess.run(as_run_here(commands["resume"]) + TINY_RUN, cwd=tmp_path, env=env, text=True,
                             capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert re.search(r"^resumed from checkpoints/.*checkpoint_\d+\.pt at iteration [1-9]", resumed.stdout, re.M)
    assert "summary: finished | 4,096 / 4,096 steps" in resumed.stdout
    assert (tmp_path / "checkpoints" / RUN_ID / "final_model.pt").is_file()

    # TensorBoard serves the run.
    port = free_port()
    board = subprocess.Popen(as_run_here(commands["tensorboard"]) + ["--port", str(port)], cwd=tmp_path, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def served_runs():
        try:
            with urllib.request.urlopen(f"http://localhost:{port}/data/runs", timeout=5) as response:
                return json.loads(response.read())
        except OSError:
            return None

    try:
        runs = wait_until(served_runs, timeout=60, interval=1)
    finally:
        board.kill()
        board.wait()
    assert len(runs) == 1 and runs[0].startswith(RUN_ID + "__"), runs

    evaluated = subprocess.run(as_run_here(commands["evaluate"]) + ["--eval-episodes", "2"], cwd=tmp_path, env=env,
                               text=True, capture_output=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert re.search(r"^eval BreakoutNoFrameskip-v4 .*final_model\.pt\): -?\d+\.\d\d \+- \d+\.\d\d over 2 games$",
                     evaluated.stdout, re.M), evaluated.stdout

    reported = subprocess.run(as_run_here(commands["report"]), cwd=tmp_path, env=env, text=True, capture_output=True,
                              timeout=300)
    assert reported.returncode == 0, reported.stderr[-3000:]
    report_dir = tmp_path / commands["report"][commands["report"].index("--out") + 1]
    assert (report_dir / "learning-BreakoutNoFrameskip-v4.png").is_file()
    table = (report_dir / "learning.md").read_text()
    assert "| BreakoutNoFrameskip-v4 | ppo_atari_multigpu | 1 |" in table, table
