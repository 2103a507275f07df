"""Sections beyond the assignment (SPEC part 6) that are not about sharding: the fused RMSNorm and the
FlashAttention optimisation log."""

from __future__ import annotations

import re
from typing import Any

from pipeline import figures
from pipeline.markup import DASH, num, span, spread, table, times
from pipeline.sections.registry import Output, problem

OURS = ("triton", "ours", "fused")


def load_rmsnorm(res) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The kernel rows (``part == "kernel"``: provider, pass, rows × cols, GB/s, the copy reference) and the
    model rows (``part == "model"``: a train step of one model size with ``norm`` plain or fused)."""
    rows = res.rows("rmsnorm")
    kernel = [r for r in rows if r.get("part", "kernel") == "kernel" and "provider" in r]
    model = [r for r in rows if r.get("part") == "model"]
    return kernel, model


@problem("rmsnorm")
def rmsnorm(res, out: Output) -> dict[str, Any]:
    kernel, model = load_rmsnorm(res)
    rows = [r for r in kernel if not r.get("oom") and r["provider"] != "copy"]
    copy = {(r["rows"], r["cols"], r["dtype"]): r for r in kernel if r["provider"] == "copy" and r.get("gbps")}
    providers = sorted({r["provider"] for r in rows}, key=lambda p: (p.lower() not in OURS, p))
    passes = sorted({r["pass"] for r in rows}, key=lambda p: (p != "fwd", p))
    shapes = sorted({(r["rows"], r["cols"]) for r in rows}, key=lambda s: (s[0], s[1]))
    dtypes = sorted({r["dtype"] for r in rows})
    index = {(r["provider"], r["pass"], r["rows"], r["cols"], r["dtype"]): r for r in rows}
    body = []
    for dtype in dtypes:
        for n_rows, n_cols in shapes:
            ref = copy.get((n_rows, n_cols, dtype))
            cells = [dtype, f"{n_rows:,} × {n_cols:,}", num(ref["gbps"], 0) if ref else DASH]
            for p in passes:
                for provider in providers:
                    row = index.get((provider, p, n_rows, n_cols, dtype))
                    cells.append(num(row["gbps"], 0) if row and row.get("gbps") else DASH)
            body.append(cells)
    header = [["", "", "", *[span(p.replace("_", "+"), len(providers)) for p in passes]],
              ["dtype", "rows × cols", "copy", *providers * len(passes)]]
    tab = table(header, body, "Fused RMSNorm kernel: effective bandwidth (GB/s, bytes read + written / time, median) "
                "per provider and pass; copy is a plain device-to-device copy of the same bytes, the bandwidth "
                "ceiling.", size=7)
    fig, axes = figures.new(6.5, 2.6, ncols=len(passes), sharey=True)
    dtype = "bf16" if "bf16" in dtypes else dtypes[0]
    width = 0.8 / max(1, len(providers) + 1)
    for ax, p in zip(axes, passes):
        for i, provider in enumerate([*providers, "copy"]):
            if provider == "copy":
                values = [copy.get((r, c, dtype), {}).get("gbps") or 0 for r, c in shapes]
            else:
                values = [index.get((provider, p, r, c, dtype), {}).get("gbps") or 0 for r, c in shapes]
            ax.bar([x + i * width for x in range(len(shapes))], values, width, label=provider,
                   color="0.75" if provider == "copy" else None)
        ax.set_xticks([x + width * len(providers) / 2 for x in range(len(shapes))])
        ax.set_xticklabels([f"{r // 1024}k×{c}" for r, c in shapes], fontsize=6)
        ax.set_xlabel("rows × cols")
        ax.set_title(p.replace("_", "+"))
    axes[0].set_ylabel("GB/s")
    figures.legend_below(fig, axes[0], ncol=len(providers) + 1)
    figure = out.save(fig, "rmsnorm", f"Fused RMSNorm kernel bandwidth per provider, {dtype}; grey: copy.")
    ours = next((p for p in providers if p.lower() in OURS), providers[0])
    ratios: dict[str, list[float]] = {}
    for (provider, p, r, c, d), row in index.items():
        mine = index.get((ours, p, r, c, d))
        if provider != ours and mine and mine.get("gbps") and row.get("gbps"):
            ratios.setdefault(provider, []).append(mine["gbps"] / row["gbps"])
    mine = [r for r in rows if r["provider"] == ours and r.get("fraction_of_copy") is not None]
    best = max(mine, key=lambda r: r["gbps"], default=None)
    norms = sorted({r.get("norm", "") for r in model if not r.get("oom")})
    measured = [r for r in model if not r.get("oom")]
    if len(norms) >= 2:
        model_text = "; ".join(f"{r.get('norm')}: {num(r.get('mean_ms'), 1)} ms" for r in measured)
    elif measured:
        r = measured[0]
        model_text = (f"only the {r.get('norm', 'plain')} RMSNorm was measured in a model "
                      f"({r.get('size')} model, {r.get('dtype')}, context {r.get('context_length')}, "
                      f"{r.get('mode', 'train step').replace('_', ' ')}: {num(r.get('mean_ms'), 1)} ms), so the "
                      "model-level comparison with the fused kernel was not measured")
    else:
        model_text = "the model-level comparison was not measured"
    n = {"ours": ours, "versus": "; ".join(f"{spread(min(v), max(v))} the bandwidth of {p}"
                                          for p, v in ratios.items()) or DASH,
         "best": num(best["gbps"], 0) if best else DASH,
         "best_share": f"{100 * best['fraction_of_copy']:.0f} %" if best else DASH,
         "dtypes": ", ".join(dtypes), "providers": ", ".join(providers),
         "model": model_text}
    return {"tables": {"main": tab}, "figures": {"main": figure}, "n": n}


def load_optimisation_log(res) -> tuple[list[dict[str, Any]], list[tuple[str, str]], list[dict[str, Any]]]:
    """The log rows if ``flash_optimisation_log.jsonl`` exists, else the probe outputs
    (``flash_probe/*.txt``, plain text of ``scripts/flash_probe.py``, one per step) and the leaderboard rows."""
    if res.path("flash_optimisation_log.jsonl").exists():
        return res.rows("flash_optimisation_log"), [], []
    probes = sorted(res.path("flash_probe").glob("*.txt")) if res.path("flash_probe").is_dir() else []
    if not probes:
        res.rows("flash_optimisation_log")  # raises Missing naming the file
    texts = [(p.stem, res.text(f"flash_probe/{p.name}")) for p in probes]
    return [], texts, res.rows("leaderboard")


TIMINGS = ("fwd_ms", "bwd_ms", "fwd_bwd_ms")
PROBE_LINE = re.compile(r"^leaderboard (\w+): ([\d.]+) ms")


def _probe_summary(texts: list[tuple[str, str]], board: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps, the leaderboard latency each probe printed for ours and the baseline, and the final leaderboard."""
    steps = []
    for name, text in texts:
        found = {m.group(1): float(m.group(2)) for m in map(PROBE_LINE.match, text.splitlines()) if m}
        steps.append({"name": name.replace("_", " "), "ours": found.get("ours"), "baseline": found.get("baseline")})
    body = [[str(i + 1), s["name"], num(s["ours"], 3), num(s["baseline"], 3),
             times(s["baseline"] / s["ours"]) if s["ours"] and s["baseline"] else DASH] for i, s in enumerate(steps)]
    tab = table(["#", "probe step", "ours (ms)", "before (ms)", "speed-up"], body,
                "FlashAttention-2 optimisation probes (scripts/flash_probe.py): forward + backward on the leaderboard "
                "shape printed by each step, for the changed kernel (ours) and the version before it (baseline).",
                align=["right", "left", "right", "right", "right"], size=8)
    ours = next((r for r in board if r.get("provider") == "ours"), None)
    others = sorted((r for r in board if r.get("provider") != "ours" and r.get("fwd_bwd_ms")),
                    key=lambda r: r["fwd_bwd_ms"])
    final = (f"The final leaderboard run (H = {ours.get('heads')}, N = {ours.get('seq_len')}, d = {ours.get('d_head')}, "
             f"{ours.get('dtype')}, causal) measured ours at {num(ours.get('fwd_bwd_ms'), 2)} ms forward + backward "
             f"({'verified against SDPA' if ours.get('verified') else 'not verified'}, "
             f"{ours.get('graph_breaks_after_first_call', ours.get('graph_breaks'))} graph breaks after the first call), "
             "against " + ", ".join(f"{r['provider']} {num(r['fwd_bwd_ms'], 2)} ms" for r in others) + "."
             ) if ours else "The leaderboard was not run."
    last = steps[-1] if steps else {}
    summary = (f"{len(steps)} probe steps were recorded as the plain text of scripts/flash_probe.py (below, verbatim): "
               "each times our kernel and the previous version (baseline) against SDPA's cuDNN and FlashAttention-2 "
               "backends on several shapes (the ratio in brackets is against cuDNN), the host overhead of one small "
               "call and, in the first steps, a profile of the host side. "
               + (f"After the last step, ours takes {num(last['ours'], 3)} ms on the leaderboard shape against "
                  f"{num(last['baseline'], 3)} ms for the baseline. " if last.get("ours") else "") + final)
    return {"tables": {"main": tab}, "listings": [{"name": n, "text": t} for n, t in texts],
            "n": {"summary": summary, "steps": str(len(steps)), "mode": "probe"}}


@problem("flash_optimisation_log")
def flash_optimisation_log(res, out: Output) -> dict[str, Any]:
    rows, texts, board = load_optimisation_log(res)
    if not rows:
        return _probe_summary(texts, board)
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
        "steps": str(len(rows)), "mode": "log"}, "listings": []}
