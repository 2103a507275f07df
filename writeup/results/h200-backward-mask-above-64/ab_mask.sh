#!/usr/bin/env bash
# A/B of the backward's mask only where needed above d = 64 (the branch at 80, 96 and 128), run from the checkout
# with .before holding the tree of 961078a: GPU tests of the new tree, then backward times, the trees in the order
# before, after, after, before.
set -uo pipefail
root=$PWD
export PYTHONUNBUFFERED=1 CS336_GIT_COMMIT=961078a-mask-d128
(PYTHONPATH=$root:$root/cs336-basics timeout 170 python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" tests/test_flash_hopper.py tests/test_flash_attention_triton.py -k "hopper" > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log)
i=0
for tree in .before . . .before; do
  i=$((i+1)); label=$([[ $tree == . ]] && echo after || echo before)
  (cd $tree && PYTHONPATH=$PWD:$PWD/cs336-basics timeout 90 python3 $root/scripts/hopper_backward_tiles.py --tiles rule --orders rule --rounds 2 --ms 100 --shapes 1,16,16384,128 4,36,2048,128 4,32,2048,80 1,32,8192,80 2>&1 | grep '^{' | grep -v check > $OUT/bwd_${i}_$label.jsonl)
  python3 -c "
import json
for l in open('$OUT/bwd_${i}_$label.jsonl'):
    r=json.loads(l)
    print('$label', r['shape'], 'bwd', r['backward_ms'], r['backward_over_cudnn'])
"
done
