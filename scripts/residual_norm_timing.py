"""The residual add fused into our RMSNorm, timed alone: ``fused_add_rmsnorm(x, residual, w)`` (one kernel writes the
sum and its norm; one backward kernel) against ``s = x + residual`` followed by our ``fused_rms_norm(s, w)`` (the
``separate`` provider: what the training step runs without the ``fused_residual_norm`` part), forward and
forward + backward (the gradients of both inputs and the gain, for gradients arriving at both the sum and the norm).

Shapes are (tokens, d_model) of the models measured elsewhere: the xl model at 4 x 4096 tokens (16384, 1600), the
large one at 64 x 1024 (65536, 1280) and the 8B model's 32,768-token sequence (32768, 4096). Two layouts of the
residual stream: ``bf16`` (everything bf16, as in a sharded step that computes in bf16) and ``fp32`` (a bf16
branch added to a float32 stream, the norm written in bf16: the one-GPU step under autocast). Each time is the
median of ``triton.testing.do_bench``; the table prints both and their ratio, and every run appends its rows to
``residual_norm_timing.jsonl`` through the benchmarks' result store (a log: rows of one configuration are not
replaced).

    python scripts/residual_norm_timing.py                 # on a GPU: three shapes, both layouts
    python scripts/residual_norm_timing.py --quick         # on a CPU: tiny shapes under the Triton interpreter
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch

SHAPES = [(16384, 1600), (65536, 1280), (32768, 4096)]
QUICK_SHAPES = [(64, 48)]
STREAMS = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The residual stream's dtype; the branch added to it and the norm's output are bf16."""
PROVIDERS = ("fused", "separate")
PASSES = ("forward", "forward_backward")


def providers() -> dict[str, Callable]:
    """``provider(x, residual, weight) -> (sum, norm)`` for each of :data:`PROVIDERS`."""
    from cs336_systems.kernels.residual_rmsnorm import fused_add_rmsnorm
    from cs336_systems.kernels.rmsnorm import fused_rms_norm

    def separate(x, residual, weight):
        s = x + residual
        return s, fused_rms_norm(s, weight, out_dtype=x.dtype)

    return {"fused": lambda x, residual, weight: fused_add_rmsnorm(x, residual, weight, out_dtype=x.dtype),
            "separate": separate}


def timed_call(provider: Callable, n_rows: int, d_model: int, stream: torch.dtype, backward: bool,
               device: torch.device) -> Callable[[], object]:
    """One call of ``provider`` on fresh inputs (a bf16 branch, a ``stream`` residual, a float32 gain); with
    ``backward`` also the gradients of the three inputs for gradients of both outputs."""
    x = torch.randn(n_rows, d_model, device=device, dtype=torch.bfloat16, requires_grad=backward)
    residual = torch.randn(n_rows, d_model, device=device, dtype=stream, requires_grad=backward)
    weight = (1 + 0.1 * torch.randn(d_model, device=device)).requires_grad_(backward)
    ds = torch.randn(n_rows, d_model, device=device, dtype=torch.promote_types(torch.bfloat16, stream))
    dy = torch.randn(n_rows, d_model, device=device, dtype=torch.bfloat16)
    if not backward:
        return lambda: provider(x, residual, weight)

    def forward_backward():
        s, y = provider(x, residual, weight)
        return torch.autograd.grad((s, y), (x, residual, weight), (ds, dy))

    return forward_backward


def measure(args: argparse.Namespace, device: torch.device) -> list[tuple[dict, dict]]:
    """``(configuration, measurements)`` per shape, stream layout and pass: each provider's median and their ratio."""
    from cs336_systems.bench.common import timing

    calls, rows = providers(), []
    for n_rows, d_model in args.shapes:
        for stream in args.streams:
            for passes in PASSES:
                medians = {}
                for name, provider in calls.items():
                    fn = timed_call(provider, n_rows, d_model, STREAMS[stream], passes == "forward_backward", device)
                    medians[name] = timing.do_bench_ms(fn, device, args.warmup_ms, args.rep_ms)["median_ms"]
                    timing.free_memory()
                config = {"n_rows": n_rows, "d_model": d_model, "stream_dtype": stream, "pass": passes,
                          "branch_dtype": "bf16"}
                rows.append((config, {"fused_ms": medians["fused"], "separate_ms": medians["separate"],
                                      "fused_over_separate": medians["fused"] / medians["separate"]}))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", nargs="+", choices=list(STREAMS), default=list(STREAMS))
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=200.0)
    p.add_argument("--quick", action="store_true", help="tiny shapes, short timing (on a CPU: the Triton interpreter)")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="where the rows go (default writeup/results on a GPU, .scratch/results otherwise)")
    args = p.parse_args()
    on_gpu = torch.cuda.is_available() and not args.quick
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel modules are imported (below)
    from cs336_systems.bench.common import cli, result_store

    args.shapes = SHAPES if on_gpu else QUICK_SHAPES
    if not on_gpu:
        args.warmup_ms, args.rep_ms = 1.0, 5.0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cli.announce(device, args.quick)
    rows = measure(args, device)
    default = result_store.RESULTS_DIR if on_gpu else result_store.SCRATCH_DIR / "results"
    store = result_store.ResultStore("residual_norm_timing", args.results_dir or default)
    printed = [store.add(config, measurements) for config, measurements in rows]
    cli.print_table(printed, ["n_rows", "d_model", "stream_dtype", "pass", "fused_ms", "separate_ms",
                              "fused_over_separate"], digits=3)


if __name__ == "__main__":
    main()
