"""Our fused LM head + cross-entropy against the plain one (problem ``fused_cross_entropy``).

For hidden states ``(tokens, d)``, an LM-head weight ``(vocab, d)`` (float32 master weights, as in training)
and random targets, under bf16 autocast: the loss and the gradients of the hidden states and of the weight,
``forward + backward`` timed with ``triton.testing.do_bench`` (median), and the peak memory above the inputs
(``peak_extra_gb``: what the loss itself allocates at its peak). Providers: ``ours``
(:func:`cs336_systems.kernels.cross_entropy.fused_linear_cross_entropy`: chunks of tokens, the logits never held),
``eager`` (``F.cross_entropy(h @ W.T, y)``: the full logits, their float32 upcast and gradient) and ``compiled``
(``torch.compile`` of the same). ``ours_over_this`` compares time, ``ours_memory_over_this`` peak memory.

Default shapes: the 2026 leaderboard's LM head (32,768 tokens, vocabulary 151,936, d 4096) and the xl model's
at context 2048, batch 4 (8,192 tokens, vocabulary 10,000, d 1600).

    python -m cs336_systems.bench.fused_cross_entropy
    python -m cs336_systems.bench.fused_cross_entropy --shapes 32768:151936:4096
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.nn.functional as F

from cs336_systems.bench.common import cli, result_store, timing

PROBLEM = "fused_cross_entropy"
PROVIDERS = ("ours", "eager", "compiled")
DEFAULT_SHAPES = ["32768:151936:4096", "8192:10000:1600"]


def shape(text: str) -> tuple[int, int, int]:
    """``tokens:vocab:d`` (argparse type), each at least 1."""
    try:
        tokens, vocab, d = (int(part) for part in text.split(":"))
    except ValueError:
        tokens = vocab = d = 0
    if min(tokens, vocab, d) < 1:
        raise argparse.ArgumentTypeError(f"a shape is tokens:vocab:d of positive whole numbers, e.g. 8192:10000:1600, "
                                         f"not {text!r}")
    return tokens, vocab, d


def parser():
    p = cli.base_parser(__doc__)
    p.add_argument("--shapes", nargs="+", type=shape, default=None, help="tokens:vocab:d (default: leaderboard, xl)")
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--rep", type=cli.positive_float, default=300, help="do_bench repetition time, ms")
    return p


def plain_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(hidden @ weight.T, targets)


def loss_fn(provider: str):
    if provider == "ours":
        from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy

        return fused_linear_cross_entropy
    return torch.compile(plain_loss) if provider == "compiled" else plain_loss


def measure(provider: str, tokens: int, vocab: int, d: int, device: torch.device, rep: float) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, d, device=device, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, d, device=device, generator=gen) / d**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    fn = loss_fn(provider)

    def step():
        hidden.grad = weight.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = fn(hidden, weight, targets)
        loss.backward()
        return loss

    loss = step()  # compiles, where it does
    result: dict[str, Any] = {"loss": loss.item()}
    if device.type == "cuda":
        import triton.testing

        timing.synchronize(device)
        hidden.grad = weight.grad = None
        timing.free_memory()
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        timing.synchronize(device)
        result["peak_extra_gb"] = (torch.cuda.max_memory_allocated(device) - baseline) / 1e9
        result["median_ms"] = triton.testing.do_bench(step, rep=rep, return_mode="median")
    else:
        result["median_ms"] = timing.summarize_ms(timing.time_calls(step, 1, 2, device))["median_ms"]
    return result


def main(argv: list[str] | None = None) -> None:
    args, device, tiny = cli.start(parser(), argv)
    args.shapes = args.shapes or ([(256, 1000, 64)] if tiny else [shape(s) for s in DEFAULT_SHAPES])
    if device.type == "cpu":
        print("# no GPU: the eager provider only (ours would run its CPU path, compile takes long)", file=sys.stderr)
        args.providers = ["eager"]
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force)
    cases = [dict(tokens=t, vocab=v, d=d, provider=provider, autocast="bf16") for t, v, d in args.shapes
             for provider in args.providers]
    pending = store.pending(cases)
    results: dict[tuple, dict[str, Any]] = {}
    for case in cli.progress(pending, PROBLEM):
        results[tuple(case.values())] = result_store.measure_or_oom(
            lambda: measure(case["provider"], case["tokens"], case["vocab"], case["d"], device, args.rep))
        torch._dynamo.reset()
        timing.free_memory()
    for case in pending:
        result = results[tuple(case.values())]
        ours = results.get((case["tokens"], case["vocab"], case["d"], "ours", "bf16"), {})
        if ours.get("median_ms") and result.get("median_ms"):
            result["ours_over_this"] = ours["median_ms"] / result["median_ms"]
        if ours.get("peak_extra_gb") and result.get("peak_extra_gb"):
            result["ours_memory_over_this"] = ours["peak_extra_gb"] / result["peak_extra_gb"]
        store.add(case, result)
    cli.print_table(store.asked_rows(), ["tokens", "vocab", "d", "provider", "median_ms", "peak_extra_gb",
                                         "ours_over_this", "ours_memory_over_this", "oom"], digits=3)


if __name__ == "__main__":
    main()
