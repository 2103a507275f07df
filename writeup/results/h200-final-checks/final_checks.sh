#!/usr/bin/env bash
# Final checks of the session's kernels: GPU tests of the Hopper attention, the 8B model's attention beside cuDNN.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/cs336-basics PYTHONUNBUFFERED=1 CS336_GIT_COMMIT=$1
timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" tests/test_flash_hopper.py tests/test_flash_attention_triton.py -k "hopper" > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log
timeout 150 python3 scripts/hopper_backward_tiles.py --tiles rule --orders rule --rounds 2 --ms 400 --shapes 1,32,32768,128 2>&1 | grep '^{' > $OUT/attention_8b.jsonl
grep -v check $OUT/attention_8b.jsonl; grep -c '"ok": true' $OUT/attention_8b.jsonl
