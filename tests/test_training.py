"""End-to-end runs of the real script: torchrun, plain python, two 'nodes', and determinism."""

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import (ROOT, SCRIPT, TINY, broken_copy, event_files, final_digests, kill_tagged, run_nodes, run_python,
                      run_torchrun, scalars, script_env, tagged_pids)

LOSSES = ["losses/value_loss", "losses/policy_loss", "losses/entropy", "losses/old_approx_kl",
          "losses/approx_kl", "losses/clipfrac", "losses/explained_variance"]


def assert_trained(cwd, iterations: int, global_batch: int):
    logged = scalars(cwd)
    for tag in LOSSES + ["charts/learning_rate", "charts/SPS"]:
        assert [step for step, _ in logged[tag]] == [global_batch * i for i in range(1, iterations + 1)], tag
    # The learning rate annealed from one iteration to the next: the optimiser really stepped each time.
    rates = [value for _, value in logged["charts/learning_rate"]]
    assert rates == sorted(rates, reverse=True) and rates[0] > rates[-1]
    assert all(value > 0 for _, value in logged["losses/approx_kl"])  # the policy moved during the updates
    return logged


def test_torchrun_two_processes_train_and_stay_identical(tmp_path):
    # 2 processes x 2 envs x 32 steps = a global batch of 128; 3 iterations.
    result = run_torchrun(2, [*TINY, "--total-timesteps", "384"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_trained(tmp_path, iterations=3, global_batch=128)
    assert len(event_files(tmp_path)) == 1  # rank 0 alone writes TensorBoard
    digests = final_digests(result.stdout)
    assert set(digests) == {"0", "1"} and len(set(digests.values())) == 1
    assert "backend gloo | world size 2" in result.stdout
    # torchrun gives each of several processes OMP_NUM_THREADS=1 (the tests set it too)
    assert re.search(r"^rank 0: .*, 1 torch threads, ", result.stdout, re.M)
    assert re.search(r"^rank 1: .*, 1 torch threads, ", result.stdout, re.M)


def test_torchrun_two_processes_train_with_the_ale_vector_env(tmp_path):
    result = run_torchrun(2, [*TINY, "--total-timesteps", "384", "--vector-env", "ale", "--env-threads", "1"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_trained(tmp_path, iterations=3, global_batch=128)
    digests = final_digests(result.stdout)
    assert set(digests) == {"0", "1"} and len(set(digests.values())) == 1
    assert re.search(r"^rank 1: .*, 1 torch threads, 1 env threads, env seeds 3\.\.4$", result.stdout, re.M)


def test_single_process_without_torchrun(tmp_path):
    result = run_python([*TINY, "--total-timesteps", "128"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_trained(tmp_path, iterations=2, global_batch=64)
    assert "world size 1" in result.stdout
    assert list(final_digests(result.stdout)) == ["0"]


def test_torch_threads_are_set_per_process(tmp_path):
    result = run_python([*TINY, "--total-timesteps", "64", "--num-minibatches", "1", "--torch-threads", "2"],
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^rank 0: .*, 2 torch threads, env seeds", result.stdout, re.M)


def check_two_nodes_on_one_machine(cwd, script=SCRIPT, timeout=120):
    results = run_nodes([*TINY, "--total-timesteps", "256"], cwd, timeout, script)
    for returncode, _, err in results:
        assert returncode == 0, err
    (_, node0_out, _), (_, node1_out, _) = results
    assert node1_out.strip() == ""  # nothing printed by the non-zero global rank
    seeds = {int(rank): (int(lo), int(hi)) for rank, lo, hi in
             re.findall(r"^rank (\d+): host .*, env seeds (\d+)\.\.(\d+)$", node0_out, re.MULTILINE)}
    assert seeds == {0: (1, 2), 1: (3, 4)}  # global ranks 0 and 1, disjoint env seeds
    assert "world size 2" in node0_out
    assert_trained(cwd, iterations=2, global_batch=128)
    assert len(event_files(cwd)) == 1
    assert len(set(final_digests(node0_out).values())) == 1


def test_two_nodes_on_one_machine(tmp_path):
    check_two_nodes_on_one_machine(tmp_path)


def test_two_node_check_catches_a_script_that_uses_the_local_rank(tmp_path, process_tag):
    # The reference's bug: the local rank passed to the process group. Both nodes' processes then claim rank 0.
    broken = broken_copy(tmp_path, "rank=RANK,", "rank=LOCAL_RANK,")
    (tmp_path / "run").mkdir()
    started = time.time()
    with pytest.raises(AssertionError):
        check_two_nodes_on_one_machine(tmp_path / "run", script=broken, timeout=60)
    assert time.time() - started < 90
    kill_tagged(process_tag)  # what the fixture does when any test ends
    assert tagged_pids(process_tag) == []  # no launcher and no worker left behind


def test_same_seed_same_losses(tmp_path):
    logs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        result = run_python([*TINY, "--total-timesteps", "128", "--seed", "3"], cwd=tmp_path / name)
        assert result.returncode == 0, result.stderr
        logs.append(scalars(tmp_path / name))
    for tag in LOSSES:
        assert logs[0][tag] == logs[1][tag], tag
    (tmp_path / "c").mkdir()
    assert run_python([*TINY, "--total-timesteps", "128", "--seed", "4"], cwd=tmp_path / "c").returncode == 0
    assert scalars(tmp_path / "c")["losses/value_loss"] != logs[0]["losses/value_loss"]  # the seed matters


@pytest.mark.parametrize("vector_env", ["async", "double", "ale-double"])
def test_speed_options_train(tmp_path, vector_env):
    result = run_python([*TINY, "--total-timesteps", "128", "--vector-env", vector_env, "--precision", "bf16",
                         "--torch-threads", "1"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    logged = assert_trained(tmp_path, iterations=2, global_batch=64)
    for tag in ("perf/rollout_time", "perf/env_time", "perf/update_time", "perf/allreduce_time"):
        assert len(logged[tag]) == 2 and all(value >= 0 for _, value in logged[tag]), tag
    assert all(value > 0 for _, value in logged["perf/update_time"])
    # bf16 runs on every CPU; where the CPU has no native bf16 (it is emulated, slowly) one note says so.
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert result.stdout.count("note: this CPU has no native bf16") == (0 if native else 1), result.stdout


@pytest.mark.parametrize("vector_env", ["sync", "ale"])
def test_games_of_every_rank_reach_the_log(tmp_path, vector_env):
    # 1 x 4 and 2 x 2 processes x envs play the same games (the same experiment: tests/test_invariance.py), so the
    # 2-process log of the first iteration must hold every game of the 1-process log, those of rank 1's envs too.
    games = {}
    for nproc in (1, 2):
        cwd = tmp_path / str(nproc)
        cwd.mkdir()
        args = ["--local-num-envs", str(4 // nproc), "--num-steps", "256", "--total-timesteps", "1024",
                "--vector-env", vector_env]
        result = run_python(args, cwd=cwd) if nproc == 1 else run_torchrun(2, args, cwd=cwd)
        assert result.returncode == 0, result.stderr
        logged = scalars(cwd)
        games[nproc] = list(zip(logged["charts/episodic_return"], logged["charts/episodic_length"]))
    assert len(games[1]) >= 4, "the envs must finish games in the first iteration"
    assert games[2] == games[1]


def test_nodes_that_pick_different_backends_are_refused_before_any_collective(tmp_path):
    # Node 0 is made to see a GPU with NCCL (patched in a launcher around the unchanged script); node 1 sees
    # none. Without an agreement node 0 would start NCCL and node 1 gloo, and the job would hang.
    launcher = tmp_path / "node_with_gpu.py"
    launcher.write_text(f"""import os, sys
sys.path.insert(0, {str(SCRIPT.parent)!r})
import torch, torch.distributed as dist
if os.environ["GROUP_RANK"] == "0":
    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: 1)
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    dist.is_nccl_available = lambda: True
import ppo_atari_multigpu as ppo
ppo.main()
""")
    for returncode, _, err in run_nodes([*TINY, "--total-timesteps", "256"], tmp_path, 90, launcher):
        assert returncode != 0
        errors = re.findall(r"^ppo_atari_multigpu\.py: error: .*$", err, re.M)
        assert len(errors) == 1 and "the nodes chose different backends: rank 1 on" in errors[0], err
        assert "chose gloo, rank 0 on" in errors[0] and "chose nccl" in errors[0]
        assert "Traceback" not in err.split("ppo_atari_multigpu.py: error:")[0]
    assert not (tmp_path / "runs").exists()


# An extension as a researcher writes it (the README's example): an auxiliary loss term, logged; a learnable
# parameter outside the Agent, in its own param group with its own rate, whose gradient differs between processes
# (it follows each process's own advantages); and a buffer of the Agent that each process starts differently.
EXTENSION = [
    "    loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef\n",
    "    value_l1 = (newvalue - returns).abs().mean()\n"
    "    loss = pg_loss - ent_coef * entropy_loss + v_loss * vf_coef + 0.1 * value_l1\n",
    '        stats = {"policy_loss": pg_loss,',
    '        stats = {"value_l1": value_l1, "policy_loss": pg_loss,',
    "    optimizer = torch.optim.Adam(agent.parameters(), lr=learning_rate, eps=1e-5, fused=True)\n",
    "    optimizer = torch.optim.Adam(agent.parameters(), lr=learning_rate, eps=1e-5, fused=True)\n"
    '    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1, device=device))], "lr": 1e-2})\n',
    "                                   vf_coef=args.vf_coef)\n",
    "                                   vf_coef=args.vf_coef)\n"
    '            loss = loss + (optimizer.param_groups[1]["params"][0] * batch["advantages"][mb].mean()).sum()\n',
    "        self.critic = layer_init(nn.Linear(512, 1), std=1)\n",
    "        self.critic = layer_init(nn.Linear(512, 1), std=1)\n"
    '        self.register_buffer("marker", torch.full((1,), float(os.environ.get("RANK", "0"))))\n',
    "    progress.finish(exit_code, global_step)\n",
    '    extra, group = optimizer.param_groups[1]["params"][0], optimizer.param_groups[1]\n'
    '    print(f"rank {rank}: extra {extra.item()!r} lr {group[\'lr\']!r} marker {agent.marker.item()!r}", flush=True)\n'
    "    progress.finish(exit_code, global_step)\n",
]


def test_a_parameter_outside_the_agent_is_trained_alike_on_every_process(tmp_path):
    script = broken_copy(tmp_path, *EXTENSION, folder="extended")
    result = run_torchrun(2, [*TINY, "--total-timesteps", "384", "--checkpoint-interval-minutes", "0.0001"],
                          cwd=script.parent, script=script)
    assert result.returncode == 0, result.stderr
    printed = dict(re.findall(r"^rank (\d): (extra .*)$", result.stdout + result.stderr, re.M))
    assert set(printed) == {"0", "1"} and printed["0"] == printed["1"], printed  # all-reduced: equal on both
    extra, lr, marker = re.fullmatch(r"extra (\S+) lr (\S+) marker (\S+)", printed["0"]).groups()
    assert float(extra) != 0.0  # it was trained
    assert float(lr) == pytest.approx(1e-2 / 3, rel=1e-12)  # its own rate, annealed: (1 - 2/3) x 1e-2 in iteration 3
    assert float(marker) == 0.0  # rank 0's buffer, broadcast at the start
    assert len(set(final_digests(result.stdout).values())) == 1
    logged = scalars(script.parent)["losses/value_l1"]
    assert [step for step, _ in logged] == [128, 256, 384] and all(value > 0 for _, value in logged)
    (last,) = (script.parent / "checkpoints").glob("*/checkpoint_000000000384.pt")  # it is saved, to resume with
    assert torch.load(last, weights_only=True)["other_parameters"][0].item() == float(extra)
    # and restored: a resume of the last checkpoint with nothing left to train holds the saved value, not 0
    resumed = run_torchrun(2, [*TINY, "--total-timesteps", "384", "--resume", str(last)], cwd=script.parent,
                           script=script)
    assert resumed.returncode == 0, resumed.stderr
    restored = dict(re.findall(r"^rank (\d): extra (\S+) ", resumed.stdout + resumed.stderr, re.M))
    assert restored == {"0": extra, "1": extra}, restored


@pytest.mark.parametrize("drift", [
    # after every update, process 1 nudges the outside parameter, or the agent's buffer
    'optimizer.param_groups[1]["params"][0].data.add_(1e-3 * dist.get_rank())',
    "agent.marker.add_(dist.get_rank())",
])
def test_processes_compare_every_trained_parameter_and_buffer(tmp_path, drift):
    script = broken_copy(tmp_path, *EXTENSION, "            optimizer.step()\n",
                         f"            optimizer.step()\n            {drift}\n", folder="extended")
    result = run_torchrun(2, [*TINY, "--total-timesteps", "384", "--checkpoint-interval-minutes", "0.0001"],
                          cwd=script.parent, script=script)
    assert result.returncode != 0
    assert "error: processes 1 hold parameters different from process 0's after iteration 1" in result.stderr


def test_each_game_is_logged_at_the_step_that_ended_it(tmp_path):
    # One env, so that global step S is the S-th transition: a game logged at S must have ended with transition
    # S, whose done flag is dones[t + 1] of its rollout (t = S - 1 - 32 * (iteration - 1)), or next_done after
    # the rollout's last step. A lost life is done too, but never twice in a row, so a log one step early fails.
    env = {**script_env(), "PPO_TEST_RECORD": str(tmp_path / "record")}
    args = ["--local-num-envs", "1", "--num-steps", "32", "--num-minibatches", "2", "--total-timesteps", "800"]
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "launch.py"), str(SCRIPT), *args], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rollouts = torch.load(tmp_path / "record" / "rank0.pt", weights_only=False)["advantages"]
    games = scalars(tmp_path)["charts/episodic_return"]
    assert len(games) >= 2 and len(rollouts) == 25
    for step, _ in games:
        iteration, t = divmod(step - 1, 32)
        rollout = rollouts[iteration]
        done = rollout["next_done"][0] if t == 31 else rollout["dones"][t + 1, 0]
        assert done == 1, (step, t)


BF16_PROBE = """import json, sys, torch
sys.path.insert(0, {root!r})
import ppo_atari_multigpu as ppo
seen, make, finish = {{}}, ppo.make_learner, ppo.Progress.finish
def make_learner(*args, **kwargs):
    agent, optimizer, flat_grad = make(*args, **kwargs)
    conv = agent.network[0]
    def forward(module, inputs, out):  # a hook that returns nothing leaves the output as it is
        seen.setdefault("update" if torch.is_grad_enabled() else "rollout", str(out.dtype))
    def backward(module, grad_in, grad_out):
        seen.setdefault("backward", str(grad_out[0].dtype))
    conv.register_forward_hook(forward)
    conv.register_full_backward_hook(backward)
    seen["gradients"] = str(flat_grad.dtype)
    return agent, optimizer, flat_grad
def write_then_finish(self, *args):
    json.dump(seen, open("dtypes.json", "w"))
    return finish(self, *args)
ppo.make_learner, ppo.Progress.finish = make_learner, write_then_finish
ppo.main()
"""


@pytest.mark.parametrize("precision, computed", [("bf16", "torch.bfloat16"), ("fp32", "torch.float32")])
def test_bf16_is_what_the_network_computes_forward_and_backward(tmp_path, precision, computed):
    probe = tmp_path / "probe.py"
    probe.write_text(BF16_PROBE.format(root=str(ROOT)))
    result = run_python([*TINY, "--total-timesteps", "64", "--precision", precision], cwd=tmp_path, script=probe)
    assert result.returncode == 0, result.stderr[-3000:]
    dtypes = json.loads((tmp_path / "dtypes.json").read_text())
    # The convolutions of the rollout, of the update and of its backward pass; the gradients the optimiser steps
    # on (and so the weights) stay float32.
    assert dtypes == {"rollout": computed, "update": computed, "backward": computed, "gradients": "torch.float32"}
