"""Fingerprint the Hopper Gluon kernels (``cs336_systems/attention/backends/hopper_kernels.py``) on a machine without a GPU:
compile the forward and the backward for sm_90 (bf16, causal, head dims 64 and 128, the shapes of
``tests/test_flash_hopper.py``) and print per kernel a hash of its SASS, its registers, spills and shared memory.
A refactor that should not change the generated code is checked by comparing this output before and after.

    python scripts/flash_hopper_sass.py [--head-dims 64 128] [--save-dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cs336_systems.attention.backends import hopper  # noqa: E402
from tests._flash_aot import compile_for_gpu, cuobjdump, resource_usage  # noqa: E402


def launches(head_dim: int, dtype: torch.dtype, is_causal: bool) -> dict[str, tuple]:
    """``name -> (kernel, args, kwargs)`` of the forward and the backward on CPU tensors (nothing runs)."""
    batch, heads, n_queries, n_keys = 2, 3, 1000, 777  # the forward's keys: n_queries, as in the test
    scale = 1 / math.sqrt(head_dim)
    Q, K, V, O = (torch.empty(batch, heads, n_queries, head_dim, dtype=dtype) for _ in range(4))
    L = torch.empty(batch * heads, n_queries)
    launch = hopper.forward_launch(Q, K, V, O, L, is_causal, scale)
    result = {f"fwd_d{head_dim}": (launch.kernel, launch.args, launch.kwargs)}
    Q, dO = (torch.empty(batch, heads, n_queries, head_dim, dtype=dtype) for _ in range(2))
    K, V, dK, dV = (torch.empty(batch, heads, n_keys, head_dim, dtype=dtype) for _ in range(4))
    L, Delta = (torch.empty(batch * heads, n_queries) for _ in range(2))
    DQ_acc = torch.empty(batch * heads, n_queries, head_dim)
    launch = hopper.backward_launch(Q, K, V, dO, L, Delta, dK, dV, DQ_acc, is_causal, scale)
    result[f"bwd_d{head_dim}"] = (launch.kernel, launch.args, launch.kwargs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--not-causal", action="store_true")
    parser.add_argument("--save-dir", default=None,
                        help="also write each kernel's SASS and TTGIR to DIR/<kernel>.sass and .ttgir")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.save_dir:
        os.makedirs(args.save_dir, exist_ok=True)
    for head_dim in args.head_dims:
        for name, (kernel, launch_args, kwargs) in launches(head_dim, dtype, not args.not_causal).items():
            compiled = compile_for_gpu(kernel, launch_args, kwargs)
            code = cuobjdump(compiled, "-sass")
            usage = resource_usage(compiled)
            digest = hashlib.sha256(code.encode()).hexdigest()[:16]
            n_instructions = sum(1 for line in code.splitlines() if line.strip().startswith("/*") and ";" in line)
            print(f"{name:8s} sass {digest} instructions {n_instructions:5d} regs {usage.registers:3d} "
                  f"spill {usage.spill_bytes} shared {usage.shared_bytes}")
            if args.save_dir:
                with open(os.path.join(args.save_dir, f"{name}.sass"), "w") as f:
                    f.write(code + "\n")
                with open(os.path.join(args.save_dir, f"{name}.ttgir"), "w") as f:
                    f.write(compiled.asm["ttgir"])


if __name__ == "__main__":
    main()
