"""Data-parallel training of the XL model on 2 GPUs, every DDP variant beside PyTorch's (problem ``ddp_benchmarking``).

Variants (all with the same data, the same AdamW and the same random weights, fp32 and bf16 autocast):

* ``naive``: one blocking all-reduce per parameter after backward; ``flat``: one all-reduce of all
  gradients flattened into one buffer; ``overlap``: one async all-reduce per parameter, launched by a
  gradient hook during backward; ``bucketed_<N>mb``: async all-reduces of buckets of at most N MiB;
  ``torch_ddp``: ``torch.nn.parallel.DistributedDataParallel`` with its defaults;
* ``local``: every rank trains its own batch alone, no wrapper, no communication. Its step time is the
  compute time of the per-rank batch, measured in the same run as the others (it is measured whenever
  anything else is, and its row written when it is missing).

Per variant and dtype, after warm-up steps, every step is timed on every rank (synchronised wall
clock) and averaged over ranks; the row holds the median step (``step_ms``), the communication time
``comm_ms`` and the exposed communication ``exposed_ms = step_ms - compute_ms``, ``compute_ms`` being
the ``local`` median of this run. ``comm_ms`` is the device time from the end of backward to the end of
``finish_gradient_synchronization()`` (CUDA events on the compute stream): for ``naive`` and ``flat``
the whole all-reduce time (plus the flattening copies), for ``overlap`` and the bucketed ones the wait
for the all-reduces still in flight when backward ends. PyTorch's DDP waits inside backward: no
``comm_ms``, only ``exposed_ms``.

``--trace`` records one more step of each of ``--trace-variants`` (default ``naive`` and ``overlap``, the
per-parameter overlapped one) with ``torch.profiler`` on every rank (Chrome traces under ``--trace-dir``, outside
git), draws the phases, compute and NCCL lanes of all ranks, one figure per variant and dtype, to
``writeup/figures/ddp_overlap_<variant>_<dtype>.png`` (:mod:`cs336_systems.bench.common.timeline`) and adds the
traced communication busy time, its share overlapped with compute and the rest (exposed) to the row.

With fewer GPUs than ranks the ranks are CPU processes (gloo) and the model is tiny, as the tool says.
Each (variant, dtype) runs on freshly spawned ranks (see ``launch_lm_benchmark``); ``--quick``, a smoke run, runs
a few variants (``naive``, ``bucketed_1mb``, ``torch_ddp``) in fp32 on one set of ranks, in about a minute on a CPU.
Rows print as one table at the end (with those measured by earlier runs).

Examples::

    python -m cs336_systems.bench.ddp_benchmarking                            # 2 GPUs, xl, every variant
    python -m cs336_systems.bench.ddp_benchmarking --variants naive overlap --dtypes fp32 --trace
    torchrun --nproc_per_node=2 -m cs336_systems.bench.ddp_benchmarking --dtypes fp32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.attention import ATTENTION_NAMES
from cs336_systems.bench.common import cli, model_sizes, result_store, timeline, timing
from cs336_systems.bench.common import distributed_launch as dl
from cs336_systems.bench.common.ddp_step import (
    LOCAL,
    VARIANTS,
    Marker,
    communication_calls,
    make_train_step,
    time_steps,
    variant_name,
    wrap,
)
from cs336_systems.bench.common.lm import DTYPES, LMConfig, build_model, make_optimizer, random_batch
from cs336_systems.parallel.ddp import bucket_size_mb

PROBLEM = "ddp_benchmarking"
TRACE_VARIANTS = ["naive", "overlap"]  # the writeup sets one against the other
DEFAULT_TRACE_DIR = Path(os.environ.get("OUT") or tempfile.gettempdir()) / "ddp_traces"
QUICK = dict(variants=["naive", "bucketed_1mb", "torch_ddp"], dtypes=["fp32"])
TABLE = ["variant", "dtype", "step_ms", "comm_ms", "compute_ms", "exposed_ms", "exposed_share", "n_buckets"]


def parser():
    p = cli.base_parser(__doc__)
    p.add_argument("--variants", nargs="+", type=variant_name, default=None,
                   help=f"default: all ({' '.join(QUICK['variants'])} with --quick)")
    p.add_argument("--dtypes", nargs="+", default=None, choices=["fp32", "bf16"], help="default: fp32 bf16 (fp32 "
                   "with --quick)")
    cli.add_model_size(p, multiple=False, default="xl; tiny on CPU")
    p.add_argument("--context-length", type=cli.positive_int, default=None, help="default 512 (32 on CPU)")
    p.add_argument("--batch-size", type=cli.positive_int, default=None, help="sequences per rank (default 4; 2 on CPU)")
    p.add_argument("--attention", default="naive", choices=ATTENTION_NAMES)
    p.add_argument("--world-size", type=cli.positive_int, default=2, help="ranks when not under torchrun (default 2)")
    p.add_argument("--warmup", type=cli.non_negative_int, default=3,
                   help="untimed steps per variant and dtype (default 3)")
    p.add_argument("--steps", type=cli.positive_int, default=10, help="timed steps per variant and dtype (default 10)")
    p.add_argument("--trace", action="store_true", help="profile one step of each --trace-variants and draw it")
    p.add_argument("--trace-variants", nargs="+", type=variant_name, default=TRACE_VARIANTS,
                   help=f"default {' '.join(TRACE_VARIANTS)}")
    p.add_argument("--trace-dir", type=Path, default=DEFAULT_TRACE_DIR,
                   help=f"raw traces (default {DEFAULT_TRACE_DIR})")
    cli.add_figures_dir(p)
    p.add_argument("--timeout-s", type=cli.positive_float, default=3600.0, help="give up if the run hangs this long")
    return p


# ---------------------------------------------------------------------------------------------
# One variant on one rank
# ---------------------------------------------------------------------------------------------


def trace_step(step, device: torch.device, path: Path) -> timeline.Timeline:
    """Profile one step into the Chrome trace ``path``; its compute and communication timeline."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        timing.synchronize(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return timeline.timeline_from_trace(timeline.load_trace(path))


def measure(variant: str, wrapped: nn.Module, optimizer, batch, dtype: str, device: torch.device, args) -> dict:
    """Median step and synchronisation times over steps, each step's time averaged over ranks."""
    marker = Marker(device)
    step = make_train_step(wrapped, optimizer, batch, DTYPES[dtype], marker)
    step_ms, sync_ms = time_steps(step, device, marker, args.warmup, args.steps)
    per_rank = dl.gather((step_ms, sync_ms))
    steps = dl.mean_over_ranks([s for s, _ in per_rank])
    syncs = dl.mean_over_ranks([c for _, c in per_rank])
    result = {
        "step_ms": statistics.median(steps),
        "step_mean_ms": statistics.fmean(steps),
        "step_min_ms": min(steps),
        "comm_ms": None if variant == "torch_ddp" else statistics.median(syncs),
        "steps_ms": steps,
        "rank_step_ms": [statistics.median(s) for s, _ in per_rank],
    }
    if args.trace and variant in args.trace_variants:
        result.update(trace_and_draw(step, variant, dtype, device, args, result["step_ms"]))
    return result


def trace_and_draw(step, variant: str, dtype: str, device: torch.device, args, step_ms: float) -> dict[str, Any]:
    """Profile one step on every rank, draw all ranks' timelines (rank 0) and summarise the overlap (mean over the
    ranks) and each rank's phases (``trace_ranks``)."""
    rank = dist.get_rank()
    path = args.trace_dir / f"ddp_{variant}_{dtype}_rank{rank}.json.gz"  # gzipped by the profiler: 10x smaller
    timelines = dl.gather(trace_step(step, device, path))  # gathered, not re-read: ranks may be on other hosts
    summaries = [timeline.overlap_summary(t) for t in timelines]
    figure = (args.figures_dir or result_store.FIGURES_DIR) / f"ddp_overlap_{variant}_{dtype}.png"
    if rank == 0:
        title = (f"{variant} DDP, {args.size} model, {dtype}, context {args.context_length}, "
                 f"{args.batch_size} sequences per rank, {result_store.environment()['device']}: one traced step "
                 f"(untraced median {step_ms:.0f} ms)")
        timeline.render_lanes(timelines, figure, title)
        print(f"# trace: {path.parent} (rank traces), figure {figure}", file=sys.stderr)

    def mean(key):
        values = [s[key] for s in summaries if s[key] is not None]
        return statistics.fmean(values) if values else None

    shown = figure.resolve()
    shown = shown.relative_to(result_store.REPO_ROOT) if shown.is_relative_to(result_store.REPO_ROOT) else shown
    # Per rank: a rank whose phases run longer (host-bound launches, say) keeps the other's collectives waiting.
    ranks = [{"span_ms": round(s["span_ms"], 2), "compute_busy_ms": round(s["compute_busy_ms"], 2),
              "comm_busy_ms": round(s["comm_busy_ms"], 2),
              **{f"{name}_ms": round(ms, 2) for name, ms in timeline.phase_lengths(t).items()}}
             for s, t in zip(summaries, timelines, strict=True)]
    return {"trace_comm_busy_ms": mean("comm_busy_ms"), "trace_comm_exposed_ms": mean("comm_exposed_ms"),
            "trace_overlap_share": mean("overlap_share"), "trace_ranks": ranks, "trace_figure": str(shown)}


# ---------------------------------------------------------------------------------------------
# Every variant, every rank
# ---------------------------------------------------------------------------------------------


def case(args, world_size: int, variant: str, dtype: str) -> dict[str, Any]:
    """The configuration keys of one row."""
    return dict(size=args.size, context_length=args.context_length, batch_size=args.batch_size,
                world_size=world_size, attention=args.attention, variant=variant, dtype=dtype)


def wanted_cases(args, world_size: int) -> list[dict[str, Any]]:
    return [case(args, world_size, v, d) for v in [LOCAL, *args.variants] for d in args.dtypes]


def _worker(rank: int, world_size: int, args) -> None:
    device = dl.rank_device()
    store = (result_store.ResultStore(PROBLEM, args.results_dir, args.force, quiet=True, edition=args.edition)
             if rank == 0 else None)
    pending = dl.from_rank0(store.pending(wanted_cases(args, world_size)) if rank == 0 else None)
    todo = [c for c in pending if c["variant"] != LOCAL]
    if not pending:
        return
    too_large = model_sizes.estimated_oom(args.size, "train_step", device)  # every rank holds all of it
    if too_large:
        for config in pending if rank == 0 else []:
            store.add(config, dict(too_large))
        return
    dtypes = [d for d in args.dtypes if any(c["dtype"] == d for c in pending)]
    variants = [LOCAL, *dict.fromkeys(c["variant"] for c in todo)]
    lm_config = LMConfig(args.size, args.context_length, args.batch_size)
    batch = random_batch(lm_config, device, generator_seed=rank)  # each rank its own sequences, same in every variant
    compute_ms: dict[str, float] = {}
    bar = cli.progress(variants, f"{PROBLEM} ({', '.join(dtypes)})") if rank == 0 else None
    for variant in variants:
        torch.manual_seed(0)  # the same weights for every variant (the wrappers also broadcast rank 0's)
        model = build_model(lm_config, device, args.attention)
        wrapped = wrap(variant, model)
        optimizer = make_optimizer(model)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        for dtype in dtypes if variant == LOCAL else [c["dtype"] for c in todo if c["variant"] == variant]:
            result = measure(variant, wrapped, optimizer, batch, dtype, device, args)
            if variant == LOCAL:
                compute_ms[dtype] = result["step_ms"]
            exposed = result["step_ms"] - compute_ms[dtype]
            result.update(compute_ms=compute_ms[dtype], exposed_ms=exposed, exposed_share=exposed / result["step_ms"],
                          n_buckets=communication_calls(variant, wrapped), grad_bytes=grad_bytes,
                          bucket_mb=bucket_size_mb(variant),
                          warmup=args.warmup, steps=args.steps, backend=dist.get_backend())
            config = case(args, world_size, variant, dtype)
            if rank == 0 and config in pending:
                store.add(config, result)
        del model, wrapped, optimizer
        timing.free_memory()
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.variants = args.variants or (QUICK["variants"] if args.quick else VARIANTS)
    args.dtypes = args.dtypes or (QUICK["dtypes"] if args.quick else ["fp32", "bf16"])
    # A smoke run shares one set of ranks; a measurement gives every variant fresh ones.
    dl.launch_lm_benchmark(PROBLEM, _worker, args, wanted_cases, isolate=None if args.quick else one_variant_each)
    if dl.is_rank0_process():
        world_size = int(os.environ["WORLD_SIZE"]) if dl.under_torchrun() else args.world_size
        store = result_store.ResultStore(PROBLEM, args.results_dir, quiet=True)
        store.pending(wanted_cases(args, world_size))
        print(f"# rows in {store.path}:", file=sys.stderr)
        cli.print_table(store.asked_rows(), TABLE)


def one_variant_each(args) -> list:
    """One launch per (variant, dtype): each on fresh ranks, with the compute-only reference (``local``) of
    its dtype measured first in the same processes."""
    return [argparse.Namespace(**{**vars(args), "variants": [variant], "dtypes": [dtype]})
            for dtype in args.dtypes for variant in args.variants]

if __name__ == "__main__":
    main()
