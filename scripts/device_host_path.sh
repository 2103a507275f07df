#!/usr/bin/env bash
# Attention's eager host path on a GPU machine, everything under $OUT: the GPU tests of the launch code and the
# kernels that go through it, then op_overhead's attention rows (providers taking turns) on two trees alternating
# (the first argument run from its own folder, then ".", in the order A B B A), and a cProfile of ours in the tree ".".
#   bash scripts/device_host_path.sh .before .
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
deadline=$(( $(date +%s) + ${SECONDS_BUDGET:-560} )) log="$OUT/log.txt"
root=$PWD
SHAPES=${ATTENTION_SHAPES:-"4,25,512,64 4,25,2048,64"}
capped "${TEST_SECONDS:-260}" python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" ${TESTS:-tests/test_flash_hopper.py \
    tests/test_kernel_launch.py tests/test_rmsnorm.py tests/test_fused_adamw.py} > "$OUT/gpu_tests.log"
tail -n 3 "$OUT/gpu_tests.log"
round=0
for tree in "$1" "$2" "$2" "$1"; do
    round=$((round + 1))
    label=$( [[ "$tree" == "." ]] && echo after || echo before )$round
    (cd "$tree" && PYTHONPATH=$PWD:$PWD/cs336-basics capped 90 python3 -m cs336_systems.bench.op_overhead \
        --ops attention --attention-shapes $SHAPES --results-dir "$OUT/$label" --force > /dev/null)
    cd "$root"
done
capped 60 python3 -m cs336_systems.bench.op_overhead --ops attention --attention-shapes $SHAPES --profile ours \
    --calls 1000 > "$OUT/profile_attention_host.txt"
