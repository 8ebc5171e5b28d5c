"""Summarise runs of ppo_atari_multigpu.py: a markdown table and learning curves.

    python benchmarks/report.py benchmarks/results/learning-cpu/runs --out benchmarks/results/learning-cpu

Runs are found recursively: a folder holding TensorBoard events files, or the text files that
benchmarks/to_text.py writes from them (games.csv.gz, iterations.csv.gz; the results committed here). Both
give the same tables. They are grouped by environment and configuration, both read from the run name `<env_id>__<exp_name>__<seed>__<time>` (the exp_name is the
configuration). For each group: mean +- std over seeds of the mean return of each run's last 100 games,
a 95% confidence interval for that mean (Student's t over seeds), the steps reached, wall time and
steps/s; the mean return of each seed's games in every window of --window steps (200k by default; with
--windows-at, only the windows ending at those steps); and per environment a PNG with the return against
global steps and against wall time (the mean over seeds up to where the shortest run ends, and each seed thin
beside it to its own end; with --published ENV_ID MEAN STD, a band for that env's published multi-GPU
result). With --published and --published-single, every configuration of 2 or more seeds is set against the
published results: its seeds' mean, std (ddof 0, the published statistic) and sample std, and Welch's t-test
of the difference in means (the published side taken as 3 seeds) with the smallest difference it could detect
at p < 0.05, once all its seeds have reached the same step. Wall time counts only the time the run was logging:
a resumed run writes each session to a new events file, and the gaps between those files are left out.
With --scalars TAG..., per-iteration logs (losses/approx_kl, losses/clipfrac, ...) are tabulated the same way: each
configuration's mean over seeds of the tag's mean over the iterations ending in each window (from text: the
iterations to_text.py kept, at most 1,000 per run, evenly spaced).
With --baseline CONFIG, each other configuration of the same
environment is set against that one: the difference of the seeds' means, its exact permutation p-value, and
how many of its seeds fall inside the baseline's 95% confidence interval of the mean and inside its 95%
prediction interval (where one more baseline seed would fall).
"""

import argparse
import csv
import gzip
import math
from collections import defaultdict
from itertools import combinations
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

LAST_GAMES = 100
PUBLISHED_SEEDS = 3  # CleanRL's published results: mean +- std (ddof 0) over 3 seeds
GAME_TAGS = ("charts/episodic_return", "charts/episodic_length")
# Two-sided 95% quantiles of Student's t for 1..20 degrees of freedom (above: the normal 1.96).
T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086]


def confidence_interval(values) -> tuple:
    """The 95% confidence interval of the mean of `values` (independent seeds), by Student's t."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return float("nan"), float("nan")
    t = T_975[len(values) - 2] if len(values) - 1 <= len(T_975) else 1.96
    half = t * np.std(values, ddof=1) / np.sqrt(len(values))
    return float(np.mean(values) - half), float(np.mean(values) + half)


def prediction_interval(values) -> tuple:
    """Where one more independent seed would fall with 95% probability: mean +- t * std * sqrt(1 + 1/n)."""
    values = np.asarray(values, dtype=float)
    low, high = confidence_interval(values)
    half = (high - low) / 2 * np.sqrt(len(values) + 1)  # the CI's half-width is t * std / sqrt(n)
    return float(np.mean(values) - half), float(np.mean(values) + half)


def student_t_p(t: float, dof: float) -> float:
    """Two-sided p-value of Student's t with any real `dof`: its density integrated numerically from 0 to |t|."""
    x = np.linspace(0.0, abs(t), 20_001)
    density = np.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)
                     - (dof + 1) / 2 * np.log1p(x ** 2 / dof))
    return float(max(0.0, 1 - 2 * np.trapezoid(density, x)))


def welch_t_test(values, other_mean: float, other_std: float, other_n: int) -> tuple:
    """Welch's t-test of mean(values) against a result known as mean +- std (ddof 0, as published) over other_n
    seeds: (t, degrees of freedom, two-sided p, detectable gap). The gap is the difference in means that would
    reach p = 0.05 with these spreads and numbers of seeds: a smaller true gap this comparison cannot show."""
    values = np.asarray(values, dtype=float)
    var_a = np.var(values, ddof=1) / len(values)
    var_b = other_std ** 2 * other_n / (other_n - 1) / other_n  # the sample variance, over n
    standard_error = np.sqrt(var_a + var_b)
    t = (values.mean() - other_mean) / standard_error
    dof = (var_a + var_b) ** 2 / (var_a ** 2 / (len(values) - 1) + var_b ** 2 / (other_n - 1))
    return float(t), float(dof), student_t_p(t, dof), t_975(dof) * float(standard_error)


def t_975(dof: float) -> float:
    """The t of two-sided p = 0.05 for any real `dof`, by bisection (12.7 at 1 dof, the fewest Welch gives here)."""
    low, high = 0.0, 100.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if student_t_p(middle, dof) > 0.05 else (low, middle)
    return high


def published_table(runs: list, published: dict) -> str:
    """Per env and configuration of 2 or more seeds, against each published result of that env: the seeds'
    mean, std (ddof 0, the published statistic) and sample std, Welch's t-test of the difference, and the
    smallest difference that test could detect."""
    groups = defaultdict(list)
    for run in runs:
        groups[(run.env_id, run.config)].append(run)
    lines = [f"| env | configuration | seeds | mean | std (ddof 0) | sample std | against | its mean +- std "
             f"({PUBLISHED_SEEDS} seeds) | difference | Welch's t | dof | p (two-sided) "
             "| smallest difference at p < 0.05 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (env_id, config), group in sorted(groups.items()):
        if len(group) < 2 or len({run.steps_reached for run in group}) > 1:  # a run still going is not final
            continue
        finals = [run.final_return for run in group]
        for label, (mean, std) in published.get(env_id, {}).items():
            t, dof, p, gap = welch_t_test(finals, mean, std, PUBLISHED_SEEDS)
            lines.append(f"| {env_id} | {config} | {len(finals)} | {np.mean(finals):.2f} | {np.std(finals):.2f} | "
                         f"{np.std(finals, ddof=1):.2f} | {label} | {mean:g} +- {std:g} | "
                         f"{np.mean(finals) - mean:+.2f} | {t:+.2f} | {dof:.1f} | {p:.3f} | {gap:.2f} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def permutation_p_value(a, b) -> float:
    """Two-sided p-value of mean(a) - mean(b): the share of all splits of the pooled seeds into groups of
    len(a) and len(b) whose means differ at least as much (exact; no assumption about the distribution)."""
    pooled = np.concatenate([a, b]).astype(float)
    observed = abs(np.mean(a) - np.mean(b))
    gaps = [abs(pooled[list(chosen)].mean() - np.delete(pooled, chosen).mean())
            for chosen in combinations(range(len(pooled)), len(a))]
    return float(np.mean(np.array(gaps) >= observed - 1e-9))


@dataclass
class Run:
    path: Path
    env_id: str
    config: str
    seed: str
    steps: np.ndarray  # global step at each finished game
    wall: np.ndarray  # seconds since the run's first log entry at each finished game
    returns: np.ndarray
    steps_reached: int
    wall_seconds: float
    scalars: dict  # per-iteration tag (losses/approx_kl, ...) -> (global steps, values)

    @property
    def final_return(self) -> float:
        return float(np.mean(self.returns[-LAST_GAMES:])) if len(self.returns) else float("nan")


def find_runs(roots) -> list:
    """Every run under `roots`; a folder holding both forms is read from its events files."""
    events = {p.parent for root in roots for p in Path(root).rglob("events.out.tfevents.*")}
    texts = {p.parent for root in roots for p in Path(root).rglob("games.csv.gz")} - events
    return [read_run(folder) for folder in sorted(events)] + [read_text_run(folder) for folder in sorted(texts)]


def run_labels(folder: Path) -> tuple:
    """env id, configuration (exp_name) and seed, from the run name `<env_id>__<exp_name>__<seed>__<time>`."""
    parts = folder.name.split("__")
    return tuple((parts + ["?"] * 3)[:3])


def read_text_run(folder: Path) -> Run:
    """A run as to_text.py stores it: `seconds` already leaves out the gaps between sessions."""
    with gzip.open(folder / "games.csv.gz", "rt", newline="") as f:
        games = list(csv.DictReader(f))
    with gzip.open(folder / "iterations.csv.gz", "rt", newline="") as f:
        iterations = list(csv.DictReader(f))
    env_id, config, seed = run_labels(folder)
    return Run(
        path=folder, env_id=env_id, config=config, seed=seed,
        steps=np.array([int(g["step"]) for g in games]),
        wall=np.array([float(g["seconds"]) for g in games]),
        returns=np.array([float(g["return"]) for g in games]),
        steps_reached=int(iterations[-1]["step"]) if iterations else 0,
        wall_seconds=float(iterations[-1]["seconds"]) if iterations else 0.0,
        scalars={tag: (np.array([int(i["step"]) for i in iterations]), np.array([float(i[tag]) for i in iterations]))
                 for tag in (iterations[0] if iterations else {}) if tag not in ("seconds", "step")},
    )


def read_run(folder: Path) -> Run:
    env_id, config, seed = run_labels(folder)
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    games = acc.Scalars("charts/episodic_return") if "charts/episodic_return" in acc.Tags()["scalars"] else []
    progress = acc.Scalars("charts/SPS") if "charts/SPS" in acc.Tags()["scalars"] else []
    segments = sorted(filter(None, map(file_span, folder.glob("events.out.tfevents.*"))))
    return Run(
        path=folder, env_id=env_id, config=config, seed=seed,
        steps=np.array([e.step for e in games]),
        wall=active_seconds(np.array([e.wall_time for e in games]), segments),
        returns=np.array([e.value for e in games]),
        steps_reached=max([e.step for e in progress] or [0]),
        wall_seconds=round(sum(end - start for start, end in segments), 3),  # to the ms, as to_text.py stores it
        scalars={tag: tuple(np.array(column) for column in zip(*((e.step, e.value) for e in acc.Scalars(tag))))
                 for tag in acc.Tags()["scalars"] if tag not in GAME_TAGS},
    )


def file_span(path: Path) -> tuple:
    """The wall times of the first and the last value logged in one events file (one session of a run)."""
    times = [event.wall_time for event in EventFileLoader(str(path)).Load() if event.HasField("summary")]
    return (min(times), max(times)) if times else None


def active_seconds(times: np.ndarray, segments: list) -> np.ndarray:
    """Seconds of logging before each of `times`, leaving out the gaps between the sorted (start, end) segments."""
    times = np.asarray(times, dtype=float)
    starts, ends = np.array(segments, dtype=float).reshape(-1, 2).T
    before = np.concatenate([[0.0], np.cumsum(ends - starts)[:-1]])  # logged in the earlier segments
    k = np.clip(np.searchsorted(starts, times, side="right") - 1, 0, None)
    return before[k] + np.clip(times - starts[k], 0, ends[k] - starts[k])


def table(runs: list) -> str:
    groups = defaultdict(list)
    for run in runs:
        groups[(run.env_id, run.config)].append(run)
    lines = [f"| env | configuration | seeds | return (mean of last {LAST_GAMES} games; mean +- std over seeds) "
             "| 95% CI of the mean | per seed | steps reached | wall time | steps/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (env_id, config), group in sorted(groups.items()):
        finals = np.array([run.final_return for run in group])
        sps = [run.steps_reached / run.wall_seconds for run in group if run.wall_seconds > 0]
        low, high = confidence_interval(finals)
        lines.append(
            f"| {env_id} | {config} | {len(group)} | {np.mean(finals):.2f} +- {np.std(finals):.2f} | "
            + (f"{low:.2f} .. {high:.2f}" if len(group) > 1 else "-") + " | "
            + ", ".join(f"{run.seed}: {run.final_return:.2f}" for run in group) + " | "
            + ", ".join(f"{run.steps_reached:,}" for run in group) + " | "
            + ", ".join(f"{run.wall_seconds / 60:.0f} min" for run in group) + " | "
            + (f"{np.mean(sps):.0f}" if sps else "-") + " |"
        )
    return "\n".join(lines) + "\n"


def baseline_table(runs: list, baseline: str) -> str:
    groups = defaultdict(list)
    for run in runs:
        groups[(run.env_id, run.config)].append(run.final_return)
    lines = [f"Against {baseline} (last-{LAST_GAMES}-game means):", "",
             f"| env | configuration | seeds | mean - {baseline}'s | permutation p | seeds inside its 95% CI "
             "| seeds inside its 95% prediction interval |", "|---|---|---|---|---|---|---|"]
    for (env_id, config), finals in sorted(groups.items()):
        base = groups.get((env_id, baseline))
        if config == baseline or base is None or len(base) < 2:
            continue
        ci, pi = confidence_interval(base), prediction_interval(base)
        lines.append(f"| {env_id} | {config} | {len(finals)} | {np.mean(finals) - np.mean(base):+.2f} | "
                     f"{permutation_p_value(finals, base):.3f} | "
                     f"{sum(ci[0] <= f <= ci[1] for f in finals)} of {len(finals)} ({ci[0]:.2f} .. {ci[1]:.2f}) | "
                     f"{sum(pi[0] <= f <= pi[1] for f in finals)} of {len(finals)} ({pi[0]:.2f} .. {pi[1]:.2f}) |")
    return "\n".join(lines) + "\n"


def cell(value: float) -> str:
    return "-" if np.isnan(value) else f"{value:.2f}"


def window_starts(runs: list, window: int, ends=None) -> list:
    """The first step of each window: those ending at `ends`, or every window up to the furthest run."""
    return [end - window for end in ends] if ends else list(range(0, max(run.steps_reached for run in runs), window))


def window_table(runs: list, window: int, ends=None) -> str:
    """Per env and configuration: each seed's mean return over the games that ended in each window of steps
    (every window, or the windows ending at `ends`)."""
    lines = []
    groups = defaultdict(list)
    for run in runs:
        groups[(run.env_id, run.config)].append(run)
    for (env_id, config), group in sorted(groups.items()):
        edges = window_starts(group, window, ends)
        rows = [[float(np.mean(run.returns[(run.steps >= lo) & (run.steps < lo + window)]))
                 if np.any((run.steps >= lo) & (run.steps < lo + window)) else float("nan") for lo in edges]
                for run in group]
        lines += [f"{env_id}, {config}: mean return of the games ending in each {window:,}-step window", "",
                  "| seed | " + " | ".join(f"{lo / 1e6:g}M-{(lo + window) / 1e6:g}M" for lo in edges) + " |",
                  "|---|" + "---|" * len(edges)]
        lines += [f"| {run.seed} | " + " | ".join(map(cell, row)) + " |" for run, row in zip(group, rows)]
        if len(group) > 1:  # over every seed, or none: a mean over fewer seeds would jump where one ends
            lines.append("| mean | " + " | ".join(map(cell, np.mean(rows, axis=0))) + " |")
        if np.isnan(rows).any():
            lines += ["", "-: no game ended in that window" + (" (in the mean row: for some seed)." if len(group) > 1
                                                              else ".")]
        lines.append("")
    return "\n".join(lines)


def scalar_table(runs: list, tags: list, window: int, ends=None) -> str:
    """Per env and logged tag: each configuration's mean over its seeds of the tag's mean over the iterations
    that ended in each window of steps (every window, or the windows ending at `ends`)."""
    lines = []
    groups = defaultdict(lambda: defaultdict(list))
    for run in runs:
        groups[run.env_id][run.config].append(run)
    for env_id, configs in sorted(groups.items()):
        edges = window_starts([run for group in configs.values() for run in group], window, ends)
        for tag in tags:
            lines += [f"{env_id}, `{tag}`: mean over the iterations ending in each {window:,}-step window "
                      "(mean over seeds)", "",
                      "| configuration | " + " | ".join(f"{lo / 1e6:g}M-{(lo + window) / 1e6:g}M" for lo in edges)
                      + " |", "|---|" + "---|" * len(edges)]
            for config, group in sorted(configs.items()):
                if any(tag not in run.scalars for run in group):
                    raise SystemExit(f"report.py: error: {config} on {env_id} has no logged {tag}")
                means = []
                for lo in edges:
                    per_seed = [values[(steps >= lo) & (steps < lo + window)]
                                for steps, values in (run.scalars[tag] for run in group)]
                    means.append(float(np.mean([v.mean() for v in per_seed])) if all(len(v) for v in per_seed)
                                 else float("nan"))
                lines.append(f"| {config} | " + " | ".join("-" if np.isnan(m) else f"{m:.4g}" for m in means) + " |")
            lines.append("")
    return "\n".join(lines)


def smoothed(run: Run, x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The running mean over the last LAST_GAMES games, read off at each grid point (NaN before any game)."""
    cumulative = np.concatenate([[0.0], np.cumsum(run.returns)])
    index = np.arange(1, len(run.returns) + 1)
    running = (cumulative[index] - cumulative[np.maximum(index - LAST_GAMES, 0)]) / np.minimum(index, LAST_GAMES)
    position = np.searchsorted(x, grid, side="right") - 1
    return np.where(position >= 0, running[np.clip(position, 0, None)], np.nan)


def seed_curves(group: list, axis: str, points: int = 200) -> tuple:
    """Each seed's running last-100 mean on one grid of `axis` ("steps" or "wall"), to its own last game, and
    their mean where every seed has got to (NaN elsewhere: a mean over fewer seeds would jump where one ends)."""
    ends = [getattr(run, axis)[-1] for run in group]
    grid = np.linspace(0, max(ends), points)
    curves = np.array([np.where(grid <= end, smoothed(run, getattr(run, axis), grid), np.nan)
                       for run, end in zip(group, ends)])
    return grid, curves, np.where(grid <= min(ends), np.mean(curves, axis=0), np.nan)


def plot(runs: list, out: Path, published: dict) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for env_id in sorted({run.env_id for run in runs}):
        env_runs = [run for run in runs if run.env_id == env_id and len(run.returns)]
        if not env_runs:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for config in sorted({run.config for run in env_runs}):
            group = [run for run in env_runs if run.config == config]
            for ax, axis in zip(axes, ("steps", "wall")):
                grid, curves, mean = seed_curves(group, axis)
                scale = 1 if axis == "steps" else 1 / 60
                line, = ax.plot(grid * scale, mean, label=f"{config} ({len(group)} seed{'s' if len(group) > 1 else ''}"
                                + (": mean and each seed)" if len(group) > 1 else ")"))
                for curve in curves if len(group) > 1 else []:
                    ax.plot(grid * scale, curve, color=line.get_color(), alpha=0.45, linewidth=0.8)
        axes[0].set_xlabel("global step")
        axes[1].set_xlabel("wall time (minutes)")
        for ax in axes:
            if env_id in published:
                published_mean, published_std = published[env_id]
                ax.axhspan(published_mean - published_std, published_mean + published_std, color="grey", alpha=0.25,
                           label=f"published {published_mean:g} +- {published_std:g}")
            ax.set_ylabel(f"episodic return (mean of last {LAST_GAMES})")
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right")  # curves rise: the top (where a published band lies) stays clear
        fig.suptitle(env_id)
        fig.tight_layout()
        path = out / f"learning-{env_id}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("roots", nargs="+", help="folders to search for runs (TensorBoard or text)")
    parser.add_argument("--out", required=True, help="folder for learning.md and the PNG curves")
    parser.add_argument("--title", default="Learning results")
    parser.add_argument("--window", type=int, default=200_000, help="steps per window of the per-seed table")
    parser.add_argument("--windows-at", type=int, nargs="+", metavar="STEP",
                        help="show only the windows ending at these steps (e.g. 1000000 10000000)")
    parser.add_argument("--published", nargs=3, action="append", default=[], metavar=("ENV_ID", "MEAN", "STD"),
                        help="draw an env's published result (mean +- std over its seeds) as a band on its curves; "
                             "once per env")
    parser.add_argument("--published-single", nargs=3, action="append", default=[], metavar=("ENV_ID", "MEAN", "STD"),
                        help="an env's published single-process result, set against configurations of 2+ seeds")
    parser.add_argument("--scalars", nargs="+", default=[], metavar="TAG",
                        help="also tabulate these per-iteration tags (e.g. losses/approx_kl losses/clipfrac) per window")
    parser.add_argument("--baseline", help="configuration (exp_name) to set the others against")
    opts = parser.parse_args()
    runs = find_runs(opts.roots)
    if not runs:
        raise SystemExit(f"report.py: error: no runs (TensorBoard or text) under {', '.join(opts.roots)}")
    first = {}
    for run in runs:  # a seed counts once: a rerun of one would weigh twice in the mean over seeds
        key = (run.env_id, run.config, run.seed)
        if key in first:
            raise SystemExit(f"report.py: error: {first[key]} and {run.path} are both seed {run.seed} of "
                             f"{run.config} on {run.env_id}; report a rerun from a folder of its own")
        first[key] = run.path
    if opts.baseline and sum(run.config == opts.baseline for run in runs) < 2:
        raise SystemExit(f"report.py: error: --baseline {opts.baseline} needs at least 2 seeds of that configuration")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    images = plot(runs, out, {env_id: (float(mean), float(std)) for env_id, mean, std in opts.published})
    published = defaultdict(dict)
    for label, option in (("multi-GPU", opts.published), ("single-GPU", opts.published_single)):
        for env_id, mean, std in option:
            published[env_id][label] = (float(mean), float(std))
    comparison = published_table(runs, published)
    text = (f"# {opts.title}\n\n" + table(runs) + "\n" + (comparison + "\n" if comparison else "")
            + (baseline_table(runs, opts.baseline) + "\n" if opts.baseline else "")
            + window_table(runs, opts.window, opts.windows_at) + "\n"
            + (scalar_table(runs, opts.scalars, opts.window, opts.windows_at) + "\n" if opts.scalars else "")
            + "".join(f"![{p.stem}]({p.name})\n" for p in images))
    (out / "learning.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
