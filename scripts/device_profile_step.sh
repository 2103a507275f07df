#!/usr/bin/env bash
# Profiles of the training step on a GPU machine (python3 with torch and triton): cProfile of our operators' issue loops,
# ours' train_step rows at xl 512:4 (beside the torch rows in writeup/results), the kernel-time profile of both
# stacks, then the GPU tests named in $TESTS. Everything under $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 120 python3 -m cs336_systems.bench.op_overhead --edition 2025 --ops attention rmsnorm cross_entropy \
    --profile ours --calls 200 2> "$OUT/profile_ours.txt" >/dev/null
cp writeup/results/train_step.jsonl "$OUT/train_step.jsonl"
timeout 200 python3 -m cs336_systems.bench.train_step --results-dir "$OUT" --edition 2025 --sizes xl --shapes 512:4 \
    --stacks ours 2>"$OUT/train_step.err" | tee "$OUT/train_step.txt"
for stack in ours torch; do
    timeout 90 python3 scripts/train_step_profile.py --size xl --context 512 --batch 4 --stack $stack --top 25 > "$OUT/profile_step_$stack.txt" 2>&1
done
if [ -n "${TESTS:-}" ]; then
    timeout "${TEST_SECONDS:-200}" python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" -x $TESTS 2>&1 | tail -30 > "$OUT/pytest.log"
fi
tail -n 3 "$OUT/train_step.err" "$OUT/pytest.log"
