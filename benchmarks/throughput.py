"""Throughput of ppo_atari_multigpu.py against the floor this machine allows, measured in one run.

    python benchmarks/throughput.py                      # all configurations that fit this machine
    python benchmarks/throughput.py --seconds 20 --only "2x4 sync fp32"

The floor: each process of a configuration measures, while the configuration's other processes do the
same (so they contend for cores, caches and memory as the real run does), the time of one env step per
agent step, one inference per observation, and one training pass (forward + backward + Adam) per sample
with the fastest memory layout for the precision. An agent step costs env + inference + update_epochs x
training, so the floor is the sum over processes of 1 / that cost: what the script would reach with no
overhead at all (no loss math, all-reduce, GAE, logging or waiting on the slowest rank).

The script's real steps/s come from torchrun runs of the real script, read from its TensorBoard log:
steady state, from the end of the first iteration to the end of the last.

    python benchmarks/throughput.py --reference-job --seconds 30

measures, in one run and without the floor, our configurations of the reference's job (8 envs in all,
128 steps, 1,024 transitions per iteration, its hyperparameters): 2 x 4 and 1 x 8 processes x envs,
sync / async / double-buffered envs, fp32 / bf16, 1 or 2 torch threads per process; it reports steady
steps/s, the rollout alone (envs + inference, from perf/rollout_time) and their ratios.

    python benchmarks/throughput.py --ale --seconds 20

measures, in one run, what --vector-env ale changes: the envs alone (8 Breakout envs, random actions:
agent steps/s per core of the Python stack in sync and async vector envs and of ale-py's C++ vector env on
1 and 2 threads); the script's rollout alone and the whole job of 1 process x 8, 16 and 32 envs with sync,
ale and ale-double; and the reference's job as 2 x 4 and 1 x 8 with each. The 1 x 8 rollout pair (ale-double
against sync) runs `--repeats` times in all, alternating; the median ratio counts.

    python benchmarks/throughput.py --against 778095b --repeats 4 --seconds 40

measures what a change to the script costs: the reference's job (2 x 4, sync, fp32) with this script and with
the script of a git revision, in `--repeats` pairs whose order alternates. Pair i runs --seed i in both: what a
short run costs depends on its games (lost lives add emulator frames, and the slower rank's env time is the
other's wait), so each pair compares the same seed and the pairs average over seeds. It reports each run's
steps/s, update, rollout and env time, their medians and the ratios of the medians.
"""

import argparse
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = Path(__file__).resolve().parent / "results"
UPDATE_EPOCHS, NUM_STEPS, NUM_MINIBATCHES = 4, 128, 4


@dataclass(frozen=True)
class Config:
    procs: int
    envs: int
    vector_env: str = "sync"
    precision: str = "fp32"
    threads: int = 0  # torch threads per process; 0: what torchrun gives (1 per process when it starts several)
    env_threads: int = 0  # --env-threads of the ale vector envs; 0: the script's default (its share of the cores)

    @property
    def name(self) -> str:
        return (f"{self.procs}x{self.envs} {self.vector_env} {self.precision}" + (f" {self.threads}t" if self.threads
                else "") + (f" {self.env_threads}et" if self.env_threads else ""))


def reference_job_configs() -> list:
    """The reference's job (8 envs, 1,024 transitions per iteration) in every way this script can run it."""
    configs = []
    for vector_env in ("sync", "async", "double"):
        for precision in ("fp32", "bf16"):
            configs.append(Config(2, 4, vector_env, precision, 1))
            configs += [Config(1, 8, vector_env, precision, threads) for threads in (1, 2)]
    return configs


def default_configs(cores: int, cuda: bool) -> list:
    configs = [Config(1, 8), Config(1, 8, "async"), Config(2, 4), Config(2, 4, precision="bf16"), Config(2, 8)]
    if cuda:  # one process, envs over all cores
        configs += [Config(1, 8, "async", "bf16"), Config(1, 4 * cores, "async"), Config(1, 4 * cores, "async", "bf16")]
    return configs


# --------------------------------------------------------------------------------------------------
# The floor
# --------------------------------------------------------------------------------------------------
def _median_seconds(fn, repeats: int, calls: int) -> float:
    """Seconds per call: the median of `repeats` timings of `calls` calls, after one warm-up call."""
    import torch

    fn()
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        timings.append((time.perf_counter() - start) / calls)
    return statistics.median(timings)


def _floor_worker(config: Config, threads: int, barrier, results, rank: int) -> None:
    import torch

    import ppo_atari_multigpu as ppo

    torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    envs = ppo.make_vector_env("BreakoutNoFrameskip-v4", config.envs, kind=config.vector_env)
    next_obs, _ = envs.reset(seed=[rank * config.envs + i for i in range(config.envs)])
    local_batch = config.envs * NUM_STEPS
    minibatch = local_batch // NUM_MINIBATCHES
    batch_obs = torch.randint(0, 256, (local_batch, 4, 84, 84), dtype=torch.uint8, device=device)
    batch_actions = torch.randint(0, 4, (local_batch,), device=device)
    bf16 = config.precision == "bf16"
    per_layout = {}
    for layout in (torch.contiguous_format, torch.channels_last):
        agent = ppo.Agent(4).to(device, memory_format=layout)
        optimizer = torch.optim.Adam(agent.parameters(), lr=1e-4, eps=1e-5, fused=True)

        def network(x):  # the bare network in this layout, the uint8 -> float scaling included
            return agent.network(x.contiguous(memory_format=layout).float().div_(255.0))

        def act(obs):  # called inside one autocast region per rollout, as the script does
            with torch.no_grad():
                hidden = network(torch.as_tensor(obs, device=device))
                agent.critic(hidden)
                logits = agent.actor(hidden).float()
                return torch.distributions.Categorical(logits=logits, validate_args=False).sample().cpu().numpy()

        # Rollout: env steps and inferences alternate, as in any synchronous rollout (each evicts the
        # other's data from the caches, so timing them apart understates the cost; both are reported).
        def rollout_step():
            nonlocal next_obs
            start = time.perf_counter()
            actions = act(next_obs)
            middle = time.perf_counter()
            next_obs, *_ = envs.step(actions)
            timings.append((middle - start, time.perf_counter() - middle))

        def training_epoch():  # one pass over the local batch in random minibatches
            permutation = torch.randperm(local_batch, device=device)
            for start in range(0, local_batch, minibatch):
                index = permutation[start : start + minibatch]
                with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                    hidden = network(batch_obs[index])
                    logits, values = agent.actor(hidden).float(), agent.critic(hidden).float()
                logprob = torch.log_softmax(logits, -1).gather(1, batch_actions[index, None])
                loss = -logprob.mean() + values.pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

        barrier.wait()
        timings = []
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            _median_seconds(rollout_step, repeats=1, calls=64)
            timings.sort(key=sum)
            inference, env_step = timings[len(timings) // 2]
            inference_alone = _median_seconds(lambda: act(next_obs), repeats=5, calls=20)
        barrier.wait()
        training = _median_seconds(training_epoch, repeats=3, calls=1) / local_batch
        name = "channels_last" if layout is torch.channels_last else "NCHW"
        per_layout[name] = {"env": env_step / config.envs, "inference": inference / config.envs,
                            "inference_alone": inference_alone / config.envs, "training": training}
    envs.close()
    results[rank] = per_layout


def measure_floor(config: Config, cores: int) -> dict:
    threads = max(1, cores // config.procs) if config.procs == 1 else 1
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(config.procs)
    with ctx.Manager() as manager:
        results = manager.dict()
        workers = [ctx.Process(target=_floor_worker, args=(config, threads, barrier, results, r))
                   for r in range(config.procs)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        per_rank = [results[r] for r in range(config.procs)]
    # Per layout: the mean over ranks of each component; the floor takes the fastest layout.
    layouts = {}
    for name in per_rank[0]:
        mean = {key: sum(r[name][key] for r in per_rank) / config.procs for key in per_rank[0][name]}
        step = mean["env"] + mean["inference"] + UPDATE_EPOCHS * mean["training"]
        layouts[name] = {**mean, "floor_sps": config.procs / step}
    best = max(layouts, key=lambda n: layouts[n]["floor_sps"])
    return {"layout": best, "layouts": layouts, **layouts[best]}


# --------------------------------------------------------------------------------------------------
# The real script
# --------------------------------------------------------------------------------------------------
def measure_script(config: Config, seconds: float, expected_sps: float, extra_args=(), num_steps=NUM_STEPS,
                   script: Path = ROOT / "ppo_atari_multigpu.py") -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    batch = config.procs * config.envs * num_steps
    iterations = max(4, round(expected_sps * seconds / batch))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc-per-node={config.procs}", str(script),
           "--local-num-envs", str(config.envs), "--vector-env", config.vector_env, "--precision", config.precision,
           "--total-timesteps", str(iterations * batch), "--num-steps", str(num_steps), "--exp-name", "throughput",
           *extra_args]
    if config.threads:
        cmd += ["--torch-threads", str(config.threads)]
    if config.env_threads:
        cmd += ["--env-threads", str(config.env_threads)]
    with tempfile.TemporaryDirectory() as workdir:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torchrun picks, as for users
        result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=seconds * 6 + 300)
        if result.returncode != 0:
            raise RuntimeError(f"{config.name} failed:\n{result.stderr[-3000:]}")
        (run_dir,) = Path(workdir, "runs").iterdir()
        acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        acc.Reload()
        sps_events = acc.Scalars("charts/SPS")
        first, last = sps_events[0], sps_events[-1]
        perf = {tag.split("/")[1]: sum(e.value for e in acc.Scalars(tag)[1:]) / (len(sps_events) - 1)
                for tag in acc.Tags()["scalars"] if tag.startswith("perf/")}
    return {"sps": (last.step - first.step) / (last.wall_time - first.wall_time), "iterations": iterations,
            "iteration_s": (last.wall_time - first.wall_time) / (len(sps_events) - 1),
            "rollout_sps": batch / perf["rollout_time"], "output": result.stdout, **perf}


def write_job_report(machine_name: str, machine: dict, rows: list, seconds: float, command: str) -> Path:
    """The reference's job: steady steps/s and rollout steps/s of each configuration, and their ratios."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"throughput-job-{machine_name}.md"
    fastest = max(rows, key=lambda row: row[1]["sps"])
    by_name = {config.name: script for config, script in rows}
    lines = [
        f"# The reference's job on {machine_name}: 8 envs, 128 steps, 1,024 transitions per iteration",
        "", f"Command: `{command}` ({seconds:.0f} s of training per configuration), {time.strftime('%Y-%m-%d')}.",
        "", "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
        "Steady-state agent steps/s of the real script under torchrun (whole job), and of its rollout alone "
        "(envs + inference: transitions per iteration / `perf/rollout_time`). Configuration: processes x envs, "
        "vector env, precision, torch threads per process. Ratios are to `2x4 sync fp32 1t` (the reference's "
        "layout) in this same run.", "",
        "| configuration | steps/s | x 2x4 sync fp32 | rollout steps/s | rollout s/iter | update s/iter | env s/iter |",
        "|---|---|---|---|---|---|---|",
    ]
    base = by_name.get("2x4 sync fp32 1t", fastest[1])
    for config, script in sorted(rows, key=lambda row: -row[1]["sps"]):
        lines.append(f"| {config.name} | {script['sps']:.0f} | {script['sps'] / base['sps']:.2f} | "
                     f"{script['rollout_sps']:.0f} | {script['rollout_time']:.2f} | {script['update_time']:.2f} | "
                     f"{script['env_time']:.2f} |")
    pairs = [("rollout, 1x8 double / sync, fp32, 1 thread", "1x8 double fp32 1t", "1x8 sync fp32 1t", "rollout_sps"),
             ("rollout, 1x8 double / sync, fp32, 2 threads", "1x8 double fp32 2t", "1x8 sync fp32 2t", "rollout_sps"),
             ("job, 1x8 double / sync, fp32, 1 thread", "1x8 double fp32 1t", "1x8 sync fp32 1t", "sps"),
             ("job, bf16 / fp32, 2x4 sync", "2x4 sync bf16 1t", "2x4 sync fp32 1t", "sps")]
    lines += ["", "Ratios in this run:", ""]
    lines += [f"- {label}: {by_name[a][key] / by_name[b][key]:.2f}x" for label, a, b, key in pairs
              if a in by_name and b in by_name]
    best_fp32 = max((row for row in rows if row[0].precision == "fp32"), key=lambda row: row[1]["sps"], default=None)
    if best_fp32:
        lines.append(f"- fastest fp32: {best_fp32[0].name}, {best_fp32[1]['sps']:.0f} steps/s")
    lines.append(f"- fastest overall: {fastest[0].name}, {fastest[1]['sps']:.0f} steps/s")
    path.write_text("\n".join(lines) + "\n")
    return path


def run_against_report(revision: str, machine_name: str, machine: dict, seconds: float, command: str,
                       repeats: int) -> Path:
    """The reference's job with this script and the script at `revision`, alternating."""
    config = Config(2, 4, "sync", "fp32")
    runs = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as folder:
        before = Path(folder) / "ppo_atari_multigpu.py"  # the same name: the same run names and messages
        before.write_text(subprocess.run(["git", "show", f"{revision}:ppo_atari_multigpu.py"], cwd=ROOT, check=True,
                                         capture_output=True, text=True).stdout)
        for pair in range(repeats):
            for name in (("before", "after") if pair % 2 == 0 else ("after", "before")):
                script = before if name == "before" else ROOT / "ppo_atari_multigpu.py"
                runs[name].append(measure_script(config, seconds, expected_sps=400, script=script,
                                                 extra_args=("--seed", str(pair + 1))))
                print(f"pair {pair + 1} {name}: {runs[name][-1]['sps']:.0f} steps/s, update "
                      f"{runs[name][-1]['update_time']:.3f} s/iter", flush=True)
    keys = ("sps", "update_time", "rollout_time", "env_time")
    medians = {name: {key: statistics.median(run[key] for run in rows) for key in keys} for name, rows in runs.items()}
    path = RESULTS / f"throughput-against-{revision}-{machine_name}.md"
    lines = [f"# The reference's job (2 x 4, sync, fp32) with this script and with the script of {revision}", "",
             f"Command: `{command}` ({seconds:.0f} s of training per run), {time.strftime('%Y-%m-%d')}.", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
             "Steady-state agent steps/s of the whole job and the mean `perf/update_time`, `perf/rollout_time` and "
             "`perf/env_time` per iteration (rank 0), read from each run's TensorBoard log. Pair i runs `--seed i` with "
             "both scripts; the order flips every pair.", "",
             "| pair (seed) | script | steps/s | update s/iter | rollout s/iter | env s/iter |", "|---|---|---|---|---|---|"]
    for pair in range(repeats):
        for name in ("before", "after"):
            run = runs[name][pair]
            lines.append(f"| {pair + 1} | {'this one' if name == 'after' else revision} | {run['sps']:.1f} | "
                         f"{run['update_time']:.3f} | {run['rollout_time']:.3f} | {run['env_time']:.3f} |")
    lines += ["", f"Medians and ratios (this script / {revision}):", ""]
    for key, label in zip(keys, ("steps/s", "update s/iter", "rollout s/iter", "env s/iter")):
        lines.append(f"- {label}: {medians['after'][key]:.3f} vs {medians['before'][key]:.3f}, ratio "
                     f"{medians['after'][key] / medians['before'][key]:.3f}")
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------------------------------------
# --vector-env ale
# --------------------------------------------------------------------------------------------------
def measure_envs(kind: str, num_envs: int, threads: int, seconds: float) -> float:
    """Agent steps/s of `num_envs` Breakout envs alone with random actions: the Python stack in a `sync` or
    `async` vector env, or ale-py's C++ vector env (`ale`) on `threads` threads."""
    import numpy as np

    import ppo_atari_multigpu as ppo

    envs = (ppo.AtariVectorGames("BreakoutNoFrameskip-v4", num_envs, threads) if kind == "ale"
            else ppo.make_vector_env("BreakoutNoFrameskip-v4", num_envs, kind=kind))
    envs.reset(seed=list(range(num_envs)))
    actions = np.random.default_rng(0).integers(4, size=(1000, num_envs))
    for step in range(50):  # warm-up
        envs.step(actions[step])
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        envs.step(actions[steps % len(actions)])
        steps += 1
    elapsed = time.perf_counter() - start
    envs.close()
    return steps * num_envs / elapsed


def ale_job_configs() -> list:
    configs = [Config(1, envs, vector_env, threads=1) for envs in (8, 16, 32)
               for vector_env in ("sync", "ale", "ale-double")]
    return configs + [Config(2, 4, vector_env) for vector_env in ("sync", "ale", "ale-double")]


def run_ale_report(machine_name: str, machine: dict, seconds: float, command: str, cores: int,
                   repeats: int) -> Path:
    env_rows = []
    for kind, threads in (("sync", 1), ("async", 0), ("ale", 1), ("ale", 2)):
        sps = measure_envs(kind, 8, threads, seconds / 2)
        used = min(8, cores) if kind == "async" else min(threads, cores) if kind == "ale" else 1
        env_rows.append((f"{kind}" + (f", {threads} thread{'s' * (threads > 1)}" if kind == "ale" else ""), sps, used))
        print(f"envs alone, {env_rows[-1][0]}: {sps:.0f} steps/s on {used} cores", flush=True)
    jobs = []
    for config in ale_job_configs():
        jobs.append((config, measure_script(config, seconds, expected_sps=300)))
        print(f"{config.name}: {jobs[-1][1]['sps']:.0f} steps/s, rollout {jobs[-1][1]['rollout_sps']:.0f}", flush=True)
    by_name = {config.name: script for config, script in jobs}
    sync_core, ale_core = env_rows[0][1], env_rows[2][1]
    # The 1x8 overlap gain is a ratio of two short runs on a shared machine: measure the pair again, alternating.
    pairs = [(by_name["1x8 ale-double fp32 1t"]["rollout_sps"], by_name["1x8 sync fp32 1t"]["rollout_sps"])]
    for _ in range(repeats - 1):
        pairs.append(tuple(measure_script(Config(1, 8, kind, threads=1), seconds, expected_sps=300)["rollout_sps"]
                           for kind in ("ale-double", "sync")))
        print(f"1x8 rollout, ale-double / sync: {pairs[-1][0]:.0f} / {pairs[-1][1]:.0f}", flush=True)
    lines = [f"# --vector-env ale on {machine_name}", "",
             f"Command: `{command}`, {time.strftime('%Y-%m-%d')}.", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
             "## The envs alone: 8 Breakout envs, random actions", "",
             "| vector env | agent steps/s | cores used | steps/s per core |", "|---|---|---|---|",
             *[f"| {name} | {sps:.0f} | {used} | {sps / used:.0f} |" for name, sps, used in env_rows], "",
             f"Env time per step on one core, sync Python stack / ale on 1 thread: {ale_core / sync_core:.2f}x.", "",
             "## The script: rollout alone and whole job", "",
             "Real runs of `ppo_atari_multigpu.py` under torchrun (fp32, 128 steps, the reference's hyperparameters); "
             "rollout = envs + inference, transitions per iteration / `perf/rollout_time`; `1t`: 1 torch thread per "
             "process; the ale envs use the script's default `--env-threads` (the process's share of the cores).", "",
             "| configuration | steps/s | rollout steps/s | rollout s/iter | update s/iter | env s/iter |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {c.name} | {r['sps']:.0f} | {r['rollout_sps']:.0f} | {r['rollout_time']:.2f} | "
              f"{r['update_time']:.2f} | {r['env_time']:.2f} |" for c, r in jobs]
    lines += ["", f"1 process x 8 envs, rollout alone: ale-double (envs on {min(2, cores)} threads, 1 torch thread) / "
              f"sync (1 thread), median of {len(pairs)} pairs of runs (the table's and {len(pairs) - 1} more, "
              f"alternating): {statistics.median(double / sync for double, sync in pairs):.2f}x; each pair: "
              + ", ".join(f"{double:.0f} / {sync:.0f} = {double / sync:.2f}x" for double, sync in pairs) + "."]
    path = RESULTS / f"throughput-ale-{machine_name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------
def machine_description() -> dict:
    import ale_py
    import gymnasium
    import numpy
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text()).group(1)
    except (OSError, AttributeError):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    # --precision bf16 on the CPU is fast only with native bf16 (AVX-512 bf16 or AMX); without it, emulated.
    native_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return {"cpu": cpu, "cores": os.cpu_count(), "cpu bf16": "native" if native_bf16 else "none (emulated, slow)",
            "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__, "gymnasium": gymnasium.__version__, "ale_py": ale_py.__version__,
            "numpy": numpy.__version__}


def write_report(machine_name: str, machine: dict, rows: list, seconds: float, command: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"throughput-{machine_name}.md"
    lines = [
        f"# Throughput on {machine_name}",
        "",
        f"Command: `{command}` ({seconds:.0f} s of training per configuration), {time.strftime('%Y-%m-%d')}.",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
        "",
        "Agent steps per second, summed over processes. *Floor*: the best the script could reach here: per "
        "agent step, one env step + one inference + 4 training passes (forward, backward, Adam), timed with "
        "all of the configuration's processes running at once, in the fastest memory layout, with nothing "
        "else (no loss bookkeeping, all-reduce, advantage computation, logging, or waiting for other ranks). "
        "*Script*: the real script under torchrun, steady state from its TensorBoard log. Env and inference "
        "are timed alternating, as in a rollout; the inference timed alone is shown for comparison.",
        "",
        "| configuration | script steps/s | floor steps/s | fraction of floor | env ms/step | inference ms/obs "
        "(alone) | training ms/sample | layout | script: rollout s/iter | update s/iter | all-reduce s/iter |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, floor, script in rows:
        lines.append(
            f"| {config.name} | {script['sps']:.0f} | {floor['floor_sps']:.0f} | "
            f"{script['sps'] / floor['floor_sps']:.0%} | {floor['env'] * 1e3:.3f} | {floor['inference'] * 1e3:.3f} "
            f"({floor['inference_alone'] * 1e3:.3f}) | {floor['training'] * 1e3:.3f} | {floor['layout']} | "
            f"{script.get('rollout_time', 0):.2f} | {script.get('update_time', 0):.2f} | "
            f"{script.get('allreduce_time', 0):.3f} |"
        )
    lines += ["", "Floor per layout (env ms/step, inference ms/obs, training ms/sample, floor steps/s):", ""]
    for config, floor, _ in rows:
        lines.append(f"- {config.name}: " + "; ".join(
            f"{name}: {m['env'] * 1e3:.3f}, {m['inference'] * 1e3:.3f}, {m['training'] * 1e3:.3f}, "
            f"{m['floor_sps']:.0f}" for name, m in floor["layouts"].items()))
    by_name = {config.name: script["sps"] for config, _, script in rows}
    ratios = [f"- {label}: {by_name[a] / by_name[b]:.2f}x" for label, a, b in [
        ("async / sync, 1 process x 8 envs", "1x8 async fp32", "1x8 sync fp32"),
        ("bf16 / fp32, 2 processes x 4 envs", "2x4 sync bf16", "2x4 sync fp32"),
    ] if a in by_name and b in by_name]
    if ratios:
        lines += ["", "Ratios of script steps/s in this run:", "", *ratios]
    path.write_text("\n".join(lines) + "\n")
    write_chart(RESULTS / f"throughput-{machine_name}.png", machine_name, rows)
    return path


def write_chart(path: Path, machine_name: str, rows: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [config.name for config, _, _ in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [floor["floor_sps"] for _, floor, _ in rows], 0.4, label="floor", color="#bbbbbb")
    ax.bar([i + 0.2 for i in x], [script["sps"] for _, _, script in rows], 0.4, label="script", color="#3060c0")
    ax.set_xticks(list(x), names, rotation=20, ha="right")
    ax.set_ylabel("agent steps / s")
    ax.set_title(f"ppo_atari_multigpu.py throughput, {machine_name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60, help="training time per script run")
    parser.add_argument("--machine", default=None, help="name used in the results file (default: from the CPU/GPU)")
    parser.add_argument("--only", nargs="*", default=None, help="configuration names to run, e.g. '2x4 sync fp32'")
    parser.add_argument("--reference-job", action="store_true",
                        help="the reference's job in every configuration, script only (no floor)")
    parser.add_argument("--ale", action="store_true", help="--vector-env ale against the Python envs")
    parser.add_argument("--repeats", type=int, default=3, help="with --ale or --against: runs of each pair")
    parser.add_argument("--against", metavar="REV", help="the reference's job with this script and the script at "
                        "git revision REV, alternating")
    opts = parser.parse_args()

    cores = os.cpu_count()
    cuda = torch.cuda.is_available()
    machine = machine_description()
    machine_name = opts.machine or re.sub(r"[^a-z0-9]+", "-", (machine["gpu"] if cuda else f"cpu{cores}").lower())
    command = ("python benchmarks/throughput.py " + " ".join(sys.argv[1:])).strip()
    if opts.ale:
        print(f"wrote {run_ale_report(machine_name, machine, opts.seconds, command, cores, opts.repeats)}")
        return
    if opts.against:
        print(f"wrote {run_against_report(opts.against, machine_name, machine, opts.seconds, command, opts.repeats)}")
        return
    if opts.reference_job:
        rows = []
        for config in reference_job_configs():
            if opts.only is None or config.name in opts.only:
                rows.append((config, measure_script(config, opts.seconds, expected_sps=400)))
                print(f"{config.name}: {rows[-1][1]['sps']:.0f} steps/s, rollout {rows[-1][1]['rollout_sps']:.0f}",
                      flush=True)
        print(f"wrote {write_job_report(machine_name, machine, rows, opts.seconds, command)}")
        return
    configs = [c for c in default_configs(cores, cuda) if opts.only is None or c.name in opts.only]
    rows = []
    for config in configs:
        floor = measure_floor(config, cores)
        script = measure_script(config, opts.seconds, floor["floor_sps"])
        rows.append((config, floor, script))
        print(f"{config.name}: script {script['sps']:.0f} steps/s, floor {floor['floor_sps']:.0f} "
              f"({script['sps'] / floor['floor_sps']:.0%})", flush=True)
    print(f"wrote {write_report(machine_name, machine, rows, opts.seconds, command)}")


if __name__ == "__main__":
    main()
