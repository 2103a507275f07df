"""Host cost per call of each of our operators beside its PyTorch counterpart (problem ``op_overhead``): the host's
time per call is part of an operator's speed.

For each operator, provider, shape and pass, two numbers per call, both medians over ``--repeats`` loops of
``--calls`` calls:

* ``issue_us``: the host time of a loop of calls issued without synchronisation (the device synchronised before
  the loop, not after): what a call costs the CPU, which bounds a step made of many small calls;
* ``wall_us``: the same loop with the device synchronised after it, over the number of calls: the larger of the
  host and the device time per call, once the queue is full.

The providers of one (op, shape, pass) take turns: each timed loop of one is followed by one of the next, so that a
host whose speed drifts (another process, a clock) moves every provider alike and not their ratio. AdamW's providers
run one after the other (two copies of a model's optimizer state need not fit one GPU).

- ``attention`` (bf16, causal): providers ``ours`` (:func:`cs336_systems.attention.op.flash_attention`),
  ``sdpa_cudnn``, ``sdpa_flash``; shapes ``(b, h, s, d)`` (``--attention-shapes``): (1, 1, 128, 64),
  (4, 25, 512, 64), (4, 16, 512, 64), (4, 25, 2048, 64); passes ``forward``, ``forward_backward``
- ``rmsnorm`` (bf16 rows): providers ``ours`` (:class:`~cs336_systems.kernels.rmsnorm.FusedRMSNormFunction`),
  ``torch_compiled`` (``cs336_basics`` RMSNorm, compiled); shapes the xl model's ``(batch * context, d_model)``;
  passes ``forward``, ``forward_backward``
- ``cross_entropy`` (bf16): providers ``ours`` (fused LM head + cross-entropy), ``torch_compiled``
  (``F.cross_entropy(h @ W.T)``, compiled); shapes the xl model's ``(tokens, d_model, vocab)``; passes ``forward``,
  ``forward_backward``
- ``adamw`` (fp32): providers ``ours`` (:class:`~cs336_systems.kernels.adamw.FusedAdamW`), ``torch_fused``
  (``AdamW(fused=True)``); shapes the xl model's parameters; passes ``step``

Forward+backward calls ``torch.autograd.grad`` (no gradient accumulation into leaves). ``ours_over_this``, in
every row of a case where ours ran: our ``issue_us`` (and ``ours_wall_over_this``: ``wall_us``) over this
provider's. Without a GPU our kernels are skipped (the interpreter is too slow to say anything) and a tiny
configuration runs. ``--profile PROVIDER`` prints the top functions of a cProfile of that provider's issue loops
(stderr) instead of writing rows.

    python -m cs336_systems.bench.op_overhead
    python -m cs336_systems.bench.op_overhead --ops attention --profile ours
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import timeit
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from cs336_systems.bench.common import cli, model_sizes, result_store, timing
from cs336_systems.bench.common.lm import SIZES, VOCAB_SIZE

PROBLEM = "op_overhead"
ATTENTION_SHAPES = [(1, 1, 128, 64), (4, 25, 512, 64), (4, 16, 512, 64), (4, 25, 2048, 64)]
SEPARATE_OPS = ("adamw",)
"""Ops whose providers are measured one after the other, not taking turns (two copies of a model's optimizer state
need not fit one GPU)."""
PROVIDERS = {
    "attention": ["ours", "sdpa_cudnn", "sdpa_flash"],
    "rmsnorm": ["ours", "torch_compiled"],
    "cross_entropy": ["ours", "torch_compiled"],
    "adamw": ["ours", "torch_fused"],
}


def attention_shape(text: str) -> tuple[int, int, int, int]:
    """``batch,heads,seq,d`` (argparse type), each at least 1."""
    parts = text.split(",")
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"an attention shape is batch,heads,seq,d (e.g. 4,25,512,64), got {text!r}")
    return tuple(cli.positive_int(part) for part in parts)


def parser():
    p = cli.base_parser(__doc__)
    p.add_argument("--ops", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    cli.add_model_size(p, multiple=False, default="xl: whose shapes the non-attention ops take; the AdamW "
                       "rows' shape is its canonical key")
    p.add_argument("--context", type=cli.positive_int, default=512, help="context length of the model shapes")
    p.add_argument("--batch", type=cli.positive_int, default=4, help="batch size of the model shapes")
    p.add_argument("--calls", type=cli.positive_int, default=100, help="calls per timed loop")
    p.add_argument("--repeats", type=cli.positive_int, default=7, help="timed loops (median)")
    p.add_argument("--attention-shapes", nargs="+", type=attention_shape, default=None, metavar="B,H,S,D",
                   help="attention shapes (default " + " ".join(",".join(map(str, s)) for s in ATTENTION_SHAPES) + ")")
    p.add_argument("--profile", default=None, help="print a cProfile of this provider's issue loops; write no rows")
    return p


# ---------------------------------------------------------------------------------------------------
# One call of each (op, provider, pass): a zero-argument function
# ---------------------------------------------------------------------------------------------------


def _attention_call(provider: str, shape: tuple[int, ...], pass_: str, device: torch.device) -> Callable[[], Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=pass_ != "forward") for _ in range(3))
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    if provider == "ours":
        from cs336_systems.attention.op import flash_attention

        def attend():
            return flash_attention(q, k, v, True)
    else:
        backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                   "sdpa_math": SDPBackend.MATH}[provider]

        def attend():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    if pass_ == "forward":
        return attend
    return lambda: torch.autograd.grad(attend(), (q, k, v), grad_out)


def _model_dims(args) -> tuple[int, int]:
    """(tokens, d_model) of the model shapes."""
    return args.batch * args.context, SIZES[args.size]["d_model"]


def _rmsnorm_call(provider: str, args, pass_: str, device: torch.device) -> Callable[[], Any]:
    from cs336_basics.model import RMSNorm

    n_tokens, d_model = _model_dims(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(n_tokens, d_model, device=device, dtype=dtype, requires_grad=pass_ != "forward")
    norm = RMSNorm(d_model, device=device, dtype=dtype)
    grad_out = torch.randn_like(x)
    if provider == "ours":
        from cs336_systems.kernels.rmsnorm import FusedRMSNormFunction

        def normalise():
            return FusedRMSNormFunction.apply(x, norm.weight, norm.eps)
    else:
        normalise = torch.compile(lambda: norm(x))
    if pass_ == "forward":
        return normalise
    return lambda: torch.autograd.grad(normalise(), (x, norm.weight), grad_out)


def _cross_entropy_call(provider: str, args, pass_: str, device: torch.device) -> Callable[[], Any]:
    n_tokens, d_model = _model_dims(args)
    vocab = VOCAB_SIZE if device.type == "cuda" else 256
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = torch.randn(n_tokens, d_model, device=device, dtype=dtype, requires_grad=pass_ != "forward")
    weight = (torch.randn(vocab, d_model, device=device, dtype=dtype) / d_model**0.5).requires_grad_(pass_ != "forward")
    targets = torch.randint(0, vocab, (n_tokens,), device=device)
    if provider == "ours":
        from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy

        def loss():
            return fused_linear_cross_entropy(hidden, weight, targets)
    else:
        loss = torch.compile(lambda: F.cross_entropy(hidden @ weight.T, targets))
    if pass_ == "forward":
        return loss
    return lambda: torch.autograd.grad(loss(), (hidden, weight))


def _adamw_call(provider: str, args, device: torch.device) -> Callable[[], Any]:
    from cs336_systems.bench.common.lm import LMConfig, build_model
    from cs336_systems.train import make_optimizer

    shapes = [p.shape for p in build_model(LMConfig(args.size, 16), torch.device("meta")).parameters()]
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen)
    optimizer = make_optimizer(params, "fused" if provider == "ours" else "torch_fused")
    optimizer.step()  # the state exists before the timed calls
    return optimizer.step


def make_call(case: dict[str, Any], args, device: torch.device) -> Callable[[], Any]:
    op, provider, pass_ = case["op"], case["provider"], case["pass"]
    if op == "attention":
        return _attention_call(provider, tuple(case["shape"]), pass_, device)
    if op == "rmsnorm":
        return _rmsnorm_call(provider, args, pass_, device)
    if op == "cross_entropy":
        return _cross_entropy_call(provider, args, pass_, device)
    return _adamw_call(provider, args, device)


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------


def warm_up(call: Callable[[], Any], device: torch.device) -> None:
    """A few untimed calls (compile, autotune, allocate), then the device synchronised."""
    for _ in range(3):
        call()
    timing.synchronize(device)


def timed_loop(call: Callable[[], Any], calls: int, device: torch.device) -> tuple[float, float]:
    """One loop of ``calls`` calls: (issue, wall) microseconds per call (module docstring)."""
    timing.synchronize(device)
    start = timeit.default_timer()
    for _ in range(calls):
        call()
    issued = timeit.default_timer()
    timing.synchronize(device)
    done = timeit.default_timer()
    return (issued - start) / calls * 1e6, (done - start) / calls * 1e6


def issue_and_wall(providers: dict[str, Callable[[], Any]], calls: int, repeats: int, device: torch.device
                   ) -> dict[str, dict[str, float]]:
    """Median issue and wall time per call, microseconds, of each provider's call; the providers' loops take turns
    (module docstring)."""
    for call in providers.values():
        warm_up(call, device)
    loops: dict[str, list[tuple[float, float]]] = {name: [] for name in providers}
    for _ in range(repeats):
        for name, call in providers.items():
            loops[name].append(timed_loop(call, calls, device))
    return {name: {"issue_us": statistics.median(i for i, _ in times), "wall_us": statistics.median(w for _, w in times),
                   "issue_us_min": min(i for i, _ in times), "calls": calls, "repeats": repeats}
            for name, times in loops.items()}


def profile(call: Callable[[], Any], calls: int, device: torch.device, top: int = 30) -> str:
    """The ``top`` functions by own time over ``calls`` calls, as cProfile prints them."""
    warm_up(call, device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    timing.synchronize(device)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def cases_for(args, device: torch.device) -> list[dict[str, Any]]:
    cases = []
    for op in args.ops:
        providers = PROVIDERS[op]
        if device.type != "cuda":  # ours needs a GPU; SDPA's fused backends too (its math one stands in)
            providers = [p.replace("sdpa_cudnn", "sdpa_math") for p in providers if p not in ("ours", "sdpa_flash")]
        if op == "attention":
            shapes = args.attention_shapes or (ATTENTION_SHAPES if device.type == "cuda" else [(1, 2, 32, 16)])
        elif op == "adamw":
            shapes = [[args.size]]
        else:
            tokens, d_model = _model_dims(args)
            shapes = [[tokens, d_model, VOCAB_SIZE]] if op == "cross_entropy" else [[tokens, d_model]]
        passes = ["step"] if op == "adamw" else ["forward", "forward_backward"]
        cases += [dict(op=op, provider=provider, shape=list(shape), **{"pass": pass_})
                  for shape in shapes for pass_ in passes for provider in providers]
    return cases


def main(argv: list[str] | None = None) -> None:
    args, device, tiny = cli.start(parser(), argv)
    args.size = args.size or model_sizes.canonical_size("xl", args.edition)
    if device.type != "cuda":
        print("# no GPU: PyTorch's providers only, tiny shapes (our kernels would need the interpreter)",
              file=sys.stderr)
    if tiny:
        args.size, args.context, args.batch = "tiny", 16, 2
        args.calls, args.repeats = min(args.calls, 5), min(args.repeats, 2)
    cases = cases_for(args, device)
    if args.profile:
        for case in cases:
            if case["provider"] == args.profile:
                print(f"## {case}", file=sys.stderr)
                print(profile(make_call(case, args, device), args.calls, device), file=sys.stderr)
                timing.free_memory()
        return
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force)
    pending = store.pending(cases)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for case in pending:  # the providers of one (op, shape, pass) are measured together, taking turns
        key = (case["op"], str(case["shape"]), case["pass"])
        groups.setdefault((*key, case["provider"]) if case["op"] in SEPARATE_OPS else key, []).append(case)
    results = {}
    for group in cli.progress(list(groups.values()), PROBLEM):
        measured = result_store.measure_or_oom(lambda: {"by_provider": issue_and_wall(
            {case["provider"]: make_call(case, args, device) for case in group}, args.calls, args.repeats, device)})
        for case in group:
            result = {"oom": False, **measured["by_provider"][case["provider"]]} if not measured["oom"] else measured
            results[(case["op"], str(case["shape"]), case["pass"], case["provider"])] = dict(result)
        timing.free_memory()
    for case in pending:
        key = (case["op"], str(case["shape"]), case["pass"])
        result, ours = results[(*key, case["provider"])], results.get((*key, "ours"), {})
        result["interleaved"] = case["op"] not in SEPARATE_OPS
        if ours.get("issue_us") and result.get("issue_us"):
            result["ours_over_this"] = ours["issue_us"] / result["issue_us"]
            result["ours_wall_over_this"] = ours["wall_us"] / result["wall_us"]
        store.add(case, result)
    cli.print_table(store.asked_rows(), ["op", "shape", "pass", "provider", "issue_us", "wall_us", "ours_over_this",
                                         "ours_wall_over_this", "oom"])


if __name__ == "__main__":
    main()
