"""CUDA memory history: recording a snapshot (the pickle pytorch.org/memory_viz loads), our drawing of its
active-memory timeline, and its largest allocations with the stack frames that made them.

A snapshot (``torch.cuda.memory._snapshot()``, pickled as ``_dump_snapshot`` does) is a dict:

* ``segments``: the allocator's cudaMalloc'd segments at the dump, each with ``device`` and ``blocks``; a block
  has ``size``, ``requested_size``, ``state`` (``active_allocated``, ``active_pending_free``, ``inactive``)
  and ``frames``;
* ``device_traces``: per device, the recorded events, each with ``action`` (``alloc``, ``free_requested``,
  ``free_completed``, ``segment_alloc``, ...), ``addr``, ``size`` (the requested bytes), ``time_us`` and
  ``frames`` (innermost first: ``filename``, ``line``, ``name``).

Memory allocated before the recording began and still alive at the dump shows in the segments but not in the
trace; the timeline starts from it (``preexisting_bytes``), as memory_viz's does.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

import torch

from cs336_systems.bench.common import timing

MAX_ENTRIES = 1_000_000  # events kept (a ring buffer): a few training steps of the 2.7B model need ~100k
LIVE_STATES = ("active_allocated", "active_pending_free")  # the names the C++ allocator writes
CODE_ROOTS = ("cs336_basics", "cs336_systems")  # the model and this package: where an allocation "comes from"
PACKAGE_ROOTS = (*CODE_ROOTS, "torch")
NO_PYTHON_FRAME = "no Python frame (autograd's backward thread)"
PREEXISTING = "allocated before the recording"
# The caching allocator's counters of costly events (torch.cuda.memory_stats): a request it could serve only after
# freeing its cache (which synchronises the device), device-wide synchronisations, and calls to the driver to map
# or unmap memory.
ALLOCATOR_EVENTS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def allocator_events(device: torch.device) -> dict[str, int]:
    """The caching allocator's :data:`ALLOCATOR_EVENTS` counters on ``device`` so far."""
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(name, 0)) for name in ALLOCATOR_EVENTS}


def allocator_events_since(before: dict[str, int], device: torch.device) -> dict[str, int]:
    """How many of each :data:`ALLOCATOR_EVENTS` happened on ``device`` since ``before`` (:func:`allocator_events`)."""
    now = allocator_events(device)
    return {name: now[name] - before.get(name, 0) for name in ALLOCATOR_EVENTS}


def record_snapshot(fn: Callable[[], Any], path: str | Path, device: torch.device, max_entries: int = MAX_ENTRIES) -> dict:
    """Run ``fn`` with the CUDA memory history recorded (Python stacks); dump the snapshot to ``path`` and return it."""
    if device.type != "cuda":
        raise RuntimeError("memory snapshots need a CUDA device")
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
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


def load_snapshot(path: str | Path) -> dict:
    with open(path, "rb") as file:
        return pickle.load(file)


# ---------------------------------------------------------------------------------------------------
# Where an allocation comes from
# ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _short_path(filename: str) -> tuple[str, bool]:
    """The path from its package root (``cs336_basics/model.py``, ``torch/functional.py``), and whether it is
    our code. Cached: a snapshot repeats the same few hundred files in every stack."""
    parts = PurePath(filename).parts
    roots = [i for i, part in enumerate(parts) if part in PACKAGE_ROOTS]
    short = "/".join(parts[roots[-1]:]) if roots else PurePath(filename).name
    return short, any(root in parts for root in CODE_ROOTS)


def frame_text(frame: dict) -> str:
    """``package/path.py:line function``."""
    return f"{_short_path(frame['filename'])[0]}:{frame['line']} {frame['name']}"


def _in_code(frame: dict) -> bool:
    return _short_path(frame["filename"])[1]


def allocation_stack(frames: list[dict], depth: int = 4) -> list[str]:
    """The allocation's call chain, innermost first: from the innermost frame of the model or this package
    (``cs336_basics``, ``cs336_systems``) outwards, ``depth`` frames of that code; where no frame is ours, the
    innermost Python frames (torch's)."""
    python = [f for f in frames if f["filename"].endswith(".py")]
    ours = [f for f in python if _in_code(f)]
    return [frame_text(f) for f in (ours or python)[:depth]]


def allocation_source(frames: list[dict]) -> str:
    """The innermost frame in the model or this package (else the innermost Python frame, torch's)."""
    stack = allocation_stack(frames, depth=1)
    # Backward runs on autograd's own thread, which has no Python stack.
    return stack[0] if stack else NO_PYTHON_FRAME


def largest_allocations(snapshot: dict, top: int = 10, device: int = 0) -> list[dict[str, Any]]:
    """The ``top`` largest allocations of the trace, one entry per (size, source): ``mb`` (MiB), ``count`` (how
    often), ``source`` (innermost frame of our code) and ``stack`` (its call chain, the first occurrence's)."""
    groups: dict[tuple[int, str], dict[str, Any]] = {}
    for event in snapshot["device_traces"][device]:
        if event["action"] != "alloc":
            continue
        frames = event.get("frames", [])
        key = (event["size"], allocation_source(frames))
        if key not in groups:
            groups[key] = {"mb": event["size"] / 2**20, "count": 0, "source": key[1], "stack": allocation_stack(frames)}
        groups[key]["count"] += 1
    ranked = sorted(groups.items(), key=lambda item: (-item[0][0], -item[1]["count"]))
    return [entry for _, entry in ranked[:top]]


# ---------------------------------------------------------------------------------------------------
# The active-memory timeline
# ---------------------------------------------------------------------------------------------------


def alloc_free_events(snapshot: dict, device: int) -> list[dict]:
    """The trace's allocations and completed frees on ``device``, in order."""
    traces = snapshot["device_traces"]
    return [e for e in (traces[device] if device < len(traces) else []) if e["action"] in ("alloc", "free_completed")]


def preexisting_bytes(snapshot: dict, device: int = 0) -> int:
    """Bytes alive when the trace begins: those alive at the dump (the segments' live blocks) less what the trace
    added. 0 for a snapshot without segments."""
    if "segments" not in snapshot:
        return 0
    live = sum(block.get("requested_size", block["size"]) for segment in snapshot["segments"]
               if segment.get("device", 0) == device for block in segment["blocks"] if block["state"] in LIVE_STATES)
    net = sum(_signed(e) for e in alloc_free_events(snapshot, device))
    return max(live - net, 0)


@dataclass
class MemoryTimeline:
    """Active memory after every allocation and free: in total and split by source (GB), time in ms."""

    times_ms: list[float] = field(default_factory=list)
    total_gb: list[float] = field(default_factory=list)
    bands: dict[str, list[float]] = field(default_factory=dict)  # stacked bottom to top; the rest in "other"

    @property
    def peak_gb(self) -> float | None:
        return max(self.total_gb) if self.total_gb else None


def _signed(event: dict) -> int:
    return event["size"] if event["action"] == "alloc" else -event["size"]


def _live_by_source(events: list[dict], until: int) -> dict[str, int]:
    """Bytes alive per source after the first ``until`` events (those alive before the trace left out)."""
    source_of: dict[int, str] = {}
    live: dict[str, int] = {}
    for event in events[:until]:
        source = _event_source(event, source_of)
        live[source] = live.get(source, 0) + _signed(event)
    return live


def _event_source(event: dict, source_of: dict[int, str]) -> str:
    """The source of an alloc (remembered by address), or of the allocation a free returns."""
    address = event.get("addr")
    if event["action"] == "alloc":
        source = allocation_source(event.get("frames", []))
        if address is not None:
            source_of[address] = source
        return source
    if address is None:  # an event without an address: only its frames tell
        return allocation_source(event["frames"]) if event.get("frames") else PREEXISTING
    # A free whose alloc is not in the trace returns memory alive before it.
    return source_of.pop(address, PREEXISTING)


def active_memory_timeline(snapshot: dict, device: int = 0, bands: int = 5) -> MemoryTimeline:
    """The active memory over the trace, from the memory alive before it, with the ``bands`` sources holding most
    memory at the peak drawn apart (the rest as ``other``)."""
    events = alloc_free_events(snapshot, device)
    base = preexisting_bytes(snapshot, device)
    if not events:
        return MemoryTimeline()
    totals, active = [], base
    for event in events:
        active += _signed(event)
        totals.append(active)
    peak = max(range(len(totals)), key=totals.__getitem__)
    at_peak = _live_by_source(events, peak + 1)
    named = sorted((s for s in at_peak if s != PREEXISTING and at_peak[s] > 0), key=lambda s: -at_peak[s])[:bands]
    series = {name: [] for name in (PREEXISTING, *named, "other")}
    live: dict[str, int] = {PREEXISTING: base}
    source_of: dict[int, str] = {}
    t0 = events[0]["time_us"]
    times = []
    for event in events:
        source = _event_source(event, source_of)
        source = source if source in series else "other"
        live[source] = live.get(source, 0) + _signed(event)
        times.append((event["time_us"] - t0) / 1e3)
        for name, values in series.items():
            values.append(live.get(name, 0) / 1e9)
    return MemoryTimeline(times, [t / 1e9 for t in totals], series)


def plot_timeline(timeline: MemoryTimeline, title: str, path: Path) -> None:
    """The timeline as stacked bands (memory alive before the trace at the bottom, then each named source)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = [n for n, values in timeline.bands.items() if any(v > 0 for v in values)]
    colors = ["#bdbdbd", "#3182bd", "#e6550d", "#31a354", "#756bb1", "#e7ba52", "#de9ed6", "#969696"]
    ax.stackplot(timeline.times_ms, *[timeline.bands[n] for n in names], labels=names, step="post",
                 colors=colors[:len(names)], alpha=0.85)
    ax.plot(timeline.times_ms, timeline.total_gb, drawstyle="steps-post", linewidth=0.6, color="black")
    ax.set_xlabel("time since the first recorded event (ms)")
    ax.set_ylabel("active memory (GB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, fontsize=7, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def render_snapshot(snapshot: dict | str | Path, path: Path, title: str) -> MemoryTimeline:
    """Draw the active-memory timeline of a snapshot (or of its pickle) to the PNG ``path``; returns the timeline."""
    data = snapshot if isinstance(snapshot, dict) else load_snapshot(snapshot)
    timeline = active_memory_timeline(data)
    plot_timeline(timeline, title, path)
    return timeline
