"""Where a training step's time goes: one stack of ``cs336_systems.train`` (with part overrides), warmed up, then
``torch.profiler`` over a few steps; prints as JSON lines the wall time per step, the GPU kernel time per step (their
ratio says whether the step is host-bound), the kernel time per step by class (matmul, attention forward and
backward, norms, loss, optimizer, elementwise, copies, other; ``idle``: the wall time no kernel ran, one stream),
the kernels with the most total time and the host operators with the most own time.

    python scripts/train_step_profile.py --edition 2026 --size xl --context 2048 --batch 4 --stack ours
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time

import torch

from cs336_systems.bench.common import model_sizes, timing
from cs336_systems.bench.common.lm import LMConfig, build_model, random_batch
from cs336_systems.train import STACKS, build_training_step

KERNEL_CLASSES = [  # the first pattern a kernel's name matches names its class
    ("attention_backward", r"attn_bwd|flash_bwd|bprop|dq_convert|dot_do_o|convert_dq|_bwd_.*fmha|fmha.*bwd"),
    ("attention_forward", r"attn_fwd|flash_fwd|fprop|fmha|sdpa"),
    ("matmul", r"nvjet|gemm|cutlass|xmma|sm90_|Kernel2|matmul|cublas"),
    ("norms", r"rmsnorm|rms_norm|residual_norm"),
    ("loss", r"cross_entropy|logsumexp|linear_ce|nll_loss|log_softmax"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("copies", r"memcpy|memset|Memcpy|Memset|copy_kernel|CatArray"),
    ("elementwise", r"triton_poi|triton_red|triton_per|elementwise|vectorized|reduce_kernel|unrolled"),
]


def kernel_class(name: str) -> str:
    """The class of a GPU kernel by its name (:data:`KERNEL_CLASSES`), else ``other``."""
    for label, pattern in KERNEL_CLASSES:
        if re.search(pattern, name):
            return label
    return "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--edition", default=model_sizes.DEFAULT_EDITION, choices=list(model_sizes.EDITIONS))
    p.add_argument("--size", default="xl", help="model size, named as in --edition")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--stack", default="ours", choices=list(STACKS))
    p.add_argument("--override", nargs="*", default=[])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    size = model_sizes.canonical_size(args.size, args.edition)
    parts = STACKS[args.stack].with_overrides(args.override)
    config = LMConfig(size, args.context, args.batch)
    device = torch.device("cuda")
    step = build_training_step(build_model(config, device), parts)
    x, y = random_batch(config, device)
    for _ in range(4):
        step(x, y)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, acc_events=True) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step(x, y)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
    kernels, calls = timing.kernel_times_ms(prof.events(), args.steps)  # per step
    gpu = sum(kernels.values())
    by_class = collections.Counter()
    for name, ms in kernels.items():
        by_class[kernel_class(name)] += ms
    by_class["idle"] = max(wall * 1e3 - gpu, 0.0)
    print(json.dumps(dict(stack=args.stack, parts=vars(parts), size=size, edition=args.edition, context=args.context,
                          batch=args.batch, wall_ms=wall * 1e3, gpu_kernel_ms=gpu,
                          host_bound_share=1 - gpu / (wall * 1e3), peak_gb=torch.cuda.max_memory_allocated() / 1e9,
                          device=torch.cuda.get_device_name(), ms_by_class=dict(by_class.most_common()))))
    for name, ms in kernels.most_common(args.top):
        print(json.dumps(dict(kernel=name[:90], kernel_class=kernel_class(name), ms_per_step=ms,
                              calls_per_step=calls[name])))
    host = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    for e in host:
        print(json.dumps(dict(host_op=e.key[:90], self_cpu_ms_per_step=e.self_cpu_time_total / 1e3 / args.steps,
                              calls_per_step=e.count / args.steps)))


if __name__ == "__main__":
    main()
