"""A data-parallel training step of the language model under one of our DDP wrappers (or PyTorch's), timed
with the communication it exposes: shared by ``ddp_benchmarking`` and ``optimizer_state_sharding_accounting``."""

from __future__ import annotations

import argparse
import timeit

import torch
from torch import nn

from cs336_basics.nn_utils import cross_entropy
from cs336_systems.bench.common import timing
from cs336_systems.bench.common.lm import autocast
from cs336_systems.parallel.ddp import bucket_size_mb, variant_type, wrap_ddp

LOCAL = "local"  # the model unwrapped: the compute-only reference
# The variants measured by default (any DDP variant name is accepted: see cs336_systems.parallel.ddp.variants).
VARIANTS = ["naive", "flat", "overlap", "bucketed_1mb", "bucketed_10mb", "bucketed_100mb", "bucketed_1000mb",
            "torch_ddp"]


_local_or_variant = variant_type(LOCAL)


def variant_name(name: str) -> str:
    """argparse type: ``local`` or a DDP variant's name, a bucketed one's cap above 0 MiB."""
    if bucket_size_mb(name) == 0:
        raise argparse.ArgumentTypeError(f"{name}: N of bucketed_<N>mb is the bucket cap in MiB and must be above 0")
    return _local_or_variant(name)


def wrap(variant: str, model: nn.Module) -> nn.Module:
    """``model`` inside the data-parallel wrapper that ``variant`` names (itself for ``local``)."""
    return model if variant == LOCAL else wrap_ddp(variant, model)


def communication_calls(variant: str, wrapped: nn.Module) -> int | None:
    """All-reduce calls per step (``n_b`` of the overhead model); None where PyTorch decides."""
    if variant == LOCAL:
        return 0
    if hasattr(wrapped, "buckets"):
        return len(wrapped.buckets)
    if variant == "flat":
        return len({(p.dtype, p.device) for p in wrapped.trainable_parameters()})
    if variant in ("naive", "overlap"):
        return len(wrapped.trainable_parameters())
    return None


class Marker:
    """Points in a rank's step on the device timeline (CUDA events), or wall-clock times on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return timeit.default_timer()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        """Milliseconds between two marks (after the device has passed both)."""
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def make_train_step(wrapped: nn.Module, optimizer, batch, dtype: torch.dtype | None, marker: Marker):
    """A training step ``step(update=True) -> (mark after backward, mark after gradient synchronisation)``.

    ``update=False`` stops before ``optimizer.step()``. The phases are ``record_function`` ranges, so a
    profiler trace shows them on the timeline.
    """
    x, y = batch
    finish = getattr(wrapped, "finish_gradient_synchronization", None)
    start = getattr(wrapped, "on_train_batch_start", None)

    def step(update: bool = True):
        if start is not None:
            start()
        optimizer.zero_grad(set_to_none=True)
        with torch.profiler.record_function("forward"), autocast(x.device, dtype):
            loss = cross_entropy(wrapped(x), y)
        with torch.profiler.record_function("backward"):
            loss.backward()
        after_backward = marker.mark()
        with torch.profiler.record_function("finish_gradient_synchronization"):
            if finish is not None:
                finish()
        after_sync = marker.mark()
        if update:
            with torch.profiler.record_function("optimizer"):
                optimizer.step()
        return after_backward, after_sync

    return step


def time_steps(step, device: torch.device, marker: Marker, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """This rank's step times and gradient-synchronisation times (ms) of ``steps`` steps after ``warmup``."""
    step_ms, sync_ms = [], []
    for i in range(warmup + steps):
        timing.synchronize(device)
        start = timeit.default_timer()
        marks = step()
        timing.synchronize(device)
        if i >= warmup:
            step_ms.append((timeit.default_timer() - start) * 1e3)
            sync_ms.append(marker.elapsed_ms(*marks))
    return step_ms, sync_ms
