#!/usr/bin/env bash
# A/B of dK issued before the barrier (the working tree, dk_before_barrier.diff applied to 1788afe) against
# 1788afe itself (.before): (with TESTS=1, the GPU tests of the new tree,)
# then backward times, the trees in the order before, after, after, before.
set -uo pipefail
root=$PWD
export PYTHONUNBUFFERED=1 CS336_GIT_COMMIT=1788afe-dk-before-barrier
[[ ${TESTS:-0} == 1 ]] && (PYTHONPATH=$root:$root/cs336-basics timeout 200 python3 -m pytest -q -x -p no:cacheprovider -m "gpu and not slow" tests/test_flash_hopper.py tests/test_flash_attention_triton.py -k "hopper" > $OUT/gpu_tests.log 2>&1; tail -3 $OUT/gpu_tests.log)
i=0
for tree in .before . . .before; do
  i=$((i+1)); label=$([[ $tree == . ]] && echo after || echo before)
  (cd $tree && PYTHONPATH=$PWD:$PWD/cs336-basics timeout 100 python3 $root/scripts/hopper_backward_tiles.py --tiles rule --orders rule --rounds 2 --ms 100 --shapes 1,16,16384,64 1,25,8192,64 4,25,2048,64 4,25,512,64 1,16,16384,128 1,32,8192,80 2>&1 | grep '^{' | grep -v check > $OUT/bwd_${i}_$label.jsonl)
  python3 -c "
import json
for l in open('$OUT/bwd_${i}_$label.jsonl'):
    r=json.loads(l)
    print('$label', r['shape'], 'bwd', r['backward_ms'], r['backward_over_cudnn'])
"
done
