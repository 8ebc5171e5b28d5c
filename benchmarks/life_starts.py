"""How long saved Breakout policies wait before pressing FIRE when a life starts, under --vector-env ale.

The Python stack presses FIRE (then action 2) itself after every lost life; ale-py presses it only when a
game starts, so under `--vector-env ale` the agent must launch the ball itself after a lost life, and every
step it waits is a step without reward. This plays each model (sampling its actions, 8 envs, fixed env
seeds) and reports the steps from a lost life to the first FIRE, the share of all steps spent waiting, and
the policy's mean probability of each action (NOOP, FIRE, RIGHT, LEFT) while the ball is in play.

    python benchmarks/life_starts.py checkpoints/*/final_model.pt [--steps 1500]
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ppo_atari_multigpu as ppo  # noqa: E402

FIRE, NUM_ENVS = 1, 8


def life_starts(model_path: str, steps: int) -> dict:
    agent = ppo.Agent(4)
    agent.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=False)["model"])
    envs = ppo.AtariVectorGames("BreakoutNoFrameskip-v4", NUM_ENVS, num_threads=1)
    obs, _ = envs.reset(seed=list(range(100, 100 + NUM_ENVS)))
    torch.manual_seed(0)
    waiting, waited = np.zeros(NUM_ENVS, bool), np.zeros(NUM_ENVS, int)
    waits, fire_probs, waiting_steps, games, in_play_probs = [], [], 0, [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = agent.actor(agent.hidden(torch.as_tensor(obs)))
            action = ppo.sample_action(logits).numpy()
            probs = torch.softmax(logits, -1).numpy()
            fire_probs += probs[waiting & (waited == 0), FIRE].tolist()
            in_play_probs.append(probs[~waiting])
            waiting_steps += waiting.sum()
            fired = waiting & (action == FIRE)
            waits += (waited[fired] + 1).tolist()
            waited[waiting & ~fired] += 1
            waiting &= ~fired
            obs, _, terminated, _, info = envs.step(action)
            game_over = info["final_info"]["_episode"] if "final_info" in info else np.zeros(NUM_ENVS, bool)
            life_lost = terminated & ~game_over  # ale-py FIREs at a game's start itself
            waiting = (waiting & ~game_over) | life_lost
            waited[life_lost | game_over] = 0
            if game_over.any():
                games += info["final_info"]["episode"]["r"][game_over].tolist()
    envs.close()
    return {"lost lives": len(waits), "steps to FIRE (mean)": np.mean(waits), "(max)": max(waits),
            "P(FIRE) at a life's first step": np.mean(fire_probs),
            "steps spent waiting": waiting_steps / (steps * NUM_ENVS),
            "P(NOOP, FIRE, RIGHT, LEFT) in play": " ".join(f"{x:.2f}" for x in np.concatenate(in_play_probs).mean(0)),
            "games": len(games),
            "mean return": np.mean(games) if games else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="checkpoints or final models of Breakout runs")
    parser.add_argument("--steps", type=int, default=1500, help="agent steps of each of the 8 envs")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    for path in opts.models:
        result = life_starts(path, opts.steps)
        print(f"{path}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
