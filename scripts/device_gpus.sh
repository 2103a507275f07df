#!/usr/bin/env bash
# Distributed runs on a machine with several GPUs (python3 with torch and triton), one or more parts per call, each
# command under what is left of $DEADLINE_S (default 560 s), into $OUT: part.log (everything printed) and results.tar
# (the rows). $WORLD (default 2) is the number of ranks of the DDP and optimizer parts.
#   PART=tests bash scripts/device_gpus.sh          # the NCCL tests, leaderboard_2026 --check (what its 2-GPU test
#                                                   # runs, here with its table), the sharded optimizers
#   PART=official bash scripts/device_gpus.sh       # the 8B step under the official protocol (the planner's
#                                                   # checkpoint plan), then the full step split
#   PART=split bash scripts/device_gpus.sh          # the full 8B step (34 layers) of both stacks split by category
#   PART=allreduce bash scripts/device_gpus.sh      # all-reduce on NCCL at 2 and 4 ranks (as many as there are GPUs)
#   PART=ddp WORLD=4 bash scripts/device_gpus.sh    # every DDP variant (bf16, then fp32)
#   PART=pairs bash scripts/device_gpus.sh          # PyTorch DDP and our best bucketed, alternating launches, 3 each
#   PART="ddp optimizers" STEPS=20 bash scripts/device_gpus.sh   # parts one after another (also: zero1)
#   PART=fsdp_memory bash scripts/device_gpus.sh    # FSDP and FSDP2 peaks with each AdamW, allocator snapshots
# Rows go where the tools put them on a GPU, writeup/results, beside the committed ones (a stack's ratio finds the
# other's row; cases measured on this device are skipped, so a cut-off part resumes next call).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
deadline=$(( $(date +%s) + ${DEADLINE_S:-560} ))
log="$OUT/part.log"

{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nvidia-smi topo -m
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee -a "$log"

for part in ${PART:-tests}; do
case "$part" in
tests)
    capped 260 python3 -m pytest -q -p no:cacheprovider -m gpu -k "nccl or compiled_blocks" \
        tests/test_ddp_wrappers.py tests/test_fsdp_wrapper.py tests/test_optimizer_state_sharding.py \
        tests/test_zero1.py tests/test_leaderboard_2026.py
    capped 150 python3 -m cs336_systems.bench.leaderboard_2026 --check
    for dtype in fp32 bf16; do
        capped 200 python3 -m cs336_systems.bench.optimizer_state_sharding_accounting --edition 2025 \
            --dtype "$dtype" --optimizers adamw sharded zero_redundancy zero1_flat
    done
    ;;
official)  # the 8B step under the official protocol with the checkpoint plan $PLAN (default auto: the planner's);
            # if a stack fails (out of memory), again with a margin of $RETRY_MARGIN GiB; then the full step split
            # (FORCE=1: measure again a case this device has rows of; SPLIT=0: no split)
    margin=${MARGIN:+--memory-margin-gib $MARGIN}
    capped 330 python3 -m cs336_systems.bench.leaderboard_2026 --checkpoint-plan "${PLAN:-auto}" $margin --timeout-s 320 \
        ${FORCE:+--force} \
        || { margin="--memory-margin-gib ${RETRY_MARGIN:-16}"
             capped 330 python3 -m cs336_systems.bench.leaderboard_2026 --checkpoint-plan "${PLAN:-auto}" $margin ${FORCE:+--force} \
                 --timeout-s 320; }
    [[ ${SPLIT:-1} == 1 ]] && capped 230 python3 scripts/leaderboard_2026_profile.py --stacks ours torch \
        --checkpoint-plan "${PLAN:-auto}" $margin --timeout-s 220
    ;;
gradient_memory)  # our full step profiled with its FSDP's gradient shards on the compute stream (the default),
                  # then on the reduction stream (two profiled steps each; rows record the placement, allocator
                  # retries and idle stretches)
    capped 270 python3 scripts/leaderboard_2026_profile.py --stacks ours --steps 2 --timeout-s 260
    capped 270 python3 scripts/leaderboard_2026_profile.py --stacks ours --steps 2 --timeout-s 260 \
        --override ours:gradient_memory=reduce_stream
    ;;
check)  # leaderboard_2026 --check alone: both stacks' first steps against one process
    capped 150 python3 -m cs336_systems.bench.leaderboard_2026 --check
    ;;
split)  # one warm-up and one profiled step of each stack at 34 layers (plan $PLAN), rank 0's time by category
    capped 230 python3 scripts/leaderboard_2026_profile.py --stacks ours torch ${PLAN:+--checkpoint-plan $PLAN} \
        --timeout-s 220
    ;;
zero1)  # the flat ZeRO-1 again (its NCCL test, rows with --force), e.g. after a change to it
    capped 90 python3 -m pytest -q -p no:cacheprovider -m gpu -k nccl tests/test_zero1.py
    for dtype in fp32 bf16; do
        capped 100 python3 -m cs336_systems.bench.optimizer_state_sharding_accounting --edition 2025 --force \
            --dtype "$dtype" --optimizers zero1_flat
    done
    ;;
optimizers)  # the four sharded-optimizer variants again in $DTYPES (--force), over $STEPS timed steps
    for dtype in ${DTYPES:-bf16}; do
        capped 150 python3 -m cs336_systems.bench.optimizer_state_sharding_accounting --edition 2025 --force \
            --steps "${STEPS:-20}" \
            --world-size "${WORLD:-2}" --dtype "$dtype" --optimizers adamw sharded zero_redundancy zero1_flat
    done
    ;;
allreduce)  # the handout's grid of sizes on NCCL at every world size the GPUs allow (2 and 4 here)
    gpus=$(nvidia-smi -L | wc -l)
    sizes=(2); (( gpus >= 4 )) && sizes+=(4); (( gpus >= 6 )) && sizes+=(6)
    capped 200 python3 -m cs336_systems.bench.distributed_communication_single_node --backends nccl \
        --world-sizes "${sizes[@]}"
    ;;
ddp)  # bf16 first, over $STEPS timed steps (bf16 steps vary by 10-20 % between launches)
    capped 280 python3 -m cs336_systems.bench.ddp_benchmarking --edition 2025 --world-size "${WORLD:-2}" --dtypes bf16 \
        --steps "${STEPS:-10}"
    capped 280 python3 -m cs336_systems.bench.ddp_benchmarking --edition 2025 --world-size "${WORLD:-2}" --dtypes fp32 \
        --steps "${STEPS:-10}"
    ;;
pairs)  # the deciding pair in alternating launches (three each); every launch's rows carry their own run id
    for round in 1 2 3; do
        for variant in torch_ddp "${BEST:-bucketed_100mb}"; do
            capped 90 python3 -m cs336_systems.bench.ddp_benchmarking --edition 2025 --world-size "${WORLD:-2}" \
                --force \
                --dtypes "${PAIR_DTYPE:-bf16}" --variants "$variant" --steps "${STEPS:-10}"
        done
    done
    capped 100 python3 scripts/ddp_ratio_check.py --dtype bf16 --bucket-mb 100 --size large
    ;;
nccl_tests)  # the NCCL tests alone (4 ranks where the host has 4 GPUs, else 2)
    capped 240 python3 -m pytest -q -p no:cacheprovider -m gpu -k nccl \
        tests/test_ddp_wrappers.py tests/test_fsdp_wrapper.py tests/test_optimizer_state_sharding.py tests/test_zero1.py
    ;;
fsdp)  # FSDP against FSDP2 at $WORLD ranks, with and without checkpointing
    capped 300 python3 -m cs336_systems.bench.fsdp_accounting --edition 2025 --impls fsdp2 ours --checkpointing 0 1 \
        --world-size "${WORLD:-2}" --steps "${STEPS:-10}"
    ;;
ddp_trace)  # one traced step of each of $VARIANTS (default the naive and the per-parameter overlapped DDP) in
            # $DTYPE (default fp32) on 2 ranks, traces kept
    variants=(${VARIANTS:-naive overlap})
    capped 200 python3 -m cs336_systems.bench.ddp_benchmarking --edition 2025 --world-size 2 --dtypes "${DTYPE:-fp32}" \
        --force \
        --variants "${variants[@]}" --trace --trace-variants "${variants[@]}" --trace-dir "$OUT/ddp_traces" \
        --steps "${STEPS:-10}"
    for trace in "$OUT"/ddp_traces/*/*.json "$OUT"/ddp_traces/*.json; do [[ -f $trace ]] && gzip "$trace"; done
    tar -cf "$OUT/figures.tar" writeup/figures/ddp_overlap_*.png
    ;;
fsdp_memory)  # ours and FSDP2 (xl, no checkpointing) with each AdamW, one step's allocator history each, reported
    for optimizer in ${OPTIMIZERS:-torch basics}; do
        capped 200 python3 -m cs336_systems.bench.fsdp_accounting --edition 2025 --force --impls fsdp2 ours \
            --checkpointing 0 \
            --world-size "${WORLD:-2}" --optimizer "$optimizer" --memory-snapshot snapshots --warmup 2 --steps "${STEPS:-5}"
    done
    shopt -s nullglob
    for snapshot in snapshots/fsdp_*.pickle; do
        capped 60 python3 scripts/memory_snapshot_report.py "$snapshot" --top 25
        gzip -c "$snapshot" > "$OUT/$(basename "$snapshot").gz"
    done
    ;;
*)
    echo "unknown part ${part}: tests, official, check, gradient_memory, split, allreduce, ddp, pairs, zero1, optimizers, fsdp_memory, nccl_tests, fsdp or ddp_trace" >&2
    exit 2
    ;;
esac
done
tar -cf "$OUT/results.tar" writeup/results/*.jsonl
