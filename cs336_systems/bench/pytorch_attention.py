"""The naive PyTorch attention at scale (problem ``pytorch_attention``).

Batch 8, no heads, head dim d in {16, 32, 64, 128} x sequence length in {256, 1024, 4096, 8192,
16384}, float32, causal: after warm-up, time ``--passes`` forwards and ``--passes`` backwards (each
followed by a synchronisation), and read the memory in use just before the backward (what the
forward saved for it). An out-of-memory case is a row. ``torch_compile`` reuses this with the
attention compiled.

Examples::

    python -m cs336_systems.bench.pytorch_attention
    python -m cs336_systems.bench.pytorch_attention --head-dims 64 --seq-lens 4096 --passes 20
"""

from __future__ import annotations

from typing import Any

import torch

from cs336_systems.attention import get_attention
from cs336_systems.bench import harness

PROBLEM = "pytorch_attention"
HEAD_DIMS = [16, 32, 64, 128]
SEQ_LENS = [256, 1024, 4096, 8192, 16384]


def parser():
    p = harness.base_parser(__doc__)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--head-dims", nargs="+", type=int, default=None)
    p.add_argument("--seq-lens", nargs="+", type=int, default=None)
    p.add_argument("--passes", type=int, default=100, help="timed forwards, and timed backwards")
    p.add_argument("--warmup", type=int, default=5)
    return p


def time_attention(
    attention: str, batch: int, seq: int, d: int, passes: int, warmup: int, device: torch.device
) -> dict[str, Any]:
    """Forward and backward times (ms) of ``attention`` on ``(batch, seq, d)`` inputs, and saved memory."""
    fn = get_attention(attention)
    q, k, v = (torch.randn(batch, seq, d, device=device, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(batch, seq, d, device=device)
    for _ in range(warmup):
        fn(q, k, v, True).backward(grad_out)
    harness.synchronize(device)
    forward_s = harness.time_calls(lambda: fn(q, k, v, True), warmup=0, steps=passes, device=device)
    backward_s = []
    memory_before_backward = []
    for _ in range(passes):
        out = fn(q, k, v, True)
        harness.synchronize(device)
        if device.type == "cuda":
            memory_before_backward.append(torch.cuda.memory_allocated(device))
        backward_s += harness.time_calls(lambda: out.backward(grad_out), warmup=0, steps=1, device=device)
        q.grad = k.grad = v.grad = None
    inputs_bytes = 4 * batch * seq * d * 4  # q, k, v and the output gradient, float32
    result = {**harness.summarize_ms(forward_s, "forward_"), **harness.summarize_ms(backward_s, "backward_")}
    if memory_before_backward:
        result["memory_before_backward_gb"] = max(memory_before_backward) / 1e9
        result["saved_for_backward_gb"] = (max(memory_before_backward) - inputs_bytes) / 1e9
    return result


def run_grid(
    problem: str, attentions: list[str], args, device: torch.device, extra: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Every (attention, d, seq) case of the grid not yet measured, as rows of ``problem`` (plus ``extra`` keys)."""
    store = harness.ResultStore(problem, args.results_dir, args.force)
    cases = [
        dict(**(extra or {}), attention=a, batch_size=args.batch_size, d=d, seq_len=s, passes=args.passes, dtype="fp32")
        for a in attentions for d in args.head_dims for s in args.seq_lens
    ]
    rows = []
    for case in harness.progress(store.pending(cases), problem):
        result = harness.measure_or_oom(lambda: time_attention(
            case["attention"], case["batch_size"], case["seq_len"], case["d"], args.passes, args.warmup, device))
        rows.append(store.add(case, result))
        harness.free_memory()
    return rows


def resolve_defaults(args, device: torch.device) -> None:
    tiny = args.quick or device.type == "cpu"
    args.head_dims = args.head_dims or ([16] if tiny else HEAD_DIMS)
    args.seq_lens = args.seq_lens or ([64, 128] if tiny else SEQ_LENS)
    if tiny:
        args.batch_size = min(args.batch_size, 2)
        args.passes, args.warmup = min(args.passes, 3), min(args.warmup, 1)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    device = harness.default_device()
    harness.announce(device, args.quick)
    resolve_defaults(args, device)
    rows = run_grid(PROBLEM, ["naive"], args, device)
    harness.print_table(rows, ["d", "seq_len", "forward_mean_ms", "backward_mean_ms", "memory_before_backward_gb", "oom"])


if __name__ == "__main__":
    main()
