#!/usr/bin/env bash
# The training step's rows on a GPU machine (python3 with torch and triton), each part under a time cap, into $OUT:
# train_step (both stacks, both variants; sizes and shapes from $STEP_ARGS; resumed from the committed rows),
# op_overhead, then the GPU tests
# selected by $TEST_K from the operator test files.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
# Resume: the committed rows travel with the checkout, so measured cases are skipped and ours finds torch's rows.
cp writeup/results/train_step.jsonl "$OUT/train_step.jsonl"
timeout "${STEP_SECONDS:-400}" python3 -m cs336_systems.bench.train_step --edition 2025 --results-dir "$OUT" \
    ${STEP_ARGS:-} 2>"$OUT/train_step.err" | tee "$OUT/train_step.txt"
timeout 110 python3 -m cs336_systems.bench.op_overhead --edition 2025 --results-dir "$OUT" 2>"$OUT/op_overhead.err" \
    | tee "$OUT/op_overhead.txt"
timeout "${TEST_SECONDS:-60}" python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" -k "${TEST_K:-cached}" \
    tests/test_flash_attention_triton.py tests/test_train.py tests/test_fused_adamw.py > "$OUT/pytest.log" 2>&1
tail -n 3 "$OUT/pytest.log"
