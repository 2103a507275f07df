"""Where the 2026 leaderboard step's time goes, per stack: ``--layers`` blocks of the 8B model at context 32,768 on
``--world-size`` GPUs (one sequence per rank; 1: the one-GPU proxy of one rank's work), warmed up, then
``torch.profiler`` over one step on rank 0; prints the step's wall time and its GPU kernel time by category
(attention forward/backward, matmuls, collectives, the rest), per block where it scales with depth, as JSON lines.

    python scripts/leaderboard_2026_profile.py --layers 4 --stacks ours torch --override ours:keep_attention=false
    python scripts/leaderboard_2026_profile.py --world-size 1 --layers 4     # the one-GPU proxy
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
import torch.distributed as dist

from cs336_basics.model import BasicsTransformerLM
from cs336_systems.bench.common.leaderboard_2026_model import ROW_NAMES
from cs336_systems.parallel.distributed import spawn
from cs336_systems.train import SHARDED_STACKS, build_training_step

MODEL = dict(vocab_size=151_936, context_length=32_768, d_model=4096, d_ff=11_008, num_heads=32)
CATEGORIES = [  # (category, substrings of kernel names), first match wins
    ("attention_backward", ("flash_attention_bwd", "_bwd_", "attn_bwd", "flash_bprop", "cudnn_bwd", "dq_", "dkdv")),
    ("attention_forward", ("flash_attention_fwd", "_fwd_", "attn_fwd", "flash_fprop", "cudnn_fwd", "fmha")),
    ("collectives", ("nccl",)),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "wgmma")),
    ("cross_entropy", ("cross_entropy", "softmax", "log_softmax", "nll")),
    ("optimizer", ("adam",)),
    ("rmsnorm", ("rmsnorm", "rms_norm")),
]


def category(name: str) -> str:
    lower = name.lower()
    for label, keys in CATEGORIES:
        if any(key in lower for key in keys):
            return label
    return "other"


def rank(rank: int, world: int, args) -> None:
    device = torch.device("cuda", rank)
    for stack in args.stacks:
        parts = SHARDED_STACKS[stack]
        overrides = [o.split(":", 1)[1] for o in args.override if o.startswith(stack + ":")]
        parts = parts.with_overrides(overrides)
        torch.manual_seed(0)
        model = BasicsTransformerLM(**MODEL, num_layers=args.layers, device=device)
        step = build_training_step(model, parts, autocast_dtype=torch.bfloat16)
        tokens = torch.randint(0, MODEL["vocab_size"], (1, MODEL["context_length"] + 1),
                               generator=torch.Generator().manual_seed(rank)).to(device)
        x, y = tokens[:, :-1], tokens[:, 1:]
        for _ in range(3):
            step(x, y)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            step(x, y)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        if rank == 0:
            by_category, by_kernel = collections.Counter(), collections.Counter()
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    by_category[category(event.name)] += event.device_time / 1e3
                    by_kernel[event.name[:90]] += event.device_time / 1e3
            print(json.dumps({"stack": ROW_NAMES[stack], "parts": overrides, "layers": args.layers, "world_size": world,
                              "wall_ms": wall * 1e3, "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9,
                              "gpu_ms": {k: round(v, 1) for k, v in by_category.most_common()},
                              "top_kernels": {k: round(v, 1) for k, v in by_kernel.most_common(args.top)}}), flush=True)
        del step, model
        torch.cuda.empty_cache()
        dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--stacks", nargs="+", default=["ours", "torch"], choices=list(SHARDED_STACKS))
    p.add_argument("--override", nargs="*", default=[], help="stack:part=value, e.g. ours:attention=sdpa")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--world-size", type=int, default=2, help="GPUs (1: the one-GPU proxy of one rank's work)")
    args = p.parse_args()
    spawn(rank, args.world_size, args, backend="nccl", timeout_s=500)


if __name__ == "__main__":
    main()
