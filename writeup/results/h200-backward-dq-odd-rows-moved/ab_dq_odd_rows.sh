#!/usr/bin/env bash
# dQ staged with odd rows moved (conflict-free stores): GPU tests, then backward times, trees before/after/after/before.
set -uo pipefail
root=$PWD
export PYTHONUNBUFFERED=1 CS336_GIT_COMMIT=${CS336_GIT_COMMIT:-wip}
export PYTHONPATH=$root:$root/cs336-basics
(timeout 220 python3 -m pytest -q -x -p no:cacheprovider -m "gpu and not slow" tests/test_flash_hopper.py tests/test_flash_attention_triton.py -k "hopper" > $OUT/gpu_tests.log 2>&1; tail -3 $OUT/gpu_tests.log)
timeout 390 python3 scripts/ab_trees.py --tree before=.before --tree after=. --out $OUT --timeout 95 -- \
  python3 $root/scripts/hopper_backward_tiles.py --tiles rule --orders rule --rounds 2 --ms 100 \
  --shapes 1,16,16384,64 1,25,8192,64 4,25,2048,64 4,25,512,64 4,32,2048,80 1,16,8192,128 1,16,16384,32
