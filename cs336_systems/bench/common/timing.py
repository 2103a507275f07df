"""Timing and memory measurement shared by the benchmarks: synchronisation, timed calls and their
statistics, replays of a captured CUDA graph over rotating inputs, each kernel's GPU time in a profile, peak memory,
and the device's measured matmul rate (the ceiling MFU is stated against)."""

from __future__ import annotations

import collections
import contextlib
import math
import statistics
import timeit
from collections.abc import Callable, Iterator, Sequence
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


def kernel_times_ms(events: Sequence[Any], per: int = 1) -> tuple[collections.Counter, collections.Counter]:
    """Each GPU kernel's time (ms) and launches among ``torch.profiler`` events (``prof.events()``), divided by
    ``per`` (the profiled calls or steps). Annotations of host ranges, which the profiler mirrors on the GPU's
    timeline, are not kernels."""
    ms, launches = collections.Counter(), collections.Counter()
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation:
            ms[event.name] += event.device_time / 1e3 / per
            launches[event.name] += 1 / per
    return ms, launches


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


class GraphCaptureError(RuntimeError):
    """An operation that cannot be timed from a CUDA graph: no CUDA device, or capture refused it (a host
    synchronisation, an allocation or a stream that capture does not allow)."""


def rotation_count(set_bytes: int, l2_bytes: int, factor: float = 2.0, fewest: int = 2, most: int = 64) -> int:
    """How many independent input sets of ``set_bytes`` each a timed loop rotates through so that every call reads
    memory that left the L2 cache since its last use: enough sets to span ``factor`` times the L2 (``l2_bytes``),
    at least ``fewest`` and at most ``most``."""
    return max(fewest, min(most, math.ceil(factor * l2_bytes / max(set_bytes, 1))))


def rounds_for(call_ms: float, sets: int, target_ms: float = 2.0, most_calls: int = 2048) -> int:
    """Rounds over ``sets`` input sets one captured graph holds so that a replay lasts about ``target_ms``, given
    ``call_ms`` per call: at least one round, and at most ``most_calls`` calls (capture runs each on the host)."""
    wanted = math.ceil(target_ms / max(call_ms * sets, 1e-6))
    return max(1, min(wanted, most_calls // sets))


def per_call_ms(replay_ms: list[float], calls: int) -> list[float]:
    """Each replay's time divided over the ``calls`` calls it holds."""
    return [ms / calls for ms in replay_ms]


def l2_cache_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def _run_rounds(fn_of_input: Callable[[Any], Any], inputs: Sequence[Any], rounds: int) -> None:
    for _ in range(rounds):
        for one in inputs:
            fn_of_input(one)  # the outputs are dropped at once: in capture their memory is reused by the next call


def _captured(fn_of_input: Callable[[Any], Any], inputs: Sequence[Any], rounds: int,
              stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            _run_rounds(fn_of_input, inputs, rounds)
    except RuntimeError as error:
        if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
            raise
        raise GraphCaptureError(f"CUDA graph capture failed: {str(error).splitlines()[0][:300]}") from error
    return graph


def _replay_times_ms(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def captured_graph(fn: Callable[[], Any], device: torch.device, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of ``fn``, captured after ``warmup`` eager calls on a side stream (compilation, the
    allocator's warm-up): for providers kept as graphs and timed in turns (:func:`replay_mean_ms`). Raises
    :class:`GraphCaptureError` where capture fails."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return _captured(lambda _: fn(), [None], 1, stream)


def replay_mean_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """The mean time of ``replays`` back-to-back replays of ``graph`` (after one untimed), ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def graph_replay_ms(fn_of_input: Callable[[Any], Any], inputs: Sequence[Any], device: torch.device,
                    replays: int = 15, target_replay_ms: float = 2.0) -> dict[str, float]:
    """Device time per call of ``fn_of_input(one input set)``, without the host's time between calls.

    ``inputs``: K independent input sets (see :func:`rotation_count`), so that consecutive calls read memory not in
    L2 without flushing it. The calls run eagerly first on a side stream (compilation, autotuning, the allocator's
    warm-up), then R rounds over the K sets are captured in one CUDA graph (R from a one-round graph's replay time,
    see :func:`rounds_for`), replayed twice untimed and ``replays`` times between CUDA events. Returns the
    statistics of :func:`summarize_samples_ms` of replay time / (R·K), with ``calls_per_replay`` (R·K) and
    ``input_sets`` (K). Raises :class:`GraphCaptureError` where capture fails or there is no CUDA device.
    """
    if device.type != "cuda":
        raise GraphCaptureError("CUDA graphs need a CUDA device")
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        _run_rounds(fn_of_input, inputs, 2)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = _captured(fn_of_input, inputs, 1, stream)
    call_ms = statistics.median(_replay_times_ms(graph, 3)) / len(inputs)
    rounds = rounds_for(call_ms, len(inputs), target_replay_ms)
    if rounds > 1:
        graph.reset()  # its memory pool goes before the larger graph is captured
        graph = _captured(fn_of_input, inputs, rounds, stream)
    _replay_times_ms(graph, 2)
    calls = rounds * len(inputs)
    times = per_call_ms(_replay_times_ms(graph, replays), calls)
    graph.reset()
    return {**summarize_samples_ms(times), "calls_per_replay": calls, "input_sets": len(inputs)}
