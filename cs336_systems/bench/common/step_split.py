"""Where one profiled training step's GPU time goes: every kernel of a ``torch.profiler`` Chrome trace in one
category, and the communication that no compute kernel hid.

A kernel's category comes from its name (:data:`KERNEL_CATEGORIES`, the first pattern that matches) and from when
and where the CPU launched it (the trace links each kernel to its launching call by a ``correlation`` id):

* the *backward* is the stretch of CPU time from the first to the last of the autograd engine's
  ``autograd::engine::evaluate_function: ...`` ranges (or a ``record_function`` range named ``step.backward``),
  one stretch per step where the trace marks its steps (:data:`STEP_RANGE`: ``prof.step()`` or a
  ``record_function`` range named ``training_step``), so that a later step's forward is not taken for backward;
* a *forward* kernel is one whose name says so (an attention forward, ``fwd`` / ``fprop`` / ``forward``) or one
  launched inside a forward range on its thread (:data:`FORWARD_RANGE`: a compiled graph's forward, a linear
  layer); PyTorch does not annotate checkpointing, but ``torch.utils.checkpoint`` recomputes a block inside the
  backward, so a forward kernel launched there is *recompute*.

Communication (NCCL kernels) runs on its own stream beside the computation; only the part of it during which no
compute kernel ran, on any stream, is *exposed*: the union of the communication kernels' intervals less the union
of the compute kernels'.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any

from cs336_systems.bench.common.timeline import LAUNCH_CATEGORIES, intersect, total_length, union

# (category, pattern searched in the lower-cased kernel name); the first that matches wins, so the norms' and the
# loss's own "fwd"/"bwd" kernels are claimed before attention's patterns see them.
KERNEL_CATEGORIES = (
    ("communication", r"nccl"),
    ("norms", r"rms_?norm|layer_?norm|rsqrt"),
    ("loss", r"cross_entropy|log_softmax|nll_loss"),
    ("optimizer", r"adam"),
    ("attention_backward", r"attn_bwd|flash_bwd|bprop|fmha.*bwd|attention_backward|dot_do_o"),
    ("attention_forward", r"attn_fwd|flash_fwd|fprop|fmha|attention_forward"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|wgmma|triton_tem_fused_.*mm|splitkreduce"),
)
OTHER_CATEGORY = "elementwise"  # what no pattern claims: copies, casts, Inductor's fused pointwise kernels
# The split of the step, in the order a stacked bar shows it (``recompute`` and ``exposed_communication`` are
# decided by when a kernel ran, not by its name alone).
SPLIT = ("matmul", "attention_forward", "attention_backward", "recompute", "elementwise", "norms", "loss",
         "optimizer", "exposed_communication")
FORWARD_NAME = re.compile(r"fwd|fprop|forward")
FORWARD_RANGE = re.compile(r"^(CompiledFunction|Torch-Compiled Region.*|aten::(linear|einsum|matmul|embedding))$")
BACKWARD_RANGE = re.compile(r"^(autograd::engine::evaluate_function: .*|step\.backward)$")
STEP_RANGE = re.compile(r"^(ProfilerStep#\d+|training_step)$")
_PATTERNS = tuple((category, re.compile(pattern)) for category, pattern in KERNEL_CATEGORIES)


def name_category(name: str) -> str:
    """The category of a kernel by its name alone (:data:`KERNEL_CATEGORIES`)."""
    lower = name.lower()
    return next((category for category, pattern in _PATTERNS if pattern.search(lower)), OTHER_CATEGORY)


@dataclass(frozen=True)
class StepKernel:
    """A GPU kernel of the step: its name, GPU interval (us), whether the CPU launched it during the backward and
    whether inside a forward range on its thread."""

    name: str
    start: float
    end: float
    in_backward: bool = False
    in_forward_range: bool = False

    @property
    def category(self) -> str:
        """:func:`name_category`, except that a forward kernel launched during the backward is ``recompute``."""
        category = name_category(self.name)
        if category == "communication" or not self.in_backward:
            return category
        forward = category == "attention_forward" or FORWARD_NAME.search(self.name.lower()) or self.in_forward_range
        return "recompute" if forward else category


def exposed_us(communication: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """How long communication ran while no compute did: the union of ``communication`` less that of ``compute``."""
    comm = union(communication)
    return total_length(comm) - total_length(intersect(comm, union(compute)))


def split_step(kernels: list[StepKernel], wall_ms: float) -> dict[str, Any]:
    """The step's GPU time in ms by :data:`SPLIT` category (``split_ms``: compute kernels summed per category and
    the exposed communication), with ``communication_ms`` (all of it), ``idle_ms`` (the wall time no kernel
    covered) and ``wall_ms``."""
    split = dict.fromkeys(SPLIT, 0.0)
    comm, compute = [], []
    for k in kernels:
        category = k.category
        if category == "communication":
            comm.append((k.start, k.end))
            continue
        compute.append((k.start, k.end))
        split[category] += (k.end - k.start) / 1e3
    split["exposed_communication"] = exposed_us(comm, compute) / 1e3
    busy = total_length(union(comm + compute)) / 1e3
    return {"split_ms": split, "communication_ms": total_length(union(comm)) / 1e3,
            "idle_ms": max(0.0, wall_ms - busy), "wall_ms": wall_ms}


def idle_gaps(kernels: list[StepKernel], top: int = 8) -> dict[str, Any]:
    """Where the GPU ran no kernel between the step's first and last: ``span_ms`` (first start to last end),
    ``gaps_ms`` and ``gap_count`` (the stretches no kernel on any stream covered), and the ``top`` largest, each
    with its length, when it began (ms after the first kernel's start) and the kernels that ended before it and
    started after it (names cut to 80 characters)."""
    if not kernels:
        return {"span_ms": 0.0, "gaps_ms": 0.0, "gap_count": 0, "largest": []}
    ordered = sorted(kernels, key=lambda k: k.start)
    first = ordered[0].start
    gaps = []
    busy_until, last = ordered[0].end, ordered[0]
    for k in ordered[1:]:
        if k.start > busy_until:
            gaps.append({"ms": (k.start - busy_until) / 1e3, "at_ms": (busy_until - first) / 1e3,
                         "after": last.name[:80], "before": k.name[:80]})
        if k.end > busy_until:
            busy_until, last = k.end, k
    largest = sorted(gaps, key=lambda g: -g["ms"])[:top]
    return {"span_ms": (busy_until - first) / 1e3, "gaps_ms": sum(g["ms"] for g in gaps), "gap_count": len(gaps),
            "largest": [{**g, "ms": round(g["ms"], 3), "at_ms": round(g["at_ms"], 2)} for g in largest]}


def backward_windows(backward: list[tuple[float, float]],
                     steps: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The backward's stretches of CPU time: from the first to the last of the ``backward`` ranges within each of
    the ``steps`` ranges, or, where the trace marks no steps, over all of them."""
    if not steps:
        return [(min(s for s, _ in backward), max(e for _, e in backward))] if backward else []
    windows = []
    for first, last in steps:
        inside = [(s, e) for s, e in backward if first <= s and e <= last]
        if inside:
            windows.append((min(s for s, _ in inside), max(e for _, e in inside)))
    return windows


def _inside(intervals: list[tuple[float, float]], starts: list[float], t: float) -> bool:
    position = bisect.bisect_right(starts, t) - 1
    return position >= 0 and t <= intervals[position][1]


def kernels_of_trace(trace: dict[str, Any]) -> list[StepKernel]:
    """The kernels of a Chrome trace (``prof.export_chrome_trace``) of one step, each with where it was launched
    (module docstring); kernels whose launch the trace does not link count as neither backward nor forward."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    launches = {e["args"]["correlation"]: (e.get("tid"), float(e["ts"])) for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    ranges = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    backward = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in ranges
                if BACKWARD_RANGE.match(e["name"])]
    steps = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in ranges if STEP_RANGE.match(e["name"])]
    windows = backward_windows(backward, steps)
    forward: dict[Any, list[tuple[float, float]]] = {}
    for e in ranges:
        if FORWARD_RANGE.match(e["name"]):
            forward.setdefault(e.get("tid"), []).append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
    forward = {tid: union(spans) for tid, spans in forward.items()}
    starts = {tid: [s for s, _ in spans] for tid, spans in forward.items()}
    kernels = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        tid, at = launches.get(e.get("args", {}).get("correlation"), (None, None))
        start = float(e["ts"])
        kernels.append(StepKernel(
            e["name"], start, start + float(e.get("dur", 0)),
            in_backward=at is not None and any(first <= at <= last for first, last in windows),
            in_forward_range=at is not None and tid in forward and _inside(forward[tid], starts[tid], at)))
    return kernels
