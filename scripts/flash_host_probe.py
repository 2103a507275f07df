"""Development probe (not a results CLI): where the host time of one eager attention call goes. Times the issue
loop (calls without synchronisation, median of repeats, microseconds a call) of each piece of our forward and
backward at one shape, beside SDPA's cuDNN backend and an autograd Function that does nothing, so that the gap to
cuDNN splits into autograd, allocation, descriptor encoding and launches.

    python scripts/flash_host_probe.py [--shape 4 25 512 64] [--calls 200] [--repeats 7]
"""

from __future__ import annotations

import argparse
import math
import statistics
import timeit

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from cs336_systems.attention import op
from cs336_systems.attention.backends import hopper
from cs336_systems.attention.backends.triton import launch_delta


def issue_us(call, calls: int, repeats: int) -> float:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = timeit.default_timer()
        for _ in range(calls):
            call()
        times.append((timeit.default_timer() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


class Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.new_empty(q.shape)

    @staticmethod
    def backward(ctx, do):
        return torch.empty_like(do), torch.empty_like(do), torch.empty_like(do)


class OursBackwardOnly(torch.autograd.Function):
    """Saves what our Function saves and runs our backward (on the autograd engine's thread), with a forward that
    launches nothing: fwd+grad of this minus the Nothing Function's is our backward's cost on the engine thread."""

    @staticmethod
    def forward(ctx, q, k, v, O, L):
        ctx.save_for_backward(q, k, v, O, L)
        return q.new_empty(q.shape)

    @staticmethod
    def backward(ctx, do):
        return *op.attention_backward(*ctx.saved_tensors, do, True), None, None


def in_thread(call, calls: int, repeats: int) -> float:
    """issue_us of ``call`` run in another Python thread (the main thread waiting, as it waits for the engine)."""
    import threading
    result = []
    thread = threading.Thread(target=lambda: result.append(issue_us(call, calls, repeats)))
    thread.start()
    thread.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[4, 25, 512, 64])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--trace", default=None, help="also write a torch.profiler trace of 20 fwd+grad calls here")
    args = parser.parse_args()
    shape = tuple(args.shape)
    device = torch.device("cuda")
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        O, L = op.attention_forward(q, k, v, True)
    scale = 1 / math.sqrt(shape[-1])
    n_q = shape[2]
    batch_heads = shape[0] * shape[1]
    dq_acc = torch.empty((batch_heads, n_q, shape[-1]), dtype=torch.float32, device=device)
    print(f"# {torch.cuda.get_device_name()}, shape {shape}, backends {op.chosen_backends(q, k)}")

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return scaled_dot_product_attention(q, k, v, is_causal=True)

    def backward_launch_only():
        key = next(key for key in hopper._plans if key[0] == "backward")
        plan = hopper._plans[key]
        hopper._BACKWARD(key, plan.grid, hopper.BackwardArgs(
            *plan.descriptor_args((q, k, v, do, O, O, dq_acc)), L, L, *plan.scalars), {})

    pieces = {
        "empty x1": lambda: torch.empty(shape, device=device, dtype=torch.bfloat16),
        "empty_like x1": lambda: torch.empty_like(q),
        "nothing fwd (autograd Function)": lambda: Nothing.apply(q, k, v),
        "nothing fwd+grad": lambda: torch.autograd.grad(Nothing.apply(q, k, v), (q, k, v), do),
        "ours attention_forward (no autograd)": lambda: op.attention_forward(q, k, v, True),
        "ours fwd (Function)": lambda: op.flash_attention(q, k, v, True),
        "ours launch_delta (+zero dq_acc)": lambda: launch_delta(O, do, dq_acc),
        "ours attention_backward (no autograd)": lambda: op.attention_backward(q, k, v, O, L, do, True),
        "ours hopper backward launch only": backward_launch_only,
        "ours backward only, engine thread (+nothing)": lambda: torch.autograd.grad(
            OursBackwardOnly.apply(q, k, v, O, L), (q, k, v), do),
        "ours fwd+grad": lambda: torch.autograd.grad(op.flash_attention(q, k, v, True), (q, k, v), do),
        "cudnn fwd": sdpa,
        "cudnn fwd+grad": lambda: torch.autograd.grad(sdpa(), (q, k, v), do),
    }
    if args.trace:
        from torch.profiler import ProfilerActivity, profile
        for name in ("ours fwd+grad", "cudnn fwd+grad"):
            call = pieces[name]
            issue_us(call, 20, 1)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as prof:
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
            print(f"## {name}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            prof.export_chrome_trace(f"{args.trace}-{name.split()[0]}.json")
    pieces["ours attention_backward, other Python thread"] = "thread"
    for name, call in pieces.items():
        try:
            if call == "thread":
                us = in_thread(lambda: op.attention_backward(q, k, v, O, L, do, True), args.calls, args.repeats)
            else:
                us = issue_us(call, args.calls, args.repeats)
            print(f"{name:46s} {us:8.1f} us")
        except Exception as error:  # a probe: say what failed and go on
            print(f"{name:46s} failed: {error!r}")


if __name__ == "__main__":
    main()
