"""Our fused Triton AdamW against PyTorch's AdamWs on a model's parameters (problem ``fused_adamw``).

The parameters (and random gradients) have the shapes of a named model size (default xl: ~2.0B parameters in
~340 tensors), in float32 or bfloat16. Each provider's ``optimizer.step()`` is timed with
``triton.testing.do_bench`` (median over repetitions; the state exists from a first step). Providers:
``ours`` (:class:`cs336_systems.kernels.adamw.FusedAdamW`), ``torch_fused`` (``torch.optim.AdamW(fused=True)``),
``torch_foreach`` (``foreach=True``) and ``basics`` (``cs336_basics`` AdamW, a Python loop). ``gb_per_s`` counts
the bytes an ideal step moves: parameters read and written, gradients read, both moments read and written in
the dtype the provider keeps them in (28 bytes a float32 parameter; with bfloat16 parameters and gradients 22
bytes for ours, whose moments stay float32, and 14 for PyTorch's, whose moments follow the parameter's dtype), beside
the device's copy bandwidth measured in the same run (``copy_gb_per_s``). ``ours_over_this`` is our time over
this provider's.

    python -m cs336_systems.bench.fused_adamw                      # xl, fp32 and bf16
    python -m cs336_systems.bench.fused_adamw --size 2.7B --dtypes fp32
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from cs336_systems.bench.common import cli, model_sizes, result_store, timing
from cs336_systems.bench.common.lm import LMConfig, build_model
from cs336_systems.train import make_optimizer

PROBLEM = "fused_adamw"
# Provider -> the optimizer of that name in cs336_systems.train (the training step's AdamW hyper-parameters).
PROVIDERS = {"ours": "fused", "torch_fused": "torch_fused", "torch_foreach": "torch_foreach", "basics": "basics"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parser():
    p = cli.base_parser(__doc__)
    cli.add_model_size(p, multiple=False, default="xl: whose parameter shapes")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    p.add_argument("--rep", type=cli.positive_float, default=500, help="do_bench repetition time, ms")
    return p


def parameter_shapes(size: str) -> list[torch.Size]:
    model = build_model(LMConfig(size, 16), torch.device("meta"))
    return [p.shape for p in model.parameters()]


def copy_bandwidth(device: torch.device, n_bytes: int = 2**31) -> float | None:
    """GB/s of a large device-to-device copy, bytes read plus written."""
    if device.type != "cuda":
        return None
    import triton.testing

    x = torch.empty(n_bytes // 4, device=device)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), rep=200, return_mode="median")
    return 2 * n_bytes / (ms / 1e3) / 1e9


def measure(provider: str, shapes: list[torch.Size], dtype: torch.dtype, device: torch.device,
            rep: float) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_() for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, dtype=dtype, generator=gen)
    optimizer = make_optimizer(params, PROVIDERS[provider])
    optimizer.step()  # creates the state
    if device.type == "cuda":
        import triton.testing

        ms = triton.testing.do_bench(optimizer.step, rep=rep, return_mode="median")
    else:
        ms = timing.summarize_ms(timing.time_calls(optimizer.step, 1, 3, device))["median_ms"]
    n = sum(p.numel() for p in params)
    # The moments' dtype is the provider's: float32 for ours, the parameter's for PyTorch's AdamWs.
    moment_size = optimizer.state[params[0]]["exp_avg"].element_size()
    bytes_per_param = 2 * params[0].element_size() + params[0].grad.element_size() + 4 * moment_size
    return {"median_ms": ms, "params": n, "tensors": len(params), "bytes_per_param": bytes_per_param,
            "moment_dtype": str(optimizer.state[params[0]]["exp_avg"].dtype).removeprefix("torch."),
            "gb_per_s": n * bytes_per_param / (ms / 1e3) / 1e9}


def main(argv: list[str] | None = None) -> None:
    args, device, tiny = cli.start(parser(), argv)
    args.size = args.size or ("tiny" if tiny else model_sizes.canonical_size("xl", args.edition))
    if device.type == "cpu" and "ours" in args.providers:
        print("# no GPU: our Triton AdamW is skipped (the interpreter is far too slow to time)", file=sys.stderr)
        args.providers = [p for p in args.providers if p not in ("ours", "torch_fused")]
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force, edition=args.edition)
    cases = [dict(size=args.size, dtype=dtype, provider=provider)
             for dtype in args.dtypes for provider in args.providers]
    pending = store.pending(cases)
    shapes = parameter_shapes(args.size)
    copy = copy_bandwidth(device)
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for case in cli.progress(pending, PROBLEM):
        result = result_store.measure_or_oom(
            lambda: measure(case["provider"], shapes, DTYPES[case["dtype"]], device, args.rep))
        result["copy_gb_per_s"] = copy
        results[(case["dtype"], case["provider"])] = result
        timing.free_memory()
    for case in pending:
        result = results[(case["dtype"], case["provider"])]
        ours = results.get((case["dtype"], "ours"), {})
        if ours.get("median_ms") and result.get("median_ms"):
            result["ours_over_this"] = ours["median_ms"] / result["median_ms"]
        store.add(case, result)
    cli.print_table(store.asked_rows(), ["size", "dtype", "provider", "median_ms", "gb_per_s", "copy_gb_per_s",
                                         "ours_over_this", "oom"])


if __name__ == "__main__":
    main()
