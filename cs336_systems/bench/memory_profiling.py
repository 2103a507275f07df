"""Memory profile of the 2.7B model (problem ``memory_profiling``).

1. Peak allocated device memory for a forward pass and for a full training step (forward, loss,
   backward, AdamW), at context 128, 256 and 512, in fp32 and under bf16 autocast (rows; out of
   memory is a row).
2. For forward and for the training step (fp32, the longest context that fits): a CUDA memory
   history (``torch.cuda.memory._record_memory_history``) dumped as a snapshot pickle that
   https://pytorch.org/memory_viz loads (``--snapshot-dir``; large, kept out of git), our own PNG of
   the active-memory timeline (``writeup/figures/memory_<case>.png``), and the largest allocations
   with the Python line that made them (in the row).

Examples::

    python -m cs336_systems.bench.memory_profiling
    python -m cs336_systems.bench.memory_profiling --contexts 128 --dtypes fp32 --snapshot-dir /tmp/snapshots
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cs336_systems.bench import harness
from cs336_systems.bench.lm import DTYPES, SIZES, LMConfig, build_model, make_optimizer, make_step, random_batch

PROBLEM = "memory_profiling"
STEPS = 3  # the optimizer state appears in the first step; three show the steady pattern


def parser():
    p = harness.base_parser(__doc__)
    p.add_argument("--size", default=None, choices=list(SIZES), help="model size (default 2.7B)")
    p.add_argument("--contexts", nargs="+", type=int, default=None, help="context lengths (default 128 256 512)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--snapshot-dir", type=Path, default=Path("snapshots"), help="where snapshot pickles go")
    p.add_argument("--figures-dir", type=Path, default=None, help=f"where PNGs go (default {harness.FIGURES_DIR})")
    p.add_argument("--no-timelines", action="store_true", help="peaks only, no snapshots or pictures")
    return p


def record_snapshot(fn: Callable[[], Any], path: str | Path, device: torch.device) -> dict:
    """Run ``fn`` with the CUDA memory history recorded; dump the snapshot to ``path`` and return it."""
    if device.type != "cuda":
        raise RuntimeError("memory snapshots need a CUDA device")
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        fn()
        harness.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        pickle.dump(snapshot, file)
    return snapshot


def active_memory_timeline(snapshot: dict, baseline_bytes: int = 0) -> tuple[list[float], list[float]]:
    """(time in ms since the first event, active GB) after every allocation and free of device 0."""
    events = [e for e in snapshot["device_traces"][0] if e["action"] in ("alloc", "free_completed")]
    if not events:
        return [], []
    t0 = events[0]["time_us"]
    active, times, gbs = baseline_bytes, [], []
    for event in events:
        active += event["size"] if event["action"] == "alloc" else -event["size"]
        times.append((event["time_us"] - t0) / 1e3)
        gbs.append(active / 1e9)
    return times, gbs


def allocation_source(frames: list[dict]) -> str:
    """The innermost frame in this repository's model or systems code (else the innermost Python frame)."""
    for frame in frames:
        if "cs336_basics" in frame["filename"] or "cs336_systems" in frame["filename"]:
            return f"{Path(frame['filename']).name}:{frame['line']} ({frame['name']})"
    for frame in frames:
        if frame["filename"].endswith(".py"):
            return f"{Path(frame['filename']).name}:{frame['line']} ({frame['name']})"
    # Backward runs on autograd's own thread, which has no Python stack.
    return "autograd backward (no Python frame)"


def largest_allocations(snapshot: dict, top: int = 10) -> list[dict[str, Any]]:
    """The ``top`` largest allocation sizes, each with how often it occurred and where it came from."""
    groups: dict[tuple[int, str], int] = {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            key = (event["size"], allocation_source(event.get("frames", [])))
            groups[key] = groups.get(key, 0) + 1
    ranked = sorted(groups.items(), key=lambda item: -item[0][0])[:top]
    return [{"mb": size / 2**20, "count": count, "source": source} for (size, source), count in ranked]


def plot_timeline(times: list[float], gbs: list[float], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.fill_between(times, gbs, step="post", alpha=0.35)
    ax.plot(times, gbs, drawstyle="steps-post", linewidth=0.8)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("active memory (GB)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def measure_peak(config: LMConfig, mode: str, dtype: str, device: torch.device) -> dict[str, Any]:
    """Peak allocated memory over ``STEPS`` steps of a freshly built model (weights included)."""
    harness.free_memory()
    model = build_model(config, device)
    optimizer = make_optimizer(model) if mode == "train_step" else None
    params_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    step = make_step(model, random_batch(config, device), mode, DTYPES[dtype], optimizer)
    try:
        with harness.peak_memory(device) as peak:
            for _ in range(STEPS):
                step(None)
        return {"peak_gb": peak.get("peak_gb"), "params_gb": params_gb}
    finally:
        del model, optimizer, step
        harness.free_memory()


def timeline_case(config: LMConfig, mode: str, device: torch.device, snapshot_dir: Path, figures_dir: Path) -> dict:
    """Snapshot, PNG and largest allocations of ``STEPS`` fp32 steps, recorded from model construction on."""
    harness.free_memory()
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
        harness.free_memory()
    times, gbs = active_memory_timeline(snapshot)
    figure = figures_dir / f"memory_{name}.png"
    label = "forward only" if mode == "forward" else "full training step (AdamW)"
    plot_timeline(times, gbs, f"{config.size}, batch {config.batch_size}, context {config.context_length}, fp32: "
                  f"{STEPS} x {label}", figure)
    return {
        "figure": str(figure.relative_to(harness.REPO_ROOT)) if figure.is_relative_to(harness.REPO_ROOT) else str(figure),
        "timeline_peak_gb": max(gbs) if gbs else None,
        "largest_allocations": largest_allocations(snapshot),
    }


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    device = harness.default_device()
    harness.announce(device, args.quick)
    tiny = args.quick or device.type == "cpu"
    size = args.size or ("tiny" if tiny else "2.7B")
    contexts = args.contexts or ([16] if tiny else [128, 256, 512])
    figures_dir = args.figures_dir or harness.FIGURES_DIR
    store = harness.ResultStore(PROBLEM, args.results_dir, args.force)
    cases = [dict(size=size, context_length=c, batch_size=args.batch_size, mode=m, dtype=d, kind="peak")
             for c in contexts for m in ("forward", "train_step") for d in args.dtypes]
    rows = []
    for case in harness.progress(store.pending(cases), PROBLEM):
        config = LMConfig(size, case["context_length"], args.batch_size)
        if device.type == "cuda":
            result = harness.measure_or_oom(lambda: measure_peak(config, case["mode"], case["dtype"], device))
        else:
            result = {"oom": False, "peak_gb": None, "note": "no CUDA device: peak memory is not measured on a CPU"}
        rows.append(store.add(case, result))
    harness.print_table(rows, ["size", "context_length", "mode", "dtype", "peak_gb", "oom"])
    if args.no_timelines or device.type != "cuda":
        if device.type != "cuda":
            print("# no CUDA device: no memory timelines", file=sys.stderr)
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
        result = harness.measure_or_oom(lambda: timeline_case(config, mode, device, args.snapshot_dir, figures_dir))
        store.add(case, result)
        print(f"# {mode}: {result.get('figure')}", file=sys.stderr)
        for alloc in result.get("largest_allocations", []):
            print(f"#   {alloc['mb']:9.1f} MB x{alloc['count']:4d}  {alloc['source']}", file=sys.stderr)


if __name__ == "__main__":
    main()
