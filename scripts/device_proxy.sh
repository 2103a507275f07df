#!/usr/bin/env bash
# The one-GPU proxy of the 8B leaderboard step's first rows (python3 with torch and triton), each part under a time cap, into $OUT: the GPU test
# of compiled blocks under our FSDP, the 2025 leaderboard protocol (ours and cuDNN), the one-GPU proxy of the 8B
# step ($PROXY_LAYERS blocks, both stacks, short do_bench), and the proxy's kernel-time profile per stack
# ($PROFILE_OVERRIDES: stack:part=value changes, e.g. ours:checkpointing=full).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
layers=${PROXY_LAYERS:-4}
if [ -z "${SKIP_FIRST:-}" ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_leaderboard_2026.py -k compiled > "$OUT/pytest_proxy.log" 2>&1
    tail -n 2 "$OUT/pytest_proxy.log"
    timeout 120 python3 -m cs336_systems.bench.leaderboard --providers ours sdpa_cudnn --results-dir "$OUT" > "$OUT/leaderboard.txt" 2>&1
    tail -n 6 "$OUT/leaderboard.txt"
    timeout 330 python3 -m cs336_systems.bench.leaderboard_2026 --world-size 1 --per-rank-batch 1 --num-layers "$layers" \
        --rep-ms 3000 --warmup-ms 1000 --results-dir "$OUT" > "$OUT/proxy.txt" 2>&1
    tail -n 8 "$OUT/proxy.txt"
fi
if [ -n "${PROFILE_OVERRIDES+x}" ]; then
    timeout "${PROFILE_SECONDS:-250}" python3 scripts/leaderboard_2026_profile.py --world-size 1 --layers "$layers" \
        --stacks ${PROFILE_STACKS:-ours torch} --override $PROFILE_OVERRIDES --top 12 > "$OUT/proxy_profile.txt" 2>&1
    grep '^{' "$OUT/proxy_profile.txt" | cut -c1-400
fi
