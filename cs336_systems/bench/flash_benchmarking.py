"""The FlashAttention sweep (problem ``flash_benchmarking``, SPEC 3.6).

Batch 1, causal, sequence length 128 ... 65536 (powers of two) x head dim 16, 32, 64, 128 x {bf16, fp32}:
forward, backward and forward+backward latency (``triton.testing.do_bench``, median) of our Triton
kernels (autotuned tiles), the plain PyTorch attention, the compiled one and our tiled PyTorch version
(these three only up to ``--max-pytorch-len``: beyond it they are slow or out of memory), and PyTorch's
fused attention (cuDNN and FlashAttention-2 CUDA backends; they take no fp32: such a row carries the error).
Out-of-memory cases are rows. Resumable: a re-run measures only what is missing.

Examples::

    python -m cs336_systems.bench.flash_benchmarking --dtypes bf16
    python -m cs336_systems.bench.flash_benchmarking --quick          # on a CPU: tiny sizes, PyTorch providers
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd
import torch

from cs336_systems.bench import harness
from cs336_systems.bench.flash_providers import time_provider, unavailable

PROBLEM = "flash_benchmarking"
SEQ_LENS = [2**i for i in range(7, 17)]
HEAD_DIMS = [16, 32, 64, 128]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROVIDERS = ["ours", "pytorch_naive", "pytorch_compiled", "pytorch_tiled", "sdpa_cudnn", "sdpa_flash"]
PYTORCH_PROVIDERS = {"pytorch_naive", "pytorch_compiled", "pytorch_tiled"}


def parser():
    p = harness.base_parser(__doc__)
    p.add_argument("--seq-lens", nargs="+", type=int, default=SEQ_LENS)
    p.add_argument("--head-dims", nargs="+", type=int, default=HEAD_DIMS)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--providers", nargs="+", default=PROVIDERS, choices=PROVIDERS)
    p.add_argument("--max-pytorch-len", type=int, default=16384, help="longest sequence for the PyTorch providers")
    p.add_argument("--max-tiled-len", type=int, default=4096, help="longest sequence for our tiled PyTorch version")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    p.add_argument("--figures-dir", type=Path, default=None, help=f"where PNGs go (default {harness.FIGURES_DIR})")
    p.add_argument("--deadline-s", type=float, default=None, help="stop starting new cases after this many seconds")
    return p


def plot(rows: list[dict], path) -> None:
    """fwd+bwd ms vs sequence length, one panel per dtype, one line per provider x head dim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = pd.DataFrame([r for r in rows if r.get("fwd_bwd_ms")])
    if frame.empty:
        return
    dtypes = sorted(frame["dtype"].unique())
    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        for (provider, d), group in frame[frame["dtype"] == dtype].groupby(["provider", "d_head"]):
            group = group.sort_values("seq_len")
            ax.plot(group["seq_len"], group["fwd_bwd_ms"], marker="o", ms=3, label=f"{provider} d={d}")
        ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="forward + backward (ms)",
               title=f"causal attention, batch 1, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    device = harness.default_device()
    harness.announce(device, args.quick)
    if args.quick or device.type == "cpu":
        args.seq_lens, args.head_dims = [s for s in args.seq_lens if s <= 256][:2] or [128], args.head_dims[:1]
        args.dtypes = args.dtypes[-1:]
    if device.type == "cpu":
        dropped = [p for p in args.providers if p not in PYTORCH_PROVIDERS]
        args.providers = [p for p in args.providers if p in PYTORCH_PROVIDERS]
        print(f"# no GPU: skipping {dropped} (Triton and SDPA's fused kernels need CUDA)", file=sys.stderr)
    store = harness.ResultStore(PROBLEM, args.results_dir, args.force)
    cases = [dict(provider=p, seq_len=n, d_head=d, dtype=dt, batch=1, causal=True)
             for dt in args.dtypes for d in args.head_dims for n in args.seq_lens for p in args.providers
             if p not in PYTORCH_PROVIDERS or n <= (args.max_tiled_len if p == "pytorch_tiled" else args.max_pytorch_len)]
    start = time.monotonic()
    rows = []
    for case in harness.progress(store.pending(cases), PROBLEM):
        if args.deadline_s and time.monotonic() - start > args.deadline_s:
            print("# deadline reached: re-run to measure the rest", file=sys.stderr)
            break
        q, k, v = (torch.randn(1, case["seq_len"], case["d_head"], device=device, dtype=DTYPES[case["dtype"]],
                               requires_grad=True) for _ in range(3))
        try:
            result = harness.measure_or_oom(lambda: time_provider(case["provider"], q, k, v, args.rep, args.rep // 4))
        except Exception as error:  # noqa: BLE001 - an unsupported input is a row, not a crash
            if not unavailable(error) and "no available kernel" not in str(error).lower():
                raise
            result = {"error": str(error).splitlines()[0][:300]}
        del q, k, v
        harness.free_memory()
        rows.append(store.add(case, result))
    everything = [r for r in store.rows() if r.get("device") == store.env["device"]]
    if everything:
        frame = pd.DataFrame(everything)
        if "fwd_bwd_ms" in frame:
            table = frame.pivot_table(index=["dtype", "d_head", "seq_len"], columns="provider", values="fwd_bwd_ms")
            print(table.round(3).to_string())
        for dtype in sorted({r["dtype"] for r in everything}):
            plot([r for r in everything if r["dtype"] == dtype], (args.figures_dir or harness.FIGURES_DIR) / f"flash_benchmarking_{dtype}.png")


if __name__ == "__main__":
    main()
