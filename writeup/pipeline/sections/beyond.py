"""Sections beyond the assignment that are not about sharding: the fused RMSNorm and the
FlashAttention optimisation log."""

from __future__ import annotations

import re
from typing import Any

from cs336_systems.bench import flash_log
from cs336_systems.bench import rmsnorm as rmsnorm_bench
from pipeline import figures
from pipeline.markup import DASH, num, pct, span, spread, table, times
from pipeline.results import Missing, display_path, main_device
from pipeline.sections.registry import Output, problem

PROVIDER_ORDER = ("ours", "eager", "compile", "liger", "quack")
PASS_NAMES = {"fwd": "forward", "fwd_bwd": "forward + backward"}


def load_rmsnorm(res) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The kernel rows of the newest kernel-part run (``rmsnorm_bench.newest_kernel_run``: rows that record
    ``copy_share``; earlier runs are left out) and the model rows (``part == "model"``: a train step of one model
    size with ``norm`` plain or fused), the latest per configuration on their main device."""

    def keep(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        model = [r for r in rows if r.get("part") == "model"]
        if model:
            device = main_device(model)
            model = [r for r in model if r.get("device") == device]
        return rmsnorm_bench.newest_kernel_run(rows) + model

    rows = res.rows("rmsnorm", one_device=False, keep=keep)
    return [r for r in rows if r.get("part") == "kernel"], [r for r in rows if r.get("part") == "model"]


def _model_text(model: list[dict[str, Any]]) -> str:
    measured = [r for r in model if not r.get("oom")]
    norms = sorted({r.get("norm", "") for r in measured})
    if len(norms) >= 2:
        return "; ".join(f"{r.get('norm')}: {num(r.get('mean_ms'), 1)} ms" for r in measured)
    if measured:
        r = measured[0]
        return (f"only the {r.get('norm', 'plain')} RMSNorm was measured in a model "
                f"({r.get('size')} model, {r.get('dtype')}, context {r.get('context_length')}, "
                f"{r.get('mode', 'train step').replace('_', ' ')}: {num(r.get('mean_ms'), 1)} ms), so the "
                "model-level comparison with the fused kernel was not measured")
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
                 "bandwidth of the same shape measured in the same run (copy: x.clone()).",
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


@problem("rmsnorm")
def rmsnorm(res, out: Output) -> dict[str, Any]:
    kernel, model = load_rmsnorm(res)
    n: dict[str, Any] = {"model": _model_text(model), "pending": not kernel,
                         "grid": (f"M in {{{', '.join(f'{m:,}' for m in rmsnorm_bench.ROWS)}}} rows × N in "
                                  f"{{{', '.join(f'{c:,}' for c in rmsnorm_bench.COLS)}}}"),
                         "all_providers": ", ".join(rmsnorm_bench.PROVIDERS)}
    if not kernel:
        return {"tables": {}, "figures": {}, "n": n}
    measured = [r for r in kernel if not r.get("oom") and r.get("gbps")]
    m = max(r["rows"] for r in measured)
    at = {(r["provider"], r["pass"], r["cols"], r["dtype"]): r for r in measured if r["rows"] == m}
    present = {r["provider"] for r in measured} - {"copy"}
    providers = [p for p in PROVIDER_ORDER if p in present] + sorted(present - set(PROVIDER_ORDER))
    cols = sorted({r["cols"] for r in measured})
    dtypes = sorted({r["dtype"] for r in measured})
    dtype = "bf16" if "bf16" in dtypes else dtypes[0]
    ours_share = {p: [at[("ours", p, c, dtype)]["copy_share"] for c in cols
                      if at.get(("ours", p, c, dtype), {}).get("copy_share") is not None] for p in rmsnorm_bench.PASSES}
    n.update({"m": f"{m:,}", "dtype": dtype, "dtypes": ", ".join(dtypes), "providers": ", ".join(providers),
              "run": kernel[0]["run"], "has_ours": bool(ours_share["fwd"] or ours_share["fwd_bwd"]),
              "not_measured": ", ".join(p for p in rmsnorm_bench.PROVIDERS if p not in present)})
    for pass_, shares in ours_share.items():
        n[f"ours_share_{pass_}"] = spread(min(shares), max(shares), pct) if shares else DASH
        n[f"versus_{pass_}"] = _ratio_text(at, providers, cols, dtype, pass_)
    return {"tables": {"main": _grid_table(at, providers, cols, dtype, m)},
            "figures": {"main": _grid_figure(out, at, providers, cols, dtypes, m)}, "n": n}


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


def plain_words(note: str) -> str:
    """A note of the log as the reader needs it: renamed result folders under their current names, and
    references to the project's task tracker left out."""
    for old, new in RENAMED_FOLDERS.items():
        note = note.replace(old, new)
    for pattern, replacement in _TRACKER_REFERENCES:
        note = pattern.sub(replacement, note)
    return note


def _point_name(point: tuple[int, int]) -> str:
    return f"{point[0]}×{point[1]}"


def _log_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The log (``flash_log``'s rows): one table line per measured step in file order with its latest decision
    (``flash_log.latest_decisions``: a ``--set-decision`` row overrides), the hypothesis and notes of each step,
    and the first and last step compared."""
    decisions = flash_log.latest_decisions(rows)
    measured = [r for r in rows if "leaderboard" in r]
    points = list(dict.fromkeys((p["seq_len"], p["d_head"]) for r in measured for p in r["points"]))
    bwd_point = max(points, key=lambda p: (p[1], p[0]), default=None)  # the largest head dim's longest sequence

    def by_point(row: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
        return {(p["seq_len"], p["d_head"]): p for p in row["points"]}

    body = []
    for r in measured:
        board, at = r["leaderboard"], by_point(r)
        ours = num(board.get("ours_fwd_bwd_ms"), 2)
        body.append([r["step"], decisions.get(r["step"], "pending"),
                     ours if board.get("verified") is not False else f"{ours} (not verified)",
                     num(board.get("sdpa_cudnn_fwd_bwd_ms"), 2), times(board.get("ratio_vs_cudnn")),
                     *[times(at.get(p, {}).get("ratio_vs_cudnn")) for p in points],
                     *([num(at.get(bwd_point, {}).get("ours_bwd_ms"), 2)] if bwd_point else [])])
    header = [["", "", span("leaderboard shape", 3), span("ours / cuDNN, N × d", len(points)),
               *(["ours bwd (ms)"] if bwd_point else [])],
              ["step", "decision", "ours (ms)", "cuDNN (ms)", "ours/cuDNN", *map(_point_name, points),
               *([_point_name(bwd_point)] if bwd_point else [])]]
    tab = table(header, body,
                "The FlashAttention optimisation log (cs336_systems.bench.flash_log), one line per measured step "
                "in the order measured, with its latest decision: forward + backward on the leaderboard shape "
                "(ours and SDPA cuDNN), ours / cuDNN forward + backward at each point of the sweep (causal, bf16, "
                "sequence length N × head dim d)"
                + (f", and our backward alone at {_point_name(bwd_point)}." if bwd_point else "."),
                align=["left", "left", *["right"] * (3 + len(points) + bool(bwd_point))], size=7)

    steps: dict[str, dict[str, Any]] = {}
    for r in rows:
        step = steps.setdefault(r["step"], {"step": r["step"], "decision": decisions.get(r["step"], "pending"),
                                            "hypothesis": [], "note": [], "commits": []})
        for key in ("hypothesis", "note"):
            if r.get(key) and r[key] not in step[key]:
                step[key].append(r[key])
        if "leaderboard" in r and r.get("commit"):
            where = r["commit"] + (" with uncommitted changes" if r.get("dirty") else "")
            if where not in step["commits"]:
                step["commits"].append(where)
    def sentences(texts: list[str]) -> str:
        return " ".join(t if t.rstrip().endswith((".", "!", "?")) else t.rstrip() + "." for t in map(plain_words, texts))

    listed = [{"step": s["step"], "decision": s["decision"],
               "where": f"measured at {', '.join(s['commits'])}" if s["commits"] else "",
               "hypothesis": sentences(s["hypothesis"]), "note": sentences(s["note"])} for s in steps.values()]

    first, last = measured[0], measured[-1]
    devices = ", ".join(dict.fromkeys((r.get("env") or {}).get("gpu_name") or r.get("device", "an unknown device")
                                      for r in measured))

    def board_text(row: dict[str, Any]) -> str:
        board = row["leaderboard"]
        return (f"{times(board.get('ratio_vs_cudnn'))} ({num(board.get('ours_fwd_bwd_ms'), 2)} ms against "
                f"{num(board.get('sdpa_cudnn_fwd_bwd_ms'), 2)} ms)")

    def bwd_ms(row: dict[str, Any]) -> str:
        return num(by_point(row).get(bwd_point, {}).get("ours_bwd_ms"), 2)

    verified = [r for r in measured if r["leaderboard"].get("verified")]
    checks = ("every step passed the leaderboard's checks (one graph, our kernels, matches SDPA)"
              if len(verified) == len(measured) else
              f"{len(verified)} of {len(measured)} steps passed the leaderboard's checks")
    if len(measured) == 1:
        summary = (f"One step ({first['step']}) was measured on {devices}; {checks}. On the leaderboard shape, ours "
                   f"takes {board_text(first)} the time of SDPA's cuDNN backend.")
    else:
        summary = (f"{len(measured)} steps were measured, on {devices}; {checks}. On the leaderboard shape, ours / "
                   f"cuDNN went from {board_text(first)} at the first step, {first['step']} "
                   f"({decisions.get(first['step'], 'pending')}), to {board_text(last)} at the last, {last['step']} "
                   f"({decisions.get(last['step'], 'pending')})"
                   + (f"; our backward alone at {_point_name(bwd_point)} from {bwd_ms(first)} ms to "
                      f"{bwd_ms(last)} ms." if bwd_point else "."))
    return {"table": tab, "steps": listed, "summary": summary, "n_steps": str(len(measured))}


@problem("flash_optimisation_log")
def flash_optimisation_log(res, out: Output) -> dict[str, Any]:
    """The optimisation log (current) and, after it, the earlier history of probe outputs; either may be absent."""
    rows, texts, board = load_optimisation_log(res)
    tables: dict[str, Any] = {}
    n: dict[str, Any] = {"has_log": bool(rows), "has_history": bool(texts)}
    listings: list[dict[str, str]] = []
    if rows:
        log = _log_summary(rows)
        tables["log"] = log.pop("table")
        n.update({f"log_{key}": value for key, value in log.items()})
    if texts:
        history = _probe_summary(texts, board)
        tables["history"] = history["tables"]["main"]
        listings = history["listings"]
        n.update({f"history_{key}": value for key, value in history["n"].items()})
        device = history["n"]["device"]
        n["history_intro"] = (("The earlier history, before this log: the kernel was tuned" if rows
                               else "The kernel was tuned") + " in earlier sessions"
                              + (f" on the {device}, the GPU of the final leaderboard run quoted below" if device else "")
                              + ", each step timed by scripts/flash_probe.py, which printed plain text.")
    return {"tables": tables, "listings": listings, "n": n}
