"""The attention grid of the assignment's ``pytorch_attention`` problem (batch 8, no heads, head dims x
sequence lengths: 100 forwards, 100 backwards, memory before backward), shared by ``pytorch_attention``
(eager) and ``torch_compile`` (eager vs compiled)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from cs336_systems.attention import get_attention
from cs336_systems.bench.common import cli, result_store, timing


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The grid's options."""
    p.add_argument("--batch-size", type=cli.positive_int, default=8)
    p.add_argument("--head-dims", nargs="+", type=cli.positive_int, default=None)
    p.add_argument("--seq-lens", nargs="+", type=cli.positive_int, default=None)
    p.add_argument("--passes", type=cli.positive_int, default=100, help="timed forwards, and timed backwards")
    p.add_argument("--warmup", type=cli.non_negative_int, default=5)
    return p


HEAD_DIMS = [16, 32, 64, 128]


SEQ_LENS = [256, 1024, 4096, 8192, 16384]


def time_attention(
    attention: str, batch: int, seq: int, d: int, passes: int, warmup: int, device: torch.device
) -> dict[str, Any]:
    """Forward and backward times (ms) of ``attention`` on ``(batch, seq, d)`` inputs, and saved memory."""
    fn = get_attention(attention)
    q, k, v = (torch.randn(batch, seq, d, device=device, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(batch, seq, d, device=device)
    for _ in range(warmup):
        fn(q, k, v, True).backward(grad_out)
    timing.synchronize(device)
    forward_s = timing.time_calls(lambda: fn(q, k, v, True), warmup=0, steps=passes, device=device)
    backward_s = []
    memory_before_backward = []
    for _ in range(passes):
        out = fn(q, k, v, True)
        timing.synchronize(device)
        if device.type == "cuda":
            memory_before_backward.append(torch.cuda.memory_allocated(device))
        backward_s += timing.time_calls(lambda: out.backward(grad_out), warmup=0, steps=1, device=device)
        q.grad = k.grad = v.grad = None
    inputs_bytes = 4 * batch * seq * d * 4  # q, k, v and the output gradient, float32
    result = {**timing.summarize_ms(forward_s, "forward_"), **timing.summarize_ms(backward_s, "backward_")}
    if memory_before_backward:
        result["memory_before_backward_gb"] = max(memory_before_backward) / 1e9
        result["saved_for_backward_gb"] = (max(memory_before_backward) - inputs_bytes) / 1e9
    return result


def run_grid(
    problem: str, attentions: list[str], args, device: torch.device, extra: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Every (attention, d, seq) case of the grid not yet measured, as rows of ``problem`` (plus ``extra`` keys);
    returns the rows of the whole grid, measured now or stored."""
    store = result_store.ResultStore(problem, args.results_dir, args.force)
    cases = [
        dict(**(extra or {}), attention=a, batch_size=args.batch_size, d=d, seq_len=s, passes=args.passes, dtype="fp32")
        for a in attentions for d in args.head_dims for s in args.seq_lens
    ]
    for case in cli.progress(store.pending(cases), problem):
        result = result_store.measure_or_oom(lambda: time_attention(
            case["attention"], case["batch_size"], case["seq_len"], case["d"], args.passes, args.warmup, device))
        store.add(case, result)
        timing.free_memory()
    return store.asked_rows()


def resolve_defaults(args, device: torch.device) -> None:
    tiny = args.quick or device.type == "cpu"
    args.head_dims = args.head_dims or ([16] if tiny else HEAD_DIMS)
    args.seq_lens = args.seq_lens or ([64, 128] if tiny else SEQ_LENS)
    if tiny:
        args.batch_size = min(args.batch_size, 2)
        args.passes, args.warmup = min(args.passes, 3), min(args.warmup, 1)
