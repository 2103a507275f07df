"""Memory profile of the 2.7B model (problem ``memory_profiling``).

1. Peak allocated device memory for a forward pass and for a full training step (forward, loss,
   backward, AdamW), at context 128, 256 and 512, in fp32 and under bf16 autocast (rows; out of
   memory is a row).
2. For forward and for the training step (fp32, the longest context that fits): a CUDA memory
   history (``torch.cuda.memory._record_memory_history``) dumped as a snapshot pickle that
   https://pytorch.org/memory_viz loads (``--snapshot-dir``; large, kept out of git), our own PNG of
   the active-memory timeline (``writeup/figures/memory_<case>.png``), and the largest allocations
   with the Python line that made them (in the row).

Both read CUDA's caching allocator: on a machine without a CUDA GPU the tool says so and writes nothing.

Examples::

    python -m cs336_systems.bench.memory_profiling
    python -m cs336_systems.bench.memory_profiling --contexts 128 --dtypes fp32 --snapshot-dir /tmp/snapshots
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from cs336_systems.bench.common import cli, result_store, timing
from cs336_systems.bench.common.lm import DTYPES, SIZES, LMConfig, build_model, make_optimizer, make_step, random_batch
from cs336_systems.bench.common.memory import (
    active_memory_timeline,
    largest_allocations,
    plot_timeline,
    record_snapshot,
)

PROBLEM = "memory_profiling"
STEPS = 3  # the optimizer state appears in the first step; three show the steady pattern


def parser():
    p = cli.base_parser(__doc__)
    p.add_argument("--size", default=None, choices=list(SIZES), help="model size (default 2.7B)")
    p.add_argument("--contexts", nargs="+", type=int, default=None, help="context lengths (default 128 256 512)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--snapshot-dir", type=Path, default=Path("snapshots"), help="where snapshot pickles go")
    cli.add_figures_dir(p)
    p.add_argument("--no-timelines", action="store_true", help="peaks only, no snapshots or pictures")
    return p












def measure_peak(config: LMConfig, mode: str, dtype: str, device: torch.device) -> dict[str, Any]:
    """Peak allocated memory over ``STEPS`` steps of a freshly built model (weights included)."""
    timing.free_memory()
    model = build_model(config, device)
    optimizer = make_optimizer(model) if mode == "train_step" else None
    params_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    step = make_step(model, random_batch(config, device), mode, DTYPES[dtype], optimizer)
    try:
        with timing.peak_memory(device) as peak:
            for _ in range(STEPS):
                step(None)
        return {"peak_gb": peak.get("peak_gb"), "params_gb": params_gb}
    finally:
        del model, optimizer, step
        timing.free_memory()


def timeline_case(config: LMConfig, mode: str, device: torch.device, snapshot_dir: Path, figures_dir: Path) -> dict:
    """Snapshot, PNG and largest allocations of ``STEPS`` fp32 steps, recorded from model construction on."""
    timing.free_memory()
    name = f"{config.size}_{mode}_ctx{config.context_length}"
    holder: dict[str, Any] = {}

    def run():
        holder["model"] = model = build_model(config, device)
        optimizer = make_optimizer(model) if mode == "train_step" else None
        step = make_step(model, random_batch(config, device), mode, None, optimizer)
        for _ in range(STEPS):
            step(None)
        holder["optimizer"] = optimizer

    try:
        snapshot = record_snapshot(run, snapshot_dir / f"memory_{name}.pickle", device)
    finally:
        holder.clear()
        timing.free_memory()
    times, gbs = active_memory_timeline(snapshot)
    figure = figures_dir / f"memory_{name}.png"
    label = "forward only" if mode == "forward" else "full training step (AdamW)"
    plot_timeline(times, gbs, f"{config.size}, batch {config.batch_size}, context {config.context_length}, fp32: "
                  f"{STEPS} x {label}", figure)
    return {
        "figure": str(figure.relative_to(result_store.REPO_ROOT)) if figure.is_relative_to(result_store.REPO_ROOT) else str(figure),
        "timeline_peak_gb": max(gbs) if gbs else None,
        "largest_allocations": largest_allocations(snapshot),
    }


def main(argv: list[str] | None = None) -> None:
    args, device, tiny = cli.start(parser(), argv)
    if device.type != "cuda":
        # The tool records the CUDA caching allocator (peaks, memory history); a CPU has none: nothing to write.
        print("# no CUDA device: there is no CUDA memory to record, so no rows and no timelines", file=sys.stderr)
        return
    size = args.size or ("tiny" if tiny else "2.7B")
    contexts = args.contexts or ([16] if tiny else [128, 256, 512])
    figures_dir = args.figures_dir or result_store.FIGURES_DIR
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force)
    cases = [dict(size=size, context_length=c, batch_size=args.batch_size, mode=m, dtype=d, kind="peak")
             for c in contexts for m in ("forward", "train_step") for d in args.dtypes]
    for case in cli.progress(store.pending(cases), PROBLEM):
        config = LMConfig(size, case["context_length"], args.batch_size)
        store.add(case, result_store.measure_or_oom(lambda: measure_peak(config, case["mode"], case["dtype"], device)))
    cli.print_table(store.asked_rows(), ["size", "context_length", "mode", "dtype", "peak_gb", "oom"])
    if args.no_timelines:
        return
    measured = [r for r in store.rows() if r.get("kind") == "peak" and r.get("size") == size and r["dtype"] == "fp32"
                and r.get("device") == store.env["device"]]
    for mode in ("forward", "train_step"):
        fitting = sorted(r["context_length"] for r in measured if r["mode"] == mode and not r["oom"])
        if not fitting:
            continue
        case = dict(size=size, context_length=fitting[-1], batch_size=args.batch_size, mode=mode, dtype="fp32",
                    kind="timeline")
        if store.done(case):
            continue
        config = LMConfig(size, fitting[-1], args.batch_size)
        result = result_store.measure_or_oom(lambda: timeline_case(config, mode, device, args.snapshot_dir, figures_dir))
        store.add(case, result)
        print(f"# {mode}: {result.get('figure')}", file=sys.stderr)
        for alloc in result.get("largest_allocations", []):
            print(f"#   {alloc['mb']:9.1f} MB x{alloc['count']:4d}  {alloc['source']}", file=sys.stderr)


if __name__ == "__main__":
    main()
