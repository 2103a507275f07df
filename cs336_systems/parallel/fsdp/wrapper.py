"""The FSDP module: hooks that move each unit through its states (:mod:`.state`) over a transport (:mod:`.transport`).

Forward. The original parameters are deleted from their modules; while a unit runs, each module attribute
(``linear.weight``) is a plain tensor, a view of the unit's gathered flat buffer ``unit.full`` (in the compute
dtype), produced by one autograd Function (:class:`GatheredParams`) per unit call, so autograd hands all the unit's
weight gradients to one backward. Before a unit runs (forward pre-hook) its buffer is all-gathered in ONE collective
from the shard (cast to ``compute_dtype`` first: half the bytes travel in bf16), and the gather of the unit
predicted next (the order of the previous forward; registration order at first) is issued before this unit
computes. After the unit's forward the buffer's storage is resized to 0: the views autograd saved stay valid
objects, and the storage is filled again before the unit's backward. The last unit of the forward stays gathered
(its backward comes next), and so does the root unit until its gradients are reduced.

Backward. A hook on each unit call's outputs fires before the unit's backward: it gathers the unit again (already
prefetched, normally) and prefetches the unit that ran before it in forward. Units whose saved tensors do not touch
their weights (an embedding's lookup) are not gathered again: a saved-tensor pack hook records, during forward,
whether anything saved lives in a gathered buffer. When all the unit's parameter gradients exist (the Function's
backward), they are cast to fp32 into one flat buffer and reduce-scattered (averaged) into this rank's slice, which
lands in the shard's ``.grad``; the gathered buffer is freed. :meth:`FSDP.finish_gradient_synchronization` waits
for what is in flight.

Memory. Gathered at once: in forward the running unit and the next one (in flight), in backward the unit whose
backward runs, the previous one (prefetched) and, briefly, the one just finished: ~2-3 units, plus the root unit.
Units holding frozen parameters stay gathered from their backward gather to the end of backward (the Function's
backward, which frees a unit, does not wait for frozen weights' last use).

Activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=False)`` inside the wrapped module:
``BasicsTransformerLM.set_activation_checkpointing``, or a caller wrapping blocks itself). Inside a checkpointed
region autograd saves nothing of the unit, so the pack hook sees no saved tensor and the unit is marked as needing
its weights in backward (it will be recomputed). In backward, recomputation calls the unit's modules again: the
pre-hook gathers the unit (usually prefetched already), installs fresh views (through the same Function, so the
recomputed operations save what the original ones did) and keeps the buffer until the unit's gradients are
reduced. A checkpointed group of ``g`` blocks therefore holds up to ``g`` gathered units during its backward.
Reentrant checkpointing is rejected (its recomputed graph is the one backpropagated).

Profiling. ``FSDP.annotate = True`` records profiler ranges named after each unit: ``fsdp.all_gather <unit>``
around a gather's launch, ``fsdp.use <unit>`` where its gathered weights become available to compute (forward and
backward), ``fsdp.reduce_scatter <unit>`` around a reduction's launch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function
from torch.optim.optimizer import register_optimizer_step_pre_hook

from cs336_systems.parallel.distributed import require_process_group
from cs336_systems.parallel.fsdp.state import Call, Grads, Phase, Step, Weights
from cs336_systems.parallel.fsdp.transport import DEFAULT_GRADIENT_MEMORY, Transport, make_transport
from cs336_systems.parallel.fsdp.units import (
    ShardLayout,
    Unit,
    UnitSpec,
    accumulate_grad,
    add_gradients,
    build_units,
    check_units,
    default_units,
    flat_gradients,
)

REDUCTIONS_IN_FLIGHT = 2  # reductions left running before the compute stream waits for the oldest
# Profiler range names (FSDP.annotate): a gather's launch, the moment its unit's weights are in use, a
# reduction's launch; each followed by the unit's name (``cs336_systems.bench.common.timeline`` reads them).
GATHER_RANGE, USE_RANGE, REDUCE_RANGE = "fsdp.all_gather ", "fsdp.use ", "fsdp.reduce_scatter "


class GatheredParams(torch.autograd.Function):
    """``shard -> views of the gathered flat buffer`` (one per original parameter) for autograd: the backward
    receives all the unit's weight gradients at once and hands them to the reduction."""

    @staticmethod
    def forward(ctx, trainable: Tensor | None, fsdp: FSDP, unit: Unit, call: Call | None) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.fsdp, ctx.unit, ctx.call = fsdp, unit, call
        views = tuple(unit.full[p.offset : p.stop].view(p.shape) for p in unit.params)
        ctx.mark_non_differentiable(*(v for v, p in zip(views, unit.params) if not p.requires_grad))
        return views

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        ctx.fsdp._on_unit_gradients(ctx.unit, ctx.call, grads)
        return None, None, None, None


def _tensors(value: Any) -> Iterable[Tensor]:
    """The tensors in a module's output (nested tuples, lists and dicts)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (nested tuples, lists and dicts) cast to ``dtype``."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: cast_floating(item, dtype) for key, item in value.items()}
    return value


def _unpack(tensor: Tensor) -> Tensor:
    """A saved tensor, about to be read by backward. Only a view of a gathered buffer can have lost its storage: the
    unit's gradients were reduced and its buffer freed, so this is a second backward through one forward."""
    if tensor.numel() and not tensor.untyped_storage().nbytes():
        raise RuntimeError(
            "a second backward through the same FSDP forward is not supported: the gathered weights it needs were "
            "freed after the first backward (backward(retain_graph=True) cannot be repeated); run the forward again"
        )
    return tensor


_REPLACED = "_replaced_by_fsdp"  # set on each parameter FSDP took out of a module (the module's shards train)


def _refuse_replaced_parameters(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """An optimizer step pre-hook, registered for every optimizer once FSDP exists: stepping parameters that FSDP
    replaced would silently train nothing (they get no gradient)."""
    for group in optimizer.param_groups:
        if any(getattr(param, _REPLACED, False) for param in group["params"]):
            raise RuntimeError(
                f"{type(optimizer).__name__} holds parameters of a module that FSDP has since wrapped: FSDP replaced "
                "them with its shards. Build the optimizer after wrapping, from the FSDP module's parameters()"
            )


_step_hook: Any = None


class FSDP(nn.Module):
    """Fully sharded data parallel wrapper around ``module`` (see :mod:`cs336_systems.parallel.fsdp`).

    ``compute_dtype`` (e.g. ``torch.bfloat16``): every unit's parameters are cast to it before they are
    gathered, and the module computes with them; floating-point inputs of the forward are cast to it too. The shards
    (master weights), the optimizer update and the shards' gradients stay fp32. Without it everything is fp32.

    ``units``: submodules (or tuples of submodules) that each form one unit; default :func:`default_units`.
    ``transport``: how collectives travel (default: chosen from the device and the default process group's backend;
    the tests pass one that needs no process group). ``gradient_memory``: on a GPU under NCCL, which stream's
    memory holds the reduced gradient shards (``reduce_stream`` or ``compute_stream``; see
    :class:`~cs336_systems.parallel.fsdp.transport.CudaStreamTransport`).

    Limits: every rank must call the same units in the same order; one backward per forward (a second one raises);
    call :meth:`finish_gradient_synchronization` after every backward (a repeated call does nothing); build the
    optimizer after wrapping, from this module's ``parameters()`` (an optimizer holding the module's original
    parameters, which FSDP replaces with its shards, raises at its first step); move the module to its device before
    wrapping (``.to()`` afterwards would break the shard/parameter aliasing); a unit's output must not be a view of
    its parameters, and a trainable weight's saved uses must lead into its gradient (a ``weight.detach()`` saved for
    backward could outlive the buffer, which is freed once the unit's gradients are reduced).

    At construction every rank takes rank 0's parameters and buffers, then keeps its shards only.
    ``annotate = True`` records profiler ranges named after each unit (see the module docstring).
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 units: Sequence[UnitSpec] | None = None, *, transport: Transport | None = None,
                 gradient_memory: str = DEFAULT_GRADIENT_MEMORY):
        super().__init__()
        if transport is None:
            require_process_group("FSDP")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating-point dtype, got {compute_dtype}")
        params = list(module.parameters())
        if not params:
            raise ValueError("the module has no parameters to shard: FSDP needs at least one")
        self.device = params[0].device
        if any(p.device != self.device for p in params) or any(not p.is_floating_point() for p in params):
            raise ValueError("FSDP needs floating-point parameters, all on one device")
        self.module, self.compute_dtype, self.annotate = module, compute_dtype, False
        self.transport = make_transport(self.device, gradient_memory) if transport is None else transport
        self.world_size, self.rank = self.transport.world_size, self.transport.rank
        self.transport.broadcast_module(module)

        specs = check_units(module, default_units(module) if units is None else units)
        self._param_names = [name for name, _ in module.named_parameters()]
        layout = ShardLayout(self.world_size, self.rank, compute_dtype or torch.float32, self.device)
        self.units: list[Unit] = build_units(module, specs, layout)  # the root unit, if any, is last
        _watch_for_replaced_parameters(params)
        self.root: Unit | None = next((u for u in self.units if not u.modules), None)
        self.shards, self.frozen_shards = nn.ParameterDict(), nn.ParameterDict()
        self._unit_of: dict[nn.Module, Unit] = {}
        for unit in self.units:
            key = unit.name.replace(".", "/")
            if unit.param is not None:
                self.shards[key] = unit.param
            if unit.frozen is not None:
                self.frozen_shards[key] = unit.frozen
            for m in unit.modules:
                self._unit_of[m] = unit
                m.register_forward_pre_hook(self._pre_forward)
                m.register_forward_hook(self._post_forward)
        self._step = Step(order=[u for u in self.units if u is not self.root])

    def _range(self, prefix: str, unit: Unit) -> contextlib.AbstractContextManager:
        return record_function(prefix + unit.name) if self.annotate else contextlib.nullcontext()

    # Weights: gather, wait, free, install ------------------------------------------------------------

    def _gather(self, unit: Unit) -> None:
        """Start gathering ``unit``'s flat buffer unless it is gathered or on its way."""
        if unit.state.weights is Weights.SHARDED:
            with self._range(GATHER_RANGE, unit):
                unit.state.start_gather(self.transport.gather(unit.shard, unit.full))

    def _wait(self, unit: Unit) -> None:
        """Make ``unit``'s gathered buffer usable by what runs next on this (compute) stream."""
        if unit.state.weights is Weights.GATHERING:
            with self._range(USE_RANGE, unit):
                self.transport.wait_gather(unit.state.finish_gather())

    def _free(self, unit: Unit) -> None:
        if unit.state.weights is not Weights.SHARDED:
            handle = unit.state.free()
            if handle is not None:
                self.transport.drop_gather(handle)
            unit.full.untyped_storage().resize_(0)

    def _install(self, unit: Unit, call: Call | None) -> None:
        """Point the modules' attributes at views of the gathered buffer (through autograd)."""
        views = GatheredParams.apply(unit.param, self, unit, call)
        for flat_param, view in zip(unit.params, views):
            for sub, attribute in flat_param.slots:
                sub.__dict__[attribute] = view
        if call is not None and any(v.requires_grad for v in views):
            unit.state.pending_backward += 1

    @staticmethod
    def _uninstall(unit: Unit) -> None:
        for flat_param in unit.params:
            for sub, attribute in flat_param.slots:
                sub.__dict__.pop(attribute, None)

    # Forward ----------------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.compute_dtype is not None:  # fp32 activations would meet weights in the compute dtype
            inputs, kwargs = cast_floating(inputs, self.compute_dtype), cast_floating(kwargs, self.compute_dtype)
        self._begin_forward()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                output = self.module(*inputs, **kwargs)
        except BaseException:
            self._reset()
            raise
        self._end_forward()
        return output

    def _begin_forward(self) -> None:
        step, root = self._step, self.root
        if step.phase is Phase.BACKWARD:
            if step.backward_started or step.reductions:
                raise RuntimeError("call finish_gradient_synchronization() after backward, before the next forward")
            self._reset()  # the last forward's graph was dropped without a backward (evaluation with grad on)
        step.start_forward()
        if root is not None:
            self._gather(root)
        if step.order:
            self._gather(step.order[0])
        if root is not None:
            self._wait(root)
            self._install(root, Call(root, -1, step.generation, torch.is_grad_enabled()))

    def _end_forward(self) -> None:
        step = self._step
        for unit in self.units:
            if unit.state.weights is Weights.RUNNING:  # a unit of several modules not all called
                self._close(unit)
        step.end_forward(awaiting_backward=any(u.state.pending_backward for u in self.units))
        last = step.calls[-1] if step.calls else None
        keep = last.unit if step.phase is Phase.BACKWARD and last is not None and last.needs_gather else None
        for unit in self.units:
            if unit is not self.root and unit is not keep:  # a prefetch the forward did not use, or a unit
                self._free(unit)  # kept for a backward that will not come
        if step.phase is Phase.IDLE:
            self._reset()

    def _pack(self, tensor: Tensor) -> Tensor:
        self._step.packs += 1
        if self._step.live:
            call = self._step.live.get(tensor.untyped_storage().data_ptr())
            if call is not None:
                call.saved = True
        return tensor

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        if self._step.phase is Phase.IDLE:
            raise RuntimeError("a sharded unit was called outside FSDP.forward: call the FSDP wrapper, not its module")
        unit = self._unit_of[module]
        if unit.state.weights is not Weights.RUNNING:
            self._open(unit)
        unit.state.depth += 1

    def _open(self, unit: Unit) -> None:
        """Gather the unit, prefetch the one predicted next, wait, install the views: the unit runs."""
        step = self._step
        if step.phase is Phase.FORWARD:
            call = Call(unit, len(step.calls), step.generation, torch.is_grad_enabled(), step.packs)
            step.calls.append(call)
            self._gather(unit)
            following = step.predicted(call.position + 1)  # prefetched before this unit computes
        else:  # recomputation of a checkpointed region, during backward
            call = None
            self._gather(unit)
            following = step.predicted(step.order.index(unit) + 1) if unit in step.order else None
            if following is not None and following.state.pending_backward == 0:
                following = None  # its backward is over: it is not part of this recomputation
        if following is not None and following is not unit:
            self._gather(following)
        self._wait(unit)
        self._install(unit, call)
        unit.state.start_running(call)
        if call is not None:
            step.live[unit.full.untyped_storage().data_ptr()] = call

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        unit = self._unit_of[module]
        state = unit.state
        state.depth -= 1
        call = state.call
        if call is not None and call.grad_enabled:
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if len(tensors) == 1:
                tensors[0].register_hook(lambda grad, call=call: self._before_backward(call))
            elif tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads, call=call: self._before_backward(call), mode="any"
                )
        state.modules_done.add(id(module))
        if state.depth == 0 and len(state.modules_done) == len(unit.modules):
            self._close(unit)

    def _close(self, unit: Unit) -> None:
        self._uninstall(unit)
        call = unit.state.stop_running()
        if call is None:
            return  # recomputed: the buffer stays until the unit's gradients are reduced
        step = self._step
        step.live.pop(unit.full.untyped_storage().data_ptr(), None)
        # Nothing packed by our hook during a forward with grad: a checkpoint's hooks took the saved tensors,
        # so the unit will be recomputed in backward and needs its weights there.
        call.needs_gather = call.saved or (call.grad_enabled and step.packs == call.packs_at_open)
        last = call.position == len(step.order) - 1
        if not (last and call.needs_gather and unit.state.pending_backward):
            self._free(unit)

    # Backward ---------------------------------------------------------------------------------------

    def _before_backward(self, call: Call) -> None:
        """The gradient of a unit call's output exists: its backward is next. Gather it, prefetch the one before."""
        step = self._step
        if call.backward_seen or call.generation != step.generation or step.phase is not Phase.BACKWARD:
            return
        call.backward_seen = True
        step.backward_started = True
        if call.needs_gather:
            self._gather(call.unit)
            self._wait(call.unit)
        for previous in reversed(step.calls[: call.position]):
            if previous.needs_gather:
                self._gather(previous.unit)
                break

    def _on_unit_gradients(self, unit: Unit, call: Call | None, grads: tuple[Tensor | None, ...]) -> None:
        """The gradients of one call's weights: sum them; after the unit's last call, reduce and free."""
        if call is None:
            raise RuntimeError("FSDP supports activation checkpointing with use_reentrant=False only")
        if call.generation != self._step.generation:
            raise RuntimeError("backward through the graph of an earlier FSDP forward: "
                               "backward before the next forward")
        state = unit.state
        if state.pending_backward <= 0:
            raise RuntimeError("a second backward through the same FSDP forward is not supported")
        self._step.backward_started = True
        if state.grads is Grads.NONE:
            state.start_accumulating(flat_gradients(unit, grads))
        else:
            add_gradients(unit, state.accumulate(), grads)
        state.pending_backward -= 1
        if state.pending_backward == 0:
            if state.weights is Weights.RUNNING:  # a recomputation that checkpointing stopped early (no post-hook)
                self._close(unit)
            self._launch_reduction(unit)
            if not unit.keeps_gathered:
                self._free(unit)

    def _launch_reduction(self, unit: Unit) -> None:
        flat = unit.state.start_reduce()
        with self._range(REDUCE_RANGE, unit):
            handle = self.transport.reduce(flat, unit.shard_numel, lambda reduced: accumulate_grad(unit, reduced))
        self._step.reductions.append((unit, handle))
        self._retire_reductions(keep=REDUCTIONS_IN_FLIGHT)

    def _retire_reductions(self, keep: int) -> None:
        """Complete the oldest reductions until at most ``keep`` are in flight (frees their inputs)."""
        while len(self._step.reductions) > keep:
            unit, handle = self._step.reductions.pop(0)
            self.transport.wait_reduce(handle)
            unit.state.finish_reduce()

    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduction in flight; afterwards each shard's ``.grad`` is fp32, averaged over ranks. Called
        again with no backward in between, it finds nothing in flight and does nothing."""
        for unit in self.units:  # a call whose output was not used: reduce what arrived
            if unit.state.pending_backward and unit.state.grads is Grads.ACCUMULATING:
                unit.state.pending_backward = 0
                self._launch_reduction(unit)
        self._reset()

    def _reset(self) -> None:
        """Back to idle: views removed, buffers freed, nothing in flight."""
        self._retire_reductions(keep=0)
        for unit in self.units:
            self._uninstall(unit)
            if unit.state.weights is Weights.RUNNING:
                unit.state.stop_running()
            self._free(unit)
            unit.state.drop_grads()
        self._step.to_idle()

    # Full parameters ----------------------------------------------------------------------------------

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, Tensor]:
        """Every parameter of the wrapped module by its original name, full and fp32 (fresh tensors; a
        collective: every rank must call it)."""
        return gather_full(self.units, self._param_names, self.transport, lambda unit: unit.shard)

    @torch.no_grad()
    def gather_full_grads(self) -> dict[str, Tensor | None]:
        """Every parameter's gradient, full like :meth:`gather_full_params` (None for frozen parameters and
        where no gradient exists; a collective, after :meth:`finish_gradient_synchronization`)."""
        return gather_full(self.units, self._param_names, self.transport, padded_grad)

    def gathered_units(self) -> list[str]:
        """Names of the units whose flat buffer is gathered (or on its way) now: for tests and debugging."""
        return [unit.name for unit in self.units if unit.state.weights is not Weights.SHARDED]


def _watch_for_replaced_parameters(params: list[nn.Parameter]) -> None:
    """Mark ``params`` as replaced, and make every optimizer refuse to step them from now on."""
    global _step_hook
    for param in params:
        setattr(param, _REPLACED, True)
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_refuse_replaced_parameters)


def padded_grad(unit: Unit) -> Tensor | None:
    """``(S,)`` fp32: the shard's gradient, zeros for its frozen part and padding (None without a gradient)."""
    if unit.param is None or unit.param.grad is None:
        return None
    padded = torch.zeros(unit.shard_numel, dtype=torch.float32, device=unit.shard.device)
    padded[: unit.param.numel()] = unit.param.grad
    return padded


def gather_full(units: list[Unit], names: list[str], transport: Transport,
                local: Callable[[Unit], Tensor | None]) -> dict[str, Tensor | None]:
    """Each parameter's full tensor by name (in ``names`` order), gathered from every rank's ``local(unit)``: the
    shard, or a tensor laid out like it (None: nothing to gather for that unit's parameters)."""
    full: dict[str, Tensor | None] = {}
    for unit in units:
        shard = local(unit)
        if shard is None:
            full.update((p.name, None) for p in unit.params)
            continue
        buffer = transport.all_gather(shard.contiguous(), unit.full.numel())
        for p in unit.params:
            full[p.name] = buffer[p.offset : p.stop].view(p.shape) if shard is unit.shard or p.requires_grad else None
    return {name: full[name] for name in names}
