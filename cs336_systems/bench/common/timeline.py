"""Timelines of compute and communication read from ``torch.profiler`` Chrome traces, and drawn as PNGs:
the one module every tool that records a trace uses.

Two views of a trace:

* **Lanes** (:func:`timeline_from_trace`, :func:`overlap_summary`, :func:`render_lanes`; used by
  ``ddp_benchmarking`` and the ``timeline`` command): per rank, compute, communication and phase spans and
  how much of the communication overlapped compute.
* **FSDP gathers** (:func:`analyze_gathers`, :func:`render_gathers`; used by ``fsdp_accounting``): every
  all-gather paired with the use of its weight, late or hidden.

Lanes.
A trace (``prof.export_chrome_trace(path)``) is reduced to three lanes of spans per rank:

* ``compute``: GPU kernels, copies and memsets other than communication; on a CPU-only trace, the
  operators of the busiest thread (the one that ran the model);
* ``communication``: NCCL kernels; on a CPU-only trace, the collectives' ranges (``gloo:all_reduce``
  on gloo's own thread, the ``c10d::`` calls);
* ``phases``: the ``record_function`` ranges named in ``phases`` (e.g. forward, backward), on the GPU
  timeline when the trace has one.

An NCCL kernel starts when it is launched and ends when the all-reduce is done, so its span includes
the time it waits for the other ranks to join.

:func:`overlap_summary` says how much of the communication ran while compute was running, and
:func:`render_lanes` draws one block of lanes per rank, the overlapped part of each communication span
highlighted, so overlap, or its absence, is plain to see.

FSDP gathers.
The trace holds GPU kernels (``cat: kernel``, with the stream and a ``correlation`` id), the CPU calls that
launched them (``cuda_runtime`` / ``cuda_driver``, same ``correlation``) and ``record_function`` ranges
(``user_annotation``). NCCL kernels are communication, every other kernel is compute.

FSDP (``FSDP.annotate = True``) names three kinds of range after a weight (see ``cs336_systems.parallel.fsdp``):
``fsdp.all_gather <w>`` around a gather's launch, ``fsdp.use <w>`` where the gathered weight becomes
available to compute, ``fsdp.reduce_scatter <w>`` around a reduction's launch. The i-th gather of a weight
serves its i-th use; the use *needs* the weight when the first compute kernel launched after it could have
started: once the compute stream finished its previous kernel and the CPU had launched this one. A gather is
*late* when its NCCL kernel ended after that moment, and the compute stream then waited
``min(gather end, kernel start) - ready``; otherwise the gather was hidden behind compute.
The step's phases come from ranges named ``step.forward``, ``step.backward``, ``step.optimizer``.
"""

from __future__ import annotations

import textwrap

import bisect
import gzip
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------------
# Traces and interval arithmetic
# ---------------------------------------------------------------------------------------------------


def load_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace from ``.json`` or ``.json.gz``."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as file:
        return json.load(file)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as disjoint, sorted intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two disjoint sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def total_length(intervals: list[tuple[float, float]]) -> float:
    """The summed length of disjoint ``(start, end)`` intervals (as :func:`union` returns them)."""
    return sum(end - start for start, end in intervals)


# ---------------------------------------------------------------------------------------------------
# Lanes: compute, communication and phases per rank
# ---------------------------------------------------------------------------------------------------


COMM_PATTERN = re.compile(r"nccl|gloo|c10d::|all_?reduce|all_?gather|reduce_?scatter|broadcast", re.IGNORECASE)
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
LANE_PHASES = ("forward", "backward", "finish_gradient_synchronization", "optimizer")


@dataclass(frozen=True)
class Span:
    start_ms: float
    end_ms: float
    name: str = ""


@dataclass
class Timeline:
    """One rank's spans, in ms from the first of them."""

    compute: list[Span] = field(default_factory=list)
    communication: list[Span] = field(default_factory=list)
    phases: list[Span] = field(default_factory=list)
    source: str = "gpu"  # "gpu": kernels on the device; "cpu": operators on host threads


def _complete_events(trace: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def timeline_from_trace(trace: dict[str, Any] | list[dict[str, Any]],
                        phases: tuple[str, ...] = LANE_PHASES) -> Timeline:
    """The compute, communication and phase spans of one rank's trace (GPU kernels if there are any)."""
    events = _complete_events(trace)
    kernels = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if kernels:
        source = "gpu"
        compute = [e for e in kernels if not COMM_PATTERN.search(e["name"])]
        communication = [e for e in kernels if COMM_PATTERN.search(e["name"])]
        phase_events = [e for e in events if e.get("cat") == "gpu_user_annotation" and e["name"] in phases]
        if not phase_events:
            phase_events = [e for e in events if e.get("cat") == "user_annotation" and e["name"] in phases]
        else:  # a range's GPU annotation covers only what its own thread launched: widen it to its launches
            counts = Counter(e["name"] for e in phase_events)
            widest = {e["name"]: e for e in phase_events if counts[e["name"]] == 1}
            for e in _phases_from_launches(trace, [p for p in phases if counts[p] <= 1]):
                known = widest.get(e["name"])
                if known is None or e["dur"] > known["dur"]:
                    widest[e["name"]] = e
            phase_events = [e for e in phase_events if counts[e["name"]] > 1] + list(widest.values())
    else:
        source = "cpu"
        operators = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
        busiest = Counter(e.get("tid") for e in operators if e.get("cat") == "cpu_op").most_common(1)
        main_thread = busiest[0][0] if busiest else None
        communication = [e for e in operators if e["name"] not in phases and COMM_PATTERN.search(e["name"])]
        compute = [e for e in operators if e.get("cat") == "cpu_op" and e.get("tid") == main_thread
                   and not COMM_PATTERN.search(e["name"])]
        phase_events = [e for e in operators if e.get("cat") == "user_annotation" and e["name"] in phases]
    everything = compute + communication + phase_events
    origin = min((e["ts"] for e in everything), default=0.0)

    def spans(selected: list[dict[str, Any]]) -> list[Span]:
        out = [Span((e["ts"] - origin) / 1e3, (e["ts"] + e["dur"] - origin) / 1e3, e["name"]) for e in selected]
        return sorted(out, key=lambda s: s.start_ms)

    return Timeline(spans(compute), spans(communication), spans(phase_events), source)


def _phases_from_launches(trace: dict[str, Any] | list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """The GPU extent of each CPU range named in ``names``: from the first to the last compute kernel launched during
    it. The profiler gives a range a GPU annotation only for kernels its own thread launched, so the backward, whose
    kernels autograd's engine thread launches, has none."""
    if not names:
        return []
    kernels, ranges = kernels_and_ranges(trace if isinstance(trace, dict) else {"traceEvents": trace})
    out = []
    for r in ranges:
        inside = [k for k in kernels if r.name in names and not k.is_comm and r.start <= k.launch <= r.end]
        if inside:
            start, end = min(k.start for k in inside), max(k.end for k in inside)
            out.append({"name": r.name, "ts": start, "dur": end - start})
    return out


def merge(spans: list[Span]) -> list[tuple[float, float]]:
    """The union of ``spans`` as disjoint, sorted ``(start, end)`` intervals (ms)."""
    return union([(span.start_ms, span.end_ms) for span in spans])


def overlap_summary(timeline: Timeline) -> dict[str, float | None]:
    """Busy time of each lane, communication time overlapped with compute, and its share (ms)."""
    compute, communication = merge(timeline.compute), merge(timeline.communication)
    comm_ms = total_length(communication)
    overlap_ms = total_length(intersect(compute, communication))
    everything = merge(timeline.compute + timeline.communication)
    return {
        "span_ms": everything[-1][1] - everything[0][0] if everything else 0.0,
        "compute_busy_ms": total_length(compute),
        "comm_busy_ms": comm_ms,
        "comm_overlapped_ms": overlap_ms,
        "comm_exposed_ms": comm_ms - overlap_ms,
        "overlap_share": overlap_ms / comm_ms if comm_ms > 0 else None,
    }


def phase_lengths(timeline: Timeline) -> dict[str, float]:
    """The ms each named phase of ``timeline`` lasted (its spans of that name summed), in the order they began."""
    lengths: dict[str, float] = {}
    for span in sorted(timeline.phases, key=lambda s: s.start_ms):
        lengths[span.name] = lengths.get(span.name, 0.0) + span.end_ms - span.start_ms
    return lengths


PHASE_COLORS = {"forward": "#9ecae1", "backward": "#fdae6b", "finish_gradient_synchronization": "#fc9272",
                "optimizer": "#a1d99b"}


LANES_WIDTH_IN, LANES_FONT_PT = 6.7, 7.5  # the writeup's text width (us-letter, 0.9 in margins); label size there


def render_lanes(timelines: list[Timeline], path: str | Path, title: str = "", labels: list[str] | None = None) -> None:
    """One block of lanes (phases, compute, communication) per timeline; overlapped communication in green."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = labels or [f"rank {i}" for i in range(len(timelines))]
    lanes_per_rank = 3
    # Drawn at the writeup's text width, so that its labels print at their size on the page.
    fig, ax = plt.subplots(figsize=(LANES_WIDTH_IN, 1.2 + 0.6 * lanes_per_rank * len(timelines)))
    yticks, yticklabels = [], []
    end = max((s.end_ms for t in timelines for s in t.compute + t.communication + t.phases), default=1.0)
    for rank, (timeline, label) in enumerate(zip(timelines, labels)):
        base = (len(timelines) - 1 - rank) * (lanes_per_rank + 0.6)
        phase_y, compute_y, comm_y = base + 2, base + 1, base
        kind = "kernels" if timeline.source == "gpu" else "CPU ops"
        summary = overlap_summary(timeline)
        share = "-" if summary["overlap_share"] is None else f"{100 * summary['overlap_share']:.0f} %"
        comm_label = f"communication\n{summary['comm_busy_ms']:.1f} ms, {share} overlapped"
        for y, name in ((phase_y, "phases"), (compute_y, f"compute\n{kind}"), (comm_y, comm_label)):
            yticks.append(y + 0.4)
            yticklabels.append(f"{label}: {name}")
        for span in timeline.phases:
            color = PHASE_COLORS.get(span.name, "#d9d9d9")
            ax.broken_barh([(span.start_ms, span.end_ms - span.start_ms)], (phase_y, 0.8), facecolors=color,
                           edgecolors="grey", linewidth=0.5)
            if span.end_ms - span.start_ms > 0.06 * end:
                short = "grad sync" if span.name == "finish_gradient_synchronization" else span.name
                ax.text((span.start_ms + span.end_ms) / 2, phase_y + 0.4, short, ha="center", va="center",
                        fontsize=LANES_FONT_PT)
        compute, communication = merge(timeline.compute), merge(timeline.communication)
        ax.broken_barh([(a, b - a) for a, b in compute], (compute_y, 0.8), facecolors="#3182bd")
        ax.broken_barh([(a, b - a) for a, b in communication], (comm_y, 0.8), facecolors="#e6550d")
        overlapped = intersect(compute, communication)
        ax.broken_barh([(a, b - a) for a, b in overlapped], (comm_y, 0.8), facecolors="#31a354")
    ax.set_yticks(yticks, yticklabels, fontsize=LANES_FONT_PT)
    ax.tick_params(axis="x", labelsize=LANES_FONT_PT)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("time since the first event of the rank's trace (ms)", fontsize=LANES_FONT_PT)
    ax.legend(handles=[Patch(color="#3182bd", label="compute"), Patch(color="#e6550d", label="communication"),
                       Patch(color="#31a354", label="communication overlapped with compute")],
              loc="upper center", bbox_to_anchor=(0.5, -0.2 if len(timelines) > 1 else -0.35), ncol=3,
              fontsize=LANES_FONT_PT)
    ax.set_title(textwrap.fill(title, 90), fontsize=LANES_FONT_PT)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# FSDP gathers: each all-gather against the use of its weight
# ---------------------------------------------------------------------------------------------------


GATHER, USE, REDUCE = "fsdp.all_gather ", "fsdp.use ", "fsdp.reduce_scatter "
FSDP_PHASES = ("step.forward", "step.backward", "step.optimizer")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
TOLERANCE_US = 2.0  # clock jitter between the GPU kernels of two streams


@dataclass(frozen=True)
class Kernel:
    name: str
    stream: int
    start: float  # us, GPU time
    end: float
    launch: float  # us, CPU time of the launching call (nan when the trace does not link it)

    @property
    def is_comm(self) -> bool:
        return "nccl" in self.name.lower()


@dataclass(frozen=True)
class Range:
    name: str
    start: float  # us, CPU time
    end: float


@dataclass
class GatherUse:
    weight: str
    phase: str
    gather_start: float
    gather_end: float
    need: float  # start of the first compute kernel launched after the use
    ready: float  # when that kernel could have started: its stream's previous kernel done, the kernel launched

    @property
    def exposed(self) -> bool:
        return self.gather_end > self.ready + TOLERANCE_US

    @property
    def stall_us(self) -> float:
        return max(0.0, min(self.gather_end, self.need) - self.ready) if self.exposed else 0.0


def kernels_and_ranges(trace: dict[str, Any]) -> tuple[list[Kernel], list[Range]]:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    launches = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    kernels = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        args = e.get("args", {})
        start = float(e["ts"])
        kernels.append(
            Kernel(
                name=e["name"],
                stream=int(args.get("stream", e.get("tid", 0))),
                start=start,
                end=start + float(e.get("dur", 0.0)),
                launch=launches.get(args.get("correlation"), float("nan")),
            )
        )
    ranges = [
        Range(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in events
        if e.get("cat") == "user_annotation"
    ]
    kernels.sort(key=lambda k: k.start)
    ranges.sort(key=lambda r: r.start)
    return kernels, ranges


class _Launches:
    """The kernels of a trace in the order the CPU launched them (those whose launch the trace does not link left
    out), and, per stream, when its compute kernels ended."""

    def __init__(self, kernels: list[Kernel]) -> None:
        self.kernels = sorted((k for k in kernels if k.launch == k.launch), key=lambda k: k.launch)
        self.times = [k.launch for k in self.kernels]
        self.compute = [k for k in self.kernels if not k.is_comm]
        self.compute_times = [k.launch for k in self.compute]
        self.compute_ends_by_stream: dict[int, list[float]] = {}
        for k in sorted((k for k in kernels if not k.is_comm), key=lambda k: k.end):
            self.compute_ends_by_stream.setdefault(k.stream, []).append(k.end)

    def inside(self, r: Range) -> list[Kernel]:
        """The kernels launched during ``r``."""
        lo, hi = bisect.bisect_left(self.times, r.start), bisect.bisect_right(self.times, r.end)
        return self.kernels[lo:hi]

    def first_compute_after(self, t: float) -> Kernel | None:
        """The first compute kernel launched at or after ``t``; ``None`` when there is none."""
        position = bisect.bisect_left(self.compute_times, t)
        return self.compute[position] if position < len(self.compute) else None

    def ready(self, kernel: Kernel) -> float:
        """When the compute ``kernel`` could have started: its stream's previous kernel done and the kernel launched
        (never after it did start)."""
        ends = self.compute_ends_by_stream[kernel.stream]  # kernels of one stream run one after the other
        previous = bisect.bisect_right(ends, kernel.start) - 1
        return min(max(ends[previous] if previous >= 0 else kernel.start, kernel.launch), kernel.start)


def _gathers_and_reductions(ranges: list[Range], launches: _Launches) -> tuple[dict[str, list[Kernel]], list[Kernel]]:
    """Each weight's all-gathers in order, and the reduce-scatters: the NCCL kernel launched inside each
    ``fsdp.all_gather`` or ``fsdp.reduce_scatter`` range (the last to end, when there are several)."""
    gathers: dict[str, list[Kernel]] = {}
    reduces: list[Kernel] = []
    for r in ranges:
        if r.name.startswith(GATHER) or r.name.startswith(REDUCE):
            nccl = [k for k in launches.inside(r) if k.is_comm]
            if not nccl:
                continue
            kernel = max(nccl, key=lambda k: k.end)
            if r.name.startswith(GATHER):
                gathers.setdefault(r.name.removeprefix(GATHER), []).append(kernel)
            else:
                reduces.append(kernel)
    return gathers, reduces


def _phase_of(t: float, phase_ranges: list[Range]) -> str:
    """The step phase (``forward``, ``backward``, ``optimizer``) whose CPU range holds ``t``; ``other`` if none."""
    for r in phase_ranges:
        if r.start <= t <= r.end:
            return r.name.removeprefix("step.")
    return "other"


def _pair_uses(ranges: list[Range], gathers: dict[str, list[Kernel]], launches: _Launches,
               phase_ranges: list[Range]) -> list[GatherUse]:
    """The i-th ``fsdp.use`` of a weight against its i-th gather, needed by the first compute kernel launched after
    the use; a use with no gather or no compute kernel after it is left out."""
    uses: list[GatherUse] = []
    seen: dict[str, int] = {}
    for r in ranges:
        if not r.name.startswith(USE):
            continue
        weight = r.name.removeprefix(USE)
        index = seen.get(weight, 0)
        seen[weight] = index + 1
        if index >= len(gathers.get(weight, [])):
            continue
        gather = gathers[weight][index]
        need = launches.first_compute_after(r.start)
        if need is None:
            continue
        uses.append(GatherUse(weight, _phase_of(r.start, phase_ranges), gather.start, gather.end, need.start,
                              launches.ready(need)))
    return uses


def _gathers_summary(kernels: list[Kernel], reduces: list[Kernel], uses: list[GatherUse]) -> dict[str, Any]:
    """Busy time of compute and communication and their overlap (ms), and per phase the gathers, the late ones and
    the compute stream's wait for them."""
    compute_busy = union([(k.start, k.end) for k in kernels if not k.is_comm])
    comm_busy = union([(k.start, k.end) for k in kernels if k.is_comm])
    overlap = total_length(intersect(comm_busy, compute_busy))
    summary: dict[str, Any] = {
        "span_ms": (max(k.end for k in kernels) - min(k.start for k in kernels)) / 1e3 if kernels else 0.0,
        "compute_ms": total_length(compute_busy) / 1e3,
        "comm_ms": total_length(comm_busy) / 1e3,
        "comm_hidden_ms": overlap / 1e3,
        "comm_exposed_ms": (total_length(comm_busy) - overlap) / 1e3,
        "reduce_scatters": len(reduces),
    }
    for phase in ("forward", "backward"):
        in_phase = [u for u in uses if u.phase == phase]
        summary[f"{phase}_gathers"] = len(in_phase)
        summary[f"{phase}_gathers_exposed"] = sum(u.exposed for u in in_phase)
        summary[f"{phase}_stall_ms"] = sum(u.stall_us for u in in_phase) / 1e3
    return summary


def analyze_gathers(trace: dict[str, Any]) -> dict[str, Any]:
    """Pair every FSDP gather with its use; totals of compute, communication and their overlap."""
    kernels, ranges = kernels_and_ranges(trace)
    launches = _Launches(kernels)
    gathers, reduces = _gathers_and_reductions(ranges, launches)
    phase_ranges = [r for r in ranges if r.name in FSDP_PHASES]
    uses = _pair_uses(ranges, gathers, launches, phase_ranges)
    return {"summary": _gathers_summary(kernels, reduces, uses), "uses": uses, "kernels": kernels, "reduces": reduces,
            "phases": [(r.name.removeprefix("step."), r) for r in phase_ranges]}


def _phase_gpu_spans(analysis: dict[str, Any]) -> list[tuple[str, float, float]]:
    """Each phase's GPU extent: from the first to the last kernel launched inside its CPU range."""
    spans = []
    for name, r in analysis["phases"]:
        inside = [k for k in analysis["kernels"] if r.start <= k.launch <= r.end]
        if inside:
            spans.append((name, min(k.start for k in inside), max(k.end for k in inside)))
    return spans


GATHER_LANES = {"compute": 3, "all-gather": 2, "reduce-scatter": 1, "other comm": 0}  # y of each lane
GATHER_COLORS = {"hidden": "#2ca02c", "exposed": "#d62728", "compute": "#7f7f7f", "reduce": "#1f77b4",
                 "other": "#9467bd"}
GATHER_LEGEND = (("compute", "compute kernel"), ("hidden", "all-gather done in time"),
                 ("exposed", "all-gather the layer waited for"), ("reduce", "reduce-scatter"),
                 ("other", "other communication"))


def _zoom_windows(kernels: list[Kernel], spans: list[tuple[str, float, float]], ms: Callable[[float], float],
                  zoom_ms: float) -> list[tuple[float, float]]:
    """The two panels' time windows (ms): the whole step, and ``zoom_ms`` from the middle of the forward pass (of the
    whole step when the trace names no forward phase)."""
    forward = next(((a, b) for name, a, b in spans if name == "forward"),
                   (min(k.start for k in kernels), max(k.end for k in kernels)))
    middle = ms((forward[0] + forward[1]) / 2)
    zoom_start = max(0.0, middle - zoom_ms / 2)
    return [(0.0, ms(max(k.end for k in kernels))), (zoom_start, zoom_start + zoom_ms)]


def _lane_and_color(kernel: Kernel, gathers: dict[tuple[float, float], GatherUse],
                    reduce_ids: set[int]) -> tuple[int, str]:
    """Where ``kernel`` is drawn: compute, an all-gather (hidden or late), a reduce-scatter, other communication."""
    if not kernel.is_comm:
        return GATHER_LANES["compute"], GATHER_COLORS["compute"]
    if (kernel.start, kernel.end) in gathers:
        state = "exposed" if gathers[(kernel.start, kernel.end)].exposed else "hidden"
        return GATHER_LANES["all-gather"], GATHER_COLORS[state]
    if id(kernel) in reduce_ids:
        return GATHER_LANES["reduce-scatter"], GATHER_COLORS["reduce"]
    return GATHER_LANES["other comm"], GATHER_COLORS["other"]


def _kernel_bars(analysis: dict[str, Any], ms: Callable[[float], float], lo: float,
                 hi: float) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """The ``(start, width)`` bars (ms) of the kernels that show between ``lo`` and ``hi``, by lane and color."""
    gathers = {(u.gather_start, u.gather_end): u for u in analysis["uses"]}
    reduce_ids = {id(k) for k in analysis["reduces"]}
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for k in analysis["kernels"]:
        if ms(k.end) < lo or ms(k.start) > hi:
            continue
        # A bar at least a pixel wide: kernels of a few microseconds vanish at the scale of a step.
        bars.setdefault(_lane_and_color(k, gathers, reduce_ids), []).append(
            (ms(k.start), max(ms(k.end) - ms(k.start), (hi - lo) / 3000)))
    return bars


def _draw_gathers_window(ax, analysis: dict[str, Any], spans: list[tuple[str, float, float]],
                         ms: Callable[[float], float], lo: float, hi: float) -> None:
    """One panel from ``lo`` to ``hi`` (ms): the kernels' lanes, a tick where each gathered weight was needed, the
    phases shaded behind."""
    for (lane, color), xs in _kernel_bars(analysis, ms, lo, hi).items():
        ax.broken_barh(xs, (lane - 0.4, 0.8), facecolors=color, edgecolors="none")
    needs = [ms(u.need) for u in analysis["uses"] if lo <= ms(u.need) <= hi]
    gather_lane = GATHER_LANES["all-gather"]
    ax.vlines(needs, gather_lane + 0.45, gather_lane + 0.75, colors="black", linewidth=0.6)
    for name, a, b in spans:
        if ms(b) >= lo and ms(a) <= hi:
            ax.axvspan(max(ms(a), lo), min(ms(b), hi), color="#f3f3f3", zorder=-1)
            ax.text((max(ms(a), lo) + min(ms(b), hi)) / 2, 3.55, name, ha="center", fontsize=8)
    ax.set_xlim(lo, hi)
    ax.set_ylim(-0.6, 3.8)
    ax.set_yticks(list(GATHER_LANES.values()), list(GATHER_LANES))
    ax.set_xlabel("time in the step (ms)")


def _gathers_title(title: str, s: dict[str, Any]) -> str:
    """``title`` over the step's late gathers, the compute stream's wait for them and the exposed communication."""
    return (f"{title}\nforward: {s['forward_gathers_exposed']}/{s['forward_gathers']} all-gathers late "
            f"(compute waited {s['forward_stall_ms']:.2f} ms); backward: {s['backward_gathers_exposed']}/"
            f"{s['backward_gathers']} late ({s['backward_stall_ms']:.2f} ms); communication {s['comm_ms']:.1f} ms, "
            f"{s['comm_exposed_ms']:.1f} ms of it not overlapped with compute")


def render_gathers(analysis: dict[str, Any], path: Path | str, title: str, zoom_ms: float = 4.0) -> None:
    """Two panels: the whole step, and ``zoom_ms`` from the middle of the forward pass. Lanes: compute kernels,
    all-gathers (green: done before the compute stream needed them; red: it waited), reductions and other
    communication; a black tick marks where each gathered weight was needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    kernels: list[Kernel] = analysis["kernels"]
    if not kernels:
        raise ValueError("the trace holds no GPU kernels: record it on a GPU with ProfilerActivity.CUDA")
    t0 = min(k.start for k in kernels)

    def ms(t: float) -> float:
        return (t - t0) / 1e3

    spans = _phase_gpu_spans(analysis)
    fig, axes = plt.subplots(2, 1, figsize=(14, 6.5))
    for ax, (lo, hi) in zip(axes, _zoom_windows(kernels, spans, ms, zoom_ms)):
        _draw_gathers_window(ax, analysis, spans, ms, lo, hi)
    axes[0].set_title(_gathers_title(title, analysis["summary"]), fontsize=9)
    axes[1].set_title(f"zoom: {zoom_ms:g} ms in the middle of the forward pass "
                      "(ticks: when the layer needed its weight)",
                      fontsize=9)
    legend = [Patch(color=GATHER_COLORS[key], label=label) for key, label in GATHER_LEGEND]
    axes[0].legend(handles=legend, loc="upper right", fontsize=7, ncol=5, bbox_to_anchor=(1.0, -0.18))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
