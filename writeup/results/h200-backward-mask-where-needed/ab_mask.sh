#!/usr/bin/env bash
# A/B of the backward's mask only where needed (d <= 64): backward kernel times (CUDA graphs) and the leaderboard
# protocol, trees alternating before/after; GPU tests of the new tree first.
set -uo pipefail
root=$PWD
export PYTHONUNBUFFERED=1
(PYTHONPATH=$root:$root/cs336-basics timeout 90 python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" tests/test_flash_hopper.py > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log)
i=0
for tree in .before . . .before; do
  i=$((i+1)); label=$([[ $tree == . ]] && echo after || echo before)
  (cd $tree && PYTHONPATH=$PWD:$PWD/cs336-basics timeout 80 python3 $root/scripts/hopper_backward_tiles.py --tiles rule --orders rule --rounds 2 --ms 150 --shapes 1,16,16384,64 4,25,2048,64 1,25,8192,64 4,25,512,64 2>&1 | grep '^{' > $OUT/bwd_${i}_$label.jsonl)
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
for tree in .before . . .before; do
  i=$((i+1)); label=$([[ $tree == . ]] && echo after || echo before)
  (cd $tree && PYTHONPATH=$PWD:$PWD/cs336-basics timeout 70 python3 -m cs336_systems.bench.leaderboard --providers ours sdpa_cudnn --rep 2000 --warmup 200 --results-dir $OUT/lb_$i 2>&1 | grep -i "ms\|ours\|cudnn" | tail -3 | sed "s/^/$label /")
done
cd $OUT && tar czf lb.tgz lb_* && rm -rf lb_*
