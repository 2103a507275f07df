#!/usr/bin/env bash
# A/B of K and V held in registers as the A operands of S^T and dP^T at d <= 64 (the working tree with
# KV_IN_REGISTERS=1) against 11a8de4 (.before; kv_in_registers.diff applied to it): GPU tests and float64 checks with it on, then backward times in the
# order before, after, after, before.
set -uo pipefail
root=$PWD
export PYTHONUNBUFFERED=1 CS336_GIT_COMMIT=11a8de4-kv-registers KV_IN_REGISTERS=1
export PYTHONPATH=$root:$root/cs336-basics
(timeout 200 python3 -m pytest -q -x -p no:cacheprovider -m "gpu and not slow" tests/test_flash_hopper.py tests/test_flash_attention_triton.py -k "hopper" > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log)
timeout 120 python3 scripts/hopper_backward_tiles.py --tiles 128x8 64x4 --shapes 1,1,4096,64 --rounds 1 --ms 20 > $OUT/checks.log 2>&1
echo "checks rc $? ok $(grep -c '"ok": true' $OUT/checks.log)"; grep '"ok": false\|Error' $OUT/checks.log | head -3
grep -q '"ok": true' $OUT/checks.log || exit 1
i=0
for tree in .before . . .before; do
  i=$((i+1)); label=$([[ $tree == . ]] && echo after || echo before)
  (cd $tree && PYTHONPATH=$PWD:$PWD/cs336-basics timeout 100 python3 $root/scripts/hopper_backward_tiles.py --tiles rule --orders rule --rounds 2 --ms 100 --shapes 1,16,16384,64 1,25,8192,64 4,25,2048,64 4,25,512,64 1,16,16384,32 2>&1 | grep '^{' | grep -v check > $OUT/bwd_${i}_$label.jsonl)
  python3 -c "
import json
for l in open('$OUT/bwd_${i}_$label.jsonl'):
    r=json.loads(l)
    print('$label', r['shape'], 'bwd', r['backward_ms'], r['backward_over_cudnn'])
"
done
