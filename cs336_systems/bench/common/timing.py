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


def _do_bench_samples(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> list[float]:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")


def _timer_loop(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> list[float]:
    """``do_bench``'s budget on a CPU: one call, an estimate from three, then warm-up and timed calls."""
    fn()
    estimate_ms = 1e3 * min(time_calls(fn, warmup=0, steps=3))
    n_warmup = max(1, int(warmup_ms / max(estimate_ms, 1e-3)))
    n_repeat = max(1, min(1000, int(rep_ms / max(estimate_ms, 1e-3))))
    return [1e3 * s for s in time_calls(fn, warmup=n_warmup, steps=n_repeat)]


def do_bench_ms(
    fn: Callable[[], Any], device: torch.device, warmup_ms: float, rep_ms: float, prefix: str = ""
) -> dict[str, float]:
    """``{prefix}ms`` (the mean, do_bench's default), ``{prefix}median_ms``, ``{prefix}p20_ms``,
    ``{prefix}p80_ms``, ``{prefix}min_ms`` and the sample count ``{prefix}samples`` of ``fn``'s latency."""
    times = _do_bench_samples(fn, warmup_ms, rep_ms) if device.type == "cuda" else _timer_loop(fn, warmup_ms, rep_ms)
    return summarize_samples_ms(times, prefix)


def summarize_samples_ms(times_ms: list[float], prefix: str = "") -> dict[str, float]:
    """Statistics of latency samples in ms as ``do_bench`` rows hold them: the mean (``{prefix}ms``, do_bench's
    default), median, 20th/80th percentiles, minimum and the sample count."""
    ordered = sorted(times_ms)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        f"{prefix}ms": statistics.fmean(ordered),
        f"{prefix}median_ms": statistics.median(ordered),
        f"{prefix}p20_ms": quantile(0.2),
        f"{prefix}p80_ms": quantile(0.8),
        f"{prefix}min_ms": ordered[0],
        f"{prefix}samples": len(ordered),
    }


def do_bench_on_ranks(fn, warmup_ms: float, rep_ms: float, device: torch.device) -> float:
    """``triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms)`` (mean ms), step for step, except that the
    ranks agree on the runtime estimate (its maximum) before deriving the warm-up and repetition counts: with
    each rank's own estimate, one rank could run a step more than the other and wait for it forever."""
    import torch.distributed as dist
    from triton import runtime

    driver = runtime.driver.active
    fn()
    torch.cuda.synchronize(device)
    cache = driver.get_empty_cache_for_benchmark()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        driver.clear_cache(cache)
        fn()
    end.record()
    torch.cuda.synchronize(device)
    estimate = torch.tensor([start.elapsed_time(end) / 5], device=device)
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
    n_warmup = max(1, int(warmup_ms / estimate.item()))
    n_repeat = max(1, int(rep_ms / estimate.item()))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    for _ in range(n_warmup):
        fn()
    for i in range(n_repeat):
        driver.clear_cache(cache)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return sum(times) / len(times)
