"""Fingerprint the Hopper Gluon kernels (``cs336_systems/attention/backends/hopper_kernels.py``) and the Triton kernels
launched around them (Delta, the dQ conversion) on a machine without a GPU: record the launches the Hopper backend
makes on CPU tensors, compile each for sm_90, and print per kernel a hash of its SASS, its registers, spills and
shared memory. A refactor that should not change the generated code is checked by comparing this output before
and after.

    python scripts/flash_hopper_sass.py [--head-dims 64 128] [--dtypes bf16 fp16] [--causal true false] [--save-dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cs336_systems.attention.backends import hopper  # noqa: E402
from tests._flash_aot import compile_for_gpu, cuobjdump, hopper_launches, resource_usage  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def fingerprint_lines(head_dim: int, dtype: str, is_causal: bool, save_dir: str | None = None) -> list[str]:
    """One line per kernel the Hopper backend launches at this head dim."""
    lines = []
    launches = hopper_launches(DTYPES[dtype], head_dim, is_causal)
    for name, launch in launches.items():
        compiled = compile_for_gpu(launch.kernel, launch.args, launch.kwargs)
        code = cuobjdump(compiled, "-sass")
        usage = resource_usage(compiled)
        digest = hashlib.sha256(code.encode()).hexdigest()[:16]
        n_instructions = sum(1 for line in code.splitlines() if line.strip().startswith("/*") and ";" in line)
        tag = f"{name}_d{head_dim}_{dtype}{'_causal' if is_causal else ''}"
        lines.append(f"{tag:26s} sass {digest} instructions {n_instructions:5d} regs {usage.registers:3d} "
                     f"spill {usage.spill_bytes} shared {usage.shared_bytes}")
        if save_dir:
            with open(os.path.join(save_dir, f"{tag}.sass"), "w") as f:
                f.write(code + "\n")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(hopper.HEAD_DIMS),
                        help="head dims (default: every one the backward runs; the forward at those it runs)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--causal", nargs="+", default=["true", "false"], choices=["true", "false"])
    parser.add_argument("--save-dir", default=None, help="also write each kernel's SASS to DIR/<kernel>.sass")
    args = parser.parse_args(argv)
    if args.save_dir:
        os.makedirs(args.save_dir, exist_ok=True)
    for head_dim in sorted(args.head_dims):
        for dtype in args.dtypes:
            for causal in args.causal:
                print("\n".join(fingerprint_lines(head_dim, dtype, causal == "true", args.save_dir)), flush=True)


if __name__ == "__main__":
    main()
