"""Timing and memory measurement shared by the benchmarks: synchronisation, timed calls and their
statistics, peak memory, and the device's measured matmul rate (the ceiling MFU is stated against)."""

from __future__ import annotations

import contextlib
import statistics
import timeit
from collections.abc import Callable, Iterator
from typing import Any

import torch


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def summarize_ms(seconds: list[float], prefix: str = "") -> dict[str, float]:
    """Mean, standard deviation, median, min and max of ``seconds``, in milliseconds."""
    ms = [s * 1e3 for s in seconds]
    if not ms:
        return {}
    return {
        f"{prefix}mean_ms": statistics.fmean(ms),
        f"{prefix}std_ms": statistics.stdev(ms) if len(ms) > 1 else 0.0,
        f"{prefix}median_ms": statistics.median(ms),
        f"{prefix}min_ms": min(ms),
        f"{prefix}max_ms": max(ms),
    }


def time_calls(fn: Callable[[], Any], warmup: int, steps: int, device: torch.device | str | None = None) -> list[float]:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then ``steps`` timed ones, each synchronised."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(steps):
        start = timeit.default_timer()
        fn()
        synchronize(device)
        times.append(timeit.default_timer() - start)
    return times


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, float]]:
    """Yields a dict that holds, on exit, ``peak_gb``: the peak allocated device memory inside the block."""
    result: dict[str, float] = {}
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    yield result
    if device.type == "cuda":
        synchronize(device)
        result["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9


def measure_matmul_tflops(device: torch.device, n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The device's measured dense matmul rate (TFLOP/s) on an ``n^3`` product of random ``dtype`` matrices.

    MFU is stated against this measured rate rather than a datasheet number. None on a CPU.
    """
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_calls(lambda: a @ b, warmup=3, steps=10, device=device)
    return 2 * n**3 / statistics.median(seconds) / 1e12
