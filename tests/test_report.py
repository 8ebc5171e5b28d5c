"""benchmarks/report.py on TensorBoard files written by real runs of the script, and where returns.sh writes."""

import gzip
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ROOT, TAG_VARIABLE, run_python, script_env, tagged_pids, wait_until

sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402
import to_text  # noqa: E402

REPORT, TO_TEXT = str(ROOT / "benchmarks" / "report.py"), str(ROOT / "benchmarks" / "to_text.py")


def test_report_tables_and_plots_real_runs(tmp_path):
    # Two seeds of one tiny configuration: 2 envs x 128 steps x 3 iterations, enough for a few Breakout games.
    for seed in (1, 2):
        result = run_python(["--local-num-envs", "2", "--num-steps", "128", "--total-timesteps", "768",
                             "--exp-name", "tiny", "--seed", str(seed)], cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    finals, clipfracs = [], []
    for run in sorted((tmp_path / "runs").iterdir()):
        acc = EventAccumulator(str(run))
        acc.Reload()
        returns = [e.value for e in acc.Scalars("charts/episodic_return")]
        assert returns, "the runs must finish at least one game"
        finals.append(np.mean(returns[-100:]))
        clipfracs.append({e.step: e.value for e in acc.Scalars("losses/clipfrac")})

    out = tmp_path / "report"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), str(tmp_path / "runs"),
                             "--out", str(out), "--window", "256", "--scalars", "losses/clipfrac"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    table = (out / "learning.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| BreakoutNoFrameskip-v4 | tiny |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2] == "2"
    assert cells[3] == f"{np.mean(finals):.2f} +- {np.std(finals):.2f}"
    # 95% CI of the mean over 2 seeds: mean +- t(0.975, 1 dof) * sample std / sqrt(2)
    half = 12.706 * np.std(finals, ddof=1) / np.sqrt(2)
    assert cells[4] == f"{np.mean(finals) - half:.2f} .. {np.mean(finals) + half:.2f}"
    assert cells[6] == "768, 768"
    # The per-window table: one row per seed and a mean row, one column per 256-step window
    assert "mean return of the games ending in each 256-step window" in table
    assert "| seed | 0M-0.000256M | 0.000256M-0.000512M | 0.000512M-0.000768M |" in table
    # --scalars: one iteration (256 steps) ends in each window from the second on, so each cell is the seeds' mean
    # of that iteration's logged clipfrac; no iteration ends before step 256.
    expected = " | ".join(f"{(clipfracs[0][step] + clipfracs[1][step]) / 2:.4g}" for step in (256, 512))
    assert f"| tiny | - | {expected} |" in table, table
    png = out / "learning-BreakoutNoFrameskip-v4.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "![learning-BreakoutNoFrameskip-v4](learning-BreakoutNoFrameskip-v4.png)" in table

    # Stored as text (what the repository keeps), the same runs give the same report.
    result = subprocess.run([sys.executable, TO_TEXT, str(tmp_path / "runs"), "--out", str(tmp_path / "text")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert not list((tmp_path / "text").rglob("events.out.tfevents.*"))
    result = subprocess.run([sys.executable, REPORT, str(tmp_path / "text"), "--out", str(tmp_path / "from-text"),
                             "--window", "256", "--scalars", "losses/clipfrac"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "from-text" / "learning.md").read_text() == table
    # The tables round steps/s, which hides a disagreement except at a rounding boundary: compare the wall times.
    for run in sorted((tmp_path / "runs").iterdir()):
        assert report.read_run(run).wall_seconds == report.read_text_run(tmp_path / "text" / run.name).wall_seconds
    # ... and every logged loss and game, value by value (what compare_runs.py checks a refactoring with).
    run = sorted((tmp_path / "runs").iterdir())[0]
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare_runs.py"), str(run),
                             str(tmp_path / "text" / run.name)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "identical" in result.stdout, result.stdout + result.stderr

    # The same two runs again under another configuration, set against the first: no difference at all.
    for run in sorted((tmp_path / "runs").iterdir()):
        shutil.copytree(run, tmp_path / "runs" / run.name.replace("__tiny__", "__tiny-copy__"))
    command = [sys.executable, str(ROOT / "benchmarks" / "report.py"), str(tmp_path / "runs"), "--out", str(out)]
    result = subprocess.run(command + ["--baseline", "tiny"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    row = next(line for line in (out / "learning.md").read_text().splitlines()
               if line.startswith("| BreakoutNoFrameskip-v4 | tiny-copy | 2 | +0.00 | 1.000 |"))
    assert "| 2 of 2 (" in row and row.count("2 of 2") == 2, row
    result = subprocess.run(command + ["--baseline", "nope"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--baseline nope needs at least 2 seeds" in result.stderr

    # Against published results (mean +- ddof-0 std over 3 seeds): Welch's t of the two seeds' mean.
    result = subprocess.run(command + ["--published", "BreakoutNoFrameskip-v4", "1", "0.5", "--published-single",
                                       "BreakoutNoFrameskip-v4", "2", "0.5"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for label, mean in (("multi-GPU", 1.0), ("single-GPU", 2.0)):
        row = next(line for line in (out / "learning.md").read_text().splitlines()
                   if line.startswith(f"| BreakoutNoFrameskip-v4 | tiny | 2 | {np.mean(finals):.2f} |") and label in line)
        t = (np.mean(finals) - mean) / np.sqrt(np.var(finals, ddof=1) / 2 + 0.5 ** 2 * 3 / 2 / 3)
        assert f"| {np.mean(finals) - mean:+.2f} | {t:+.2f} |" in row, row

    # A rerun of seed 1 (another start time) beside the first: refused, not averaged in as a third seed.
    first = sorted((tmp_path / "text").iterdir())[0]
    shutil.copytree(first, tmp_path / "text" / (first.name.rsplit("__", 1)[0] + "__9999999999"))
    result = subprocess.run([sys.executable, REPORT, str(tmp_path / "text"), "--out", str(out)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "are both seed 1 of tiny on BreakoutNoFrameskip-v4" in result.stderr


def test_report_refuses_an_empty_folder(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), str(tmp_path),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "no runs (TensorBoard or text)" in result.stderr


def test_welch_t_test_worked_by_hand():
    # Seeds 1, 2, 3 against a published 4 +- sqrt(2/3) over 3 seeds (ddof 0: seeds 3, 4, 5). Both sample variances
    # are 1: t = (2 - 4) / sqrt(1/3 + 1/3) = -sqrt(6); dof = (2/3)^2 / (2 (1/3)^2 / 2) = 4. Student's t with 4 dof
    # has the closed form F(t) = 1/2 + 3x/4 - x^3/4, x = t / sqrt(4 + t^2) = sqrt(0.6), so p = 2 (1 - F(sqrt 6)).
    t, dof, p, gap = report.welch_t_test([1, 2, 3], 4.0, np.sqrt(2 / 3), 3)
    x = np.sqrt(0.6)
    assert np.isclose(t, -np.sqrt(6)) and np.isclose(dof, 4.0)
    assert np.isclose(p, 2 * (1 - (0.5 + 0.75 * x - 0.25 * x ** 3)), rtol=1e-6)  # 0.0705
    # The detectable gap: t(0.975, 4 dof) = 2.776445 (tables) times the standard error sqrt(2/3): 2.266966.
    assert np.isclose(gap, 2.776445 * np.sqrt(2 / 3), rtol=1e-5)


def synthetic_run(seed, steps, returns):
    """A run whose games end at `steps` with `returns`, one second per step, reaching its last game's step."""
    return report.Run(path=Path(seed), env_id="BreakoutNoFrameskip-v4", config="c", seed=seed, steps=np.array(steps),
                      wall=np.array(steps, dtype=float), returns=np.array(returns, dtype=float),
                      steps_reached=steps[-1], wall_seconds=float(steps[-1]), scalars={})


def test_seeds_that_stopped_at_different_steps():
    # Seed 1's games end at steps 10, 20, 30 with returns 1, 2, 3; seed 2 (a run still going) at 10, 20 with 5, 7.
    # Fewer than 100 games: each curve is the running mean of all games so far. On the grid 0, 10, 20, 30:
    # seed 1: -, 1, 1.5, 2; seed 2: -, 5, 6, and nothing past its last game; the mean only where both have got to.
    going = [synthetic_run("1", [10, 20, 30], [1, 2, 3]), synthetic_run("2", [10, 20], [5, 7])]
    grid, curves, mean = report.seed_curves(going, "steps", points=4)
    nan = np.nan
    assert np.allclose(grid, [0, 10, 20, 30])
    assert np.allclose(curves, [[nan, 1, 1.5, 2], [nan, 5, 6, nan]], equal_nan=True)
    assert np.allclose(mean, [nan, 3, 3.75, nan], equal_nan=True)
    # Windows 10-20 and 30-40 steps: seed 1 has games in both (1 and 3), seed 2 in the first only (5).
    assert "| 1 | 1.00 | 3.00 |\n| 2 | 5.00 | - |\n| mean | 3.00 | - |" in report.window_table(going, 10, [20, 40])
    # Set against a published result only once both have reached the same step: means 2 and 6, mean 4.
    published = {"BreakoutNoFrameskip-v4": {"multi-GPU": (4.0, 1.0)}}
    assert report.published_table(going, published) == ""
    finished = going[:1] + [synthetic_run("2", [10, 20, 30], [5, 7, 6])]
    # Difference 0, so t 0 and p 1. Standard error sqrt(8/2 + 1 * 3/2 / 3) = sqrt(4.5); Welch's dof
    # 4.5^2 / (4^2 / 1 + 0.5^2 / 2) = 20.25 / 16.125 = 1.256, between t(0.975)'s 12.706 at 1 dof and 4.303 at 2.
    row = next(line for line in report.published_table(finished, published).splitlines() if "multi-GPU" in line)
    assert row.startswith("| BreakoutNoFrameskip-v4 | c | 2 | 4.00 | 2.00 | 2.83 | multi-GPU | 4 +- 1 | +0.00 | "
                          "+0.00 | 1.3 | 1.000 | "), row
    assert 4.303 * np.sqrt(4.5) < float(row.split("|")[-2]) < 12.706 * np.sqrt(4.5), row


def test_baseline_statistics_worked_by_hand():
    # Pooled 1, 2, 3, 4 split into pairs: {1,2}|{3,4} and {3,4}|{1,2} differ by 2, {1,3}|{2,4} and {2,4}|{1,3}
    # by 1, {1,4}|{2,3} and {2,3}|{1,4} by 0: 2 of the 6 splits differ at least as much as the observed 2.
    assert np.isclose(report.permutation_p_value([1, 2], [3, 4]), 2 / 6)
    # 20 splits of six seeds into threes: only the observed one and its mirror differ by 9.
    assert np.isclose(report.permutation_p_value([1, 2, 3], [10, 11, 12]), 2 / 20)
    # 1, 2, 3, 4: mean 2.5, sample std sqrt(5/3); t(0.975, 3) = 3.182; 3.182 * sqrt(5/3) * sqrt(1 + 1/4) = 4.5928
    low, high = report.prediction_interval([1, 2, 3, 4])
    assert np.isclose(low, 2.5 - 4.5928, atol=1e-4) and np.isclose(high, 2.5 + 4.5928, atol=1e-4)


def test_resumed_run_counts_only_the_time_it_ran(tmp_path):
    # A run resumed in a later session writes a second events file into its folder; the hours between the
    # sessions are not the run's. Session 1 logs from wall time 1000 to 1100, session 2 from 5000 to 5200.
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path / "runs" / "BreakoutNoFrameskip-v4__resumed__1__1000"
    sessions = [[("charts/SPS", 1, 100, 1000), ("charts/episodic_return", 1, 150, 1050),
                 ("charts/episodic_return", 3, 180, 1090), ("charts/SPS", 1, 200, 1100)],
                [("charts/SPS", 1, 300, 5000), ("charts/episodic_return", 5, 350, 5100),
                 ("charts/SPS", 1, 400, 5200)]]
    for session in sessions:
        writer = SummaryWriter(str(folder))
        for tag, value, step, wall_time in session:
            writer.add_scalar(tag, value, step, walltime=wall_time)
            if tag == "charts/episodic_return":
                writer.add_scalar("charts/episodic_length", 100 * value, step, walltime=wall_time)
        writer.close()
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2
    run = report.read_run(folder)
    assert run.wall_seconds == 100 + 200 and run.steps_reached == 400
    # Games at 1050 and 1090: 50 and 90 s into session 1; at 5100: 100 s of session 1 + 100 s into session 2.
    assert np.allclose(run.wall, [50, 90, 200])

    # The windows ending at 200 and 400 steps, 100 steps wide: games 1 and 3 in the first, game 5 in the second.
    out = tmp_path / "report"
    command = [sys.executable, str(ROOT / "benchmarks" / "report.py"), str(tmp_path / "runs"), "--out", str(out),
               "--window", "100", "--windows-at", "200", "400"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    table = (out / "learning.md").read_text()
    assert "| seed | 0.0001M-0.0002M | 0.0003M-0.0004M |\n|---|---|---|\n| 1 | 2.00 | 5.00 |" in table
    # 400 steps in 300 s of running: 1 steps/s (with the gap: 400 / 4200 s, which would print 0)
    row = next(line for line in table.splitlines() if line.startswith("| BreakoutNoFrameskip-v4 | resumed |"))
    assert row.endswith("| 400 | 5 min | 1 |"), row

    # A window the run has not reached (500-600 steps, for a run still going) holds no game: "-", not nan.
    result = subprocess.run(command + ["600"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    table = (out / "learning.md").read_text()
    assert "| 1 | 2.00 | 5.00 | - |" in table and "-: no game ended in that window." in table

    # The published band is drawn: the same curves with and without it are different pictures.
    png = out / "learning-BreakoutNoFrameskip-v4.png"
    without = png.read_bytes()
    result = subprocess.run(command + ["--published", "BreakoutNoFrameskip-v4", "4", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    band_drawn = png.read_bytes() != without
    assert band_drawn, "--published left the picture as it was"
    result = subprocess.run(command + ["--published", "PongNoFrameskip-v4", "4", "1"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert png.read_bytes() == without, "another env's published result was drawn on Breakout's curves"

    # As text, with one iteration row kept: the games keep their seconds and the last iteration is always kept,
    # so steps reached (400) and wall time (300 s) stay; converting again writes the same bytes.
    text_folder = tmp_path / "text" / folder.name
    to_text.convert(folder, text_folder, max_rows=1)
    first = {p.name: p.read_bytes() for p in text_folder.iterdir()}
    to_text.convert(folder, text_folder, max_rows=1)
    assert {p.name: p.read_bytes() for p in text_folder.iterdir()} == first
    stored = report.read_text_run(text_folder)
    assert stored.wall_seconds == 300 and stored.steps_reached == 400
    assert np.allclose(stored.wall, [50, 90, 200]) and list(stored.steps) == [150, 180, 350]
    assert list(stored.returns) == [1, 3, 5]
    with gzip.open(text_folder / "games.csv.gz", "rt") as f:
        assert f.read().splitlines()[1:] == ["50.000,150,1.0,100", "90.000,180,3.0,300", "200.000,350,5.0,500"]


def returns_sh_part(repo: Path, work: Path, console: Path, **extra_env) -> str:
    """One part of `returns.sh cpu-10m BreakoutNoFrameskip-v4 2`: its torchrun is stopped (SIGTERM, as a
    preemption) once an iteration more has been logged; returns.sh then stores the run as text and exits."""
    logged = console.read_text().count("\niter ") if console.exists() else 0
    job = subprocess.Popen(["bash", str(repo / "benchmarks" / "returns.sh"), "cpu-10m", "BreakoutNoFrameskip-v4", "2"],
                           env={**script_env(), "RUNS_DIR": str(work), **extra_env}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    wait_until(lambda: console.exists() and console.read_text().count("\niter ") > logged, timeout=240)
    (launcher,) = [pid for pid in tagged_pids(script_env()[TAG_VARIABLE])
                   if b"torchrun" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    os.kill(launcher, signal.SIGTERM)
    output, _ = job.communicate(timeout=180)
    assert job.returncode != 0 and "summary: interrupted" in output, output  # the same command continues it
    return output


def test_a_rerun_of_a_committed_result_writes_to_a_folder_of_its_own(tmp_path):
    # returns.sh in a copy of the repository: the 10M command for Breakout's seed 2, in two parts.
    repo, work = tmp_path / "repo", tmp_path / "work"
    (repo / "benchmarks" / "results" / "learning-10m").mkdir(parents=True)  # a committed result to keep
    shutil.copy(ROOT / "ppo_atari_multigpu.py", repo)
    for name in ("returns.sh", "to_text.py", "report.py"):
        shutil.copy(ROOT / "benchmarks" / name, repo / "benchmarks")
    console = work / "10m-BreakoutNoFrameskip-v4__2x4-fp32__2" / "console.txt"
    returns_sh_part(repo, work, console)
    (results,) = (repo / "benchmarks" / "results" / "reruns").iterdir()
    assert results.name.startswith("learning-cpu-10m-")
    assert not list((repo / "benchmarks" / "results" / "learning-10m").iterdir())  # untouched
    assert (results / "console-BreakoutNoFrameskip-v4__2x4-fp32__2.txt").read_text() == console.read_text()
    (run,) = (results / "runs").iterdir()
    assert run.name.startswith("BreakoutNoFrameskip-v4__2x4-fp32__2__") and (run / "games.csv.gz").is_file()
    # The next part continues the run (--resume auto) and stores it in the folder its first part chose.
    output = returns_sh_part(repo, work, console)
    assert "resumed from checkpoints/BreakoutNoFrameskip-v4__2x4-fp32__2/" in output
    assert list((repo / "benchmarks" / "results" / "reruns").iterdir()) == [results]
    assert [p.name for p in (results / "runs").iterdir()] == [run.name]
