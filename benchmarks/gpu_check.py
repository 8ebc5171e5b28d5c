"""One-command GPU check: the runs that show how the script uses one GPU machine, in at most 8 minutes.

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
    runs = [(Config(1, 8), []), (Config(1, 16, "double"), []), (Config(1, 32, "double"), []),
            (Config(1, 64, "double"), []), (Config(1, 32, "double", "bf16"), []),
            (Config(1, 64, "ale", env_threads=16), []), (Config(1, 128, "ale", env_threads=16), []),
            (Config(1, 128, "ale-double", env_threads=16), []),
            (Config(4, 8, "double"), ["--device-ids", "0", "0", "0", "0"] if gpus else [])]
    if gpus >= 2:
        runs.append((Config(2, 8), ["--backend", "nccl"]))
    started, rows = time.time(), []
    for config, extra in runs:
        result = measure_script(config, opts.seconds, expected_sps=3000 if gpus else 300, num_steps=opts.num_steps,
                                extra_args=[*cuda_flag, *extra])
        digests = re.search(r"^final parameter digest per rank: (.*)$", result["output"], re.M).group(1).split()
        notes = re.findall(r"^note: (.*)$", result["output"], re.M)
        agree = len({d.split(":")[1] for d in digests}) == 1
        rows.append((config, extra, result, agree, notes))
        print(f"{config.name} {' '.join(extra)}: {result['sps']:.0f} steps/s, rollout {result['rollout_sps']:.0f}, "
              f"digests {'agree' if agree else 'DIFFER'}", flush=True)
    machine = machine_description()
    lines = [f"# GPU check on {device}", "",
             f"Command: `python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d')}, "
             f"{(time.time() - started) / 60:.1f} min in all.", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), ""]
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
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"throughput-{device}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return 0 if all(agree for *_, agree, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
