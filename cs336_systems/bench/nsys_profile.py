"""Kernel-level profile of the model (problem ``nsys_profile``), through ``torch.profiler``.

Nsight Systems answers these questions with NVTX ranges; where ``nsys`` is missing (our GPU machines),
``torch.profiler`` answers the same ones. For every size and context length 128, 256, 512, 1024
(out-of-memory cases are rows), with the NVTX/``record_function``-annotated attention swapped in:

* the forward pass's GPU time (sum of its kernels) beside the Python timer's forward time;
* per phase (forward, backward, optimizer) of a full training step: the kernels with the most GPU
  time and how often each runs per step, the matmul share, and the heaviest non-matmul kernels;
* inside the forward's attention: GPU time of the scores matmul, the softmax and the final matmul,
  beside their FLOPs.

Each phase runs inside NVTX ranges too, so ``nsys profile python -m cs336_systems.bench.nsys_profile``
shows the same structure where Nsight Systems exists; nothing here depends on it.

Kernels are assigned to a phase (and to an attention stage) by time: the profiler mirrors every
``record_function`` range on the GPU timeline, and a kernel belongs to the range it starts in. The step
synchronises at the end of every phase, inside its range, so phases never overlap on the GPU. The backward
is the exception: autograd launches its kernels from its own thread, outside the main thread's range, so the
backward is what runs between the end of a step's forward and the start of its optimizer step.

Examples::

    python -m cs336_systems.bench.nsys_profile
    python -m cs336_systems.bench.nsys_profile --sizes small --contexts 512
"""

from __future__ import annotations

import contextlib
import statistics
from collections import defaultdict
from typing import Any

import torch

from cs336_systems.attention.reference import nvtx_range
from cs336_systems.bench.common import cli, model_sizes, result_store, timing
from cs336_systems.bench.common.lm import LMConfig, build_model, make_optimizer, make_step, random_batch

PROBLEM = "nsys_profile"
PHASES = ("forward", "backward", "optimizer")
ATTENTION_RANGES = ("computing attention scores", "computing softmax", "final matmul")
MATMUL_MARKERS = ("gemm", "xmma", "cutlass", "wgmma", "nvjet", "matmul", "cublas", "sm90_", "sm80_", "ampere_")
TOP = 8


def parser():
    p = cli.base_parser(__doc__)
    cli.add_model_size(p, multiple=True, default="the edition's every size")
    p.add_argument("--contexts", nargs="+", type=cli.positive_int, default=None,
                   help="context lengths (default 128 256 512 1024)")
    p.add_argument("--batch-size", type=cli.positive_int, default=4)
    p.add_argument("--steps", type=cli.positive_int, default=2, help="profiled training steps (after 2 warm-up steps)")
    return p


def is_matmul(kernel_name: str) -> bool:
    name = kernel_name.lower()
    return any(marker in name for marker in MATMUL_MARKERS)


def phase_range(name: str) -> contextlib.AbstractContextManager:
    stack = contextlib.ExitStack()
    stack.enter_context(nvtx_range(name))
    stack.enter_context(torch.profiler.record_function(name))
    return stack


def kernel_table(kernels: list[tuple[str, float]], steps: int) -> dict[str, Any]:
    """Per-step totals of ``(name, us)`` kernels: total, matmul share, top kernels and top non-matmul ones."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, us in kernels:
        by_name[name].append(us)
    total = sum(us for _, us in kernels)
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    entry = lambda name, times: {  # noqa: E731
        "name": name[:160], "ms": sum(times) / 1e3 / steps, "calls": len(times) / steps,
        "share": sum(times) / total if total else 0.0, "matmul": is_matmul(name),
    }
    return {
        "gpu_ms": total / 1e3 / steps,
        "kernel_launches": len(kernels) / steps,
        "matmul_share": sum(us for name, us in kernels if is_matmul(name)) / total if total else 0.0,
        "top_kernels": [entry(n, t) for n, t in ranked[:TOP]],
        "top_non_matmul": [entry(n, t) for n, t in ranked if not is_matmul(n)][:TOP],
    }


def attention_flops(config: LMConfig) -> dict[str, float]:
    """FLOPs of the three attention stages over all layers (naive attention: the full score matrix)."""
    h = config.hparams
    b, s, d, heads, layers = config.batch_size, config.context_length, h["d_model"], h["num_heads"], h["num_layers"]
    matmul = 2 * b * s * s * d * layers  # over all heads: heads * (2 * s * s * d_head)
    # softmax: max, subtract, exp, sum, divide: about 5 operations per score.
    return {"computing attention scores": matmul, "computing softmax": 5 * b * heads * s * s * layers,
            "final matmul": matmul}


def profile_case(config: LMConfig, steps: int, device: torch.device) -> dict[str, Any]:
    model = build_model(config, device, attention="annotated")
    optimizer = make_optimizer(model)
    batch = random_batch(config, device)
    train = make_step(model, batch, "train_step", None, optimizer, phase_range=phase_range)
    forward = make_step(model, batch, "forward", None)
    for _ in range(2):
        train({})
    forward_s = []
    for _ in range(5):  # the Python timer's forward, outside the profiler
        phases: dict[str, float] = {}
        forward(phases)
        forward_s.append(phases["forward"])
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            train({})
        timing.synchronize(device)
    events = list(prof.events())
    on_gpu = lambda e: e.device_type != torch.autograd.DeviceType.CPU  # noqa: E731
    # The profiler mirrors each record_function range on the GPU timeline as an event of the same name
    # (a "user annotation" spanning the range's kernels): those give the spans; they are not kernels.
    annotations = set(PHASES) | set(ATTENTION_RANGES)
    kernels = [(e.time_range.start, e.name, e.time_range.elapsed_us()) for e in events
               if on_gpu(e) and e.name not in annotations and not getattr(e, "is_user_annotation", False)]

    def spans(name: str) -> list[tuple[float, float]]:
        gpu = [(e.time_range.start, e.time_range.end) for e in events if e.name == name and on_gpu(e)]
        return gpu or [(e.time_range.start, e.time_range.end) for e in events if e.name == name]

    def backward_spans() -> list[tuple[float, float]]:
        # Autograd launches the backward kernels from its own thread, outside the main thread's
        # "backward" range; phases are synchronised, so the backward is what runs on the GPU between
        # the end of a step's forward and the start of its optimizer step.
        ends = sorted(end for _, end in spans("forward"))
        starts = sorted(start for start, _ in spans("optimizer"))
        return list(zip(ends, starts))

    def inside(name: str) -> list[tuple[str, float]]:
        name_spans = backward_spans() if name == "backward" else spans(name)
        return [(k, us) for start, k, us in kernels if any(a <= start <= b for a, b in name_spans)]

    result: dict[str, Any] = {"forward_python_ms": statistics.median(forward_s) * 1e3}
    for phase in PHASES:
        result[phase] = kernel_table(inside(phase), steps)
    result["train_step"] = kernel_table([k for phase in PHASES for k in inside(phase)], steps)
    flops = attention_flops(config)
    attention = {}
    for name in ATTENTION_RANGES:
        gpu_us = sum(us for _, us in inside(name))
        attention[name] = {"gpu_ms": gpu_us / 1e3 / steps, "flops": flops[name]}
    result["attention_forward"] = attention
    return result


def main(argv: list[str] | None = None) -> None:
    args, device, tiny = cli.start(parser(), argv)
    sizes = args.sizes or (["tiny"] if tiny else model_sizes.edition_sizes(args.edition))
    contexts = args.contexts or ([32] if tiny else [128, 256, 512, 1024])
    if tiny:
        args.batch_size, args.steps = min(args.batch_size, 2), 1
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force, edition=args.edition)
    cases = [dict(size=s, context_length=c, batch_size=args.batch_size, dtype="fp32", steps=args.steps)
             for s in sizes for c in contexts]
    for case in cli.progress(store.pending(cases), PROBLEM):
        config = LMConfig(case["size"], case["context_length"], case["batch_size"])
        result = (model_sizes.estimated_oom(config.size, "train_step", device)
                  or result_store.measure_or_oom(lambda: profile_case(config, args.steps, device)))
        store.add(case, result)
        timing.free_memory()
    rows = store.asked_rows()
    for row in rows:
        row["forward_gpu_ms"] = row.get("forward", {}).get("gpu_ms")
        row["fwd_matmul_share"] = row.get("forward", {}).get("matmul_share")
        row["step_matmul_share"] = row.get("train_step", {}).get("matmul_share")
        top = row.get("forward", {}).get("top_kernels") or [{}]
        row["fwd_top_kernel"] = (top[0].get("name") or "-")[:40]
    cli.print_table(rows, ["size", "context_length", "forward_python_ms", "forward_gpu_ms", "fwd_matmul_share",
                           "step_matmul_share", "fwd_top_kernel", "oom"])


if __name__ == "__main__":
    main()
