"""Development probe for the FlashAttention speed work, on a machine without a GPU: compile our kernels
for an H100 (sm_90) through Triton's own ptxas and report, per configuration, registers, spills, shared
memory and the SASS instructions that matter (tensor-core HGMMA, MUFU.EX2, atomics and bulk reductions,
local-memory LDL/STL).

    python scripts/flash_aot_report.py [--kernels fwd bwd delta] [--head-dim 64] [--causal]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cs336_systems.attention.backends import triton as triton_backend  # noqa: E402
from cs336_systems.attention.backends import triton_kernels  # noqa: E402
from tests._flash_aot import compile_for_gpu, cuobjdump, resource_usage  # noqa: E402

SASS_PATTERNS = {"HGMMA": r"\bHGMMA\b", "HMMA": r"\bHMMA\b", "EX2": r"MUFU\.EX2", "RED": r"\bRED\b|\bATOM",
                 "UBLKRED": r"UBLKRED|UTMAREDG", "LDL/STL": r"\bLDL\b|\bSTL\b", "BAR": r"\bBAR\b"}


def captured_launches(dtype: torch.dtype, head_dim: int, is_causal: bool) -> list[tuple[str, tuple, dict]]:
    """(kernel, args, meta) of one forward and backward at a small size, without running anything."""
    launches = []
    recorders = {name: (lambda key, grid, args, meta, fixed, name=name, **options: launches.append((name, args, meta)))
                 for name in ("fwd", "bwd", "delta")}
    original = dict(triton_backend.KERNELS), triton_backend.DELTA_KERNEL
    triton_backend.KERNELS.update(fwd=recorders["fwd"], bwd=recorders["bwd"])
    triton_backend.DELTA_KERNEL = recorders["delta"]
    try:
        q, k, v = (torch.randn(2, 3, 256, head_dim).to(dtype) for _ in range(3))
        O, L = triton_backend.forward(q, k, v, is_causal, head_dim ** -0.5)
        triton_backend.backward(q, k, v, O, L, torch.randn_like(O), is_causal, head_dim ** -0.5)
    finally:
        triton_backend.KERNELS.update(original[0])
        triton_backend.DELTA_KERNEL = original[1]
    return launches


def sass_counts(compiled) -> dict[str, int]:
    sass = cuobjdump(compiled, "-sass")
    return {name: len(re.findall(pattern, sass)) for name, pattern in SASS_PATTERNS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="+", default=None, help="kernel names (default: every one launched)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--not-causal", action="store_true")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    for kernel, launch_args, meta in captured_launches(dtype, args.head_dim, not args.not_causal):
        if args.kernels and kernel not in args.kernels:
            continue
        if kernel in triton_backend.KERNELS:
            autotuner = triton_backend.KERNELS[kernel].autotuner
            configs = autotuner.early_config_prune(autotuner.configs, {"Q": launch_args[0]}, **meta)
            function = triton_backend.KERNELS[kernel].fn
        else:
            configs, function = [triton_backend.DELTA_CONFIG], triton_kernels.attn_bwd_delta_kernel
        for config in configs:
            try:
                compiled = compile_for_gpu(function, tuple(launch_args), {**meta, **config.all_kwargs()})
            except Exception as error:  # noqa: BLE001
                print(f"{kernel:13s} {config.kwargs} w{config.num_warps} s{config.num_stages}: FAILED {str(error)[:300]}")
                continue
            usage = resource_usage(compiled)
            counts = " ".join(f"{k}={v}" for k, v in sass_counts(compiled).items())
            print(f"{kernel:13s} {str(config.kwargs):28s} w{config.num_warps} s{config.num_stages}: regs {usage.registers:3d} "
                  f"spill {usage.spill_bytes:4d} smem {usage.shared_bytes // 1024:3d}K  {counts}", flush=True)


if __name__ == "__main__":
    main()
