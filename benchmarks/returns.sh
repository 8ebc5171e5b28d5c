#!/usr/bin/env bash
# Learning benchmark: the exact commands behind benchmarks/results/learning-*.md.
#
#   bash benchmarks/returns.sh cpu   # CPU-budget protocol: Breakout, 1M steps, 2 processes x 4 envs (fp32 seeds 1-4)
#   bash benchmarks/returns.sh cpu-ale [SEED...]   # the same command with --vector-env ale (default seeds 1 2)
#   bash benchmarks/returns.sh cpu-shared [SEED...]   # the fp32 command again, logged as 2x4-fp32-shared: the script
#                                    # since its ranks share one random stream (default seeds 1 2)
#   bash benchmarks/returns.sh cpu-10m [ENV_ID] [SEED]   # the published scale on the CPU: 10M steps, 2 processes x 4
#                                    # envs, every other setting default (default BreakoutNoFrameskip-v4, seed 1);
#                                    # the same command continues it (--resume auto) and, once the run has finished,
#                                    # plays 30 games with its final model
#   bash benchmarks/returns.sh cpu-10m-64 mb256|default|steps16 [SEED]   # Breakout at 10M steps with 64 envs
#                                    # (2 processes x 32), the experiment of 8 GPUs x 8 envs: mb256 keeps the published
#                                    # minibatch of 256 (--num-minibatches 32), default leaves every other setting
#                                    # default, steps16 keeps the published batch of 1,024 (--num-steps 16)
#   bash benchmarks/returns.sh gpu   # full protocol: Pong, BeamRider, Breakout x 3 seeds x 10M steps,
#                                    # 1 process x 8 envs vs 2 processes x 4 envs (one GPU per process)
#
# A rerun never writes over a committed result: results go to a new folder,
# benchmarks/results/reruns/learning-<protocol>-<UTC time>/ (a 10M run's later parts to the folder its first
# part chose), or to RESULTS=<folder> when set (how the committed results were extended). Summarise them with
#   python benchmarks/report.py <folder>/runs --out <folder>
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
protocol="${1:?usage: returns.sh cpu|cpu-ale|cpu-shared|cpu-10m|cpu-10m-64|gpu}"
folder="${protocol%%-*}"
[ "$protocol" = cpu-10m ] && folder=10m
[ "$protocol" = cpu-10m-64 ] && folder=10m-64
out="${RESULTS:-$root/benchmarks/results/reruns/learning-$protocol-$(date -u +%Y%m%dT%H%M%SZ)}"

run() {  # run <nproc> <exp-name> <args...>
    local nproc="$1" name="$2"
    shift 2
    echo "== $(date -u +%FT%TZ) $name $*"
    torchrun --standalone --nnodes=1 --nproc-per-node="$nproc" "$root/ppo_atari_multigpu.py" --exp-name "$name" "$@"
}

ten_million() {  # ten_million <env-id> <seed> <nproc> <exp-name> <args...>
    # One run over several sessions (the same command continues it with --resume auto). Its working folder
    # (checkpoints, TensorBoard log, console) lies outside the clone, in $RUNS_DIR (default ~/ppo-runs); after
    # every part the run is stored as text in the results folder (to_text.py), with its console.
    local env_id="$1" seed="$2" nproc="$3" name="$4"
    shift 4
    local key="${env_id}__${name}__${seed}" status=0
    local work="${RUNS_DIR:-$HOME/ppo-runs}/$folder-$key"
    mkdir -p "$work"
    cd "$work"
    [ -n "${RESULTS:-}" ] || [ ! -f results-folder ] || out="$(cat results-folder)"  # a later part of the same run
    echo "$out" > results-folder
    mkdir -p "$out"
    run "$nproc" "$name" --env-id "$env_id" --seed "$seed" --resume auto "$@" 2>&1 | tee -a console.txt || status=$?
    python "$root/benchmarks/to_text.py" runs --out "$out/runs"
    cp console.txt "$out/console-$key.txt"
    [ "$status" = 0 ] || exit "$status"  # interrupted: continue it with the same command
    # Reached once the run has finished: 30 whole games of the final model, actions sampled.
    python "$root/ppo_atari_multigpu.py" --eval-checkpoint "checkpoints/$key/final_model.pt" \
        --eval-episodes 30 2>&1 | tee "$out/eval-$key.txt"
}

case "$protocol" in
cpu | cpu-ale | cpu-shared | gpu)
    mkdir -p "$out"
    cd "$out"
    ;;
esac
case "$protocol" in
cpu)
    for seed in 1 2 3 4; do
        run 2 2x4-fp32 --env-id BreakoutNoFrameskip-v4 --total-timesteps 1000000 --local-num-envs 4 --seed "$seed"
    done
    run 2 2x4-bf16 --env-id BreakoutNoFrameskip-v4 --total-timesteps 1000000 --local-num-envs 4 --seed 1 --precision bf16
    run 2 2x4-async --env-id BreakoutNoFrameskip-v4 --total-timesteps 1000000 --local-num-envs 4 --seed 1 --vector-env async
    ;;
cpu-ale)
    shift
    seeds=("$@")
    [ ${#seeds[@]} -gt 0 ] || seeds=(1 2)
    for seed in "${seeds[@]}"; do
        run 2 2x4-ale --env-id BreakoutNoFrameskip-v4 --total-timesteps 1000000 --local-num-envs 4 --seed "$seed" --vector-env ale
    done
    ;;
cpu-shared)
    shift
    seeds=("$@")
    [ ${#seeds[@]} -gt 0 ] || seeds=(1 2)
    for seed in "${seeds[@]}"; do
        run 2 2x4-fp32-shared --env-id BreakoutNoFrameskip-v4 --total-timesteps 1000000 --local-num-envs 4 --seed "$seed"
    done
    ;;
cpu-10m)
    ten_million "${2:-BreakoutNoFrameskip-v4}" "${3:-1}" 2 2x4-fp32 --local-num-envs 4
    ;;
cpu-10m-64)
    # 64 envs (2 processes x 32): the experiment of the README's 8-GPU command (8 processes x 8 envs).
    case "${2:-}" in
    mb256) ten_million BreakoutNoFrameskip-v4 "${3:-1}" 2 2x32-mb256 --local-num-envs 32 --num-minibatches 32 ;;
    default) ten_million BreakoutNoFrameskip-v4 "${3:-1}" 2 2x32 --local-num-envs 32 ;;
    steps16) ten_million BreakoutNoFrameskip-v4 "${3:-1}" 2 2x32x16 --local-num-envs 32 --num-steps 16 ;;
    *) echo "usage: returns.sh cpu-10m-64 mb256|default|steps16 [SEED]" >&2; exit 2 ;;
    esac
    ;;
gpu)
    for env in PongNoFrameskip-v4 BeamRiderNoFrameskip-v4 BreakoutNoFrameskip-v4; do
        for seed in 1 2 3; do
            run 1 1x8 --env-id "$env" --total-timesteps 10000000 --local-num-envs 8 --seed "$seed" --vector-env async
            run 2 2x4 --env-id "$env" --total-timesteps 10000000 --local-num-envs 4 --seed "$seed" --vector-env async
        done
    done
    ;;
*)
    echo "unknown protocol '$protocol' (cpu, cpu-ale, cpu-shared, cpu-10m or gpu)" >&2
    exit 2
    ;;
esac
