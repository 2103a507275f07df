"""Sections of SPEC part 9, the fast training step: our stack's step against PyTorch's (``train_step``), and three
of its parts measured on their own: the fused AdamW, the fused LM head + cross-entropy and the cold first call
of our attention operator."""

from __future__ import annotations

from typing import Any

from cs336_basics.model import MODEL_SIZES
from pipeline import accounting, figures
from pipeline.markup import DASH, num, pct, sig, span, spread, table, times
from pipeline.results import Missing
from pipeline.sections.registry import Output, problem

SIZES = list(MODEL_SIZES)  # small ... 2.7B, the order every table uses
STACKS = ("torch", "ours")
PHASES = ("forward", "backward", "optimizer")
PHASE_SIZE = "xl"  # the size whose phases the section breaks down (the largest measured if absent)
# The target set for our stack: at most 0.95x PyTorch's step time and at least 40 % MFU, on xl at context 512, batch 4.
GOAL = {"ratio": 0.95, "mfu": 0.40, "size": "xl", "context_length": 512, "batch_size": 4}

# What each recorded part (``parts`` in a train_step row) is; cs336_systems/train/step.py defines them.
PART_NAMES = {
    ("attention", "triton"): "our FlashAttention-2 (Triton operators)",
    ("attention", "sdpa"): "SDPA",
    ("rmsnorm", "fused"): "our fused Triton RMSNorm",
    ("rmsnorm", "plain"): "cs336_basics RMSNorm",
    ("loss", "fused"): "our fused LM head + cross-entropy",
    ("loss", "plain"): "LM head, F.cross_entropy",
    ("optimizer", "fused"): "our fused Triton AdamW",
    ("optimizer", "torch_fused"): "AdamW(fused=True)",
    ("optimizer", "basics"): "cs336_basics AdamW",
    ("compile", "blocks"): "each block and the loss head",
    ("compile", "model"): "the whole forward and loss",
    ("compile", "none"): "none",
    ("checkpointing", 0): "none",
}


def size_order(size: str) -> int:
    return SIZES.index(size) if size in SIZES else len(SIZES)


def join_words(words: list[str]) -> str:
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + " and " + words[-1]


def value_range(values: list[float], digits: int = 1, fmt=None) -> str:
    """``'1.2 to 3.4'`` over ``values`` (``fmt`` or ``digits`` decimals); a dash when there are none."""
    values = list(values)
    return spread(min(values), max(values), fmt or (lambda x: num(x, digits))) if values else DASH


def ratio(mine: dict[str, Any], other: dict[str, Any], key: str, digits: int = 2, fmt=None) -> str:
    """``mine[key] / other[key]`` as ``'0.85×'`` (or ``fmt``); a dash when either is missing."""
    if not (mine.get(key) and other.get(key)):
        return DASH
    return (fmt or (lambda x: times(x, digits)))(mine[key] / other[key])


def shape_label(context: int, batch: int) -> str:
    return f"{context:,} × {batch}"


# -----------------------------------------------------------------------------------------------
# train_step
# -----------------------------------------------------------------------------------------------


def load_train_step(res) -> dict[tuple[str, int, int], dict[str, dict[str, Any]]]:
    """The rows of ``train_step.jsonl`` without overrides (the two stacks as defined), by (size, context length,
    batch size) and stack, in size order."""
    rows = [r for r in res.rows("train_step") if not r.get("overrides") and r.get("stack") in STACKS]
    cases: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        cases.setdefault((r["size"], r["context_length"], r["batch_size"]), {})[r["stack"]] = r
    return dict(sorted(cases.items(), key=lambda item: (size_order(item[0][0]), item[0][2] != 4, item[0][1])))


def measured(row: dict[str, Any] | None) -> bool:
    return bool(row) and not row.get("oom") and row.get("step_ms") is not None


def step_ratio(case: dict[str, dict[str, Any]]) -> float | None:
    torch, ours = case.get("torch"), case.get("ours")
    return ours["step_ms"] / torch["step_ms"] if measured(torch) and measured(ours) else None


def earlier_torch(case: dict[str, dict[str, Any]]) -> bool:
    """Whether the torch row of ``case`` comes from another invocation of the tool than ours' row."""
    torch, ours = case.get("torch"), case.get("ours")
    return bool(torch and ours) and torch.get("run") != ours.get("run")


def _cell(row: dict[str, Any] | None, key: str, fmt) -> str:
    if row is None:
        return DASH
    return "OOM" if row.get("oom") else fmt(row.get(key))


def _stacks_table(cases) -> dict[str, Any]:
    """Each part of the two stacks, as the rows record it (``parts``)."""
    parts = {stack: next((c[stack]["parts"] for c in cases.values() if c.get(stack, {}).get("parts")), {})
             for stack in STACKS}
    names = list(dict.fromkeys([*parts["torch"], *parts["ours"]]))
    body = [[name, *[PART_NAMES.get((name, parts[s].get(name)), str(parts[s].get(name, DASH))) for s in STACKS]]
            for name in names]
    return table(["part", *STACKS], body, "The two stacks, part by part, as the rows record them (parts).",
                 align=["left", "left", "left"], size=8)


def _main_table(cases, marker: str) -> dict[str, Any]:
    body = []
    for (size, context, batch), case in cases.items():
        torch, ours = case.get("torch"), case.get("ours")
        ratio = step_ratio(case)
        torch_ms = _cell(torch, "step_ms", lambda x: num(x, 1))
        body.append([size, shape_label(context, batch), torch_ms + (marker if earlier_torch(case) else ""),
                     _cell(ours, "step_ms", lambda x: num(x, 1)), times(ratio),
                     _cell(torch, "mfu", lambda x: pct(x, 1)), _cell(ours, "mfu", lambda x: pct(x, 1)),
                     _cell(torch, "peak_gb", lambda x: num(x, 1)), _cell(ours, "peak_gb", lambda x: num(x, 1))])
    header = [["", "", span("step (ms)", 2), "", span("MFU", 2), span("peak memory (GB)", 2)],
              ["size", "context × batch", *STACKS, "ours ÷ torch", *STACKS, *STACKS]]
    rows = [r for c in cases.values() for r in c.values()]
    warmup = sorted({r.get("warmup") for r in rows if r.get("warmup") is not None})
    steps = sorted({r.get("steps") for r in rows if r.get("steps") is not None})
    peaks = [r["peak_tflops"] for r in rows if r.get("peak_tflops")]
    return table(header, body,
                 f"A training step (forward, loss, backward, AdamW) of each model size, bf16 autocast, both stacks: "
                 f"median over {'/'.join(map(str, steps))} timed steps after {'/'.join(map(str, warmup))} warm-up "
                 f"steps, each case in a fresh process. MFU: the step's model FLOPs (causal attention counted half) "
                 f"over the bf16 matmul rate measured in the same invocation ({value_range(peaks, 0)} TFLOP/s). "
                 f"Peak: the most memory allocated during the timed steps. {marker}: the torch row comes "
                 f"from an earlier invocation of the tool than ours' row.", size=8)


def _ratio_figure(out: Output, cases) -> dict[str, str]:
    sizes = sorted({size for size, _, _ in cases}, key=size_order)
    shapes = sorted({(c, b) for _, c, b in cases}, key=lambda s: (s[1] != 4, s[0]))
    fig, axes = figures.new(6.5, 2.6)
    ax = axes[0]
    width = 0.8 / max(1, len(shapes))
    for i, (context, batch) in enumerate(shapes):
        xs = [x + (i - (len(shapes) - 1) / 2) * width for x in range(len(sizes))]
        values = [step_ratio(cases.get((size, context, batch), {})) or 0 for size in sizes]
        bars = ax.bar(xs, values, width, label=shape_label(context, batch))
        ax.bar_label(bars, [f"{v:.2f}" if v else "" for v in values], fontsize=5.5, padding=1)
    ax.axhline(1.0, color="0.2", linewidth=0.8, label="torch (1)")
    ax.axhline(GOAL["ratio"], color="0.2", linewidth=0.8, linestyle="--", label=f"goal ({GOAL['ratio']:.2f})")
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels(sizes)
    ax.set_ylabel("ours ÷ torch step time")
    figures.legend_below(fig, ax, ncol=len(shapes) + 2)
    return out.save(fig, "train_step_ratio", "Step time of our stack over PyTorch's, per model size and shape "
                    "(context × batch; below 1: ours faster); dashed: the goal.")


def _phase_table(cases, size: str) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Phase medians of ``size``'s shapes, both stacks, and per shape the differences (ours - torch)."""
    shapes = [(c, b) for s, c, b in cases if s == size]
    pairs = [(shape, cases[(size, *shape)]) for shape in shapes]
    pairs = [(shape, c) for shape, c in pairs if measured(c.get("torch")) and measured(c.get("ours"))]
    labels = [*PHASES, "sum of the phases", "step (timed whole)"]

    def value(row: dict[str, Any], label: str) -> float:
        if label == "sum of the phases":
            return sum(row[f"{p}_ms"] for p in PHASES)
        return row["step_ms"] if label.startswith("step") else row[f"{label}_ms"]

    body = []
    for label in labels:
        cells = [label]
        for _, case in pairs:
            torch, ours = value(case["torch"], label), value(case["ours"], label)
            cells += [num(torch, 1), num(ours, 1), f"{ours - torch:+.1f}"]
        body.append(cells)
    header = [["", *[span(f"context {c:,}, batch {b}", 3) for (c, b), _ in pairs]],
              ["ms", *["torch", "ours", "ours − torch"] * len(pairs)]]
    tab = table(header, body, f"The {size} model's training step by phase (medians over steps timed phase by phase, "
                "the device synchronised after each phase, so the phases do not add up exactly to the step timed "
                "whole). The optimizer phase includes zeroing the gradients.", size=8)
    gaps = [{p: case["ours"][f"{p}_ms"] - case["torch"][f"{p}_ms"] for p in PHASES} for _, case in pairs]
    return tab, gaps


@problem("train_step")
def train_step(res, out: Output) -> dict[str, Any]:
    cases = load_train_step(res)
    if not any(step_ratio(c) for c in cases.values()):
        raise Missing("writeup/results/train_step.jsonl", "no configuration measured with both stacks")
    marker = "†"
    both = {key: c for key, c in cases.items() if step_ratio(c)}
    ratios = {key: step_ratio(c) for key, c in both.items()}
    best, worst = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
    sizes = sorted({size for size, _, _ in cases}, key=size_order)
    shapes = sorted({(c, b) for _, c, b in cases}, key=lambda s: (s[1] != 4, s[0]))
    measured_sizes = {size for size, _, _ in both}
    phase_size = PHASE_SIZE if PHASE_SIZE in measured_sizes else max(measured_sizes, key=size_order)
    phases, gaps = _phase_table(both, phase_size)
    share = [(g["forward"] + g["backward"]) / sum(g.values()) for g in gaps if sum(g.values()) > 0]
    goal = cases.get((GOAL["size"], GOAL["context_length"], GOAL["batch_size"]), {})
    goal_ratio = step_ratio(goal) if goal else None
    goal_mfu = goal["ours"].get("mfu") if goal_ratio else None
    # Ours' rows whose torch row came from an earlier invocation, grouped by that invocation.
    earlier: dict[str, list[str]] = {}
    for (size, _, _), case in both.items():
        if earlier_torch(case):
            sizes_of_run = earlier.setdefault(case["torch"].get("run", "?"), [])
            if size not in sizes_of_run:
                sizes_of_run.append(size)
    ours_runs = sorted({c["ours"].get("run", "?") for c in both.values()})
    rows = [r for c in both.values() for r in c.values()]
    first = {s: [r["first_step_s"] for r in rows if r["stack"] == s and r.get("first_step_s")] for s in STACKS}
    peak_ratio = [c["ours"]["peak_gb"] / c["torch"]["peak_gb"] for c in both.values()
                  if c["ours"].get("peak_gb") and c["torch"].get("peak_gb")]
    mfu = {s: max((c[s] for c in both.values() if c[s].get("mfu")), key=lambda r: r["mfu"], default=None)
           for s in STACKS}

    def case_name(key) -> str:
        size, context, batch = key
        return f"{size}, context {context:,}, batch {batch}"

    n = {
        "sizes": join_words(sizes),
        "shapes": join_words([f"{join_words([f'{c:,}' for c, b in shapes if b == batch])} tokens at batch {batch}"
                              for batch in dict.fromkeys(b for _, b in shapes)]),
        "cases": str(len(both)), "slower": str(sum(r > 1 for r in ratios.values())),
        "slower_everywhere": all(r > 1 for r in ratios.values()),
        "range": spread(min(ratios.values()), max(ratios.values())),
        "best": times(ratios[best]), "best_case": case_name(best),
        "worst": times(ratios[worst]), "worst_case": case_name(worst),
        "marker": marker, "has_earlier": bool(earlier),
        "runs": "; ".join([*(f"{join_words(s)}: run {run}" for run, s in earlier.items()),
                           f"ours: run{'s' if len(ours_runs) > 1 else ''} {join_words(ours_runs)}"]),
        "first_torch": value_range(first["torch"]), "first_ours": value_range(first["ours"]),
        "peak_ratio": spread(min(peak_ratio), max(peak_ratio)) if peak_ratio else DASH,
        "mfu_torch": pct(mfu["torch"]["mfu"], 1) if mfu["torch"] else DASH,
        "mfu_torch_case": case_name((mfu["torch"]["size"], mfu["torch"]["context_length"], mfu["torch"]["batch_size"]))
        if mfu["torch"] else DASH,
        "mfu_ours": pct(mfu["ours"]["mfu"], 1) if mfu["ours"] else DASH,
        "mfu_ours_case": case_name((mfu["ours"]["size"], mfu["ours"]["context_length"], mfu["ours"]["batch_size"]))
        if mfu["ours"] else DASH,
        "goal_ratio": times(GOAL["ratio"]), "goal_mfu": pct(GOAL["mfu"]),
        "goal_case": case_name((GOAL["size"], GOAL["context_length"], GOAL["batch_size"])),
        "has_goal": goal_ratio is not None,
        "goal_met": bool(goal_ratio and goal_ratio <= GOAL["ratio"] and (goal_mfu or 0) >= GOAL["mfu"]),
        "goal_ours_ratio": times(goal_ratio), "goal_ours_mfu": pct(goal_mfu, 1),
        "goal_torch_mfu": pct(goal["torch"].get("mfu"), 1) if goal_ratio else DASH,
        "phase_size": phase_size,
        "fwd_gap": value_range([g["forward"] for g in gaps]), "bwd_gap": value_range([g["backward"] for g in gaps]),
        "opt_gap": value_range([g["optimizer"] for g in gaps]),
        "fb_share": spread(min(share), max(share), pct) if share else DASH,
    }
    return {"tables": {"stacks": _stacks_table(both), "main": _main_table(cases, marker), "phases": phases},
            "figures": {"main": _ratio_figure(out, cases)}, "n": n}


# -----------------------------------------------------------------------------------------------
# fused_adamw
# -----------------------------------------------------------------------------------------------

ADAMW_PROVIDERS = ("ours", "torch_fused", "torch_foreach", "basics")
DTYPE_BYTES = {"fp32": accounting.FP32, "bf16": accounting.BF16}


def adamw_moment_dtype(provider: str, dtype: str) -> str:
    """Ours keeps float32 moments whatever the parameters' dtype (SPEC: float32 state); PyTorch's AdamWs and the
    cs336_basics AdamW (``zeros_like(p)``) keep them in the parameter's dtype."""
    return "fp32" if provider == "ours" else dtype


def load_fused_adamw(res) -> list[dict[str, Any]]:
    """The rows of ``fused_adamw.jsonl``, each with the bytes its provider moves per parameter and the GB/s that
    gives. (The rows' own ``gb_per_s`` counted float32 moments for every provider, too many bytes for PyTorch's
    AdamWs on bf16 parameters; it is not used.)"""
    rows = [r for r in res.rows("fused_adamw") if r.get("provider") in ADAMW_PROVIDERS]
    for r in rows:
        moments = adamw_moment_dtype(r["provider"], r["dtype"])
        size = DTYPE_BYTES[r["dtype"]]
        r["moments"] = moments
        r["bytes_per_param_moved"] = accounting.adamw_bytes_per_param(size, size, DTYPE_BYTES[moments])
        if not r.get("oom") and r.get("median_ms"):
            r["gb_per_s_moved"] = r["params"] * r["bytes_per_param_moved"] / (r["median_ms"] / 1e3) / 1e9
    return sorted(rows, key=lambda r: (r["dtype"] != "fp32", ADAMW_PROVIDERS.index(r["provider"])))


@problem("fused_adamw")
def fused_adamw(res, out: Output) -> dict[str, Any]:
    rows = load_fused_adamw(res)
    index = {(r["dtype"], r["provider"]): r for r in rows}
    body = []
    for r in rows:
        ours = index.get((r["dtype"], "ours"), {})
        gbps, copy = r.get("gb_per_s_moved"), r.get("copy_gb_per_s")
        body.append([r["dtype"], r["provider"], r["moments"], str(r["bytes_per_param_moved"]),
                     "OOM" if r.get("oom") else num(r.get("median_ms"), 2), num(gbps, 0),
                     pct(gbps / copy) if gbps and copy else DASH,
                     ratio(ours, r, "median_ms")])
    first = rows[0]
    tab = table(["parameters", "provider", "moments", "bytes / param.", "step (ms)", "GB/s", "of copy", "ours ÷ this"],
                body, f"One optimizer.step() over the {first['size']} model's parameter shapes ({first['params']:,} "
                f"parameters in {first['tensors']} tensors, random gradients of the parameters' dtype): median "
                "(triton.testing.do_bench). GB/s: the bytes the provider moves per parameter (parameter read and "
                "written, gradient read, both moments read and written, in the moments' dtype) over the time; "
                f"copy: a device-to-device copy, {num(first.get('copy_gb_per_s'), 0)} GB/s in the same run.",
                align=["left", "left", "left", "right", "right", "right", "right", "right"], size=8)

    def pair(dtype: str) -> dict[str, str]:
        ours, torch = index.get((dtype, "ours"), {}), index.get((dtype, "torch_fused"), {})
        ok = bool(ours.get("median_ms") and torch.get("median_ms"))
        return {"ours": num(ours.get("median_ms"), 2), "torch": num(torch.get("median_ms"), 2),
                "ratio": times(ours["median_ms"] / torch["median_ms"]) if ok else DASH,
                "ours_gbps": num(ours.get("gb_per_s_moved"), 0), "torch_gbps": num(torch.get("gb_per_s_moved"), 0),
                "ours_copy": ratio(ours, {"gb_per_s_moved": ours.get("copy_gb_per_s")}, "gb_per_s_moved", fmt=pct),
                "ours_bytes": str(ours.get("bytes_per_param_moved", DASH)),
                "torch_bytes": str(torch.get("bytes_per_param_moved", DASH)), "ok": ok}

    fp32, bf16 = pair("fp32"), pair("bf16")
    others = [r for r in rows if r["dtype"] == "fp32" and r["provider"] not in ("ours", "torch_fused")
              and r.get("median_ms") and index.get(("fp32", "ours"), {}).get("median_ms")]
    n = {"size": first["size"], "params": f"{first['params'] / 1e9:.3f}", "tensors": str(first["tensors"]),
         "fp32": fp32, "bf16": bf16,
         "bytes_ratio": (f"{bf16['ours_bytes']}/{bf16['torch_bytes']} = "
                         f"{times(int(bf16['ours_bytes']) / int(bf16['torch_bytes']))}") if bf16["ok"] else DASH,
         "others": join_words([f"{times(index[('fp32', 'ours')]['median_ms'] / r['median_ms'])} the time of "
                               f"{r['provider']} ({num(r['median_ms'], 2)} ms)" for r in others]) or DASH}
    return {"tables": {"main": tab}, "n": n}


# -----------------------------------------------------------------------------------------------
# fused_cross_entropy
# -----------------------------------------------------------------------------------------------

CE_PROVIDERS = ("ours", "eager", "compiled")
# The heads the tool measures by default (cs336_systems/bench/fused_cross_entropy.py).
CE_HEADS = {(32768, 151936, 4096): "the 2026 leaderboard's LM head",
            (8192, 10000, 1600): "the xl model's LM head at context 2,048, batch 4"}


def load_fused_cross_entropy(res) -> dict[tuple[int, int, int], dict[str, dict[str, Any]]]:
    """Rows by shape (tokens, vocabulary, d), largest logits first, and provider."""
    shapes: dict[tuple[int, int, int], dict[str, dict[str, Any]]] = {}
    for r in res.rows("fused_cross_entropy"):
        if r.get("provider") in CE_PROVIDERS:
            shapes.setdefault((r["tokens"], r["vocab"], r["d"]), {})[r["provider"]] = r
    return dict(sorted(shapes.items(), key=lambda item: -item[0][0] * item[0][1]))


@problem("fused_cross_entropy")
def fused_cross_entropy(res, out: Output) -> dict[str, Any]:
    shapes = load_fused_cross_entropy(res)
    body = []
    for (tokens, vocab, d), by_provider in shapes.items():
        ours = by_provider.get("ours", {})
        for provider in CE_PROVIDERS:
            r = by_provider.get(provider)
            if r is None:
                continue
            oom = r.get("oom")
            body.append([f"{tokens:,} × {vocab:,} × {d:,}", provider, "OOM" if oom else num(r.get("median_ms"), 2),
                         DASH if oom else ratio(ours, r, "median_ms"), DASH if oom else num(r.get("peak_extra_gb"), 2),
                         DASH if oom else ratio(ours, r, "peak_extra_gb", 3)])
    autocast = join_words(sorted({r.get("autocast", "") for p in shapes.values() for r in p.values()}))
    tab = table(["tokens × vocabulary × d", "provider", "fwd + bwd (ms)", "ours ÷ this", "extra peak (GB)",
                 "ours ÷ this"], body,
                f"LM head + cross-entropy, {autocast} autocast, float32 head weight: loss and the gradients of the "
                "hidden states and of the weight (median, triton.testing.do_bench), and the peak memory allocated "
                "above the inputs. The first ours ÷ this compares time, the second memory.",
                align=["left", "left", "right", "right", "right", "right"], size=8)

    def head(shape) -> dict[str, Any]:
        tokens, vocab, d = shape
        p = shapes[shape]
        ours, eager, compiled = p.get("ours", {}), p.get("eager", {}), p.get("compiled", {})

        return {"name": CE_HEADS.get(shape, f"{tokens:,} tokens, vocabulary {vocab:,}, d {d:,}"),
                "shape": f"{tokens:,} × {vocab:,} × {d:,}",
                "logits_bf16": num(accounting.BF16 * tokens * vocab / 1e9, 1),
                "logits_fp32": num(accounting.FP32 * tokens * vocab / 1e9, 1),
                "ours_gb": num(ours.get("peak_extra_gb"), 2), "eager_gb": num(eager.get("peak_extra_gb"), 2),
                "compiled_gb": num(compiled.get("peak_extra_gb"), 2),
                "mem_eager": ratio(ours, eager, "peak_extra_gb", 3),
                "mem_compiled": ratio(ours, compiled, "peak_extra_gb", 3),
                "ours_ms": num(ours.get("median_ms"), 1 if (ours.get("median_ms") or 0) > 10 else 2),
                "time_eager": ratio(ours, eager, "median_ms"), "time_compiled": ratio(ours, compiled, "median_ms")}

    keys = list(shapes)
    n = {"big": head(keys[0]), "has_small": len(keys) > 1, "small": head(keys[-1]) if len(keys) > 1 else {}}
    return {"tables": {"main": tab}, "n": n}


# -----------------------------------------------------------------------------------------------
# flash_cold_start
# -----------------------------------------------------------------------------------------------

# scripts/flash_cold_start.py times forward + backward at batch 1 with 4 heads, the first call at 512 tokens.
COLD_BATCH_HEADS = 1 * 4
COLD_FIRST_LENGTH = 512
KEY_TILE = 128  # the auto rule counts key tiles of 128 (cs336_systems/attention/flash_triton.py)
ONE_PASS_MIN_KEY_TILES = 256  # from these many key tiles on, the "auto" backward is the one-pass variant
UNSEEN_SHAPE_BOUND_S = 2.0  # SPEC 9: a cold call at an unseen shape costs about 2 s at most


def key_tiles(length: int) -> int:
    return COLD_BATCH_HEADS * -(-length // KEY_TILE)


def load_flash_cold_start(res) -> list[dict[str, Any]]:
    """One row per head dimension (the JSON scripts/flash_cold_start.py prints: no env, the GPU's name only)."""
    return sorted(res.rows("flash_cold_start"), key=lambda r: (r.get("dtype", ""), r["d_head"]))


@problem("flash_cold_start")
def flash_cold_start(res, out: Output) -> dict[str, Any]:
    rows = load_flash_cold_start(res)
    lengths = sorted({int(n) for r in rows for n in r.get("unseen_length_call_s", {})})
    variant = {n: "one-pass" if key_tiles(n) >= ONE_PASS_MIN_KEY_TILES else "two-pass"
               for n in [COLD_FIRST_LENGTH, *lengths]}
    body = []
    for r in rows:
        unseen = {int(n): s for n, s in r.get("unseen_length_call_s", {}).items()}
        body.append([f"d = {r['d_head']} ({r.get('dtype', '')})", num(r.get("import_s"), 2),
                     num(r.get("first_call_s"), 2), *[sig(1e3 * unseen[n], 3) if n in unseen else DASH
                                                      for n in lengths]])
    body.append([f"key tiles of {KEY_TILE} (× {COLD_BATCH_HEADS} heads)", "", str(key_tiles(COLD_FIRST_LENGTH)),
                 *[str(key_tiles(n)) for n in lengths]])
    body.append(["backward (auto rule)", "", variant[COLD_FIRST_LENGTH], *[variant[n] for n in lengths]])
    header = [["", "import (s)", f"first call at {COLD_FIRST_LENGTH:,} (s)",
               span("then an unseen length (ms)", len(lengths))],
              ["", "", "", *[f"{n:,}" for n in lengths]]]
    tab = table(header, body, "Our attention operator from an empty Triton cache, in a fresh process: importing it, "
                f"the first forward + backward (causal, batch 1, 4 heads, {COLD_FIRST_LENGTH} tokens), then one "
                "forward + backward at each new length, in this order.", size=8)
    # The first length whose backward is a variant not compiled before: its call compiles that variant.
    seen = {variant[COLD_FIRST_LENGTH]}
    switch = None
    for n in lengths:
        if variant[n] not in seen:
            switch = switch or n
            seen.add(variant[n])
    others = [1e3 * s for r in rows for n, s in r.get("unseen_length_call_s", {}).items() if int(n) != switch]
    compile_s = [r["unseen_length_call_s"][str(switch)] for r in rows
                 if switch and str(switch) in r.get("unseen_length_call_s", {})]
    first = [r["first_call_s"] for r in rows if r.get("first_call_s")]
    n = {"first": value_range(first),
         "d_heads": join_words([str(r["d_head"]) for r in rows]),
         "others": value_range(others, fmt=lambda x: sig(x, 2)),
         "has_switch": switch is not None, "switch": f"{switch:,}" if switch else DASH,
         "switch_tiles": str(key_tiles(switch)) if switch else DASH, "min_tiles": str(ONE_PASS_MIN_KEY_TILES),
         "compile": value_range(compile_s),
         "bound": num(UNSEEN_SHAPE_BOUND_S, 0),
         "within_bound": all(s <= UNSEEN_SHAPE_BOUND_S for s in compile_s),
         "no_env": not any(r.get("env") for r in rows)}
    return {"tables": {"main": tab}, "n": n}
