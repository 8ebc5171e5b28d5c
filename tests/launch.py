"""Runs a copy of ppo_atari_multigpu.py (the first argument; the rest are its arguments) under python or torchrun,
with two test-only changes taken from the environment:

- PPO_TEST_DTYPE=float64: torch's default dtype, so the network and its update run in float64 and runs that
  differ only in the order of floating-point sums agree to ~1e-12. The script itself stays float32.
- PPO_TEST_RECORD=<folder>: each rank saves to <folder>/rank<RANK>.pt what the script drew from its shared
  random stream (the job's action noise and minibatches of every iteration), the actions it took, and its
  optimizer's state when the first update starts; per iteration the rollout's last observation (`next_obs`),
  what `compute_advantages` was given (`advantages`) and the agent's weights when the update starts (`model`);
  per rollout step the noise `sample_action` was given (`noise`). The script runs unchanged; its functions
  are wrapped.
"""

import importlib.util
import os
import sys
from pathlib import Path

import torch

script, sys.argv = sys.argv[1], sys.argv[1:]
spec = importlib.util.spec_from_file_location("ppo_atari_multigpu", script)
ppo = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = ppo  # env worker processes find the module by name
spec.loader.exec_module(ppo)

if os.environ.get("PPO_TEST_DTYPE") == "float64":
    torch.set_default_dtype(torch.float64)

if os.environ.get("PPO_TEST_RECORD"):
    path = Path(os.environ["PPO_TEST_RECORD"]) / f"rank{os.environ.get('RANK', '0')}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {key: [] for key in ("gumbel", "minibatches", "actions", "next_obs", "advantages", "model", "noise")}
    record["optimizer"] = None

    def recorded(key, function, keep, save=True):
        def wrapper(*args, **kwargs):
            if key == "model":  # ppo_update(args, agent, optimizer, ...)
                agent, optimizer = args[1:3]
                record["model"].append({name: value.clone() for name, value in agent.state_dict().items()})
                if record["optimizer"] is None:
                    record["optimizer"] = [{name: value.clone() for name, value in optimizer.state[p].items()}
                                           for p in optimizer.param_groups[0]["params"]]
            result = function(*args, **kwargs)
            if key != "model":
                kept = keep(args, kwargs, result)
                record[key].append({k: v.clone() if torch.is_tensor(v) else v for k, v in kept.items()}
                                   if isinstance(kept, dict) else kept.clone())
            if save:
                torch.save(record, path)
            return result
        return wrapper

    ppo.draw_gumbel = recorded("gumbel", ppo.draw_gumbel, lambda args, kwargs, result: result)
    ppo.draw_minibatches = recorded("minibatches", ppo.draw_minibatches, lambda args, kwargs, result: result)
    ppo.collect_rollout = recorded("actions", ppo.collect_rollout, lambda args, kwargs, result: args[3].actions)
    ppo.collect_rollout = recorded("next_obs", ppo.collect_rollout, lambda args, kwargs, result: args[3].next_obs)
    ppo.compute_advantages = recorded("advantages", ppo.compute_advantages, lambda args, kwargs, result: dict(
        zip(("rewards", "values", "dones", "next_value", "next_done"), args), **kwargs))
    ppo.ppo_update = recorded("model", ppo.ppo_update, None)
    ppo.sample_action = recorded("noise", ppo.sample_action, lambda args, kwargs, result: args[1] if args[1] is not None else torch.empty(0), save=False)

ppo.main()
