"""CUDA memory history: recording a snapshot (the pickle pytorch.org/memory_viz loads), our drawing of its
active-memory timeline with every allocation coloured by what it holds, PyTorch's own viewer page of it, and its
largest allocations with the stack frames that made them.

A snapshot (``torch.cuda.memory._snapshot()``, pickled as ``_dump_snapshot`` does) is a dict:

* ``segments``: the allocator's cudaMalloc'd segments at the dump, each with ``device`` and ``blocks``; a block
  has ``size``, ``requested_size``, ``state`` (``active_allocated``, ``active_pending_free``, ``inactive``)
  and ``frames``;
* ``device_traces``: per device, the recorded events, each with ``action`` (``alloc``, ``free_requested``,
  ``free_completed``, ``segment_alloc``, ...), ``addr``, ``size`` (the requested bytes), ``time_us`` and
  ``frames`` (innermost first: ``filename``, ``line``, ``name``).

Memory allocated before the recording began and still alive at the dump shows in the segments but not in the
trace; the timeline starts from it (``preexisting_bytes``), as memory_viz's does.

What an allocation holds (its category: weights, optimizer state, gradients, attention scores, softmax, ...) is
read from its stack: the innermost function of the model (``cs336_basics``) that has a category in
:data:`FUNCTION_CATEGORY`. ``Linear.forward`` has none, so a projection counts for the module that calls it (the
attention or the feed-forward network). The backward runs on autograd's own thread, which has no Python stack:
there an allocation of a parameter's size is a gradient, any other an activation gradient or a temporary.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
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


def record_snapshot(fn: Callable[[], Any], path: str | Path, device: torch.device,
                    max_entries: int = MAX_ENTRIES) -> dict:
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


@functools.lru_cache(maxsize=4096)  # one entry per source file a snapshot names
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
    often), ``source`` (innermost frame of our code), ``category`` (what it holds, :func:`allocation_category`) and
    ``stack`` (its call chain, the first occurrence's)."""
    sizes = gradient_sizes(snapshot, device)
    groups: dict[tuple[int, str], dict[str, Any]] = {}
    for event in alloc_free_events(snapshot, device):
        if event["action"] != "alloc":
            continue
        frames = event.get("frames", [])
        key = (event["size"], allocation_source(frames))
        if key not in groups:
            groups[key] = {"mb": event["size"] / 2**20, "count": 0, "source": key[1],
                           "category": allocation_category(frames, event["size"], sizes),
                           "stack": allocation_stack(frames)}
        groups[key]["count"] += 1
    ranked = sorted(groups.items(), key=lambda item: (-item[0][0], -item[1]["count"]))
    return [entry for _, entry in ranked[:top]]


# ---------------------------------------------------------------------------------------------------
# What an allocation holds
# ---------------------------------------------------------------------------------------------------

MODEL_ROOT = "cs336_basics"
MODEL_FILE = "cs336_basics/model.py"
WEIGHTS = "weights"
OPTIMIZER_STATE = "optimizer state (AdamW)"
GRADIENTS = "gradients (parameters')"
BACKWARD = "backward: activation gradients, temporaries"
OTHER = "other"
FUNCTION_CATEGORY = {
    "AdamW.step": OPTIMIZER_STATE,
    "Embedding.forward": "embedding",
    "RMSNorm.forward": "RMSNorm",
    "CausalMultiHeadSelfAttention.forward": "attention: Q, K, V, output projections",
    "RotaryEmbedding.forward": "attention: RoPE",
    "causal_attention": "attention: scores, mask",
    "scaled_dot_product_attention": "attention: scores, mask",
    "softmax": "attention: softmax",
    "SwiGLU.forward": "feed-forward (SwiGLU)",
    "silu": "feed-forward (SwiGLU)",
    "TransformerBlock.forward": "residual adds",
    "BasicsTransformerLM.forward": "LM head: logits",
    "log_softmax": "loss",
    "cross_entropy": "loss",
}
"""The category of an allocation made (innermost) in a model function, by the function's qualified name. Every
``__init__`` of the model makes weights (and the RoPE tables); ``Linear.forward`` is left out on purpose."""
# Bottom to top in the timeline, with one colour each.
CATEGORY_COLOURS = {
    PREEXISTING: "#bdbdbd",
    WEIGHTS: "#636363",
    OPTIMIZER_STATE: "#9e9ac8",
    GRADIENTS: "#54278f",
    "embedding": "#fdd0a2",
    "RMSNorm": "#fd8d3c",
    "attention: Q, K, V, output projections": "#c6dbef",
    "attention: RoPE": "#9ecae1",
    "attention: scores, mask": "#4292c6",
    "attention: softmax": "#08519c",
    "feed-forward (SwiGLU)": "#41ab5d",
    "residual adds": "#c7e9c0",
    "LM head: logits": "#e7ba52",
    "loss": "#ad494a",
    BACKWARD: "#de9ed6",
    OTHER: "#f0f0f0",
}


def _source_file(short_path: str) -> Path | None:
    """The local copy of ``package/path.py`` (``cs336_basics/model.py``), where its package is importable."""
    package, _, rest = short_path.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / rest
    return path if path.is_file() else None


@functools.lru_cache(maxsize=1024)  # one entry per source file of ours
def _function_spans(short_path: str) -> tuple[tuple[int, int, str], ...]:
    """``(first line, last line, qualified name)`` of every function in a source file of ours (none where the file
    is not found)."""
    path = _source_file(short_path)
    if path is None:
        return ()
    spans = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                spans.append((child.lineno, child.end_lineno, prefix + child.name))
                visit(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return tuple(spans)


@functools.lru_cache(maxsize=65536)  # one entry per distinct frame
def function_at(short_path: str, line: int, name: str) -> str:
    """The qualified name (``SwiGLU.forward``) of the innermost function holding ``line`` of ``short_path``; the
    frame's bare ``name`` where the source is not at hand (a snapshot of another checkout)."""
    holding = [span for span in _function_spans(short_path) if span[0] <= line <= span[1]]
    return max(holding)[2] if holding else name


def frame_category(frame: dict) -> str | None:
    """The category of a frame in the model's code (None elsewhere, or for a function without one)."""
    short, _ = _short_path(frame["filename"])
    if not short.startswith(MODEL_ROOT + "/"):
        return None
    function = function_at(short, frame["line"], frame["name"])
    if short == MODEL_FILE and function.endswith("__init__"):
        return WEIGHTS
    return FUNCTION_CATEGORY.get(function)


def allocation_category(frames: list[dict], size: int | None = None,
                        gradient_sizes: frozenset[int] = frozenset()) -> str:
    """What an allocation holds, from its stack (innermost first): the category of its innermost model frame that
    has one; without a Python frame (autograd's thread), a gradient where ``size`` is a parameter's."""
    python = [f for f in frames if f["filename"].endswith(".py")]
    if not python:
        return GRADIENTS if size in gradient_sizes else BACKWARD
    for frame in python:
        category = frame_category(frame)
        if category is not None:
            return category
    return OTHER


def gradient_sizes(snapshot: dict, device: int = 0) -> frozenset[int]:
    """The sizes (bytes) of the allocations that hold weights, in the trace or alive at the dump: a parameter's
    gradient has its parameter's size."""
    sizes = {e["size"] for e in alloc_free_events(snapshot, device)
             if e["action"] == "alloc" and allocation_category(e.get("frames", [])) == WEIGHTS}
    for segment in snapshot.get("segments", []):
        if segment.get("device", 0) == device:
            sizes |= {b.get("requested_size", b["size"]) for b in segment["blocks"]
                      if b.get("frames") and allocation_category(b["frames"]) == WEIGHTS}
    return frozenset(sizes)


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
    """Active memory after every allocation and free: in total and by category (GB), time in ms."""

    times_ms: list[float] = field(default_factory=list)
    total_gb: list[float] = field(default_factory=list)
    bands: dict[str, list[float]] = field(default_factory=dict)  # categories in CATEGORY_COLOURS' order
    before_gb: float = 0.0  # alive when the recording began

    @property
    def peak_gb(self) -> float | None:
        return max(self.total_gb) if self.total_gb else None

    def at_peak(self) -> dict[str, float]:
        """GB of each category alive at the (first) peak."""
        if not self.total_gb:
            return {}
        peak = self.total_gb.index(max(self.total_gb))
        return {name: values[peak] for name, values in self.bands.items() if values[peak] > 0}


def _signed(event: dict) -> int:
    return event["size"] if event["action"] == "alloc" else -event["size"]


def active_memory_timeline(snapshot: dict, device: int = 0) -> MemoryTimeline:
    """The active memory over the trace, from the memory alive before it, by category (:func:`allocation_category`;
    a free takes its bytes from its allocation's category, or from the memory alive before the trace)."""
    events = alloc_free_events(snapshot, device)
    base = preexisting_bytes(snapshot, device)
    if not events:
        return MemoryTimeline(before_gb=base / 1e9)
    sizes = gradient_sizes(snapshot, device)
    live = dict.fromkeys(CATEGORY_COLOURS, 0)
    live[PREEXISTING] = base
    category_of: dict[int, str] = {}  # address of a live allocation -> its category
    series: dict[str, list[float]] = {name: [] for name in CATEGORY_COLOURS}
    times, totals = [], []
    t0 = events[0]["time_us"]
    for event in events:
        if event["action"] == "alloc":
            category = allocation_category(event.get("frames", []), event["size"], sizes)
            category_of[event["addr"]] = category
        else:  # a free whose allocation is not in the trace returns memory alive before it
            category = category_of.pop(event["addr"], PREEXISTING)
        live[category] += _signed(event)
        times.append((event["time_us"] - t0) / 1e3)
        totals.append(sum(live.values()) / 1e9)
        for name, values in series.items():
            values.append(live[name] / 1e9)
    bands = {name: values for name, values in series.items() if any(v > 0 for v in values)}
    return MemoryTimeline(times, totals, bands, base / 1e9)


ZOOM_WHEN_BEFORE_SHARE = 0.5  # memory alive before the recording above this share of the peak: axis starts above it


def y_range(timeline: MemoryTimeline) -> tuple[float, float]:
    """The y axis (GB): from 0, or, where memory alive before the recording (the weights of a forward pass) is most
    of the peak, from just below that memory (or the lowest total, if lower), so that what the recorded passes
    allocate above it fills the picture."""
    peak = timeline.peak_gb or 0.0
    top = peak * 1.03 if peak else 1.0
    if not timeline.total_gb or timeline.before_gb <= ZOOM_WHEN_BEFORE_SHARE * peak:
        return 0.0, top
    low = min(timeline.before_gb, *timeline.total_gb)
    span = max(peak - low, 1e-3)
    return max(low - 0.1 * span, 0.0), peak + 0.1 * span


def plot_timeline(timeline: MemoryTimeline, title: str, path: Path) -> None:
    """The timeline as stacked bands, one per category (legend below), and the total as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    names = list(timeline.bands)
    ax.stackplot(timeline.times_ms, *[timeline.bands[n] for n in names], labels=names, step="post",
                 colors=[CATEGORY_COLOURS[n] for n in names], alpha=0.9)
    ax.plot(timeline.times_ms, timeline.total_gb, drawstyle="steps-post", linewidth=0.6, color="black")
    if timeline.times_ms:
        ax.set_xlim(timeline.times_ms[0], timeline.times_ms[-1])
    bottom, top = y_range(timeline)
    ax.set_ylim(bottom, top)
    ax.set_xlabel("time since the first recorded event (ms)")
    ax.set_ylabel("active memory (GB)" + (f"\naxis from {bottom:.2f} GB" if bottom > 0 else ""))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize=7, frameon=False)
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


# ---------------------------------------------------------------------------------------------------
# PyTorch's viewer as one HTML page
# ---------------------------------------------------------------------------------------------------

VIEWER_LIMIT_BYTES = 4 * 2**20  # a larger page is not written (the pickle and --render make it again)
VIEWER_FRAMES = 12  # the innermost frames of each stack kept in the page


def _viewer_frame(frame: dict) -> bool:
    """A Python frame other than ``nn.Module``'s call wrappers (they sit between every two model frames)."""
    name = frame["filename"]
    return name.endswith(".py") and not name.endswith("torch/nn/modules/module.py")


def compact_snapshot(snapshot: dict, depth: int = VIEWER_FRAMES) -> dict:
    """The snapshot with each stack cut to its ``depth`` innermost Python frames outside ``nn.Module``'s wrappers,
    and every repeated frame, stack and string held as one object: pickle writes a repeated object once, and the
    viewer page embeds the pickle."""
    strings: dict[str, str] = {}
    frames: dict[tuple, dict] = {}
    stacks: dict[tuple, list[dict]] = {}

    def shared(value):
        return strings.setdefault(value, value) if isinstance(value, str) else value

    def stack(raw: list[dict]) -> list[dict]:
        key = tuple((f["filename"], f["line"], f["name"]) for f in raw if _viewer_frame(f))[:depth]
        if key not in stacks:
            stacks[key] = [frames.setdefault(k, {"filename": shared(k[0]), "line": k[1], "name": shared(k[2])})
                           for k in key]
        return stacks[key]

    def entry(item: dict) -> dict:
        return {shared(k): stack(v) if k == "frames" else shared(v) for k, v in item.items() if k != "blocks"}

    segments = [{**entry(segment), "blocks": [entry(block) for block in segment.get("blocks", [])]}
                for segment in snapshot.get("segments", [])]
    traces = [[entry(event) for event in trace] for trace in snapshot.get("device_traces", [])]
    return {**snapshot, "segments": segments, "device_traces": traces}


def viewer_html(snapshot: dict) -> str:
    """PyTorch's "Active Memory Timeline" page of the snapshot (``torch.cuda._memory_viz.trace_plot``): the pickle
    embedded in the page, which loads the viewer's script from PyTorch's repository when opened."""
    from torch.cuda import _memory_viz

    return _memory_viz.trace_plot(compact_snapshot(snapshot))


def write_viewer_html(snapshot: dict, path: Path, limit: int = VIEWER_LIMIT_BYTES) -> int:
    """Write :func:`viewer_html` to ``path`` when it has at most ``limit`` bytes; returns its size either way."""
    page = viewer_html(snapshot).encode()
    if len(page) <= limit:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(page)
    return len(page)
