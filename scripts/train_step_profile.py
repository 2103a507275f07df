"""Where a training step's time goes: one stack of ``cs336_systems.train`` (with part overrides), warmed up, then
``torch.profiler`` over a few steps; prints the wall time per step, the GPU kernel time per step (their ratio says
whether the step is host-bound) and the kernels with the most total time, as JSON lines.

    python scripts/train_step_profile.py --size xl --context 512 --batch 4 --stack ours --override loss=plain
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from cs336_systems.bench.common.lm import LMConfig, build_model, random_batch
from cs336_systems.train import STACKS, build_training_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="xl")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--stack", default="ours", choices=list(STACKS))
    p.add_argument("--override", nargs="*", default=[])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    parts = STACKS[args.stack].with_overrides(args.override)
    config = LMConfig(args.size, args.context, args.batch)
    device = torch.device("cuda")
    step = build_training_step(build_model(config, device), parts)
    x, y = random_batch(config, device)
    for _ in range(4):
        step(x, y)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step(x, y)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
    kernels = collections.Counter()
    calls = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time
            calls[event.name] += 1
    gpu = sum(kernels.values()) / 1e3 / args.steps
    print(json.dumps(dict(stack=args.stack, parts=vars(parts), size=args.size, context=args.context, batch=args.batch,
                          wall_ms=wall * 1e3, gpu_kernel_ms=gpu, host_bound_share=1 - gpu / (wall * 1e3))))
    for name, us in kernels.most_common(args.top):
        print(json.dumps(dict(kernel=name[:90], ms_per_step=us / 1e3 / args.steps, calls_per_step=calls[name] / args.steps)))
    host = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    for e in host:
        print(json.dumps(dict(host_op=e.key[:90], self_cpu_ms_per_step=e.self_cpu_time_total / 1e3 / args.steps,
                              calls_per_step=e.count / args.steps)))


if __name__ == "__main__":
    main()
