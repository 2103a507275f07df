"""FlashAttention-2 against PyTorch's attentions across lengths and head dims (problem ``flash_benchmarking``).

The handout's sweep: batch 1 (one head), causal, sequence length 128..65536 (powers of two) x head dim 16, 32, 64, 128 x
{bf16, fp32}; forward, backward and forward+backward latency with ``triton.testing.do_bench`` (mean over the
samples; see ``common/attention_providers`` for what each phase times) of

* ``ours``: ``FlashAttention2Triton.apply`` (eager),
* ``naive`` and ``naive_compiled``: the plain PyTorch attention, eager and ``torch.compile``-d,
* ``flash_pytorch``: the tiled PyTorch FlashAttention-2 (up to ``--flash-pytorch-max-seq``: a Python loop over
  tiles, hopelessly slow beyond),
* ``sdpa_cudnn`` and ``sdpa_flash``: PyTorch SDPA pinned to cuDNN and to FlashAttention-2 CUDA (they refuse
  fp32: those cases are rows with ``"error"``).

An out-of-memory case is a row (``"oom": true``, with the phases that did fit). Rows ``{"run", "provider",
"seq_len", "d_head", "dtype", "fwd_ms", "bwd_ms", "fwd_bwd_ms", ...}`` go to
``writeup/results/flash_benchmarking.jsonl``; re-running skips what was measured on the same device, so the
sweep can be split (``--time-limit-s`` stops cleanly before a deadline; run again to go on). At the end it
prints the forward+backward table of everything measured on this device, and draws
``writeup/figures/flash_benchmarking_<dtype>.png`` (fwd+bwd ms against length, one panel per head dim, one
line per provider).

On a CPU (no GPU): tiny lengths, and without ``ours`` (the Triton interpreter is far too slow to time).

Examples::

    python -m cs336_systems.bench.flash_benchmarking                      # the whole sweep
    python -m cs336_systems.bench.flash_benchmarking --dtypes bf16 --time-limit-s 540
    python -m cs336_systems.bench.flash_benchmarking --providers ours sdpa_cudnn --seq-lens 16384 --head-dims 64
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from cs336_systems.attention.config import FLASH_CONFIG, FP32_PRODUCTS
from cs336_systems.bench.common import attention_providers as fp
from cs336_systems.bench.common import cli, result_store, timing

PROBLEM = "flash_benchmarking"
SEQ_LENS = [2**i for i in range(7, 17)]  # 128 .. 65536
HEAD_DIMS = [16, 32, 64, 128]
DTYPES = ["bf16", "fp32"]
GPU_PROVIDERS = ["ours", "naive", "naive_compiled", "flash_pytorch", "sdpa_cudnn", "sdpa_flash"]
CPU_PROVIDERS = ["naive", "flash_pytorch"]
TINY = dict(seq_lens=[64, 128], head_dims=[16], rep=20, warmup=5)
# A CPU smoke run: one shape in one dtype, so that torch.compile builds the tiled backward once.
CPU_QUICK = dict(seq_lens=[64], dtypes=["fp32"])
GPU_QUICK = dict(seq_lens=[128, 1024, 4096], head_dims=[64], dtypes=["bf16"], rep=20, warmup=5)
SHAPE_KEYS = ("dtype", "d_head", "seq_len")


def parser():
    p = cli.base_parser(__doc__)
    p.add_argument("--providers", nargs="+", type=fp.provider_name, choices=list(fp.PROVIDERS), default=None,
                   help=f"default: {' '.join(GPU_PROVIDERS)} on a GPU, {' '.join(CPU_PROVIDERS)} on a CPU")
    p.add_argument("--seq-lens", nargs="+", type=cli.positive_int, default=None)
    p.add_argument("--head-dims", nargs="+", type=cli.positive_int, default=None)
    p.add_argument("--dtypes", nargs="+", choices=list(fp.DTYPES), default=None)
    p.add_argument("--rep", type=cli.positive_float, default=100, help="do_bench repetition time per phase, ms")
    p.add_argument("--warmup", type=cli.positive_float, default=25, help="do_bench warm-up time per phase, ms")
    p.add_argument("--flash-pytorch-max-seq", type=cli.positive_int, default=1024,
                   help="longest length for flash_pytorch (its Python tile loop makes ~seq^2/2048 calls)")
    p.add_argument("--naive-max-seq", type=cli.positive_int, default=None,
                   help="longest length for naive and naive_compiled (default: all; out-of-memory becomes a row)")
    p.add_argument("--fixed-tiles", action="store_true", help="our kernels with fixed tiles (the default)")
    p.add_argument("--autotune", action="store_true", help="autotune our kernels' tiles per length bucket instead")
    p.add_argument("--fp32-products", choices=FP32_PRODUCTS, default=None,
                   help="our kernels' float32 products: ieee (FMA units) or tf32x3 (three TF32 tensor-core products); "
                        "default: CS336_FLASH_FP32, else tf32x3. Our float32 rows carry the key fp32_products (rows "
                        "without it ran ieee)")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="start no new case after this many seconds (run again to resume)")
    cli.add_figures_dir(p)
    p.add_argument("--no-plot", action="store_true")
    return p


def resolve_defaults(args, device: torch.device) -> None:
    """Fill the grid: the handout's sweep on a GPU (``--quick``: three lengths at d=64, bf16), tiny on a CPU
    (``--quick``: one length, d=16, fp32)."""
    if device.type != "cuda":
        providers = args.providers or CPU_PROVIDERS
        skipped = [p for p in providers if fp.get_provider(p).unavailable_reason(device)]
        for name in skipped:
            print(f"# skipping {name} on the CPU: {fp.get_provider(name).unavailable_reason(device)}", file=sys.stderr)
        args.providers = [p for p in providers if p not in skipped]
        args.seq_lens = args.seq_lens or (CPU_QUICK["seq_lens"] if args.quick else TINY["seq_lens"])
        args.head_dims = args.head_dims or TINY["head_dims"] + ([] if args.quick else [32])
        args.dtypes = args.dtypes or (CPU_QUICK["dtypes"] if args.quick else None)
        args.rep, args.warmup = min(args.rep, TINY["rep"]), min(args.warmup, TINY["warmup"])
    elif args.quick:
        args.seq_lens = args.seq_lens or GPU_QUICK["seq_lens"]
        args.head_dims = args.head_dims or GPU_QUICK["head_dims"]
        args.dtypes = args.dtypes or GPU_QUICK["dtypes"]
        args.rep, args.warmup = min(args.rep, GPU_QUICK["rep"]), min(args.warmup, GPU_QUICK["warmup"])
    args.providers = args.providers or GPU_PROVIDERS
    args.seq_lens = args.seq_lens or SEQ_LENS
    args.head_dims = args.head_dims or HEAD_DIMS
    args.dtypes = args.dtypes or DTYPES


def max_seq(provider: str, args) -> int | None:
    """The longest length ``provider`` runs at (None: no cap)."""
    if provider == "flash_pytorch":
        return args.flash_pytorch_max_seq
    if provider in ("naive", "naive_compiled"):
        return args.naive_max_seq
    return None


def fp32_products(args) -> str:
    """How our kernels multiply float32 inputs in this run (``--fp32-products``, else the configuration's)."""
    return args.fp32_products or FLASH_CONFIG.get().fp32_products


def make_cases(args) -> list[dict[str, Any]]:
    """Every (dtype, head dim, length, provider) configuration within the providers' length caps, grouped by
    shape so that each shape's inputs are made once."""
    cases = []
    for dtype in args.dtypes:
        for d_head in args.head_dims:
            for seq_len in args.seq_lens:
                for provider in args.providers:
                    cap = max_seq(provider, args)
                    if cap is None or seq_len <= cap:
                        case = dict(provider=provider, seq_len=seq_len, d_head=d_head, dtype=dtype, batch=1,
                                    causal=True, rep_ms=args.rep, warmup_ms=args.warmup)
                        if dtype == "fp32" and provider.startswith("ours"):
                            case["fp32_products"] = fp32_products(args)  # rows without the key: IEEE products
                        cases.append(case)
    return cases






def run_sweep(args, device: torch.device) -> result_store.ResultStore:
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force)
    pending = store.pending(make_cases(args))
    start, inputs, shape = time.monotonic(), None, None
    bar = cli.progress(pending, PROBLEM)
    for case in bar:
        if args.time_limit_s is not None and time.monotonic() - start > args.time_limit_s:
            print(f"\n# time limit reached: {len(pending) - bar.n} cases left; run again to resume", file=sys.stderr)
            break
        bar.set_postfix_str(f"{case['provider']} {case['dtype']} d={case['d_head']} n={case['seq_len']}")
        if shape != tuple(case[key] for key in SHAPE_KEYS):
            inputs = None
            timing.free_memory()
            shape = tuple(case[key] for key in SHAPE_KEYS)
            inputs = fp.make_inputs(1, case["seq_len"], case["d_head"], fp.DTYPES[case["dtype"]], device)
        store.add(case, fp.measure_provider(case["provider"], *inputs, device, args.rep, args.warmup))
    bar.close()
    return store


def latest_rows(store: result_store.ResultStore) -> list[dict[str, Any]]:
    """This device's rows, the latest one of each (provider, length, head dim, dtype)."""
    return result_store.latest((row for row in store.rows() if row.get("device") == store.env["device"]),
                               key=lambda row: (row["provider"], row["seq_len"], row["d_head"], row["dtype"]))


def cell(row: dict[str, Any], column: str) -> Any:
    """A table cell: the time, or why there is none."""
    if row.get(column) is not None:
        return row[column]
    if row.get("oom"):
        return "OOM"
    return "n/a" if row.get("error") else None


def table(rows: list[dict[str, Any]], column: str = "fwd_bwd_ms"):
    """A pandas table of ``column``: one line per (dtype, d_head, seq_len), one column per provider."""
    import pandas as pd

    frame = pd.DataFrame([{**{k: row[k] for k in ("provider", *SHAPE_KEYS)}, column: cell(row, column)}
                          for row in rows])
    if frame.empty:
        return frame
    return frame.pivot(index=list(SHAPE_KEYS), columns="provider", values=column)


def plot(rows: list[dict[str, Any]], dtype: str, path: Path) -> None:
    """fwd+bwd ms against length (log-log), one panel per head dim, one line per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["dtype"] == dtype and r.get("fwd_bwd_ms") is not None]
    head_dims = sorted({r["d_head"] for r in rows})
    providers = sorted({r["provider"] for r in rows})
    columns = min(2, len(head_dims))
    panels = (len(head_dims) + columns - 1) // columns
    fig, axes = plt.subplots(panels, columns, figsize=(6 * columns, 4.2 * panels), squeeze=False, sharey=True)
    for ax, d_head in zip(axes.flat, head_dims):
        for provider in providers:
            points = sorted((r["seq_len"], r["fwd_bwd_ms"]) for r in rows if r["provider"] == provider
                            and r["d_head"] == d_head)
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=provider)
        ax.set(xscale="log", yscale="log", title=f"d = {d_head}", xlabel="sequence length", ylabel="fwd+bwd (ms)")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(head_dims):]:
        ax.set_visible(False)
    device = rows[0]["device"] if rows else ""
    fig.suptitle(f"Causal attention, batch 1, {dtype}: forward + backward ({device})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args, device, _ = cli.start(parser(), argv)
    resolve_defaults(args, device)
    fp.choose_tiles(args.fixed_tiles, args.autotune, args.fp32_products)
    store = run_sweep(args, device)
    rows = latest_rows(store)
    import pandas as pd

    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width", 200,
                           "display.float_format", "{:.3f}".format):
        print("# forward+backward ms, everything measured on this device:")
        print(table(rows))
    if not args.no_plot:
        figures_dir = args.figures_dir or result_store.FIGURES_DIR
        for dtype in sorted({r["dtype"] for r in rows}):
            path = figures_dir / f"{PROBLEM}_{dtype}.png"
            plot(rows, dtype, path)
            print(f"# figure: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
