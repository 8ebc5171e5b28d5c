"""Do the tests pin what they claim? Break a copy of the script in one place at a time and run the tests named
for that place: every one of them must fail.

    python benchmarks/mutants.py                      # every mutant; writes results/mutants.md
    python benchmarks/mutants.py --only pg-min-max    # some of them

Each mutant replaces one exact piece of ppo_atari_multigpu.py (it must occur exactly once) in a copy of the
repository under a temporary folder and runs the tests it names there; it is killed when every named test
fails (a parametrised test fails when any of its cases does). The names are the README's "pinned by" for the
detail the mutant breaks, so a test named there that would still pass shows up here. The repository itself is
never changed.
"""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from throughput import machine_description  # noqa: E402

ORACLE = "test_update_matches_the_textbook_update"
INVARIANCE = "test_every_split_of_the_envs_computes_the_same_experiment"
MUTANTS = [  # (name, what it breaks, exact original text, replacement, the tests that must fail)
    # the loss
    ("pg-min-max", "min instead of max in the clipped objective",
     "pg_loss = torch.max(pg_loss1, pg_loss2).mean()", "pg_loss = torch.min(pg_loss1, pg_loss2).mean()",
     "test_policy_loss_is_the_pessimistic_clipped_surrogate " + ORACLE),
    ("pg-sign", "policy loss with the wrong sign", "pg_loss1 = -advantages * ratio", "pg_loss1 = advantages * ratio",
     "test_policy_loss_is_the_pessimistic_clipped_surrogate " + ORACLE),
    ("pg-no-clip", "the ratio not clipped", "torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)", "ratio",
     "test_policy_loss_is_the_pessimistic_clipped_surrogate " + ORACLE),
    ("pg-clip-range", "clip range 1 +- 2 * clip_coef", "torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)",
     "torch.clamp(ratio, 1 - 2 * clip_coef, 1 + 2 * clip_coef)",
     "test_policy_loss_is_the_pessimistic_clipped_surrogate " + ORACLE),
    ("ratio-wrong-logprob", "ratio against the new log-probability (always 1)",
     'ppo_loss(newlogprob, batch["logprobs"][mb]', 'ppo_loss(newlogprob, newlogprob.detach()', ORACLE),
    ("ratio-inverted", "ratio old / new", "logratio = newlogprob - oldlogprob", "logratio = oldlogprob - newlogprob",
     "test_policy_loss_is_the_pessimistic_clipped_surrogate test_kl_estimates_and_clip_fraction " + ORACLE),
    ("entropy-sign", "entropy bonus with the wrong sign",
     "loss = pg_loss - ent_coef * entropy_loss", "loss = pg_loss + ent_coef * entropy_loss",
     "test_entropy_bonus_and_total_loss " + ORACLE),
    ("entropy-dropped", "no entropy bonus", "loss = pg_loss - ent_coef * entropy_loss",
     "loss = pg_loss - 0 * entropy_loss", "test_entropy_bonus_and_total_loss " + ORACLE),
    ("entropy-doubled", "entropy coefficient doubled", "loss = pg_loss - ent_coef * entropy_loss",
     "loss = pg_loss - 2 * ent_coef * entropy_loss", "test_entropy_bonus_and_total_loss " + ORACLE),
    ("vf-coef-dropped", "value coefficient dropped", "+ v_loss * vf_coef", "+ v_loss",
     "test_entropy_bonus_and_total_loss " + ORACLE),
    ("value-loss-half-dropped", "value loss without its 0.5",
     "v_loss = 0.5 * torch.max(v_loss_unclipped", "v_loss = torch.max(v_loss_unclipped",
     "test_clipped_value_loss " + ORACLE),
    ("value-clip-min-max", "min instead of max in the clipped value loss",
     "torch.max(v_loss_unclipped, (v_clipped - returns) ** 2)", "torch.min(v_loss_unclipped, (v_clipped - returns) ** 2)",
     "test_clipped_value_loss " + ORACLE),
    ("value-no-clip", "value clipping skipped under --clip-vloss",
     "v_clipped = oldvalue + torch.clamp(newvalue - oldvalue, -clip_coef, clip_coef)", "v_clipped = newvalue",
     "test_clipped_value_loss " + ORACLE),
    ("value-unclipped-half", "the unclipped value loss (--no-clip-vloss) without its 0.5",
     "v_loss = 0.5 * v_loss_unclipped.mean()", "v_loss = v_loss_unclipped.mean()", "test_unclipped_value_loss " + ORACLE),
    ("value-target-values", "value regressed on the old values instead of the returns",
     'batch["values"][mb], batch["returns"][mb], entropy', 'batch["values"][mb], batch["values"][mb], entropy', ORACLE),
    ("approx-kl", "approx_kl with + log r", "((ratio - 1) - logratio).mean()", "((ratio - 1) + logratio).mean()",
     "test_kl_estimates_and_clip_fraction"),
    ("old-approx-kl", "old_approx_kl sign", '"old_approx_kl": (-logratio).mean()', '"old_approx_kl": logratio.mean()',
     "test_kl_estimates_and_clip_fraction"),
    ("clipfrac", "clipfrac counts only ratios above the range",
     "((ratio - 1.0).abs() > clip_coef)", "((ratio - 1.0) > clip_coef)", "test_kl_estimates_and_clip_fraction"),
    # advantages and their normalisation
    ("norm-adv-skipped", "advantage normalisation skipped", "    if adv_stats is not None:\n", "    if False:\n",
     "test_advantages_are_normalised_per_minibatch_with_sample_std " + ORACLE),
    ("norm-adv-population-std", "normalised by the population std",
     "(total_of_squares - total * mean) / (count - 1)", "(total_of_squares - total * mean) / count",
     "test_advantages_are_normalised_per_minibatch_with_sample_std " + ORACLE),
    ("norm-adv-epsilon", "normalisation epsilon 1e-5", "(std + 1e-8)", "(std + 1e-5)",
     "test_advantage_normalisation_epsilon"),
    ("norm-adv-per-process", "advantages normalised with each process's share of the minibatch",
     'advantage_stats(batch["advantages"][minibatches], world_size)', 'advantage_stats(batch["advantages"][minibatches], 1)',
     "test_two_gloo_ranks_match_the_textbook_update_of_the_whole_batch"),
    ("norm-adv-stats-local", "advantage_stats sums each process's share only",
     "                           world_size)\n    count, total, total_of_squares = sums",
     "                           1)\n    count, total, total_of_squares = sums",
     "test_normalisation_and_explained_variance_are_over_every_rank "
     "test_two_gloo_ranks_match_the_textbook_update_of_the_whole_batch"),
    ("returns-are-advantages", "returns = advantages (no + values)",
     "return advantages, advantages + values", "return advantages, advantages",
     "test_gae_with_lambda_one_is_discounted_return_minus_value"),
    ("gae-done-off-by-one", "GAE cut one step late",
     "next_nonterminal = 1.0 - torch.cat([dones[1:], next_done.unsqueeze(0)])", "next_nonterminal = 1.0 - dones",
     "test_gae_matches_reference_with_episode_ends"),
    ("gae-no-lambda", "GAE without lambda", "gamma * gae_lambda * next_nonterminal[t] * last_gae",
     "gamma * next_nonterminal[t] * last_gae", "test_gae_matches_reference_with_episode_ends"),
    ("gae-no-gamma-in-delta", "TD error without gamma", "deltas = rewards + gamma * next_values",
     "deltas = rewards + next_values",
     "test_gae_matches_reference_with_episode_ends test_gae_with_lambda_one_is_discounted_return_minus_value"),
    ("gae-across-ends", "GAE across episode ends", "deltas[t] + gamma * gae_lambda * next_nonterminal[t] * last_gae",
     "deltas[t] + gamma * gae_lambda * last_gae", "test_gae_matches_reference_with_episode_ends"),
    ("gae-given-default-gamma", "train hands GAE the default gamma, not --gamma",
     "gamma=args.gamma, gae_lambda=args.gae_lambda)", "gamma=0.99, gae_lambda=args.gae_lambda)",
     "test_gae_gets_the_runs_gamma_lambda_and_the_value_after_the_last_step"),
    ("gae-given-default-lambda", "train hands GAE the default lambda, not --gae-lambda",
     "gamma=args.gamma, gae_lambda=args.gae_lambda)", "gamma=args.gamma, gae_lambda=0.95)",
     "test_gae_gets_the_runs_gamma_lambda_and_the_value_after_the_last_step"),
    ("gae-bootstraps-last-stored-obs", "the value after the last step taken from the last stored observation",
     "next_value = agent.get_value(rollout.next_obs).flatten()", "next_value = agent.get_value(rollout.obs[-1]).flatten()",
     "test_gae_gets_the_runs_gamma_lambda_and_the_value_after_the_last_step"),
    ("truncation-not-bootstrapped", "no bootstrap after a time-limit truncation",
     "        if truncated_only.any():\n", "        if False:\n", "test_truncation_is_bootstrapped_and_termination_is_not"),
    ("termination-bootstrapped", "bootstrap after terminations too",
     "truncated_only = truncations & ~terminations", "truncated_only = truncations | terminations",
     "test_truncation_is_bootstrapped_and_termination_is_not"),
    # the update and the learner
    ("grad-clip-skipped", "gradient clipping skipped",
     "clip_grad_norm_(trained, args.max_grad_norm)", 'clip_grad_norm_(trained, float("inf"))',
     ORACLE + " test_two_gloo_ranks_match_the_textbook_update_of_the_whole_batch"),
    ("grad-clip-before-all-reduce", "each process clips its own gradient, before the all-reduce",
     "            with ALLREDUCE_TIMER(flat_grad.device):\n                all_reduce_mean_(flat_grad, world_size)\n"
     "            grad_norm = nn.utils.clip_grad_norm_(trained, args.max_grad_norm)\n",
     "            grad_norm = nn.utils.clip_grad_norm_(trained, args.max_grad_norm)\n"
     "            with ALLREDUCE_TIMER(flat_grad.device):\n                all_reduce_mean_(flat_grad, world_size)\n",
     "test_two_gloo_ranks_match_the_textbook_update_of_the_whole_batch"),
    ("allreduce-sum", "gradients summed over ranks, not averaged",
     "all_reduce_sum_(tensor, world_size).div_(world_size) if", "all_reduce_sum_(tensor, world_size) if",
     "test_flat_all_reduce_is_the_mean_of_rank_gradients test_two_gloo_ranks_match_the_textbook_update_of_the_whole_batch"),
    ("zero-grad-set-to-none", "optimizer.zero_grad() in place of zeroing the flat buffer",
     "            flat_grad.zero_()\n", "            optimizer.zero_grad()\n",
     "test_two_gloo_ranks_match_the_textbook_update_of_the_whole_batch"),
    ("adam-eps", "Adam eps 1e-8", "eps=1e-5, fused=True", "eps=1e-8, fused=True", ORACLE),
    ("obs-not-scaled", "observations not divided by 255", ".div_(255.0)", ".div_(1.0)", ORACLE),
    ("trunk-activation", "the last hidden layer without its ReLU",
     "            layer_init(nn.Linear(64 * 7 * 7, 512)),\n            nn.ReLU(),\n",
     "            layer_init(nn.Linear(64 * 7 * 7, 512)),\n", ORACLE),
    ("actor-init-gain", "actor head initialised with gain 1", "nn.Linear(512, num_actions), std=0.01",
     "nn.Linear(512, num_actions), std=1", "test_orthogonal_init_with_the_nature_gains"),
    ("trunk-init-gain", "trunk initialised with gain 1", "std: float = np.sqrt(2)", "std: float = 1.0",
     "test_orthogonal_init_with_the_nature_gains"),
    ("lr-off-by-one", "schedule one iteration ahead", "(1.0 - (iteration - 1.0) / num_iterations)",
     "(1.0 - iteration / num_iterations)", "test_learning_rate_schedule test_training_uses_the_schedule"),
    ("lr-anneal-ignored", "--no-anneal-lr ignored", "* learning_rate if anneal else learning_rate",
     "* learning_rate if True else learning_rate", "test_learning_rate_schedule test_training_uses_the_schedule"),
    ("lr-first-group-only", "the schedule sets the first param group's rate only",
     "        for group, base_lr in zip(optimizer.param_groups, base_lrs):\n",
     "        for group, base_lr in zip(optimizer.param_groups[:1], base_lrs):\n",
     "test_a_parameter_outside_the_agent_is_trained_alike_on_every_process"),
    ("flat-buffer-agent-only", "only the agent's gradients in the flat buffer (and the all-reduce)",
     "    return agent, optimizer, flat_gradient_buffer(trained_parameters(optimizer))\n",
     "    return agent, optimizer, flat_gradient_buffer(agent.parameters())\n",
     "test_a_parameter_outside_the_agent_is_trained_alike_on_every_process"),
    ("digest-agent-only", "the processes compare the agent's parameters only",
     "    shared_state = trained + list(agent.buffers())\n",
     "    shared_state = list(agent.parameters())\n",
     "test_a_parameter_outside_the_agent_is_trained_alike_on_every_process "
     "test_processes_compare_every_trained_parameter_and_buffer"),
    ("minibatches-not-shuffled", "minibatches not shuffled",
     "order = noise.argsort(dim=-1, stable=True)", "order = torch.arange(num_steps).repeat(epochs, num_envs, 1)",
     "test_minibatches_take_an_equal_slice_of_every_envs_shuffled_steps"),
    ("shuffle-per-process", "each process shuffles with its own seed",
     "draw_minibatches(shared_rng,", "draw_minibatches(torch.Generator().manual_seed(args.seed + rank + iteration),",
     INVARIANCE),
    ("global-size-minibatches", "each process splits its data into global-size minibatches",
     "args.num_minibatches)\n        minibatches = local", "args.num_minibatches // world_size)\n        minibatches = local",
     INVARIANCE),
    ("epochs-off-by-one", "one epoch too few",
     "for epoch in range(args.update_epochs):", "for epoch in range(args.update_epochs - 1):", ORACLE),
    ("early-stop-old-kl", "the early stop decided on old_approx_kl",
     'all_reduce_mean_(stats["approx_kl"].clone()', 'all_reduce_mean_(stats["old_approx_kl"].clone()',
     "test_early_stop_reads_approx_kl_over_both_processes"),
    ("early-stop-per-rank", "the early stop decided on each process's own KL",
     'all_reduce_mean_(stats["approx_kl"].clone(), world_size)', 'all_reduce_mean_(stats["approx_kl"].clone(), 1)',
     "test_early_stop_is_agreed_by_every_rank"),
    ("losses-of-rank-0", "logged losses are rank 0's, not the job's",
     "all_reduce_mean_(totals / num_updates, world_size)", "(totals / num_updates)",
     "test_two_gloo_ranks_match_the_textbook_update_of_the_whole_batch " + INVARIANCE),
    ("explained-variance-of-rank-0", "explained variance over rank 0's batch",
     'explained_variance(batch["values"], batch["returns"], world_size)', 'explained_variance(batch["values"], batch["returns"], 1)',
     INVARIANCE),
    ("explained-variance-stats-local", "explained_variance sums each process's batch only",
     "all_reduce_sum_(sums, world_size).tolist()", "all_reduce_sum_(sums, 1).tolist()",
     "test_normalisation_and_explained_variance_are_over_every_rank"),
    ("explained-variance-formula", "explained variance without the error's mean",
     "1 - (error_squares / count - (error_sum / count) ** 2) / var_y", "1 - (error_squares / count) / var_y",
     "test_explained_variance_over_the_batch"),
    # sampling, the shared stream, seeds
    ("sampler-half-noise", "Gumbel noise halved: actions no longer drawn with the policy's probabilities",
     "return torch.argmax(logits + gumbel, dim=-1)", "return torch.argmax(logits + 0.5 * gumbel, dim=-1)",
     "test_sampler_draws_each_action_with_the_policy_probability"),
    ("noise-of-the-previous-step", "step t acts on step t-1's noise",
     "policy(rollout.next_obs[i], gumbel[step, i])", "policy(rollout.next_obs[i], gumbel[max(step - 1, 0), i])",
     "test_each_rollout_step_acts_on_its_own_column_of_the_jobs_noise"),
    ("noise-per-process-seed", "each process samples actions from its own seed",
     "draw_gumbel(shared_rng,", "draw_gumbel(torch.Generator().manual_seed(args.seed + rank + iteration),",
     INVARIANCE),
    ("noise-rows-of-process-0", "every process uses process 0's columns of the job's noise",
     "num_actions)[:, local_envs]", "num_actions)[:, :args.local_num_envs]",
     INVARIANCE + " test_each_rollout_step_acts_on_its_own_column_of_the_jobs_noise"),
    ("env-seeds-overlap", "seed s's envs take s + j, overlapping other seeds'",
     "return [1 + (seed - 1) % MAX_SEEDS * ENV_SEEDS_PER_SEED + first + i for i in range(count)]",
     "return [seed + first + i for i in range(count)]", "test_experiment_seeds_have_disjoint_env_seeds"),
    ("env-seeds-not-fresh-on-resume", "a resumed run reseeds its envs with the first seeds",
     '(resumed["iteration"] * sizes.num_envs if resumed else 0) + rank', "0 + rank",
     "test_signal_to_one_rank_stops_every_rank_and_resume_reaches_the_exact_total"),
    ("initial-weights-per-rank", "each process initialises its own weights and none is broadcast",
     ("    torch.manual_seed(args.seed)\n", "            dist.broadcast(tensor.data, src=0)\n"),
     ("    torch.manual_seed(args.seed + rank)\n", "            pass\n"),
     "test_torchrun_two_processes_train_and_stay_identical"),
    ("resume-without-adam", "resume skips the optimizer's state",
     '        optimizer.load_state_dict(resumed["optimizer"])\n', "",
     "test_resume_on_another_number_of_processes_continues_the_run"),
    ("resume-fresh-stream", "resume restarts the shared random stream",
     '        shared_rng.set_state(resumed["shared_rng"])\n', "",
     "test_resume_on_another_number_of_processes_continues_the_run"),
    # the environment
    ("next-step-autoreset", "gymnasium's default NEXT_STEP autoreset: a fake transition after every episode end",
     "autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)\n\n\n", "autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)\n\n\n",
     "test_vector_env_stores_only_real_transitions"),
    ("statistics-outside-clipping", "episode statistics recorded after reward clipping",
     ("        env = gym.wrappers.RecordEpisodeStatistics(env)  # innermost: whole-game, unclipped returns\n",
      "        env = gym.wrappers.TransformReward(env, lambda r: float(np.sign(r)))\n"),
     ("", "        env = gym.wrappers.TransformReward(env, lambda r: float(np.sign(r)))\n"
          "        env = gym.wrappers.RecordEpisodeStatistics(env)\n"),
     "test_episode_statistics_are_whole_game_and_unclipped"),
    ("rewards-unclipped", "learner sees raw rewards", "lambda r: float(np.sign(r))", "lambda r: float(r)",
     "test_learner_rewards_are_the_sign_of_the_raw_rewards"),
    ("noop-max", "at most 10 no-ops at reset", "NoopReset(env, noop_max=30)", "NoopReset(env, noop_max=10)",
     "test_noop_reset_plays_1_to_30_noops"),
    ("ale-no-noops", "ale-py's vector env without reset no-ops", "noop_max=30, use_fire_reset=True",
     "noop_max=0, use_fire_reset=True", "test_games_start_after_fire_then_0_to_28_no_ops"),
    ("no-fire-reset", "FIRE never pressed after a reset", "env = FireReset(env)", "env = env",
     "test_fire_is_pressed_after_reset_and_after_every_lost_life"),
    ("life-loss-ends-nothing", "a lost life does not end the learning episode",
     "terminated = terminated or 0 < lives < self.lives", "terminated = terminated",
     "test_life_loss_ends_learning_episode_but_not_the_game"),
    ("frame-skip", "3 frames per step", "MaxAndSkipObservation(env, skip=4)", "MaxAndSkipObservation(env, skip=3)",
     "test_ids_run_with_the_sticky_actions_they_register"),
    ("three-frames-stacked", "3 stacked frames", "FrameStackObservation(env, 4)", "FrameStackObservation(env, 3)",
     "test_observations_are_uint8_frame_stacks"),
    ("no-sticky-actions", "v5 ids without their sticky actions",
     "repeat_action_probability=sticky_actions(env_id),\n", "repeat_action_probability=0.0,\n",
     "test_ids_run_with_the_sticky_actions_they_register"),
    ("ale-no-sticky-actions", "ale-py's vector env without the id's sticky actions",
     "repeat_action_probability=sticky_actions(env_id), noop_max=30", "repeat_action_probability=0.0, noop_max=30",
     "test_the_ale_vector_env_runs_the_ids_sticky_actions"),
    # processes, logs, checkpoints, evaluation
    ("global-rank-from-local", "the process group told the local rank",
     "store=store, rank=RANK, world_size=WORLD_SIZE", "store=store, rank=LOCAL_RANK, world_size=WORLD_SIZE",
     "test_two_nodes_on_one_machine"),
    ("games-of-rank-0", "only rank 0's games logged",
     "sorted(game for games, _ in per_rank for game in games)", "sorted(per_rank[0][0])",
     "test_games_of_every_rank_reach_the_log"),
    ("checkpoint-unpickled", "checkpoints unpickled with code", 'map_location="cpu", weights_only=True)',
     'map_location="cpu", weights_only=False)', "test_checkpoint_that_would_run_code_is_refused"),
    ("digests-not-compared", "the processes' parameters not compared before a checkpoint",
     "        if differ:\n", "        if False:\n", "test_processes_whose_weights_differ_stop_before_a_checkpoint"),
    ("fresh-run-overwrites", "a fresh run starts in a folder holding another run's checkpoints",
     "            if (not saved or fork) and (latest", "            if False and (latest",
     "test_a_fresh_run_never_overwrites_an_earlier_runs_checkpoints"),
    ("exit-through-teardown", "a finished rank leaves through the interpreter's teardown",
     "    os._exit(exit_code)\n", "    sys.exit(exit_code)\n",
     "test_a_finished_rank_exits_without_tearing_down_a_live_process_group"),
    ("eval-first-games", "evaluation counts the first games to end, not a quota per env",
     "                    if played[i] < quota[i]:\n", "                    if True:\n",
     "test_evaluation_takes_a_fixed_quota_of_games_from_every_env"),
]


def test_files() -> dict:
    """{test function name: its file}, from the test modules' source."""
    return {name: path.relative_to(ROOT).as_posix() for path in sorted((ROOT / "tests").glob("test_*.py"))
            for name in re.findall(r"^def (test_\w+)\(", path.read_text(), re.M)}


def run_mutant(name: str, old, new, tests: list, workdir: Path) -> tuple:
    """Returns {test: failed?} and the seconds it took."""
    copy = workdir / name
    shutil.copytree(ROOT / "tests", copy / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "benchmarks", copy / "benchmarks", ignore=shutil.ignore_patterns("__pycache__", "results"))
    source = (ROOT / "ppo_atari_multigpu.py").read_text()
    for old_text, new_text in zip(*((old, new) if isinstance(old, tuple) else ((old,), (new,)))):
        if source.count(old_text) != 1:
            raise SystemExit(f"mutant {name}: the script holds {old_text!r} {source.count(old_text)} times, not once")
        source = source.replace(old_text, new_text)
    (copy / "ppo_atari_multigpu.py").write_text(source)
    files, started = test_files(), time.time()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                             *[f"{files[test]}::{test}" for test in tests]], cwd=copy, capture_output=True, text=True)
    failed = set(re.findall(r"^(?:FAILED|ERROR) \S+::(test_\w+)", result.stdout, re.M))
    return {test: test in failed for test in tests}, time.time() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="names of the mutants to run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mutants.md"))
    opts = parser.parse_args()
    chosen = [m for m in MUTANTS if not opts.only or m[0] in opts.only]
    known = test_files()
    unknown = sorted({test for m in chosen for test in m[4].split() if test not in known})
    if unknown:
        raise SystemExit(f"mutants.py: error: no such tests: {', '.join(unknown)}")
    rows, survivors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, what, old, new, tests in chosen:
            failed, seconds = run_mutant(name, old, new, tests.split(), Path(tmp))
            killed = all(failed.values())
            verdicts = ", ".join(f"`{test}` {'fails' if fail else '**passes**'}" for test, fail in failed.items())
            print(f"{'killed' if killed else 'SURVIVED':8} {name:32} {seconds:5.0f} s  {verdicts}", flush=True)
            rows.append(f"| `{name}` | {what} | {'killed' if killed else '**survived**'} | {verdicts} | {seconds:.0f} |")
            survivors += [] if killed else [name]
    table = "\n".join(["| mutant | what it breaks | result | the tests named for it | seconds |", "|---|---|---|---|---|",
                       *rows])
    machine = ", ".join(f"{k} {v}" for k, v in machine_description().items())
    Path(opts.out).write_text(f"# Mutants of ppo_atari_multigpu.py against the tests that pin each detail\n\n"
                              f"`python benchmarks/mutants.py`, {time.strftime('%Y-%m-%d')}. A mutant is killed when "
                              f"every test named for it fails.\n\nMachine: {machine}\n\n"
                              f"{len(chosen) - len(survivors)} of {len(chosen)} killed.\n\n{table}\n")
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} killed; {opts.out}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
