#!/usr/bin/env bash
# Run the test suite on a GPU machine whose python3 already has torch and triton (no installing),
# writing the log, a junit report and the environment under $OUT (default: ./device-out), then measure
# the attention error grid into $OUT/flash_attention_triton_errors.json (scripts/flash_error_grid.py).
#   bash scripts/device_tests.sh            # the whole suite
#   bash scripts/device_tests.sh -m gpu     # only the GPU tests
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export CS336_RESULTS_DIR=$OUT
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import sys, torch, triton, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/environment.txt"
python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/junit.xml" "$@" tests 2>&1 | tee "$OUT/pytest.log"
python3 scripts/flash_error_grid.py --results-dir "$OUT" 2>&1 | tee "$OUT/flash_error_grid.log"
