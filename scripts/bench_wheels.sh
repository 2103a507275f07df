#!/usr/bin/env bash
# Wheels of the optional `bench` group (pyproject.toml) for a GPU machine without network, into wheels/ (git-ignored).
#
#   bash scripts/bench_wheels.sh                    # the whole group: liger-kernel and quack-kernels
#   bash scripts/bench_wheels.sh liger-kernel       # one of them
#
# Only what torch 2.11 and triton 3.6 do not bring is fetched (pip download --no-deps of each name below), as
# CPython 3.12 x86-64 wheels. On the GPU machine, from the repository root (wheels/ travels with the tree):
#
#   python3 -m pip install --no-deps --no-index wheels/*.whl
#
# The script prints every wheel's size and their total, and fails when the total exceeds LIMIT_MIB (default 40):
# a working tree carried to such a machine may hold 64 MiB in all.
set -euo pipefail
cd "$(dirname "$0")/.."

LIMIT_MIB=${LIMIT_MIB:-40}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
OUT=wheels

# Each package of the group with what it needs beyond torch and triton. Liger-Kernel is pure Python on top of
# Triton (it imports `packaging`, which torch's environment has). QuACK needs NVIDIA's CuTe DSL (the CUDA 13
# build, for torch's CUDA 13), the TVM FFI and torch's C DLPack extension; protobuf, cuda-bindings, einops and
# typing-extensions come with torch's environment.
declare -A NEEDS=(
    [liger-kernel]="liger-kernel==0.8.5"
    [quack-kernels]="quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
                     nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1
                     apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5"
)
packages=("$@")
if [ ${#packages[@]} -eq 0 ]; then
    packages=(liger-kernel quack-kernels)
fi

rm -rf "$OUT"
mkdir -p "$OUT"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
declare -A bytes_of
for package in "${packages[@]}"; do
    if [ -z "${NEEDS[$package]+set}" ]; then
        echo "unknown package $package: the bench group holds ${!NEEDS[*]}" >&2
        exit 2
    fi
    before=$(du -sb "$OUT" | cut -f1)
    # shellcheck disable=SC2086  # the list is split on purpose
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
        --implementation cp "${platforms[@]}" -d "$OUT" ${NEEDS[$package]}
    bytes_of[$package]=$(( $(du -sb "$OUT" | cut -f1) - before ))
done

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
total=0
for wheel in "$OUT"/*.whl; do
    size=$(stat -c %s "$wheel")
    total=$((total + size))
    printf '%12s  %s\n' "$(mib "$size")" "$(basename "$wheel")"
done
for package in "${packages[@]}"; do
    printf '%12s  %s with what it needs\n' "$(mib "${bytes_of[$package]}")" "$package"
done
printf '%12s  in all, in %s/\n' "$(mib "$total")" "$OUT"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "error: the wheels take $(mib "$total"), over the ${LIMIT_MIB} MiB that may travel to the GPU machine;" \
         "fetch fewer packages (e.g. bash scripts/bench_wheels.sh liger-kernel): a provider whose package is" \
         "missing there is skipped" >&2
    exit 1
fi
