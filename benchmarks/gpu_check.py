"""The GPU check, one call planned for under 9 minutes: what a GPU host gives the script, and how fast it runs there.

    python benchmarks/gpu_check.py                                        # on the GPU machine (planned for under 9 min)
    python benchmarks/gpu_check.py --no-cuda --seconds 3 --num-steps 16   # the same parts on a CPU: a smoke test

In order, the report (`benchmarks/results/gpu-check-<device>.md`) rewritten after every part, so a check cut
short keeps what it measured:
1. the host: logical CPUs, physical cores and threads per core, the CPU quota of this cgroup, this process's
   CPU affinity;
2. the env-only ceiling: Breakout stepped with random actions by ale-py's vector env (64 and 128 envs on every
   CPU) and by the Python envs in subprocesses (`AsyncVectorEnv`, one per CPU and 64);
3. where a rollout step's time goes at 1 process x 128 envs with `--vector-env ale`: the wait for the envs and
   a torch.profiler summary of the rest (host-to-device copies, cuDNN, synchronisations; Python is what the
   profiled operators leave of the wall time);
4. the real script under torchrun: the 8-env experiment split 1 x 8, 2 x 4, 4 x 2 and 8 x 1 on one GPU (the
   same experiment, so a pure speed comparison; several processes share the GPU through gloo) and the 64-env
   job as 1 x 64 `ale`, 8 x 8 `double` and 4 x 16 `double`, and 1 x 64 `ale` with the published minibatch of
   256 (`--num-minibatches 32` at 128 steps: 8x the Adam steps); steps/s, the rollout alone, the update, and
   whether every rank ended with the same parameters (exit code 1 if not). From the 1 x 64 and 1 x 128 `ale`
   rollouts (parts 3 and 4) the report fits the rollout's time per policy step as a fixed part plus a part per env.
"""

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from throughput import RESULTS, Config, machine_description, measure_envs, measure_script  # noqa: E402


def host() -> dict:
    """Logical CPUs, physical cores (distinct (package, core) pairs in /proc/cpuinfo), the cgroup's CPU quota."""
    blocks = [b for b in Path("/proc/cpuinfo").read_text().split("\n\n") if "processor" in b]
    cores = {tuple(re.findall(r"^(?:physical id|core id)\s*:\s*(\d+)", b, re.M)) for b in blocks}
    quota = "none found"
    for path, parse in ((Path("/sys/fs/cgroup/cpu.max"), lambda text: text.split()),
                        (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), lambda text: [
                            text.strip(), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text().strip()])):
        if path.exists():
            limit, period = parse(path.read_text())
            quota = "unlimited" if limit in ("max", "-1") else f"{int(limit) / int(period):g} CPUs"
            break
    known = all(len(core) == 2 for core in cores)  # some VMs leave the core ids out
    return {"logical CPUs": len(blocks), "physical cores": len(cores) if known else "not reported",
            "threads per core": f"{len(blocks) / len(cores):g}" if known else "not reported", "cgroup CPU quota": quota,
            "CPUs this process may use": len(os.sched_getaffinity(0))}


def profile_rollout(device, num_envs: int, env_threads: int, num_steps: int) -> dict:
    """One rollout of `num_envs` ale envs, as `train` runs it, after a warm-up one: wall time, the wait for the
    envs, and torch.profiler's operators (sorted by their own CPU time)."""
    import torch

    import ppo_atari_multigpu as ppo

    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False  # the script's default
    args = ppo.Args(local_num_envs=num_envs, num_steps=num_steps, vector_env="ale", env_threads=env_threads)
    groups = ppo.make_env_groups(args, None, env_threads)
    num_actions = groups[0].envs.single_action_space.n
    agent, _, _ = ppo.make_learner(num_actions, device, args.learning_rate)
    rollout = ppo.Rollout.allocate(num_steps, num_envs, groups[0].envs.single_observation_space.shape, device)
    rollout.set_next_obs(groups[0].index, groups[0].envs.reset(seed=list(range(1, num_envs + 1)))[0])
    noise = torch.Generator().manual_seed(1)

    def policy(obs, gumbel):
        action, logprob, _, value = agent.get_action_and_value(obs, gumbel=gumbel)
        return action, logprob, value

    def one_rollout() -> float:
        groups[0].wait_seconds, start = 0.0, time.perf_counter()
        gumbel = ppo.draw_gumbel(noise, num_steps, num_envs, num_actions).to(device)
        with torch.no_grad():
            ppo.collect_rollout(policy, agent.get_value, groups, rollout, gumbel, args.gamma)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    one_rollout()  # warm-up: cuDNN's algorithms, the allocator
    plain = one_rollout()
    env_wait = groups[0].wait_seconds
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as profile:
        profiled = one_rollout()
    groups[0].envs.close()
    events = profile.key_averages()
    operators = sum(e.self_cpu_time_total for e in events) / 1e6
    return {"steps": num_steps, "wall": plain, "env_wait": env_wait, "profiled_wall": profiled,
            "operators": operators, "table": events.table(sort_by="self_cpu_time_total", row_limit=18)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15, help="training time per run of part 4 (default 15)")
    parser.add_argument("--num-steps", type=int, default=128, help="rollout length (the reference's 128)")
    parser.add_argument("--no-cuda", action="store_true", help="run on the CPU, to check the parts end to end")
    opts = parser.parse_args()
    import torch

    gpus = 0 if opts.no_cuda else torch.cuda.device_count()
    device_name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()) if gpus else "cpu-no-cuda"
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    cpus = len(os.sched_getaffinity(0))
    # (config, extra arguments, steps/s expected on an H200 with 16 cores): each run is sized to last about
    # --seconds at that rate; the rates are lower bounds (the 1 x 8 and 1 x 64 ale runs measured 693 and 4,048).
    def sharing(procs: int) -> list:  # every process on GPU 0 (gloo, picked and said by the script)
        return ["--device-ids", *["0"] * procs] if gpus and procs > 1 else []

    runs = [(Config(procs, 8 // procs), sharing(procs), 700) for procs in (1, 2, 4, 8)]
    runs += [(Config(1, 64, "ale", env_threads=cpus), [], 4000), (Config(8, 8, "double"), sharing(8), 2000),
             (Config(4, 16, "double"), sharing(4), 2000),
             # the published minibatch of 256 = 64 envs x 4 steps (32 minibatches at --num-steps 128)
             (Config(1, 64, "ale", env_threads=cpus), ["--num-minibatches", str(opts.num_steps // 4)], 3000)]

    report = Report(RESULTS / f"gpu-check-{device_name}.md", device_name, gpus, machine_description(), len(runs))
    report.host = host()
    report.write()

    env_seconds = 4 if gpus else 1
    for kind, num_envs, threads in (("ale", 64, cpus), ("ale", 128, cpus), ("async", cpus, 0), ("async", 64, 0)):
        label = f"{num_envs} envs, " + (f"ale-py's vector env on {threads} threads" if kind == "ale"
                                        else f"{num_envs} Python env subprocesses (AsyncVectorEnv)")
        report.envs.append((label, measure_envs(kind, num_envs, threads, env_seconds)))
        report.write()

    report.profile = profile_rollout(device, 128, cpus, opts.num_steps)
    report.write()

    for config, extra, expected_sps in runs:
        result = measure_script(config, opts.seconds, expected_sps=expected_sps if gpus else 150,
                                num_steps=opts.num_steps, extra_args=[*([] if gpus else ["--no-cuda"]), *extra])
        digests = re.search(r"^final parameter digest per rank: (.*)$", result["output"], re.M).group(1).split()
        agree = len({d.split(":")[1] for d in digests}) == 1
        report.runs.append((config, extra, result, agree, re.findall(r"^note: (.*)$", result["output"], re.M)))
        print(f"{config.name} {' '.join(extra)}: {result['sps']:.0f} steps/s, rollout {result['rollout_sps']:.0f}, "
              f"digests {'agree' if agree else 'DIFFER'}", flush=True)
        report.write()
    print(f"wrote {report.path}")
    return 0 if all(agree for *_, agree, _ in report.runs) else 1


class Report:
    """The report as it stands; write() replaces the file atomically."""

    def __init__(self, path: Path, device: str, gpus: int, machine: dict, planned: int):
        self.path, self.device, self.gpus, self.machine, self.planned = path, device, gpus, machine, planned
        self.host, self.envs, self.profile, self.runs, self.started = {}, [], None, [], time.time()

    def write(self) -> None:
        lines = [f"# GPU check on {self.device}", "",
                 f"Command: `python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d')}, "
                 f"{(time.time() - self.started) / 60:.1f} min{' so far' if len(self.runs) < self.planned else ' in all'}.",
                 "",
                 "Machine: " + ", ".join(f"{k} {v}" for k, v in self.machine.items()), ""]
        if not self.gpus:
            lines += ["**No GPU was used: a CPU run (`--no-cuda`) that checks every part works end to end; none of "
                      "these are GPU figures.**", ""]
        if len(self.runs) < self.planned:
            lines += [f"**Unfinished: {len(self.runs)} of {self.planned} training runs so far.**", ""]
        lines += ["## Host", ""] + [f"- {key}: {value}" for key, value in self.host.items()] + [""]
        lines += ["## The envs alone (Breakout, random actions)", "", "| envs | agent steps/s |", "|---|---|"]
        lines += [f"| {label} | {sps:,.0f} |" for label, sps in self.envs] + [""]
        if self.profile:
            p = self.profile
            per_step = 1000 / p["steps"]
            lines += ["## Where a rollout step goes: 1 process x 128 envs, `--vector-env ale`", "",
                      f"- one rollout of {p['steps']} steps: {p['wall']:.3f} s, {p['wall'] * per_step:.2f} ms per "
                      f"policy step ({128 * p['steps'] / p['wall']:,.0f} agent steps/s)",
                      f"- waiting for the envs: {p['env_wait'] * per_step:.2f} ms per step; the rest (network, "
                      f"copies, Python): {(p['wall'] - p['env_wait']) * per_step:.2f} ms",
                      f"- under the profiler: {p['profiled_wall'] * per_step:.2f} ms per step, of which the profiled "
                      f"operators' own CPU time {p['operators'] * per_step:.2f} ms", "", "```", p["table"], "```", ""]
        lines += ["## The script under torchrun", "",
                  "Steady-state agent steps/s (the first iteration left out), the rollout alone (envs + inference), "
                  "seconds per iteration on rank 0, and whether every rank ended with the same parameters.", "",
                  "| run | extra arguments | steps/s | rollout steps/s | rollout s/iter | update s/iter | "
                  "all-reduce s/iter | digests agree | notes |", "|---|---|---|---|---|---|---|---|---|"]
        for config, extra, r, agree, notes in self.runs:
            lines.append(f"| {config.name} | `{' '.join(extra) or '-'}` | {r['sps']:.0f} | {r['rollout_sps']:.0f} | "
                         f"{r['rollout_time']:.2f} | {r['update_time']:.2f} | {r['allreduce_time']:.3f} | "
                         f"{'yes' if agree else 'NO'} | {'; '.join(notes) or '-'} |")
        ale64 = next((r for config, _, r, *_ in self.runs if config.envs == 64 and config.vector_env == "ale"), None)
        if ale64 and self.profile:  # time per policy step t(n) = fixed + n x per env, through n = 64 and 128
            t64, t128 = 64 / ale64["rollout_sps"], self.profile["wall"] / self.profile["steps"]
            per_env = (t128 - t64) / 64
            lines += ["", f"Rollout time per policy step, fitted through 1 x 64 (part 4) and 1 x 128 (part 3) `ale`: "
                      f"{(t64 - 64 * per_env) * 1000:.2f} ms fixed + {per_env * 1e6:.1f} us per env."]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.path)


if __name__ == "__main__":
    sys.exit(main())
