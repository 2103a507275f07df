"""The sharded optimizer against the unsharded one (gloo on CPU with 2 and 3 ranks; NCCL with 2+ GPUs).

Every rank computes the same full-batch gradients, so any difference from the unsharded optimizer
comes from the sharding: ownership, the local step, the broadcasts, hyper-parameter propagation and
the consolidated state dict. One spawn per world size runs all the checks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.parallel.ddp import DDPIndividualParameters
from cs336_systems.parallel.distributed import one_rank_group
from cs336_systems.parallel.fsdp import FSDP
from cs336_systems.parallel.sharded_optimizer import ShardedOptimizer
from tests import adapters
from tests._ddp_toy_models import assert_same_parameters, assert_same_tensors
from tests._distributed import assert_all_passed, gpu_world_size, run_checks

STEPS = 10
STEP_ADDING_A_GROUP = 4
STEP_CHANGING_LR = 7
DEFAULTS = {"lr": 5e-3, "weight_decay": 0.01}
TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-6}


class ThreeLayerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class TwoParameterNet(nn.Module):
    """A linear layer (weight and bias) and, outside any group until added later, an output scale."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def initial_groups(model: nn.Module) -> list[dict]:
    if isinstance(model, TwoParameterNet):
        return [{"params": list(model.linear.parameters())}]
    return [
        {"params": [model.fc1.weight, model.fc2.weight], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [model.fc1.bias, model.fc2.bias], "lr": 3e-3, "betas": (0.8, 0.99)},
    ]


def late_group(model: nn.Module) -> dict:
    if isinstance(model, TwoParameterNet):
        return {"params": [model.scale], "lr": 2e-2}
    return {"params": list(model.fc3.parameters()), "lr": 2e-2, "weight_decay": 0.0}


def build(model_cls: type[nn.Module], device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return model_cls().to(device)


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(16, 8)`` inputs and ``(16, 4)`` targets, the same on every rank."""
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=generator).to(device), torch.randn(16, 4, generator=generator).to(device)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, device: torch.device) -> None:
    x, y = batch(step, device)
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def assert_same_state_dicts(actual: dict, expected: dict, context: str, rtol: float = 1.3e-6,
                            atol: float = 1e-7) -> None:
    assert actual["param_groups"] == expected["param_groups"], context
    assert sorted(actual["state"]) == sorted(expected["state"]), context
    for index, state in expected["state"].items():
        assert_same_tensors(actual["state"][index], state, f"{context}, state of parameter {index}", rtol=rtol,
                            atol=atol)


def change_groups_on_schedule(step: int, optimizers_and_models: list[tuple], late_group: Callable,
                              step_adding_a_group: int, step_changing_lr: int) -> None:
    """At ``step_adding_a_group`` each optimizer takes its model's ``late_group``; at ``step_changing_lr`` each
    halves its first group's learning rate, as a learning-rate schedule does."""
    for optimizer, model in optimizers_and_models:
        if step == step_adding_a_group:
            optimizer.add_param_group(late_group(model))
        if step == step_changing_lr:
            optimizer.param_groups[0]["lr"] *= 0.5


def resumed_from(state_dict: dict, model: nn.Module, copy_model: Callable[[], nn.Module], sharded_cls: type,
                 initial_groups: Callable, late_group: Callable) -> tuple[tuple, tuple]:
    """``(model copy, sharded_cls over AdamW)`` and ``(model copy, plain AdamW)``, each model a copy of ``model``
    and each optimizer loaded from ``state_dict`` after its late group was added. Like torch's, the state dict holds
    the live state tensors and loading does not copy them: each optimizer gets its own deep copy, or they would all
    step the same moments."""
    resumed_model, plain_model = copy_model(), copy_model()
    for model_copy in (resumed_model, plain_model):
        model_copy.load_state_dict(model.state_dict())
    resumed = sharded_cls(initial_groups(resumed_model), torch.optim.AdamW, **DEFAULTS)
    plain = torch.optim.AdamW(initial_groups(plain_model), **DEFAULTS)
    for optimizer, model_copy in ((resumed, resumed_model), (plain, plain_model)):
        optimizer.add_param_group(late_group(model_copy))
        optimizer.load_state_dict(copy.deepcopy(state_dict))
    return (resumed_model, resumed), (plain_model, plain)


def check_ownership(sharded: ShardedOptimizer, rank: int, world_size: int, context: str) -> None:
    """Every parameter is stepped by exactly one rank, which alone holds its optimizer state."""
    all_params = [param for group in sharded.param_groups for param in group["params"]]
    local = {id(param) for group in sharded.local_optimizer.param_groups for param in group["params"]}
    owned_here = torch.tensor([float(id(param) in local) for param in all_params], device=all_params[0].device)
    owners_count = owned_here.clone()
    dist.all_reduce(owners_count)
    assert owners_count.tolist() == [1.0] * len(all_params), f"{context}: owners per parameter {owners_count.tolist()}"
    assert all(id(param) in local for param in sharded.local_optimizer.state), context
    expected_owned = [owner == rank for owners in sharded.owners for owner in owners]
    assert owned_here.bool().tolist() == expected_owned, context


def check_matches_unsharded(rank: int, world_size: int, device: torch.device, model_cls: type[nn.Module]) -> None:
    """10 AdamW steps with param groups, a group added later and a changed lr; then the state dict."""
    context = f"{model_cls.__name__}, world size {world_size}, rank {rank}"
    model, reference = build(model_cls, device), build(model_cls, device)
    sharded = ShardedOptimizer(initial_groups(model), torch.optim.AdamW, **DEFAULTS)
    unsharded = torch.optim.AdamW(initial_groups(reference), **DEFAULTS)
    assert hyperparameters(sharded) == hyperparameters(unsharded), context
    assert hyperparameters(sharded.local_optimizer) == hyperparameters(unsharded), context

    for step in range(STEPS):
        change_groups_on_schedule(step, [(sharded, model), (unsharded, reference)], late_group, STEP_ADDING_A_GROUP,
                                  STEP_CHANGING_LR)
        train_step(model, sharded, step, device)
        train_step(reference, unsharded, step, device)
        assert_same_parameters(model, reference, f"{context}, step {step}", **TOLERANCE)
    check_ownership(sharded, rank, world_size, context)
    if model_cls is TwoParameterNet and world_size == 3:
        # Largest first to the least-loaded rank: weight (32 floats), bias (4), then the late scale (4).
        assert sharded.owners == [[0, 1], [2]], f"{context}: owners {sharded.owners}"

    state_dict = sharded.state_dict()
    assert_same_state_dicts(state_dict, unsharded.state_dict(), f"{context}, state_dict()")

    # Round trip: a fresh sharded optimizer (and an unsharded one) loaded from it continue identically.
    (resumed_model, resumed), (plain_model, plain) = resumed_from(
        state_dict, model, lambda: build(model_cls, device), ShardedOptimizer, initial_groups, late_group)
    assert_same_state_dicts(resumed.state_dict(), state_dict, f"{context}, after load_state_dict")
    for step in range(STEPS, STEPS + 3):
        for pair in ((model, sharded), (reference, unsharded), (resumed_model, resumed), (plain_model, plain)):
            train_step(*pair, step, device)
        for other, name in (
            (model, "original"),
            (resumed_model, "resumed"),
            (plain_model, "unsharded from the state dict"),
        ):
            assert_same_parameters(other, reference, f"{context}, {name}, step {step}", **TOLERANCE)


def check_careless_use(rank: int, world_size: int, device: torch.device) -> None:
    """No parameters: refused naming it. Built before the model is wrapped in DDP: it trains the wrapped model (the
    wrapper keeps the module's parameters). Built before FSDP wraps the model: it raises at its first step."""
    with pytest.raises(ValueError, match="empty parameter list"):
        ShardedOptimizer([], torch.optim.AdamW, **DEFAULTS)
    model, reference = build(ThreeLayerNet, device), build(ThreeLayerNet, device)
    sharded = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **DEFAULTS)
    ddp_model = DDPIndividualParameters(model)
    unsharded = torch.optim.AdamW(reference.parameters(), **DEFAULTS)
    for step in range(3):
        x, y = batch(step, device)
        sharded.zero_grad()
        F.mse_loss(ddp_model(x), y).backward()
        ddp_model.finish_gradient_synchronization()
        sharded.step()
        train_step(reference, unsharded, step, device)
    assert_same_parameters(model, reference, f"built before DDP wrapping, rank {rank}", **TOLERANCE)
    model = build(ThreeLayerNet, device)
    early = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **DEFAULTS)
    fsdp = FSDP(model)
    F.mse_loss(fsdp(x), y).backward()
    fsdp.finish_gradient_synchronization()
    with pytest.raises(RuntimeError, match="ShardedOptimizer holds parameters of a module that FSDP has since wrapped"):
        early.step()


CHECKS = {
    "ThreeLayerNet": partial(check_matches_unsharded, model_cls=ThreeLayerNet),
    "TwoParameterNet": partial(check_matches_unsharded, model_cls=TwoParameterNet),
    "careless use": check_careless_use,
}


@pytest.mark.slow  # a spawn of 2 or 3 ranks: 10-20 s on two cores
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_optimizer_matches_unsharded(world_size):
    assert_all_passed(run_checks(CHECKS, world_size, timeout_s=180))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sharded_optimizer_with_nccl():
    assert_all_passed(run_checks(CHECKS, gpu_world_size(), backend="nccl", timeout_s=300))


def test_sharded_optimizer_on_one_rank_is_the_inner_optimizer():
    with one_rank_group():
        model, reference = build(ThreeLayerNet, torch.device("cpu")), build(ThreeLayerNet, torch.device("cpu"))
        sharded = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        unsharded = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            train_step(model, sharded, step, torch.device("cpu"))
            train_step(reference, unsharded, step, torch.device("cpu"))
        assert_same_parameters(model, reference, "one process")
        assert_same_state_dicts(sharded.state_dict(), unsharded.state_dict(), "one process")


def test_sharded_optimizer_without_process_group_names_the_fix():
    with pytest.raises(RuntimeError, match=r"ShardedOptimizer needs an initialised default process group: call "
                                           r"torch\.distributed\.init_process_group"):
        ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)


def test_optimizer_given_by_name_is_refused_naming_the_fix():
    with pytest.raises(TypeError, match="optimizer class such as torch.optim.AdamW, got 'AdamW'"):
        adapters.get_sharded_optimizer(nn.Linear(2, 2).parameters(), "AdamW", lr=0.1)
