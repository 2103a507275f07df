#!/usr/bin/env bash
# Kernel variants of the FlashAttention operator on one GPU (python3 with torch and triton), in one call, into $OUT/variants.log and
# $OUT/variants.jsonl: SDPA's times once (scripts/flash_shapes_bench.py sdpa, fa2), then for the checkout as it is
# ("main") and for every folder _variants/NAME/ (files laid over a copy of the checkout), each in its own copy
# and processes: the errors against float64 (scripts/flash_variant_check.py) and our operator's times at the
# same shapes. Make the variants here from branches, and carry the folder (it is git-ignored):
#   mkdir -p _variants/NAME/cs336_systems/attention/backends
#   git show BRANCH:cs336_systems/attention/backends/hopper_kernels.py \
#       > _variants/NAME/cs336_systems/attention/backends/hopper_kernels.py
#   (device) VARIANT_SECONDS=150 bash scripts/device_flash_variants.sh      # run with carry ["_variants"]
# VARIANT_KERNELS="auto hopper triton" times each variant once per kernel family (CS336_FLASH_KERNELS).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
root=$PWD
log="$OUT/variants.log"
rows="$OUT/variants.jsonl"
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=name --format=csv,noheader; } | tee -a "$log"
for provider in sdpa fa2; do
    timeout 150 python3 scripts/flash_shapes_bench.py $provider 2>>"$log" | sed "s/^{/{\"variant\": \"$provider\", /" \
        | tee -a "$rows"
done
for variant in main _variants/*/; do
    [ -d "$variant" ] || [ "$variant" = main ] || continue
    name=$(basename "$variant")
    copy=/tmp/flash_variant_$name
    rm -rf "$copy" && cp -r "$root" "$copy"
    if [ "$variant" != main ]; then cp -r "$variant". "$copy"/; fi
    echo "# $(date -u +%H:%M:%S) $name" | tee -a "$log"
    (
        cd "$copy" && export PYTHONPATH=$copy:$copy/cs336-basics
        timeout "${VARIANT_SECONDS:-150}" python3 scripts/flash_variant_check.py 2>&1 | tee -a "$log" | tail -n 1
        if [ "${PIPESTATUS[0]}" -eq 0 ]; then
            for kernels in ${VARIANT_KERNELS:-auto}; do
                CS336_FLASH_KERNELS=$kernels timeout "${VARIANT_SECONDS:-150}" python3 scripts/flash_shapes_bench.py \
                    ours 2>>"$log" | sed "s/^{/{\"variant\": \"$name\", /" | tee -a "$rows"
            done
        else
            echo "# $name: errors over the bound or a failure; not timed" | tee -a "$log"
        fi
    )
done
