#!/usr/bin/env bash
# One device call for a change to the Hopper backward: the Hopper GPU tests at the working tree, then the backward
# (CUDA graphs, Delta and the dQ conversion included, beside cuDNN; scripts/hopper_backward_tiles.py) at each shape in
# the tree before the change (.before) and the working tree, each run in its own process, in the order before, after,
# after, before (scripts/ab_trees.py). Files under $OUT: gpu_tests.log, one jsonl per run, runs.log.
#   git archive HEAD cs336_systems cs336-basics scripts tests pyproject.toml | tar -x -C .before   # before the change
#   bash scripts/device_backward_ab.sh 1,16,16384,64 4,25,2048,64 4,25,512,64       # shapes B,H,T,d (causal, bf16)
set -uo pipefail
[[ $# -gt 0 && -d .before ]] || { echo "usage: bash $0 B,H,T,d [...] (with the old tree in .before)" >&2; exit 2; }
root=$PWD
export PYTHONUNBUFFERED=1 CS336_GIT_COMMIT=${CS336_GIT_COMMIT:-wip} PYTHONPATH=$root:$root/cs336-basics
timeout 220 python3 -m pytest -q -x -p no:cacheprovider -m "gpu and not slow" tests/test_flash_hopper.py \
    tests/test_flash_attention_triton.py -k hopper > "$OUT/gpu_tests.log" 2>&1
tail -1 "$OUT/gpu_tests.log"
timeout 390 python3 scripts/ab_trees.py --tree before=.before --tree after=. --out "$OUT" --timeout 95 -- \
    python3 "$root/scripts/hopper_backward_tiles.py" --tiles rule --orders rule --rounds 2 --ms 100 --shapes "$@"
