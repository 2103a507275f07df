"""All-reduce on one node (problem ``distributed_communication_single_node``).

All-reduce (SUM, in place) of float32 tensors of 1 MB, 10 MB, 100 MB and 1 GB (decimal megabytes), with
gloo on CPU processes for 2, 4 and 6 ranks and NCCL with one GPU per rank for every one of those world
sizes the machine has GPUs for. For each case: warm-up calls, then timed calls, each preceded by a
barrier and bracketed by device synchronisations; every rank times its own calls, the times are
gathered from all ranks (``all_gather_object``) and averaged over ranks, call by call.

Reported per case: time per call (mean, median), algorithm bandwidth ``algbw = bytes / time`` and bus
bandwidth ``busbw = algbw * 2 (n - 1) / n`` (the bytes each rank's link carries in a ring all-reduce,
which makes numbers comparable across world sizes; NCCL's tests use the same definition). The rows of
one backend and world size also give a latency-bandwidth model ``t = alpha + bytes / beta``
(:func:`fit_latency_bandwidth`), used by the DDP overhead model. A plot of time and bus bandwidth vs size,
one line per backend and world size, goes to ``writeup/figures/``.

One rank group is spawned per world size; inside it, NCCL runs on the default group and gloo on a
second (CPU) group. Under torchrun only torchrun's world size is measured.

Examples::

    python -m cs336_systems.bench.distributed_communication_single_node
    python -m cs336_systems.bench.distributed_communication_single_node --backends nccl --world-sizes 2 4
    torchrun --nproc_per_node=2 -m cs336_systems.bench.distributed_communication_single_node
"""

from __future__ import annotations

import os
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.bench.common import cli, result_store, timing
from cs336_systems.bench.common import distributed_launch as dl
from cs336_systems.bench.common.allreduce_fit import bus_bandwidth, fits_by_setting, latest_rows

PROBLEM = "distributed_communication_single_node"
SIZES_MB = [1, 10, 100, 1000]
QUICK_SIZES_MB = [0.01, 0.1]
WORLD_SIZES = [2, 4, 6]
BACKENDS = ["gloo", "nccl"]


def parser():
    p = cli.base_parser(__doc__)
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=BACKENDS,
                   help="nccl is skipped for world sizes with too few GPUs (default: both)")
    p.add_argument("--world-sizes", nargs="+", type=cli.positive_int, default=None, help=f"default {WORLD_SIZES}")
    p.add_argument("--sizes-mb", nargs="+", type=cli.positive_float, default=None,
                   help=f"tensor sizes in MB (default {SIZES_MB})")
    p.add_argument("--warmup", type=cli.non_negative_int, default=5,
                   help="warm-up calls, fewer when one call is slow (default 5)")
    p.add_argument("--iters", type=cli.positive_int, default=20, help="timed calls at most (default 20)")
    p.add_argument("--min-iters", type=cli.positive_int, default=3, help="timed calls at least (default 3)")
    p.add_argument("--budget-s", type=cli.positive_float, default=3.0,
                   help="timed calls per case are cut to about this many seconds (within the bounds above)")
    cli.add_figures_dir(p, "plots")
    p.add_argument("--timeout-s", type=cli.positive_float, default=1200.0, help="give up if a group hangs this long")
    return p


# ---------------------------------------------------------------------------------------------
# Measurement (every rank)
# ---------------------------------------------------------------------------------------------


def _timed_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    """Seconds of one all-reduce on this rank, started right after a barrier."""
    dist.barrier(group=group)
    timing.synchronize(tensor.device)
    start = timeit.default_timer()
    dist.all_reduce(tensor, group=group)
    timing.synchronize(tensor.device)
    return timeit.default_timer() - start


def measure_case(size_mb: float, group: dist.ProcessGroup | None, device: torch.device, args) -> dict[str, Any]:
    """Time all-reduces of ``size_mb`` MB on ``group``; per-call times averaged over ranks (every rank gets them).

    The number of warm-up and timed calls follows from the slowest rank's first call, so every rank
    makes the same calls. Values grow by a factor ``n`` per call; with at most ``warmup + iters`` calls
    of uniform [0, 1) data they stay far from float32 overflow for the world sizes here.
    """
    numel = int(size_mb * 1e6) // 4
    tensor = torch.rand(numel, dtype=torch.float32, device=device)
    first = max(dl.gather(_timed_all_reduce(tensor, group), group))
    warmup = max(0, min(args.warmup - 1, int(args.budget_s / 2 / first)))
    iters = max(args.min_iters, min(args.iters, int(args.budget_s / first)))
    for _ in range(warmup):
        _timed_all_reduce(tensor, group)
    mine = [_timed_all_reduce(tensor, group) for _ in range(iters)]
    per_rank = dl.gather(mine, group)
    seconds = dl.mean_over_ranks(per_rank)  # call i: mean over ranks
    mean_s = statistics.fmean(seconds)
    world_size = dist.get_world_size(group)
    algbw = numel * 4 / mean_s / 1e9
    return {
        "bytes": numel * 4,
        "warmup": warmup + 1,
        "iters": iters,
        **timing.summarize_ms(seconds),
        "rank_mean_ms": [statistics.fmean(times) * 1e3 for times in per_rank],
        "call_ms": [s * 1e3 for s in seconds],
        "algbw_gbps": algbw,
        "busbw_gbps": bus_bandwidth(algbw, world_size),
    }


def wanted_cases(args, world_size: int, backends: list[str]) -> list[dict[str, Any]]:
    return [{"backend": b, "world_size": world_size, "size_mb": s} for b in backends for s in args.sizes_mb]


def _worker(rank: int, world_size: int, args, backends: list[str]) -> None:
    default_backend = dist.get_backend()
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force) if rank == 0 else None
    cases = dl.from_rank0(store.pending(wanted_cases(args, world_size, backends)) if rank == 0 else None)
    for backend in backends:
        # Every rank creates every group, in the same order (new_group is collective).
        group = None if backend == default_backend else dist.new_group(backend=backend)
        device = dl.rank_device() if backend == "nccl" else torch.device("cpu")
        todo = [case for case in cases if case["backend"] == backend]
        for case in cli.progress(todo, f"{backend} x{world_size}") if rank == 0 else todo:
            result = measure_case(case["size_mb"], group, device, args)
            if rank == 0:
                store.add(case, result)
        timing.free_memory()


# ---------------------------------------------------------------------------------------------
# Latency-bandwidth model and plot (from the rows)
# ---------------------------------------------------------------------------------------------










def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Time per call and bus bandwidth vs size (log-log), one line per backend and world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in latest_rows(rows):
        lines.setdefault((row["backend"], row["world_size"]), []).append(row)
    fig, (ax_time, ax_bw) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (backend, world_size), line in sorted(lines.items()):
        line.sort(key=lambda r: r["bytes"])
        mb = [r["bytes"] / 1e6 for r in line]
        style = dict(marker="o" if backend == "nccl" else "s", linestyle="-" if backend == "nccl" else "--",
                     label=f"{backend} ({'GPUs' if backend == 'nccl' else 'CPU'}), {world_size} ranks")
        ax_time.plot(mb, [r["mean_ms"] for r in line], **style)
        ax_bw.plot(mb, [r["busbw_gbps"] for r in line], **style)
    for ax in (ax_time, ax_bw):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensor size (MB, float32)")
        ax.grid(True, which="both", alpha=0.3)
    ax_time.set_ylabel("time per all-reduce (ms, mean over ranks)")
    ax_bw.set_ylabel("bus bandwidth (GB/s)")
    ax_bw.legend(fontsize=8)
    gpu = rows[-1].get("env", {}).get("gpu_name") if rows else None
    how = {"gloo": "gloo on CPU processes", "nccl": "NCCL one GPU per rank"}
    backends = "; ".join(how[backend] for backend in sorted({backend for backend, _ in lines}))
    fig.suptitle(f"All-reduce on one node ({gpu or 'no GPU'}; {backends or 'no rows'})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def settings(args) -> list[tuple[int, str, list[str]]]:
    """(world size, default backend of its group, backends to measure) for every group to start."""
    out = []
    for world_size in args.world_sizes:
        has_gpus, reason = dl.choose_backend(world_size)
        backends = [b for b in args.backends if b == "gloo" or has_gpus == "nccl"]
        skipped = sorted(set(args.backends) - set(backends))
        if skipped and dl.is_rank0_process():
            print(f"# {world_size} ranks: skipping {', '.join(skipped)} ({reason})", file=sys.stderr)
        if backends:
            out.append((world_size, "nccl" if "nccl" in backends else "gloo", backends))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if dl.gpu_count() == 0 and dl.is_rank0_process():
        print("# no GPU found: gloo on CPU processes only", file=sys.stderr)
    if args.quick and dl.is_rank0_process():
        print("# --quick: small tensors, 2 ranks, few calls", file=sys.stderr)
    args.sizes_mb = args.sizes_mb or (QUICK_SIZES_MB if args.quick else SIZES_MB)
    args.world_sizes = args.world_sizes or ([2] if args.quick else WORLD_SIZES)
    if args.quick:
        args.warmup, args.iters, args.min_iters = 1, 3, 2
    if dl.under_torchrun():
        args.world_sizes = [int(os.environ["WORLD_SIZE"])]
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force)
    for world_size, backend, backends in settings(args):
        if store.pending(wanted_cases(args, world_size, backends)):  # else no group to start
            dl.launch(_worker, world_size, args, backends, backend=backend, timeout_s=args.timeout_s)
    if dl.is_rank0_process():
        report(args)


def report(args) -> None:
    """The table, the latency-bandwidth fits and the plot, from every row measured on this kind of GPU.

    Rows of machines with more GPUs of the same kind join in (NCCL with 4 ranks, say); of each case the
    latest row counts.
    """
    store = result_store.ResultStore(PROBLEM, args.results_dir)
    rows = [row for row in store.rows() if row.get("env", {}).get("gpu_name") == store.env["gpu_name"]]
    shown = sorted(latest_rows(rows), key=lambda r: (r["backend"], r["world_size"], r["bytes"]))
    cli.print_table(shown, ["backend", "world_size", "size_mb", "iters", "mean_ms", "median_ms", "algbw_gbps",
                                "busbw_gbps"], digits=3)
    fits = fits_by_setting(rows)
    print("\nlatency-bandwidth fits, t = alpha + bytes / beta:")
    cli.print_table(
        [{"backend": b, "world_size": n, "alpha_us": f.alpha_s * 1e6, "beta_gbps": f.beta_bytes_per_s / 1e9}
         for (b, n), f in fits.items()],
        ["backend", "world_size", "alpha_us", "beta_gbps"],
    )
    for backend, world_size in sorted({(r["backend"], r["world_size"]) for r in shown} - set(fits)):
        print(f"# {backend}, {world_size} ranks: no fit: it needs times at two or more sizes that grow with the "
              "size (tiny tensors, as --quick's, may take the same time at every size)")
    path = (args.figures_dir or result_store.FIGURES_DIR) / f"{PROBLEM}.png"
    plot(rows, path)
    print(f"# plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
