"""Timelines of compute and communication from ``torch.profiler`` Chrome traces, drawn as a PNG.

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
:func:`render` draws one block of lanes per rank, the overlapped part of each communication span
highlighted, so overlap, or its absence, is plain to see. Reusable by any benchmark that records a trace::

    python -m cs336_systems.bench.timeline rank0.json rank1.json -o timeline.png --title "bucketed DDP"
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMM_PATTERN = re.compile(r"nccl|gloo|c10d::|all_?reduce|all_?gather|reduce_?scatter|broadcast", re.IGNORECASE)
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
PHASES = ("forward", "backward", "finish_gradient_synchronization", "optimizer")


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


def load_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace from ``.json`` or ``.json.gz``."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as file:
        return json.load(file)


def _complete_events(trace: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def timeline_from_trace(trace: dict[str, Any] | list[dict[str, Any]], phases: tuple[str, ...] = PHASES) -> Timeline:
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


def merge(spans: list[Span]) -> list[tuple[float, float]]:
    """The union of ``spans`` as disjoint, sorted ``(start, end)`` intervals."""
    merged: list[list[float]] = []
    for span in sorted(spans, key=lambda s: s.start_ms):
        if merged and span.start_ms <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], span.end_ms)
        else:
            merged.append([span.start_ms, span.end_ms])
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


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def overlap_summary(timeline: Timeline) -> dict[str, float | None]:
    """Busy time of each lane, communication time overlapped with compute, and its share (ms)."""
    compute, communication = merge(timeline.compute), merge(timeline.communication)
    comm_ms = _length(communication)
    overlap_ms = _length(intersect(compute, communication))
    everything = merge(timeline.compute + timeline.communication)
    return {
        "span_ms": everything[-1][1] - everything[0][0] if everything else 0.0,
        "compute_busy_ms": _length(compute),
        "comm_busy_ms": comm_ms,
        "comm_overlapped_ms": overlap_ms,
        "comm_exposed_ms": comm_ms - overlap_ms,
        "overlap_share": overlap_ms / comm_ms if comm_ms > 0 else None,
    }


PHASE_COLORS = {"forward": "#9ecae1", "backward": "#fdae6b", "finish_gradient_synchronization": "#fc9272",
                "optimizer": "#a1d99b"}


def render(timelines: list[Timeline], path: str | Path, title: str = "", labels: list[str] | None = None) -> None:
    """One block of lanes (phases, compute, communication) per timeline; overlapped communication in green."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = labels or [f"rank {i}" for i in range(len(timelines))]
    lanes_per_rank = 3
    fig, ax = plt.subplots(figsize=(14, 1.0 + 1.05 * lanes_per_rank * len(timelines)))
    yticks, yticklabels = [], []
    end = max((s.end_ms for t in timelines for s in t.compute + t.communication + t.phases), default=1.0)
    for rank, (timeline, label) in enumerate(zip(timelines, labels)):
        base = (len(timelines) - 1 - rank) * (lanes_per_rank + 0.6)
        phase_y, compute_y, comm_y = base + 2, base + 1, base
        kind = "kernels" if timeline.source == "gpu" else "CPU ops"
        summary = overlap_summary(timeline)
        share = "-" if summary["overlap_share"] is None else f"{100 * summary['overlap_share']:.0f} %"
        comm_label = f"communication\n({summary['comm_busy_ms']:.1f} ms, {share} overlapped)"
        for y, name in ((phase_y, "phases"), (compute_y, f"compute {kind}"), (comm_y, comm_label)):
            yticks.append(y + 0.4)
            yticklabels.append(f"{label}: {name}")
        for span in timeline.phases:
            color = PHASE_COLORS.get(span.name, "#d9d9d9")
            ax.broken_barh([(span.start_ms, span.end_ms - span.start_ms)], (phase_y, 0.8), facecolors=color,
                           edgecolors="grey", linewidth=0.5)
            if span.end_ms - span.start_ms > 0.06 * end:
                short = "grad sync" if span.name == "finish_gradient_synchronization" else span.name
                ax.text((span.start_ms + span.end_ms) / 2, phase_y + 0.4, short, ha="center", va="center", fontsize=8)
        compute, communication = merge(timeline.compute), merge(timeline.communication)
        ax.broken_barh([(a, b - a) for a, b in compute], (compute_y, 0.8), facecolors="#3182bd")
        ax.broken_barh([(a, b - a) for a, b in communication], (comm_y, 0.8), facecolors="#e6550d")
        overlapped = intersect(compute, communication)
        ax.broken_barh([(a, b - a) for a, b in overlapped], (comm_y, 0.8), facecolors="#31a354")
    ax.set_yticks(yticks, yticklabels, fontsize=8)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("time since the first event of the rank's trace (ms)")
    ax.legend(handles=[Patch(color="#3182bd", label="compute"), Patch(color="#e6550d", label="communication"),
                       Patch(color="#31a354", label="communication overlapped with compute")],
              loc="upper center", bbox_to_anchor=(0.5, -0.12 if len(timelines) > 1 else -0.25), ncol=3, fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path, help="Chrome traces, one per rank, in rank order")
    p.add_argument("-o", "--output", type=Path, required=True, help="the PNG to write")
    p.add_argument("--title", default="")
    p.add_argument("--phases", nargs="*", default=list(PHASES), help="record_function ranges drawn as phases")
    args = p.parse_args(argv)
    timelines = [timeline_from_trace(load_trace(path), tuple(args.phases)) for path in args.traces]
    for path, timeline in zip(args.traces, timelines):
        summary = overlap_summary(timeline)
        print(f"{path}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items() if v is not None))
    render(timelines, args.output, args.title)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
