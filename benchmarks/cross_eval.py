"""Saved Breakout policies played on both env paths: the Python wrapper stack (`--vector-env sync`) and
ale-py's C++ vector env (`--vector-env ale`).

A fixed policy sees no learning noise, so if the two paths give it the same score their semantics agree where
the returns are concerned, and a gap between the paths' learning curves comes from what the learner sees
(the episode boundaries, the frames at a life's start), not from how games are played and scored. Each model
plays the same number of games per env on each path with the script's own `evaluate` (sampled actions,
fixed seeds); only the vector env differs. Breakout's returns are heavy-tailed (a tunnel through the wall
scores hundreds), so the median is printed beside the mean.

    python benchmarks/cross_eval.py checkpoints/*/final_model.pt [--games 40]
"""

import argparse
import contextlib
import io
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ppo_atari_multigpu as ppo  # noqa: E402

NUM_ENVS, SEED = 8, 1000


def play(model_path: str, games: int, path: str) -> np.ndarray:
    with contextlib.redirect_stdout(io.StringIO()):  # evaluate() prints every game
        return np.array(ppo.evaluate(model_path, games, NUM_ENVS, torch.device("cpu"), SEED,
                                     protocol="ale" if path == "ale" else "python"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="checkpoints or final models of Breakout runs")
    parser.add_argument("--games", type=int, default=40, help="games per model and env path")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | path | games | mean +- s.e. | median | max |\n|---|---|---|---|---|---|")
    for model_path in opts.models:
        for path in ("sync", "ale"):
            returns = play(model_path, opts.games, path)
            standard_error = returns.std(ddof=1) / np.sqrt(len(returns))
            print(f"| {model_path} | {path} | {len(returns)} | {returns.mean():.2f} +- {standard_error:.2f} | "
                  f"{np.median(returns):.1f} | {returns.max():.0f} |", flush=True)


if __name__ == "__main__":
    main()
