#!/usr/bin/env bash
# Run benchmark commands on a GPU machine whose python3 already has torch and triton (no installing),
# within a deadline, then pack the results and figures they wrote into $OUT/results.tar.
#   DEADLINE_S=540 bash scripts/device_bench.sh "benchmarking_script" "pytorch_attention --passes 50"
# Each argument is one `python -m cs336_systems.bench.<argument>` command. Rows land in writeup/results/
# (which travelled with the checkout, so finished cases are skipped: a cut-off sweep resumes next call);
# a command still running at the deadline is stopped, and what it wrote so far is kept.
#   PART=residual bash scripts/device_bench.sh
# The residual add fused into our RMSNorm: its GPU tests, the kernel alone against the add and our RMSNorm
# (scripts/residual_norm_timing.py), then our stack's xl training step with --residual-norm separate and fused in
# isolated launches, alternating, $RESIDUAL_ROUNDS (2) of each, at each context:batch of $RESIDUAL_SHAPES (512:4),
# in the variants $RESIDUAL_VARIANTS (default: eager launches). PART=residual_step runs only the training steps:
#   PART=residual_step RESIDUAL_SHAPES=2048:4 bash scripts/device_bench.sh
#   PART=rmsnorm_grid bash scripts/device_bench.sh
# The RMSNorm kernel grid on CUDA-graph replays (the writeup's), bf16 then fp32 in one run (one --run-id; a cut-off
# call resumes it with RUN=<that id>), every provider installed (carry wheels/ for Liger), then our forward's grid
# sizes beside Liger (scripts/rmsnorm_forward_grid.py, into $OUT/forward_grid.jsonl).
#   PART=checks bash scripts/device_bench.sh
# The GPU tests of the graph timer, the two-part head dims and the tf32x3 products; the 2.7B model's attention
# (head dim 80) in cuDNN, our Hopper kernels (padded to 128) and our portable kernels (two column parts); then the
# RMSNorm bench's small shapes under both timers (rows in $OUT/rmsnorm_timers: a smoke run, not the writeup's).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
deadline=$(( $(date +%s) + ${DEADLINE_S:-540} ))
log="$OUT/bench.log"

residual_steps() {  # our xl step, separate and fused in alternating launches (--force: every launch its own row)
    for shape in ${RESIDUAL_SHAPES:-512:4}; do
        for (( round = 1; round <= ${RESIDUAL_ROUNDS:-2}; round++ )); do
            for choice in separate fused; do
                # shellcheck disable=SC2086
                capped 180 python3 -m cs336_systems.bench.train_step --edition 2025 --sizes xl --shapes "$shape" \
                    --stacks ours \
                    --variants ${RESIDUAL_VARIANTS:-default} --residual-norm "$choice" --force
            done
        done
    done
}

case "${PART:-}" in
"")
    for command in "$@"; do
        # shellcheck disable=SC2086
        capped "$(( deadline - $(date +%s) ))" python3 -m cs336_systems.bench.$command
    done
    ;;
residual)
    capped 240 python3 -m pytest -q -p no:cacheprovider -m gpu -k residual \
        tests/test_residual_rmsnorm.py tests/test_residual_stream.py
    capped 120 python3 scripts/residual_norm_timing.py
    residual_steps
    ;;
residual_step)
    residual_steps
    ;;
rmsnorm_grid)
    python3 -m pip install --no-deps --no-index wheels/*.whl -q 2>/dev/null || echo "# no wheels: Liger not installed"
    run=${RUN:-$(date -u +%Y%m%dT%H%M%SZ)-grid}
    for dtype in bf16 fp32; do
        capped 280 python3 -m cs336_systems.bench.rmsnorm --part kernel --timer graph --dtypes "$dtype" --run-id "$run"
    done
    capped 120 python3 scripts/rmsnorm_forward_grid.py --output "$OUT/forward_grid.jsonl"
    ;;
checks)
    capped 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graph_timer.py \
        tests/test_flash_attention_triton.py -k "graph or split_head_dims or tf32x3"
    for provider in sdpa ours; do
        capped 60 python3 scripts/flash_shapes_bench.py "$provider" --shapes models --head-dim 80
    done
    CS336_FLASH_KERNELS=triton capped 90 python3 scripts/flash_shapes_bench.py ours --shapes models --head-dim 80
    small="--part kernel --rows 4096 16384 --cols 768 1024 1280 1600 2560 --dtypes bf16 --passes fwd fwd_bwd"
    for timer in do_bench graph; do
        # shellcheck disable=SC2086
        capped 150 python3 -m cs336_systems.bench.rmsnorm $small --providers ours eager compile liger --timer "$timer" \
            --results-dir "$OUT/rmsnorm_timers"
    done
    ;;
*)
    echo "unknown part ${PART}: residual, residual_step, rmsnorm_grid or checks (or none: the arguments are bench commands)" >&2
    exit 2
    ;;
esac
tar -cf "$OUT/results.tar" writeup/results writeup/figures 2>/dev/null || tar -cf "$OUT/results.tar" writeup/results
