#!/usr/bin/env bash
# The committed tree (K and V in registers up to d = 32) against 97a3139's kernels (.before): GPU tests, then
# backward times at d = 16 and 32 in the order before, after, after, before.
set -uo pipefail
root=$PWD
export PYTHONUNBUFFERED=1 CS336_GIT_COMMIT=3ae0056
export PYTHONPATH=$root:$root/cs336-basics
(timeout 200 python3 -m pytest -q -x -p no:cacheprovider -m "gpu and not slow" tests/test_flash_hopper.py tests/test_flash_attention_triton.py -k "hopper" > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log)
i=0
for tree in .before . . .before; do
  i=$((i+1)); label=$([[ $tree == . ]] && echo after || echo before)
  (cd $tree && PYTHONPATH=$PWD:$PWD/cs336-basics timeout 100 python3 $root/scripts/hopper_backward_tiles.py --tiles rule --orders rule --rounds 2 --ms 100 --shapes 1,16,16384,16 1,16,16384,32 4,16,2048,32 4,12,512,32 2>&1 | grep '^{' | grep -v check > $OUT/bwd_${i}_$label.jsonl)
  python3 -c "
import json
for l in open('$OUT/bwd_${i}_$label.jsonl'):
    r=json.loads(l)
    print('$label', r['shape'], 'bwd', r['backward_ms'], r['backward_over_cudnn'])
"
done
