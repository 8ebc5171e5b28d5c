"""One-command GPU check: the runs that show how the script uses one GPU machine, each about --seconds of training.

    python benchmarks/gpu_check.py                            # on a machine with a GPU (and 16 cores or so)
    python benchmarks/gpu_check.py --no-cuda --seconds 5 --num-steps 16   # the same runs on the CPU: a smoke test

Runs the real script under torchrun: 1 process x 8 envs sync; 1 process x 16, 32 and 64 envs double-buffered;
bf16 (1 x 32 double-buffered); ale-py's C++ vector env (`--vector-env ale`, 1 x 64 and 1 x 128 envs on
16 threads, and `ale-double` with 128); 4 processes sharing GPU 0 through gloo (`--device-ids 0 0 0 0`, no --backend:
the script must pick gloo and say so); and, where there are 2 GPUs, a short NCCL run of 2 processes whose
ranks' final parameter digests must agree. Writes `benchmarks/results/throughput-<device>.md`.
"""

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import RESULTS, Config, machine_description, measure_script  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20, help="training time per run (10 runs; default 20)")
    parser.add_argument("--num-steps", type=int, default=128, help="rollout length (the reference's 128)")
    parser.add_argument("--no-cuda", action="store_true", help="run on the CPU, to check the script end to end")
    opts = parser.parse_args()
    import torch

    gpus = 0 if opts.no_cuda else torch.cuda.device_count()
    device = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()) if gpus else "cpu-no-cuda"
    cuda_flag = [] if gpus else ["--no-cuda"]
    # (config, extra arguments, steps/s expected on an H200 with 16 cores, measured 2026-12-04): each run is sized
    # to last about --seconds; one rate for all made the small configs run 4x longer than planned.
    shared_gpu = ["--device-ids", "0", "0", "0", "0"] if gpus else []
    runs = [(Config(1, 8), [], 700), (Config(1, 16, "double"), [], 870), (Config(1, 32, "double"), [], 1550),
            (Config(1, 64, "double"), [], 2300), (Config(1, 32, "double", "bf16"), [], 1400),
            (Config(1, 64, "ale", env_threads=16), [], 4000), (Config(1, 128, "ale", env_threads=16), [], 5800),
            (Config(1, 128, "ale-double", env_threads=16), [], 4400), (Config(4, 8, "double"), shared_gpu, 4200)]
    if gpus >= 2:
        runs.append((Config(2, 8), ["--backend", "nccl"], 1400))  # not measured yet: twice the 1 x 8 run
    started, rows, machine = time.time(), [], machine_description()
    path = RESULTS / f"throughput-{device}.md"
    for config, extra, expected_sps in runs:
        result = measure_script(config, opts.seconds, expected_sps=expected_sps if gpus else 300,
                                num_steps=opts.num_steps, extra_args=[*cuda_flag, *extra])
        digests = re.search(r"^final parameter digest per rank: (.*)$", result["output"], re.M).group(1).split()
        notes = re.findall(r"^note: (.*)$", result["output"], re.M)
        agree = len({d.split(":")[1] for d in digests}) == 1
        rows.append((config, extra, result, agree, notes))
        print(f"{config.name} {' '.join(extra)}: {result['sps']:.0f} steps/s, rollout {result['rollout_sps']:.0f}, "
              f"digests {'agree' if agree else 'DIFFER'}", flush=True)
        write_report(path, device, gpus, machine, rows, len(runs), time.time() - started)  # kept if a later run dies
    print(f"wrote {path}")
    return 0 if all(agree for *_, agree, _ in rows) else 1


def write_report(path: Path, device: str, gpus: int, machine: dict, rows: list, planned: int, seconds: float) -> None:
    lines = [f"# GPU check on {device}", "",
             f"Command: `python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d')}, "
             f"{seconds / 60:.1f} min in all.", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), ""]
    if len(rows) < planned:
        lines += [f"**Unfinished: {len(rows)} of {planned} runs so far.**", ""]
    if not gpus:
        lines += ["**No GPU was used: these are CPU runs (`--no-cuda`) that check the runs work end to end; they "
                  "are not GPU figures.**", ""]
    lines += ["Steady-state agent steps/s of the real script under torchrun, the rollout alone (envs + inference), "
              "seconds per iteration, and whether every rank ended with the same parameters.", "",
              "| run | extra arguments | steps/s | rollout steps/s | rollout s/iter | update s/iter | all-reduce s/iter "
              "| digests agree | notes |", "|---|---|---|---|---|---|---|---|---|"]
    for config, extra, r, agree, notes in rows:
        lines.append(f"| {config.name} | `{' '.join(extra) or '-'}` | {r['sps']:.0f} | {r['rollout_sps']:.0f} | "
                     f"{r['rollout_time']:.2f} | {r['update_time']:.2f} | {r['allreduce_time']:.3f} | "
                     f"{'yes' if agree else 'NO'} | {'; '.join(notes) or '-'} |")
    if gpus < 2:
        lines += ["", "Fewer than 2 GPUs: no NCCL run (it needs 2)."]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
