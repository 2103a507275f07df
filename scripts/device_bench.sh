#!/usr/bin/env bash
# Run benchmark commands on a GPU machine whose python3 already has torch and triton (no installing),
# within a deadline, then pack the results and figures they wrote into $OUT/results.tar.
#   DEADLINE_S=540 bash scripts/device_bench.sh "benchmarking_script" "pytorch_attention --passes 50"
# Each argument is one `python -m cs336_systems.bench.<argument>` command. Rows land in writeup/results/
# (which travelled with the checkout, so finished cases are skipped: a cut-off sweep resumes next call);
# a command still running at the deadline is stopped, and what it wrote so far is kept.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
deadline=$(( $(date +%s) + ${DEADLINE_S:-540} ))
for command in "$@"; do
    left=$(( deadline - $(date +%s) ))
    if (( left < 10 )); then echo "# deadline reached: skipping $command" | tee -a "$OUT/bench.log"; continue; fi
    echo "# $(date -u +%H:%M:%S) python -m cs336_systems.bench.$command (at most ${left}s)" | tee -a "$OUT/bench.log"
    # shellcheck disable=SC2086
    timeout --signal=INT --kill-after=15 "$left" python3 -m cs336_systems.bench.$command 2>&1 \
        | grep --line-buffered -v 'it/s\]\|s/it\]' | tee -a "$OUT/bench.log"
done
tar -cf "$OUT/results.tar" writeup/results writeup/figures 2>/dev/null || tar -cf "$OUT/results.tar" writeup/results
