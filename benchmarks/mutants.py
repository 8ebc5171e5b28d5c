"""Does the test suite catch a wrong algorithm? Break a copy of the script in one place at a time and run the
algorithm's tests on it: every mutant must make them fail.

    python benchmarks/mutants.py                      # every mutant; writes results/mutants.md
    python benchmarks/mutants.py --only pg-min-max    # some of them

Each mutant replaces one exact piece of ppo_atari_multigpu.py (it must occur exactly once) in a copy of
the repository under a temporary folder, then runs `pytest -x` on TESTS there. The tests are a subset of
the README's test command, so a mutant they catch makes that command fail too. The repository itself is
never changed.
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from throughput import machine_description  # noqa: E402
TESTS = ["tests/test_algorithm.py", "tests/test_advantages.py", "tests/test_update_oracle.py", "tests/test_allreduce.py",
         "tests/test_rollout.py", "tests/test_preprocessing.py", "tests/test_invariance.py"]

MUTANTS = [  # (name, what it breaks, exact original text, replacement)
    ("pg-min-max", "min instead of max in the clipped objective",
     "pg_loss = torch.max(pg_loss1, pg_loss2).mean()", "pg_loss = torch.min(pg_loss1, pg_loss2).mean()"),
    ("pg-sign", "policy loss with the wrong sign", "pg_loss1 = -advantages * ratio", "pg_loss1 = advantages * ratio"),
    ("pg-no-clip", "the ratio not clipped",
     "torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)", "ratio"),
    ("pg-clip-range", "clip range 1 +- 2 * clip_coef",
     "torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)", "torch.clamp(ratio, 1 - 2 * clip_coef, 1 + 2 * clip_coef)"),
    ("ratio-wrong-logprob", "ratio against the new log-probability (always 1)",
     'ppo_loss(newlogprob, batch["logprobs"][mb]', 'ppo_loss(newlogprob, newlogprob.detach()'),
    ("ratio-inverted", "ratio old / new", "logratio = newlogprob - oldlogprob", "logratio = oldlogprob - newlogprob"),
    ("entropy-sign", "entropy bonus with the wrong sign",
     "loss = pg_loss - ent_coef * entropy_loss", "loss = pg_loss + ent_coef * entropy_loss"),
    ("entropy-dropped", "no entropy bonus", "loss = pg_loss - ent_coef * entropy_loss", "loss = pg_loss - 0 * entropy_loss"),
    ("entropy-doubled", "entropy coefficient doubled",
     "loss = pg_loss - ent_coef * entropy_loss", "loss = pg_loss - 2 * ent_coef * entropy_loss"),
    ("vf-coef-dropped", "value coefficient dropped", "+ v_loss * vf_coef", "+ v_loss"),
    ("value-loss-half-dropped", "value loss without its 0.5",
     "v_loss = 0.5 * torch.max(v_loss_unclipped", "v_loss = torch.max(v_loss_unclipped"),
    ("value-clip-min-max", "min instead of max in the clipped value loss",
     "torch.max(v_loss_unclipped, (v_clipped - returns) ** 2)", "torch.min(v_loss_unclipped, (v_clipped - returns) ** 2)"),
    ("value-no-clip", "value clipping skipped under --clip-vloss",
     "v_clipped = oldvalue + torch.clamp(newvalue - oldvalue, -clip_coef, clip_coef)", "v_clipped = newvalue"),
    ("value-target-values", "value regressed on the old values instead of the returns",
     'batch["values"][mb], batch["returns"][mb], entropy', 'batch["values"][mb], batch["values"][mb], entropy'),
    ("returns-are-advantages", "returns = advantages (no + values)",
     "return advantages, advantages + values", "return advantages, advantages"),
    ("norm-adv-skipped", "advantage normalisation skipped", "    if adv_stats is not None:\n", "    if False:\n"),
    ("norm-adv-population-std", "normalised by the population std",
     "(total_of_squares - total * mean) / (count - 1)", "(total_of_squares - total * mean) / count"),
    ("norm-adv-epsilon", "normalisation epsilon 1e-5", "(std + 1e-8)", "(std + 1e-5)"),
    ("norm-adv-per-process", "advantages normalised with each process's share of the minibatch",
     'advantage_stats(batch["advantages"][minibatches], world_size)', 'advantage_stats(batch["advantages"][minibatches], 1)'),
    ("approx-kl", "approx_kl with + log r", "((ratio - 1) - logratio).mean()", "((ratio - 1) + logratio).mean()"),
    ("old-approx-kl", "old_approx_kl sign", '"old_approx_kl": (-logratio).mean()', '"old_approx_kl": logratio.mean()'),
    ("clipfrac", "clipfrac counts only ratios above the range",
     "((ratio - 1.0).abs() > clip_coef)", "((ratio - 1.0) > clip_coef)"),
    ("grad-clip-skipped", "gradient clipping skipped",
     "clip_grad_norm_(agent.parameters(), args.max_grad_norm)", 'clip_grad_norm_(agent.parameters(), float("inf"))'),
    ("allreduce-sum", "gradients summed over ranks, not averaged",
     "all_reduce_sum_(tensor, world_size).div_(world_size) if", "all_reduce_sum_(tensor, world_size) if"),
    ("adam-eps", "Adam eps 1e-8", "eps=1e-5, fused=True", "eps=1e-8, fused=True"),
    ("no-shuffle", "minibatches not shuffled",
     "order = noise.argsort(dim=-1, stable=True)", "order = torch.arange(num_steps).repeat(epochs, num_envs, 1)"),
    ("shuffle-per-process", "each process shuffles with its own seed",
     "draw_minibatches(shared_rng,", "draw_minibatches(torch.Generator().manual_seed(args.seed + rank + iteration),"),
    ("global-size-minibatches", "each process splits its data into global-size minibatches",
     "args.num_minibatches)\n        minibatches = local", "args.num_minibatches // world_size)\n        minibatches = local"),
    ("epochs-off-by-one", "one epoch too few",
     "for epoch in range(args.update_epochs):", "for epoch in range(args.update_epochs - 1):"),
    ("noise-per-process-seed", "each process samples actions from its own seed",
     "draw_gumbel(shared_rng,", "draw_gumbel(torch.Generator().manual_seed(args.seed + rank + iteration),"),
    ("noise-rows-of-process-0", "every process uses process 0's columns of the job's noise",
     "num_actions)[:, local_envs]", "num_actions)[:, :args.local_num_envs]"),
    ("losses-of-rank-0", "logged losses are rank 0's, not the job's",
     "all_reduce_mean_(totals / num_updates, world_size)", "(totals / num_updates)"),
    ("explained-variance-of-rank-0", "explained variance over rank 0's batch",
     'explained_variance(batch["values"], batch["returns"], world_size)', 'explained_variance(batch["values"], batch["returns"], 1)'),
    ("resume-without-adam", "resume skips the optimizer's state",
     '        optimizer.load_state_dict(resumed["optimizer"])\n', ""),
    ("resume-fresh-stream", "resume restarts the shared random stream",
     '        shared_rng.set_state(resumed["shared_rng"])\n', ""),
    ("obs-not-scaled", "observations not divided by 255", ".div_(255.0)", ".div_(1.0)"),
    ("lr-off-by-one", "schedule one iteration ahead", "(1.0 - (iteration - 1.0) / num_iterations)",
     "(1.0 - iteration / num_iterations)"),
    ("lr-anneal-ignored", "--no-anneal-lr ignored", "* learning_rate if anneal else learning_rate",
     "* learning_rate if True else learning_rate"),
    ("gae-done-off-by-one", "GAE cut one step late", "next_nonterminal = 1.0 - torch.cat([dones[1:], next_done.unsqueeze(0)])",
     "next_nonterminal = 1.0 - dones"),
    ("gae-no-lambda", "GAE without lambda", "gamma * gae_lambda * next_nonterminal[t] * last_gae",
     "gamma * next_nonterminal[t] * last_gae"),
    ("gae-no-gamma-in-delta", "TD error without gamma", "deltas = rewards + gamma * next_values",
     "deltas = rewards + next_values"),
    ("gae-across-ends", "GAE across episode ends", "deltas[t] + gamma * gae_lambda * next_nonterminal[t] * last_gae",
     "deltas[t] + gamma * gae_lambda * last_gae"),
    ("truncation-not-bootstrapped", "no bootstrap after a time-limit truncation",
     "        if truncated_only.any():\n", "        if False:\n"),
    ("termination-bootstrapped", "bootstrap after terminations too",
     "truncated_only = truncations & ~terminations", "truncated_only = truncations | terminations"),
    ("rewards-unclipped", "learner sees raw rewards", "lambda r: float(np.sign(r))", "lambda r: float(r)"),
    ("noop-max", "at most 10 no-ops at reset", "NoopReset(env, noop_max=30)", "NoopReset(env, noop_max=10)"),
    ("no-fire-reset", "FIRE never pressed after a reset", "env = FireReset(env)", "env = env"),
    ("life-loss-ends-nothing", "a lost life does not end the learning episode",
     "terminated = terminated or 0 < lives < self.lives", "terminated = terminated"),
    ("frame-skip", "3 frames per step", "MaxAndSkipObservation(env, skip=4)", "MaxAndSkipObservation(env, skip=3)"),
    ("actor-init-gain", "actor head initialised with gain 1", "nn.Linear(512, num_actions), std=0.01",
     "nn.Linear(512, num_actions), std=1"),
    ("trunk-init-gain", "trunk initialised with gain 1", "std: float = np.sqrt(2)", "std: float = 1.0"),
    ("early-stop-old-kl", "the early stop decided on old_approx_kl",
     'all_reduce_mean_(stats["approx_kl"].clone()', 'all_reduce_mean_(stats["old_approx_kl"].clone()'),
    ("zero-grad-set-to-none", "optimizer.zero_grad() in place of zeroing the flat buffer",
     "            flat_grad.zero_()\n", "            optimizer.zero_grad()\n"),
]


def run_mutant(name: str, old: str, new: str, workdir: Path) -> tuple:
    copy = workdir / name
    shutil.copytree(ROOT / "tests", copy / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    source = (ROOT / "ppo_atari_multigpu.py").read_text()
    if source.count(old) != 1:
        raise SystemExit(f"mutant {name}: the script contains its original text {source.count(old)} times, not once")
    (copy / "ppo_atari_multigpu.py").write_text(source.replace(old, new))
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *TESTS], cwd=copy,
                            capture_output=True, text=True, timeout=900)
    failed = [line.split(" ")[1] for line in result.stdout.splitlines() if line.startswith("FAILED ")]
    return result.returncode != 0, (failed[0] if failed else result.stdout.strip().splitlines()[-1]), time.time() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="names of the mutants to run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mutants.md"))
    opts = parser.parse_args()
    chosen = [m for m in MUTANTS if not opts.only or m[0] in opts.only]
    rows, survivors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, what, old, new in chosen:
            killed, by, seconds = run_mutant(name, old, new, Path(tmp))
            print(f"{'killed' if killed else 'SURVIVED':8} {name:30} {seconds:5.0f} s  {by}", flush=True)
            rows.append(f"| `{name}` | {what} | {'killed' if killed else '**survived**'} | `{by}` | {seconds:.0f} |")
            survivors += [] if killed else [name]
    table = "\n".join(["| mutant | what it breaks | result | first failing test | seconds |", "|---|---|---|---|---|", *rows])
    machine = ", ".join(f"{k} {v}" for k, v in machine_description().items())
    Path(opts.out).write_text(f"# Mutants of ppo_atari_multigpu.py against the algorithm's tests\n\n"
                              f"`python benchmarks/mutants.py`, {time.strftime('%Y-%m-%d')}; tests: {' '.join(TESTS)} "
                              f"(`pytest -x`).\n\nMachine: {machine}\n\n"
                              f"{len(chosen) - len(survivors)} of {len(chosen)} killed.\n\n{table}\n")
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} killed; {opts.out}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
