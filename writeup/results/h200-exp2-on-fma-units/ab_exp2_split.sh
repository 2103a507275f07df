#!/usr/bin/env bash
# A/B of one exponential in four on the FMA units (the working tree; EXP2_SPLIT_BWD / EXP2_SPLIT_FWD switch the
# backward's and the forward's) against 97a3139 (.before; the diff applied to it): GPU tests and float64 checks with both on, then times in
# the order before, bwd, both, both, bwd, before.
set -uo pipefail
root=$PWD
export PYTHONUNBUFFERED=1 CS336_GIT_COMMIT=97a3139-exp2-split
export PYTHONPATH=$root:$root/cs336-basics
(EXP2_SPLIT_BWD=1 EXP2_SPLIT_FWD=1 timeout 200 python3 -m pytest -q -x -p no:cacheprovider -m "gpu and not slow" tests/test_flash_hopper.py tests/test_flash_attention_triton.py -k "hopper" > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log)
EXP2_SPLIT_BWD=1 EXP2_SPLIT_FWD=1 timeout 120 python3 scripts/hopper_backward_tiles.py --tiles rule --shapes 1,1,4096,64 --rounds 1 --ms 20 > $OUT/checks.log 2>&1
echo "checks rc $? ok $(grep -c '"ok": true' $OUT/checks.log)"; grep '"ok": false\|Error' $OUT/checks.log | head -3
grep -q '"ok": true' $OUT/checks.log || exit 1
i=0
for run in before:0:0 bwd:1:0 both:1:1 both:1:1 bwd:1:0 before:0:0; do
  i=$((i+1)); IFS=: read label b f <<< "$run"; tree=$([[ $label == before ]] && echo .before || echo .)
  (cd $tree && EXP2_SPLIT_BWD=$b EXP2_SPLIT_FWD=$f PYTHONPATH=$PWD:$PWD/cs336-basics timeout 100 python3 $root/scripts/hopper_backward_tiles.py --tiles rule --orders rule --rounds 2 --ms 100 --shapes 1,16,16384,64 1,25,8192,64 4,25,2048,64 4,25,512,64 1,16,16384,128 1,32,8192,80 2>&1 | grep '^{' | grep -v check > $OUT/t_${i}_$label.jsonl)
  python3 -c "
import json
for l in open('$OUT/t_${i}_$label.jsonl'):
    r=json.loads(l); k='rule/rule'
    print('$label', r['shape'], 'bwd %.4f fwd %.4f fb %.4f | cudnn bwd %.4f fb %.4f' % (r['backward_ms'][k], r['fwd_bwd_ms'][k]-r['backward_ms'][k], r['fwd_bwd_ms'][k], r['backward_ms']['cudnn'], r['fwd_bwd_ms']['cudnn']))
"
done
