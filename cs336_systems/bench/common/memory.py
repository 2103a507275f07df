"""CUDA memory history: recording a snapshot (loadable at pytorch.org/memory_viz), the active-memory
timeline drawn from it, and its largest allocations with their source lines."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cs336_systems.bench.common import timing


def record_snapshot(fn: Callable[[], Any], path: str | Path, device: torch.device) -> dict:
    """Run ``fn`` with the CUDA memory history recorded; dump the snapshot to ``path`` and return it."""
    if device.type != "cuda":
        raise RuntimeError("memory snapshots need a CUDA device")
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        fn()
        timing.synchronize(device)
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
