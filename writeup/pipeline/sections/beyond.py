"""Sections beyond the assignment that are not about sharding: the fused RMSNorm and the
FlashAttention optimisation log."""

from __future__ import annotations

import re
from typing import Any

from cs336_systems.bench import flash_log
from pipeline import figures
from pipeline.markup import DASH, num, span, spread, table, times
from pipeline.results import Missing, display_path
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
