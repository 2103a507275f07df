#!/usr/bin/env bash
# A/B of the backward's next S^T and dP^T issued behind dK through a three-stage Q/dO ring (d <= 80), run from
# a checkout with early_scores.diff applied and .before holding the tree of dc30637; trees before, after, after, before.
set -uo pipefail
root=$PWD
export PYTHONUNBUFFERED=1 CS336_GIT_COMMIT=dc30637-early-scores
(PYTHONPATH=$root:$root/cs336-basics timeout 170 python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" tests/test_flash_hopper.py tests/test_flash_attention_triton.py -k "hopper" > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log)
i=0
for tree in .before . . .before; do
  i=$((i+1)); label=$([[ $tree == . ]] && echo after || echo before)
  (cd $tree && PYTHONPATH=$PWD:$PWD/cs336-basics timeout 95 python3 $root/scripts/hopper_backward_tiles.py --tiles rule --orders rule --rounds 2 --ms 100 --shapes 1,16,16384,64 4,25,2048,64 1,25,8192,64 4,25,512,64 1,32,8192,80 4,32,2048,80 2>&1 | grep '^{' > $OUT/bwd_${i}_$label.jsonl)
  python3 -c "
import json
for l in open('$OUT/bwd_${i}_$label.jsonl'):
    r=json.loads(l)
    if 'check' in r:
        if not r['ok']: print('$label CHECK FAILED', r)
        continue
    print('$label', r['shape'], 'bwd', r['backward_ms'], r['backward_over_cudnn'])
"
done
