#!/usr/bin/env bash
# Issue 26 on a GPU machine (python3 with torch and triton): ours' train_step at xl 512:4 beside the torch rows in
# writeup/results, the host cost per call (op_overhead), the GPU tests of $TESTS, the leaderboard protocol
# (3 s of samples) against cuDNN, each under a time cap; everything under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/cs336-basics PYTHONUNBUFFERED=1
cp writeup/results/train_step.jsonl "$OUT/train_step.jsonl"
timeout 150 python3 -m cs336_systems.bench.train_step --results-dir "$OUT" --sizes xl --shapes 512:4 --stacks ours 2>"$OUT/train_step.err" | tee "$OUT/train_step.txt"
timeout 150 python3 -m cs336_systems.bench.op_overhead --results-dir "$OUT" 2>"$OUT/op_overhead.err" | tee "$OUT/op_overhead.txt"
timeout 110 python3 -m cs336_systems.bench.leaderboard --results-dir "$OUT" --rep 3000 --warmup 300 --providers ours sdpa_cudnn 2>"$OUT/leaderboard.err" | tee "$OUT/leaderboard.txt"
timeout "${TEST_SECONDS:-170}" python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" $TESTS > "$OUT/pytest.log" 2>&1
tail -n 4 "$OUT/pytest.log"
