"""Store TensorBoard runs of ppo_atari_multigpu.py as small text files that benchmarks/report.py reads.

    python benchmarks/to_text.py RUNS [--out DEST]

Every run folder under RUNS (any folder holding events files) is written to DEST/<its path under RUNS>
(default: beside the events files) as
- games.csv.gz: every finished game: seconds, global step, return (whole game, unclipped), length (frames);
- iterations.csv.gz: the per-iteration scalars (learning rate, steps/s, timings, losses), at most --max-rows
  rows evenly spaced through the run, always including its last iteration;
- hyperparameters.md: the settings table the script logs when a run starts.
`seconds` counts the time the run was logging before that value: the gaps between the sessions of a resumed
run are left out, as report.py does, so the last iteration's seconds is the run's wall time. The output is
byte-identical for the same input (gzip without a timestamp): converting again changes nothing in git.
The events files and checkpoints stay out of git; these files are the result.
"""

import argparse
import gzip
import io
import math
import os
from collections import defaultdict
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from report import GAME_TAGS, active_seconds, file_span


def write_gzip_csv(path: Path, header: list, rows: list) -> None:
    """Write atomically: a temporary file in the same folder, renamed over `path`."""
    text = ",".join(header) + "\n" + "".join(",".join(row) + "\n" for row in rows)
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as f:
        f.write(text.encode())
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)


def convert(folder: Path, dest: Path, max_rows: int = 1000) -> None:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    segments = sorted(filter(None, map(file_span, folder.glob("events.out.tfevents.*"))))
    tags = acc.Tags()["scalars"]
    dest.mkdir(parents=True, exist_ok=True)

    returns, lengths = ([acc.Scalars(tag) if tag in tags else [] for tag in GAME_TAGS])
    seconds = active_seconds([e.wall_time for e in returns], segments)
    write_gzip_csv(dest / "games.csv.gz", ["seconds", "step", "return", "length"],
                   [[f"{s:.3f}", str(r.step), repr(r.value), str(int(n.value))]
                    for s, r, n in zip(seconds, returns, lengths, strict=True)])

    per_step, last_time = defaultdict(dict), {}
    iteration_tags = [tag for tag in tags if tag not in GAME_TAGS]
    for tag in iteration_tags:
        for event in acc.Scalars(tag):
            per_step[event.step][tag] = event.value
            last_time[event.step] = max(last_time.get(event.step, 0.0), event.wall_time)
    steps = sorted(per_step)
    every = max(1, math.ceil(len(steps) / max_rows))
    kept = steps[::every] + ([steps[-1]] if steps and (len(steps) - 1) % every else [])
    seconds = active_seconds([last_time[step] for step in kept], segments)
    write_gzip_csv(dest / "iterations.csv.gz", ["seconds", "step"] + iteration_tags,
                   [[f"{s:.3f}", str(step)] + [f"{per_step[step].get(tag, math.nan):.9g}" for tag in iteration_tags]
                    for s, step in zip(seconds, kept)])

    texts = acc.Tags()["tensors"]
    if "hyperparameters/text_summary" in texts:
        table = acc.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
        (dest / "hyperparameters.md").write_text(table + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", help="folder to search for TensorBoard runs")
    parser.add_argument("--out", help="folder to write to, mirroring the runs' paths (default: beside them)")
    parser.add_argument("--max-rows", type=int, default=1000, help="rows of iterations.csv.gz per run")
    opts = parser.parse_args()
    root = Path(opts.runs)
    folders = sorted({p.parent for p in root.rglob("events.out.tfevents.*")})
    if not folders:
        raise SystemExit(f"to_text.py: error: no TensorBoard runs under {root}")
    for folder in folders:
        dest = Path(opts.out) / folder.relative_to(root) if opts.out else folder
        convert(folder, dest, opts.max_rows)
        print(f"{folder} -> {dest}")


if __name__ == "__main__":
    main()
