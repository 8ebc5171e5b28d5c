"""Each speed lever of ppo_atari_multigpu.py measured on its own: the way the script does it against the
alternative, interleaved in one process (one thread by default) so that machine noise hits both alike.

    python benchmarks/levers.py                 # writes benchmarks/results/levers-<machine>.md
    python benchmarks/levers.py --threads 2 --no-compile

A ratio above 1 means the script's choice is faster. The learning algorithm is the same either way.
"""

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import ppo_atari_multigpu as ppo  # noqa: E402
from throughput import RESULTS, machine_description  # noqa: E402

MINIBATCH, ENVS, LOCAL_BATCH = 128, 4, 512


def compare(chosen, alternative, repeats: int, calls: int) -> tuple:
    """Median seconds per call of both, measured in alternation."""
    chosen(), alternative()
    times = {0: [], 1: []}
    for _ in range(repeats):
        for key, fn in ((0, chosen), (1, alternative)):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[key].append((time.perf_counter() - start) / calls)
    return statistics.median(times[0]), statistics.median(times[1])


def make_agent(device, layout=torch.channels_last):
    torch.manual_seed(0)
    return ppo.Agent(4).to(device, memory_format=layout)


def training_step(agent, optimizer, obs, actions, autocast=False, clip=None, compiled=None):
    forward = compiled or agent.get_action_and_value
    with torch.autocast(obs.device.type, torch.bfloat16, enabled=autocast):
        _, logprob, entropy, value = forward(obs, actions)
    loss = -logprob.mean() + value.pow(2).mean() - 0.01 * entropy.mean()
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    (clip or (lambda: nn.utils.clip_grad_norm_(agent.parameters(), 0.5)))()
    optimizer.step()


def levers(device, repeats: int, with_compile: bool) -> list:
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    rollout_u8 = torch.randint(0, 256, (LOCAL_BATCH, 4, 84, 84), dtype=torch.uint8, generator=gen).to(device)
    rollout_f32 = rollout_u8.float() / 255.0  # scaled once, when stored
    actions = torch.randint(0, 4, (LOCAL_BATCH,), generator=gen).to(device)
    index = torch.randperm(LOCAL_BATCH, generator=gen)[:MINIBATCH].to(device)
    obs = rollout_u8[:ENVS].clone()

    agent = make_agent(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-4, eps=1e-5, fused=True)
    flat_grad = ppo.flat_gradient_buffer(agent.parameters())

    # 1. uint8 rollout storage (scaled inside the network) vs float32 storage (scaled when stored).
    def update_from(storage, scale):
        x = storage[index].contiguous(memory_format=torch.channels_last)
        hidden = agent.network(x.float().div_(255.0) if scale else x)
        logits, value = agent.actor(hidden), agent.critic(hidden)
        loss = -torch.log_softmax(logits, -1).gather(1, actions[index, None]).mean() + value.pow(2).mean()
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()

    rows.append(("uint8 rollout storage vs float32 (training step incl. minibatch gather)", "kept",
                 *compare(lambda: update_from(rollout_u8, True), lambda: update_from(rollout_f32, False),
                          repeats, 3), "rollout memory per transition: 28 KB vs 113 KB"))

    # 2. channels_last vs NCHW: training step and one rollout inference.
    nchw = make_agent(device, torch.contiguous_format)
    nchw.hidden = lambda o: nchw.network(o.float().div_(255.0))
    nchw_optimizer = torch.optim.Adam(nchw.parameters(), lr=1e-4, eps=1e-5, fused=True)
    rows.append(("channels_last vs NCHW (training step)", "kept", *compare(
        lambda: training_step(agent, optimizer, rollout_u8[index], actions[index]),
        lambda: training_step(nchw, nchw_optimizer, rollout_u8[index], actions[index]), repeats, 3), ""))
    with torch.no_grad():
        rows.append(("channels_last vs NCHW (inference, 4 envs)", "kept", *compare(
            lambda: agent.get_action_and_value(obs), lambda: nchw.get_action_and_value(obs), repeats, 50), ""))

    # 3. Adam: fused vs foreach vs the plain per-tensor loop.
    for name, kwargs in (("foreach", {"foreach": True}), ("per-tensor loop", {"foreach": False})):
        other = torch.optim.Adam(agent.parameters(), lr=1e-4, eps=1e-5, **kwargs)
        rows.append((f"fused Adam vs {name} (training step)", "kept", *compare(
            lambda: training_step(agent, optimizer, rollout_u8[index], actions[index]),
            lambda: training_step(agent, other, rollout_u8[index], actions[index]), repeats, 3), ""))

    # 4. Gradients living in one flat buffer vs concatenating them and copying the slices back.
    params = list(agent.parameters())

    def in_place():
        flat_grad.div_(1.0)

    def cat_and_copy_back():
        flat = torch.cat([p.grad.reshape(-1) for p in params]).div_(1.0)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset: offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    rows.append(("flat gradient buffer vs cat + copy back (excluding the all-reduce itself)", "kept",
                 *compare(in_place, cat_and_copy_back, repeats, 50), "per minibatch"))

    # 5. Categorical without argument validation (validation synchronises with the GPU).
    def categorical(validate):
        logits = agent.actor(agent.hidden(obs))
        dist = torch.distributions.Categorical(logits=logits, validate_args=validate)
        dist.log_prob(dist.sample())

    with torch.no_grad():
        rows.append(("Categorical(validate_args=False) vs default (inference, 4 envs)", "kept",
                     *compare(lambda: categorical(False), lambda: categorical(True), repeats, 50), ""))

    # 6. bf16 autocast vs fp32 (opt-in --precision bf16).
    rows.append(("bf16 autocast vs fp32 (training step)", "opt-in", *compare(
        lambda: training_step(agent, optimizer, rollout_u8[index], actions[index], autocast=True),
        lambda: training_step(agent, optimizer, rollout_u8[index], actions[index]), repeats, 3), ""))

    def inference(steps, autocast, region_per_step):
        """`steps` rollout inferences, in one autocast region or in one region per step."""
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=autocast and not region_per_step):
            for _ in range(steps):
                if region_per_step:
                    with torch.autocast(device.type, torch.bfloat16):
                        agent.get_action_and_value(obs)
                else:
                    agent.get_action_and_value(obs)

    rows.append(("bf16 autocast vs fp32 (32 rollout inferences, 4 envs)", "opt-in", *compare(
        lambda: inference(32, True, False), lambda: inference(32, False, False), repeats, 2), ""))
    rows.append(("one autocast region per rollout vs one per step (bf16, 32 inferences)", "kept", *compare(
        lambda: inference(32, True, False), lambda: inference(32, True, True), repeats, 2),
        "autocast re-casts the weights in every new region"))

    # 7. torch.compile of the network (not in the script unless it pays somewhere measured).
    if with_compile:
        start = time.perf_counter()
        compiled = torch.compile(agent.get_action_and_value)
        training_step(agent, optimizer, rollout_u8[index], actions[index], compiled=compiled)
        compile_seconds = time.perf_counter() - start
        eager, with_compiled = compare(
            lambda: training_step(agent, optimizer, rollout_u8[index], actions[index]),
            lambda: training_step(agent, optimizer, rollout_u8[index], actions[index], compiled=compiled),
            repeats, 3)
        rows.append(("eager vs torch.compile (training step)", "dropped", eager, with_compiled,
                     f"compiling took {compile_seconds:.0f} s"))

    # 8. Vector env: no copy of the stacked observations on return vs the default copy.
    import gymnasium as gym

    thunks = [ppo.make_env("BreakoutNoFrameskip-v4") for _ in range(ENVS)]
    copying = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    sharing = gym.vector.SyncVectorEnv(thunks, copy=False, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    copying.reset(seed=list(range(ENVS)))
    sharing.reset(seed=list(range(ENVS)))
    rng = np.random.default_rng(0)
    rows.append(("SyncVectorEnv default (copy) vs copy=False (env step, 4 envs)", "default kept", *compare(
        lambda: copying.step(rng.integers(4, size=ENVS)), lambda: sharing.step(rng.integers(4, size=ENVS)),
        repeats, 30), ""))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: as each torchrun process)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to compile)")
    parser.add_argument("--machine", default=None)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    machine = machine_description()
    name = opts.machine or re.sub(r"[^a-z0-9]+", "-", (machine["gpu"] if device.type == "cuda"
                                                         else f"cpu{os.cpu_count()}").lower())
    rows = levers(device, opts.repeats, not opts.no_compile)
    lines = [f"# Speed levers on {name}", "",
             f"Command: `python benchmarks/levers.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d')}, "
             f"{opts.threads} torch thread(s), device {device}, median of {opts.repeats} interleaved repeats.", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
             "| lever: script's way vs alternative | in the script | script's way ms | alternative ms | speed-up | note |",
             "|---|---|---|---|---|---|"]
    for lever, status, chosen, alternative, note in rows:
        lines.append(f"| {lever} | {status} | {chosen * 1e3:.3f} | {alternative * 1e3:.3f} | "
                     f"{alternative / chosen:.2f}x | {note} |")
        print(f"{lever}: {chosen * 1e3:.3f} vs {alternative * 1e3:.3f} ms ({alternative / chosen:.2f}x)", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"levers-{name}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
