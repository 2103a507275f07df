"""Memory profile of the 2.7B model (problem ``memory_profiling``).

1. Peak allocated device memory of an inference forward pass (``torch.inference_mode``: no autograd graph), of
   a forward pass with autograd recording (as in training) and of a full training step (forward, loss, backward,
   AdamW), at context 128, 256 and 512, in fp32 and under bf16 autocast (rows; out of memory is a row).
2. At the longest context that fits: a CUDA memory history (``torch.cuda.memory._record_memory_history``)
   of three inference forward passes, in fp32 and in bf16, recorded once the model is built (its weights are
   memory alive before the recording), and of three fp32 training steps, recorded from the model's
   construction on. Each is dumped as the snapshot pickle that https://pytorch.org/memory_viz loads
   (``--snapshot-dir``; large, kept out of git), drawn as our own PNG of its active-memory timeline
   (``writeup/figures/memory_<size>_<mode>_<dtype>_ctx<context>.png``), and its largest allocations, each with
   the innermost frame of the model code that made it and its call chain, go in the row.

``--render PICKLE ...`` draws the timelines of snapshot pickles already dumped (on any machine) and prints
their largest allocations, without measuring. Measuring reads CUDA's caching allocator: on a machine without
a CUDA GPU the tool says so and writes nothing.

Examples::

    python -m cs336_systems.bench.memory_profiling
    python -m cs336_systems.bench.memory_profiling --contexts 128 --dtypes fp32 --snapshot-dir /tmp/snapshots
    python -m cs336_systems.bench.memory_profiling --render /tmp/snapshots/memory_2.7B_inference_fp32_ctx512.pickle
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch

from cs336_systems.bench.common import cli, result_store, timing
from cs336_systems.bench.common.lm import DTYPES, LMConfig, build_model, make_optimizer, make_step, random_batch
from cs336_systems.bench.common.memory import largest_allocations, load_snapshot, record_snapshot, render_snapshot

PROBLEM = "memory_profiling"
STEPS = 3  # the optimizer state appears in the first step; three show the steady pattern
# "inference": the forward under torch.inference_mode; "forward": with autograd recording, as in training.
PEAK_MODES = ("inference", "forward", "train_step")
MODE_TITLE = {"inference": "forward (inference)", "forward": "forward (autograd recording)",
              "train_step": "training step (AdamW)"}


def parser():
    p = cli.base_parser(__doc__)
    cli.add_model_size(p, multiple=False, default="the 2.7B model: 2025's 2.7B, 2026's xl")
    p.add_argument("--contexts", nargs="+", type=cli.positive_int, default=None,
                   help="context lengths (default 128 256 512)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--batch-size", type=cli.positive_int, default=4)
    p.add_argument("--snapshot-dir", type=Path, default=Path("snapshots"), help="where snapshot pickles go")
    cli.add_figures_dir(p)
    p.add_argument("--no-timelines", action="store_true", help="peaks only, no snapshots or pictures")
    p.add_argument("--render", nargs="+", type=cli.existing_file, default=None, metavar="PICKLE",
                   help="draw these snapshot pickles' timelines into --figures-dir and print their largest "
                        "allocations; measures nothing")
    return p


def profiled_step(config: LMConfig, mode: str, dtype: str, device: torch.device) -> tuple[dict[str, Any], Any]:
    """A fresh model (with its optimizer for a training step) and ``step()`` of ``mode``; the first value holds
    the model and optimizer, so that the caller decides when they are freed."""
    held: dict[str, Any] = {"model": build_model(config, device)}
    held["optimizer"] = make_optimizer(held["model"]) if mode == "train_step" else None
    step = make_step(held["model"], random_batch(config, device), "forward" if mode == "inference" else mode,
                     DTYPES[dtype], held["optimizer"])

    def run() -> None:
        with torch.inference_mode() if mode == "inference" else contextlib.nullcontext():
            step(None)

    return held, run


def measure_peak(config: LMConfig, mode: str, dtype: str, device: torch.device) -> dict[str, Any]:
    """Peak allocated memory over ``STEPS`` steps of a freshly built model (weights included)."""
    timing.free_memory()
    state, step = profiled_step(config, mode, dtype, device)
    params_gb = sum(p.numel() * p.element_size() for p in state["model"].parameters()) / 1e9
    try:
        with timing.peak_memory(device) as peak:
            for _ in range(STEPS):
                step()
        return {"peak_gb": peak.get("peak_gb"), "params_gb": params_gb}
    finally:
        del state, step
        timing.free_memory()


def timeline_name(config: LMConfig, mode: str, dtype: str) -> str:
    return f"memory_{config.size}_{mode}_{dtype}_ctx{config.context_length}"


def timeline_case(config: LMConfig, mode: str, dtype: str, device: torch.device, snapshot_dir: Path,
                  figures_dir: Path) -> dict:
    """Snapshot, PNG and largest allocations of ``STEPS`` steps of ``mode``. A training step is recorded from the
    model's construction on; the inference forward once the model is built, so that the trace holds the forward
    pass alone (the weights are memory alive before it)."""
    timing.free_memory()
    name = timeline_name(config, mode, dtype)
    held: dict[str, Any] = {}

    def build():
        held["state"], held["step"] = profiled_step(config, mode, dtype, device)

    def steps():
        for _ in range(STEPS):
            held["step"]()

    try:
        if mode == "inference":
            build()
            snapshot = record_snapshot(steps, snapshot_dir / f"{name}.pickle", device)
        else:
            snapshot = record_snapshot(lambda: (build(), steps()), snapshot_dir / f"{name}.pickle", device)
    finally:
        held.clear()
        timing.free_memory()
    figure = figures_dir / f"{name}.png"
    title = (f"{config.size}, batch {config.batch_size}, context {config.context_length}, {dtype}: "
             f"{STEPS} x {MODE_TITLE[mode]}")
    timeline = render_snapshot(snapshot, figure, title)
    shown = figure.resolve()
    return {
        "figure": str(shown.relative_to(result_store.REPO_ROOT) if shown.is_relative_to(result_store.REPO_ROOT) else shown),
        "snapshot": f"{name}.pickle",
        "timeline_peak_gb": timeline.peak_gb,
        "largest_allocations": largest_allocations(snapshot),
    }


def print_allocations(title: str, allocations: list[dict[str, Any]]) -> None:
    print(f"# {title}", file=sys.stderr)
    for alloc in allocations:
        chain = " <- ".join(alloc.get("stack", [])[1:3])
        print(f"#   {alloc['mb']:9.1f} MiB x{alloc['count']:4d}  {alloc['source']}"
              f"{f'  (from {chain})' if chain else ''}", file=sys.stderr)


def render_pickles(pickles: list[Path], figures_dir: Path) -> None:
    """Draw each snapshot pickle's timeline to ``<figures_dir>/<pickle name>.png``; print its largest allocations."""
    for path in pickles:
        snapshot = load_snapshot(path)
        figure = figures_dir / f"{path.stem}.png"
        timeline = render_snapshot(snapshot, figure, f"{path.stem}: active memory")
        print_allocations(f"{path}: {figure}, peak {timeline.peak_gb or 0:.2f} GB", largest_allocations(snapshot))


def record_timelines(args, store: result_store.ResultStore, size: str, device: torch.device, figures_dir: Path) -> None:
    """The timeline cases (inference in every dtype, the fp32 training step) at the longest context whose peak
    row on this device did not run out of memory."""
    measured = [r for r in store.rows() if r.get("kind") == "peak" and r.get("size") == size
                and r.get("device") == store.env["device"] and not r["oom"]]
    for mode, dtype in [*(("inference", d) for d in args.dtypes), ("train_step", "fp32")]:
        fitting = sorted(r["context_length"] for r in measured if r["mode"] == mode and r["dtype"] == dtype)
        if not fitting:
            continue
        case = dict(size=size, context_length=fitting[-1], batch_size=args.batch_size, mode=mode, dtype=dtype,
                    kind="timeline")
        if store.done(case):
            continue
        config = LMConfig(size, fitting[-1], args.batch_size)
        result = result_store.measure_or_oom(
            lambda: timeline_case(config, mode, dtype, device, args.snapshot_dir, figures_dir))
        store.add(case, result)
        print_allocations(f"{mode} {dtype}: {result.get('figure')}", result.get("largest_allocations", []))


def main(argv: list[str] | None = None) -> None:
    args, device, tiny = cli.start(parser(), argv)
    figures_dir = args.figures_dir or result_store.FIGURES_DIR
    if args.render:
        render_pickles(args.render, figures_dir)
        return
    if device.type != "cuda":
        # The tool records the CUDA caching allocator (peaks, memory history); a CPU has none: nothing to write.
        print("# no CUDA device: there is no CUDA memory to record, so no rows and no timelines", file=sys.stderr)
        return
    size = args.size or ("tiny" if tiny else "2.7B")
    contexts = args.contexts or ([16] if tiny else [128, 256, 512])
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force, edition=args.edition)
    cases = [dict(size=size, context_length=c, batch_size=args.batch_size, mode=m, dtype=d, kind="peak")
             for c in contexts for m in PEAK_MODES for d in args.dtypes]
    for case in cli.progress(store.pending(cases), PROBLEM):
        config = LMConfig(size, case["context_length"], args.batch_size)
        store.add(case, result_store.measure_or_oom(lambda: measure_peak(config, case["mode"], case["dtype"], device)))
    cli.print_table(store.asked_rows(), ["size", "context_length", "mode", "dtype", "peak_gb", "oom"])
    if not args.no_timelines:
        record_timelines(args, store, size, device, figures_dir)


if __name__ == "__main__":
    main()
