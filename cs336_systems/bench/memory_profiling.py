"""Memory profile of the 2.7B model (problem ``memory_profiling``), in three parts (``--parts``).

``peaks``: the peak allocated device memory of an inference forward pass (``torch.inference_mode``: no autograd
graph), of a forward pass with autograd recording (as in training) and of a full training step (forward, loss,
backward, AdamW), at contexts 128 and 2048 (``--contexts``; 256 and 512 too), in fp32 and under bf16 autocast.
Out of memory (a forward pass with autograd or a training step at 2048, whose 32 blocks each save gigabytes for
backward; the training step's weights, gradients and Adam's two moments alone take 16 bytes a parameter, 55 GB for the
3.4e9 parameters with the 10,000-word vocabulary) is a row.

``residuals``: what one Transformer block saves for backward, by the operation that made each saved tensor, and the
gradients one block's backward produces, read from how the allocated memory changes over each block's backward
(:mod:`cs336_systems.bench.common.block_memory`). Nsight Systems, which the handout uses for this, does not run on
our GPU machines; saved-tensor hooks, a dispatch mode and the caching allocator's counters give the same numbers.

``timelines``: at the longest context whose peak fits, a CUDA memory history
(``torch.cuda.memory._record_memory_history``) of one inference forward pass (fp32 and bf16) and of one forward
pass with autograd (fp32), recorded once the model is built (its weights are alive before the recording), and of
two fp32 training steps recorded from the model's construction on (the optimizer state appears in the first).
Each is dumped as the snapshot pickle that https://pytorch.org/memory_viz loads (``--snapshot-dir``; large, kept
out of git), drawn as our PNG of its active-memory timeline with every allocation coloured by what it holds,
written as PyTorch's own viewer page (``writeup/figures/memory_<size>_<mode>_<dtype>_ctx<context>.html``, where it
has at most ``--html-limit-mib``), and its largest allocations, each with the innermost frame of the model code
that made it and its call chain, go in the row.

``--render PICKLE ...`` draws the timelines (and viewer pages) of snapshot pickles already dumped, on any machine,
and prints their largest allocations, without measuring. Measuring reads CUDA's caching allocator: on a machine
without a CUDA GPU the tool says so and writes nothing.

Examples::

    python -m cs336_systems.bench.memory_profiling
    python -m cs336_systems.bench.memory_profiling --contexts 128 256 512 --dtypes fp32 --parts peaks
    python -m cs336_systems.bench.memory_profiling --render snapshots/memory_2.7B_inference_fp32_ctx2048.pickle
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch

from cs336_systems.bench.common import block_memory, cli, result_store, timing
from cs336_systems.bench.common.lm import DTYPES, LMConfig, build_model, make_optimizer, make_step, random_batch
from cs336_systems.bench.common.memory import (
    VIEWER_LIMIT_BYTES,
    active_memory_timeline,
    largest_allocations,
    load_snapshot,
    plot_timeline,
    record_snapshot,
    write_viewer_html,
)

PROBLEM = "memory_profiling"
STEPS = 3  # steps of a peak measurement: the optimizer state appears in the first step
# "inference": the forward under torch.inference_mode; "forward": with autograd recording, as in training.
PEAK_MODES = ("inference", "forward", "train_step")
MODE_TITLE = {"inference": "forward (inference)", "forward": "forward (autograd recording)",
              "train_step": "training step (AdamW)"}
# Passes in a snapshot: few, so that the viewer page stays small; two training steps show the first (which makes the
# optimizer state) and one as every later step is.
TIMELINE_STEPS = {"inference": 1, "forward": 1, "train_step": 2}
PARTS = ("peaks", "residuals", "timelines")
BLOCK_WINDOW = 4  # consecutive blocks run forward and backward for the residuals


def parser():
    p = cli.base_parser(__doc__)
    cli.add_model_size(p, multiple=False, default="the 2.7B model: 2025's 2.7B, 2026's xl")
    p.add_argument("--contexts", nargs="+", type=cli.positive_int, default=None,
                   help="context lengths (default 128 2048)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--batch-size", type=cli.positive_int, default=4)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="what to measure (default all)")
    p.add_argument("--snapshot-dir", type=Path, default=Path("snapshots"), help="where snapshot pickles go")
    cli.add_figures_dir(p, "PNGs and viewer pages")
    p.add_argument("--html-limit-mib", type=float, default=4.0,
                   help="write a viewer page only up to this size (0: always)")
    p.add_argument("--render", nargs="+", type=cli.existing_file, default=None, metavar="PICKLE",
                   help="draw these snapshot pickles' timelines and viewer pages into --figures-dir and print their "
                        "largest allocations; measures nothing")
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


def measure_residuals(config: LMConfig, dtype: str, device: torch.device) -> dict[str, Any]:
    """:func:`block_memory.measure_blocks` on a fresh model, reading the caching allocator."""
    timing.free_memory()
    model = build_model(config, device)
    try:
        tokens, _ = random_batch(config, device)
        return block_memory.measure_blocks(model, tokens, DTYPES[dtype], lambda: torch.cuda.memory_allocated(device),
                                           BLOCK_WINDOW)
    finally:
        del model
        timing.free_memory()


def timeline_name(config: LMConfig, mode: str, dtype: str) -> str:
    return f"memory_{config.size}_{mode}_{dtype}_ctx{config.context_length}"


def shown_path(path: Path) -> str:
    """``path`` from the repository root where it lies inside it (as rows name figures)."""
    path = path.resolve()
    return str(path.relative_to(result_store.REPO_ROOT) if path.is_relative_to(result_store.REPO_ROOT) else path)


def draw(snapshot: dict, stem: str, title: str, figures_dir: Path, html_limit_bytes: int) -> dict[str, Any]:
    """The PNG of a snapshot's timeline and its viewer page (``html`` None where the page is over the limit; 0: no
    limit), with what the row keeps of them."""
    figure = figures_dir / f"{stem}.png"
    timeline = active_memory_timeline(snapshot)
    plot_timeline(timeline, title, figure)
    page = figures_dir / f"{stem}.html"
    page_bytes = write_viewer_html(snapshot, page, html_limit_bytes or sys.maxsize)
    written = page_bytes <= (html_limit_bytes or sys.maxsize)
    return {
        "figure": shown_path(figure),
        "html": shown_path(page) if written else None,
        "html_bytes": page_bytes,
        "timeline_peak_gb": timeline.peak_gb,
        "before_recording_gb": timeline.before_gb,
        "peak_by_category_gb": timeline.at_peak(),
    }


def timeline_case(config: LMConfig, mode: str, dtype: str, device: torch.device, snapshot_dir: Path,
                  figures_dir: Path, html_limit_bytes: int = VIEWER_LIMIT_BYTES) -> dict:
    """Snapshot, PNG, viewer page and largest allocations of ``TIMELINE_STEPS[mode]`` steps of ``mode``. A training
    step is recorded from the model's construction on; a forward pass once the model is built, so that the trace
    holds the forward pass alone (the weights are memory alive before it)."""
    timing.free_memory()
    name = timeline_name(config, mode, dtype)
    steps = TIMELINE_STEPS[mode]
    held: dict[str, Any] = {}

    def build():
        held["state"], held["step"] = profiled_step(config, mode, dtype, device)

    def run():
        for _ in range(steps):
            held["step"]()

    pickle_path = snapshot_dir / f"{name}.pickle"
    try:
        if mode == "train_step":
            snapshot = record_snapshot(lambda: (build(), run()), pickle_path, device)
        else:
            build()
            snapshot = record_snapshot(run, pickle_path, device)
    finally:
        held.clear()
        timing.free_memory()
    title = (f"{config.size}, batch {config.batch_size}, context {config.context_length}, {dtype}: "
             f"{steps} x {MODE_TITLE[mode]}")
    row = {"snapshot": pickle_path.name, "steps_recorded": steps,
           **draw(snapshot, name, title, figures_dir, html_limit_bytes)}
    if row["html"] is None:
        row["html_note"] = (f"viewer page of {row['html_bytes'] / 2**20:.1f} MiB not written: "
                            f"python -m cs336_systems.bench.memory_profiling --render {pickle_path} --html-limit-mib 0")
    row["largest_allocations"] = largest_allocations(snapshot)
    return row


def print_allocations(title: str, allocations: list[dict[str, Any]]) -> None:
    print(f"# {title}", file=sys.stderr)
    for alloc in allocations:
        chain = " <- ".join(alloc.get("stack", [])[1:3])
        print(f"#   {alloc['mb']:9.1f} MiB x{alloc['count']:4d}  {alloc['source']}"
              f"{f'  (from {chain})' if chain else ''}", file=sys.stderr)


def render_pickles(pickles: list[Path], figures_dir: Path, html_limit_bytes: int) -> None:
    """Draw each snapshot pickle's timeline to ``<figures_dir>/<pickle name>.png`` (and its viewer page beside it);
    print its largest allocations."""
    for path in pickles:
        snapshot = load_snapshot(path)
        drawn = draw(snapshot, path.stem, f"{path.stem}: active memory", figures_dir, html_limit_bytes)
        page = drawn["html"] or f"no viewer page ({drawn['html_bytes'] / 2**20:.1f} MiB over the limit)"
        print_allocations(f"{path}: {drawn['figure']}, {page}, peak {drawn['timeline_peak_gb'] or 0:.2f} GB",
                          largest_allocations(snapshot))


def timeline_cases(dtypes: list[str]) -> list[tuple[str, str]]:
    """(mode, dtype) of the recorded timelines: the inference forward in every dtype, the fp32 forward with autograd
    and the fp32 training step."""
    return [*(("inference", d) for d in dtypes), ("forward", "fp32"), ("train_step", "fp32")]


def record_timelines(args, store: result_store.ResultStore, size: str, device: torch.device, figures_dir: Path) -> None:
    """The timeline cases at the longest context whose peak row on this device did not run out of memory."""
    measured = [r for r in store.rows() if r.get("kind") == "peak" and r.get("size") == size
                and r.get("device") == store.env["device"] and not r["oom"]
                and r.get("batch_size") == args.batch_size and r["context_length"] in args.contexts]
    for mode, dtype in timeline_cases(args.dtypes):
        fitting = sorted(r["context_length"] for r in measured if r["mode"] == mode and r["dtype"] == dtype)
        if not fitting:
            print(f"# no {mode} {dtype} timeline: no peak of it fits (or none is measured)", file=sys.stderr)
            continue
        case = dict(size=size, context_length=fitting[-1], batch_size=args.batch_size, mode=mode, dtype=dtype,
                    kind="timeline")
        if store.done(case):
            continue
        config = LMConfig(size, fitting[-1], args.batch_size)
        limit = int(args.html_limit_mib * 2**20)
        result = result_store.measure_or_oom(
            lambda: timeline_case(config, mode, dtype, device, args.snapshot_dir, figures_dir, limit))
        store.add(case, result)
        print_allocations(f"{mode} {dtype}: {result.get('figure')}", result.get("largest_allocations", []))


def record_residuals(args, store: result_store.ResultStore, size: str, device: torch.device) -> None:
    cases = [dict(size=size, context_length=c, batch_size=args.batch_size, dtype=d, kind="block_residuals")
             for c in args.contexts for d in args.dtypes]
    for case in cli.progress(store.pending(cases), f"{PROBLEM} residuals"):
        config = LMConfig(size, case["context_length"], args.batch_size)
        store.add(case, result_store.measure_or_oom(lambda: measure_residuals(config, case["dtype"], device)))
    columns = ["context_length", "dtype", "residual_mib", "gradient_bytes_measured", "gradient_bytes_expected", "oom"]
    cli.print_table([r for r in store.asked_rows() if r["kind"] == "block_residuals"], columns)


def record_peaks(args, store: result_store.ResultStore, size: str, device: torch.device) -> None:
    cases = [dict(size=size, context_length=c, batch_size=args.batch_size, mode=m, dtype=d, kind="peak")
             for c in args.contexts for m in PEAK_MODES for d in args.dtypes]
    for case in cli.progress(store.pending(cases), PROBLEM):
        config = LMConfig(size, case["context_length"], args.batch_size)
        store.add(case, result_store.measure_or_oom(lambda: measure_peak(config, case["mode"], case["dtype"], device)))
    columns = ["size", "context_length", "mode", "dtype", "peak_gb", "oom"]
    cli.print_table([r for r in store.asked_rows() if r["kind"] == "peak"], columns)


def main(argv: list[str] | None = None) -> None:
    args, device, tiny = cli.start(parser(), argv)
    figures_dir = args.figures_dir or result_store.FIGURES_DIR
    if args.render:
        render_pickles(args.render, figures_dir, int(args.html_limit_mib * 2**20))
        return
    if device.type != "cuda":
        # The tool records the CUDA caching allocator (peaks, memory history); a CPU has none: nothing to write.
        print("# no CUDA device: there is no CUDA memory to record, so no rows and no timelines", file=sys.stderr)
        return
    size = args.size or ("tiny" if tiny else "2.7B")
    args.contexts = args.contexts or ([16] if tiny else [128, 2048])
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force, edition=args.edition)
    if "peaks" in args.parts:
        record_peaks(args, store, size, device)
    if "residuals" in args.parts:
        record_residuals(args, store, size, device)
    if "timelines" in args.parts:
        record_timelines(args, store, size, device, figures_dir)


if __name__ == "__main__":
    main()
