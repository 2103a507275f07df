"""A toy model trained with a DDP variant or the sharded optimizer, its weights checked against one process.

Each rank starts from different random weights (the wrapper must broadcast rank 0's), trains on its
slice of every batch, and after the last step compares its weights with a single-process model that
started from rank 0's weights and trained on the full batches (loss averaged over the batch). The command line
that runs every variant is ``python -m cs336_systems.bench.naive_ddp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.parallel.ddp import DataParallelModule, wrap_ddp
from cs336_systems.parallel.sharded_optimizer import ShardedOptimizer

SHARDED_OPTIMIZER = "sharded-optimizer"
# Buckets of 0.002 MiB (about 500 fp32 elements) make several buckets of this small model.
SHARDED_OPTIMIZER_DDP = "bucketed_0.002mb"  # the DDP that the sharded optimizer trains under
VARIANTS = ("naive", "flat", "overlap", SHARDED_OPTIMIZER_DDP, SHARDED_OPTIMIZER)
IN_FEATURES, HIDDEN, OUT_FEATURES = 16, 32, 4


@dataclass(frozen=True)
class ToyTraining:
    """How long and how the toy model trains, and the largest weight difference accepted."""

    steps: int = 10
    batch_size: int = 32  # the full batch, split over the ranks
    lr: float = 1e-2  # AdamW's
    seed: int = 0
    atol: float = 1e-5


class ToyModel(nn.Module):
    """A three-layer MLP whose middle layer is frozen (it must never change, and match rank 0's)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.fc3 = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def max_weight_difference(variant: str, rank: int, world_size: int, device: torch.device,
                          args: ToyTraining) -> float:
    """Train ``variant`` and the single-process reference side by side; the largest weight difference."""
    torch.manual_seed(args.seed + rank)
    ddp_model = wrap_ddp(SHARDED_OPTIMIZER_DDP if variant == SHARDED_OPTIMIZER else variant, ToyModel().to(device))
    own_wrapper = isinstance(ddp_model, DataParallelModule)
    torch.manual_seed(args.seed)  # the reference starts where rank 0 started
    reference = ToyModel().to(device)

    trainable = [param for param in ddp_model.parameters() if param.requires_grad]
    if variant == SHARDED_OPTIMIZER:
        optimizer = ShardedOptimizer(trainable, torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.1)
    reference_optimizer = torch.optim.AdamW(
        [param for param in reference.parameters() if param.requires_grad], lr=args.lr, weight_decay=0.1
    )

    data = torch.Generator().manual_seed(args.seed + 1)  # every rank draws the same full batches
    local_size = args.batch_size // world_size
    local = slice(rank * local_size, (rank + 1) * local_size)
    for _ in range(args.steps):
        x = torch.randn(args.batch_size, IN_FEATURES, generator=data).to(device)  # (batch, in)
        y = torch.randn(args.batch_size, OUT_FEATURES, generator=data).to(device)  # (batch, out)

        if own_wrapper:
            ddp_model.on_train_batch_start()
        optimizer.zero_grad()
        F.mse_loss(ddp_model(x[local]), y[local]).backward()
        if own_wrapper:  # PyTorch's DDP synchronises inside backward
            ddp_model.finish_gradient_synchronization()
        optimizer.step()

        reference_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        reference_optimizer.step()

    difference = torch.zeros((), device=device, dtype=torch.float64)
    for param, reference_param in zip(ddp_model.parameters(), reference.parameters()):
        difference = torch.maximum(difference, (param - reference_param).abs().max().double())
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    return difference.item()
