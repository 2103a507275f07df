"""Development probe (not a results CLI): the float32 split over keys (forward) and over sweeps (backward) against
the plain kernels at the same shapes: GPU time of each kernel (torch.profiler), each path's wall time per call
(CUDA events, median) and its issue cost (calls without synchronisation, microseconds a call).

    python scripts/flash_split_probe.py [--shapes 32:1024 128:4096 ...]
"""

from __future__ import annotations

import argparse
import math
import statistics
import timeit

import torch
from torch.profiler import ProfilerActivity, profile

from cs336_systems.attention.backends import triton as tb


def wall_ms(call, repeats: int = 50) -> float:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def issue_us(call, calls: int = 100) -> float:
    torch.cuda.synchronize()
    start = timeit.default_timer()
    for _ in range(calls):
        call()
    elapsed = (timeit.default_timer() - start) / calls * 1e6
    torch.cuda.synchronize()
    return elapsed


def kernel_us(call) -> dict[str, float]:
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
    return {e.key[:40]: e.device_time_total / 10 for e in prof.key_averages() if e.device_time_total > 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["32:1024", "32:4096", "64:1024", "128:1024", "128:4096",
                                                         "128:8192"])
    args = parser.parse_args()
    for shape in args.shapes:
        d, n = map(int, shape.split(":"))
        Q, K, V, dO = (torch.randn(1, n, d, device="cuda") for _ in range(4))
        scale = 1 / math.sqrt(d)
        O, L = tb.forward(Q, K, V, True, scale)
        splits = tb.forward_key_splits(Q, K, True), tb.backward_splits(Q, K)
        print(f"## d={d} n={n} forward splits {splits[0]}, backward parts {splits[1]}")
        paths = {
            "fwd plain": lambda: _plain_forward(Q, K, V, scale),
            "fwd split": lambda: tb.forward(Q, K, V, True, scale),
            "bwd plain": lambda: _plain_backward(Q, K, V, O, L, dO, scale),
            "bwd split": lambda: tb.backward(Q, K, V, O, L, dO, True, scale),
        }
        for name, call in paths.items():
            kernels = kernel_us(call)
            print(f"{name}: wall {wall_ms(call):.3f} ms, issue {issue_us(call):.0f} us, kernels "
                  + ", ".join(f"{k} {v:.0f}us" for k, v in kernels.items()))


def _plain_forward(Q, K, V, scale):
    saved = tb.forward_key_splits
    tb.forward_key_splits = lambda *a: 1
    try:
        return tb.forward(Q, K, V, True, scale)
    finally:
        tb.forward_key_splits = saved


def _plain_backward(Q, K, V, O, L, dO, scale):
    saved = tb.backward_splits
    tb.backward_splits = lambda *a: 1
    try:
        return tb.backward(Q, K, V, O, L, dO, True, scale)
    finally:
        tb.backward_splits = saved


if __name__ == "__main__":
    main()
