"""ZeRO-1 on flat buffers (``FlatShardedOptimizer``) against plain AdamW on the averaged gradients.

Each rank trains on its own data, as under DDP, and the optimizer averages the gradients itself; the
reference is one process stepping ``torch.optim.AdamW`` on the whole batch (every rank's data), whose
gradient is the average of the ranks' gradients. World sizes 1 (a group of one, in this process), 2 and 3 (gloo, with
padding); parameter counts that no world size divides, a 0-dim parameter, a frozen one, two param groups
with different hyper-parameters, a group added later and a learning-rate change; then each rank's
optimizer state (1/W of AdamW's) and the consolidated state dict. One spawn per world size runs it all.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.parallel.distributed import one_rank_group
from cs336_systems.parallel.zero1 import FlatShardedOptimizer
from tests._ddp_toy_models import assert_same_parameters
from tests._distributed import assert_all_passed, gpu_world_size, run_checks
from tests.test_optimizer_state_sharding import (
    assert_same_state_dicts,
    change_groups_on_schedule,
    hyperparameters,
    resumed_from,
)

STEPS = 8
STEP_ADDING_A_GROUP = 3
STEP_CHANGING_LR = 5
ROWS_PER_RANK = 6
DEFAULTS = {"lr": 5e-3, "weight_decay": 0.01}
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # float32 rounding of the averaged gradients, through 8 steps


class AwkwardNet(nn.Module):
    """Sizes no world size divides (7x13, 13, 13x5, 5), a 0-dim temperature, a frozen offset, a late head."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 5)
        self.temperature = nn.Parameter(torch.tensor(1.3))
        self.offset = nn.Parameter(torch.randn(5), requires_grad=False)
        self.head = nn.Parameter(0.1 * torch.randn(5))  # joins the optimizer at STEP_ADDING_A_GROUP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x) / self.temperature)) * (1 + self.head) + self.offset


def build() -> AwkwardNet:
    torch.manual_seed(0)
    return AwkwardNet()


def initial_groups(model: AwkwardNet) -> list[dict]:
    return [
        {"params": [model.fc1.weight, model.fc2.weight, model.offset], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [model.fc1.bias, model.fc2.bias, model.temperature], "lr": 3e-3, "betas": (0.8, 0.99)},
    ]


def late_group(model: AwkwardNet) -> dict:
    return {"params": [model.head], "lr": 2e-2, "weight_decay": 0.0}


def rank_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    device = torch.get_default_device()  # the rank's GPU under NCCL (run_checks)
    return (torch.randn(ROWS_PER_RANK, 7, generator=generator, device="cpu").to(device),
            torch.randn(ROWS_PER_RANK, 5, generator=generator, device="cpu").to(device))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch, set_to_none_by_model: bool = False) -> None:
    if set_to_none_by_model:
        model.zero_grad()  # .grad to None behind the optimizer's back: step() copies them back into the buffer
    else:
        optimizer.zero_grad()
    F.mse_loss(model(batch[0]), batch[1]).backward()
    optimizer.step()


def whole_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    batches = [rank_batch(step, rank) for rank in range(world_size)]
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def total(values: list[int]) -> list[int]:
    """Each value summed over the ranks."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return [int(v) for v in tensor.tolist()]


def check_state_is_sharded(flat: FlatShardedOptimizer, model: AwkwardNet, world_size: int, context: str) -> None:
    """AdamW's two moments per trainable parameter, split 1/W per rank, plus at most W - 1 padding per buffer."""
    trainable = sum(p.numel() for group in flat.param_groups for p in group["params"] if p.requires_grad)
    buckets = flat._all_buckets()
    assert len(buckets) == 3, f"{context}: one buffer per group (float32 only), got {len(buckets)}"
    padded = sum(bucket.flat_param.numel() for bucket in buckets)
    assert trainable <= padded < trainable + len(buckets) * world_size, context
    local = sum(v.numel() for state in flat.local_optimizer.state.values() for v in state.values() if v.dim() > 0)
    assert local == 2 * padded // world_size, f"{context}: {local} state elements here, {padded} padded parameters"
    assert total([local]) == [2 * padded], context
    assert not any(model.offset is p for p in flat.local_optimizer.state), context


def check_matches_plain_adamw(rank: int, world_size: int) -> None:
    context = f"world size {world_size}, rank {rank}"
    model, reference = build(), build()
    flat = FlatShardedOptimizer(initial_groups(model), torch.optim.AdamW, **DEFAULTS)
    plain = torch.optim.AdamW(initial_groups(reference), **DEFAULTS)
    assert hyperparameters(flat) == hyperparameters(plain), context
    assert model.fc1.weight.untyped_storage().data_ptr() == model.fc2.weight.untyped_storage().data_ptr(), context

    for step in range(STEPS):
        change_groups_on_schedule(step, [(flat, model), (plain, reference)], late_group, STEP_ADDING_A_GROUP,
                                  STEP_CHANGING_LR)
        train_step(model, flat, rank_batch(step, rank), set_to_none_by_model=step == 2)
        train_step(reference, plain, whole_batch(step, world_size))
        assert_same_parameters(model, reference, f"{context}, step {step}", **TOLERANCE)
    check_state_is_sharded(flat, model, world_size, context)

    state_dict = flat.state_dict()
    assert_same_state_dicts(state_dict, plain.state_dict(), f"{context}, state_dict()", **TOLERANCE)

    # Round trip: a fresh flat optimizer (and a plain one) loaded from it continue identically.
    (resumed_model, resumed), (plain_model, restored) = resumed_from(
        state_dict, model, build, FlatShardedOptimizer, initial_groups, late_group)
    assert_same_state_dicts(resumed.state_dict(), state_dict, f"{context}, after load_state_dict", **TOLERANCE)
    for step in range(STEPS, STEPS + 2):
        train_step(model, flat, rank_batch(step, rank))
        train_step(resumed_model, resumed, rank_batch(step, rank))
        train_step(reference, plain, whole_batch(step, world_size))
        train_step(plain_model, restored, whole_batch(step, world_size))
        for other, name in ((model, "original"), (resumed_model, "resumed"), (plain_model, "plain from it")):
            assert_same_parameters(other, reference, f"{context}, {name}, {step}", **TOLERANCE)


def check_on_the_rank_device(rank: int, world_size: int, device: torch.device) -> None:
    torch.set_default_device(device)  # models, batches and counts on the rank's GPU under NCCL
    check_matches_plain_adamw(rank, world_size)


CHECKS = {"matches plain AdamW": check_on_the_rank_device}


@pytest.fixture
def one_rank():
    """This process as a process group of one (the optimizer needs a group)."""
    with one_rank_group():
        yield


@pytest.mark.slow  # a spawn of 3 ranks: over 10 s on two cores
def test_flat_sharded_optimizer_matches_plain_adamw_on_gloo():
    """Three ranks, so that the flat buffers are padded and the shards uneven (the two-rank case adds nothing the
    sharded optimizer's two-rank test and the NCCL test do not cover)."""
    assert_all_passed(run_checks(CHECKS, 3, timeout_s=180))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_flat_sharded_optimizer_with_nccl():
    assert_all_passed(run_checks(CHECKS, gpu_world_size(), backend="nccl", timeout_s=300))


def test_flat_sharded_optimizer_on_one_rank():
    with one_rank_group():
        check_matches_plain_adamw(0, 1)


def test_flat_sharded_optimizer_without_process_group_names_the_fix():
    with pytest.raises(RuntimeError, match=r"FlatShardedOptimizer needs an initialised default process group"):
        FlatShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.AdamW, lr=0.1)


def test_lower_precision_parameters_step_a_float32_master(one_rank):
    torch.manual_seed(0)
    model = nn.Linear(5, 3).to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    flat = FlatShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    (bucket,) = flat._all_buckets()
    assert bucket.master.dtype == torch.float32 and bucket.flat_param.dtype == torch.bfloat16
    for _ in range(3):
        train_step(model, flat, (torch.randn(4, 5, dtype=torch.bfloat16), torch.randn(4, 3, dtype=torch.bfloat16)))
    assert all(p.dtype == torch.bfloat16 and not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert torch.equal(bucket.flat_param[: bucket.offsets[1]], bucket.master[: bucket.offsets[1]].bfloat16())
    assert all(v.dtype == torch.float32 for v in flat.local_optimizer.state[bucket.master].values() if v.dim())


def test_bad_input_is_refused_naming_the_fix(one_rank):
    with pytest.raises(TypeError, match="optimizer class such as torch.optim.AdamW, got 'AdamW'"):
        FlatShardedOptimizer(nn.Linear(2, 2).parameters(), "AdamW", lr=0.1)
    with pytest.raises(ValueError, match="empty parameter list"):
        FlatShardedOptimizer([], torch.optim.AdamW, lr=0.1)
    with pytest.raises(ValueError, match="dense floating-point parameters, got a torch.complex64 tensor"):
        FlatShardedOptimizer([nn.Parameter(torch.ones(3, dtype=torch.complex64))], torch.optim.SGD, lr=0.1)
    flat = FlatShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.AdamW, lr=0.1)
    with pytest.raises(ValueError, match="state dict has 2 param groups, optimizer has 1"):
        flat.load_state_dict({"state": {}, "param_groups": [{"params": [0]}, {"params": [1]}]})
