"""Fully sharded data parallel (FSDP) for ``cs336_basics`` models (SPEC section 6, the course's 2026 ``fsdp``).

``FSDP(module, compute_dtype=None)`` shards the ``weight`` of every ``cs336_basics`` :class:`Linear` and
:class:`Embedding` (a *unit*) along dim 0: with ``W`` ranks, the weight of ``rows`` rows is padded to
``W * ceil(rows / W)`` rows and rank ``r`` keeps rows ``[r s, (r + 1) s)`` (``s = ceil(rows / W)``) as an fp32
parameter of its own, registered under the weight's name, so ``named_parameters()`` yields shard-shaped
parameters and any optimizer steps only the shard. Every other parameter (the RMSNorm gains) is replicated.

One training step, seen from a unit:

* forward: its full weight is all-gathered (cast to ``compute_dtype`` first, so half the bytes travel in
  bf16), asynchronously and ahead of use: the gather of the ``i``-th unit call starts when call ``i - 2`` has
  finished its forward, which bounds the gathered weights alive at once to about three. The forward runs the
  unit's own code on the gathered weight, which is then freed: autograd's saved reference to it is replaced
  by a placeholder (``torch.autograd.graph.saved_tensors_hooks``).
* backward: when autograd unpacks the placeholder, the weight is gathered again (and the gather of the unit
  needed next in backward is started). Once the gradient of the full weight exists, it is cast to fp32 and
  reduce-scattered, asynchronously, to the ranks that own its rows.
* replicated parameters: their gradients are all-gathered from a post-accumulate-grad hook and averaged.

``finish_gradient_synchronization()`` (after backward, before ``optimizer.step()``) waits for everything still
in flight; afterwards every parameter has an fp32 gradient of its own shape, averaged over the ranks.

Reduction order, and why fp32 training is bit-identical to one process. Data-parallel training computes the
gradient of the mean loss over the full batch as the average of per-rank gradients, each the gradient of the
mean loss over that rank's slice. One process computing the full batch in one backward sums all tokens inside
one matmul, in an order no split of the batch can reproduce, so bit-identity is only possible against the
same computation done in one process: gradient accumulation over the ranks' slices in rank order
(``g = ((g_0 + g_1) + g_2) ...``, autograd's own accumulation), then ``g / W``. The collectives here
reproduce that order exactly: a reduce-scatter is an all-to-all (rank ``j`` receives every rank's rows of its
shard) followed by a local sum in rank order, and a replicated gradient's all-reduce is an all-gather
followed by the same sum (a ring reduce-scatter or all-reduce adds in an order that depends on the chunk,
which changes the bits for 3+ ranks). The bytes sent equal a ring reduce-scatter's; the receive buffer is one
full-size gradient per reduction in flight. The optimizer updates are elementwise, so stepping the shards of
a weight gives the rows of the full step. ``tests/test_fsdp.py`` checks this with ``torch.equal``.

Limits: every rank must call the same units in the same order (as for any FSDP); units called twice are
fine (their gradients are summed before the reduce-scatter). Call ``finish_gradient_synchronization`` after
every backward. Activation checkpointing inside the wrapped module is not supported.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from jaxtyping import Float
from torch import Tensor, nn
from torch.autograd.profiler import record_function

from cs336_basics.model import Embedding, Linear
from cs336_systems.parallel.ddp.base import broadcast_module_state

SHARDED_TYPES = (Linear, Embedding)
WEIGHT = "weight"  # the attribute of a unit that is sharded
PREFETCH_DISTANCE = 2  # forward: gather unit call i once call i - 2 has finished
REDUCTIONS_IN_FLIGHT = 2  # reductions left running before the oldest is completed (bounds receive buffers)
# Profiler range names (FSDP.annotate): a gather's launch, the moment its weight is in use, a reduction's launch.
GATHER_RANGE, USE_RANGE, REDUCE_RANGE = "fsdp.all_gather ", "fsdp.use ", "fsdp.reduce_scatter "


@dataclass(eq=False)
class ShardedWeight:
    """One sharded weight: the rank's fp32 shard (an optimizer-visible parameter) and the full layout."""

    name: str  # the name of the full weight in the wrapped module
    param: nn.Parameter  # (shard_rows, *rest) fp32: rows [rank * shard_rows, (rank + 1) * shard_rows) of the padded weight
    full_shape: torch.Size  # (rows, *rest), unpadded
    world_size: int
    uses_in_flight: int = 0  # forward uses whose gradient has not arrived yet
    grad_sum: Tensor | None = None  # (padded_rows, *rest) fp32: gradients of the uses that arrived, summed

    @property
    def rows(self) -> int:
        return self.full_shape[0]

    @property
    def shard_rows(self) -> int:
        return self.param.shape[0]

    @property
    def padded_shape(self) -> torch.Size:
        return torch.Size((self.shard_rows * self.world_size, *self.full_shape[1:]))


@dataclass(eq=False)
class _Gather:
    """An all-gather of one weight in flight: the padded full weight arrives in ``buffer``."""

    buffer: Tensor  # (padded_rows, *rest) in the compute dtype
    source: Tensor  # the cast shard being sent (kept alive until the gather completes)
    work: dist.Work | None

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.buffer


@dataclass(eq=False)
class _UnitCall:
    """One forward call of a unit, and what its backward needs."""

    unit: nn.Module
    weight: ShardedWeight
    previous: _UnitCall | None = None  # the call before it (in forward order) that saved its weight for backward
    saved: int = 0  # placeholders autograd holds for this call's weight
    unpacked: int = 0
    backward_gather: _Gather | None = None  # the weight gathered again for backward (prefetched or on demand)
    backward_buffer: Tensor | None = None  # held until every placeholder has been unpacked


@dataclass(frozen=True, eq=False)
class _Placeholder:
    """Stands in for a saved view of a gathered weight; unpacking gathers the weight again."""

    call: _UnitCall
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass(eq=False)
class _Reduction:
    """A reduce-scatter in flight: every rank's gradient rows of this rank's shard arrive in ``received``."""

    weight: ShardedWeight
    sent: Tensor  # (padded_rows, *rest) fp32, kept alive until the all-to-all completes
    received: Tensor  # (world_size * shard_rows, *rest) fp32: chunk j is rank j's gradient of my rows
    work: dist.Work


@dataclass(eq=False)
class _ReplicatedReduction:
    param: nn.Parameter
    gathered: Tensor  # (world_size * param.numel(),): every rank's gradient, in rank order
    work: dist.Work


class _GatheredWeight(torch.autograd.Function):
    """``shard -> full weight`` for autograd: forward waits for the gather, backward hands the full
    weight's gradient to the reduce-scatter (the shard's ``.grad`` is set when that completes)."""

    @staticmethod
    def forward(ctx, shard: Tensor, gather: _Gather, call: _UnitCall, fsdp: FSDP) -> Tensor:
        ctx.call, ctx.fsdp = call, fsdp
        full = gather.wait()
        return full if full.shape[0] == call.weight.rows else full[: call.weight.rows]

    @staticmethod
    def backward(ctx, grad_full: Tensor):
        ctx.fsdp._on_full_gradient(ctx.call.weight, grad_full)
        return None, None, None, None


def _ordered_mean(chunks: Float[Tensor, "world ..."]) -> Float[Tensor, "..."]:
    """``((chunks[0] + chunks[1]) + chunks[2] + ...) / world``: the sum in rank order, as gradient
    accumulation over the ranks' micro-batches would compute it."""
    total = chunks[0].clone() if len(chunks) == 1 else chunks[0] + chunks[1]
    for chunk in chunks[2:]:
        total.add_(chunk)
    return total.div_(len(chunks))


class FSDP(nn.Module):
    """Fully sharded data parallel wrapper around ``module`` (see the module docstring).

    ``compute_dtype`` (e.g. ``torch.bfloat16``): the sharded weights are cast to it before they are
    gathered and the unit runs on the cast weight; the shards (master weights), the optimizer update and
    the shards' gradients stay fp32. Replicated parameters are not cast.

    At construction every rank takes rank 0's parameters and buffers, then keeps its shards only.

    ``annotate = True`` records profiler ranges named after each weight: ``fsdp.all_gather <name>`` around a
    gather's launch, ``fsdp.use <name>`` when its weight becomes available to compute (forward and backward),
    ``fsdp.reduce_scatter <name>`` around a reduction's launch (``cs336_systems.bench.common.timeline`` reads them).
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("FSDP needs an initialised default process group")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating-point dtype, got {compute_dtype}")
        self.module = module
        self.compute_dtype = compute_dtype
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        broadcast_module_state(module, src=0)

        self.sharded_weights: list[ShardedWeight] = []
        self._weight_of: dict[nn.Module, ShardedWeight] = {}
        self._order: list[nn.Module] = []  # units in the order the last forward called them
        for unit_name, unit in module.named_modules():
            if isinstance(unit, SHARDED_TYPES):
                self._shard_unit(unit_name, unit)
                self._order.append(unit)  # first guess: registration order; the first forward corrects it
                unit.register_forward_pre_hook(self._before_unit)
                unit.register_forward_hook(self._after_unit)
        sharded = {id(w.param) for w in self.sharded_weights}
        self.replicated_params = [p for p in module.parameters() if id(p) not in sharded]
        for param in self.replicated_params:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._on_replicated_gradient)

        self._in_forward = False
        self._calls: list[_UnitCall] = []  # this forward's unit calls, in order
        self._prefetched: dict[nn.Module, _Gather] = {}
        self._live: dict[int, _UnitCall] = {}  # storage pointer of a gathered weight in use -> its call
        self._last_saved: _UnitCall | None = None
        self._reductions: list[_Reduction] = []
        self._replicated_reductions: list[_ReplicatedReduction] = []
        self.annotate = False

    def _range(self, prefix: str, weight: ShardedWeight) -> contextlib.AbstractContextManager:
        return record_function(prefix + weight.name) if self.annotate else contextlib.nullcontext()

    # ------------------------------------------------------------------------------------------------
    # Sharding
    # ------------------------------------------------------------------------------------------------

    def _shard_unit(self, unit_name: str, unit: nn.Module) -> None:
        param = getattr(unit, WEIGHT)
        for existing in self.sharded_weights:  # a weight shared by several units is sharded once
            if existing.param is param:
                self._weight_of[unit] = existing
                return
        full = param.detach()
        shard_rows = math.ceil(full.shape[0] / self.world_size)
        shard = torch.zeros((shard_rows, *full.shape[1:]), dtype=torch.float32, device=full.device)
        start, stop = self.rank * shard_rows, min((self.rank + 1) * shard_rows, full.shape[0])
        if stop > start:
            shard[: stop - start].copy_(full[start:stop])
        weight = ShardedWeight(
            name=f"{unit_name}.{WEIGHT}" if unit_name else WEIGHT,
            param=nn.Parameter(shard, requires_grad=param.requires_grad),
            full_shape=full.shape,
            world_size=self.world_size,
        )
        # Every unit holding the full parameter (a tied weight) gets the shard.
        for other in self.module.modules():
            if isinstance(other, SHARDED_TYPES) and getattr(other, WEIGHT) is param:
                setattr(other, WEIGHT, weight.param)
                self._weight_of[other] = weight
        self.sharded_weights.append(weight)

    def _start_gather(self, weight: ShardedWeight) -> _Gather:
        source = weight.param.detach()
        if self.compute_dtype is not None:
            source = source.to(self.compute_dtype)
        buffer = torch.empty(weight.padded_shape, dtype=source.dtype, device=source.device)
        with self._range(GATHER_RANGE, weight):
            work = dist.all_gather_into_tensor(buffer, source, async_op=True)
        return _Gather(buffer=buffer, source=source, work=work)

    # ------------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._reductions or self._replicated_reductions:
            raise RuntimeError("call finish_gradient_synchronization() after backward, before the next forward")
        self._in_forward, self._calls, self._last_saved = True, [], None
        for position in range(PREFETCH_DISTANCE):
            self._prefetch(position)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                output = self.module(*inputs, **kwargs)
        finally:
            self._end_forward()
        if isinstance(output, Tensor) and output.requires_grad and self._last_saved is not None:
            last = self._last_saved
            output.register_hook(lambda grad: self._prefetch_for_backward(last))
        return output

    def _end_forward(self) -> None:
        self._in_forward = False
        for unit in self._weight_of:  # only after an error inside a unit: the full weight is still installed
            unit.__dict__.pop(WEIGHT, None)
        self._live.clear()
        if self._calls:
            self._order = [call.unit for call in self._calls]
        for gather in self._prefetched.values():  # gathered for a call that did not happen this time
            gather.wait()
        self._prefetched.clear()

    def _prefetch(self, position: int) -> None:
        if position < len(self._order):
            unit = self._order[position]
            if unit not in self._prefetched:
                self._prefetched[unit] = self._start_gather(self._weight_of[unit])

    def _before_unit(self, unit: nn.Module, args: tuple) -> None:
        if not self._in_forward:
            raise RuntimeError("a sharded unit was called outside FSDP.forward: call the FSDP wrapper, not its module")
        weight = self._weight_of[unit]
        call = _UnitCall(unit=unit, weight=weight)
        self._calls.append(call)
        gather = self._prefetched.pop(unit, None) or self._start_gather(weight)
        gather.wait()
        with self._range(USE_RANGE, weight):
            full = _GatheredWeight.apply(weight.param, gather, call, self)
        if full.requires_grad:
            weight.uses_in_flight += 1
        self._live[full.untyped_storage().data_ptr()] = call
        # An instance attribute shadows the registered (shard) parameter, so the unit's own forward code
        # reads the full weight; named_parameters() and the optimizer still see the shard.
        unit.__dict__[WEIGHT] = full

    def _after_unit(self, unit: nn.Module, args: tuple, output: Any) -> None:
        full = unit.__dict__.pop(WEIGHT)
        self._live.pop(full.untyped_storage().data_ptr(), None)
        self._prefetch(len(self._calls) - 1 + PREFETCH_DISTANCE)

    def _pack(self, tensor: Tensor) -> Any:
        if not self._live:
            return tensor
        call = self._live.get(tensor.untyped_storage().data_ptr())
        if call is None:
            return tensor
        if call.saved == 0:
            call.previous, self._last_saved = self._last_saved, call
        call.saved += 1
        return _Placeholder(call, tensor.size(), tensor.stride(), tensor.storage_offset())

    # ------------------------------------------------------------------------------------------------
    # Backward
    # ------------------------------------------------------------------------------------------------

    def _prefetch_for_backward(self, call: _UnitCall | None) -> None:
        if call is not None and call.backward_gather is None and call.backward_buffer is None:
            call.backward_gather = self._start_gather(call.weight)

    def _unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _Placeholder):
            return saved
        call = saved.call
        if call.backward_buffer is None:
            self._prefetch_for_backward(call)
            self._prefetch_for_backward(call.previous)  # the next unit backward will need
            gather, call.backward_gather = call.backward_gather, None
            call.backward_buffer = gather.wait()
            with self._range(USE_RANGE, call.weight):
                pass
        buffer = call.backward_buffer
        call.unpacked += 1
        if call.unpacked % call.saved == 0:  # autograd now holds the views it needs
            call.backward_buffer = None
        return buffer.as_strided(saved.size, saved.stride, saved.offset)

    def _on_full_gradient(self, weight: ShardedWeight, grad: Tensor) -> None:
        """Sum the gradient of one use of ``weight``; after its last use, launch the reduce-scatter."""
        weight.uses_in_flight -= 1
        last_use = weight.uses_in_flight == 0
        if weight.grad_sum is None:
            if last_use and grad.dtype == torch.float32 and grad.shape == weight.padded_shape and grad.is_contiguous():
                weight.grad_sum = grad  # the common case: sent as it is, no copy
            else:
                weight.grad_sum = grad.new_zeros(weight.padded_shape, dtype=torch.float32)
                weight.grad_sum[: weight.rows].copy_(grad)
        else:
            weight.grad_sum[: weight.rows].add_(grad)
        if last_use:
            self._launch_reduction(weight)

    def _launch_reduction(self, weight: ShardedWeight) -> None:
        sent, weight.grad_sum = weight.grad_sum, None
        received = torch.empty_like(sent)
        with self._range(REDUCE_RANGE, weight):
            work = dist.all_to_all_single(received, sent, async_op=True)
        self._reductions.append(_Reduction(weight=weight, sent=sent, received=received, work=work))
        self._complete_reductions(keep=REDUCTIONS_IN_FLIGHT)

    def _complete_reductions(self, keep: int) -> None:
        """Complete the oldest reductions until at most ``keep`` are in flight (frees their buffers)."""
        while len(self._reductions) > keep:
            reduction = self._reductions.pop(0)
            reduction.work.wait()
            weight = reduction.weight
            chunks = reduction.received.view(self.world_size, weight.shard_rows, *weight.full_shape[1:])
            grad = _ordered_mean(chunks)
            if weight.param.grad is None:
                weight.param.grad = grad
            else:
                weight.param.grad.add_(grad)

    def _on_replicated_gradient(self, param: nn.Parameter) -> None:
        grad = param.grad.contiguous().view(-1)
        gathered = grad.new_empty(self.world_size * grad.numel())  # gloo wants the ranks' tensors concatenated on dim 0
        work = dist.all_gather_into_tensor(gathered, grad, async_op=True)
        self._replicated_reductions.append(_ReplicatedReduction(param=param, gathered=gathered, work=work))

    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduction in flight; afterwards each parameter holds its averaged fp32 gradient."""
        for weight in self.sharded_weights:  # a use whose gradient never arrived (its output was unused)
            if weight.grad_sum is not None:
                weight.uses_in_flight = 0
                self._launch_reduction(weight)
            weight.uses_in_flight = 0
        self._complete_reductions(keep=0)
        for reduction in self._replicated_reductions:
            reduction.work.wait()
            chunks = reduction.gathered.view(self.world_size, *reduction.param.shape)
            reduction.param.grad.copy_(_ordered_mean(chunks))
        self._replicated_reductions.clear()
        self._last_saved = None

    # ------------------------------------------------------------------------------------------------
    # Full parameters
    # ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, Tensor]:
        """Every parameter of the wrapped module by its name there, unsharded and unpadded, in fp32 for the
        sharded ones (a collective: every rank must call it)."""
        return self._gather_full(lambda param: param)

    @torch.no_grad()
    def gather_full_grads(self) -> dict[str, Tensor | None]:
        """Every parameter's gradient, unsharded like :meth:`gather_full_params` (None where there is none;
        a collective: every rank must call it after :meth:`finish_gradient_synchronization`)."""
        return self._gather_full(lambda param: param.grad)

    def _gather_full(self, tensor_of) -> dict[str, Tensor | None]:
        sharded = {id(weight.param): weight for weight in self.sharded_weights}
        full = {}
        for name, param in self.module.named_parameters():
            tensor, weight = tensor_of(param), sharded.get(id(param))
            if tensor is None or weight is None:
                full[name] = None if tensor is None else tensor.detach().clone()
                continue
            buffer = torch.empty(weight.padded_shape, dtype=tensor.dtype, device=tensor.device)
            dist.all_gather_into_tensor(buffer, tensor.detach().contiguous())
            full[name] = buffer if weight.rows == buffer.shape[0] else buffer[: weight.rows].clone()
        return full

    def sharded_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, shard)`` of every sharded weight."""
        for weight in self.sharded_weights:
            yield weight.name, weight.param
