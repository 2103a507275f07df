"""Sections beyond the assignment (SPEC part 6) that are not about sharding: the fused RMSNorm and the
FlashAttention optimisation log."""

from __future__ import annotations

import math
from typing import Any

from pipeline import figures
from pipeline.markup import DASH, num, span, spread, table, times
from pipeline.sections.registry import Output, problem

OURS = ("triton", "ours", "fused")


def load_rmsnorm(res) -> list[dict[str, Any]]:
    return res.rows("rmsnorm")


@problem("rmsnorm")
def rmsnorm(res, out: Output) -> dict[str, Any]:
    rows = [r for r in load_rmsnorm(res) if not r.get("oom")]
    providers = sorted({r["provider"] for r in rows}, key=lambda p: (p.lower() not in OURS, p))
    passes = sorted({r["pass"] for r in rows}, key=lambda p: (p != "forward", p))
    shapes = sorted({(r["rows"], r["cols"]) for r in rows}, key=lambda s: (s[1], s[0]))
    dtypes = sorted({r["dtype"] for r in rows})
    index = {(r["provider"], r["pass"], r["rows"], r["cols"], r["dtype"]): r for r in rows}
    body = []
    for dtype in dtypes:
        for n_rows, n_cols in shapes:
            cells = [dtype, f"{n_rows:,} × {n_cols:,}"]
            for p in passes:
                for provider in providers:
                    row = index.get((provider, p, n_rows, n_cols, dtype))
                    cells.append(num(row["gbps"], 0) if row and row.get("gbps") else DASH)
            body.append(cells)
    header = [["", "", *[span(p, len(providers)) for p in passes]], ["dtype", "rows × cols", *providers * len(passes)]]
    tab = table(header, body, "Fused RMSNorm: effective bandwidth (GB/s, bytes read + written / time) per provider; "
                "rows × cols is batch·context × d_model of the five model sizes at context 512.", size=7)
    fig, axes = figures.new(6.5, 2.6, ncols=len(passes), sharey=True)
    dtype = "bf16" if "bf16" in dtypes else dtypes[0]
    width = 0.8 / max(1, len(providers))
    for ax, p in zip(axes, passes):
        for i, provider in enumerate(providers):
            values = [index.get((provider, p, r, c, dtype), {}).get("gbps") or 0 for r, c in shapes]
            ax.bar([x + i * width for x in range(len(shapes))], values, width, label=provider)
        ax.set_xticks([x + width * (len(providers) - 1) / 2 for x in range(len(shapes))])
        ax.set_xticklabels([f"{c}" for _, c in shapes])
        ax.set_xlabel("d_model (cols)")
        ax.set_title(p)
    axes[0].set_ylabel("GB/s")
    figures.legend_below(fig, axes[0], ncol=len(providers))
    figure = out.save(fig, "rmsnorm", f"Fused RMSNorm bandwidth per provider, {dtype}.")
    ours = next((p for p in providers if p.lower() in OURS), providers[0])
    ratios: dict[str, list[float]] = {}
    for (provider, p, r, c, d), row in index.items():
        mine = index.get((ours, p, r, c, d))
        if provider != ours and mine and mine.get("gbps") and row.get("gbps"):
            ratios.setdefault(provider, []).append(mine["gbps"] / row["gbps"])
    n = {"ours": ours, "versus": "; ".join(f"{spread(min(v), max(v))} the bandwidth of {p}"
                                          for p, v in ratios.items()) or DASH,
         "best": num(max((r["gbps"] for r in rows if r["provider"] == ours), default=math.nan), 0)}
    return {"tables": {"main": tab}, "figures": {"main": figure}, "n": n}


def load_optimisation_log(res) -> list[dict[str, Any]]:
    return res.rows("flash_optimisation_log")


TIMINGS = ("fwd_ms", "bwd_ms", "fwd_bwd_ms")


@problem("flash_optimisation_log")
def flash_optimisation_log(res, out: Output) -> dict[str, Any]:
    rows = load_optimisation_log(res)
    if any("step" in r for r in rows):
        rows = sorted(rows, key=lambda r: r.get("step", 0))
    timings = [k for k in TIMINGS if any(r.get(k) is not None for r in rows)]
    label = next((k for k in ("change", "description", "name", "step") if any(r.get(k) for r in rows)), None)
    first = rows[0]
    body = []
    for i, r in enumerate(rows):
        main = r.get("fwd_bwd_ms") or r.get(timings[-1]) if timings else None
        base = first.get("fwd_bwd_ms") or first.get(timings[-1]) if timings else None
        body.append([str(r.get("step", i + 1)), str(r.get(label, "")) if label else DASH,
                     *[num(r.get(k), 3) for k in timings],
                     times(base / main) if main and base else DASH])
    tab = table(["#", "change", *[k.removesuffix("_ms").replace("_", "+") + " (ms)" for k in timings], "vs first"],
                body, "FlashAttention-2 on the leaderboard shape, one change at a time: latency after each change "
                "and the speed-up over the first version.", align=["right", "left", *["right"] * (len(timings) + 1)],
                size=8)
    last = rows[-1]
    key = "fwd_bwd_ms" if "fwd_bwd_ms" in timings else (timings[-1] if timings else None)
    return {"tables": {"main": tab}, "n": {
        "first": num(first.get(key), 2) if key else DASH, "last": num(last.get(key), 2) if key else DASH,
        "total": times(first[key] / last[key]) if key and first.get(key) and last.get(key) else DASH,
        "steps": str(len(rows))}}
