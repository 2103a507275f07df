"""An independent check of ``ddp_benchmarking``'s DDP ratio: one process per rank runs PyTorch's
``DistributedDataParallel`` and our bucketed DDP side by side in its own plain timing loop (no shared benchmark
code: its own model build, steps and synchronisation), alternating the two every few steps so that clock or
thermal drift hits both alike, and prints the ratio of their median step times beside the ratio in the CLI's
newest rows for the same configuration. The two should agree within 5 %.

Each GPU holds both models with their AdamW state: at xl that fits 141 GB H200s but not 80 GB H100s (it ran out of
memory there on 2026-11-25); on H100s check a smaller ``--size``.

    python scripts/ddp_ratio_check.py                         # 2 GPUs (NCCL), xl, context 512, 4 sequences a rank
    python scripts/ddp_ratio_check.py --dtype bf16 --bucket-mb 100
    python scripts/ddp_ratio_check.py --quick                 # 2 gloo ranks on CPU, the tiny model (seconds)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cs336_basics.model import MODEL_SIZES, BasicsTransformerLM
from cs336_basics.optimizer import AdamW
from cs336_systems.bench.common import result_store
from cs336_systems.parallel.ddp import wrap_ddp
from cs336_systems.parallel.distributed import spawn

RESULTS = Path(__file__).resolve().parents[1] / "writeup" / "results" / "ddp_benchmarking.jsonl"
TINY = dict(d_model=64, d_ff=256, num_layers=2, num_heads=4)


def _rank(rank: int, world_size: int, args: argparse.Namespace, out: str) -> None:
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    hparams = TINY if args.size == "tiny" else MODEL_SIZES[args.size]
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 10_000, (args.batch, args.context + 1), generator=gen).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    runners = {}
    for name in ("torch_ddp", f"bucketed_{args.bucket_mb:g}mb"):
        torch.manual_seed(0)
        model = BasicsTransformerLM(10_000, args.context, rope_theta=10_000.0, device=device, **hparams)
        if name == "torch_ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if device.type == "cuda" else None)
        else:
            wrapped = wrap_ddp(name, model)
        runners[name] = (wrapped, AdamW(model.parameters(), lr=1e-4, weight_decay=0.01))
    dtype = torch.bfloat16 if args.dtype == "bf16" else None

    def step(name: str) -> None:
        wrapped, optimizer = runners[name]
        if hasattr(wrapped, "on_train_batch_start"):
            wrapped.on_train_batch_start()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = wrapped(x)
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        if hasattr(wrapped, "finish_gradient_synchronization"):
            wrapped.finish_gradient_synchronization()
        optimizer.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    times: dict[str, list[float]] = {name: [] for name in runners}
    for name in runners:
        for _ in range(args.warmup):
            step(name)
    for _ in range(args.rounds):
        for name in runners:
            for _ in range(args.steps_per_round):
                sync()
                start = time.perf_counter()
                step(name)
                sync()
                times[name].append(time.perf_counter() - start)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, times)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


def cli_ratio(args: argparse.Namespace, bucketed: str) -> float | None:
    """Our bucketed DDP over PyTorch's DDP in the CLI's newest rows of this configuration (None if absent)."""
    if not RESULTS.exists():
        return None
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    newest = {}
    for row in rows:
        if (row.get("size"), row.get("context_length"), row.get("dtype")) == (args.size, args.context, args.dtype):
            newest[row["variant"]] = row
    if "torch_ddp" in newest and bucketed in newest:
        return newest[bucketed]["step_ms"] / newest["torch_ddp"]["step_ms"]
    return None


def write_row(args: argparse.Namespace, world_size: int, medians: dict[str, float], bucketed: str) -> None:
    """One row of ``ddp_ratio_check.jsonl`` (through the benchmarks' result store): both median steps and their
    ratio. Every run appends its own row; the writeup reads the file as a log."""
    default = result_store.RESULTS_DIR if args.backend == "nccl" else result_store.SCRATCH_DIR / "results"
    store = result_store.ResultStore("ddp_ratio_check", args.results_dir or default)
    config = {"size": args.size, "context_length": args.context, "batch_size": args.batch, "dtype": args.dtype,
              "bucket_mb": args.bucket_mb, "world_size": world_size, "backend": args.backend}
    store.add(config, {"torch_ddp_ms": medians["torch_ddp"] * 1e3, "bucketed_ms": medians[bucketed] * 1e3,
                       "ratio": medians[bucketed] / medians["torch_ddp"]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default=None, choices=[*MODEL_SIZES, "tiny"])
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="sequences per rank")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--bucket-mb", type=float, default=100.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 gloo ranks on CPU, the tiny model")
    p.add_argument("--results-dir", type=Path, default=None,
                   help=f"where the row goes (default {result_store.RESULTS_DIR} on GPUs, "
                        f"{result_store.SCRATCH_DIR / 'results'} on gloo)")
    args = p.parse_args()
    gpus = torch.cuda.device_count()
    args.backend = "nccl" if gpus >= 2 and not args.quick else "gloo"
    tiny = args.backend == "gloo"
    args.size = args.size or ("tiny" if tiny else "xl")
    args.context = args.context or (32 if tiny else 512)
    args.batch = args.batch or (2 if tiny else 4)
    if args.quick:
        args.warmup, args.rounds, args.steps_per_round = 1, 2, 1
    out = Path(f"/tmp/ddp_ratio_check_{time.time_ns()}.json")
    spawn(_rank, 2 if tiny else gpus, args, str(out), backend=args.backend, timeout_s=1800)
    per_rank = json.loads(out.read_text())
    bucketed = f"bucketed_{args.bucket_mb:g}mb"
    # A step's time is the slowest rank's; each rank's steps were taken between the same barriers.
    medians = {name: statistics.median(max(r[name][i] for r in per_rank) for i in range(len(per_rank[0][name])))
               for name in per_rank[0]}
    ratio = medians[bucketed] / medians["torch_ddp"]
    print(f"# {len(per_rank)} ranks, {args.backend}, {args.size}, context {args.context}, {args.batch} sequences a rank, {args.dtype}")
    for name, seconds in medians.items():
        print(f"{name:>16}: {seconds * 1e3:9.2f} ms (median step)")
    print(f"{'plain loop ratio':>16}: {ratio:.3f} ({bucketed} / torch_ddp)")
    write_row(args, len(per_rank), medians, bucketed)
    reference = cli_ratio(args, bucketed)
    if reference is None:
        print("# no ddp_benchmarking rows of this configuration to compare with")
    else:
        agree = abs(ratio / reference - 1) <= 0.05
        print(f"{'CLI rows ratio':>16}: {reference:.3f}; agreement within 5 %: {agree}")


if __name__ == "__main__":
    main()
