"""How FSDP's collectives travel: one interface, two transports, chosen once per wrapper (:func:`make_transport`).

* :class:`CudaStreamTransport` (GPU under NCCL). Gathers run on a gather stream and reduce-scatters on a reduction
  stream, each on its own process group (one NCCL communicator runs its collectives one after another; two let a
  reduce-scatter overlap the next gather). A gather first waits for the compute stream (the optimizer may have
  written the shard, and a buffer freed on the CPU may still be read by queued kernels: the allocator hands its
  block to the next gather only once the gather stream has caught up), then records an event that the compute
  stream waits for before the unit runs. A reduction waits for the compute stream (the gradients) and records an
  event; its fp32 input (allocated on the compute stream) is kept until the compute stream has waited for that
  event, which bounds the gradient buffers in flight.
* :class:`GlooTransport` (gloo, or a GPU without NCCL): the collectives are asynchronous ``Work`` objects, waited
  for at the same points.

Both implement :class:`Transport`: issue a gather, wait for it (or drop it before its buffer is freed), issue a
reduce-scatter of the mean, wait for it; plus what construction and full-parameter gathers need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from jaxtyping import Float
from torch import Tensor, nn

from cs336_systems.parallel.distributed import broadcast_module_state

# Backend -> whether reduce_scatter_tensor(op=AVG) works there (gloo gained it late; probed on first use).
NATIVE_MEAN_REDUCE_SCATTER: dict[str, bool] = {"nccl": True}

Deliver = Callable[[Float[Tensor, " S"]], None]  # receives this rank's slice of the mean, where it may be read


@dataclass(eq=False)
class MeanReduceScatter:
    """A :func:`reduce_scatter_mean` in flight; :meth:`wait` leaves the mean in its output."""

    work: dist.Work | None
    finish: Callable[[], None] | None = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.finish is not None:
            self.finish()
            self.finish = None


def reduce_scatter_mean(
    output: Float[Tensor, " S"], input: Float[Tensor, " WS"], group=None, async_op: bool = False
) -> MeanReduceScatter:
    """``output = mean over ranks of input[rank * S : (rank + 1) * S]``.

    One ``reduce_scatter_tensor(op=AVG)`` where the backend has it (NCCL; gloo in recent PyTorch). Elsewhere:
    a SUM all-reduce of ``input`` in place, then this rank's chunk divided by the world size (the same
    values, W times the bytes received). Without ``async_op`` the result is there on return.
    """
    backend = dist.get_backend(group)
    if NATIVE_MEAN_REDUCE_SCATTER.get(backend, True):
        try:
            work = dist.reduce_scatter_tensor(output, input, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
        except RuntimeError:
            if backend == "nccl":
                raise
            NATIVE_MEAN_REDUCE_SCATTER[backend] = False  # every rank fails alike: same backend, same version
        else:
            NATIVE_MEAN_REDUCE_SCATTER[backend] = True
            return MeanReduceScatter(work)
    world_size, rank, size = dist.get_world_size(group), dist.get_rank(group), output.numel()
    work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    chunk = input[rank * size : (rank + 1) * size]
    handle = MeanReduceScatter(work, finish=lambda: torch.div(chunk, world_size, out=output))
    if not async_op:
        handle.wait()
    return handle


class Transport(Protocol):
    """What FSDP asks of the process group. Handles are the transport's own; FSDP only hands them back."""

    rank: int
    world_size: int

    def broadcast_module(self, module: nn.Module) -> None:
        """Every rank takes rank 0's parameters and buffers."""

    def gather(self, shard: Float[Tensor, " S"], full: Tensor) -> Any:
        """Allocate ``full``'s storage and start gathering every rank's shard into it, cast to ``full.dtype``."""

    def wait_gather(self, handle: Any) -> None:
        """Make the gathered buffer usable by what runs next on the compute stream."""

    def drop_gather(self, handle: Any) -> None:
        """A gather never waited for: its buffer is about to be freed."""

    def reduce(self, flat: Float[Tensor, " WS"], shard_numel: int, deliver: Deliver) -> Any:
        """Start the mean reduce-scatter of ``flat``; ``deliver`` gets this rank's slice when it may be read."""

    def wait_reduce(self, handle: Any) -> None:
        """Complete a reduction (``deliver`` has run, and the compute stream may use its result)."""

    def all_gather(self, shard: Tensor, numel: int) -> Tensor:
        """Every rank's ``shard`` end to end (``numel`` elements), now: a blocking collective."""


class _ProcessGroupTransport:
    """What both transports share: the default process group's rank and size, construction, blocking gathers."""

    def __init__(self) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def broadcast_module(self, module: nn.Module) -> None:
        broadcast_module_state(module, src=0)

    def all_gather(self, shard: Tensor, numel: int) -> Tensor:
        buffer = torch.empty(numel, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(buffer, shard)
        return buffer


def _allocate(full: Tensor) -> None:
    full.untyped_storage().resize_(full.numel() * full.element_size())


@dataclass(eq=False)
class _StreamReduction:
    event: torch.cuda.Event
    input: Tensor  # (W * S,) fp32: kept until the compute stream has waited for the event
    output: Tensor  # (S,) fp32


GRADIENT_MEMORY = ("reduce_stream", "compute_stream")
"""Where :class:`CudaStreamTransport` allocates a reduction's output, the fp32 gradient shard the optimizer reads."""
DEFAULT_GRADIENT_MEMORY = "compute_stream"
"""The default of every ``gradient_memory`` argument (see :class:`CudaStreamTransport`)."""


def check_gradient_memory(gradient_memory: str) -> None:
    if gradient_memory not in GRADIENT_MEMORY:
        raise ValueError(f"unknown gradient_memory {gradient_memory!r}; choose one of {', '.join(GRADIENT_MEMORY)}")


class CudaStreamTransport(_ProcessGroupTransport):
    """GPU under NCCL: a gather stream and a reduction stream, each with its own communicator.

    ``gradient_memory``: where a reduction's output (which becomes the shard's ``.grad``) is allocated. The
    caching allocator keeps freed memory for the stream that allocated it, and serves another stream from it only
    after freeing its cache, which synchronises the device. ``reduce_stream``: on the reduction stream, so the
    gradients' memory, freed after the optimizer step, stays reserved for the next backward's reductions;
    ``compute_stream``: on the compute stream before the reduction starts (the compute stream waits for the
    reduction before it reads or frees the output), so the next forward's activations can reuse it."""

    def __init__(self, device: torch.device, gradient_memory: str = DEFAULT_GRADIENT_MEMORY) -> None:
        super().__init__()
        check_gradient_memory(gradient_memory)
        self.device, self.gradient_memory = device, gradient_memory
        self.reduce_group = dist.new_group()
        self.gather_stream = torch.cuda.Stream(device)
        self.reduce_stream = torch.cuda.Stream(device)

    def gather(self, shard: Tensor, full: Tensor) -> torch.cuda.Event:
        self.gather_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.gather_stream):
            source = shard.to(full.dtype)
            _allocate(full)  # allocated on the gather stream
            # .data: an alias with a version counter of its own, so that refilling a buffer whose views autograd
            # saved is not taken for an in-place change of those views.
            dist.all_gather_into_tensor(full.data, source)
            return self.gather_stream.record_event()

    def wait_gather(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def drop_gather(self, event: torch.cuda.Event) -> None:
        pass  # the buffer's block returns to the gather stream, which reuses it only after the gather

    def reduce(self, flat: Tensor, shard_numel: int, deliver: Deliver) -> _StreamReduction:
        output = None
        if self.gradient_memory == "compute_stream":
            output = torch.empty(shard_numel, dtype=torch.float32, device=self.device)
        self.reduce_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.reduce_stream):
            if output is None:
                output = torch.empty(shard_numel, dtype=torch.float32, device=self.device)
            reduce_scatter_mean(output, flat, group=self.reduce_group)
            deliver(output)  # stream-ordered after the reduction
            return _StreamReduction(self.reduce_stream.record_event(), flat, output)

    def wait_reduce(self, reduction: _StreamReduction) -> None:
        torch.cuda.current_stream(self.device).wait_event(reduction.event)


@dataclass(eq=False)
class _WorkGather:
    work: dist.Work
    tensors: tuple[Tensor, ...]  # the source and the output, alive until the work is done


@dataclass(eq=False)
class _WorkReduction:
    handle: MeanReduceScatter
    input: Tensor
    output: Tensor
    deliver: Deliver


class GlooTransport(_ProcessGroupTransport):
    """Asynchronous ``Work`` objects (gloo; any backend without CUDA streams to overlap on)."""

    def gather(self, shard: Tensor, full: Tensor) -> _WorkGather:
        source = shard.to(full.dtype)
        _allocate(full)
        output = full.data  # see CudaStreamTransport.gather
        return _WorkGather(dist.all_gather_into_tensor(output, source, async_op=True), (source, output))

    def wait_gather(self, gather: _WorkGather) -> None:
        gather.work.wait()

    def drop_gather(self, gather: _WorkGather) -> None:
        gather.work.wait()  # gloo writes into the buffer from its own thread

    def reduce(self, flat: Tensor, shard_numel: int, deliver: Deliver) -> _WorkReduction:
        output = torch.empty(shard_numel, dtype=torch.float32, device=flat.device)
        return _WorkReduction(reduce_scatter_mean(output, flat, async_op=True), flat, output, deliver)

    def wait_reduce(self, reduction: _WorkReduction) -> None:
        reduction.handle.wait()
        reduction.deliver(reduction.output)


def make_transport(device: torch.device, gradient_memory: str = DEFAULT_GRADIENT_MEMORY) -> Transport:
    """CUDA streams for a GPU under NCCL (``gradient_memory``: see :class:`CudaStreamTransport`), asynchronous
    work objects otherwise."""
    check_gradient_memory(gradient_memory)
    if device.type == "cuda" and dist.get_backend() == "nccl":
        return CudaStreamTransport(device, gradient_memory)
    return GlooTransport()
