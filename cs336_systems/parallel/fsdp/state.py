"""Where a unit is in a training step, and where the step is: enums with named, checked transitions.

A unit's weights move ``SHARDED -> GATHERING -> UNSHARDED -> RUNNING -> UNSHARDED -> SHARDED``:

* ``SHARDED``: only this rank's shard exists; the gathered buffer's storage is freed;
* ``GATHERING``: an all-gather into the buffer is in flight (a prefetch, or the gather before use);
* ``UNSHARDED``: the gathered buffer is usable by compute (kept for backward, or between a backward gather and
  the unit's gradients);
* ``RUNNING``: a forward (or a recomputation) of the unit is running: its modules' attributes are views of the
  buffer.

A prefetch the forward did not use goes ``GATHERING -> SHARDED``. Its gradients move ``NONE -> ACCUMULATING`` (the
gradients of one or more calls summed in one flat fp32 buffer) ``-> REDUCING`` (the reduce-scatter launched)
``-> NONE`` (its result in the shard's ``.grad``). Each transition names the states it may leave; any other raises
:class:`IllegalTransition` naming both the state it found and the one asked for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from torch import Tensor

Unit = TypeVar("Unit")  # a unit of :mod:`.units`: a step orders units and never reads them, so needs no import


class IllegalTransition(RuntimeError):
    """A unit or step asked to move from a state that the transition does not leave."""


class Weights(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"
    RUNNING = "running"


class Grads(enum.Enum):
    NONE = "none"
    ACCUMULATING = "accumulating"
    REDUCING = "reducing"


def _check(who: str, action: str, current: enum.Enum, allowed: tuple[enum.Enum, ...], target: enum.Enum) -> None:
    if current not in allowed:
        expected = " or ".join(state.name for state in allowed)
        raise IllegalTransition(f"{who}: {action} cannot move {current.name} -> {target.name} (it leaves {expected})")


@dataclass(eq=False)
class Call(Generic[Unit]):
    """One forward call of a unit (the root's included), and what its backward needs."""

    unit: Unit
    position: int  # index in Step.calls (-1: the root)
    generation: int  # the forward it belongs to
    grad_enabled: bool
    packs_at_open: int = 0  # Step.packs when the call started
    saved: bool = False  # autograd saved a view of the unit's gathered buffer
    needs_gather: bool = False  # the unit's weights must be gathered again for its backward
    backward_seen: bool = False


@dataclass(eq=False)
class UnitState:
    """One unit's place in the current step (its layout is the :class:`~cs336_systems.parallel.fsdp.units.Unit`)."""

    name: str
    weights: Weights = Weights.SHARDED
    grads: Grads = Grads.NONE
    gather: Any = None  # the transport's handle of the gather in flight (GATHERING)
    call: Call | None = None  # the running forward call (RUNNING; None in a recomputation)
    depth: int = 0  # module calls of the unit entered and not yet left (RUNNING)
    modules_done: set[int] = field(default_factory=set)  # ids of the unit's modules whose forward finished
    pending_backward: int = 0  # forward calls whose gradients have not arrived
    grad_flat: Tensor | None = None  # (W * S,) fp32: the gradients that arrived, summed (ACCUMULATING)

    def _move_weights(self, action: str, allowed: tuple[Weights, ...], target: Weights) -> None:
        if self.weights not in allowed:  # the message is formatted only when it is needed
            _check(f"unit {self.name}", action, self.weights, allowed, target)
        self.weights = target

    def _move_grads(self, action: str, allowed: tuple[Grads, ...], target: Grads) -> None:
        if self.grads not in allowed:
            _check(f"unit {self.name} (gradients)", action, self.grads, allowed, target)
        self.grads = target

    # Weights ---------------------------------------------------------------------------------------

    def start_gather(self, handle: Any) -> None:
        self._move_weights("start_gather", (Weights.SHARDED,), Weights.GATHERING)
        self.gather = handle

    def finish_gather(self) -> Any:
        """The handle of the gather, now to be waited for."""
        self._move_weights("finish_gather", (Weights.GATHERING,), Weights.UNSHARDED)
        handle, self.gather = self.gather, None
        return handle

    def start_running(self, call: Call | None) -> None:
        self._move_weights("start_running", (Weights.UNSHARDED,), Weights.RUNNING)
        self.call, self.depth = call, 0
        self.modules_done.clear()

    def stop_running(self) -> Call | None:
        """The call that ran (None for a recomputation)."""
        self._move_weights("stop_running", (Weights.RUNNING,), Weights.UNSHARDED)
        call, self.call, self.depth = self.call, None, 0
        self.modules_done.clear()
        return call

    def free(self) -> Any:
        """The handle of a gather still in flight (None if it was waited for)."""
        self._move_weights("free", (Weights.GATHERING, Weights.UNSHARDED), Weights.SHARDED)
        handle, self.gather = self.gather, None
        return handle

    # Gradients -------------------------------------------------------------------------------------

    def start_accumulating(self, flat: Tensor) -> None:
        self._move_grads("start_accumulating", (Grads.NONE,), Grads.ACCUMULATING)
        self.grad_flat = flat

    def accumulate(self) -> Tensor:
        """The flat gradient buffer to add another call's gradients to."""
        self._move_grads("accumulate", (Grads.ACCUMULATING,), Grads.ACCUMULATING)
        return self.grad_flat

    def start_reduce(self) -> Tensor:
        """The summed flat gradients, handed to the reduction."""
        self._move_grads("start_reduce", (Grads.ACCUMULATING,), Grads.REDUCING)
        flat, self.grad_flat = self.grad_flat, None
        return flat

    def finish_reduce(self) -> None:
        self._move_grads("finish_reduce", (Grads.REDUCING,), Grads.NONE)

    def drop_grads(self) -> None:
        """Forget gradients that will not be reduced (a forward whose backward never came)."""
        self._move_grads("drop_grads", (Grads.NONE, Grads.ACCUMULATING), Grads.NONE)
        self.grad_flat, self.pending_backward = None, 0


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"  # between a forward that needs a backward and finish_gradient_synchronization


@dataclass(eq=False)
class Step(Generic[Unit]):
    """What the hooks of one training step share, from the wrapper's forward to ``finish_gradient_synchronization``:
    IDLE -> (:meth:`start_forward`) FORWARD -> (:meth:`end_forward`) BACKWARD or IDLE -> (:meth:`to_idle`) IDLE."""

    order: list[Unit]  # the last forward's unit calls: which unit to prefetch next
    phase: Phase = Phase.IDLE
    generation: int = 0  # which forward: a hook of an earlier one's graph is stale
    calls: list[Call] = field(default_factory=list)  # this forward's unit calls, in order
    live: dict[int, Call] = field(default_factory=dict)  # storage of a gathered buffer in use in forward -> its call
    packs: int = 0  # tensors autograd saved so far (counted by the pack hook)
    backward_started: bool = False
    reductions: list[tuple[Unit, Any]] = field(default_factory=list)  # (unit, transport handle), oldest first

    def start_forward(self) -> None:
        _check("step", "start_forward", self.phase, (Phase.IDLE,), Phase.FORWARD)
        self.generation += 1
        self.calls = []
        self.phase = Phase.FORWARD

    def end_forward(self, awaiting_backward: bool) -> None:
        target = Phase.BACKWARD if awaiting_backward else Phase.IDLE
        _check("step", "end_forward", self.phase, (Phase.FORWARD,), target)
        if self.calls:
            self.order = [call.unit for call in self.calls]
        self.phase = target

    def to_idle(self) -> None:
        self.live.clear()
        self.phase, self.backward_started = Phase.IDLE, False

    def predicted(self, position: int) -> Unit | None:
        """The unit expected at ``position`` of the forward (the last forward's order; registration order at first)."""
        return self.order[position] if 0 <= position < len(self.order) else None
