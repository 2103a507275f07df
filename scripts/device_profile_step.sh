#!/usr/bin/env bash
# Profiles on a GPU machine (python3 with torch and triton), everything under $OUT:
# - cProfile of our attention operator's eager calls (op_overhead --profile ours) at $ATTENTION_SHAPES;
# - op_overhead attention rows, providers taking turns, at the same shapes;
# - the kernel-time profile by class of both stacks' training step (scripts/train_step_profile.py) for the
#   $EDITION (default 2026) xl at each context:batch of $SHAPES (default "2048:4 8192:1");
# - the GPU tests named in $TESTS.
# Pass CS336_GIT_COMMIT=<hash> from the checkout that travelled.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
deadline=$(( $(date +%s) + ${SECONDS_BUDGET:-560} )) log="$OUT/log.txt"
EDITION=${EDITION:-2026}
SHAPES=${SHAPES:-"2048:4 8192:1"}
ATTENTION_SHAPES=${ATTENTION_SHAPES:-"4,25,512,64 4,25,2048,64"}
capped 120 python3 -m cs336_systems.bench.op_overhead --ops attention --attention-shapes $ATTENTION_SHAPES \
    --profile ours --calls 1000 > "$OUT/profile_attention_host.txt"
capped 120 python3 -m cs336_systems.bench.op_overhead --ops attention --attention-shapes $ATTENTION_SHAPES \
    --results-dir "$OUT" --force
for shape in $SHAPES; do
    for stack in ours torch; do
        capped 150 python3 scripts/train_step_profile.py --edition "$EDITION" --size xl --context "${shape%:*}" \
            --batch "${shape#*:}" --stack $stack --top 30 > "$OUT/profile_step_${stack}_${shape/:/x}.txt"
    done
done
if [ -n "${TESTS:-}" ]; then
    capped "${TEST_SECONDS:-200}" python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" -x $TESTS \
        > "$OUT/pytest.log"
fi
grep -h '"wall_ms"' "$OUT"/profile_step_*.txt | cut -c1-400
