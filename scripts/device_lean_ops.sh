#!/usr/bin/env bash
# Issue 26 on a GPU machine whose python3 has torch and triton: host cost per operator call (op_overhead), the
# training step (train_step, both stacks, both variants) and the GPU tests of the operators, each under a time cap,
# everything under $OUT. Arguments: the train_step sizes and shapes (default: xl at 512:4).
#   bash scripts/device_lean_ops.sh [--sizes xl --shapes 512:4] 
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/cs336-basics PYTHONUNBUFFERED=1
export CS336_GIT_COMMIT=${CS336_GIT_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
STEP_ARGS=("$@")
[ ${#STEP_ARGS[@]} -eq 0 ] && STEP_ARGS=(--sizes xl --shapes 512:4)
if [ -z "${SKIP_OVERHEAD:-}" ]; then
    timeout 240 python3 -m cs336_systems.bench.op_overhead --results-dir "$OUT" 2>"$OUT/op_overhead.err" | tee "$OUT/op_overhead.txt"
fi
timeout "${STEP_SECONDS:-300}" python3 -m cs336_systems.bench.train_step --results-dir "$OUT" "${STEP_ARGS[@]}" 2>"$OUT/train_step.err" | tee "$OUT/train_step.txt"
if [ -n "${TESTS:-}" ]; then
    timeout "${TEST_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" -x $TESTS 2>&1 | tail -40 > "$OUT/pytest.log"
fi
tail -3 "$OUT"/*.err
