"""What a cold first call of our attention operator costs: run in a fresh process with an empty Triton cache
(``TRITON_CACHE_DIR`` pointed at a new folder), it times forward + backward at one shape (compiling every
kernel), then at several unseen sequence lengths (nothing new to compile with fixed tiles), and prints JSON.

    TRITON_CACHE_DIR=$(mktemp -d) python scripts/flash_cold_start.py --d-head 64 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def fwd_bwd_seconds(attention, batch: int, heads: int, seq: int, d: int, dtype: torch.dtype) -> float:
    q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    torch.cuda.synchronize()
    start = time.perf_counter()
    attention(q, k, v, True).sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-head", type=int, default=64)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--lengths", nargs="+", type=int, default=[1000, 3000, 5000, 7777, 12345, 20000])
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    start = time.perf_counter()
    from cs336_systems.attention import get_attention

    attention = get_attention("triton")
    import_s = time.perf_counter() - start
    first = fwd_bwd_seconds(attention, 1, 4, 512, args.d_head, dtype)
    unseen = {n: fwd_bwd_seconds(attention, 1, 4, n, args.d_head, dtype) for n in args.lengths}
    print(json.dumps(dict(d_head=args.d_head, dtype=args.dtype, import_s=import_s, first_call_s=first,
                          unseen_length_call_s=unseen, gpu=torch.cuda.get_device_name())))


if __name__ == "__main__":
    main()
