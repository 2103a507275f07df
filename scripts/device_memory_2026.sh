#!/usr/bin/env bash
# The 2026 handout's memory questions (memory_profiling, gradient_checkpointing) on the 2.7B model (the 2026 xl:
# d_model 2560, d_ff 10240, 32 layers, 32 heads), batch 4, on one GPU whose python3 has torch (no installing),
# within a deadline:
#   DEADLINE_S=540 CS336_GIT_COMMIT=<hash> bash scripts/device_memory_2026.sh
# Most important first, each part capped so that the later ones keep their time:
#   1. memory_profiling peaks (inference, forward, training step; fp32 and bf16) at contexts 128 and 2048, and what
#      one block saves for backward and the gradients per block (rows of kind "block_residuals");
#   2. gradient_checkpointing at context 2048: groups of 1 block (predicted best: a block saves gigabytes for
#      backward, its input only 84 MB), 2, 3 and 4 blocks, and none;
#   3. memory_profiling timelines at the longest context that fits each case: PNGs, PyTorch's viewer pages, the
#      largest allocations.
# Rows land in writeup/results/ (a part cut off by the deadline resumes on the next call: measured cases are
# skipped). $OUT gets rows.tar (both jsonl files), figures.tar (this run's memory PNGs), pages.tgz (their viewer
# pages; the pages one by one where the archive is over 16 MB), snapshots.tgz (the snapshot pickles, where under
# 16 MB) and memory.log.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
deadline=$(( $(date +%s) + ${DEADLINE_S:-540} ))
log="$OUT/memory.log"
limit=$(( 16 * 1000 * 1000 ))
started=$(mktemp)  # figures newer than this file are this run's

capped 200 python3 -m cs336_systems.bench.memory_profiling --parts peaks residuals
capped 170 python3 -m cs336_systems.bench.gradient_checkpointing --size 2.7B --context-length 2048 --batch-size 4 \
    --group-sizes 1 2 3 4 0 --steps 2
capped 600 python3 -m cs336_systems.bench.memory_profiling --parts timelines --snapshot-dir snapshots

tar -cf "$OUT/rows.tar" writeup/results/memory_profiling.jsonl writeup/results/gradient_checkpointing.jsonl
mapfile -t pngs < <(find writeup/figures -name 'memory_*.png' -newer "$started")
mapfile -t pages < <(find writeup/figures -name 'memory_*.html' -newer "$started")
(( ${#pngs[@]} )) && tar -cf "$OUT/figures.tar" "${pngs[@]}"
if (( ${#pages[@]} )); then
    tar -czf "$OUT/pages.tgz" "${pages[@]}"
    if (( $(stat -c %s "$OUT/pages.tgz") > limit )); then
        echo "# pages.tgz over 16 MB: the pages one by one instead" | tee -a "$log"
        rm "$OUT/pages.tgz"
        cp "${pages[@]}" "$OUT/"
    fi
fi
if [ -d snapshots ]; then
    tar -czf "$OUT/snapshots.tgz" snapshots
    if (( $(stat -c %s "$OUT/snapshots.tgz") > limit )); then
        echo "# snapshots.tgz over 16 MB: left out (the rows say how to draw them again)" | tee -a "$log"
        rm "$OUT/snapshots.tgz"
    fi
fi
rm -f "$started"
ls -l "$OUT" | tee -a "$log"
