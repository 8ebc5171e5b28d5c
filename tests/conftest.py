"""Helpers to run the real script (plain python or torchrun) in a scratch folder and read what it logged."""

import glob
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ppo_atari_multigpu.py"
sys.path.insert(0, str(ROOT))

# A tiny but real configuration: 2 envs x 32 steps per process, 2 minibatches, 4 epochs.
TINY = ["--local-num-envs", "2", "--num-steps", "32", "--num-minibatches", "2"]


def script_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(args, cwd, timeout=120, extra_env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env={**script_env(), **(extra_env or {})},
                          capture_output=True, text=True, timeout=timeout)


def torchrun_cmd(nproc: int, args, extra=("--standalone", "--nnodes=1")) -> list:
    return [sys.executable, "-m", "torch.distributed.run", *extra, f"--nproc-per-node={nproc}", str(SCRIPT), *args]


def run_torchrun(nproc, args, cwd, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(nproc, args), cwd=cwd, env=script_env(),
                          capture_output=True, text=True, timeout=timeout)


def event_files(cwd) -> list:
    return sorted(glob.glob(str(Path(cwd) / "runs" / "*" / "events.out.tfevents.*")))


def scalars(cwd) -> dict:
    """{tag: [(step, value), ...]} from the single TensorBoard run under cwd/runs, via tensorboard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = glob.glob(str(Path(cwd) / "runs" / "*"))
    assert len(runs) == 1, runs
    acc = EventAccumulator(runs[0], size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def final_digests(output: str) -> dict:
    line = next(l for l in output.splitlines() if l.startswith("final parameter digest per rank:"))
    return dict(item.split(":") for item in line.split(": ", 1)[1].split())


def start_torchrun(nproc, args, cwd, extra=("--standalone", "--nnodes=1")) -> subprocess.Popen:
    return subprocess.Popen(torchrun_cmd(nproc, args, extra), cwd=cwd, env=script_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def worker_pids(launcher_pid: int) -> dict:
    """{global rank: pid} of the processes torchrun started (read from /proc, Linux)."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    pids = {}
    for child in children:
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        for item in environ:
            if item.startswith(b"RANK="):
                pids[int(item[5:])] = int(child)
    return pids


def wait_until(predicate, timeout: float, interval: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("condition not reached in time")
