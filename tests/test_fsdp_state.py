"""FSDP's state machine without a process group: a fake transport (one rank) records every collective FSDP asks
for, in order, so that the order of gathers, waits and reductions of a training step is checked exactly; the
gradients are checked against the unwrapped model; illegal transitions raise naming both states."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from cs336_systems.parallel.fsdp import FSDP, Grads, IllegalTransition, Phase, Weights
from cs336_systems.parallel.fsdp.state import Step, UnitState


class RecordingTransport:
    """One rank: a gather copies the shard into the buffer, a reduction hands the flat gradients back. Every call is
    recorded as ``(kind, unit name)``; ``names`` maps a unit's flat size to its name (the test's units differ in size;
    set once FSDP is built)."""

    rank, world_size = 0, 1

    def __init__(self):
        self.log: list[tuple[str, str]] = []
        self.names: dict[int, str] = {}

    def name(self, tensor: Tensor) -> str:
        return self.names[tensor.numel()]

    def broadcast_module(self, module: nn.Module) -> None:
        pass

    def gather(self, shard: Tensor, full: Tensor):
        self.log.append(("gather", self.name(full)))
        full.untyped_storage().resize_(full.numel() * full.element_size())
        full.data.copy_(shard)  # cast to the compute dtype
        return full

    def wait_gather(self, full: Tensor) -> None:
        self.log.append(("wait_gather", self.name(full)))

    def drop_gather(self, full: Tensor) -> None:
        self.log.append(("drop_gather", self.name(full)))

    def reduce(self, flat: Tensor, shard_numel: int, deliver):
        self.log.append(("reduce", self.name(flat)))
        return flat, shard_numel, deliver

    def wait_reduce(self, handle) -> None:
        flat, shard_numel, deliver = handle
        self.log.append(("wait_reduce", self.name(flat)))
        deliver(flat[:shard_numel].clone())  # the mean over one rank

    def all_gather(self, shard: Tensor, numel: int) -> Tensor:
        return shard.clone()


class Chain(nn.Module):
    """``x -> a -> tanh -> b -> tanh -> c``, optionally ``b`` twice; a root gain outside every unit."""

    def __init__(self, repeat_b: bool = False):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.repeat_b = repeat_b

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))  # (batch, 6)
        if self.repeat_b:
            h = torch.tanh(self.b(h))
        return self.c(h) * self.gain  # (batch, 3)


def wrap(model: Chain, compute_dtype: torch.dtype | None = None) -> tuple[FSDP, RecordingTransport]:
    transport = RecordingTransport()
    fsdp = FSDP(model, compute_dtype=compute_dtype, units=[model.a, model.b, model.c], transport=transport)
    transport.names = {unit.full.numel(): unit.name for unit in fsdp.units}  # 30, 42, 21 and 1 elements
    assert len(transport.names) == len(fsdp.units)
    return fsdp, transport


def plain_grads(repeat_b: bool, batches: list[Tensor]) -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = Chain(repeat_b)
    for x in batches:
        model(x).square().sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_a_step_gathers_ahead_and_reduces_in_reverse():
    torch.manual_seed(0)
    fsdp, transport = wrap(Chain())
    assert [u.name for u in fsdp.units] == ["a", "b", "c", "_root"]
    x = torch.randn(5, 4)
    loss = fsdp(x).square().sum()
    # The root and the first unit at the start; each unit's successor is issued before the unit is waited for.
    assert transport.log == [("gather", "_root"), ("gather", "a"), ("wait_gather", "_root"),
                             ("gather", "b"), ("wait_gather", "a"), ("gather", "c"), ("wait_gather", "b"),
                             ("wait_gather", "c")]
    assert fsdp.gathered_units() == ["c", "_root"]  # the last unit stays for its backward, the root to the end
    assert fsdp._step.phase is Phase.BACKWARD
    assert [u.state.weights for u in fsdp.units] == [Weights.SHARDED, Weights.SHARDED, Weights.UNSHARDED,
                                                     Weights.UNSHARDED]
    transport.log.clear()
    loss.backward()
    # Backward in reverse: b prefetched before c's gradients are reduced; a is not gathered again (its input needs
    # no gradient, so autograd saved the input and not a's weight); the oldest reduction completed once two more are
    # in flight. The root's gradients come last (autograd reaches its Function after every unit's).
    assert transport.log == [("gather", "b"), ("reduce", "c"), ("wait_gather", "b"), ("reduce", "b"),
                             ("reduce", "a"), ("wait_reduce", "c"), ("reduce", "_root"), ("wait_reduce", "b")]
    assert fsdp.gathered_units() == []
    assert [u.state.grads for u in fsdp.units] == [Grads.REDUCING, Grads.NONE, Grads.NONE, Grads.REDUCING]
    fsdp.finish_gradient_synchronization()
    assert transport.log[-2:] == [("wait_reduce", "a"), ("wait_reduce", "_root")]
    assert fsdp.gathered_units() == [] and fsdp._step.phase is Phase.IDLE
    assert all(u.state.weights is Weights.SHARDED and u.state.grads is Grads.NONE for u in fsdp.units)
    expected = plain_grads(False, [x])
    for name, grad in fsdp.gather_full_grads().items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-7, msg=name)


def test_prefetch_follows_the_last_forward_order():
    """The second forward prefetches in the order the first one called the units (here: c is never called first,
    but the registration order is replaced by the calls' order, repeats included)."""
    torch.manual_seed(0)
    fsdp, transport = wrap(Chain(repeat_b=True))
    fsdp(torch.randn(2, 4)).sum().backward()
    fsdp.finish_gradient_synchronization()
    assert [u.name for u in fsdp._step.order] == ["a", "b", "b", "c"]
    transport.log.clear()
    with torch.no_grad():
        fsdp(torch.randn(2, 4))
    gathers = [name for kind, name in transport.log if kind == "gather"]
    assert gathers == ["_root", "a", "b", "b", "c"]  # b freed after its first call, gathered again for its second


def test_two_calls_of_a_unit_sum_before_one_reduction():
    torch.manual_seed(0)
    fsdp, transport = wrap(Chain(repeat_b=True))
    x = torch.randn(3, 4)
    loss = fsdp(x).square().sum()
    b = fsdp.units[1]
    assert b.state.pending_backward == 2
    transport.log.clear()
    loss.backward()
    fsdp.finish_gradient_synchronization()
    assert [kind for kind, _ in transport.log].count("reduce") == 4  # one per unit, b's two calls summed
    expected = plain_grads(True, [x])
    for name, grad in fsdp.gather_full_grads().items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-7, msg=name)


def test_gradients_accumulate_across_two_steps_without_zero_grad():
    torch.manual_seed(0)
    fsdp, _ = wrap(Chain())
    batches = [torch.randn(3, 4), torch.randn(3, 4)]
    for x in batches:
        fsdp(x).square().sum().backward()
        fsdp.finish_gradient_synchronization()
    expected = plain_grads(False, batches)
    for name, grad in fsdp.gather_full_grads().items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-6, msg=name)


def test_forward_before_finish_raises_and_evaluation_leaves_nothing_gathered():
    torch.manual_seed(0)
    fsdp, _ = wrap(Chain())
    x = torch.randn(2, 4)
    fsdp(x).sum().backward()
    with pytest.raises(RuntimeError, match="finish_gradient_synchronization"):
        fsdp(x)
    fsdp.finish_gradient_synchronization()
    with torch.no_grad():
        fsdp(x)
    assert fsdp.gathered_units() == [] and fsdp._step.phase is Phase.IDLE
    fsdp(x)  # a graph dropped without backward: the next forward starts afresh
    fsdp(x).sum().backward()
    fsdp.finish_gradient_synchronization()


def test_a_second_backward_through_one_forward_raises_instead_of_reading_freed_weights():
    """The first backward frees every gathered buffer (the root's last); a second one through the retained graph
    would read them. Whichever unit it reaches first, it raises naming the problem."""
    torch.manual_seed(0)
    for reads_the_root_first in (True, False):
        model = Chain()
        fsdp, _ = wrap(model)
        if not reads_the_root_first:  # without the root's gain: c's weight is the first one read
            model.forward = lambda x, model=model: model.c(torch.tanh(model.b(torch.tanh(model.a(x)))))
        loss = fsdp(torch.randn(5, 4)).square().sum()
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="second backward through the same FSDP forward is not supported"):
            loss.backward()
        fsdp.finish_gradient_synchronization()
        assert fsdp.gathered_units() == [] and fsdp._step.phase is Phase.IDLE


def test_finishing_twice_changes_nothing():
    torch.manual_seed(0)
    fsdp, transport = wrap(Chain())
    x = torch.randn(5, 4)
    fsdp(x).square().sum().backward()
    fsdp.finish_gradient_synchronization()
    grads = {name: grad.clone() for name, grad in fsdp.gather_full_grads().items()}
    calls = len(transport.log)
    fsdp.finish_gradient_synchronization()
    assert len(transport.log) == calls
    for name, grad in fsdp.gather_full_grads().items():
        assert torch.equal(grad, grads[name]), name


def test_an_optimizer_built_before_wrapping_raises_at_its_first_step():
    """Its parameters are the module's originals, which FSDP replaced: it would silently train nothing."""
    torch.manual_seed(0)
    model = Chain()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    fsdp, _ = wrap(model)
    fsdp(torch.randn(5, 4)).square().sum().backward()
    fsdp.finish_gradient_synchronization()
    with pytest.raises(RuntimeError, match="SGD holds parameters of a module that FSDP has since wrapped"):
        early.step()
    torch.optim.SGD(fsdp.parameters(), lr=0.1).step()  # built after wrapping: it steps the shards
    torch.optim.SGD(Chain().parameters(), lr=0.1).step()  # an optimizer of another module is left alone


def test_a_module_without_parameters_is_refused():
    with pytest.raises(ValueError, match="the module has no parameters to shard"):
        FSDP(nn.ReLU(), transport=RecordingTransport())


def test_an_unused_prefetch_is_dropped():
    """A forward that stops before the predicted unit: its gather was issued, never waited for, then dropped."""
    torch.manual_seed(0)
    model = Chain()
    fsdp, transport = wrap(model)
    fsdp(torch.randn(2, 4)).sum().backward()
    fsdp.finish_gradient_synchronization()
    transport.log.clear()
    model.forward = lambda x: model.a(x).sum() * model.gain  # only a runs; b is prefetched all the same
    fsdp(torch.randn(2, 4)).backward()
    fsdp.finish_gradient_synchronization()
    assert ("gather", "b") in transport.log and ("drop_gather", "b") in transport.log
    assert ("wait_gather", "b") not in transport.log


def test_floating_inputs_are_cast_to_the_compute_dtype():
    torch.manual_seed(0)
    fsdp, _ = wrap(Chain(), compute_dtype=torch.bfloat16)
    out = fsdp(torch.randn(2, 4))  # fp32 input, bf16 weights
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    fsdp.finish_gradient_synchronization()
    assert all(p.grad.dtype == torch.float32 for p in fsdp.parameters() if p.requires_grad)


def test_unit_transitions_in_order():
    state = UnitState("u")
    state.start_gather("handle")
    assert state.weights is Weights.GATHERING
    assert state.finish_gather() == "handle" and state.weights is Weights.UNSHARDED
    state.start_running(None)
    assert state.stop_running() is None and state.weights is Weights.UNSHARDED
    assert state.free() is None and state.weights is Weights.SHARDED
    state.start_gather("again")
    assert state.free() == "again"  # a prefetch never used: its handle comes back to be dropped
    flat = torch.zeros(3)
    state.start_accumulating(flat)
    assert state.accumulate() is flat
    assert state.start_reduce() is flat and state.grads is Grads.REDUCING and state.grad_flat is None
    state.finish_reduce()
    assert state.grads is Grads.NONE


@pytest.mark.parametrize(
    "steps, message",
    [
        (lambda s: s.finish_gather(), "finish_gather cannot move SHARDED -> UNSHARDED"),
        (lambda s: s.free(), "free cannot move SHARDED -> SHARDED"),
        (lambda s: (s.start_gather(1), s.start_running(None)), "start_running cannot move GATHERING -> RUNNING"),
        (lambda s: (s.start_gather(1), s.start_gather(2)), "start_gather cannot move GATHERING -> GATHERING"),
        (lambda s: (s.start_gather(1), s.finish_gather(), s.start_running(None), s.free()),
         "free cannot move RUNNING -> SHARDED"),
        (lambda s: s.start_reduce(), r"\(gradients\): start_reduce cannot move NONE -> REDUCING"),
        (lambda s: (s.start_accumulating(torch.zeros(1)), s.start_reduce(), s.accumulate()),
         "accumulate cannot move REDUCING -> ACCUMULATING"),
        (lambda s: (s.start_accumulating(torch.zeros(1)), s.start_reduce(), s.drop_grads()),
         "drop_grads cannot move REDUCING -> NONE"),
    ],
)
def test_illegal_unit_transitions_name_both_states(steps, message):
    with pytest.raises(IllegalTransition, match=message):
        steps(UnitState("u"))


def test_illegal_step_transitions_name_both_states():
    step = Step(order=[])
    with pytest.raises(IllegalTransition, match="end_forward cannot move IDLE -> IDLE"):
        step.end_forward(awaiting_backward=False)
    step.start_forward()
    with pytest.raises(IllegalTransition, match="start_forward cannot move FORWARD -> FORWARD"):
        step.start_forward()
    step.end_forward(awaiting_backward=True)
    assert step.phase is Phase.BACKWARD
    step.to_idle()
    assert step.phase is Phase.IDLE
