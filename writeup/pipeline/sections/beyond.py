"""Sections beyond the assignment that are not about sharding: the fused RMSNorm and the
FlashAttention optimisation log."""

from __future__ import annotations

import json
import re
import statistics
from typing import Any

from cs336_systems.bench import flash_log
from cs336_systems.bench import rmsnorm as rmsnorm_bench
from pipeline import figures
from pipeline.markup import DASH, num, pct, span, spread, table, times
from pipeline.results import Missing, display_path, main_device, read_jsonl, row_date
from pipeline.sections.registry import Output, problem

PROVIDER_ORDER = ("ours", "eager", "compile", "liger", "quack")
PASS_NAMES = {"fwd": "forward", "fwd_bwd": "forward + backward"}


FORWARD_GRID_FILE = "h100-rmsnorm-forward-grid/tuned_grid_1ee9e87.jsonl"  # scripts/rmsnorm_forward_grid.py


def newest_graph_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The kernel rows timed on CUDA-graph replays: per dtype, its newest run (``rmsnorm_bench.newest_kernel_run``);
    without any, the newest ``do_bench`` run."""
    kernel = [r for dtype in rmsnorm_bench.DTYPES for r in rmsnorm_bench.newest_kernel_run(
        [r for r in rows if r.get("dtype") == dtype], timer="graph")]
    return kernel or rmsnorm_bench.newest_kernel_run(rows)


def load_rmsnorm(res) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The kernel rows of :func:`newest_graph_runs` (rows that record ``copy_share``; earlier runs are left out) and
    the model rows (``part == "model"``: a train step of one model size with ``norm`` plain or fused), the latest
    per configuration on their main device."""

    def keep(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        model = [r for r in rows if r.get("part") == "model"]
        if model:
            device = main_device(model)
            model = [r for r in model if r.get("device") == device]
        return newest_graph_runs(rows) + model

    rows = res.rows("rmsnorm", one_device=False, keep=keep)
    return [r for r in rows if r.get("part") == "kernel"], [r for r in rows if r.get("part") == "model"]


def _model_text(model: list[dict[str, Any]]) -> str:
    measured = [r for r in model if not r.get("oom")]
    norms = sorted({r.get("norm", "") for r in measured})
    if len(norms) >= 2:
        return "; ".join(f"{r.get('norm')}: {num(r.get('mean_ms'), 1)} ms" for r in measured)
    if measured:
        r = measured[0]
        return (f"the benchmark's model part has a row of the {r.get('norm', 'plain')} RMSNorm only "
                f"({r.get('size')} model, {r.get('dtype')}, context {r.get('context_length')}, "
                f"{r.get('mode', 'train step').replace('_', ' ')}: {num(r.get('mean_ms'), 1)} ms); the fused "
                "residual add is compared in the training step below")
    return "the model-level comparison was not measured"


def _grid_table(at: dict[tuple, dict[str, Any]], providers: list[str], cols: list[int], dtype: str,
                m: int) -> dict[str, Any]:
    """GB/s and share of copy per provider, one line per (pass, N), at ``m`` rows in ``dtype``."""
    body = []
    for pass_ in rmsnorm_bench.PASSES:
        for n_cols in cols:
            copy = at.get(("copy", "copy", n_cols, dtype), {})
            cells = [PASS_NAMES[pass_], f"{n_cols:,}", num(copy.get("gbps"), 0)]
            for provider in providers:
                row = at.get((provider, pass_, n_cols, dtype))
                cells.append(f"{num(row['gbps'], 0)} ({pct(row.get('copy_share'))})" if row else DASH)
            body.append(cells)
    return table(["pass", "N", "copy", *providers], body,
                 f"RMSNorm kernels at M = {m:,} rows of N, {dtype}: effective bandwidth in GB/s (bytes an ideal "
                 "implementation reads and writes over the median time) and, in brackets, its share of the copy "
                 "bandwidth of the same shape measured in the same run (copy: x.clone(); where a kernel moved "
                 "more bytes a second than the copy, the share is of that kernel's bandwidth).",
                 align=["left", "right", "right", *["right"] * len(providers)], size=7)


def _grid_figure(out: Output, at: dict[tuple, dict[str, Any]], providers: list[str], cols: list[int],
                 dtypes: list[str], m: int) -> dict[str, str]:
    """GB/s against N per provider, one panel per (dtype, pass), the copy bandwidth dashed."""
    panels = [(dtype, pass_) for dtype in dtypes for pass_ in rmsnorm_bench.PASSES]
    fig, axes = figures.new(6.5, 2.3 * len(dtypes), ncols=2, nrows=len(dtypes), sharey=True)
    for ax, (dtype, pass_) in zip(axes, panels):
        for provider in providers:
            points = [(c, at[(provider, pass_, c, dtype)]["gbps"]) for c in cols if (provider, pass_, c, dtype) in at]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=provider)
        copy = [(c, at[("copy", "copy", c, dtype)]["gbps"]) for c in cols if ("copy", "copy", c, dtype) in at]
        if copy:
            ax.plot(*zip(*copy), linestyle="--", color="black", linewidth=1, label="copy")
        figures.log2_axis(ax, cols)
        ax.tick_params(axis="x", labelsize=6)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{dtype}, {PASS_NAMES[pass_]}", fontsize=8)
        ax.set_xlabel("N")
    for ax in axes[::2]:
        ax.set_ylabel("GB/s")
    figures.legend_below(fig, axes[0], ncol=len(providers) + 1)
    return out.save(fig, "rmsnorm_grid", f"RMSNorm kernels at M = {m:,} rows: effective bandwidth against the hidden "
                    "size N per provider; dashed: the copy bandwidth of the same tensor.")


def _ratio_text(at: dict[tuple, dict[str, Any]], providers: list[str], cols: list[int], dtype: str, pass_: str) -> str:
    """Ours over each other provider in GB/s across N, as ``"0.9× to 1.2× the bandwidth of compile; ..."``."""
    parts = []
    for provider in providers:
        ratios = [at[("ours", pass_, c, dtype)]["gbps"] / at[(provider, pass_, c, dtype)]["gbps"] for c in cols
                  if ("ours", pass_, c, dtype) in at and (provider, pass_, c, dtype) in at]
        if provider != "ours" and ratios:
            parts.append(f"{spread(min(ratios), max(ratios))} the bandwidth of {provider}")
    return "; ".join(parts) or DASH


LARGE_SHAPE = 1 << 24  # elements (M × N) from which ours is set against the fastest other kernel
LARGEST_SHAPES = 1 << 26  # elements from which its share of the copy bandwidth is quoted
RIVALS = ("compile", "liger", "quack")
CLOSE = 0.05  # a shortfall within 5 % is counted, a larger one named
STEADY = 0.05  # a time whose 20th to 80th percentile spans at most 5 % of its median


def _against_rivals(grid: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape of at least ``LARGE_SHAPE`` elements, dtype and pass: ours over the fastest of the rival kernels
    measured there (``ratio``, from GB/s) and which one that was; ``grid`` is keyed (provider, pass, M, N, dtype)."""
    cases = []
    for (provider, pass_, m, n_cols, dtype), row in grid.items():
        rivals = [(grid[(p, pass_, m, n_cols, dtype)]["gbps"], p) for p in RIVALS
                  if (p, pass_, m, n_cols, dtype) in grid]
        if provider == "ours" and m * n_cols >= LARGE_SHAPE and rivals:
            best, rival = max(rivals)
            cases.append({"dtype": dtype, "pass": pass_, "m": m, "n": n_cols, "ratio": row["gbps"] / best,
                          "rival": rival, "unsteady": _unsteady(row)})
    return sorted(cases, key=lambda c: (c["dtype"], rmsnorm_bench.PASSES.index(c["pass"]), c["m"], c["n"]))


def _against_table(cases: list[dict[str, Any]], cols: list[int], rivals: str) -> dict[str, Any]:
    """One line per (dtype, pass, M), one column per N: ours over the fastest rival."""
    lines: dict[tuple[str, str, int], dict[int, float]] = {}
    for c in cases:
        lines.setdefault((c["dtype"], c["pass"], c["m"]), {})[c["n"]] = c["ratio"]
    body = [[dtype, PASS_NAMES[pass_], f"{m:,}", *[num(ratios.get(n), 2) if n in ratios else DASH for n in cols]]
            for (dtype, pass_, m), ratios in lines.items()]
    return table(["dtype", "pass", "M", *[f"N = {n:,}" for n in cols]], body,
                 f"Ours over the faster of {rivals} at each shape of at least {LARGE_SHAPE / 2**20:g}M elements "
                 "(M × N; smaller shapes: –): ratio of effective bandwidths, above 1 where ours is faster.",
                 align=["left", "left", "right", *["right"] * len(cols)], size=7)


def _against_text(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per dtype and pass (``items``): at how many shapes ours is at least as fast as the fastest rival, at how
    many within ``CLOSE`` of it, and the shapes where it is further behind with its ratio; and how many of those
    larger shortfalls are at shapes where our time is unsteady."""
    items = []
    for dtype in sorted({c["dtype"] for c in cases}):
        for pass_ in rmsnorm_bench.PASSES:
            these = [c for c in cases if (c["dtype"], c["pass"]) == (dtype, pass_)]
            if not these:
                continue
            close = sum(1 - CLOSE <= c["ratio"] < 1 for c in these)
            far = [f"{c['m']:,} × {c['n']:,} ({num(c['ratio'], 2)})" for c in these if c["ratio"] < 1 - CLOSE]
            text = (f"{dtype} {PASS_NAMES[pass_]}: at least as fast at {sum(c['ratio'] >= 1 for c in these)} of "
                    f"{len(these)} shapes" + (f", within {pct(CLOSE)} at {close}" if close else ""))
            items.append(text + (f", further behind at {', '.join(far)}" if far else "") + ".")
    far = [c for c in cases if c["ratio"] < 1 - CLOSE]
    return {"items": items, "far": len(far), "far_unsteady": sum(c["unsteady"] for c in far)}


def _copy_share_text(grid: dict[tuple, dict[str, Any]], dtypes: list[str]) -> list[str]:
    """Ours' share of the copy bandwidth at the shapes of at least ``LARGEST_SHAPES`` elements, one item per dtype
    and pass; where the lowest shares are all at shapes whose time is unsteady, those are quoted apart."""
    items = []
    for dtype in dtypes:
        for pass_ in rmsnorm_bench.PASSES:
            rows = [r for (p, q, m, n_cols, d), r in grid.items()
                    if (p, q, d) == ("ours", pass_, dtype) and m * n_cols >= LARGEST_SHAPES and r.get("copy_share")]
            if not rows:
                continue
            unsteady = sorted((r for r in rows if _unsteady(r)), key=lambda r: (r["rows"], r["cols"]))
            steady = [r for r in rows if not _unsteady(r)]
            apart = (unsteady and steady
                     and max(r["copy_share"] for r in unsteady) < min(r["copy_share"] for r in steady))
            text = f"{dtype} {PASS_NAMES[pass_]}: {_share_range(steady if apart else rows)}"
            if apart:
                spans = [_time_span(r) for r in unsteady]
                text += (f" at {len(steady)} of {len(rows)} shapes, {_share_range(unsteady)} at the other "
                         f"{len(unsteady)} (" + ", ".join(f"{r['rows']:,} × {r['cols']:,}" for r in unsteady) +
                         f"), where our time is unsteady ({spread(min(spans), max(spans), pct)} of the median)")
            items.append(text + ".")
    return items


def _rival_share(grid: dict[tuple, dict[str, Any]], pass_: str) -> dict[str, str]:
    """The share of the copy bandwidth of the faster rival at each shape of at least ``LARGEST_SHAPES`` elements:
    its range and median over shapes and dtypes."""
    shares = []
    for p, q, m, n_cols, d in grid:
        rivals = [grid[(rival, q, m, n_cols, d)].get("copy_share") for rival in RIVALS
                  if (rival, q, m, n_cols, d) in grid]
        if (p, q) == ("ours", pass_) and m * n_cols >= LARGEST_SHAPES and rivals and None not in rivals:
            shares.append(max(rivals))
    if not shares:
        return {"range": DASH, "median": DASH}
    return {"range": spread(min(shares), max(shares), pct), "median": pct(statistics.median(shares))}


def with_copy_reference(grid: dict[tuple, dict[str, Any]]) -> tuple[dict[tuple, dict[str, Any]], list[str]]:
    """``grid`` (keyed (provider, pass, M, N, dtype)) with every ``copy_share`` against the larger of the copy's
    bandwidth and the fastest kernel's at the same shape, and the shapes where a kernel outran the copy by more
    than ``CLOSE``, each with both bandwidths."""
    best: dict[tuple, float] = {}
    for (_, _, m, n_cols, dtype), row in grid.items():
        best[(m, n_cols, dtype)] = max(best.get((m, n_cols, dtype), 0.0), row["gbps"])
    low, result = [], {}
    for key, row in grid.items():
        shape = key[2:]
        copy = grid.get(("copy", "copy", *shape), {}).get("gbps")
        reference = max(copy or 0.0, best[shape]) if copy else None
        result[key] = {**row, "copy_share": row["gbps"] / reference if reference else None}
        if key[0] == "copy" and copy and best[shape] > (1 + CLOSE) * copy:
            low.append(f"{shape[0]:,} × {shape[1]:,} {shape[2]} ({num(copy, 0)} against {num(best[shape], 0)} GB/s)")
    return result, low


def forward_grid(res) -> dict[str, Any]:
    """Our forward at each grid size of ``FWD_GRIDS`` and autotuned over them, beside Liger, at the large shapes
    (``scripts/rmsnorm_forward_grid.py``'s lines in ``FORWARD_GRID_FILE``): a table and the tuned-over-Liger
    range per dtype."""
    try:
        lines = read_jsonl(res.path(FORWARD_GRID_FILE))
    except Missing:
        return {"table": None, "n": {"has_grid": False}}
    by_shape: dict[tuple, dict[str, float]] = {}
    run_of: dict[tuple, dict[str, Any]] = {}  # the call that wrote each line (a line without a run: the file's call)
    for r in lines:
        name = r["provider"] if r["provider"] != "ours" else f"ours {r['programs_per_sm']}"
        by_shape.setdefault((r["dtype"], r["rows"], r["cols"]), {})[name] = r["gbps"]
        run_of.setdefault((r["dtype"], r["rows"], r["cols"]), {})[name] = r.get("run")
    calls = len({r.get("run") for r in lines})
    grids = {"ours 4": "4 per SM", "ours 16": "16 per SM", "ours 0": "one per tile", "ours None": "tuned"}
    body, ratios = [], {}
    for (dtype, m, n_cols), got in sorted(by_shape.items()):
        ratio = got["ours None"] / got["liger"]
        ratios.setdefault(dtype, []).append(ratio)
        body.append([dtype, f"{m:,} × {n_cols:,}", *[num(got.get(g), 0) for g in grids], num(got["liger"], 0),
                     num(ratio, 3)])
    header = ["dtype", "M × N", *[f"ours, {g}" for g in grids.values()], "Liger", "tuned / Liger"]
    caption = (f"Our RMSNorm forward by grid size (programs per SM; tuned: the autotuner's pick among them) and "
               f"Liger's, GB/s on CUDA-graph replays, {'one call' if calls == 1 else f'{calls} calls'} on "
               f"{lines[0]['device']} (scripts/rmsnorm_forward_grid.py).")
    return {"table": table(header, body, caption, align=["left", "right", *["right"] * 6], size=7),
            "n": {"has_grid": True, "ratios": "; ".join(f"{d}: {spread(min(v), max(v))}" for d, v in ratios.items()),
                  "wins": sum(r >= 1 for v in ratios.values() for r in v),
                  "shapes": sum(len(v) for v in ratios.values()),
                  "before": spread(min(by["ours 4"] / by["liger"] for by in by_shape.values()),
                                   max(by["ours 4"] / by["liger"] for by in by_shape.values())),
                  "calls": str(calls) if calls > 1 else "one",
                  "before_same_call": all(run["ours 4"] == run["liger"] for run in run_of.values())}}


def _time_span(row: dict[str, Any]) -> float:
    """The 20th to 80th percentile of a kernel's time over its median (0 where the row has no percentiles)."""
    return (row["ms_p80"] - row["ms_p20"]) / row["ms"] if "ms_p20" in row and "ms_p80" in row else 0.0


def _unsteady(row: dict[str, Any]) -> bool:
    return _time_span(row) > STEADY


def _share_range(rows: list[dict[str, Any]]) -> str:
    return spread(min(r["copy_share"] for r in rows), max(r["copy_share"] for r in rows), pct)


@problem("rmsnorm")
def rmsnorm(res, out: Output) -> dict[str, Any]:
    kernel, model = load_rmsnorm(res)
    n: dict[str, Any] = {"model": _model_text(model), "pending": not kernel,
                         "grid": (f"M in {{{', '.join(f'{m:,}' for m in rmsnorm_bench.ROWS)}}} rows × N in "
                                  f"{{{', '.join(f'{c:,}' for c in rmsnorm_bench.COLS)}}}"),
                         "all_providers": ", ".join(rmsnorm_bench.PROVIDERS)}
    residual, forward = residual_norm(res), forward_grid(res)
    n["residual"], n["forward"] = residual["n"], forward["n"]
    tables = {"residual": residual["table"]} if residual["table"] else {}
    if forward["table"]:
        tables["forward"] = forward["table"]
    if not kernel:
        return {"tables": tables, "figures": {}, "n": n}
    measured = [r for r in kernel if not r.get("oom") and r.get("gbps")]
    grid, copy_low = with_copy_reference(
        {(r["provider"], r["pass"], r["rows"], r["cols"], r["dtype"]): r for r in measured})
    measured = list(grid.values())
    m = max(r["rows"] for r in measured)
    at = {(p, q, c, d): r for (p, q, rows, c, d), r in grid.items() if rows == m}
    present = {r["provider"] for r in measured} - {"copy"}
    providers = [p for p in PROVIDER_ORDER if p in present] + sorted(present - set(PROVIDER_ORDER))
    cols = sorted({r["cols"] for r in measured})
    dtypes = sorted({r["dtype"] for r in measured})
    dtype = "bf16" if "bf16" in dtypes else dtypes[0]
    cases = _against_rivals(grid)
    rivals = " and ".join(p for p in RIVALS if p in present)
    n.update({"m": f"{m:,}", "dtype": dtype, "dtypes": ", ".join(dtypes), "providers": ", ".join(providers),
              "run": ", ".join(sorted({r["run"] for r in kernel})), "graph": all(
                  rmsnorm_bench.case_timer(r) == "graph" for r in kernel), "copy_low": "; ".join(copy_low),
              "has_ours": "ours" in present, "has_rivals": bool(cases), "rivals": rivals,
              "large": f"{LARGE_SHAPE / 2**20:g}M", "largest": f"{LARGEST_SHAPES / 2**20:g}M",
              "close": pct(CLOSE), "steady": pct(STEADY),
              "at_least": sum(c["ratio"] >= 1 for c in cases), "cases": len(cases),
              "against": _against_text(cases), "copy_share": _copy_share_text(grid, dtypes),
              "rival_share_fwd": _rival_share(grid, "fwd"),
              "not_measured": ", ".join(p for p in rmsnorm_bench.PROVIDERS if p not in present)})
    for pass_ in rmsnorm_bench.PASSES:
        n[f"versus_eager_{pass_}"] = _ratio_text(at, ["eager"], cols, dtype, pass_)
    tables["main"] = _grid_table(at, providers, cols, dtype, m)
    if cases:
        tables["against"] = _against_table(cases, cols, rivals)
    return {"tables": tables, "figures": {"main": _grid_figure(out, at, providers, cols, dtypes, m)}, "n": n}


RESIDUAL_PASSES = {"forward": "fwd", "forward_backward": "fwd_bwd"}  # the script's pass names, the grid's


def residual_norm(res) -> dict[str, Any]:
    """The residual add fused into the RMSNorm: the kernel against an add then our RMSNorm
    (``residual_norm_timing.jsonl``, latest row per configuration on its main device), and every launch of the
    training step with ``residual_norm`` separate and fused (``train_step.jsonl``)."""
    try:
        kernel = res.rows("residual_norm_timing")
    except Missing:
        return {"table": None, "n": {"has_kernel": False, "has_step": False}}
    n = {"has_kernel": True, **_residual_kernel_numbers(kernel), **_residual_step_numbers(res)}
    return {"table": _residual_table(kernel), "n": n}


def _residual_cases(kernel: list[dict[str, Any]]) -> dict[tuple[int, int, str], dict[str, dict[str, Any]]]:
    """Rows by (M, N, stream dtype) then by pass, the shapes in order of their elements."""
    cases: dict[tuple[int, int, str], dict[str, dict[str, Any]]] = {}
    for r in sorted(kernel, key=lambda r: (r["n_rows"] * r["d_model"], r["stream_dtype"] != "bf16")):
        cases.setdefault((r["n_rows"], r["d_model"], r["stream_dtype"]), {})[r["pass"]] = r
    return cases


def _residual_table(kernel: list[dict[str, Any]]) -> dict[str, Any]:
    body = []
    for (m, n_cols, stream), by_pass in _residual_cases(kernel).items():
        cells = [f"{m:,} × {n_cols:,}", stream]
        for pass_ in RESIDUAL_PASSES:
            r = by_pass.get(pass_)
            cells += ([num(r["fused_ms"], 3), num(r["separate_ms"], 3), num(r["fused_over_separate"], 2)] if r
                      else [DASH] * 3)
        body.append(cells)
    branch = sorted({r["branch_dtype"] for r in kernel})
    header = [["shape", "stream", span("forward", 3), span("forward + backward", 3)],
              ["M × N", "", *["fused (ms)", "separate (ms)", "fused / separate"] * 2]]
    return table(header, body,
                 f"The residual add fused into our RMSNorm (one kernel writes s = x + r and the norm of s) against "
                 f"the add followed by our RMSNorm: median times (do_bench); the branch x is {', '.join(branch)}, "
                 "the stream r bf16 or float32 (the sum takes the stream's dtype), the norm is written in the "
                 "branch's dtype; the backward takes gradients arriving at both s and the norm.",
                 align=["left", "left", *["right"] * 6], size=7)


def _residual_kernel_numbers(kernel: list[dict[str, Any]]) -> dict[str, Any]:
    """Fused over separate: its range at the shapes of at least ``LARGEST_SHAPES`` elements (and the saving it
    means), every case of the smaller shapes, and the (shape, stream) of those where fused is slower."""
    large = [r["fused_over_separate"] for r in kernel if r["n_rows"] * r["d_model"] >= LARGEST_SHAPES]
    small = {key: by_pass for key, by_pass in _residual_cases(kernel).items() if key[0] * key[1] < LARGEST_SHAPES}
    text: dict[tuple[int, int], list[str]] = {}
    for (m, n_cols, stream), by_pass in small.items():
        text.setdefault((m, n_cols), []).append(f"{stream} stream " + ", ".join(
            f"{PASS_NAMES[RESIDUAL_PASSES[q]]} {num(r['fused_over_separate'], 2)}" for q, r in by_pass.items()))
    slower = [f"{m:,} × {n_cols:,} with the {stream} stream" for (m, n_cols, stream), by_pass in small.items()
              if any(r["fused_over_separate"] > 1 for r in by_pass.values())]
    return {"large_ratio": spread(min(large), max(large), lambda x: num(x, 2)) if large else DASH,
            "large_saving": spread(1 - max(large), 1 - min(large), pct) if large else DASH,
            "small": "; ".join(f"at {m:,} × {n_cols:,}, {'; '.join(t)}" for (m, n_cols), t in text.items()),
            "small_slower": ", ".join(slower)}


def _residual_step_numbers(res) -> dict[str, Any]:
    """The training step with ``residual_norm`` separate and fused, per configuration measured (launches
    alternating): each choice's median step per launch and its step-to-step standard deviation, and a verdict. A
    difference of the medians is a measured one only beyond the noise: the spread of one choice's launches (largest
    over smallest), or, with one launch a choice, the step-to-step standard deviation over the median."""
    try:
        rows = [r for r in res.log_rows("train_step", measured=lambda row: False)
                if "residual_norm" in r and not r.get("oom")]
    except Missing:
        rows = []
    configs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        config = json.dumps({k: r.get(k) for k in r["config_keys"] if k != "residual_norm"}, sort_keys=True)
        configs.setdefault((r["device"], config), []).append(r)
    steps = []
    for (_, config), config_rows in configs.items():
        by_choice = {c: [r for r in config_rows if r["residual_norm"] == c] for c in ("separate", "fused")}
        if not all(by_choice.values()):
            continue
        res.used.extend(config_rows)
        c = json.loads(config)
        graphs = "with" if config_rows[-1].get("parts", {}).get("cudagraphs") else "without"
        item: dict[str, Any] = {"setup": (
            f"{c.get('size')} model, context {c.get('context_length')}, batch {c.get('batch_size')}, {c.get('dtype')}, "
            f"{'our' if c.get('stack') == 'ours' else 'the ' + str(c.get('stack'))} stack {graphs} CUDA graphs")}
        medians = {choice: [r["median_ms"] for r in launches] for choice, launches in by_choice.items()}
        for choice, launches in by_choice.items():
            item[choice] = ", ".join(num(t, 1) for t in medians[choice])
            item[f"{choice}_std"] = ", ".join(num(r["std_ms"], 1) for r in launches)
        # A choice's noise: its launches' spread, or with one launch its step-to-step deviation over the median.
        noise = max(max(m) / min(m) - 1 if len(m) > 1 else by_choice[choice][0]["std_ms"] / m[0]
                    for choice, m in medians.items())
        several_launches = {len(m) > 1 for m in medians.values()}
        item["noise_from"] = ("launches" if several_launches == {True} else
                              "steps" if several_launches == {False} else "launches_and_steps")
        how = {"launches": "the spread of one choice's launches",
               "steps": "the step-to-step standard deviation over the median (one launch of a choice)",
               "launches_and_steps": "the larger of one choice's launch spread and the other's step-to-step "
                                     "deviation over the median"}[item["noise_from"]]
        change = statistics.median(medians["fused"]) / statistics.median(medians["separate"]) - 1
        # fused against separate: "win" where fused is faster beyond the noise, "tie" within it
        item["outcome"] = "tie" if abs(change) <= noise else ("win" if change < 0 else "loss")
        item["change"] = f"{pct(abs(change), 1)} {'slower' if change > 0 else 'faster'}"
        item["noise"] = f"{pct(noise, 1)}, {how}"
        item["verdict"] = {"tie": "within the noise: no measurable difference", "win": "a saving",
                           "loss": "a loss"}[item["outcome"]]
        steps.append(item)
    return {"has_step": bool(steps), "steps": steps}


def load_optimisation_log(res) -> tuple[list[dict[str, Any]], list[tuple[str, str]], list[dict[str, Any]]]:
    """The log rows of ``flash_optimisation_log.jsonl`` (``cs336_systems.bench.flash_log``: measured steps and
    ``--set-decision`` rows, every row in file order), and the earlier history: the probe outputs
    (``flash_probe/*.txt``, plain text of ``scripts/flash_probe.py``, one per step) with the leaderboard run that
    closed it (the last before the log's first step).
    Either part may be absent, not both (``Missing`` then names the log)."""
    rows = (res.log_rows(flash_log.PROBLEM, measured=lambda row: "leaderboard" in row)
            if res.path(f"{flash_log.PROBLEM}.jsonl").exists() else [])
    if rows and not any("leaderboard" in row for row in rows):
        raise Missing(display_path(res.path(f"{flash_log.PROBLEM}.jsonl")), "no measured step, only decisions")
    probes = sorted(res.path("flash_probe").glob("*.txt")) if res.path("flash_probe").is_dir() else []
    if not rows and not probes:
        res.rows(flash_log.PROBLEM)  # raises Missing naming the file
    texts = [(p.stem, res.text(f"flash_probe/{p.name}")) for p in probes]
    board = res.log_rows("leaderboard", measured=lambda row: False) if probes else []
    if rows:  # the history ends where the log starts: its leaderboard is the last run before the first logged step
        board = [r for r in board if r.get("run", "") < rows[0].get("run", "")]
    latest = max((r.get("run", "") for r in board), default=None)
    board = [r for r in board if r.get("run") == latest]
    res.used.extend(board)
    return rows, texts, board


PROVIDER_NAMES = {"sdpa_cudnn": "SDPA's cuDNN backend", "sdpa_flash": "its FlashAttention-2 backend",
                  "sdpa_efficient": "its memory-efficient backend"}


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
    # This run measured the kernels of its day, not today's: say which (the leaderboard section has today's).
    hopper = any("hopper" in k for k in (ours or {}).get("our_kernels", []))
    final = (f"The leaderboard run that closed this history ({row_date(ours)}, "
             + ("with the Hopper kernels of that day" if hopper else
                "with the portable Triton kernels only, before the Hopper kernels")
             + f"; H = {ours.get('heads')}, N = {ours.get('seq_len')}, d = {ours.get('d_head')}, "
             f"{ours.get('dtype')}, causal) measured ours at {num(ours.get('fwd_bwd_ms'), 2)} ms forward + backward "
             f"({'verified against SDPA' if ours.get('verified') else 'not verified'}, "
             f"{ours.get('graph_breaks_after_first_call', ours.get('graph_breaks'))} graph breaks after the first call), "
             "against " + ", ".join(f"{PROVIDER_NAMES.get(r['provider'], r['provider'])} {num(r['fwd_bwd_ms'], 2)} ms"
                                    for r in others)
             + "; the leaderboard section's time is that of the present kernels."
             ) if ours else "The leaderboard was not run."
    last = steps[-1] if steps else {}
    summary = (f"{len(steps)} probe steps were recorded as the plain text of scripts/flash_probe.py "
               "(writeup/results/flash_probe/): "
               "each times our kernel and the previous version (baseline) against SDPA's cuDNN and FlashAttention-2 "
               "backends on several shapes, the host overhead of one small "
               "call and, in the first steps, a profile of the host side. "
               + (f"After the last step, ours takes {num(last['ours'], 3)} ms on the leaderboard shape against "
                  f"{num(last['baseline'], 3)} ms for the baseline. " if last.get("ours") else "") + final)
    return {"tables": {"main": tab},
            "n": {"summary": summary, "steps": str(len(steps)),
                  "device": ((ours.get("env") or {}).get("gpu_name") or ours.get("device")) if ours else None}}


# Folders of raw results renamed after the log's notes were written: the name the rows' notes use -> the name that
# says what the folder holds (the only place the old names appear, so that the notes point to existing folders).
RENAMED_FOLDERS = {"h100-issue28/": "h100-hopper-backward/", "h100-issue26/": "h100-train-step-profile/"}
# References to the project's task tracker, which the reader does not have, left out: "(<ref>, x)" -> "(x)",
# "after <ref>'s change" -> "after the change", " (<ref>)" -> "".
_TRACKER_REFERENCES = [(re.compile(r"\(issue \d+, ", re.IGNORECASE), "("),
                       (re.compile(r"\bissue \d+'s ", re.IGNORECASE), "the "),
                       (re.compile(r" ?\(issue \d+\)", re.IGNORECASE), ""),
                       (re.compile(r",? ?\bissue \d+\b", re.IGNORECASE), "")]


# Words of the working log that the reader does not have (a stretch of work, a throwaway benchmark script), put as
# what they measured: the pattern -> the reader's words.
_WORKING_WORDS = [(re.compile(r"\bThe final state of this session: (\w)"), lambda m: m.group(1).upper()),
                  (re.compile(r"scratch bench same session"), "a separate benchmark on the same machine"),
                  (re.compile(r"\bin a scratch bench\b"), "in a separate benchmark"),
                  (re.compile(r"\bunlike the scratch bench\b"), "unlike that separate benchmark"),
                  (re.compile(r" but lost to the device tool's file limit"), " but its output file was not kept"),
                  (re.compile(r" \(no device time left to take one\)"), "")]


def plain_words(note: str) -> str:
    """A note of the log as the reader needs it: renamed result folders under their current names, references to
    the project's task tracker left out, and the working log's own words put as what they measured."""
    for old, new in RENAMED_FOLDERS.items():
        note = note.replace(old, new)
    for pattern, replacement in _TRACKER_REFERENCES + _WORKING_WORDS:
        note = pattern.sub(replacement, note)
    return note


def step_name(step: str) -> str:
    """A log step's name without the working log's numbering of stretches of work (``session6-triton-baseline``
    -> ``triton-baseline``)."""
    return re.sub(r"^session\d+-", "", step)


def _point_name(point: tuple[int, int]) -> str:
    return f"{point[0]}×{point[1]}"


def short_gpu(name: str) -> str:
    """``'NVIDIA H100 80GB HBM3'`` -> ``'H100'``."""
    return (name.removeprefix("NVIDIA ").split() or [name])[0]


def _log_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The log (``flash_log``'s rows): one table line per measured step in file order with its latest decision
    (``flash_log.latest_decisions``: a ``--set-decision`` row overrides), the hypothesis and notes of each step,
    and the first and last step compared."""
    rows = [dict(r, step=step_name(r["step"])) for r in rows]
    decisions = flash_log.latest_decisions(rows)
    measured = [r for r in rows if "leaderboard" in r]
    points = list(dict.fromkeys((p["seq_len"], p["d_head"]) for r in measured for p in r["points"]))
    bwd_point = max(points, key=lambda p: (p[1], p[0]), default=None)  # the largest head dim's longest sequence

    def by_point(row: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
        return {(p["seq_len"], p["d_head"]): p for p in row["points"]}

    def gpu(row: dict[str, Any]) -> str:
        return (row.get("env") or {}).get("gpu_name") or row.get("device", "an unknown device")

    gpus = list(dict.fromkeys(map(gpu, measured)))
    several = len(gpus) > 1  # then each line names its GPU, and absolute times compare within one GPU only
    body = []
    for r in measured:
        board, at = r["leaderboard"], by_point(r)
        ours = num(board.get("ours_fwd_bwd_ms"), 2)
        body.append([r["step"], *([short_gpu(gpu(r))] if several else []), decisions.get(r["step"], "pending"),
                     ours if board.get("verified") is not False else f"{ours} (not verified)",
                     num(board.get("sdpa_cudnn_fwd_bwd_ms"), 2), times(board.get("ratio_vs_cudnn")),
                     *[times(at.get(p, {}).get("ratio_vs_cudnn")) for p in points],
                     *([num(at.get(bwd_point, {}).get("ours_bwd_ms"), 2)] if bwd_point else [])])
    header = [["", *([""] if several else []), "", span("leaderboard shape", 3),
               span("ours / cuDNN, N × d", len(points)), *(["ours bwd (ms)"] if bwd_point else [])],
              ["step", *(["GPU"] if several else []), "decision", "ours (ms)", "cuDNN (ms)", "ours/cuDNN", *map(_point_name, points),
               *([_point_name(bwd_point)] if bwd_point else [])]]
    tab = table(header, body,
                "The FlashAttention optimisation log (cs336_systems.bench.flash_log), one line per measured step "
                "in the order measured, with its latest decision: forward + backward on the leaderboard shape "
                "(ours and SDPA cuDNN), ours / cuDNN forward + backward at each point of the sweep (causal, bf16, "
                "sequence length N × head dim d)"
                + (f", and our backward alone at {_point_name(bwd_point)}" if bwd_point else "")
                + (f"; GPU: the one each step ran on ({', '.join(gpus)}; ratios are against cuDNN on the same GPU "
                   "in the same run)."
                   if several else f"; every step on the {gpus[0]}."),
                align=["left", *(["left"] if several else []), "left",
                       *["right"] * (3 + len(points) + bool(bwd_point))], size=7)

    steps: dict[str, dict[str, Any]] = {}
    for r in rows:
        step = steps.setdefault(r["step"], {"step": r["step"], "decision": decisions.get(r["step"], "pending"),
                                            "hypothesis": [], "note": [], "commits": []})
        for key in ("hypothesis", "note"):
            if r.get(key) and r[key] not in step[key]:
                step[key].append(r[key])
        if "leaderboard" in r and r.get("commit"):
            where = r["commit"].partition("+")[0] + (" with uncommitted changes" if r.get("dirty") else "")
            if where not in step["commits"]:
                step["commits"].append(where)
    def sentences(texts: list[str]) -> str:
        return " ".join(t if t.rstrip().endswith((".", "!", "?")) else t.rstrip() + "." for t in map(plain_words, texts))

    listed = [{"step": s["step"], "decision": s["decision"],
               "where": f"measured at {', '.join(s['commits'])}" if s["commits"] else "",
               "hypothesis": sentences(s["hypothesis"]), "note": sentences(s["note"])} for s in steps.values()]

    first, last = measured[0], measured[-1]
    devices = ", ".join(gpus)

    def board_text(row: dict[str, Any], with_ms: bool = True) -> str:
        board = row["leaderboard"]
        return times(board.get("ratio_vs_cudnn")) + (
            f" ({num(board.get('ours_fwd_bwd_ms'), 2)} ms against {num(board.get('sdpa_cudnn_fwd_bwd_ms'), 2)} ms)"
            if with_ms else f" on the {gpu(row)}")

    def bwd_ms(row: dict[str, Any]) -> str:
        return num(by_point(row).get(bwd_point, {}).get("ours_bwd_ms"), 2)

    def on_one_gpu(rows_: list[dict[str, Any]]) -> str:
        """The first and last step of one GPU: ours and cuDNN in ms, and our backward alone."""
        a, b = rows_[0], rows_[-1]
        if a is b:
            return (f"the {gpu(a)} ran one step, {a['step']}: {board_text(a)}"
                    + (f", our backward alone at {_point_name(bwd_point)} {bwd_ms(a)} ms" if bwd_point else ""))
        return (f"on the {gpu(a)}, from {a['step']} to {b['step']} ({len(rows_)} steps), ours / cuDNN went from "
                f"{board_text(a)} to {board_text(b)}"
                + (f" and our backward alone at {_point_name(bwd_point)} from {bwd_ms(a)} ms to {bwd_ms(b)} ms"
                   if bwd_point else ""))

    verified = [r for r in measured if r["leaderboard"].get("verified")]
    checks = ("every step passed the leaderboard's checks (one graph, our kernels, matches SDPA)"
              if len(verified) == len(measured) else
              f"{len(verified)} of {len(measured)} steps passed the leaderboard's checks")
    if len(measured) == 1:
        summary = (f"One step ({first['step']}) was measured on {devices}; {checks}. On the leaderboard shape, ours "
                   f"takes {board_text(first)} the time of SDPA's cuDNN backend.")
    elif not several:
        summary = (f"{len(measured)} steps were measured, on {devices}; {checks}. On the leaderboard shape, ours / "
                   f"cuDNN went from {board_text(first)} at the first step, {first['step']} "
                   f"({decisions.get(first['step'], 'pending')}), to {board_text(last)} at the last, {last['step']} "
                   f"({decisions.get(last['step'], 'pending')})"
                   + (f"; our backward alone at {_point_name(bwd_point)} from {bwd_ms(first)} ms to "
                      f"{bwd_ms(last)} ms." if bwd_point else "."))
    else:
        summary = (f"{len(measured)} steps were measured, on {devices}; {checks}. On the leaderboard shape, ours / "
                   f"cuDNN (each against cuDNN of its own run and GPU) went from {board_text(first, False)} at the "
                   f"first step, {first['step']} ({decisions.get(first['step'], 'pending')}), to "
                   f"{board_text(last, False)} at the last, {last['step']} "
                   f"({decisions.get(last['step'], 'pending')}). Milliseconds compare within one GPU only: "
                   + "; ".join(on_one_gpu([r for r in measured if gpu(r) == g]) for g in gpus) + ".")
    return {"table": tab, "steps": listed, "summary": summary, "n_steps": str(len(measured))}


@problem("flash_optimisation_log")
def flash_optimisation_log(res, out: Output) -> dict[str, Any]:
    """The optimisation log (current) and, after it, the earlier history of probe outputs; either may be absent."""
    rows, texts, board = load_optimisation_log(res)
    tables: dict[str, Any] = {}
    n: dict[str, Any] = {"has_log": bool(rows), "has_history": bool(texts)}
    if rows:
        log = _log_summary(rows)
        tables["log"] = log.pop("table")
        n.update({f"log_{key}": value for key, value in log.items()})
    if texts:
        history = _probe_summary(texts, board)
        tables["history"] = history["tables"]["main"]
        n.update({f"history_{key}": value for key, value in history["n"].items()})
        device = history["n"]["device"]
        n["history_intro"] = (("The earlier history, before this log: the kernel was first tuned" if rows
                               else "The kernel was tuned")
                              + (f" on the {device}, the GPU of the leaderboard run that closed this history, quoted "
                                 "below" if device else "")
                              + ", each step timed by scripts/flash_probe.py, which printed plain text.")
    return {"tables": tables, "n": n}
