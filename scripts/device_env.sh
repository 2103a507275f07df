# Sourced by the device scripts: the repository root as working directory, $OUT, the import path (no install),
# and NVLink multicast off (shared hosts).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/cs336-basics PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
