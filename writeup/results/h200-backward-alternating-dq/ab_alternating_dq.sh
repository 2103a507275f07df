#!/usr/bin/env bash
# A/B of the alternating-dQ backward at d = 64 (the working tree, alternating_dq_v1.diff applied to 81ca133)
# against 81ca133 (.before): float64 checks with 128-key programs forced, then backward times, the trees in the
# order before, after, after, before.
set -uo pipefail
root=$PWD
export PYTHONUNBUFFERED=1 CS336_GIT_COMMIT=81ca133-alt-dq
export PYTHONPATH=$root:$root/cs336-basics
timeout 120 python3 scripts/hopper_backward_tiles.py --tiles 128x8 --shapes 1,16,16384,64 --rounds 1 --ms 50 > $OUT/checks.log 2>&1
echo "checks rc $?"; grep -c '"ok": true' $OUT/checks.log; grep '"ok": false\|Error\|error' $OUT/checks.log | head -5; tail -2 $OUT/checks.log
grep -q '"ok": false' $OUT/checks.log && exit 1
i=0
for tree in .before . . .before; do
  i=$((i+1)); label=$([[ $tree == . ]] && echo after || echo before)
  (cd $tree && PYTHONPATH=$PWD:$PWD/cs336-basics timeout 100 python3 $root/scripts/hopper_backward_tiles.py --tiles rule --orders rule --rounds 2 --ms 100 --shapes 1,16,16384,64 1,25,8192,64 4,25,2048,64 2,16,4096,64 2>&1 | grep '^{' | grep -v check > $OUT/bwd_${i}_$label.jsonl)
  python3 -c "
import json
for l in open('$OUT/bwd_${i}_$label.jsonl'):
    r=json.loads(l)
    print('$label', r['shape'], 'bwd', r['backward_ms'], r['backward_over_cudnn'])
"
done
