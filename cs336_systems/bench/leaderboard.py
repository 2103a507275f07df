"""The leaderboard timing of our FlashAttention-2 beside PyTorch's fused attention (problem ``leaderboard``).

The course's official protocol: 16 heads of length 16384 and head dim 64, bf16, causal, inputs ``q, k, v``
of shape ``(16, 16384, 64)`` requiring gradients; the timed function is::

    f = torch.compile(FlashAttention2Triton.apply)
    def fn():
        o = f(q, k, v, True)
        o.sum().backward()
    triton.testing.do_bench(fn, rep=10000, warmup=1000)      # ms, the mean over the samples

In the same run, on the same tensors viewed as ``(1, 16, 16384, 64)`` (batch 1, 16 heads), PyTorch's
``scaled_dot_product_attention`` with each of its fused backends (cuDNN, flash = FlashAttention-2 CUDA,
memory-efficient) pinned by ``torch.nn.attention.sdpa_kernel``, eager, through the same ``o.sum().backward()``.
A forward-only time (``f(q, k, v, True)``, same inputs) is taken for every provider too.

Before timing, once per run, the compiled wrapper is checked: dynamo's graph-break count on its first call
(``graph_breaks`` must be 0: our kernels are ``torch.library`` operators, so the Function is one graph), the kernels one
call launches (``our_kernels``: ours must run, no library attention kernel may stand in), and outputs and gradients
against SDPA's float32 math backend, within 3x SDPA's own bf16 error (``matches_sdpa``). A failed check is printed,
recorded (``verified: false``) and makes the command exit with status 1 after writing its rows.

Every invocation is a fresh measurement (no resume): it appends one row per provider to
``writeup/results/leaderboard.jsonl``: ``{"run", "provider": "ours" | "sdpa_cudnn" | "sdpa_flash" |
"sdpa_efficient", "fwd_bwd_ms", "fwd_ms", "device", ...}``; a backend that refuses the input gives a row with
``"error"``. It prints the ratios ours / each SDPA backend.

Examples::

    python -m cs336_systems.bench.leaderboard                          # the official rep=10000, warmup=1000
    python -m cs336_systems.bench.leaderboard --rep 2000 --warmup 200  # shorter, for development
    python -m cs336_systems.bench.leaderboard --quick --providers ours sdpa_cudnn
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from cs336_systems.bench.common import attention_providers as fp
from cs336_systems.bench.common import cli, result_store

PROBLEM = "leaderboard"
REP_MS, WARMUP_MS = 10_000, 1_000
QUICK = dict(rep=500, warmup=100)
CPU = dict(heads=2, seq_len=256, d_head=64, rep=50, warmup=10)


def parser():
    p = cli.base_parser(__doc__, resumes=False)
    p.add_argument("--providers", nargs="+", choices=list(fp.LEADERBOARD_PROVIDERS),
                   default=list(fp.LEADERBOARD_PROVIDERS))
    p.add_argument("--rep", type=cli.positive_float, default=None,
                   help=f"do_bench repetition time, ms (default {REP_MS})")
    p.add_argument("--warmup", type=cli.positive_float, default=None,
                   help=f"do_bench warm-up time, ms (default {WARMUP_MS})")
    p.add_argument("--heads", type=cli.positive_int, default=fp.LEADERBOARD_HEADS,
                   help="the leading dimension of q, k, v (heads)")
    p.add_argument("--seq-len", type=cli.positive_int, default=fp.LEADERBOARD_SEQ_LEN)
    p.add_argument("--d-head", type=cli.positive_int, default=fp.LEADERBOARD_D_HEAD)
    p.add_argument("--dtype", choices=list(fp.DTYPES), default=fp.LEADERBOARD_DTYPE)
    p.add_argument("--no-fwd", action="store_true", help="skip the forward-only timings")
    p.add_argument("--no-verify", action="store_true", help="skip the checks of the compiled wrapper")
    p.add_argument("--fixed-tiles", action="store_true", help="our kernels with fixed tiles (the default)")
    p.add_argument("--autotune", action="store_true", help="autotune our kernels' tiles per length bucket instead")
    return p


def resolve_defaults(args, device: torch.device) -> None:
    """``--quick`` shortens do_bench; on a CPU, a small shape and short timings (ours is skipped there)."""
    if device.type != "cuda":
        args.heads, args.seq_len = min(args.heads, CPU["heads"]), min(args.seq_len, CPU["seq_len"])
        args.rep, args.warmup = args.rep or CPU["rep"], args.warmup or CPU["warmup"]
    elif args.quick:
        args.rep, args.warmup = args.rep or QUICK["rep"], args.warmup or QUICK["warmup"]
    args.rep, args.warmup = args.rep or REP_MS, args.warmup or WARMUP_MS








def print_summary(rows: list[dict[str, Any]]) -> None:
    cli.print_table(rows, ["provider", "fwd_bwd_ms", "fwd_ms", "fwd_bwd_median_ms", "ours_over_this_fwd_bwd",
                               "ours_over_this_fwd"], digits=3)
    for row in rows:
        if row.get("error"):
            print(f"# {row['provider']}: {row['error']}")
    ours = next((r for r in rows if r["provider"] == "ours"), None)
    if ours and "verified" in ours:
        print(f"# ours: graph breaks {ours['graph_breaks']}, our kernels {ours['our_kernels']}, "
              f"other attention kernels {ours['foreign_attention_kernels']}, max relative error "
              f"{ours['max_rel_err']} (SDPA's {ours['sdpa_max_rel_err']}): verified={ours['verified']}")
        for reason in ours["graph_break_reasons"]:
            print(f"#   graph break: {reason}")




def run(args, device: torch.device) -> list[dict[str, Any]]:
    """Measure every requested provider and append their rows (always: no resume)."""
    store = result_store.ResultStore(PROBLEM, args.results_dir, force=True)
    phases = ["fwd_bwd"] if args.no_fwd else ["fwd_bwd", "fwd"]
    results = fp.measure_leaderboard(args.providers, args.heads, args.seq_len, args.d_head, args.dtype, device,
                                     args.rep, args.warmup, phases, verify=not args.no_verify)
    config = dict(heads=args.heads, seq_len=args.seq_len, d_head=args.d_head, dtype=args.dtype, causal=True,
                  rep_ms=args.rep, warmup_ms=args.warmup)
    return [store.add({"provider": name, **config}, result) for name, result in results.items()]


def main(argv: list[str] | None = None) -> None:
    args, device, _ = cli.start(parser(), argv)
    resolve_defaults(args, device)
    fp.choose_tiles(args.fixed_tiles, args.autotune)
    if device.type != "cuda":
        print("# no GPU: only SDPA's flash backend has a CPU kernel (error rows, not timed: ours, cuDNN, "
              "memory-efficient)", file=sys.stderr)
    print(f"# q, k, v ({args.heads}, {args.seq_len}, {args.d_head}) {args.dtype}, causal; "
          f"do_bench(rep={args.rep:g}, warmup={args.warmup:g})", file=sys.stderr)
    rows = run(args, device)
    print_summary(rows)
    if any(row.get("verified") is False for row in rows):
        print("# VERIFICATION FAILED: see the checks above", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
