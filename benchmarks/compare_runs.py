"""Compare two runs value by value: every losses/* scalar and every game's return and length.

    python benchmarks/compare_runs.py runs/<run A> runs/<run B>
    python benchmarks/compare_runs.py --prefix runs/<short run> runs/<long run>   # up to the shorter run's end

Exits 0 when both runs logged exactly the same values at the same steps (bitwise, as float32), 1 otherwise.
With --prefix only the steps up to the last logged step of the shorter run are compared.
A run is a TensorBoard run folder or one stored as text by to_text.py (whose iterations.csv.gz must hold
every iteration: runs of up to 1,000 iterations). Used to show that a change which must not alter what the
script computes did not.
"""

import argparse
import csv
import gzip
import sys
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

GAME_TAGS = {"charts/episodic_return": "return", "charts/episodic_length": "length"}


def read(run: str) -> dict:
    """{tag: [(step, value as float32)]}: TensorBoard stores scalars as float32, the text keeps them exactly."""
    if (Path(run) / "games.csv.gz").is_file():
        with gzip.open(Path(run) / "games.csv.gz", "rt", newline="") as f:
            games = list(csv.DictReader(f))
        with gzip.open(Path(run) / "iterations.csv.gz", "rt", newline="") as f:
            iterations = list(csv.DictReader(f))
        values = {tag: [(int(g["step"]), g[column]) for g in games] for tag, column in GAME_TAGS.items()}
        for tag in [t for t in (iterations[0] if iterations else {}) if t.startswith("losses/")]:
            values[tag] = [(int(row["step"]), row[tag]) for row in iterations]
    else:
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        tags = [t for t in acc.Tags()["scalars"] if t.startswith("losses/") or t in GAME_TAGS]
        values = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags}
    return {tag: [(step, np.float32(value)) for step, value in pairs] for tag, pairs in values.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--prefix", action="store_true", help="compare only up to the end of the shorter run")
    opts = parser.parse_args()
    a, b = read(opts.run_a), read(opts.run_b)
    if opts.prefix:
        end = min(max(step for values in run.values() for step, _ in values) for run in (a, b))
        a, b = ({tag: [(s, v) for s, v in values if s <= end] for tag, values in run.items()} for run in (a, b))
        print(f"comparing up to step {end:,}")
    if not a:
        print(f"no losses/* or episodic scalars in {sys.argv[1]}", file=sys.stderr)
        return 1
    same = True
    for tag in sorted(set(a) | set(b)):
        values_a, values_b = a.get(tag, []), b.get(tag, [])
        # NaN != NaN: compare their text, so a NaN explained variance in both runs counts as equal.
        equal = [(s, repr(v)) for s, v in values_a] == [(s, repr(v)) for s, v in values_b]
        same &= equal
        print(f"{'same' if equal else 'DIFFERENT':9} {tag}: {len(values_a)} vs {len(values_b)} values")
    print("identical" if same else "the runs differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
