"""Sections on FlashAttention-2: accuracy on the GPU, the benchmark, the leaderboard."""

from __future__ import annotations

from typing import Any

from cs336_systems.attention.config import FlashConfig
from pipeline import figures
from pipeline.markup import DASH, join_words, num, pct, sci, span, spread, table, times
from pipeline.results import Missing, measured_when, row_date
from pipeline.sections.registry import Output, problem

ERRORS_FILE = "h100-hopper-backward/tests/flash_attention_triton_errors.json"  # the GPU tests with the Hopper kernels
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


def accuracy_table(res, tensors: list[str], what: str) -> tuple[dict, dict]:
    """Worst relative error of ``tensors`` per precision, from the GPU test run's error summary."""
    errors = res.json(ERRORS_FILE)
    body = []
    for precision in PRECISIONS:
        summary = errors["summary"].get(precision)
        if not summary:
            continue
        for tensor in tensors:
            worst = summary["worst"][tensor]
            body.append([precision if tensor == tensors[0] else "", tensor, str(summary["cases"]),
                         sci(worst["relative_error"]), sci(worst["max_abs_error"]), num(worst["max_ratio_to_torch"], 2),
                         worst["case"]])
    caption = (f"{what} of our kernels against a float64 reference on {errors['device']} (fp16 and bf16 on the Hopper "
               "kernels, fp32 and TF32 on the Triton ones): the worst relative "
               "error over the test cases, its absolute error, its ratio to PyTorch's own error at the same precision, "
               "and the case (batch x heads x queries x keys).")
    tab = table(["precision", "tensor", "cases", "relative error", "abs. error", "÷ PyTorch's", "worst case"], body,
                caption, align=["left", "left", "right", "right", "right", "right", "left"], size=8)
    n = {"factor": num(errors.get("torch_error_factor"), 0),
         "floors": ", ".join(f"{p} {v:g}" for p, v in errors.get("error_floor", {}).items())}
    return tab, n


@problem("flash_forward")
def flash_forward(res, out: Output) -> dict[str, Any]:
    tab, n = accuracy_table(res, ["O", "L"], "Forward accuracy")
    return {"tables": {"accuracy": tab}, "n": n}


@problem("flash_backward")
def flash_backward(res, out: Output) -> dict[str, Any]:
    tab, n = accuracy_table(res, ["dQ", "dK", "dV"], "Backward accuracy")
    return {"tables": {"accuracy": tab}, "n": n}


# -----------------------------------------------------------------------------------------------
# flash_benchmarking
# -----------------------------------------------------------------------------------------------

OURS = ("triton", "ours", "flash_triton", "flash")
BASELINES = ("pytorch", "naive", "torch", "eager")


def provider_role(name: str) -> str:
    lowered = name.lower()
    if lowered in OURS:
        return "ours"
    if lowered in BASELINES:
        return "pytorch"
    return lowered


def load_flash_benchmarking(res) -> list[dict[str, Any]]:
    """The sweep's rows of our default kernels: our float32 rows of the default ``fp32_products`` (rows without the
    key ran "ieee")."""
    default = FlashConfig().fp32_products
    return res.rows("flash_benchmarking",
                    keep=lambda rows: [r for r in rows if r.get("fp32_products", "ieee") == default
                                       or not (r.get("dtype") == "fp32" and r.get("provider") == "ours")])


def cell(row: dict[str, Any] | None, key: str) -> str:
    if row is None:
        return DASH
    if row.get("oom"):
        return "OOM"
    return num(row.get(key), 3) if row.get(key) is not None else DASH


GLUON_MIN_LENGTH = 4096
"""At batch 1 and one head, the first length with 32 tiles of 128 queries: from there our operator runs the Gluon
(Hopper) kernels on fp16/bf16 inputs, below it the Triton ones."""


def provider_table(index: dict, providers: list[str], lengths: list[int], heads: list[int], dtype: str,
                   keys: tuple[str, ...], caption: str) -> dict[str, Any]:
    """Rows (length, d) by columns (provider, key): the benchmark's latencies as printed."""
    labels = {"fwd_ms": "fwd", "bwd_ms": "bwd", "fwd_bwd_ms": "both"}
    body = []
    for length in lengths:
        for d in heads:
            cells = [f"{length:,}", str(d)]
            for provider in providers:
                cells += [cell(index.get((provider, length, d, dtype)), key) for key in keys]
            body.append(cells)
    if len(keys) == 1:
        header = ["length", "d", *providers]
    else:
        header = [["", "", *[span(p, len(keys)) for p in providers]], ["length", "d", *[labels[k] for k in keys] * len(providers)]]
    return table(header, body, caption, size=7.5)


def fwd_bwd(index: dict, key: tuple) -> float | None:
    row = index.get(key)
    return row.get("fwd_bwd_ms") if row and not row.get("oom") else None


TIE = 0.02
"""Rows of two different runs within 2 % of each other are a tie: no run set them side by side, and runs of the
same configuration differ by about that much."""


def latest_cells(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """The row each table cell shows: the latest (date, run) of each (provider, length, d, dtype)."""
    index = {}
    for r in sorted(rows, key=measured_when):
        index[(r["provider"], r["seq_len"], r["d_head"], r["dtype"])] = r
    return index


def _length_words(d: int, listed: list[int], tail: list[int]) -> str:
    """"d = 128 (lengths 4,096 and 8,192)", or "d = 64 (from 8,192 on)" when ``listed`` is every length of ``tail``."""
    if tail == listed and len(listed) > 1:
        return f"d = {d} (from {listed[0]:,} on)"
    return f"d = {d} (length{'s' if len(listed) > 1 else ''} {join_words([f'{n:,}' for n in listed])})"


def where_ours_loses(index: dict, ours: str, other: str, lengths: list[int], heads: list[int],
                     dtype: str) -> tuple[str, str]:
    """Per head dimension, the lengths where ours is slower than ``other`` (forward + backward, where both ran):
    "d = 128 (lengths 4,096 and 8,192)", or "d = 64 (from 8,192 on)" when ours is slower at every longer length;
    and, apart, the lengths where the two tie: rows of different runs within ``TIE`` of each other."""
    slower_words, tie_words = [], []
    for d in heads:
        both = [(n, index.get((ours, n, d, dtype)), index.get((other, n, d, dtype))) for n in lengths]
        both = [(n, a, b) for n, a, b in both if fwd_bwd(index, (ours, n, d, dtype))
                and fwd_bwd(index, (other, n, d, dtype))]
        tied = [n for n, a, b in both
                if a.get("run") != b.get("run") and abs(a["fwd_bwd_ms"] / b["fwd_bwd_ms"] - 1) <= TIE]
        slower = [n for n, a, b in both if a["fwd_bwd_ms"] > b["fwd_bwd_ms"] and n not in tied]
        if slower:
            slower_words.append(_length_words(d, slower, [n for n, _, _ in both if n >= slower[0]]))
        if tied:
            tie_words.append(_length_words(d, tied, []))
    return "; ".join(slower_words), "; ".join(tie_words)


def commit_words(row: dict[str, Any]) -> str:
    """The commit a row ran at, as a reader can look it up: a tool records uncommitted changes as ``<commit>+<name>``,
    which the text gives as ``<commit> with uncommitted changes``."""
    commit = str(row.get("env", {}).get("commit", "?"))
    base, plus, _ = commit.partition("+")
    return f"{base[:7]} with uncommitted changes" if plus else commit[:7]


def shown_runs(index: dict, providers: list[str], lengths: list[int], heads: list[int], dtype: str) -> str:
    """Where the cells a table shows come from, per provider: "ours: 2 runs of 2026-11-26 (commits a and b,
    do_bench rep 100 ms); naive: 1 run of 2026-11-22 (commit c, rep 40 ms)", or "all rows from one run (...)"."""
    shown = {p: [index[(p, n, d, dtype)] for n in lengths for d in heads if (p, n, d, dtype) in index]
             for p in providers}

    def where(rows: list[dict[str, Any]]) -> str:
        rows = sorted(rows, key=measured_when)
        dates = sorted({r.get("env", {}).get("date", "")[:10] or "?" for r in rows})
        commits = list(dict.fromkeys(commit_words(r) for r in rows))
        reps = sorted({r["rep_ms"] for r in rows if r.get("rep_ms") is not None})
        runs = len({r.get("run") for r in rows})
        return (f"{runs if runs > 1 else 'one'} run{'s' if runs > 1 else ''} of {' to '.join(dict.fromkeys([dates[0], dates[-1]]))} "
                f"(commit{'s' if len(commits) > 1 else ''} {join_words(commits)}"
                + (f", do_bench rep {join_words([f'{x:g}' for x in reps])} ms" if reps else "") + ")")

    if len({r.get("run") for rows in shown.values() for r in rows}) == 1:
        return "all rows from " + where([r for rows in shown.values() for r in rows])
    return "; ".join(f"{p}: {where(rows)}" for p, rows in shown.items() if rows)


def cross_run(index: dict, a: str, b: str, lengths: list[int], heads: list[int], dtype: str) -> bool:
    """Whether some cell where both ``a`` and ``b`` ran sets rows of two different runs side by side."""
    return any(index[(a, n, d, dtype)].get("run") != index[(b, n, d, dtype)].get("run")
               for n in lengths for d in heads if (a, n, d, dtype) in index and (b, n, d, dtype) in index)


@problem("flash_benchmarking")
def flash_benchmarking(res, out: Output) -> dict[str, Any]:
    rows = load_flash_benchmarking(res)
    providers = sorted({row["provider"] for row in rows}, key=lambda p: (provider_role(p) != "ours", p))
    dtypes = sorted({row["dtype"] for row in rows}, key=lambda d: (d != "bf16", d))
    lengths = sorted({row["seq_len"] for row in rows})
    heads = sorted({row["d_head"] for row in rows})
    index = latest_cells(rows)
    ours = next((p for p in providers if provider_role(p) == "ours"), None)
    base = next((p for p in providers if provider_role(p) == "pytorch"), None)
    extra = [p for p in providers if p not in (ours, base)]
    tables, figs, speedups = {}, {}, {}
    for dtype in dtypes:
        runs = shown_runs(index, [ours, base], lengths, heads, dtype)
        tables[dtype] = provider_table(
            index, [ours, base], lengths, heads, dtype, ("fwd_ms", "bwd_ms", "fwd_bwd_ms"),
            f"Our Triton FlashAttention-2 against the PyTorch attention ({base}), {dtype}, batch 1, causal: latency "
            "(ms) from triton.testing.do_bench; fwd: forward, bwd: backward, both: forward + backward; OOM: out of "
            f"memory; {runs}.")
        ran = [p for p in extra if any(fwd_bwd(index, (p, n_, d_, dtype)) for n_ in lengths for d_ in heads)]
        if ran:
            tables[f"extra_{dtype}"] = provider_table(
                index, [ours, *ran], lengths, heads, dtype, ("fwd_bwd_ms",),
                f"Forward + backward (ms), {dtype}, batch 1, causal: ours beside the other implementations the "
                f"benchmark timed in {dtype} ({', '.join(ran)}); –: not measured; "
                f"{shown_runs(index, [ours, *ran], lengths, heads, dtype)}.")
        fig, axes = figures.new(7.0, 2.5, ncols=len(heads), sharey=True)
        for ax, d in zip(axes, heads):
            for provider in providers:
                pts = [(n, fwd_bwd(index, (provider, n, d, dtype))) for n in lengths]
                pts = [p for p in pts if p[1]]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=provider)
            figures.log2_axis(ax, lengths[:: max(1, len(lengths) // 5)])
            ax.set_yscale("log")
            ax.set_title(f"d = {d}")
            ax.set_xlabel("sequence length")
        axes[0].set_ylabel("forward + backward (ms)")
        figures.legend_below(fig, axes[0], ncol=len(providers))
        runs_shown = {index[(p, n_, d_, dtype)].get("run") for p in providers for n_ in lengths for d_ in heads
                      if fwd_bwd(index, (p, n_, d_, dtype))}
        figs[dtype] = out.save(fig, f"flash_benchmarking_{dtype}", f"Forward + backward latency against sequence "
                               f"length, {dtype}, causal, batch 1 (log-log; missing points ran out of memory)"
                               + ("; the providers' rows come from different runs, named in the tables' captions."
                                  if len(runs_shown) > 1 else "."))
        ratios = [(n, d, fwd_bwd(index, (base, n, d, dtype)) / fwd_bwd(index, (ours, n, d, dtype)))
                  for n in lengths for d in heads
                  if fwd_bwd(index, (base, n, d, dtype)) and fwd_bwd(index, (ours, n, d, dtype))]
        longest = max((r[0] for r in ratios), default=None)
        at_longest = [r[2] for r in ratios if r[0] == longest]
        base_oom = sorted({r["seq_len"] for r in rows if r["provider"] == base and r["dtype"] == dtype and r.get("oom")})
        compiled = next((p for p in providers if p.endswith("compiled")), None)
        top = (max(lengths), max(heads)) if lengths else None
        loses, ties = where_ours_loses(index, ours, base, lengths, heads, dtype)
        loses_compiled, ties_compiled = (where_ours_loses(index, ours, compiled, lengths, heads, dtype)
                                         if compiled else ("", ""))
        speedups[dtype] = {
            "range": spread(min((r[2] for r in ratios), default=None), max((r[2] for r in ratios), default=None)),
            "longest": f"{longest:,}" if longest else DASH,
            "at_longest": spread(min(at_longest, default=None), max(at_longest, default=None)),
            "base_oom": f"{base_oom[0]:,}" if base_oom else "",
            "loses": loses, "ties": ties, "loses_compiled": loses_compiled, "ties_compiled": ties_compiled,
            "cross_run": cross_run(index, ours, base, lengths, heads, dtype), "runs": runs,
            "compiled_cross_run": bool(compiled) and cross_run(index, ours, compiled, lengths, heads, dtype),
            "compiled": compiled or "",
            "top_length": f"{top[0]:,}" if top else DASH, "top_d": str(top[1]) if top else DASH,
            "top_ours": num(fwd_bwd(index, (ours, *top, dtype)), 0) if top else DASH,
            "top_compiled": num(fwd_bwd(index, (compiled, *top, dtype)), 0) if top and compiled else DASH,
            "top_over_compiled": times(fwd_bwd(index, (ours, *top, dtype)) / fwd_bwd(index, (compiled, *top, dtype)), 1)
            if top and compiled and fwd_bwd(index, (ours, *top, dtype)) and fwd_bwd(index, (compiled, *top, dtype)) else DASH,
        }
        # The longest length where the PyTorch attention still runs, at the largest head dimension.
        both_ran = [n for n in lengths if fwd_bwd(index, (ours, n, max(heads), dtype)) and fwd_bwd(index, (base, n, max(heads), dtype))]
        if both_ran:
            n_ = both_ran[-1]
            speedups[dtype] |= {"last_length": f"{n_:,}", "last_ours": num(fwd_bwd(index, (ours, n_, max(heads), dtype)), 1),
                                "last_base": num(fwd_bwd(index, (base, n_, max(heads), dtype)), 1)}
    n = {"dtypes": dtypes, "speedups": speedups, "providers": ", ".join(providers), "ours": ours or DASH,
         "base": base or DASH, "extra": ", ".join(extra), "has_extra": bool(extra),
         "gluon_length": f"{GLUON_MIN_LENGTH:,}", "max_d": str(max(heads)) if heads else DASH}
    n["hopper"] = _hopper_sweep(res) or {}
    n["has_hopper"] = bool(n["hopper"])
    for head_dim in MODEL_ATTENTION:
        found = _model_shapes(res, head_dim)
        n[f"has_d{head_dim}"] = found is not None
        if found is not None:
            tables[f"d{head_dim}"], n[f"d{head_dim}"] = found
    return {"tables": tables, "figures": figs, "n": n}


BACKEND_NAMES = {"hopper": "Hopper kernels", "triton": "portable kernels"}


def backends_label(r: dict[str, Any]) -> str:
    """Who ran a flash_shapes_bench row: SDPA's cuDNN backend, or our backends per part (``backends``)."""
    if r["provider"] != "ours":
        return {"sdpa": "SDPA (cuDNN)", "fa2": "SDPA (FlashAttention-2)"}.get(r["provider"], r["provider"])

    def name(text):
        backend, d = text.split(", ")
        return f"{BACKEND_NAMES.get(backend, backend)} at {d}"

    b = r.get("backends") or {}
    if not b:
        return f"ours ({r['kernels']})"
    if b["forward"] == b["backward"]:
        return f"ours, {name(b['forward'])}"
    return f"ours, forward {name(b['forward'])}, backward {name(b['backward'])}"


MODEL_ATTENTION = {64: "The small to xl models' attention (d = 64)", 80: "The 2.7B model's attention (d = 80)"}
"""The head dims of the model sizes, as ``flash_shapes_bench --shapes models`` times them."""
MODEL_MAX_CONTEXT = 8192  # the models' shapes in flash_shapes_bench; its long-context shapes start at 16,384


def _model_shapes(res, head_dim: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The models' attention at ``head_dim`` in ``flash_shapes_bench.jsonl``: the newest row of each provider, kernel
    family and shape of the newest date, as a table (ms, and ours over cuDNN per part) and its numbers; None without
    such rows."""
    try:
        rows = [r for r in res.log_rows("flash_shapes_bench", measured=lambda r: r["shape"][-1] == head_dim)
                if r["shape"][-1] == head_dim and r["shape"][2] <= MODEL_MAX_CONTEXT]
    except Missing:
        return None
    if not rows:
        return None
    date = max(r.get("date", "") for r in rows)
    # Our default's newest row per shape, whichever backends it ran; each other kernel family's newest
    latest = {("ours (default)" if r["provider"] == "ours" and r.get("kernels") == "auto" else backends_label(r),
               tuple(r["shape"])): r for r in rows if r.get("date", "") == date}
    # cuDNN of the same commit where it ran there, so that a ratio compares rows of one code
    cudnn_of = {(r.get("commit"), tuple(r["shape"])): r for r in rows
                if r.get("date", "") == date and r["provider"] == "sdpa"}
    parts = ("fwd_ms", "bwd_ms", "fwd_bwd_ms")
    body, default_ratios = [], {}
    for (label, shape), r in sorted(latest.items(), key=lambda item: (item[1]["provider"] == "ours", item[0][0],
                                                                      item[0][1][2], item[0][1][0])):
        cudnn = cudnn_of.get((r.get("commit"), shape)) if r["provider"] == "ours" else None
        ratios = {part: r[part] / cudnn[part] for part in parts} if cudnn else {}
        if ratios and r.get("kernels") == "auto":
            default_ratios[shape] = ratios
        body.append([backends_label(r), " × ".join(str(x) for x in shape), *(num(r[part], 3) for part in parts),
                     *(times(ratios[part], 2) if ratios else DASH for part in parts), str(r.get("commit", DASH))])
    first = next(iter(latest.values()))
    found = table(["kernels", "shape (B, H, T, d)", "fwd ms", "bwd ms", "both ms", "fwd ÷ cuDNN", "bwd ÷ cuDNN",
                   "both ÷ cuDNN", "commit"], body,
                  f"{MODEL_ATTENTION[head_dim]}, bf16, causal, scripts/flash_shapes_bench.py on {first['device']} "
                  f"({date}), each kernel family in its own process: do_bench per call (an eager call, its host "
                  "time included); each kernel family's newest row, at the commit it ran (rows of different commits "
                  "ran different code), over cuDNN timed at the same commit.",
                  align=["left", "left"] + ["right"] * 6 + ["left"], size=8)
    long = {shape: ratios for shape, ratios in default_ratios.items() if shape[2] >= 2048}
    short = {shape: ratios for shape, ratios in default_ratios.items() if shape[2] < 2048}

    def over(group: dict, part: str) -> str:
        values = [ratios[part] for ratios in group.values()]
        return spread(min(values), max(values)) if values else ""

    return found, {"device": first["device"], "date": date,
                   **{f"long_{part}": over(long, part) for part in parts},
                   **{f"short_{part}": over(short, part) for part in parts}}


HOPPER_FROM_LENGTH = 16384
"""From this length the kernels' time, not their launches, sets the forward + backward latency."""


def _hopper_sweep(res) -> dict[str, Any] | None:
    """The latest bf16 run of ours against SDPA's cuDNN and FA2 backends at d 64 and 128 (one run, one device):
    ours over each at the long lengths."""
    def latest_run(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rows = [r for r in rows if r.get("dtype") == "bf16" and r.get("d_head") in (64, 128)
                and r.get("provider") in ("ours", "sdpa_cudnn", "sdpa_flash")]
        runs = {r["run"] for r in rows if r["provider"] == "ours" and r.get("run")}
        return [r for r in rows if r.get("run") == max(runs)] if runs else []

    rows = res.rows("flash_benchmarking", one_device=False, keep=latest_run)
    index = {(r["provider"], r["seq_len"], r["d_head"]): r for r in rows}
    points = sorted({(r["seq_len"], r["d_head"]) for r in rows if r["provider"] == "ours" and r.get("fwd_bwd_ms")})
    vs = {"sdpa_cudnn": [], "sdpa_flash": []}
    for length, d in points:
        if length < HOPPER_FROM_LENGTH:
            continue
        ours = fwd_bwd(index, ("ours", length, d))
        for other in vs:
            theirs = fwd_bwd(index, (other, length, d))
            if ours and theirs:
                vs[other].append(ours / theirs)
    if not vs["sdpa_cudnn"]:
        return None
    return {"device": rows[0].get("device", ""), "from_length": f"{HOPPER_FROM_LENGTH:,}",
            "n_points": str(len(vs["sdpa_cudnn"])),
            "vs_cudnn": spread(min(vs["sdpa_cudnn"]), max(vs["sdpa_cudnn"])),
            "vs_fa2": spread(min(vs["sdpa_flash"]), max(vs["sdpa_flash"])) if vs["sdpa_flash"] else DASH,
            "faster_than_cudnn": str(sum(r < 1 for r in vs["sdpa_cudnn"])),
            "fa2_all": bool(vs["sdpa_flash"]) and max(vs["sdpa_flash"]) < 1}


# -----------------------------------------------------------------------------------------------
# leaderboard
# -----------------------------------------------------------------------------------------------

LEADERBOARD_LABELS = {"ours": "ours (FlashAttention-2 operator)", "sdpa_cudnn": "SDPA, cuDNN backend",
                      "sdpa_flash": "SDPA, FlashAttention backend", "sdpa_efficient": "SDPA, memory-efficient backend"}


def load_leaderboard(res) -> list[dict[str, Any]]:
    return res.rows("leaderboard")


@problem("leaderboard")
def leaderboard(res, out: Output) -> dict[str, Any]:
    rows = [row for row in load_leaderboard(res) if not row.get("oom")]
    ours = next((row for row in rows if row["provider"] == "ours"), None)
    if ours is None:
        raise Missing("writeup/results/leaderboard.jsonl", "no row with provider 'ours'")
    rows.sort(key=lambda row: row["fwd_bwd_ms"])
    # A backend's latest row may come from another run than ours': it is marked, and only rows of ours' run are
    # compared (in the text and the ratio column).
    earlier = {r["provider"]: row_date(r) for r in rows if r.get("run") != ours.get("run")}
    # A † row's ratio to ours would divide rows of two runs: it is left out.
    body = [[LEADERBOARD_LABELS.get(r["provider"], r["provider"]) + (" †" if r["provider"] in earlier else ""),
             num(r["fwd_bwd_ms"], 3), percentile_range(r), num(r.get("fwd_ms"), 3),
             DASH if r["provider"] in earlier else times(r["fwd_bwd_ms"] / ours["fwd_bwd_ms"])]
            for r in rows]
    caption = ("Leaderboard shape: batch x heads = 16, length 16,384, head dim 64, bf16, causal; "
               "torch.compile(apply), o.sum().backward(), timed by triton.testing.do_bench")
    if earlier:
        caption += (f"; ours and the unmarked backends in one run ({row_date(ours)}), † in another run of the "
                    f"same protocol ({', '.join(sorted(set(earlier.values())))}), not divided by ours (–).")
    else:
        caption += " in one run."
    caption += (" Forward + backward: the mean over do_bench's calls and, beside it, the 20th to 80th percentile of "
                "the calls.")
    tab = table(["implementation", "forward + backward (ms)", "20th–80th percentile (ms)", "forward (ms)",
                 "time ÷ ours"], body, caption)
    others = [r for r in rows if r["provider"] != "ours" and r["provider"] not in earlier]
    best = min(others, key=lambda r: r["fwd_bwd_ms"]) if others else None
    return {"tables": {"main": tab}, "n": {
        "ours": num(ours["fwd_bwd_ms"], 2), "ours_fwd": num(ours.get("fwd_ms"), 2),
        "best": LEADERBOARD_LABELS.get(best["provider"], best["provider"]) if best else DASH,
        "best_ms": num(best and best["fwd_bwd_ms"], 2),
        "ratio": times(best["fwd_bwd_ms"] / ours["fwd_bwd_ms"]) if best else DASH,
        "difference": pct(abs(best["fwd_bwd_ms"] / ours["fwd_bwd_ms"] - 1), 1) if best else DASH,
        "faster": bool(best and ours["fwd_bwd_ms"] < best["fwd_bwd_ms"]),
        "tie": bool(best and timings_overlap(ours, best)),
        "ours_range": percentile_range(ours), "best_range": percentile_range(best) if best else DASH,
    }}


def percentile_range(row: dict[str, Any]) -> str:
    """The forward + backward timing's 20th to 80th percentile over do_bench's calls, or a dash without them."""
    lo, hi = row.get("fwd_bwd_p20_ms"), row.get("fwd_bwd_p80_ms")
    return f"{num(lo, 3)} to {num(hi, 3)}" if lo is not None and hi is not None else DASH


def timings_overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """A tie: the two forward + backward timings' 20th to 80th percentile ranges overlap (the difference of their
    means lies within the call-to-call spread); False without the percentiles."""
    ranges = [(r.get("fwd_bwd_p20_ms"), r.get("fwd_bwd_p80_ms")) for r in (a, b)]
    if any(lo is None or hi is None for lo, hi in ranges):
        return False
    (a_lo, a_hi), (b_lo, b_hi) = ranges
    return a_lo <= b_hi and b_lo <= a_hi
