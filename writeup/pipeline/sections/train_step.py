"""Sections on the fast training step (beyond the assignment): our stack's step against PyTorch's (``train_step``), and three
of its parts measured on their own: the fused AdamW, the fused LM head + cross-entropy and the cold first call
of our attention operator."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from cs336_basics.model import MODEL_SIZES
from cs336_systems.parallel.fsdp.transport import DEFAULT_GRADIENT_MEMORY
from cs336_systems.train.step import Parts
from pipeline import accounting, figures
from pipeline.markup import DASH, join_words, num, pct, sig, span, spread, table, times
from pipeline.results import Missing, main_device, measured_when, read_jsonl, row_commit
from pipeline.sections.registry import Output, problem

SIZES = list(MODEL_SIZES)  # small ... 2.7B, the order every table uses
STACKS = ("torch", "ours")
# The step's variants (cs336_systems/bench/train_step.py VARIANTS): eager launches from the compiled blocks, or the
# forward, loss and backward captured in one CUDA graph and replayed (the ``cudagraphs`` part).
VARIANTS = ("default", "cudagraphs")
VARIANT_NAMES = {"default": "default", "cudagraphs": "CUDA graphs"}
# The (context length, batch size) pairs the tool runs every size at by default (its DEFAULT_SHAPES).
PLANNED_SHAPES = ((512, 4), (2048, 4), (8192, 1))
PHASES = ("forward", "backward", "optimizer")
PHASE_SIZE = "xl"  # the size whose phases the section breaks down (the largest measured if absent)
# With CUDA graphs the replayed forward + backward is timed as the forward phase (its backward is empty), so the
# phases are broken down on the default variant.
PHASE_VARIANT = "default"
# The case the text singles out: the xl model at context 512, batch 4 (the single-GPU benchmarks' configuration).
FOCUS = {"size": "xl", "context_length": 512, "batch_size": 4}
# The profile of the default step (scripts/train_step_profile.py), one file per stack: profile_step_<stack>_<commit>.txt.
PROFILE_DIR = "h100-train-step-profile"

# What each recorded part (``parts`` in a train_step row) is; cs336_systems/train/step.py defines them.
PART_NAMES = {
    ("attention", "triton"): "our FlashAttention-2 (Triton/Gluon operators)",
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
    ("checkpointing", "keep"): "none",
    ("gradient_memory", DEFAULT_GRADIENT_MEMORY): "compute stream (FSDP's gradient shards; one GPU: unused)",
    ("recompute_materialized", False): "no (Inductor's default partition)",
    ("keep_attention", False): "no",
    ("sharding", "none"): "none (one GPU)",
    ("cudagraphs", False): "no",
    ("cudagraphs", True): "forward, loss and backward replayed as one graph, optimizer outside",
    ("weights", "fp32"): "fp32 (autocast casts them to bf16)",
    ("weights", "bf16"): "linear layers bf16, fp32 masters in the optimizer",
    ("fused_residual_norm", False): "separate from the norms",
    ("fused_residual_norm", True): "each inside the RMSNorm kernel that reads the sum",
}
# A row's ``parts`` may leave out a part that did not exist when it ran: it ran at the part's default, as recorded
# (a tuple becomes a list in JSON).
PART_DEFAULTS = {f.name: list(f.default) if isinstance(f.default, tuple) else f.default for f in fields(Parts)}
# Rows from before one checkpointing mode record two more parts (and a group size as ``checkpointing``).
RETIRED_PART_DEFAULTS = {"keep_attention": False, "block_checkpointing": []}


def size_order(size: str) -> int:
    return SIZES.index(size) if size in SIZES else len(SIZES)


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

Case = dict[tuple[str, str], dict[str, Any]]  # (stack, variant) -> row


def new_protocol(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the current protocol (those with a ``variant``: both stacks in both variants, ours against
    torch's faster variant), without overrides and with the residual adds separate from the norms (the stacks as
    defined), on the device with the most such rows."""
    rows = [r for r in rows if r.get("variant") in VARIANTS and not r.get("overrides") and r.get("stack") in STACKS
            and r.get("residual_norm", "separate") == "separate"]
    if not rows:
        return []
    device = main_device(rows)
    return [r for r in rows if r.get("device", "") == device]


def load_train_step(res) -> dict[tuple[str, int, int], Case]:
    """The current protocol's rows by (size, context length, batch size) and (stack, variant), in size order."""
    cases: dict[tuple[str, int, int], Case] = {}
    # A row that says residual_norm="separate" and one from before that key existed describe the same stack, but
    # latest_per_config keeps both (their keys differ): the newest of them wins here.
    for r in sorted(res.rows("train_step", one_device=False, keep=new_protocol), key=measured_when):
        cases.setdefault((r["size"], r["context_length"], r["batch_size"]), {})[(r["stack"], r["variant"])] = r
    return dict(sorted(cases.items(), key=lambda item: (size_order(item[0][0]), item[0][2] != 4, item[0][1])))


def measured(row: dict[str, Any] | None) -> bool:
    return bool(row) and not row.get("oom") and row.get("step_ms") is not None


def best(case: Case, stack: str) -> dict[str, Any] | None:
    """``stack``'s faster variant in ``case`` (None when neither was measured)."""
    rows = [case[(stack, v)] for v in VARIANTS if measured(case.get((stack, v)))]
    return min(rows, key=lambda r: r["step_ms"], default=None)


def step_ratio(case: Case) -> float | None:
    """Ours' best variant's step time over torch's best variant's."""
    torch, ours = best(case, "torch"), best(case, "ours")
    return ours["step_ms"] / torch["step_ms"] if torch and ours else None


def earlier_torch(case: Case) -> bool:
    """Whether torch's best row of ``case`` comes from another invocation of the tool than ours' best row."""
    torch, ours = best(case, "torch"), best(case, "ours")
    return bool(torch and ours) and torch.get("run") != ours.get("run")


def _cell(row: dict[str, Any] | None, key: str, fmt) -> str:
    if row is None:
        return DASH
    return "OOM" if row.get("oom") else fmt(row.get(key))


def _part(row: dict[str, Any], name: str) -> Any:
    return row.get("parts", {}).get(name, PART_DEFAULTS.get(name, RETIRED_PART_DEFAULTS.get(name)))


def _part_word(name: str, value: Any) -> str:
    """How the stacks table shows a part's value (lists, e.g. the blocks checkpointed, as their items)."""
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) or "none"
    return PART_NAMES.get((name, value), str(value))


def _stacks_table(cases: dict[Any, Case]) -> dict[str, Any]:
    """Each part of the two stacks, as the rows record it (``parts``); a part that differs between the variants
    (``cudagraphs``) is shown per variant."""
    rows = {key: r for c in cases.values() for key, r in c.items() if r.get("parts")}
    names = list(dict.fromkeys([*(n for r in rows.values() for n in r["parts"]), *PART_DEFAULTS]))

    def cell(stack: str, name: str) -> str:
        values = {v: _part(rows[(stack, v)], name) for v in VARIANTS if (stack, v) in rows}
        if not values:
            return DASH
        words = {v: _part_word(name, value) for v, value in values.items()}
        if len(set(words.values())) == 1:
            return next(iter(words.values()))
        return "; ".join(f"{VARIANT_NAMES[v]}: {w}" for v, w in words.items())

    body = [[name, *[cell(s, name) for s in STACKS]] for name in names]
    return table(["part", *STACKS], body, "The two stacks, part by part, as the rows record them (parts; a part a "
                 "row leaves out is at its default). The cudagraphs part is what tells the two variants apart.",
                 align=["left", "left", "left"], size=8)


MARKER = "†"
"""Marks a comparison of rows from different invocations of the tool."""


def same_run(*rows: dict[str, Any] | None) -> bool:
    """Whether every row was measured and all come from one invocation of the tool."""
    return all(measured(r) for r in rows) and len({r.get("run") for r in rows}) == 1


def _main_table(cases: dict[Any, Case], marker: str) -> dict[str, Any]:
    body = []
    for (size, context, batch), case in cases.items():
        bests = {s: best(case, s) for s in STACKS}
        steps = [_cell(case.get((s, v)), "step_ms", lambda x: num(x, 1)) for s in STACKS for v in VARIANTS]
        body.append([size, shape_label(context, batch), *steps,
                     times(step_ratio(case), 3) + (marker if earlier_torch(case) else ""),
                     *[_cell(bests[s], "mfu", lambda x: pct(x, 1)) for s in STACKS]])
    header = [["", "", *[span(f"{s} step (ms)", len(VARIANTS)) for s in STACKS], "ours ÷ torch",
               span("MFU of the best", len(STACKS))],
              ["size", "context × batch", *[VARIANT_NAMES[v] for _ in STACKS for v in VARIANTS], "best ÷ best",
               *STACKS]]
    rows = [r for c in cases.values() for r in c.values()]
    warmup = sorted({r.get("warmup") for r in rows if r.get("warmup") is not None})
    steps = sorted({r.get("steps") for r in rows if r.get("steps") is not None})
    peaks = [r["peak_tflops"] for r in rows if r.get("peak_tflops")]
    return table(header, body,
                 f"A training step (forward, loss, backward, AdamW) of each model size, bf16 autocast, both stacks, "
                 f"each in both variants: median over {'/'.join(map(str, steps))} timed steps after "
                 f"{'/'.join(map(str, warmup))} warm-up steps, each case in a fresh process; a dash: not measured. "
                 f"ours ÷ torch: ours' faster variant over torch's faster variant. MFU: the best variant's model "
                 f"FLOPs (causal attention counted half) over the bf16 matmul rate measured in the same invocation "
                 f"({value_range(peaks, 0)} TFLOP/s). {marker}: torch's best row comes from another invocation of "
                 f"the tool than ours' best row.", size=8)


def _ratio_figure(out: Output, cases: dict[Any, Case]) -> dict[str, str]:
    both = {key: c for key, c in cases.items() if step_ratio(c)}
    sizes = sorted({size for size, _, _ in both}, key=size_order)
    shapes = sorted({(c, b) for _, c, b in both}, key=lambda s: (s[1] != 4, s[0]))
    fig, axes = figures.new(6.5, 2.6)
    ax = axes[0]
    width = 0.8 / max(1, len(shapes)) * min(1.0, len(sizes) / 3)  # narrower bars when few sizes were measured
    for i, (context, batch) in enumerate(shapes):
        xs = [x + (i - (len(shapes) - 1) / 2) * width for x in range(len(sizes))]
        values = [step_ratio(cases.get((size, context, batch), {})) or 0 for size in sizes]
        bars = ax.bar(xs, values, width, label=shape_label(context, batch))
        ax.bar_label(bars, [f"{v:.3f}" if v else "" for v in values], fontsize=5.5, padding=1)
    ax.axhline(1.0, color="0.2", linewidth=0.8, label="torch (1)")
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels(sizes)
    ax.set_xlim(-0.5, len(sizes) - 0.5)
    ax.set_ylabel("ours ÷ torch step time\n(best variant of each)")
    figures.legend_below(fig, ax, ncol=len(shapes) + 1)
    return out.save(fig, "train_step_ratio", "Step time of our stack's faster variant over PyTorch's faster "
                    "variant, per model size and shape measured with both stacks (context × batch; below 1: ours "
                    "faster).")


def _phase_table(cases: dict[Any, Case], size: str, replay_bwd: list[float]
                 ) -> tuple[dict[str, Any], list[tuple[tuple[int, int], dict[str, float]]]]:
    """Phase medians of ``size``'s shapes in the default variant, both stacks, and per shape the differences
    (ours - torch)."""
    pairs = [((c, b), {s: cases[(sz, c, b)].get((s, PHASE_VARIANT)) for s in STACKS})
             for sz, c, b in cases if sz == size]
    pairs = [(shape, rows) for shape, rows in pairs if all(measured(r) for r in rows.values())]
    labels = [*PHASES, "sum of the phases", "step (timed whole)"]

    def value(row: dict[str, Any], label: str) -> float:
        if label == "sum of the phases":
            return sum(row[f"{p}_ms"] for p in PHASES)
        return row["step_ms"] if label.startswith("step") else row[f"{label}_ms"]

    body = []
    for label in labels:
        cells = [label]
        for _, rows in pairs:
            torch, ours = value(rows["torch"], label), value(rows["ours"], label)
            cells += [num(torch, 1), num(ours, 1), f"{ours - torch:+.1f}"]
        body.append(cells)
    apart = {shape for shape, rows in pairs if rows["ours"].get("run") != rows["torch"].get("run")}
    header = [["", *[span(f"context {c:,}, batch {b}" + (f" {MARKER}" if (c, b) in apart else ""), 3)
                     for (c, b), _ in pairs]],
              ["ms", *["torch", "ours", "ours − torch"] * len(pairs)]]
    replay = (f" (their rows record a backward of at most {num(max(replay_bwd), 2)} ms)" if replay_bwd else "")
    apart_note = f" {MARKER}: the two stacks' rows come from different invocations of the tool." if apart else ""
    tab = table(header, body, f"The {size} model's training step by phase, {VARIANT_NAMES[PHASE_VARIANT]} variant "
                "(medians over steps timed phase by phase, the device synchronised after each phase, so the phases "
                "do not add up exactly to the step timed whole). The optimizer phase includes zeroing the "
                "gradients. With CUDA graphs the replayed forward + backward is recorded under forward and the "
                f"backward phase is empty{replay}, so that variant is not broken down here.{apart_note}", size=8)
    gaps = [(shape, {p: rows["ours"][f"{p}_ms"] - rows["torch"][f"{p}_ms"] for p in PHASES}) for shape, rows in pairs]
    return tab, gaps


def load_profiles(res, directory: str = PROFILE_DIR, shape: str = "") -> dict[str, dict[str, Any]]:
    """The step profiles under ``directory`` (scripts/train_step_profile.py's output: a header line with the stack,
    wall and GPU kernel time per step, then kernels and host ops), by stack, from files named
    ``profile_step_<stack>_<commit>.txt`` or, with a ``shape`` such as ``2048x4``,
    ``profile_step_<stack>_<shape>_<commit>.txt``; empty when there are none."""
    profiles: dict[str, dict[str, Any]] = {}
    suffix = f"_{shape}" if shape else ""
    for path in sorted(res.path(directory).glob(f"profile_step_*{suffix}_*.txt")):
        stack, commit = path.stem.removeprefix("profile_step_").rsplit("_", 1)
        lines = [json.loads(line) for line in res.text(f"{directory}/{path.name}").splitlines()
                 if line.startswith("{")]
        header = next((line for line in lines if "stack" in line), None)
        if header is None or header["stack"] + suffix != stack:
            continue
        profiles[header["stack"]] = {**header, "commit": commit, "file": f"writeup/results/{directory}/{path.name}",
                                     "kernels": {x["kernel"]: x for x in lines if "kernel" in x},
                                     "host_ops": {x["host_op"]: x for x in lines if "host_op" in x}}
    return profiles


def _profile_numbers(profiles: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if not all(s in profiles for s in STACKS):
        return {"has_profile": False}
    p = {s: profiles[s] for s in STACKS}
    ours = p["ours"]
    # Our attention operators' host time per step beside their kernels' GPU time, where the profile lists both.
    attention = []
    for pass_, op, kernel in (("forward", "cs336_systems::flash_attention_forward", "attn_fwd_hopper_kernel"),
                              ("backward", "cs336_systems::flash_attention_backward", "attn_bwd_hopper_kernel")):
        host, gpu = ours["host_ops"].get(op), ours["kernels"].get(kernel)
        if host and gpu:
            attention.append({"pass": pass_, "host": num(host["self_cpu_ms_per_step"], 1),
                              "calls": num(host["calls_per_step"], 0), "gpu": num(gpu["ms_per_step"], 1),
                              "host_over": host["self_cpu_ms_per_step"] > gpu["ms_per_step"]})
    commits = sorted({p[s]["commit"] for s in STACKS})
    return {"has_profile": True, "commit": join_words(commits),
            "files": [p[s]["file"] for s in STACKS],
            "shape": f"{ours['size']}, context {ours['context']:,}, batch {ours['batch']}",
            "cudagraphs": any(p[s]["parts"].get("cudagraphs") for s in STACKS),
            "no_weights_part": not any("weights" in p[s]["parts"] for s in STACKS),
            **{f"{s}_gpu": num(p[s]["gpu_kernel_ms"], 1) for s in STACKS},
            **{f"{s}_wall": num(p[s]["wall_ms"], 1) for s in STACKS},
            **{f"{s}_idle": pct(p[s]["host_bound_share"]) for s in STACKS},
            "attention": attention, "attention_host_over": bool(attention) and all(a["host_over"] for a in attention)}


RECOMPUTE_OVERRIDE = ["recompute_materialized=true"]


def _recompute_rows(res, device: str, cases: dict[tuple[str, int, int], Case]) -> str:
    """Ours' default variant with the ``recompute_materialized`` part, where the stack as defined ran out of memory
    (its rows carry that override), against torch's default variant of the same case: one phrase per case."""
    rows = res.rows("train_step", one_device=False,
                    keep=lambda rows: [r for r in rows if r.get("overrides") == RECOMPUTE_OVERRIDE
                                       and r.get("device") == device and r.get("stack") == "ours"
                                       and r.get("variant") == "default" and measured(r)
                                       and r.get("residual_norm", "separate") == "separate"])
    phrases = []
    for r in rows:
        key = (r["size"], r["context_length"], r["batch_size"])
        torch_row = cases.get(key, {}).get(("torch", "default"))
        if not measured(torch_row) or not (cases[key].get(("ours", "default")) or {}).get("oom"):
            continue
        apart = "" if same_run(r, torch_row) else (
            f" (torch's row from another invocation, at commit {row_commit(torch_row)}; "
            f"ours at {row_commit(r)})")
        phrases.append(f"at {r['size']} and {shape_label(r['context_length'], r['batch_size'])} it takes "
                       f"{num(r['step_ms'])} ms at a peak of {num(r['peak_gb'])} GB, against torch's default variant's "
                       f"{num(torch_row['step_ms'])} ms and {num(torch_row['peak_gb'])} GB{apart}")
    return "; ".join(phrases)


H200_2026_DIR = "h200-train-step-2026"
"""Both stacks on the 2026 handout's xl (2.7B here) on one H200, ours at its current parts (the partitioner may
recompute what a backward operator reads whole): ``train_step.jsonl`` of one invocation, and ours with the residual
adds fused into its norms (``train_step_fused_residual_norm.jsonl``, another invocation)."""
H200_2026_PROFILE_DIR = "h200-train-step-profile-2026"
KERNEL_CLASS_NAMES = {("matmul",): "matmuls", ("attention_forward",): "attention forward",
                      ("attention_backward",): "attention backward",
                      ("elementwise", "norms"): "elementwise kernels and norms (Inductor fuses torch's norms)",
                      ("optimizer",): "the optimizer", ("idle",): "no kernel (idle)"}


def _h200_2026(res) -> dict[str, Any]:
    """The table and phrases of the 2026 xl's step on one H200 (``H200_2026_DIR``), with the kernel time by class of
    each stack's default step at 2048 x 4 (``H200_2026_PROFILE_DIR``); ``{"has": False}`` without the rows."""
    path = res.path(H200_2026_DIR) / "train_step.jsonl"
    if not path.exists():
        return {"has": False}
    rows = {(r["context_length"], r["batch_size"], r["stack"], r["variant"]): r
            for r in read_jsonl(path) if measured(r)}
    shapes = sorted({(c, b) for c, b, _, _ in rows}, key=lambda shape: shape[0])
    body, ratios = [], {}
    for c, b in shapes:
        cells = [rows.get((c, b, stack, variant)) for stack in STACKS for variant in VARIANTS]
        if not all(cells):
            continue
        torch_best = min(cells[:2], key=lambda r: r["step_ms"])
        ours_best = min(cells[2:], key=lambda r: r["step_ms"])
        ratios[(c, b)] = ours_best["step_ms"] / torch_best["step_ms"]
        body.append([shape_label(c, b), *[f"{num(r['step_ms'], 1)} ({num(r['peak_gb'], 1)})" for r in cells],
                     times(ratios[(c, b)], 3)])
    if not body:
        return {"has": False}
    any_row = next(iter(rows.values()))
    tab = table([["shape", span("torch", 2), span("ours", 2), ""],
                 ["", "default", "CUDA graphs", "default", "CUDA graphs", "ours / torch (best)"]], body,
                f"The 2026 xl (2.7B) on {any_row['device']}: step time in ms (peak GB), both stacks and both "
                f"variants in one invocation (run {any_row['run'][:15]}..., commit {row_commit(any_row)}, "
                f"{any_row['env']['date'][:10]}); ours' parts as the stack is defined now. A CUDA-graph step's peak "
                "leaves out its graph's pool.", size=8)
    fused_path = res.path(H200_2026_DIR) / "train_step_fused_residual_norm.jsonl"
    fused = [r for r in read_jsonl(fused_path) if measured(r)] if fused_path.exists() else []
    fused_phrases = []
    for r in fused:
        key = (r["context_length"], r["batch_size"])
        torch_best = min((rows[(*key, "torch", v)] for v in VARIANTS if (*key, "torch", v) in rows),
                         key=lambda t: t["step_ms"], default=None)
        ours_default = rows.get((*key, "ours", "default"))
        if torch_best and ours_default:
            fused_phrases.append(f"at {shape_label(*key)} {num(r['step_ms'], 1)} ms against {num(ours_default['step_ms'], 1)}"
                                 f" without ({times(r['step_ms'] / torch_best['step_ms'], 3)} torch's best, rows of "
                                 f"two invocations) at a peak of {num(r['peak_gb'], 1)} GB")
    profiles = load_profiles(res, H200_2026_PROFILE_DIR, shape="2048x4")
    classes = []
    if all("ms_by_class" in profiles.get(s, {}) for s in STACKS):
        for names, words in KERNEL_CLASS_NAMES.items():
            ours_ms, torch_ms = (sum(profiles[s]["ms_by_class"].get(name, 0.0) for name in names)
                                 for s in ("ours", "torch"))
            classes.append(f"{words} {num(ours_ms, 1)} against {num(torch_ms, 1)}")
    shares = {s: profiles[s]["ms_by_class"].get("matmul", 0.0) / profiles[s]["wall_ms"] for s in profiles}
    return {"has": True, "table": tab,
            "ratios": join_words([f"{times(r, 3)} at {shape_label(*shape)}" for shape, r in ratios.items()]),
            "peaks": join_words([f"{num(rows[(c, b, 'ours', 'default')]['peak_gb'], 1)} GB against "
                                 f"{num(rows[(c, b, 'torch', 'default')]['peak_gb'], 1)} GB at {shape_label(c, b)}"
                                 for c, b in shapes if (c, b, "ours", "default") in rows
                                 and (c, b, "torch", "default") in rows]),
            "fused": "; ".join(fused_phrases), "has_fused": bool(fused_phrases),
            "classes": "; ".join(classes), "has_classes": bool(classes),
            "matmul_share": spread(min(shares.values()), max(shares.values()), lambda x: pct(x, 0)) if shares else DASH,
            "profile_dir": f"writeup/results/{H200_2026_PROFILE_DIR}"}


@problem("train_step")
def train_step(res, out: Output) -> dict[str, Any]:
    cases = load_train_step(res)
    if not any(step_ratio(c) for c in cases.values()):
        raise Missing("writeup/results/train_step.jsonl", "no configuration measured with both stacks (with a variant)")
    marker = MARKER
    both = {key: c for key, c in cases.items() if step_ratio(c)}
    ratios = {key: step_ratio(c) for key, c in both.items()}
    rows = [r for c in cases.values() for r in c.values()]
    device = rows[0]["device"]
    # The earlier protocol's rows (no variant): kept in the file, not compared with these.
    older = [r for r in read_jsonl(res.path("train_step.jsonl")) if "variant" not in r]

    def case_name(key) -> str:
        size, context, batch = key
        return f"{size} at {shape_label(context, batch)}"

    # What was measured, per size and shape, and what was not.
    def coverage(case: Case) -> str:
        have = [(s, v) for s in STACKS for v in VARIANTS if measured(case.get((s, v)))]
        if len(have) == len(STACKS) * len(VARIANTS):
            return "both stacks, both variants"
        return join_words([f"{s} {VARIANT_NAMES[v]}" for s, v in have]) + " only"

    measured_parts = []
    for size in sorted({s for s, _, _ in cases}, key=size_order):
        groups: dict[str, list[str]] = {}
        for (sz, c, b), case in cases.items():
            if sz == size:
                groups.setdefault(coverage(case), []).append(shape_label(c, b))
        measured_parts.append(f"{size} at " + " and at ".join(f"{join_words(shapes)} ({what})"
                                                              for what, shapes in groups.items()))
    unmeasured_sizes = [s for s in SIZES if s not in {sz for sz, _, _ in cases}]
    unmeasured_shapes = [f"{size} at {join_words([shape_label(c, b) for c, b in PLANNED_SHAPES if (size, c, b) not in cases])}"
                         for size in sorted({s for s, _, _ in cases}, key=size_order)
                         if any((size, c, b) not in cases for c, b in PLANNED_SHAPES)]
    faster_cases = {k: r for k, r in ratios.items() if r < 1}
    slower_cases = {k: r for k, r in ratios.items() if r >= 1}
    focus_key = (FOCUS["size"], FOCUS["context_length"], FOCUS["batch_size"])
    focus_case = cases.get(focus_key, {})
    focus_ours, focus_torch = best(focus_case, "ours"), best(focus_case, "torch")

    phase_sizes = {size for size, _, _ in both}
    phase_size = PHASE_SIZE if PHASE_SIZE in phase_sizes else max(phase_sizes, key=size_order)
    replay_bwd = [r["backward_ms"] for r in rows if r["variant"] == "cudagraphs" and measured(r)
                  and r.get("backward_ms") is not None]
    phases, gaps = _phase_table(both, phase_size, replay_bwd)
    bests = [(best(c, "torch"), best(c, "ours")) for c in both.values()]
    first = {s: [r["first_step_s"] for r in rows if r["stack"] == s and r.get("first_step_s")] for s in STACKS}
    # Default variants only: a CUDA-graph step's replays allocate nothing, so the timed steps' peak of a graph
    # variant leaves out the memory its graph's private pool holds.
    defaults = [(c.get(("torch", "default")), c.get(("ours", "default"))) for c in both.values()]
    peak_ratio = [o["peak_gb"] / t["peak_gb"] for t, o in defaults
                  if same_run(t, o) and o.get("peak_gb") and t.get("peak_gb")]
    default_oom = [f"{case_name(key)} ({stack})" for key, c in both.items() for stack in STACKS
                   if (c.get((stack, "default")) or {}).get("oom")]
    recompute = _recompute_rows(res, device, both)
    faster = {s: [c for c in both.values() if best(c, s)["variant"] == "cudagraphs"] for s in STACKS}
    gains = {s: {key: c[(s, "default")]["step_ms"] / c[(s, "cudagraphs")]["step_ms"] for key, c in both.items()
                 if same_run(c.get((s, "default")), c.get((s, "cudagraphs")))} for s in STACKS}
    gain = {s: list(g.values()) for s, g in gains.items()}
    most_gain = {s: case_name(max(g, key=g.get)) if g else DASH for s, g in gains.items()}
    runs = sorted({r["run"] for t, o in bests for r in (t, o)})
    commits = sorted({row_commit(r) for t, o in bests for r in (t, o)})

    # The slower variants' rows may come from other commits than the compared ones: say which.
    def provenance(r: dict[str, Any]) -> tuple[str, str]:
        return row_commit(r), r.get("env", {}).get("date", "")[:10]

    compared = {provenance(r) for t, o in bests for r in (t, o)}
    older_slower = sorted({provenance(r) for c in both.values() for r in c.values()} - compared,
                          key=lambda commit_date: (commit_date[1], commit_date[0]))

    def gap_phrase(shape, gap) -> str:
        return (f"at {shape_label(*shape)}: forward {gap['forward']:+.1f} ms, backward {gap['backward']:+.1f} ms, "
                f"optimizer {gap['optimizer']:+.1f} ms")

    largest = [(shape, max(PHASES, key=lambda p: gap[p])) for shape, gap in gaps]
    n = {
        "device": device, "runs": join_words(runs), "commits": join_words(commits),
        "has_older_slower": bool(older_slower),
        "older_slower": ("commit " if len(older_slower) == 1 else "commits ") + join_words(
            [f"{commit} ({date})" if date else commit for commit, date in older_slower]),
        "measured": "; ".join(measured_parts),
        "unmeasured": "; ".join([*([f"{join_words(unmeasured_sizes)} at any shape"] if unmeasured_sizes else []),
                                 *unmeasured_shapes]),
        "has_unmeasured": bool(unmeasured_sizes or unmeasured_shapes),
        "planned": join_words([shape_label(c, b) for c, b in PLANNED_SHAPES]),
        "n_older": str(len(older)), "has_older": bool(older),
        "older_devices": join_words(sorted({r.get("device", "?") for r in older})),
        "older_dates": value_range(sorted({r.get("env", {}).get("date", "")[:10] for r in older}),
                                   fmt=str) if older else DASH,
        "cases": str(len(both)),
        "faster": join_words([f"{case_name(k)} ({times(r, 3)})" for k, r in faster_cases.items()]),
        "slower": join_words([f"{case_name(k)} ({times(r, 3)})" for k, r in slower_cases.items()]),
        "has_faster": bool(faster_cases), "has_slower": bool(slower_cases),
        "range": spread(min(ratios.values()), max(ratios.values()), lambda x: times(x, 3)),
        "marker": marker, "has_earlier": any(earlier_torch(c) for c in both.values()),
        "first_torch": value_range(first["torch"]), "first_ours": value_range(first["ours"]),
        "peak_ratio": spread(min(peak_ratio), max(peak_ratio)) if peak_ratio else DASH,
        "default_oom": join_words(default_oom), "has_default_oom": bool(default_oom),
        "recompute": recompute, "has_recompute": bool(recompute),
        "cg_best_ours": str(len(faster["ours"])), "cg_best_torch": str(len(faster["torch"])),
        "cg_gain_ours": spread(min(gain["ours"]), max(gain["ours"])) if gain["ours"] else DASH,
        "cg_gain_torch": spread(min(gain["torch"]), max(gain["torch"])) if gain["torch"] else DASH,
        "cg_most": (f"{most_gain['ours']} for both" if most_gain["ours"] == most_gain["torch"] else
                    f"{most_gain['ours']} for ours and {most_gain['torch']} for torch"),
        "focus_case": case_name(focus_key), "has_focus": bool(focus_ours and focus_torch),
        "focus_ratio": times(step_ratio(focus_case), 3) if focus_ours and focus_torch else DASH,
        "focus_ours_mfu": pct(focus_ours.get("mfu"), 1) if focus_ours else DASH,
        "focus_ours_variant": VARIANT_NAMES[focus_ours["variant"]] if focus_ours else DASH,
        "focus_ours_ms": num(focus_ours["step_ms"], 1) if focus_ours else DASH,
        "focus_torch_ms": num(focus_torch["step_ms"], 1) if focus_torch else DASH,
        "focus_torch_variant": VARIANT_NAMES[focus_torch["variant"]] if focus_torch else DASH,
        "focus_torch_mfu": pct(focus_torch.get("mfu"), 1) if focus_torch else DASH,
        "phase_size": phase_size, "phase_variant": VARIANT_NAMES[PHASE_VARIANT],
        "gaps": "; ".join(gap_phrase(shape, gap) for shape, gap in gaps),
        "largest": join_words([f"the {p} at {shape_label(*shape)}" for shape, p in largest]),
        "opt_slower_all": bool(gaps) and all(gap["optimizer"] > 0 for _, gap in gaps),
        "opt_gap": value_range([gap["optimizer"] for _, gap in gaps]),
        "profile": _profile_numbers(load_profiles(res)),
        "h200_2026": _h200_2026(res),
    }
    return {"tables": {"stacks": _stacks_table(both), "main": _main_table(cases, marker), "phases": phases},
            "figures": {"main": _ratio_figure(out, cases)}, "n": n}


# -----------------------------------------------------------------------------------------------
# fused_adamw
# -----------------------------------------------------------------------------------------------

ADAMW_PROVIDERS = ("ours", "torch_fused", "torch_foreach", "basics")
DTYPE_BYTES = {"fp32": accounting.FP32, "bf16": accounting.BF16}


def adamw_moment_dtype(provider: str, dtype: str) -> str:
    """Ours keeps float32 moments whatever the parameters' dtype (by design: bf16 moments lose small updates); PyTorch's AdamWs and the
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
KEY_TILE = 128  # the auto rule counts key tiles of 128 (FlashConfig.hopper_min_programs, cs336_systems/attention/config.py)
ONE_PASS_MIN_KEY_TILES = 256  # from these many key tiles on, the "auto" backward is the one-pass variant


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
         "no_env": not any(r.get("env") for r in rows)}
    return {"tables": {"main": tab}, "n": n}
