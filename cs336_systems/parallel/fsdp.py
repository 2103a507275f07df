"""Fully sharded data parallel (FSDP) by blocks (SPEC section 6, the course's 2026 ``fsdp``).

``FSDP(module, compute_dtype=None, units=None)`` shards the parameters of ``module`` over the ranks of the
default process group one *unit* at a time: by default each ``TransformerBlock``, each ``Embedding``, and the
final norm with the LM head (:func:`default_units`). A unit's parameters are one flat fp32 buffer; each rank keeps
its slice as one optimizer-visible parameter (:class:`Unit`). Before a unit runs its buffer is all-gathered in one
collective (in ``compute_dtype`` when given), the next unit's gather already issued; after use it is freed,
gathered again for backward, and its gradients are reduce-scattered (averaged) in one collective
(:meth:`FSDP._open`, :meth:`FSDP._before_backward`, :meth:`FSDP._on_unit_gradients`). What one step's hooks
share lives in one :class:`_Step`. Notes on streams, memory and activation checkpointing stand where the code
does them.

fp32 training matches one process only to float tolerance: the ranks sum their own tokens, then the collective
sums the ranks' partial sums, while one process sums all tokens in one matmul (``python
scripts/fsdp_equality_demo.py``; ``tests/test_fsdp.py`` compares to tolerance).
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from jaxtyping import Float
from torch import Tensor, nn
from torch.autograd.profiler import record_function

from cs336_basics.model import Embedding, TransformerBlock
from cs336_systems.parallel.ddp.base import broadcast_module_state
from cs336_systems.parallel.distributed import require_process_group

REDUCTIONS_IN_FLIGHT = 2  # reductions left running before the compute stream waits for the oldest
ROOT_KEY = "_root"  # the root unit's key in FSDP.shards
# Profiler range names (FSDP.annotate): a gather's launch, the moment its unit's weights are in use, a
# reduction's launch; each followed by the unit's name (``cs336_systems.bench.common.timeline`` reads them).
GATHER_RANGE, USE_RANGE, REDUCE_RANGE = "fsdp.all_gather ", "fsdp.use ", "fsdp.reduce_scatter "

UnitSpec = nn.Module | Sequence[nn.Module]


# ---------------------------------------------------------------------------------------------------
# The reduce-scatter of a mean, with a fallback
# ---------------------------------------------------------------------------------------------------

# Backend -> whether reduce_scatter_tensor(op=AVG) works there (gloo gained it late; probed on first use).
_NATIVE_MEAN_REDUCE_SCATTER: dict[str, bool] = {"nccl": True}


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
    if _NATIVE_MEAN_REDUCE_SCATTER.get(backend, True):
        try:
            work = dist.reduce_scatter_tensor(output, input, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
        except RuntimeError:
            if backend == "nccl":
                raise
            _NATIVE_MEAN_REDUCE_SCATTER[backend] = False  # every rank fails alike: same backend, same version
        else:
            _NATIVE_MEAN_REDUCE_SCATTER[backend] = True
            return MeanReduceScatter(work)
    world_size, rank, size = dist.get_world_size(group), dist.get_rank(group), output.numel()
    work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    chunk = input[rank * size : (rank + 1) * size]
    handle = MeanReduceScatter(work, finish=lambda: torch.div(chunk, world_size, out=output))
    if not async_op:
        handle.wait()
    return handle


# ---------------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------------


def default_units(module: nn.Module) -> list[UnitSpec]:
    """Every ``TransformerBlock`` and ``Embedding`` (outermost ones), and ``(ln_final, lm_head)`` when the
    module has both: for ``BasicsTransformerLM`` the token embedding, each block, the final norm with the head.

    By default (:func:`default_units`) every ``TransformerBlock`` is a unit (``module.layers[i]`` of a
    ``BasicsTransformerLM``), and so is every ``Embedding`` (the token embedding); the final norm and the LM
    head (``ln_final``, ``lm_head``) form one unit together. ``units=`` names any other split: each entry is a
    submodule, or a tuple of submodules that form one unit. Every parameter not in a unit belongs to the *root*
    unit, and so does a parameter shared by two units (tied weights).
    """
    units: list[UnitSpec] = []
    inside: set[int] = set()  # ids of modules inside a unit already chosen
    for sub in module.modules():
        if sub is module or id(sub) in inside:
            continue
        if isinstance(sub, (TransformerBlock, Embedding, nn.Embedding)):
            units.append(sub)
            inside.update(id(m) for m in sub.modules())
    head = [getattr(module, name, None) for name in ("ln_final", "lm_head")]
    if all(isinstance(m, nn.Module) and id(m) not in inside for m in head):
        units.append(tuple(head))
    return units


@dataclass(eq=False)
class FlatParam:
    """One original parameter, a segment of its unit's flat buffer."""

    name: str  # its (first) name in the wrapped module
    slots: list[tuple[nn.Module, str]]  # every (module, attribute) that held it
    shape: torch.Size
    offset: int  # first element in the flat buffer
    requires_grad: bool

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclass(eq=False)
class _Call:
    """One forward call of a unit (the root's included), and what its backward needs."""

    unit: Unit
    position: int  # index in FSDP._calls (-1: the root)
    generation: int  # the forward it belongs to
    grad_enabled: bool
    packs_at_open: int = 0
    saved: bool = False  # autograd saved a view of the unit's gathered buffer
    needs_gather: bool = False  # the unit's weights must be gathered again for its backward
    backward_seen: bool = False


@dataclass(eq=False)
class _Gather:
    """An all-gather in flight: a CUDA event on the gather stream, or a CPU ``Work`` and its tensors."""

    event: torch.cuda.Event | None = None
    work: dist.Work | None = None
    tensors: tuple[Tensor, ...] = ()


@dataclass(eq=False)
class _Reduction:
    unit: Unit
    input: Tensor  # (W * S,) fp32, kept until the reduction is known complete
    output: Tensor  # (S,) fp32: this rank's slice of the mean
    event: torch.cuda.Event | None = None
    handle: MeanReduceScatter | None = None


@dataclass(eq=False)
class Unit:
    """A block of parameters sharded as one flat fp32 buffer.

    A unit's parameters (all of them: RMSNorm gains too), trainable ones first, then frozen ones,
    are laid end to end in one flat fp32 buffer of ``N`` elements, padded to ``W * S`` with ``S = ceil(N / W)``
    for ``W`` ranks; rank ``r`` keeps elements ``[r S, (r + 1) S)`` in ``unit.shard``. The optimizer sees ONE
    ``nn.Parameter`` per unit: the trainable part of the rank's slice, a 1-D view of ``unit.shard`` (registered
    as ``shards.<unit>``; frozen elements as ``frozen_shards.<unit>``, ``requires_grad=False``). One parameter per
    unit keeps the optimizer's loop short (50 parameters on the xl model instead of 435), any elementwise
    ``torch.optim.Optimizer`` works on it (``cs336_basics``' AdamW included), and the padding is never stepped.
    The price: per-parameter optimizer options (no weight decay on gains, say) cannot be expressed, and the
    wrapped module has no parameters of its own left. :meth:`FSDP.gather_full_params` returns every original
    parameter by its original name, full and fp32.
    """

    name: str
    modules: tuple[nn.Module, ...]  # () for the root unit
    params: list[FlatParam]  # trainable ones first, then frozen ones
    trainable_numel: int  # T: elements [0, T) of the flat buffer are trainable
    numel: int  # N: parameters' elements; the flat buffer holds W * S >= N
    shard: Tensor  # (S,) fp32: this rank's slice of the flat buffer
    param: nn.Parameter | None  # shard[:t]: the trainable part of the slice (None if T == 0)
    frozen: nn.Parameter | None  # the frozen part of the slice (None without frozen parameters)
    full: Tensor  # (W * S,) compute dtype; its storage is resized to 0 when not gathered
    # The state of one step.
    gather: _Gather | None = None  # in flight
    ready: bool = False  # gathered and waited for
    is_open: bool = False  # its forward (or recomputation) is running, its views are installed
    open_call: _Call | None = None
    depth: int = 0
    modules_done: set[int] = field(default_factory=set)
    pending_backward: int = 0  # forward calls whose gradients have not arrived
    grad_flat: Tensor | None = None  # (W * S,) fp32: the gradients that arrived, summed

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()

    @property
    def allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    @property
    def keeps_gathered(self) -> bool:
        """Frozen weights may be read after the last trainable gradient arrived: kept to the end of backward."""
        return self.frozen is not None


class _GatheredParams(torch.autograd.Function):
    """``shard -> views of the gathered flat buffer`` (one per original parameter) for autograd: the backward
    receives all the unit's weight gradients at once and hands them to the reduction."""

    @staticmethod
    def forward(ctx, trainable: Tensor | None, fsdp: FSDP, unit: Unit, call: _Call | None) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.fsdp, ctx.unit, ctx.call = fsdp, unit, call
        views = tuple(unit.full[p.offset : p.stop].view(p.shape) for p in unit.params)
        ctx.mark_non_differentiable(*(v for v, p in zip(views, unit.params) if not p.requires_grad))
        return views

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        ctx.fsdp._on_unit_gradients(ctx.unit, ctx.call, grads)
        return None, None, None, None


class _Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"  # between a forward that needs a backward and finish_gradient_synchronization


@dataclass(eq=False)
class _Step:
    """What the hooks of one training step share, from the wrapper's forward to ``finish_gradient_synchronization``:
    IDLE -> (:meth:`start_forward`) FORWARD -> (:meth:`end_forward`) BACKWARD or IDLE -> (:meth:`to_idle`) IDLE."""

    order: list[Unit]  # the last forward's unit calls: which unit to prefetch next
    phase: _Phase = _Phase.IDLE
    generation: int = 0  # which forward: a hook of an earlier one's graph is stale
    calls: list[_Call] = field(default_factory=list)  # this forward's unit calls, in order
    root_call: _Call | None = None
    live: dict[int, _Call] = field(default_factory=dict)  # storage of a gathered buffer in use in forward -> its call
    packs: int = 0  # tensors autograd saved so far (counted by the pack hook)
    backward_started: bool = False
    reductions: list[_Reduction] = field(default_factory=list)  # in flight, oldest first

    def start_forward(self) -> None:
        self.generation += 1
        self.calls = []
        self.phase = _Phase.FORWARD

    def end_forward(self, awaiting_backward: bool) -> None:
        if self.calls:
            self.order = [call.unit for call in self.calls]
        self.phase = _Phase.BACKWARD if awaiting_backward else _Phase.IDLE

    def to_idle(self) -> None:
        self.live.clear()
        self.root_call = None
        self.phase, self.backward_started = _Phase.IDLE, False


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


class FSDP(nn.Module):
    """Fully sharded data parallel wrapper around ``module`` (see the module docstring).

    ``compute_dtype`` (e.g. ``torch.bfloat16``): every unit's parameters are cast to it before they are
    gathered, and the module computes with them; the shards (master weights), the optimizer update and the
    shards' gradients stay fp32. Without it everything is fp32.

    ``units``: submodules (or tuples of submodules) that each form one unit; default :func:`default_units`.

    Limits: every rank must call the same units in the same order; one forward per backward; call
    :meth:`finish_gradient_synchronization` after every backward; move the module to its device before wrapping
    (``.to()`` afterwards would break the shard/parameter aliasing); a unit's output must not be a view of its
    parameters, and a trainable weight's saved uses must lead into its gradient (a ``weight.detach()`` saved for
    backward could outlive the buffer, which is freed once the unit's gradients are reduced).

    At construction every rank takes rank 0's parameters and buffers, then keeps its shards only.

    ``annotate = True`` records profiler ranges named after each unit: ``fsdp.all_gather <unit>`` around a
    gather's launch, ``fsdp.use <unit>`` where its gathered weights become available to compute (forward and
    backward), ``fsdp.reduce_scatter <unit>`` around a reduction's launch.
    """

    def __init__(
        self, module: nn.Module, compute_dtype: torch.dtype | None = None, units: Sequence[UnitSpec] | None = None
    ):
        super().__init__()
        require_process_group("FSDP")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating-point dtype, got {compute_dtype}")
        params = list(module.parameters())
        if not params:
            raise ValueError("the module has no parameters to shard")
        self.device = params[0].device
        if any(p.device != self.device for p in params) or any(not p.is_floating_point() for p in params):
            raise ValueError("FSDP needs floating-point parameters, all on one device")
        self.module = module
        self.compute_dtype = compute_dtype
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.annotate = False
        broadcast_module_state(module, src=0)

        specs = self._check_units(module, default_units(module) if units is None else units)
        self._param_names = [name for name, _ in module.named_parameters()]
        self.units: list[Unit] = []  # the root unit, if any, is last
        self.root: Unit | None = None
        self._unit_of: dict[nn.Module, Unit] = {}
        self.shards = nn.ParameterDict()
        self.frozen_shards = nn.ParameterDict()
        self._build_units(module, specs)

        # GPU under NCCL: side streams, and a second communicator so that reductions overlap gathers.
        self._streams = self.device.type == "cuda" and dist.get_backend() == "nccl"
        self._gather_group = None  # the default group
        self._reduce_group = dist.new_group() if self._streams else None
        if self._streams:
            self._gather_stream = torch.cuda.Stream(self.device)
            self._reduce_stream = torch.cuda.Stream(self.device)

        self._step = _Step(order=[u for u in self.units if u is not self.root])

    # ------------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------------

    @staticmethod
    def _check_units(module: nn.Module, units: Sequence[UnitSpec]) -> list[tuple[str, tuple[nn.Module, ...]]]:
        """``(name, modules)`` per unit; submodules of ``module`` only, none in two units, none nested."""
        names = {id(m): name for name, m in module.named_modules()}
        specs, owner = [], {}  # owner: id of a unit's module -> the unit's index
        for index, spec in enumerate(units):
            members = (spec,) if isinstance(spec, nn.Module) else tuple(spec) if isinstance(spec, Sequence) else ()
            if not members or not all(isinstance(m, nn.Module) for m in members):
                raise ValueError(f"unit {index} must be a module or a non-empty sequence of modules, got {spec!r}")
            for member in members:
                if member is module:
                    raise ValueError("the wrapped module itself cannot be a unit (its own parameters form the root unit)")
                if id(member) not in names:
                    raise ValueError(f"unit {index}: {type(member).__name__} is not a submodule of the wrapped module")
                if owner.setdefault(id(member), index) != index:
                    raise ValueError(f"{names[id(member)]} is in units {owner[id(member)]} and {index}")
            specs.append(("+".join(names[id(m)] for m in members), members))
        # Submodules may be shared (the blocks' rotary embedding); a unit's module inside another's may not.
        for index, (_, members) in enumerate(specs):
            for member in members:
                for sub in member.modules():
                    if sub is not member and owner.get(id(sub), index) != index:
                        raise ValueError(f"unit {owner[id(sub)]} ({names[id(sub)]}) is nested inside unit {index}")
        return specs

    def _build_units(self, module: nn.Module, specs: list[tuple[str, tuple[nn.Module, ...]]]) -> None:
        slots: dict[int, list[tuple[nn.Module, str]]] = {}  # id(param) -> every (module, attribute) holding it
        claims: dict[int, set[int]] = {}  # id(param) -> units whose modules hold it (-1: outside every unit)
        units_of_module: dict[int, set[int]] = {}  # a submodule shared by units is in several
        for i, (_, members) in enumerate(specs):
            for member in members:
                for sub in member.modules():
                    units_of_module.setdefault(id(sub), set()).add(i)
        for sub in module.modules():
            for attribute, param in sub._parameters.items():
                if param is not None:
                    slots.setdefault(id(param), []).append((sub, attribute))
                    claims.setdefault(id(param), set()).update(units_of_module.get(id(sub), {-1}))
        members: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(specs) + 1)]  # the root last
        for name, param in module.named_parameters():
            owners = claims[id(param)]
            members[next(iter(owners)) if len(owners) == 1 and -1 not in owners else len(specs)].append((name, param))
        for i, named in enumerate(members):
            if not named:
                continue  # a unit whose parameters all went to the root, or an empty root
            is_root = i == len(specs)
            name, modules = (ROOT_KEY, ()) if is_root else specs[i]
            unit = self._make_unit(name, modules, named, slots)
            self.units.append(unit)
            key = name.replace(".", "/")
            if unit.param is not None:
                self.shards[key] = unit.param
            if unit.frozen is not None:
                self.frozen_shards[key] = unit.frozen
            if is_root:
                self.root = unit
            for m in modules:
                self._unit_of[m] = unit
                m.register_forward_pre_hook(self._pre_forward)
                m.register_forward_hook(self._post_forward)

    @torch.no_grad()
    def _make_unit(self, name: str, modules: tuple[nn.Module, ...], named: list[tuple[str, nn.Parameter]],
                   slots: dict[int, list[tuple[nn.Module, str]]]) -> Unit:
        ordered = [(n, p) for n, p in named if p.requires_grad] + [(n, p) for n, p in named if not p.requires_grad]
        flat_params, offset = [], 0
        for param_name, param in ordered:
            flat_params.append(FlatParam(param_name, slots[id(param)], param.shape, offset, param.requires_grad))
            offset += param.numel()
        numel, world, rank = offset, self.world_size, self.rank
        trainable = sum(p.numel for p in flat_params if p.requires_grad)
        shard_numel = math.ceil(numel / world)
        flat = torch.zeros(world * shard_numel, dtype=torch.float32, device=self.device)
        for flat_param, (_, param) in zip(flat_params, ordered):
            flat[flat_param.offset : flat_param.stop].copy_(param.reshape(-1))
        shard = flat[rank * shard_numel : (rank + 1) * shard_numel].clone()
        trainable_here = min(max(trainable - rank * shard_numel, 0), shard_numel)
        params_here = min(max(numel - rank * shard_numel, 0), shard_numel)
        full = torch.empty(world * shard_numel, dtype=self.compute_dtype or torch.float32, device=self.device)
        full.untyped_storage().resize_(0)
        for flat_param in flat_params:  # the modules lose their parameters; views are installed while they run
            for sub, attribute in flat_param.slots:
                del sub._parameters[attribute]
        return Unit(
            name=name,
            modules=modules,
            params=flat_params,
            trainable_numel=trainable,
            numel=numel,
            shard=shard,
            param=nn.Parameter(shard[:trainable_here]) if trainable else None,
            frozen=nn.Parameter(shard[trainable_here:params_here], requires_grad=False) if numel > trainable else None,
            full=full,
        )

    def _range(self, prefix: str, unit: Unit) -> contextlib.AbstractContextManager:
        return record_function(prefix + unit.name) if self.annotate else contextlib.nullcontext()

    # ------------------------------------------------------------------------------------------------
    # Gathering and freeing
    # ------------------------------------------------------------------------------------------------

    def _issue_gather(self, unit: Unit) -> None:
        """Start gathering ``unit``'s flat buffer unless it is gathered or on its way."""
        # Streams (GPU, NCCL). Gathers run on a gather stream and reduce-scatters on a reduction stream, each on its
        # own process group (one NCCL communicator runs its collectives one after another; two let a reduce-scatter
        # overlap the next gather). A gather stream first waits for the compute stream (the optimizer may have written
        # the shard, and a buffer freed on the CPU may still be read by queued kernels: the allocator hands its block
        # to the next gather only once the gather stream has caught up), then records an event that the compute stream
        # waits for before the unit runs. A reduction waits for the compute stream (the gradients), records an event;
        # its fp32 input (allocated on the compute stream) is released once the compute stream has waited for that
        # event, two reductions later, which bounds the gradient buffers in flight. On the CPU (gloo) the collectives
        # are asynchronous ``Work`` objects, waited for at the same points.
        if unit.allocated:
            return
        storage_bytes = unit.full.numel() * unit.full.element_size()
        with self._range(GATHER_RANGE, unit):
            if self._streams:
                self._gather_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._gather_stream):
                    source = unit.shard if self.compute_dtype is None else unit.shard.to(self.compute_dtype)
                    unit.full.untyped_storage().resize_(storage_bytes)  # allocated on the gather stream
                    # .data: an alias with a version counter of its own, so that refilling a buffer whose
                    # views autograd saved is not taken for an in-place change of those views.
                    dist.all_gather_into_tensor(unit.full.data, source, group=self._gather_group)
                    unit.gather = _Gather(event=self._gather_stream.record_event())
            else:
                source = unit.shard if self.compute_dtype is None else unit.shard.to(self.compute_dtype)
                unit.full.untyped_storage().resize_(storage_bytes)
                output = unit.full.data
                work = dist.all_gather_into_tensor(output, source, group=self._gather_group, async_op=True)
                unit.gather = _Gather(work=work, tensors=(source, output))

    def _wait_gather(self, unit: Unit) -> None:
        """Make ``unit``'s gathered buffer usable by what runs next on this (compute) stream."""
        gather, unit.gather = unit.gather, None
        if gather is not None:
            with self._range(USE_RANGE, unit):
                if gather.event is not None:
                    torch.cuda.current_stream(self.device).wait_event(gather.event)
                else:
                    gather.work.wait()
        unit.ready = unit.allocated

    def _free(self, unit: Unit) -> None:
        if unit.gather is not None and unit.gather.work is not None:
            unit.gather.work.wait()  # gloo writes into the buffer from its own thread
        unit.gather, unit.ready = None, False
        unit.full.untyped_storage().resize_(0)

    def _install(self, unit: Unit, call: _Call | None) -> None:
        """Point the modules' attributes at views of the gathered buffer (through autograd)."""
        views = _GatheredParams.apply(unit.param, self, unit, call)
        for flat_param, view in zip(unit.params, views):
            for sub, attribute in flat_param.slots:
                sub.__dict__[attribute] = view
        if call is not None and any(v.requires_grad for v in views):
            unit.pending_backward += 1

    @staticmethod
    def _uninstall(unit: Unit) -> None:
        for flat_param in unit.params:
            for sub, attribute in flat_param.slots:
                sub.__dict__.pop(attribute, None)

    # ------------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
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
        if self._step.phase is _Phase.BACKWARD:
            if self._step.backward_started or self._step.reductions:
                raise RuntimeError("call finish_gradient_synchronization() after backward, before the next forward")
            self._reset()  # the last forward's graph was dropped without a backward (evaluation with grad on)
        self._step.start_forward()
        root = self.root
        if root is not None:
            self._issue_gather(root)
        if self._step.order:
            self._issue_gather(self._step.order[0])
        if root is not None:
            self._wait_gather(root)
            self._step.root_call = _Call(root, -1, self._step.generation, torch.is_grad_enabled())
            self._install(root, self._step.root_call)

    def _end_forward(self) -> None:
        # Memory. Gathered at once: in forward the running unit and the next one (in flight), in backward the unit
        # whose backward runs, the previous one (prefetched) and, briefly, the one just finished: ~2-3 units, plus the
        # root unit. Units holding frozen parameters stay gathered from their backward gather to the end of backward
        # (the Function's backward, which frees a unit, does not wait for frozen weights' last use).
        for unit in self.units:
            if unit.is_open and unit is not self.root:  # a unit of several modules not all called
                self._close(unit)
        self._step.end_forward(awaiting_backward=any(u.pending_backward for u in self.units))
        last = self._step.calls[-1] if self._step.calls else None
        for unit in self.units:
            if unit is self.root or not unit.allocated:
                continue
            keep = (self._step.phase is _Phase.BACKWARD and last is not None and last.unit is unit and last.needs_gather)
            if not keep:  # a prefetch the forward did not use, or a unit kept for a backward that will not come
                self._free(unit)
        if self._step.phase is _Phase.IDLE:
            self._reset()

    def _predicted(self, position: int) -> Unit | None:
        return self._step.order[position] if 0 <= position < len(self._step.order) else None

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        if self._step.phase is _Phase.IDLE:
            raise RuntimeError("a sharded unit was called outside FSDP.forward: call the FSDP wrapper, not its module")
        unit = self._unit_of[module]
        if not unit.is_open:
            self._open(unit)
        unit.depth += 1

    def _open(self, unit: Unit) -> None:
        """The original parameters are deleted from their modules; while a unit runs, each module attribute
        (``linear.weight``) is a plain tensor, a view of the unit's gathered flat buffer ``unit.full`` (in the compute
        dtype), produced by one autograd Function (:class:`_GatheredParams`) per unit call, so autograd hands all the
        unit's weight gradients to one backward. Before a unit runs (forward pre-hook) its buffer is all-gathered in
        ONE ``all_gather_into_tensor`` from the shard (cast to ``compute_dtype`` first: half the bytes travel in
        bf16), and the gather of the unit predicted next (the order of the previous forward; registration order at
        first) is issued before this unit computes. After the unit's forward the buffer's storage is resized to 0:
        the views autograd saved stay valid objects, and the storage is filled again before the unit's backward.
        The last unit of the forward stays gathered (its backward comes next), and so does the root unit until its
        gradients are reduced.
        """
        if self._step.phase is _Phase.FORWARD:
            call = _Call(unit, len(self._step.calls), self._step.generation, torch.is_grad_enabled(), self._step.packs)
            self._step.calls.append(call)
            self._issue_gather(unit)
            following = self._predicted(call.position + 1)  # prefetched before this unit computes
        else:  # recomputation of a checkpointed region, during backward
            call = None
            self._issue_gather(unit)
            following = self._predicted(self._step.order.index(unit) + 1) if unit in self._step.order else None
            if following is not None and following.pending_backward == 0:
                following = None  # its backward is over: it is not part of this recomputation
        if following is not None and following is not unit:
            self._issue_gather(following)
        self._wait_gather(unit)
        self._install(unit, call)
        unit.is_open, unit.open_call = True, call
        if call is not None:
            self._step.live[unit.full.untyped_storage().data_ptr()] = call

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        unit = self._unit_of[module]
        unit.depth -= 1
        call = unit.open_call
        if call is not None and call.grad_enabled:
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if len(tensors) == 1:
                tensors[0].register_hook(lambda grad, call=call: self._before_backward(call))
            elif tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads, call=call: self._before_backward(call), mode="any"
                )
        unit.modules_done.add(id(module))
        if unit.depth == 0 and len(unit.modules_done) == len(unit.modules):
            self._close(unit)

    def _close(self, unit: Unit) -> None:
        # Activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=False)`` inside the wrapped module:
        # ``BasicsTransformerLM.set_activation_checkpointing``, or a caller wrapping blocks itself). Inside a checkpointed
        # region autograd saves nothing of the unit, so the pack hook sees no saved tensor and the unit is marked as
        # needing its weights in backward (it will be recomputed). In backward, recomputation calls the unit's modules
        # again: the pre-hook gathers the unit (usually prefetched already), installs fresh views (through the same
        # Function, so the recomputed operations save what the original ones did) and keeps the buffer until the
        # unit's gradients are reduced. A checkpointed group of ``g`` blocks therefore holds up to ``g`` gathered units
        # during its backward. Reentrant checkpointing is rejected (its recomputed graph is the one backpropagated).
        self._uninstall(unit)
        call, unit.open_call = unit.open_call, None
        unit.is_open, unit.depth = False, 0
        unit.modules_done.clear()
        if call is None:
            return  # recomputed: the buffer stays until the unit's gradients are reduced
        self._step.live.pop(unit.full.untyped_storage().data_ptr(), None)
        # Nothing packed by our hook during a forward with grad: a checkpoint's hooks took the saved tensors,
        # so the unit will be recomputed in backward and needs its weights there.
        call.needs_gather = call.saved or (call.grad_enabled and self._step.packs == call.packs_at_open)
        last = call.position == len(self._step.order) - 1
        if not (last and call.needs_gather and unit.pending_backward):
            self._free(unit)

    def _pack(self, tensor: Tensor) -> Tensor:
        self._step.packs += 1
        if self._step.live:
            call = self._step.live.get(tensor.untyped_storage().data_ptr())
            if call is not None:
                call.saved = True
        return tensor

    # ------------------------------------------------------------------------------------------------
    # Backward
    # ------------------------------------------------------------------------------------------------

    def _before_backward(self, call: _Call) -> None:
        # Backward. A hook on each unit call's outputs fires before the unit's backward: it gathers the unit again
        # (already prefetched, normally) and prefetches the unit that ran before it in forward. Units whose saved
        # tensors do not touch their weights (an embedding's lookup) are not gathered again: a saved-tensor pack hook
        # records, during forward, whether anything saved lives in a gathered buffer. When all the unit's parameter
        # gradients exist (the Function's backward), they are cast to fp32 into one flat buffer and
        # ``reduce_scatter_tensor(op=AVG)`` leaves this rank's slice of the average in its shard's ``.grad``
        # (:func:`reduce_scatter_mean` falls back to all-reduce + slice where a backend lacks it); the gathered buffer
        # is freed. :meth:`FSDP.finish_gradient_synchronization` waits for what is in flight; afterwards every shard's
        # ``.grad`` is fp32 and averaged over ranks.
        """The gradient of a unit call's output exists: its backward is next. Gather it, prefetch the one before."""
        if call.backward_seen or call.generation != self._step.generation or self._step.phase is not _Phase.BACKWARD:
            return
        call.backward_seen = True
        self._step.backward_started = True
        if call.needs_gather:
            self._issue_gather(call.unit)
            self._wait_gather(call.unit)
        for previous in reversed(self._step.calls[: call.position]):
            if previous.needs_gather:
                self._issue_gather(previous.unit)
                break

    def _on_unit_gradients(self, unit: Unit, call: _Call | None, grads: tuple[Tensor | None, ...]) -> None:
        """The gradients of one call's weights: sum them; after the unit's last call, reduce and free."""
        if call is None:
            raise RuntimeError("FSDP supports activation checkpointing with use_reentrant=False only")
        if call.generation != self._step.generation:
            raise RuntimeError("backward through the graph of an earlier FSDP forward: backward before the next forward")
        if unit.pending_backward <= 0:
            raise RuntimeError("a second backward through the same FSDP forward is not supported")
        self._step.backward_started = True
        if unit.grad_flat is None:
            flat = unit.grad_flat = torch.empty(unit.full.numel(), dtype=torch.float32, device=self.device)
            flat[unit.trainable_numel :].zero_()  # frozen parameters and padding
            for flat_param, grad in zip(unit.params, grads):
                if flat_param.requires_grad:
                    segment = flat[flat_param.offset : flat_param.stop]
                    segment.zero_() if grad is None else segment.view(flat_param.shape).copy_(grad)  # cast to fp32
        else:
            for flat_param, grad in zip(unit.params, grads):
                if flat_param.requires_grad and grad is not None:
                    unit.grad_flat[flat_param.offset : flat_param.stop].view(flat_param.shape).add_(grad)
        unit.pending_backward -= 1
        if unit.pending_backward == 0:
            self._launch_reduction(unit)
            if not unit.keeps_gathered:
                self._free(unit)

    def _launch_reduction(self, unit: Unit) -> None:
        flat, unit.grad_flat = unit.grad_flat, None
        with self._range(REDUCE_RANGE, unit):
            if self._streams:
                self._reduce_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._reduce_stream):
                    output = torch.empty(unit.shard_numel, dtype=torch.float32, device=self.device)
                    reduce_scatter_mean(output, flat, group=self._reduce_group)
                    self._accumulate_grad(unit, output)
                    event = self._reduce_stream.record_event()
                self._step.reductions.append(_Reduction(unit, flat, output, event=event))
            else:
                output = torch.empty(unit.shard_numel, dtype=torch.float32, device=self.device)
                handle = reduce_scatter_mean(output, flat, group=self._reduce_group, async_op=True)
                self._step.reductions.append(_Reduction(unit, flat, output, handle=handle))
        self._retire_reductions(keep=REDUCTIONS_IN_FLIGHT)

    def _retire_reductions(self, keep: int) -> None:
        """Complete the oldest reductions until at most ``keep`` are in flight (frees their inputs)."""
        while len(self._step.reductions) > keep:
            reduction = self._step.reductions.pop(0)
            if reduction.event is not None:
                torch.cuda.current_stream(self.device).wait_event(reduction.event)
            else:
                reduction.handle.wait()
                self._accumulate_grad(reduction.unit, reduction.output)

    @staticmethod
    def _accumulate_grad(unit: Unit, reduced: Float[Tensor, " S"]) -> None:
        grad = reduced[: unit.param.numel()]
        if unit.param.grad is None:
            unit.param.grad = grad
        else:
            unit.param.grad.add_(grad)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduction in flight; afterwards each shard's ``.grad`` is fp32, averaged over ranks."""
        for unit in self.units:  # a call whose output was not used: reduce what arrived
            if unit.pending_backward and unit.grad_flat is not None:
                unit.pending_backward = 0
                self._launch_reduction(unit)
        self._retire_reductions(keep=0)
        self._reset()

    def _reset(self) -> None:
        """Back to idle: views removed, buffers freed, nothing in flight."""
        self._retire_reductions(keep=0)
        for unit in self.units:
            self._uninstall(unit)
            self._free(unit)
            unit.is_open, unit.open_call, unit.depth = False, None, 0
            unit.modules_done.clear()
            unit.pending_backward, unit.grad_flat = 0, None
        self._step.to_idle()

    # ------------------------------------------------------------------------------------------------
    # Full parameters
    # ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, Tensor]:
        """Every parameter of the wrapped module by its original name, full and fp32 (fresh tensors; a
        collective: every rank must call it)."""
        return self._gather_full(lambda unit: unit.shard)

    @torch.no_grad()
    def gather_full_grads(self) -> dict[str, Tensor | None]:
        """Every parameter's gradient, full like :meth:`gather_full_params` (None for frozen parameters and
        where no gradient exists; a collective, after :meth:`finish_gradient_synchronization`)."""
        def local_grad(unit: Unit) -> Tensor | None:
            if unit.param is None or unit.param.grad is None:
                return None
            padded = torch.zeros(unit.shard_numel, dtype=torch.float32, device=self.device)
            padded[: unit.param.numel()] = unit.param.grad
            return padded

        return self._gather_full(local_grad)

    def _gather_full(self, local: Callable[[Unit], Tensor | None]) -> dict[str, Tensor | None]:
        full: dict[str, Tensor | None] = {}
        for unit in self.units:
            shard = local(unit)
            if shard is None:
                full.update((p.name, None) for p in unit.params)
                continue
            buffer = torch.empty(unit.full.numel(), dtype=shard.dtype, device=self.device)
            dist.all_gather_into_tensor(buffer, shard.contiguous())
            for p in unit.params:
                full[p.name] = buffer[p.offset : p.stop].view(p.shape) if shard is unit.shard or p.requires_grad else None
        return {name: full[name] for name in self._param_names}

    def gathered_units(self) -> list[str]:
        """Names of the units whose flat buffer is gathered (or on its way) now: for tests and debugging."""
        return [unit.name for unit in self.units if unit.allocated]


def _unpack(tensor: Tensor) -> Tensor:
    return tensor
