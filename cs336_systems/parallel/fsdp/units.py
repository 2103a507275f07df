"""What a unit is: which modules form it, and its parameters' layout in one flat buffer and this rank's shard.

By default (:func:`default_units`) every ``TransformerBlock`` is a unit (``module.layers[i]`` of a
``BasicsTransformerLM``), and so is every ``Embedding`` (the token embedding); the final norm and the LM head
(``ln_final``, ``lm_head``) form one unit together. ``units=`` names any other split: each entry is a submodule, or a
tuple of submodules that form one unit. Every parameter not in a unit belongs to the *root* unit, and so does a
parameter shared by two units (tied weights).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from cs336_basics.model import Embedding, TransformerBlock
from cs336_systems.parallel.fsdp.state import UnitState

ROOT_KEY = "_root"  # the root unit's name (its key in FSDP.shards)

UnitSpec = nn.Module | Sequence[nn.Module]
Slots = dict[int, list[tuple[nn.Module, str]]]  # id(param) -> every (module, attribute) holding it


def default_units(module: nn.Module) -> list[UnitSpec]:
    """Every ``TransformerBlock`` and ``Embedding`` (outermost ones), and ``(ln_final, lm_head)`` when the
    module has both: for ``BasicsTransformerLM`` the token embedding, each block, the final norm with the head."""
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


def check_units(module: nn.Module, units: Sequence[UnitSpec]) -> list[tuple[str, tuple[nn.Module, ...]]]:
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
class Unit:
    """A block of parameters sharded as one flat fp32 buffer (its layout; :attr:`state` is where it is in a step).

    A unit's parameters (all of them: RMSNorm gains too), trainable ones first, then frozen ones, are laid end to
    end in one flat fp32 buffer of ``N`` elements, padded to ``W * S`` with ``S = ceil(N / W)`` for ``W`` ranks;
    rank ``r`` keeps elements ``[r S, (r + 1) S)`` in ``unit.shard``. The optimizer sees ONE ``nn.Parameter`` per
    unit: the trainable part of the rank's slice, a 1-D view of ``unit.shard`` (registered as ``shards.<unit>``;
    frozen elements as ``frozen_shards.<unit>``, ``requires_grad=False``). One parameter per unit keeps the
    optimizer's loop short (50 parameters on the xl model instead of 435), any elementwise
    ``torch.optim.Optimizer`` works on it (``cs336_basics``' AdamW included), and the padding is never stepped.
    The price: per-parameter optimizer options (no weight decay on gains, say) cannot be expressed, and the
    wrapped module has no parameters of its own left.
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
    state: UnitState = field(init=False)

    def __post_init__(self) -> None:
        self.state = UnitState(self.name)

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


@dataclass(frozen=True)
class ShardLayout:
    """How flat buffers are split: over ``world_size`` ranks, this one ``rank``; gathered in ``compute_dtype``."""

    world_size: int
    rank: int
    compute_dtype: torch.dtype
    device: torch.device


def parameter_owners(module: nn.Module, specs: list[tuple[str, tuple[nn.Module, ...]]]):
    """``(slots, members)``: every (module, attribute) holding each parameter, and each unit's named parameters
    (``members[len(specs)]`` is the root's: parameters outside every unit or shared by two)."""
    slots: Slots = {}
    claims: dict[int, set[int]] = {}  # id(param) -> units whose modules hold it (-1: outside every unit)
    units_of_module: dict[int, set[int]] = {}  # a submodule shared by units is in several
    for i, (_, modules) in enumerate(specs):
        for member in modules:
            for sub in member.modules():
                units_of_module.setdefault(id(sub), set()).add(i)
    for sub in module.modules():
        for attribute, param in sub._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((sub, attribute))
                claims.setdefault(id(param), set()).update(units_of_module.get(id(sub), {-1}))
    members: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(specs) + 1)]
    for name, param in module.named_parameters():
        owners = claims[id(param)]
        members[next(iter(owners)) if len(owners) == 1 and -1 not in owners else len(specs)].append((name, param))
    return slots, members


@torch.no_grad()
def make_unit(name: str, modules: tuple[nn.Module, ...], named: list[tuple[str, nn.Parameter]], slots: Slots,
              layout: ShardLayout) -> Unit:
    """The unit of ``named`` parameters: its flat layout and this rank's shard; the modules lose the parameters."""
    ordered = [(n, p) for n, p in named if p.requires_grad] + [(n, p) for n, p in named if not p.requires_grad]
    flat_params, offset = [], 0
    for param_name, param in ordered:
        flat_params.append(FlatParam(param_name, slots[id(param)], param.shape, offset, param.requires_grad))
        offset += param.numel()
    numel, world, rank = offset, layout.world_size, layout.rank
    trainable = sum(p.numel for p in flat_params if p.requires_grad)
    shard_numel = math.ceil(numel / world)
    flat = torch.zeros(world * shard_numel, dtype=torch.float32, device=layout.device)
    for flat_param, (_, param) in zip(flat_params, ordered):
        flat[flat_param.offset : flat_param.stop].copy_(param.reshape(-1))
    shard = flat[rank * shard_numel : (rank + 1) * shard_numel].clone()
    trainable_here = min(max(trainable - rank * shard_numel, 0), shard_numel)
    params_here = min(max(numel - rank * shard_numel, 0), shard_numel)
    full = torch.empty(world * shard_numel, dtype=layout.compute_dtype, device=layout.device)
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


def build_units(module: nn.Module, specs: list[tuple[str, tuple[nn.Module, ...]]], layout: ShardLayout) -> list[Unit]:
    """One unit per spec that kept parameters, then the root unit (named :data:`ROOT_KEY`) if any are left."""
    slots, members = parameter_owners(module, specs)
    units = []
    for i, named in enumerate(members):
        if named:  # else a unit whose parameters all went to the root, or an empty root
            name, modules = (ROOT_KEY, ()) if i == len(specs) else specs[i]
            units.append(make_unit(name, modules, named, slots, layout))
    return units


def flat_gradients(unit: Unit, grads: tuple[Tensor | None, ...]) -> Tensor:
    """``(W * S,)`` fp32: one call's gradients of the unit's parameters laid out like its flat buffer (zeros for
    frozen parameters, missing gradients and padding)."""
    flat = torch.empty(unit.full.numel(), dtype=torch.float32, device=unit.shard.device)
    flat[unit.trainable_numel :].zero_()  # frozen parameters and padding
    for flat_param, grad in zip(unit.params, grads):
        if flat_param.requires_grad:
            segment = flat[flat_param.offset : flat_param.stop]
            segment.zero_() if grad is None else segment.view(flat_param.shape).copy_(grad)  # cast to fp32
    return flat


def add_gradients(unit: Unit, flat: Tensor, grads: tuple[Tensor | None, ...]) -> None:
    """Add another call's gradients to ``flat`` (see :func:`flat_gradients`)."""
    for flat_param, grad in zip(unit.params, grads):
        if flat_param.requires_grad and grad is not None:
            flat[flat_param.offset : flat_param.stop].view(flat_param.shape).add_(grad)


def accumulate_grad(unit: Unit, reduced: Tensor) -> None:
    """Add this rank's reduced slice ``(S,)`` to the shard parameter's ``.grad`` (or make it the ``.grad``)."""
    grad = reduced[: unit.param.numel()]
    if unit.param.grad is None:
        unit.param.grad = grad
    else:
        unit.param.grad.add_(grad)
