"""Helpers to run the real script (plain python or torchrun) in a scratch folder and read what it logged."""

import glob
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ppo_atari_multigpu.py"
sys.path.insert(0, str(ROOT))

import pytest

# Every process a test starts carries this variable (torchrun passes it to its workers, they to their env
# workers), so that whatever a test leaves running can be found and killed when it ends.
TAG_VARIABLE = "PPO_TEST_PROCESS_TAG"
_current_tag = [f"session-{os.getpid()}"]

# A tiny but real configuration: 2 envs x 32 steps per process, 2 minibatches, 4 epochs.
TINY = ["--local-num-envs", "2", "--num-steps", "32", "--num-minibatches", "2"]


def script_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{TAG_VARIABLE: _current_tag[0]})
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(args, cwd, timeout=120, extra_env=None, script=SCRIPT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env={**script_env(), **(extra_env or {})},
                          capture_output=True, text=True, timeout=timeout)


def torchrun_cmd(nproc: int, args, extra=("--standalone", "--nnodes=1"), script=SCRIPT) -> list:
    return [sys.executable, "-m", "torch.distributed.run", *extra, f"--nproc-per-node={nproc}", str(script), *args]


def run_torchrun(nproc, args, cwd, timeout=180, script=SCRIPT) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(nproc, args, script=script), cwd=cwd, env=script_env(),
                          capture_output=True, text=True, timeout=timeout)


def no_core_files() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGABRT would otherwise dump a core per process


def run_nodes(args, cwd, timeout: float, script=SCRIPT, nodes: int = 2) -> list:
    """Run one single-process torchrun per 'node' on this machine; return [(returncode, stdout, stderr)] by node.

    Each node writes to its own files, so none can block on a full pipe while another is read. torchrun logs
    each stage (LOGLEVEL=INFO); a job still running at the deadline gets SIGABRT on every process, which makes
    each one print its threads' stacks (PYTHONFAULTHANDLER), and the test fails with all of it.
    """
    port, cwd = free_port(), Path(cwd)
    env = {**script_env(), "PYTHONFAULTHANDLER": "1", "LOGLEVEL": "INFO"}
    jobs = []
    for node in range(nodes):
        extra = (f"--nnodes={nodes}", f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}")
        with open(cwd / f"node{node}.out", "w") as out, open(cwd / f"node{node}.err", "w") as err:
            jobs.append(subprocess.Popen(torchrun_cmd(1, args, extra, script), cwd=cwd, env=env, stdout=out,
                                         stderr=err, preexec_fn=no_core_files))
    deadline = time.time() + timeout
    try:
        for job in jobs:
            job.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        for pid in tagged_pids(_current_tag[0]):
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        for job in jobs:
            job.wait(timeout=30)
        logs = "\n".join(f"--- node {n} stdout:\n{(cwd / f'node{n}.out').read_text()[-3000:]}\n--- node {n} stderr:\n"
                         f"{(cwd / f'node{n}.err').read_text()[-12000:]}" for n in range(nodes))
        raise AssertionError(f"the {nodes} nodes were still running after {timeout} s:\n{logs}") from None
    return [(job.returncode, (cwd / f"node{n}.out").read_text(), (cwd / f"node{n}.err").read_text())
            for n, job in enumerate(jobs)]


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


def start_torchrun(nproc, args, cwd, extra=("--standalone", "--nnodes=1"), script=SCRIPT) -> subprocess.Popen:
    return subprocess.Popen(torchrun_cmd(nproc, args, extra, script), cwd=cwd, env=script_env(), stdout=subprocess.PIPE,
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


def tagged_pids(tag: str) -> list:
    """Live processes (Linux /proc) that carry `tag` in their environment."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile, or a zombie
                pass
    return pids


def kill_tagged(tag: str) -> list:
    """SIGKILL every process carrying `tag` until none is left; return the pids that were still running."""
    killed = []
    for _ in range(50):
        pids = tagged_pids(tag)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed += pids
        time.sleep(0.1)
    return sorted(set(killed))


@pytest.fixture(autouse=True)
def process_tag(request):
    """Each test's processes get their own tag; when the test ends (passed, failed or timed out), none survives."""
    _current_tag[0] = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.nodeid)
    yield _current_tag[0]
    kill_tagged(_current_tag[0])
    _current_tag[0] = f"session-{os.getpid()}"


def pytest_sessionfinish(session):
    kill_tagged(f"session-{os.getpid()}")  # module fixtures run before a test's tag is set


def broken_copy(tmp_path, old: str, new: str, *more: str, folder: str = "broken") -> Path:
    """A copy of the script with one fault put in (`old` replaced by `new`, exactly once), or several edits:
    `more` continues the list of (old, new) pairs."""
    source = SCRIPT.read_text()
    edits = [old, new, *more]
    for old, new in zip(edits[::2], edits[1::2]):
        assert source.count(old) == 1, f"the script no longer contains {old!r} exactly once"
        source = source.replace(old, new)
    path = tmp_path / folder / SCRIPT.name
    path.parent.mkdir()
    path.write_text(source)
    return path
