"""Train a toy model with every DDP variant and the sharded optimizer; check the weights against one process.

Each rank starts from different random weights (the wrapper must broadcast rank 0's), trains on its
slice of every batch, and after the last step compares its weights with a single-process model that
started from rank 0's weights and trained on the full batches (loss averaged over the batch).

    python -m cs336_systems.parallel.ddp.toy_training                  # 2 ranks: NCCL with 2+ GPUs, else gloo on CPU
    python -m cs336_systems.parallel.ddp.toy_training --backend gloo --world-size 4 --steps 20
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.parallel.ddp import DataParallelModule, variant_type, wrap_ddp
from cs336_systems.parallel.distributed import spawn
from cs336_systems.parallel.sharded_optimizer import ShardedOptimizer

SHARDED_OPTIMIZER = "sharded-optimizer"
# Buckets of 0.002 MiB (about 500 fp32 elements) make several buckets of this small model.
SHARDED_OPTIMIZER_DDP = "bucketed_0.002mb"  # the DDP that the sharded optimizer trains under
VARIANTS = ("naive", "flat", "overlap", SHARDED_OPTIMIZER_DDP, SHARDED_OPTIMIZER)
IN_FEATURES, HIDDEN, OUT_FEATURES = 16, 32, 4


class ToyModel(nn.Module):
    """A three-layer MLP whose middle layer is frozen (it must never change, and match rank 0's)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.fc3 = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def max_weight_difference(variant: str, rank: int, world_size: int, device: torch.device, args) -> float:
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


def _train_all_variants(rank: int, world_size: int, args) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    failures = []
    for variant in args.variants:
        difference = max_weight_difference(variant, rank, world_size, device, args)
        matches = difference <= args.atol
        if rank == 0:
            verdict = "matches" if matches else "MISMATCH"
            print(
                f"{variant:>18}: max |w - w_single| = {difference:.2e} after {args.steps} steps: {verdict}", flush=True
            )
        if not matches:
            failures.append(variant)
    assert not failures, f"weights differ from single-process training for {failures} (atol={args.atol})"


def choose_backend(requested: str, world_size: int) -> tuple[str, str]:
    """The backend to use and why."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested != "auto":
        return requested, "as requested"
    if gpus >= world_size and dist.is_nccl_available():
        return "nccl", f"{gpus} GPUs, one per rank"
    return "gloo", f"{gpus} GPU(s) for {world_size} ranks: CPU processes"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="number of processes (default: 2)")
    parser.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto: NCCL when there is one GPU per rank, gloo on CPU otherwise",
    )
    parser.add_argument(
        "--variants", nargs="+", type=variant_type(SHARDED_OPTIMIZER), default=list(VARIANTS),
        help=f"what to check: DDP variants (naive, flat, overlap, bucketed_<N>mb, torch_ddp) or {SHARDED_OPTIMIZER} "
        f"(default: {' '.join(VARIANTS)})",
    )
    parser.add_argument("--steps", type=int, default=10, help="training steps (default: 10)")
    parser.add_argument("--batch-size", type=int, default=32, help="full batch size, split over ranks (default: 32)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default: 1e-2)")
    parser.add_argument("--atol", type=float, default=1e-5, help="largest weight difference accepted (default: 1e-5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="give up if a run hangs this long")
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.batch_size % args.world_size:
        parser.error(
            f"--batch-size ({args.batch_size}) must be a positive multiple of --world-size ({args.world_size})"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    backend, reason = choose_backend(args.backend, args.world_size)
    print(f"backend: {backend} ({reason}); world size {args.world_size}; batch {args.batch_size}", flush=True)
    spawn(_train_all_variants, args.world_size, args, backend=backend, timeout_s=args.timeout_s)
    print("all variants match single-process training")


if __name__ == "__main__":
    sys.exit(main())
