"""Where the 2026 leaderboard step's time goes, per stack: ``--layers`` blocks (default 34: the full step) of the 8B
model at context 32,768 on ``--world-size`` GPUs (one sequence per rank; 1: the one-GPU proxy of one rank's work),
``--warmup-steps`` steps (compilation included), then ``torch.profiler`` (CPU and CUDA) over ``--steps`` steps on
every rank. Rank 0's trace is split by ``cs336_systems.bench.common.step_split``: matmuls, attention forward and
backward, recompute (forward kernels the backward runs again), elementwise, norms, loss, optimizer and the exposed
communication (NCCL time no compute kernel hid), per step; the row (``leaderboard_2026_profile``) also keeps the
kernels summed by name alone (``gpu_ms``) and the slowest kernels, and is appended to ``--results-dir``.

The full step on 2 GPUs (one warm-up step and one profiled step per stack: about a minute a stack, most of it
building the model and compiling):

    python scripts/leaderboard_2026_profile.py --stacks ours torch
    python scripts/leaderboard_2026_profile.py --stacks ours torch --checkpoint-plan stack  # each stack's own plan
    python scripts/leaderboard_2026_profile.py --layers 4 --stacks ours --checkpoint-plan stack \
        --override ours:checkpointing=full
    python scripts/leaderboard_2026_profile.py --world-size 1 --layers 4     # the one-GPU proxy
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist

from cs336_basics.model import BasicsTransformerLM
from cs336_systems.bench.common import distributed_launch as dl
from cs336_systems.bench.common import memory, result_store, step_split
from cs336_systems.bench.common.leaderboard_2026_check import batch_of_rank
from cs336_systems.bench.common.leaderboard_2026_model import GB, MODEL, ROW_NAMES, plan_of_option
from cs336_systems.bench.common.timeline import load_trace
from cs336_systems.parallel.distributed import spawn
from cs336_systems.train import SHARDED_STACKS, build_training_step
from cs336_systems.train.checkpoint_plan import GiB

PROBLEM = "leaderboard_2026_profile"
TOOL = "scripts/leaderboard_2026_profile.py"


def build_stack(stack: str, args, device: torch.device, world: int, free_bytes: float | None):
    """``stack`` with its ``--override`` parts and its ``--checkpoint-plan`` (``auto`` fills ``free_bytes``, the
    ranks' least free memory before any stack was built), on a fresh model (seed 0); the overrides and the
    plan, and the parts built."""
    overrides = [o.split(":", 1)[1] for o in args.override if o.startswith(stack + ":")]
    parts = SHARDED_STACKS[stack].with_overrides(overrides)
    plan = None
    if args.checkpoint_plan != "stack":
        config = {**MODEL, "num_layers": args.layers}
        margin = None if args.memory_margin_gib is None else args.memory_margin_gib * GiB
        plan = plan_of_option(args.checkpoint_plan, config, stack, world, 1, free_bytes, margin)
        parts = parts.with_(checkpointing=plan.modes)
        if dist.get_rank() == 0:
            print(f"# {stack}: checkpoint plan: {plan.describe()}", flush=True)
    torch.manual_seed(0)
    model = BasicsTransformerLM(**{**MODEL, "num_layers": args.layers}, device=device)
    return build_training_step(model, parts, autocast_dtype=torch.bfloat16), overrides, plan, parts


def profile_steps(step, x, y, steps: int, trace_path: str | None):
    """``steps`` steps under ``torch.profiler``; the wall ms per step. Writes the Chrome trace to ``trace_path``."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    dist.barrier()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            with torch.profiler.record_function("training_step"):  # the split's step boundaries
                step(x, y)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return wall_ms


def step_row(kernels: list[step_split.StepKernel], wall_ms: float, steps: int, top: int) -> dict:
    """The row's measurements from rank 0's kernels over ``steps`` steps: the split per step, the kernels by
    name-only category, the ``top`` slowest kernels and the ``top`` slowest of those counted as recompute (ms per
    step)."""
    split = step_split.split_step(kernels, wall_ms * steps)
    per_step = {k: v / steps for k, v in split["split_ms"].items()}
    by_name, by_kernel, recomputed = collections.Counter(), collections.Counter(), collections.Counter()
    for k in kernels:
        by_name[step_split.name_category(k.name)] += (k.end - k.start) / 1e3 / steps
        by_kernel[k.name[:90]] += (k.end - k.start) / 1e3 / steps
        if k.category == "recompute":
            recomputed[k.name[:90]] += (k.end - k.start) / 1e3 / steps
    return {"wall_ms": wall_ms, "split_ms": {k: round(v, 2) for k, v in per_step.items()},
            "communication_ms": split["communication_ms"] / steps, "idle_ms": split["idle_ms"] / steps,
            "idle_gaps": step_split.idle_gaps(kernels, top),
            "gpu_ms": {k: round(v, 1) for k, v in by_name.most_common()},
            "top_kernels": {k: round(v, 1) for k, v in by_kernel.most_common(top)},
            "top_recompute_kernels": {k: round(v, 1) for k, v in recomputed.most_common(top)}}


def rank(rank: int, world: int, args) -> None:
    device = torch.device("cuda", rank)
    config = {**MODEL, "num_layers": args.layers}
    # Measured once: a stack's memory is not all returned to the device before the next is built.
    free_bytes = dl.least_free_bytes(device) if args.checkpoint_plan == "auto" else None
    for stack in args.stacks:
        step, overrides, plan, parts = build_stack(stack, args, device, world, free_bytes)
        x, y = batch_of_rank(config, device, rank, world, world)
        for _ in range(args.warmup_steps):
            step(x, y)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = memory.allocator_events(device)
        with tempfile.TemporaryDirectory() as folder:
            trace_path = os.path.join(folder, "trace.json") if rank == 0 else None
            wall_ms = profile_steps(step, x, y, args.steps, trace_path)
            if rank == 0:
                measured = step_row(step_split.kernels_of_trace(load_trace(trace_path)), wall_ms, args.steps,
                                    args.top)
                measured["allocator_events"] = memory.allocator_events_since(before, device)
                case = {"stack": ROW_NAMES[stack], "parts": overrides, "layers": args.layers, "world_size": world,
                        "context_length": MODEL["context_length"], "batch_per_rank": 1,
                        "checkpoint_option": None if args.checkpoint_plan == "stack" else args.checkpoint_plan,
                        "warmup_steps": args.warmup_steps,
                        "profiled_steps": args.steps}
                measured["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
                if parts.sharding == "ours":
                    measured["gradient_memory"] = parts.gradient_memory
                if plan is not None:
                    measured["checkpoint_plan"] = {"describe": plan.describe(),
                                                   "predicted_peak_gb": plan.peak_bytes / GB,
                                                   "modes": list(plan.modes)}
                store = result_store.ResultStore(PROBLEM, args.results_dir, quiet=True)
                row = store.add(case, {**measured, "tool": TOOL})
                print(json.dumps({k: row[k] for k in ("stack", "parts", "layers", "wall_ms", "split_ms",
                                                      "communication_ms", "idle_ms", "idle_gaps",
                                                      "allocator_events", "peak_gb")}), flush=True)
        del step
        torch.cuda.empty_cache()
        dist.barrier()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=MODEL["num_layers"], help="blocks (default 34: the full step)")
    p.add_argument("--stacks", nargs="+", default=["ours", "torch"], choices=list(SHARDED_STACKS))
    p.add_argument("--override", nargs="*", default=[], help="stack:part=value, e.g. ours:attention=sdpa")
    p.add_argument("--checkpoint-plan", choices=("auto", "selective", "full", "stack"), default="auto",
                   help="what each block's backward recomputes, as in cs336_systems.bench.leaderboard_2026: 'auto' "
                        "(default) plans from the ranks' free memory; 'selective' / 'full' in every block; 'stack': "
                        "each stack's own")
    p.add_argument("--memory-margin-gib", type=float, default=None,
                   help="memory left out of the auto plan's budget (default: the larger of 4 GiB and 5 %% of the "
                        "free memory)")
    p.add_argument("--warmup-steps", type=int, default=1, help="steps before the profiled ones (compilation)")
    p.add_argument("--steps", type=int, default=1, help="profiled steps (the row gives per-step times)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--world-size", type=int, default=2, help="GPUs (1: the one-GPU proxy of one rank's work)")
    p.add_argument("--results-dir", default=None, help="where the row goes (default writeup/results)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    spawn(rank, args.world_size, args, backend="nccl", timeout_s=args.timeout_s)


if __name__ == "__main__":
    main()
