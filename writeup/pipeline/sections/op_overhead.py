"""Beyond the assignment, "host cost is part of speed": the host time per call of each of our operators beside
its PyTorch counterpart (``op_overhead``), before and after the lean launch path."""

from __future__ import annotations

from typing import Any

from pipeline.markup import DASH, join_words, num, span, table, times
from pipeline.results import Missing
from pipeline.sections.registry import Output, problem

OPS = ("attention", "rmsnorm", "cross_entropy", "adamw")  # cs336_systems/bench/op_overhead.py PROVIDERS
PASSES = ("forward", "forward_backward", "step")
PROVIDER_NAMES = {"ours": "ours", "sdpa_cudnn": "SDPA cuDNN", "sdpa_flash": "SDPA flash",
                  "torch_compiled": "compiled", "torch_fused": "AdamW(fused=True)"}
PASS_NAMES = {"forward": "forward", "forward_backward": "fwd + bwd", "step": "step"}
# The like-for-like comparisons: attention against SDPA's cuDNN backend at the training step's shape (batch 4, 25
# heads, 512 tokens, head dimension 64: the xl model at context 512), forward and forward+backward; every other
# operator against its counterpart, in every pass.
COUNTERPART = {"attention": "sdpa_cudnn", "rmsnorm": "torch_compiled", "cross_entropy": "torch_compiled",
                    "adamw": "torch_fused"}
STEP_ATTENTION_SHAPE = (4, 25, 512, 64)
# Ours' forward of the fused LM head + cross-entropy also computes the gradients (its backward only scales them):
# its forward row is not like for like with the compiled loss's forward.
NOT_LIKE_FOR_LIKE = {("cross_entropy", "forward")}

Key = tuple[str, tuple, str]  # (op, shape, pass)


def shape_text(shape: tuple) -> str:
    return " × ".join(f"{x:,}" if isinstance(x, int) else str(x) for x in shape)


def load_op_overhead(res) -> list[tuple[str, str, dict[Key, dict[str, dict[str, Any]]]]]:
    """Every row, by run (oldest first): (run, commit, {(op, shape, pass): {provider: row}}). The file is read whole,
    not latest-per-configuration, so that the earlier run stays beside the latest."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in res.log_rows("op_overhead", measured=lambda r: not r.get("oom")):
        if r.get("op") in OPS:
            runs.setdefault(r["run"], []).append(r)
    ordered = sorted(runs.items(), key=lambda item: min((r.get("env", {}).get("date", ""), r["run"]) for r in item[1]))
    out = []
    for run, rows in ordered:
        cases: dict[Key, dict[str, dict[str, Any]]] = {}
        for r in rows:
            cases.setdefault((r["op"], tuple(r["shape"]), r["pass"]), {})[r["provider"]] = r
        out.append((run, str(rows[0].get("env", {}).get("commit", "?"))[:7], cases))
    return out


def issue(row: dict[str, Any] | None) -> float | None:
    return row["issue_us"] if row and not row.get("oom") and row.get("issue_us") else None


def over(case: dict[str, dict[str, Any]] | None, provider: str) -> float | None:
    """Ours' issue time over ``provider``'s in one run's ``case``."""
    if not case:
        return None
    ours, other = issue(case.get("ours")), issue(case.get(provider))
    return ours / other if ours and other else None


def compared(key: Key) -> bool:
    op, shape, _ = key
    return op != "attention" or shape == STEP_ATTENTION_SHAPE


OP_SHAPES = {"attention": "Attention: bf16, causal, shape (batch, heads, tokens, head dimension)",
             "rmsnorm": "rmsnorm: (rows, d_model)", "cross_entropy": "cross_entropy: (tokens, d_model, vocabulary)",
             "adamw": "adamw: the xl model's parameters, fp32"}


def newest_per_op(runs: list[tuple[str, str, dict[Key, dict[str, dict[str, Any]]]]]
                  ) -> tuple[dict[Key, dict[str, dict[str, Any]]], dict[Key, int]]:
    """Each operator's rows from the newest run that measured it (the newest run may time only some operators):
    the cases in operator order, and the index in ``runs`` each case comes from."""
    newest = {op: i for i, (_, _, cases) in enumerate(runs) for op, _, _ in cases}
    shown, run_of = {}, {}
    for op in sorted(newest, key=OPS.index):
        for key, case in runs[newest[op]][2].items():
            if key[0] == op:
                shown[key], run_of[key] = case, newest[op]
    return shown, run_of


def run_date(cases: dict[Key, dict[str, dict[str, Any]]]) -> str:
    return min(str(r.get("env", {}).get("date", "?"))[:10] for c in cases.values() for r in c.values())


@problem("op_overhead")
def op_overhead(res, out: Output) -> dict[str, Any]:
    runs = load_op_overhead(res)
    (now_run, now_commit, _), (before_run, before_commit, before) = runs[-1], runs[0]
    now, run_of = newest_per_op(runs)
    if not any(issue(c.get("ours")) for c in now.values()):
        raise Missing("writeup/results/op_overhead.jsonl", "no run with our operators measured")
    has_before = len(runs) > 1
    marker, older_marker = "‡", "§"
    older = {run_of[k] for k in now if run_of[k] != len(runs) - 1}  # runs of operators the newest run left out
    keys = list(now)
    body = []
    for key in keys:
        op, shape, pass_ = key
        # An operator whose newest run is the earliest has no "before" of its own.
        case, old = now[key], before.get(key) if has_before and run_of[key] > 0 else None
        others = [p for p in PROVIDER_NAMES if p != "ours" and p in case]
        for i, provider in enumerate(others):
            first = i == 0
            body.append([op + (f" {older_marker}" if run_of[key] in older else "") if first else "",
                         shape_text(shape) if first else "",
                         PASS_NAMES.get(pass_, pass_) + (marker if key[::2] in NOT_LIKE_FOR_LIKE else "")
                         if first else "",
                         num(issue((old or {}).get("ours")), 1) if first else "",
                         num(issue(case.get("ours")), 1) if first else "",
                         PROVIDER_NAMES[provider], num(issue(case.get(provider)), 1),
                         times(over(old, provider)), times(over(case, provider))])
    header = [["", "", "", span("ours (µs)", 2), span("PyTorch's counterpart", 2), span("ours ÷ it", 2)],
              ["op", "shape", "pass", "before", "now", "provider", "now (µs)", "before", "now"]]
    calls = sorted({r.get("calls") for c in now.values() for r in c.values() if r.get("calls")})
    repeats = sorted({r.get("repeats") for c in now.values() for r in c.values() if r.get("repeats")})
    ops = list(dict.fromkeys(k[0] for k in keys))
    tab = table(header, body,
                "Host time per call (issue time: a loop of "
                f"{'/'.join(map(str, calls))} calls issued without synchronising the device, median of "
                f"{'/'.join(map(str, repeats))} loops) of each of our operators and of its PyTorch counterparts. "
                + (f"Before: run {before_run} at commit {before_commit}; now: " if has_before else "Now (one run): ")
                + f"run {now_run} at commit {now_commit}"
                + "".join(f"; {older_marker} now: run {runs[i][0]} at commit {runs[i][1]}, the newest to measure "
                          f"{join_words([op for op in ops if any(run_of[k] == i for k in keys if k[0] == op)])}"
                          for i in sorted(older))
                + (". Before and now are different runs, possibly on different machines, whose µs then differ "
                   "also by the machine: compare the ratios, each within one run. " if has_before else ". ")
                + "; ".join(OP_SHAPES[op] for op in ops) + ". "
                + (f"{marker}: ours' forward also computes the gradients, so this row is not like for like."
                   if any(k[::2] in NOT_LIKE_FOR_LIKE for k in keys) else ""),
                align=["left", "left", "left", "right", "right", "left", "right", "right", "right"], size=8)

    ratios = {}
    for key in keys:
        ratio = over(now[key], COUNTERPART[key[0]])
        if compared(key) and ratio is not None:
            ratios[key] = ratio

    def name(key: Key) -> str:
        op, shape, pass_ = key
        where = f" at ({', '.join(map(str, shape))})" if op == "attention" else ""
        return f"{op}{where} {PASS_NAMES.get(pass_, pass_)} ({times(ratios[key])})"

    cheaper = [k for k, r in ratios.items() if r <= 1]
    dearer = [k for k, r in ratios.items() if r > 1]

    def step_attention(cases: dict, pass_: str, provider: str) -> float | None:
        return issue(cases.get(("attention", STEP_ATTENTION_SHAPE, pass_), {}).get(provider))

    attention = {p: {"now": times(over(now.get(("attention", STEP_ATTENTION_SHAPE, p)), "sdpa_cudnn")),
                     "before": times(over(before.get(("attention", STEP_ATTENTION_SHAPE, p)), "sdpa_cudnn")),
                     "ours_now": num(step_attention(now, p, "ours"), 0),
                     "ours_before": num(step_attention(before, p, "ours"), 0),
                     "cudnn_now": num(step_attention(now, p, "sdpa_cudnn"), 0),
                     "cudnn_before": num(step_attention(before, p, "sdpa_cudnn"), 0)}
                 for p in ("forward", "forward_backward")}
    # The change between the runs as the within-run ratios: ours over its counterpart, before and now.
    both = {k: (over(before.get(k), COUNTERPART[k[0]]), r) for k, r in ratios.items() if has_before and run_of[k] > 0}
    both = {k: pair for k, pair in both.items() if pair[0] is not None and k[::2] not in NOT_LIKE_FOR_LIKE}
    rose = [f"{k[0]} {PASS_NAMES.get(k[2], k[2])} ({times(a)} to {times(b)})" for k, (a, b) in both.items() if b > a]
    devices = sorted({r.get("device", "?") for _, _, cases in runs for c in cases.values() for r in c.values()})
    n = {"has_before": has_before, "before_commit": before_commit, "now_commit": now_commit,
         "before_date": run_date(before), "now_date": run_date(runs[-1][2]),
         "devices": join_words(devices),
         "step_shape": f"({', '.join(map(str, STEP_ATTENTION_SHAPE))})",
         "n_compared": str(len(ratios)), "n_cheaper": str(len(cheaper)),
         "cheaper": join_words([name(k) for k in cheaper]) or DASH, "dearer": join_words([name(k) for k in dearer]) or DASH,
         "has_cheaper": bool(cheaper), "has_dearer": bool(dearer),
         "attention": attention, "marker": marker, "older_marker": older_marker, "has_older": bool(older),
         "older_commits": join_words([runs[i][1] for i in sorted(older)]),
         "older_dates": join_words([run_date(runs[i][2]) for i in sorted(older)]),
         "older_ops": join_words([op for op in ops if any(run_of[k] in older for k in keys if k[0] == op)]),
         "ce_forward_dearer": ("cross_entropy", "forward") in {k[::2] for k in dearer},
         "n_both": str(len(both)), "n_fell": str(sum(b < a for a, b in both.values())),
         "has_rose": bool(rose), "rose": join_words(rose)}
    return {"tables": {"main": tab}, "n": n}
