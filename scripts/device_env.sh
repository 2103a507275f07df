# Sourced by the device scripts: the repository root as working directory, $OUT, the import path (no install),
# NVLink multicast off (shared hosts), and `capped` (which reads the caller's $deadline and $log).
# The rows' commit: pass CS336_GIT_COMMIT=<hash> in the call (the copy on the device may carry another checkout's
# .git, whose HEAD is not the commit that travelled); without it rows say +modified where the tree differs.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/cs336-basics PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

capped() {  # capped SECONDS command...: at most SECONDS, and never past $deadline; output to the screen and $log
    local left=$(( deadline - $(date +%s) ))
    local cap=$(( $1 < left ? $1 : left ))
    shift
    if (( cap < 10 )); then echo "# deadline reached: skipping $*" | tee -a "$log"; return; fi
    echo "# $(date -u +%H:%M:%S) (at most ${cap}s) $*" | tee -a "$log"
    timeout --signal=INT --kill-after=15 "$cap" "$@" 2>&1 | grep --line-buffered -v 'it/s\]\|s/it\]' | tee -a "$log"
}
