"""The leaderboard timing (SPEC 3.7), beside PyTorch's fused attention in the same run.

Exactly the official protocol: ``f = torch.compile(FlashAttention2Triton.apply)`` on q, k, v of shape
``(16, 16384, 64)``, bfloat16, ``requires_grad=True``; the timed function is ``o = f(q, k, v, True)``,
``o.sum().backward()``, timed by ``triton.testing.do_bench(fn, rep=10000, warmup=1000)``. Then PyTorch's
``scaled_dot_product_attention`` with each backend (cuDNN, flash, efficient) on the same tensors viewed as
``(1, 16, 16384, 64)``, the same way. Before timing, ours is checked against cuDNN's outputs and
gradients, and torch.compile must report no graph break other than the one our launch wrappers ask for.

Every invocation is a fresh measurement (rows are appended, never skipped). ``--log-step NAME`` also
appends the run to ``flash_optimisation_log.jsonl`` with ``--hypothesis``: the optimisation log.

Examples::

    python -m cs336_systems.bench.leaderboard                       # the official rep=10000, warmup=1000
    python -m cs336_systems.bench.leaderboard --rep 1000 --warmup 100 --log-step tiles --hypothesis "..."
"""

from __future__ import annotations

import sys

import torch

from cs336_systems.bench import harness
from cs336_systems.bench.flash_providers import FOUR_D, get_provider, unavailable

PROBLEM = "leaderboard"
PROVIDERS = ["ours", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"]


def parser():
    p = harness.base_parser(__doc__)
    p.add_argument("--rep", type=int, default=10000, help="do_bench repetition time (ms)")
    p.add_argument("--warmup", type=int, default=1000, help="do_bench warm-up time (ms)")
    p.add_argument("--providers", nargs="+", default=PROVIDERS, choices=PROVIDERS)
    p.add_argument("--log-step", default=None, help="also append this run to the optimisation log under this name")
    p.add_argument("--hypothesis", default="", help="what the step should move, and by how much")
    return p


def graph_breaks(fn, *args) -> int:
    """Graph breaks torch.compile reports for ``fn(*args)``."""
    import torch._dynamo

    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args).graph_break_count


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    device = harness.default_device()
    harness.announce(device, args.quick)
    if device.type != "cuda":
        sys.exit("the leaderboard is timed on a CUDA GPU (do_bench, Triton kernels); none found")
    shape = (16, 16384, 64) if not args.quick else (2, 1024, 64)
    if args.quick:
        args.rep, args.warmup = min(args.rep, 100), min(args.warmup, 20)
    import triton

    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    store = harness.ResultStore(PROBLEM, args.results_dir, force=True)
    rows, outputs = [], {}
    for name in harness.progress(args.providers, PROBLEM):
        raw = get_provider(name)
        inputs = [x.detach().view(1, *shape).requires_grad_() if name in FOUR_D else x for x in (q, k, v)]
        compiled = torch.compile(raw)
        result: dict = {}
        try:
            o = compiled(*inputs, True)
            o.sum().backward()
            outputs[name] = [o.detach().reshape(shape)] + [x.grad.reshape(shape) for x in inputs]
            for x in inputs:
                x.grad = None

            def step():
                compiled(*inputs, True).sum().backward()

            def forward():
                compiled(*inputs, True)

            result["fwd_bwd_ms"] = triton.testing.do_bench(step, rep=args.rep, warmup=args.warmup, grad_to_none=inputs)
            result["fwd_ms"] = triton.testing.do_bench(forward, rep=max(args.rep // 10, 50), warmup=args.warmup // 10)
            if name == "ours":
                result["graph_breaks"] = graph_breaks(raw, *inputs, True)
        except Exception as error:  # noqa: BLE001 - an unsupported backend is a row, not a crash
            if not unavailable(error) and "cudnn" not in str(error).lower():
                raise
            result = {"error": str(error).splitlines()[0][:300]}
        rows.append(store.add({"provider": name, "shape": list(shape), "dtype": "bf16", "causal": True,
                               "rep_ms": args.rep, "warmup_ms": args.warmup}, result))
    if "ours" in outputs and "sdpa_cudnn" in outputs:
        errors = {name: ((a.float() - b.float()).norm() / b.float().norm()).item()
                  for name, a, b in zip(["O", "dQ", "dK", "dV"], outputs["ours"], outputs["sdpa_cudnn"])}
        print("# relative difference to cuDNN:", {k: f"{v:.1e}" for k, v in errors.items()}, file=sys.stderr)
        if max(errors.values()) > 2e-2:
            sys.exit(f"ours disagrees with cuDNN: {errors}")
    timed = {row["provider"]: row["fwd_bwd_ms"] for row in rows if "fwd_bwd_ms" in row}
    for row in rows:
        if "ours" in timed and "fwd_bwd_ms" in row:
            row["ours_over_this"] = timed["ours"] / row["fwd_bwd_ms"]
    harness.print_table(rows, ["provider", "fwd_bwd_ms", "fwd_ms", "ours_over_this", "error"], digits=3)
    if args.log_step:
        log = harness.ResultStore("flash_optimisation_log", args.results_dir, force=True)
        log.add({"step": args.log_step}, {"hypothesis": args.hypothesis, "leaderboard_run": store.run,
                                          **{f"{p}_fwd_bwd_ms": t for p, t in timed.items()}})


if __name__ == "__main__":
    main()
