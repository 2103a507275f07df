#!/usr/bin/env bash
# The same measurements on two checkouts in one call, alternating, so that a change's effect on speed is read on
# one machine: the leaderboard protocol (ours and cuDNN) and the xl training step (ours, eager and CUDA graphs).
#   git worktree add /tmp/base <commit> && mkdir -p .baseline && cp -r /tmp/base/cs336_systems /tmp/base/cs336-basics .baseline/
#   bash scripts/device_regression.sh .baseline .      # on the GPU machine: rows under $OUT/<label>/
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
root=$PWD
for round in 1 2; do
    for tree in "$@"; do
        label=$( [[ "$tree" == "." ]] && echo current || basename "$tree" | tr -d . )
        # xl is the 1600-wide model: 2025's name (trees from before the --edition option know only that edition)
        edition=$(grep -q -- "--edition" "$tree/cs336_systems/bench/common/cli.py" && echo "--edition 2025")
        mkdir -p "$OUT/$label"
        echo "# $(date -u +%H:%M:%S) round $round: $label" | tee -a "$OUT/regression.log"
        (cd "$tree" && PYTHONPATH=$PWD:$PWD/cs336-basics timeout 120 python3 -m cs336_systems.bench.leaderboard \
            --providers ours sdpa_cudnn --no-fwd --rep 3000 --results-dir "$OUT/$label" 2>&1 \
            | grep -v 'it/s\]\|s/it\]' | tail -n 8) | tee -a "$OUT/regression.log"
        (cd "$tree" && PYTHONPATH=$PWD:$PWD/cs336-basics timeout 150 python3 -m cs336_systems.bench.train_step \
            $edition --sizes xl --shapes 512:4 --stacks ours --force --results-dir "$OUT/$label" 2>&1 \
            | grep -v 'it/s\]\|s/it\]' | tail -n 6) | tee -a "$OUT/regression.log"
    done
done
cd "$root"
