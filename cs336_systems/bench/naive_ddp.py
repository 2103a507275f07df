"""Problem ``naive_ddp``: a toy model trained with every DDP variant and the sharded optimizer, each rank on its
slice of every batch; after the last step each variant's weights are compared with a single-process model that
started from rank 0's weights and trained on the full batches (:mod:`cs336_systems.parallel.ddp.toy_training`).

    python -m cs336_systems.bench.naive_ddp                  # 2 ranks: NCCL with 2+ GPUs, else gloo on CPU
    python -m cs336_systems.bench.naive_ddp --backend gloo --world-size 4 --steps 20
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from cs336_systems.parallel.ddp import variant_type
from cs336_systems.parallel.ddp.toy_training import SHARDED_OPTIMIZER, VARIANTS, ToyTraining, max_weight_difference
from cs336_systems.parallel.distributed import spawn


def train_all_variants(rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    failures = []
    for variant in args.variants:
        options = ToyTraining(args.steps, args.batch_size, args.lr, args.seed, args.atol)
        difference = max_weight_difference(variant, rank, world_size, device, options)
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


def parser() -> argparse.ArgumentParser:
    defaults = ToyTraining()
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
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="smoke test: one training step")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="full batch size, split over ranks (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--atol", type=float, default=defaults.atol,
                        help="largest weight difference accepted (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="give up if a run hangs this long")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    options = parser()
    args = options.parse_args(argv)
    if args.world_size < 1 or args.batch_size % args.world_size:
        options.error(
            f"--batch-size ({args.batch_size}) must be a positive multiple of --world-size ({args.world_size})"
        )
    if args.quick:
        args.steps = 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    backend, reason = choose_backend(args.backend, args.world_size)
    print(f"backend: {backend} ({reason}); world size {args.world_size}; batch {args.batch_size}", flush=True)
    spawn(train_all_variants, args.world_size, args, backend=backend, timeout_s=args.timeout_s)
    print("all variants match single-process training")


if __name__ == "__main__":
    sys.exit(main())
