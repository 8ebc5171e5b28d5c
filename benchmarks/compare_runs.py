"""Compare two TensorBoard runs value by value: every losses/* scalar and every game's return and length.

    python benchmarks/compare_runs.py runs/<run A> runs/<run B>
    python benchmarks/compare_runs.py --prefix runs/<short run> runs/<long run>   # up to the shorter run's end

Exits 0 when both runs logged exactly the same values at the same steps (bitwise, as float32), 1 otherwise.
With --prefix only the steps up to the last logged step of the shorter run are compared.
Used to show that a change which must not alter what the script computes did not.
"""

import argparse
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read(run: str) -> dict:
    acc = EventAccumulator(run, size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith("losses/") or t in ("charts/episodic_return", "charts/episodic_length")]
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags}


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
