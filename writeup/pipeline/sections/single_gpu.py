"""Sections on benchmarking and profiling on one GPU (and, beyond the assignment, activation checkpointing)."""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

from cs336_basics.model import MODEL_SIZES
from cs336_systems.bench.common.memory import GRADIENTS, OPTIMIZER_STATE, PREEXISTING, WEIGHTS
from pipeline import accounting, editions, figures
from pipeline.editions import size_name
from pipeline.markup import DASH, gb, join_words, num, pct, pm, short_kernel, span, spread, table, times
from pipeline.results import Missing, main_device, measured_at, measured_when
from pipeline.sections.registry import Output, problem

SIZES = list(MODEL_SIZES)  # small ... 2.7B, the order every table uses
MODE_LABEL = {"forward": "forward", "forward_backward": "forward + backward", "train_step": "training step"}


def by(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    """The rows whose keys equal ``match``."""
    return [row for row in rows if all(row.get(k) == v for k, v in match.items())]


def one(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    found = by(rows, **match)
    return found[-1] if found else None


def size_order(size: str) -> int:
    return SIZES.index(size) if size in SIZES else len(SIZES)


def oom_or(row: dict[str, Any] | None, text: str) -> str:
    if row is None:
        return DASH
    if row.get("oom") and row.get("oom_estimate_gb"):  # not tried: the estimate exceeds the GPU's memory
        return f"OOM (≈ {num(row['oom_estimate_gb'], 0)} GB)"
    return "OOM" if row.get("oom") else text


def cv(row: dict[str, Any]) -> float:
    return row["std_ms"] / row["mean_ms"]


# -----------------------------------------------------------------------------------------------
# benchmarking_script
# -----------------------------------------------------------------------------------------------


def load_benchmarking_script(res) -> tuple[list[dict], list[dict]]:
    rows = [row for row in res.rows("benchmarking_script", one_device=False)
            if not row.get("compile") and row.get("attention", "naive") == "naive"]
    device = main_device(rows)
    on_main = {row["size"] for row in rows if row.get("device") == device}
    # A size the main GPU has no rows of (10B: its fp32 weights and gradients alone exceed an H100's 80 GB) comes
    # from the GPU that measured it, and its table row names that GPU.
    rows = [row for row in rows if row.get("device") == device or row["size"] not in on_main]
    sweep = [row for row in rows if row.get("tag", "sweep") == "sweep" and row.get("warmup") == 5]
    study = [row for row in rows if row.get("tag") == "warmup_study"]
    return sweep, study


@problem("benchmarking_script")
def benchmarking_script(res, out: Output) -> dict[str, Any]:
    sweep, study = load_benchmarking_script(res)
    fp32 = [row for row in sweep if row.get("dtype") == "fp32" and not row.get("oom")]
    sizes = sorted({row["size"] for row in fp32}, key=size_order)
    tried = [row for row in sweep if row.get("dtype") == "fp32"]  # out-of-memory rows too
    body = []
    main_gpu = main_device(tried) if tried else ""
    elsewhere = {}  # size -> the GPU of its rows, where it is not the table's
    for size in sorted({row["size"] for row in tried}, key=size_order):
        fwd, fb, step = (one(tried, size=size, mode=m) for m in ("forward", "forward_backward", "train_step"))
        gpu = next(row.get("device", "") for row in tried if row["size"] == size)
        if gpu != main_gpu:
            elsewhere[size] = gpu
        body.append([
            size_name(size) + ("†" if size in elsewhere else ""),
            oom_or(fwd, pm(fwd and fwd.get("mean_ms"), fwd and fwd.get("std_ms"))),
            oom_or(fb, pm(fb and fb.get("backward_mean_ms"), fb and fb.get("backward_std_ms"))),
            oom_or(fb, pm(fb and fb.get("mean_ms"), fb and fb.get("std_ms"))),
            oom_or(step, pm(step and step.get("mean_ms"), step and step.get("std_ms"))),
            oom_or(step, pct(step and step.get("mfu"), 1)),
        ])
    first = fp32[0] if fp32 else {}
    caption = (f"End-to-end timings, fp32, batch {first.get('batch_size')}, context {first.get('context_length')}, "
               f"{first.get('warmup')} warm-up and {first.get('steps')} timed steps: mean ± standard deviation (ms). "
               "Backward is timed inside the forward + backward step; MFU of the training step is against the "
               "bf16 matmul rate measured in the same run." + oom_note(tried)
               + "".join(f" † Measured on {gpu} (the other sizes on {main_gpu})." for gpu in
                         dict.fromkeys(elsewhere.values())))
    main = table(["size", "forward", "backward", "forward + backward", "training step", "MFU"], body, caption)

    # Variability: which (size, mode) cases have a standard deviation above 5 % of the mean.
    cases = [(row["size"], row["mode"], cv(row)) for row in fp32 if row.get("mode") in ("forward", "forward_backward")]
    noisy = sorted((c for c in cases if c[2] > 0.05), key=lambda c: -c[2])
    # The backward over the forward as the table prints them: its backward column over its forward column.
    bwd_over_fwd = []
    for size in sizes:
        fwd, fb = one(fp32, size=size, mode="forward"), one(fp32, size=size, mode="forward_backward")
        if fwd and fb and fb.get("backward_mean_ms") and fwd.get("mean_ms"):
            bwd_over_fwd.append(fb["backward_mean_ms"] / fwd["mean_ms"])
    small, big = (one(fp32, size=sizes[0], mode="forward"), one(fp32, size=sizes[-1], mode="forward")) if sizes else (None, None)
    n = {
        "fwd_small": num(small and small["mean_ms"]), "fwd_big": num(big and big["mean_ms"]),
        "size_small": size_name(sizes[0]) if sizes else DASH, "size_big": size_name(sizes[-1]) if sizes else DASH,
        "bwd_ratio": spread(min(bwd_over_fwd), max(bwd_over_fwd)) if bwd_over_fwd else DASH,
        "bwd_ratio_lo": bwd_over_fwd and min(bwd_over_fwd), "bwd_ratio_hi": bwd_over_fwd and max(bwd_over_fwd),
        "std_lo": pct(min(c for _, _, c in cases), 1) if cases else DASH,
        "std_hi": pct(max(c for _, _, c in cases), 0) if cases else DASH,
        "quiet": f"{len(cases) - len(noisy)} of {len(cases)}",
        "noisy": join_words([f"{size_name(s)} {MODE_LABEL[m]} ({pct(c)})" for s, m, c in noisy]) or "none",
        "has_noisy": bool(noisy),
        "oom_sizes": join_words(list(dict.fromkeys(size_name(r["size"]) for r in tried if r.get("oom")))),
        "oom_cases": join_words(list(dict.fromkeys(f"{size_name(r['size'])} {MODE_LABEL.get(r['mode'], r['mode'])}"
                                                   for r in tried if r.get("oom")))),
    }
    study_table, study_figure, study_n = warmup_study(study, out)
    result = {"tables": {"main": main, "study": study_table}, "figures": {"warmup": study_figure}, "n": n | study_n}
    if editions.current() == "2026" and not any(row["size"] == "10B" for row in tried):  # (b) asks for every size
        result["missing_parts"] = {"b": "writeup/results/benchmarking_script.jsonl (no fp32 rows of the 10B model, "
                                        "measured or out of memory)"}
    return result


def oom_note(rows: list[dict[str, Any]]) -> str:
    """The caption's note on the sizes that did not fit, with the estimate that ruled them out (if any)."""
    notes = list(dict.fromkeys(f"{size_name(row['size'])} {MODE_LABEL.get(row.get('mode'), row.get('mode'))}: "
                               f"{row['oom_reason']}" for row in rows if row.get("oom") and row.get("oom_reason")))
    return f" OOM: out of memory ({'; '.join(notes)})." if notes else (" OOM: out of memory." if any(
        row.get("oom") for row in rows) else "")


def warmup_study(study: list[dict], out: Output) -> tuple[dict, dict, dict]:
    """The warm-up study's table, its figure of every step, and its numbers."""
    if not study:
        raise Missing("writeup/results/benchmarking_script.jsonl", "no warm-up study rows (--warmup-study)")
    warmups = sorted({row["warmup"] for row in study})
    sizes = sorted({row["size"] for row in study}, key=size_order)
    body = []
    first_size = study[0]["size"]  # rows are written in measurement order
    warmed = "†"  # the process had already run the sizes above: its one-off costs were paid
    for size in sizes:
        cells = [size_name(size)]
        for w in warmups:
            row = one(study, size=size, warmup=w)
            mark = warmed if w == 0 and size != first_size else ""
            cells.append(oom_or(row, pm(row and row.get("mean_ms"), row and row.get("std_ms")) + mark))
        first = one(study, size=size, warmup=0)
        rest = first and first.get("step_ms", [])[1:]
        cells.append(oom_or(first, f"{num(first['step_ms'][0])} / {num(statistics.median(rest))}" if rest else DASH))
        body.append(cells)
    header = ["size", *[f"{w} warm-up" for w in warmups], "first / median of rest (0 warm-up)"]
    tab = table(header, body, "Forward + backward step (fp32), mean ± std over 10 timed steps (ms), for "
                f"{join_words([str(w) for w in warmups])} warm-up steps; each warm-up count ran in one fresh process "
                f"that measured the sizes in this order. {warmed}: not a cold start, since the same process had "
                f"already run the sizes above (only the {size_name(first_size)} model's first step pays the "
                "process's one-off "
                "costs).")
    fig, axes = figures.new(7.0, 2.3, ncols=len(sizes))
    for ax, size in zip(axes, sizes):
        for w in warmups:
            row = one(study, size=size, warmup=w)
            if row and row.get("step_ms"):
                ax.plot(range(1, len(row["step_ms"]) + 1), row["step_ms"], marker=".", label=f"{w} warm-up")
        ax.set_title(size_name(size))
        ax.set_xlabel("timed step")
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("ms")
    figures.legend_below(fig, axes[0])
    figure = out.save(fig, "warmup_study", "Every timed step of the warm-up study (forward + backward, fp32).")
    zero = [one(study, size=s, warmup=0) for s in sizes]
    slowdowns = {r["size"]: r["step_ms"][0] / statistics.median(r["step_ms"][1:]) for r in zero
                 if r and not r.get("oom") and len(r.get("step_ms", [])) > 1}
    worst = max(slowdowns, key=slowdowns.get) if slowdowns else None
    others = [s for s in slowdowns if s != first_size]
    return tab, figure, {
        "first_size": size_name(first_size),
        "first_slowdown": times(slowdowns.get(first_size), 1),
        "first_ms": num(zero[sizes.index(first_size)]["step_ms"][0]) if first_size in sizes else DASH,
        "worst_size": size_name(worst) if worst else DASH,
        "others_max_slowdown": times(max((slowdowns[s] for s in others), default=float("nan")), 2),
    }


# -----------------------------------------------------------------------------------------------
# nsys_profile
# -----------------------------------------------------------------------------------------------


_GEMM_TILE = re.compile(r"tilesize(\d+x\d+)|_(\d+x\d+)_\d+x\d+")
_KERNEL_OPS = [  # (a fragment of the kernel name, what the kernel does)
    ("masked_fill", "masked_fill"), ("DivFu", "div"), ("MulFu", "mul"), ("CUDAFunctorOnSelf_add", "add (in place)"),
    ("CUDAFunctor_add", "add"), ("direct_copy", "copy / cast"), ("MeanOps", "mean"), ("MaxOps", "max"),
    ("SumOps", "sum"), ("lerp", "lerp"), ("addcdiv", "addcdiv"), ("addcmul", "addcmul"), ("exp_kernel", "exp"),
    ("sigmoid", "sigmoid"), ("rsqrt", "rsqrt"), ("sqrt", "sqrt"), ("pow", "pow"), ("gather", "gather (embedding)"),
    ("FillFunctor", "fill"), ("where", "where"), ("neg", "neg"), ("softmax", "softmax"), ("cat", "cat"),
]


def describe_kernel(name: str) -> str:
    """A readable label for a CUDA kernel: GEMMs by library, layout and tile; ATen kernels by their operation."""
    if "gemm" in name.lower():
        tile = _GEMM_TILE.search(name)
        library = "CUTLASS" if "cutlass" in name else "cuBLAS"
        kind = "SGEMM" if ("f32f32" in name or "sgemm" in name) else "GEMM"
        layout = next((f" {lay}" for lay in ("_tn_", "_nn_", "_nt_", "_tt_") if lay in name), "").replace("_", "")
        split = ", split-K" if "split_k" in name else ""
        return f"{library} {kind}{layout} {tile.group(1) or tile.group(2) if tile else ''}{split}".strip()
    if name.startswith("Memcpy"):
        return name
    kind = "reduce" if "reduce_kernel" in name else "elementwise"
    for fragment, label in _KERNEL_OPS:
        if fragment in name:
            return f"{kind}: {label}"
    return short_kernel(name, 50)


def is_annotation(name: str) -> bool:
    """Profiler range names (``Optimizer.step#AdamW.step``) that appear among GPU events but are not kernels."""
    return "#" in name or name.startswith(("Optimizer.", "ProfilerStep"))


def top_kernel(phase: dict[str, Any]) -> dict[str, Any] | None:
    kernels = [k for k in phase.get("top_kernels", []) if not is_annotation(k["name"])]
    return kernels[0] if kernels else None


def top_kernel_of(*phases: dict[str, Any]) -> dict[str, Any] | None:
    """The kernel with the most GPU time over several phases (forward and backward: one forward + backward
    pass), from each phase's list of its heaviest kernels: times and calls summed by kernel name."""
    total: dict[str, dict[str, Any]] = {}
    for phase in phases:
        for k in phase.get("top_kernels", []):
            if is_annotation(k["name"]):
                continue
            entry = total.setdefault(k["name"], {"name": k["name"], "ms": 0.0, "calls": 0})
            entry["ms"] += k["ms"]
            entry["calls"] += k["calls"]
    return max(total.values(), key=lambda k: k["ms"]) if total else None


@problem("nsys_profile")
def nsys_profile(res, out: Output) -> dict[str, Any]:
    rows = sorted(res.rows("nsys_profile"), key=lambda r: (size_order(r["size"]), r["context_length"]))
    ok = [row for row in rows if not row.get("oom")]
    contexts = sorted({row["context_length"] for row in rows})
    sizes = sorted({row["size"] for row in rows}, key=size_order)

    timing = []
    for size in sizes:
        cells = [size]
        for ctx in contexts:
            row = one(rows, size=size, context_length=ctx)
            cells.append(oom_or(row, row and not row.get("oom") and
                                f"{num(row['forward']['gpu_ms'])} / {num(row['forward_python_ms'])}" or DASH))
        timing.append(cells)
    timing_table = table(["size", *[f"context {c}" for c in contexts]], timing,
                         "Forward pass: GPU time of its kernels (profiler) / Python timer (median of 5), ms, "
                         "fp32, batch 4; OOM: out of memory during the training step.")

    kernels, top_forward = [], []
    for row in ok:
        fwd, both = top_kernel(row["forward"]), top_kernel_of(row["forward"], row["backward"])
        top_forward.append(fwd)
        kernels.append([
            f"{row['size']} / {row['context_length']}",
            describe_kernel(fwd["name"]) if fwd else DASH, num(fwd and fwd["calls"], 0), pct(fwd and fwd["share"]),
            "same" if fwd and both and both["name"] == fwd["name"] else (describe_kernel(both["name"]) if both else DASH),
            pct(row["forward"].get("matmul_share")), pct(row["train_step"].get("matmul_share")),
        ])
    kernel_table = table(
        ["size / context", "top forward kernel", "calls", "share", "top in forward + backward", "matmul (fwd)",
         "matmul (step)"], kernels,
        "The kernel with the most GPU time in the forward pass (calls per forward pass, share of forward GPU time), "
        "the kernel with the most GPU time over forward + backward (the forward's and backward's kernels summed by "
        "name), and the matmul share of GPU time in the forward and in the training step with AdamW.",
        align=["left", "left", "right", "right", "left", "right", "right"], size=7)

    # Non-matmul kernels of the largest configuration that fits.
    largest = max(ok, key=lambda r: (size_order(r["size"]), r["context_length"])) if ok else None
    non_matmul = []
    if largest:
        for k in largest["forward"].get("top_non_matmul", [])[:6]:
            non_matmul.append([describe_kernel(k["name"]), num(k["ms"], 2), num(k["calls"], 0), pct(k["share"], 1)])
    non_matmul_table = table(["non-matmul kernel (forward)", "ms", "calls", "share"], non_matmul,
                             f"The heaviest non-matmul kernels of the forward pass, {largest['size']} model, context "
                             f"{largest['context_length']}." if largest else "", size=8)

    attention = []
    for row in ok:
        stages = row["attention_forward"]
        scores, softmax, final = (stages.get(k, {}) for k in ("computing attention scores", "computing softmax",
                                                               "final matmul"))
        matmul_ms = scores.get("gpu_ms", 0) + final.get("gpu_ms", 0)
        matmul_flops = scores.get("flops", 0) + final.get("flops", 0)
        attention.append([
            f"{row['size']} / {row['context_length']}", num(scores.get("gpu_ms"), 2), num(softmax.get("gpu_ms"), 2),
            num(final.get("gpu_ms"), 2), times(softmax.get("gpu_ms", 0) / matmul_ms if matmul_ms else None),
            times(softmax.get("flops", 0) / matmul_flops if matmul_flops else None, 3),
        ])
    attention_table = table(["size / context", "scores (ms)", "softmax (ms)", "final matmul (ms)",
                             "softmax / matmuls: time", "FLOPs"], attention,
                            "Inside the forward's attention (all layers, per step): GPU time of the three stages, and "
                            "softmax relative to the two matmuls in time and in FLOPs.", size=8)

    gaps = [abs(r["forward"]["gpu_ms"] - r["forward_python_ms"]) / r["forward_python_ms"] for r in ok]
    big_ctx = [r for r in ok if r["context_length"] >= 512]
    close = [r for r in big_ctx if abs(r["forward"]["gpu_ms"] - r["forward_python_ms"]) / r["forward_python_ms"] < 0.1]
    small_ctx = [r for r in ok if r["context_length"] <= 256]
    time_ratio = [a[4] for a in attention]
    fwd_share = [r["forward"]["matmul_share"] for r in ok]
    step_share = [r["train_step"]["matmul_share"] for r in ok]
    backward_kernels = [r["backward"].get("kernel_launches", 0) for r in ok]
    ratios = [float(t.rstrip("×").replace(",", "")) for t in time_ratio if t != DASH]
    flop_ratios = [float(a[5].rstrip("×").replace(",", "")) for a in attention if a[5] != DASH]
    # The table's FLOP column per head dimension (softmax's FLOPs per score are fixed, the matmuls' grow with d).
    by_head_dim: dict[int, set[str]] = {}
    for row, cells in zip(ok, attention):
        hp = MODEL_SIZES.get(row["size"])
        if hp and cells[5] != DASH:
            by_head_dim.setdefault(hp["d_model"] // hp["num_heads"], set()).add(cells[5])
    n = {
        "close": f"{len(close)} of {len(big_ctx)}",
        "python_over_gpu_small_ctx": times(statistics.median(r["forward_python_ms"] / r["forward"]["gpu_ms"]
                                                             for r in small_ctx), 1) if small_ctx else DASH,
        "max_gap": pct(max(gaps)) if gaps else DASH,
        "ooms": join_words([f"{r['size']} at context {r['context_length']}" for r in rows if r.get("oom")]) or "none",
        "fwd_share_lo": pct(min(fwd_share)), "fwd_share_hi": pct(max(fwd_share)),
        "step_share_lo": pct(min(step_share)), "step_share_hi": pct(max(step_share)),
        "softmax_time_lo": times(min(ratios), 2) if ratios else DASH,
        "softmax_time_hi": times(max(ratios), 2) if ratios else DASH,
        # The FLOP ratio falls with the head dimension (the matmuls' FLOPs per score grow with it): the table's range.
        "softmax_flops": spread(min(flop_ratios), max(flop_ratios), fmt=lambda x: times(x, 3)) if flop_ratios else DASH,
        "backward_broken": bool(backward_kernels) and max(backward_kernels) <= 1,
        "same_top": f"{sum(k[4] == 'same' for k in kernels)} of {len(kernels)}",
        "top_family": join_words(sorted({" ".join(describe_kernel(k["name"]).split()[:3]) for k in top_forward if k})),
        "calls_lo": num(min((k["calls"] for k in top_forward if k), default=None), 0),
        "calls_hi": num(max((k["calls"] for k in top_forward if k), default=None), 0),
        "calls": spread(min((k["calls"] for k in top_forward if k), default=None),
                        max((k["calls"] for k in top_forward if k), default=None), fmt=lambda x: num(x, 0)),
        "top_share": spread(min((k["share"] for k in top_forward if k), default=None),
                            max((k["share"] for k in top_forward if k), default=None), fmt=pct),
        "fwd_share": spread(min(fwd_share), max(fwd_share), fmt=pct) if fwd_share else DASH,
        "step_share": spread(min(step_share), max(step_share), fmt=pct) if step_share else DASH,
        "softmax_time": spread(min(ratios), max(ratios)) if ratios else DASH,
        "softmax_flops_by_head_dim": join_words([f"{' or '.join(sorted(v))} at head dimension {d}"
                                                 for d, v in sorted(by_head_dim.items())]),
        "non_matmul": join_words(list(dict.fromkeys(r[0].split(": ")[-1] for r in non_matmul))),
        "other_tops": join_words(sorted({k[4] for k in kernels if k[4] not in ('same', DASH)})) or "none",
        "other_top_family": join_words(sorted({" ".join(k[4].split()[:3]) for k in kernels if k[4] not in ('same', DASH)})) or "none",
    }
    return {"tables": {"timing": timing_table, "kernels": kernel_table, "non_matmul": non_matmul_table,
                       "attention": attention_table}, "n": n}


# -----------------------------------------------------------------------------------------------
# mixed_precision_accumulation, benchmarking_mixed_precision
# -----------------------------------------------------------------------------------------------


@problem("mixed_precision_accumulation")
def mixed_precision_accumulation(res, out: Output) -> dict[str, Any]:
    rows = res.rows("mixed_precision_accumulation")
    body = [[row["variant"], f"{row['result']:.6f}", f"{row['error']:+.2e}", f"{row['summand']:.10f}"] for row in rows]
    tab = table(["accumulation", "sum of 1000 × 0.01", "error", "summand as stored"], body,
                "Summing 0.01 a thousand times (exact answer 10).", align=["left", "right", "right", "right"])
    fp16 = one(rows, accumulator="float16") or {}
    fp32 = one(rows, accumulator="float32", value="float32") or {}
    mixed = one(rows, accumulator="float32", value="float16", upcast=False) or {}
    return {"tables": {"main": tab}, "n": {
        "fp16_result": f"{fp16.get('result', float('nan')):.4f}", "fp32_error": f"{fp32.get('error', float('nan')):.1e}",
        "mixed_error": f"{mixed.get('error', float('nan')):.1e}", "fp16_summand": f"{mixed.get('summand', float('nan')):.8f}",
    }}


@problem("benchmarking_mixed_precision")
def benchmarking_mixed_precision(res, out: Output) -> dict[str, Any]:
    dtype_rows = res.rows("benchmarking_mixed_precision")
    casts = [row["autocast"] for row in dtype_rows]
    names = list(dict.fromkeys(k for row in dtype_rows for k in row["dtypes"]))
    body = [[name, *[row["dtypes"].get(name, DASH).removeprefix("torch.") for row in dtype_rows]] for name in names]
    dtypes = table(["tensor", *[f"autocast {c}" for c in casts]], body,
                   "Dtypes inside the toy model under autocast, printed by the benchmarking_mixed_precision script.",
                   align=["left"] + ["center"] * len(casts))

    sweep, _ = load_benchmarking_script(res)
    sizes = sorted({row["size"] for row in sweep}, key=size_order)
    timing = []
    speedups: dict[str, dict[str, float]] = {}
    for size in sizes:
        cells = [size_name(size)]
        for mode in ("forward", "forward_backward", "train_step"):
            f32, b16 = one(sweep, size=size, mode=mode, dtype="fp32"), one(sweep, size=size, mode=mode, dtype="bf16")
            ok = f32 and b16 and not f32.get("oom") and not b16.get("oom")
            cells += [oom_or(f32, num(f32 and f32.get("mean_ms"))), oom_or(b16, num(b16 and b16.get("mean_ms"))),
                      times(f32["mean_ms"] / b16["mean_ms"]) if ok else DASH]
            if ok:
                speedups.setdefault(mode, {})[size] = f32["mean_ms"] / b16["mean_ms"]
        timing.append(cells)
    header = [["", span("forward", 3), span("forward + backward", 3), span("training step", 3)],
              ["size", *["fp32", "bf16", "speed-up"] * 3]]
    timing_table = table(header, timing, "fp32 vs bf16 autocast, mean over 10 steps after 5 warm-up (ms); "
                         "speed-up = fp32 time / bf16 time.", size=8)
    step = speedups.get("train_step", {})
    slower = [s for s, x in speedups.get("forward", {}).items() if x < 1]
    n = {
        "step_speedup_small": times(step.get(sizes[0])) if sizes else DASH,
        "step_speedup_best": times(max(step.values(), default=float("nan"))),
        "step_speedup_big": times(step.get(sizes[-1])) if sizes else DASH,
        "best_fwd": times(max(speedups.get("forward", {}).values(), default=float("nan"))),
        "best_fwd_size": size_name(max(speedups.get("forward", {}), key=speedups["forward"].get)) if speedups.get(
            "forward") else DASH,
        "slower": join_words([size_name(size) for size in slower]) or "no size",
        "size_small": size_name(sizes[0]) if sizes else DASH, "size_big": size_name(sizes[-1]) if sizes else DASH,
    }
    return {"tables": {"dtypes": dtypes, "timing": timing_table}, "n": n}


# -----------------------------------------------------------------------------------------------
# memory_profiling
# -----------------------------------------------------------------------------------------------


MEMORY_FILE = "writeup/results/memory_profiling.jsonl"
VOCAB_SIZE = 10_000  # the benchmarked model's (cs336_systems.bench.common.lm)
PEAK_COLUMNS = (("inference", "inference"), ("forward", "forward"), ("train_step", "training step"))
TIMELINE_MODE = {"inference": "forward pass only (inference, torch.inference_mode)",
                 "forward": "forward pass with autograd recording", "train_step": "training step (AdamW)"}
# The timelines part (a) shows, by name: (mode, dtype), each at the longest context recorded for it.
TIMELINES = {"forward": ("forward", "fp32"), "train_step": ("train_step", "fp32"), "inference": ("inference", "fp32")}
MODEL_STATE = (WEIGHTS, OPTIMIZER_STATE, GRADIENTS)


def longest(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    """The row of the longest context among those whose keys equal ``match``."""
    found = by(rows, **match)
    return max(found, key=lambda row: row["context_length"]) if found else None


def gpu_of(row: dict[str, Any]) -> str:
    """The GPU a row was measured on, by its name (``NVIDIA H200``)."""
    return (row.get("env") or {}).get("gpu_name") or row.get("device", "?")


def load_memory_profiling(res) -> list[dict[str, Any]]:
    """The edition's rows of ``memory_profiling.jsonl``: the peaks and block residuals of one device (the one with
    the most peak rows), and the timelines of the latest recording, whichever device made it (they are drawn with
    every allocation coloured by what it holds, beside PyTorch's viewer page)."""

    def chosen(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        peaks = [row for row in rows if row.get("kind") == "peak"]
        if not peaks:
            raise Missing(MEMORY_FILE, "no peak rows")
        device = main_device(peaks)
        timelines = [row for row in rows if row.get("kind") == "timeline"]
        recorder = max(timelines, key=measured_when)["device"] if timelines else None
        return [row for row in rows if row.get("device") == (recorder if row.get("kind") == "timeline" else device)]

    return res.rows("memory_profiling", one_device=False, keep=chosen)


def memory_peak_table(peaks: list[dict], size: str, batch: int) -> dict[str, Any]:
    contexts = sorted({row["context_length"] for row in peaks})
    dtypes = [d for d in ("fp32", "bf16") if any(row["dtype"] == d for row in peaks)]
    body = []
    for ctx in contexts:
        cells = [str(ctx)]
        for dtype in dtypes:
            for mode, _ in PEAK_COLUMNS:
                row = one(peaks, context_length=ctx, dtype=dtype, mode=mode)
                cells.append(oom_or(row, num(row and row.get("peak_gb"))))
        body.append(cells)
    header = [["", *[span(d, len(PEAK_COLUMNS)) for d in dtypes]],
              ["context", *[label for _, label in PEAK_COLUMNS] * len(dtypes)]]
    notes = ("; a dash: not measured" if any(DASH in c for r in body for c in r) else "") + (
        "; OOM: out of memory" if any("OOM" in c for r in body for c in r) else "")
    return table(header, body, f"Peak allocated memory (GB) of the {size_name(size)} model, batch {batch}, "
                 f"on {gpu_of(peaks[0])}, over three steps of a freshly built model (weights included). Inference: "
                 "the forward pass under torch.inference_mode (no autograd graph); forward: the forward pass with "
                 "autograd recording, as in training; training step: forward, loss, backward and AdamW. bf16 means "
                 f"autocast with fp32 parameters{notes}.", size=8)


def largest_allocations_table(row: dict[str, Any], sizes: dict[int, str]) -> dict[str, Any]:
    """The largest allocations of one snapshot: size, how often, the innermost model frame, its caller, what the
    allocation holds (from its stack) and the tensor of the model that has this size."""
    body = []
    for a in row.get("largest_allocations", [])[:6]:
        stack = a.get("stack") or [a["source"]]
        body.append([num(a["mb"], 1), str(a["count"]), a["source"], stack[1] if len(stack) > 1 else DASH,
                     a.get("category", DASH), sizes.get(round(a["mb"] * 2**20), DASH)])
    caption = (f"Largest allocations in the memory snapshot of the {TIMELINE_MODE[row['mode']]}, {row['dtype']}, "
               f"context {row['context_length']} ({passes(row)}): size, how many times, the innermost frame of the "
               "model code that made it (file:line function), its caller, what it holds (read from the stack) and "
               "the model tensor of that size.")
    return table(["MiB", "count", "allocated at", "called from", "holds", "tensor of this size"], body, caption,
                 align=["right", "right", "left", "left", "left", "left"], size=7)


def passes(row: dict[str, Any]) -> str:
    """How many passes a snapshot recorded, in words (``one pass``, ``3 passes``)."""
    steps = row.get("steps_recorded", 3)
    return "one pass" if steps == 1 else f"{steps} passes"


def largest_allocation_numbers(row: dict[str, Any] | None, batch: int, heads: int, d_ff: int) -> dict[str, Any]:
    if row is None or not row.get("largest_allocations"):
        return {"pending": True}
    ctx = row["context_length"]
    sizes = tensor_names(batch, ctx, row["size"])
    top = row["largest_allocations"][0]
    same = [a for a in row["largest_allocations"] if a["mb"] == top["mb"]]
    return {"pending": False, "mib": num(top["mb"], 0), "count": str(sum(a["count"] for a in same)),
            "passes": passes(row), "ctx": str(ctx),
            "sources": join_words([a["source"] for a in same]), "what": sizes.get(round(top["mb"] * 2**20), DASH),
            "scores_mib": num(accounting.attention_scores_bytes(batch, heads, ctx, 4) / 2**20, 0),
            "ffn_mib": num(accounting.residual_stream_bytes(batch, ctx, d_ff, 4) / 2**20, 0)}


def tensor_names(batch: int, ctx: int, size: str) -> dict[int, str]:
    """The model's tensors at this context by their bytes (the first name of each size)."""
    names: dict[int, str] = {}
    for name, nbytes in accounting.model_tensor_bytes(batch, ctx, VOCAB_SIZE, **MODEL_SIZES[size]).items():
        names.setdefault(nbytes, name)
    return names


def memory_timeline_figure(out: Output, row: dict[str, Any] | None, peaks: list[dict]) -> dict[str, str] | None:
    """The timeline's PNG with its caption (``None`` while the row is missing; a row whose PNG is missing stops the
    build, naming it). The caption names PyTorch's viewer page of the same snapshot."""
    if row is None:
        return None
    # The peak quoted is the peak table's for the same case on the same GPU, so that caption and table agree.
    peak = one(peaks, context_length=row["context_length"], dtype=row["dtype"], mode=row["mode"], device=row["device"])
    if peak and peak.get("peak_gb"):
        peak_text = f"peak {gb(peak['peak_gb'])} (the peak table)"
    else:
        peak_text = f"peak of this recording {gb(row.get('timeline_peak_gb'))}"
    name = size_name(row["size"])
    model = f"{name} model" if name == row["size"] else f"{name} model ({row['size']} in the plot's title)"
    viewer = f" PyTorch's viewer page: {row['html']}." if row.get("html") else (
        f" {row['html_note']}." if row.get("html_note") else "")
    return out.existing(row["figure"], f"Active memory, {model}, batch {row['batch_size']}, context "
                        f"{row['context_length']}, {row['dtype']}, {row.get('steps_recorded', 3)} × "
                        f"{TIMELINE_MODE.get(row['mode'], row['mode'])}, {gpu_of(row)}; {peak_text}.{viewer}")


def timeline_numbers(row: dict[str, Any] | None) -> dict[str, Any]:
    """What a timeline shows at its peak: the memory alive before the recording, the model state (weights, AdamW
    moments, gradients) and the activations by what they hold."""
    if row is None:
        return {"shown": False}
    at_peak = row.get("peak_by_category_gb") or {}
    peak = row.get("timeline_peak_gb")
    before = row.get("before_recording_gb", at_peak.get(PREEXISTING))
    activations = {k: v for k, v in at_peak.items() if k not in (PREEXISTING, *MODEL_STATE)}
    top = max(activations, key=activations.get) if activations else None
    return {
        "shown": True, "ctx": str(row["context_length"]), "gpu": gpu_of(row), "html": row.get("html") or "",
        "peak": gb(peak), "before": gb(before), "above": gb(peak - before if peak and before else None),
        "activations": gb(sum(activations.values())), "top": top or DASH, "top_gb": gb(top and activations[top]),
        "scores_softmax": gb(sum(activations.get(k, 0.0) for k in ("attention: scores, mask", "attention: softmax"))),
        "weights": gb(at_peak.get(WEIGHTS)), "moments": gb(at_peak.get(OPTIMIZER_STATE)),
        "gradients": gb(at_peak.get(GRADIENTS)),
    }


@problem("memory_profiling")
def memory_profiling(res, out: Output) -> dict[str, Any]:
    rows = load_memory_profiling(res)
    peaks = [row for row in rows if row.get("kind") == "peak"]
    timelines = [row for row in rows if row.get("kind") == "timeline"]
    blocks = [row for row in rows if row.get("kind") == "block_residuals" and not row.get("oom")]
    size, batch = peaks[0]["size"], peaks[0]["batch_size"]
    hp = MODEL_SIZES[size]
    ctx_max = max(row["context_length"] for row in peaks)
    shown = {name: longest(timelines, mode=mode, dtype=dtype) for name, (mode, dtype) in TIMELINES.items()}
    figs = {name: memory_timeline_figure(out, row, peaks) for name, row in shown.items()}
    snapshots = {dtype: longest(timelines, mode="inference", dtype=dtype) for dtype in ("fp32", "bf16")}
    tables = {"peaks": memory_peak_table(peaks, size, batch)}
    for dtype, row in snapshots.items():
        names = tensor_names(batch, row["context_length"], size) if row else {}
        tables[f"allocations_{dtype}"] = largest_allocations_table(row, names) if row else None
    n = memory_numbers(peaks, size, batch, ctx_max)
    n["e"] = {d: largest_allocation_numbers(row, batch, hp["num_heads"], hp["d_ff"]) for d, row in snapshots.items()}
    n["tl"] = {name: timeline_numbers(row) for name, row in shown.items()}
    n["snapshot"] = (shown["inference"] or {}).get("snapshot") or DASH
    n["peaks_gpu"] = gpu_of(peaks[0])
    n["timelines_gpu"] = gpu_of(timelines[0]) if timelines else DASH
    n["fit"] = fit_numbers(peaks, blocks, ctx_max, hp["num_layers"])
    saved_c0 = {dtype: one(blocks, dtype=dtype, context_length=int(n["c0"])) for dtype in ("fp32", "bf16")}
    n["saved_c0"] = ({dtype: num(row["residual_mib"], 1) for dtype, row in saved_c0.items()}
                     if all(saved_c0.values()) else None)
    result = {"tables": tables, "figures": figs, "n": n}
    if blocks:
        tables["block_operations"], n["f"] = block_residuals(blocks, size, batch)
    elif editions.current() == "2026":
        result["missing_parts"] = {"f": f"{MEMORY_FILE} (no block_residuals rows: what one TransformerBlock saves "
                                        "for backward and the gradients its backward produces)"}
    return result


def fit_numbers(peaks: list[dict], blocks: list[dict], ctx: int, n_layers: int) -> dict[str, Any]:
    """Why the forward with autograd runs out of memory at context ``ctx`` (if it does): every block's saved
    activations (the block_residuals row at that context, fp32) against the GPU's memory."""
    forward = one(peaks, context_length=ctx, dtype="fp32", mode="forward")
    block = one(blocks, context_length=ctx, dtype="fp32")
    if not (forward and forward.get("oom") and block):
        return {"oom": False}
    capacity = accounting.device_memory_gb(peaks)
    return {"oom": True, "ctx": str(ctx), "gpu": gpu_of(forward), "capacity_gib": num(capacity * 1e9 / 2**30, 1),
            "block_gb": gb(block["residual_bytes"] / 1e9, 2), "blocks": str(n_layers),
            "all_gb": gb(n_layers * block["residual_bytes"] / 1e9, 0)}


def block_residuals(blocks: list[dict], size: str, batch: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Part (f): what one block saves for backward (fp32, every context), by the operation that made it, the
    five largest at each context in one table, and the gradients its backward produced against its parameters."""
    fp32 = sorted(by(blocks, dtype="fp32"), key=lambda row: row["context_length"])
    contexts = [row["context_length"] for row in fp32]
    key = lambda op: (op["op"], op["caller"])  # noqa: E731
    listed = list(dict.fromkeys(key(op) for row in fp32 for op in row["top_operations"]))
    saved = {row["context_length"]: {key(op): op for op in row["saved_by_operation"]} for row in fp32}
    longest_ctx = contexts[-1]
    listed.sort(key=lambda k: -saved[longest_ctx].get(k, {}).get("share", 0.0))
    top_five = {row["context_length"]: {key(op) for op in row["top_operations"]} for row in fp32}
    body = []
    for op, caller in listed:
        cells = [op.removeprefix("aten."), caller or DASH]
        for ctx in contexts:
            found = saved[ctx].get((op, caller))
            mark = "" if (op, caller) in top_five[ctx] else " ◦"
            cells += [num(found and found["mib"], 1), pct(found and found["share"], 1) + mark]
        body.append(cells)
    header = [["", "", *[span(f"context {c}", 2) for c in contexts]],
              ["operation (ATen)", "called in (model functions)", *["MiB", "share"] * len(contexts)]]
    first = fp32[0]
    caption = (f"What one TransformerBlock of the {size_name(size)} model saves for backward (fp32, batch {batch}, "
               f"blocks {first['blocks'][0]} to {first['blocks'][-1]} of the model measured): the five largest "
               "contributions at each context, by the ATen operation that made the saved tensor and the model "
               "functions that called it; share of the block's saved bytes (◦: not among that context's five). "
               "Totals: " + "; ".join(f"{num(r['residual_mib'], 1)} MiB in {r['residual_tensors']} tensors at "
                                     f"context {r['context_length']}" for r in fp32) + ".")
    tab = table(header, body, caption, align=["left", "left", *["right"] * (2 * len(contexts))], size=8)

    def at(row: dict[str, Any]) -> dict[str, Any]:
        top = row["top_operations"]
        after_first = row["backward_change_bytes"][1:] or row["backward_change_bytes"]
        gap = abs(row["gradient_bytes_measured"] - row["gradient_bytes_expected"])
        return {
            "ctx": str(row["context_length"]), "mib": num(row["residual_mib"], 1),
            "tensors": str(row["residual_tensors"]),
            "top_op": top[0]["op"].removeprefix("aten."), "top_caller": top[0]["caller"],
            "top_share": pct(top[0]["share"], 1), "top5_share": pct(sum(op["share"] for op in top), 0),
            "top_same_size": str(sum(op["bytes"] == top[0]["bytes"] for op in top)),
            "top_in_attention": "attention" in top[0]["caller"],
            "change": moved(statistics.median(after_first) / 2**20),
            "measured_mib": num(row["gradient_bytes_measured"] / 2**20, 1),
            "expected_mib": num(row["gradient_bytes_expected"] / 2**20, 1),
            "ratio": num(row["gradient_ratio"], 3), "gap_mib": num(gap / 2**20, 1),
            "stream_mib": num(row["residual_stream_bytes"] / 2**20, 1),
            "within_stream": gap <= row["residual_stream_bytes"],
        }

    n = {"by_ctx": [at(row) for row in fp32],
         "blocks": f"{first['blocks'][0]} to {first['blocks'][-1]}", "parameters": f"{first['block_parameters']:,}"}
    return tab, n


def moved(mib: float) -> str:
    """A change of memory in words: ``grows by 229.8 MiB``, ``falls by 8,151.3 MiB``."""
    return f"{'grows' if mib >= 0 else 'falls'} by {num(abs(mib), 1)} MiB"


def memory_numbers(peaks: list[dict], size: str, batch: int, ctx_max: int) -> dict[str, Any]:
    """The peaks and sizes the answers quote."""
    hp = MODEL_SIZES[size]
    contexts = sorted({row["context_length"] for row in peaks})
    params_gb = next((row["params_gb"] for row in peaks if row.get("params_gb")), float("nan"))
    residual = accounting.residual_stream_bytes(batch, ctx_max, hp["d_model"], 4)
    peak = {(mode, dtype): {r["context_length"]: r.get("peak_gb") for r in by(peaks, dtype=dtype, mode=mode)}
            for mode, _ in PEAK_COLUMNS for dtype in ("fp32", "bf16")}
    c0 = contexts[0]
    forward_max = one(peaks, context_length=ctx_max, dtype="fp32", mode="forward")
    return {
        "size": size_name(size), "batch": str(batch), "ctx": str(ctx_max), "d_model": f"{hp['d_model']:,}",
        "d_ff": f"{hp['d_ff']:,}", "heads": str(hp["num_heads"]), "blocks": str(hp["num_layers"]),
        "residual_bytes": f"{residual:,}", "residual_mib": num(residual / 2**20, 1), "residual_mb": num(residual / 1e6, 1),
        "residual_mib_c0": num(accounting.residual_stream_bytes(batch, c0, hp["d_model"], 4) / 2**20, 1),
        "weight_mib": num(hp["d_model"] * hp["d_ff"] * 4 / 2**20, 0),
        "params_gb": num(params_gb, 1), "state_gb": num(4 * params_gb, 1), "half_params_gb": num(params_gb / 2, 1),
        "c0": str(c0), "cmax_oom": bool(forward_max and forward_max.get("oom")),
        "fwd_fp32_c0": gb(peak["forward", "fp32"].get(c0)), "fwd_bf16_c0": gb(peak["forward", "bf16"].get(c0)),
        "step_fp32_c0": gb(peak["train_step", "fp32"].get(c0)), "step_fp32_cmax": gb(peak["train_step", "fp32"].get(ctx_max)),
        "fwd_fp32_cmax": gb(peak["forward", "fp32"].get(ctx_max)), "fwd_bf16_cmax": gb(peak["forward", "bf16"].get(ctx_max)),
        "inf_fp32_cmax": gb(peak["inference", "fp32"].get(ctx_max)), "inf_bf16_cmax": gb(peak["inference", "bf16"].get(ctx_max)),
        "inference_measured": bool(peak["inference", "fp32"]),
    }


# -----------------------------------------------------------------------------------------------
# pytorch_attention, torch_compile
# -----------------------------------------------------------------------------------------------


def attention_grid(rows: list[dict], caption: str, with_memory: bool) -> dict[str, Any]:
    body = []
    for row in sorted(rows, key=lambda r: (r["d"], r["seq_len"])):
        cells = [str(row["d"]), f"{row['seq_len']:,}"]
        if row.get("oom"):
            cells += ["OOM"] * (4 if with_memory else 2)
        else:
            cells += [num(row["forward_mean_ms"], 2), num(row["backward_mean_ms"], 2)]
            if with_memory:
                cells += [num(row["memory_before_backward_gb"], 2), num(row.get("saved_for_backward_gb"), 2)]
        body.append(cells)
    header = ["d", "length", "forward (ms)", "backward (ms)"]
    if with_memory:
        header += ["memory before backward (GB)", "saved for backward (GB)"]
    return table(header, body, caption, size=8)


@problem("pytorch_attention")
def pytorch_attention(res, out: Output) -> dict[str, Any]:
    rows = res.rows("pytorch_attention")
    first = rows[0]
    caption = (f"Naive attention, batch {first['batch_size']}, {first['dtype']}, causal: mean time of one pass over "
               f"{first['passes']} forwards and {first['passes']} backwards, and memory in use before the backward.")
    grid = attention_grid(rows, caption, with_memory=True)
    ok = [row for row in rows if not row.get("oom")]
    batch = first["batch_size"]
    fit = accounting.NAIVE_ATTENTION_SAVED_MATRICES  # from the memory equation, not fitted
    agreement = [r["saved_for_backward_gb"] * 1e9 / accounting.naive_attention_memory(batch, r["seq_len"], r["d"], fit)["saved_bytes"]
                 for r in ok if r.get("saved_for_backward_gb") and r["seq_len"] >= 4096]
    oom_rows = sorted((r for r in rows if r.get("oom")), key=lambda r: (r["seq_len"], r["d"]))
    capacity_gb = accounting.device_memory_gb(rows)
    if oom_rows:
        case = oom_rows[0]
        length, d, measured = case["seq_len"], case["d"], True
    else:
        length, d = accounting.first_oom_length(max(r["seq_len"] for r in rows), batch, fit, capacity_gb), max(r["d"] for r in rows)
        measured = False
    need = accounting.naive_attention_memory(batch, length, d, fit)
    fig, axes = figures.new(6.0, 2.6, ncols=2)
    for d_ in sorted({r["d"] for r in ok}):
        pts = sorted((r["seq_len"], r["saved_for_backward_gb"], r["forward_mean_ms"]) for r in ok if r["d"] == d_)
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=f"d = {d_}")
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", ms=3, label=f"d = {d_}")
    lengths = sorted({r["seq_len"] for r in ok})
    axes[0].plot(lengths, [fit * batch * t * t * 4 / 1e9 for t in lengths], "k--", lw=0.8,
                 label=f"{fit} · B·T²·4 bytes")
    for ax, label in zip(axes, ("saved for backward (GB)", "forward (ms)")):
        figures.log2_axis(ax, lengths)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    figure = out.save(fig, "pytorch_attention", "Saved-for-backward memory and forward time of the naive attention "
                      "against sequence length (log-log): memory grows as T², like the score matrices.")
    n = {
        "any_oom": bool(oom_rows), "ooms": join_words([f"d = {r['d']}, T = {r['seq_len']:,}" for r in oom_rows]),
        "matrices": str(fit), "capacity": gb(capacity_gb, 0), "batch": str(batch),
        "agreement": spread(min(agreement), max(agreement), fmt=lambda x: pct(x, 0)) if agreement else DASH,
        "len": f"{length:,}", "d": str(d), "measured": measured,
        "score_gb": num(need["score_matrix_bytes"] / 1e9, 2), "saved_gb": num(need["saved_bytes"] / 1e9, 1),
        "scores3_gb": num(fit * need["score_matrix_bytes"] / 1e9, 1),
        "mask_gb": num(need["mask_bytes"] / 1e9, 2), "peak_gb": num(need["backward_peak_bytes"] / 1e9, 1),
        "inputs_mb": num(need["inputs_bytes"] / 1e6, 1),
        "largest_len": f"{max(r['seq_len'] for r in ok):,}" if ok else DASH,
        "largest_saved": gb(max((r["saved_for_backward_gb"] for r in ok), default=None)),
    }
    return {"tables": {"grid": grid}, "figures": {"memory": figure}, "n": n}


def split_pair(eager: dict[str, Any], compiled: dict[str, Any], what: str, split: list[tuple[str, str]]) -> str:
    """" †" when the eager and the compiled row of a compared pair come from different runs (invocations), noting
    ``what`` and the two rows' code and day in ``split``; "" when one run measured both."""
    if eager.get("run") == compiled.get("run"):
        return ""
    split.append((what, f"eager {measured_at(eager)}; compiled {measured_at(compiled)}"))
    return " †"


def split_note(split: list[tuple[str, str]]) -> str:
    """The caption's note on the pairs that :func:`split_pair` marked, or "" when every pair shares a run."""
    if not split:
        return ""
    return f" † eager and compiled from different runs: {'; '.join(f'{what} ({runs})' for what, runs in split)}."


@problem("torch_compile")
def torch_compile(res, out: Output) -> dict[str, Any]:
    rows = res.rows("torch_compile")
    attention = [row for row in rows if row.get("part") == "attention"]
    model = [row for row in rows if row.get("part") == "model"]
    body, speedups, attention_split = [], [], []
    for d in sorted({r["d"] for r in attention}):
        for length in sorted({r["seq_len"] for r in attention}):
            eager, compiled = one(attention, d=d, seq_len=length, attention="naive"), one(attention, d=d, seq_len=length,
                                                                                       attention="compiled")
            cells = [str(d), f"{length:,}"]
            for row in (eager, compiled):
                cells += [oom_or(row, num(row and row.get("forward_mean_ms"), 2)),
                          oom_or(row, num(row and row.get("backward_mean_ms"), 2))]
            ok = eager and compiled and not eager.get("oom") and not compiled.get("oom")
            if ok:
                speedups.append((d, length, eager["forward_mean_ms"] / compiled["forward_mean_ms"],
                                 eager["backward_mean_ms"] / compiled["backward_mean_ms"]))
                mark = split_pair(eager, compiled, f"d = {d}, T = {length:,}", attention_split)
            cells += [times(speedups[-1][2]) + mark if ok else DASH, times(speedups[-1][3]) + mark if ok else DASH]
            body.append(cells)
    header = [["", "", span("eager", 2), span("compiled", 2), span("speed-up", 2)],
              ["d", "length", "fwd", "bwd", "fwd", "bwd", "fwd", "bwd"]]
    first = attention[0] if attention else {}
    attention_table = table(header, body, f"Attention eager vs torch.compile, batch {first.get('batch_size')}, "
                            f"{first.get('dtype')}: ms per pass (mean of {first.get('passes')})."
                            + split_note(attention_split), size=8)
    model_body, model_speedups, model_split = [], {}, []
    for size in sorted({r["size"] for r in model}, key=size_order):
        cells = [size_name(size)]
        for mode in ("forward", "train_step"):
            eager, compiled = one(model, size=size, mode=mode, compile=False), next(
                (r for r in by(model, size=size, mode=mode) if r.get("compile")), None)
            ok = eager and compiled and not eager.get("oom") and not compiled.get("oom")
            mark = split_pair(eager, compiled, f"{size_name(size)} {MODE_LABEL[mode]}", model_split) if ok else ""
            cells += [oom_or(eager, pm(eager and eager.get("mean_ms"), eager and eager.get("std_ms"))),
                      oom_or(compiled, pm(compiled and compiled.get("mean_ms"), compiled and compiled.get("std_ms"))),
                      times(eager["mean_ms"] / compiled["mean_ms"]) + mark if ok else DASH]
            if ok:
                model_speedups.setdefault(mode, []).append(eager["mean_ms"] / compiled["mean_ms"])
        model_body.append(cells)
    model_header = [["", span("forward", 3), span("training step (AdamW)", 3)],
                    ["size", "eager", "compiled", "speed-up", "eager", "compiled", "speed-up"]]
    mfirst = model[0] if model else {}
    model_table = table(model_header, model_body, f"Whole model eager vs torch.compile, fp32, batch "
                        f"{mfirst.get('batch_size')}, context {mfirst.get('context_length')}: mean ± std (ms); "
                        "– : not measured." + split_note(model_split), size=8)
    long = [s for s in speedups if s[1] >= 4096]
    # The eager attention here is measured beside the compiled one (in one run unless marked); how far it lies
    # from the pytorch_attention table's separate run (forward and backward, every case both measured).
    table_rows = {(r["d"], r["seq_len"]): r for r in res.rows("pytorch_attention") if not r.get("oom")}
    gaps = [abs(e[k] / table_rows[(e["d"], e["seq_len"])][k] - 1)
            for e in attention if e.get("attention") == "naive" and not e.get("oom") and (e["d"], e["seq_len"]) in table_rows
            for k in ("forward_mean_ms", "backward_mean_ms") if e.get(k) and table_rows[(e["d"], e["seq_len"])].get(k)]
    # The eager baseline of this comparison is the eager row of the same run, not the benchmarking_script sweep.
    sweep = [r for r in load_benchmarking_script(res)[0] if r.get("dtype") == "fp32" and not r.get("oom")]
    first_size = min((r["size"] for r in model), key=size_order, default=None)
    here = one(model, size=first_size, mode="forward", compile=False)
    there = one(sweep, size=first_size, mode="forward")
    n = {
        "baseline_size": size_name(first_size) if first_size else DASH,
        "attention_gap": pct(max(gaps), 0) if gaps else DASH,
        "attention_gap_median": pct(statistics.median(gaps), 0) if gaps else DASH,
        "eager_here": num(here and here.get("mean_ms")), "eager_sweep": num(there and there.get("mean_ms")),
        "fwd_lo": times(min((s[2] for s in long), default=None)), "fwd_hi": times(max((s[2] for s in long), default=None)),
        "bwd_lo": times(min((s[3] for s in long), default=None)), "bwd_hi": times(max((s[3] for s in long), default=None)),
        "short_fwd": times(statistics.median([s[2] for s in speedups if s[1] < 4096])) if any(
            s[1] < 4096 for s in speedups) else DASH,
        "model_fwd_lo": times(min(model_speedups.get("forward", [math.nan]))),
        "model_fwd_hi": times(max(model_speedups.get("forward", [math.nan]))),
        "model_step_lo": times(min(model_speedups.get("train_step", [math.nan]))),
        "model_step_hi": times(max(model_speedups.get("train_step", [math.nan]))),
        # The compared pairs whose eager and compiled rows come from different runs (marked † in the tables).
        "attention_split": join_words([what for what, _ in attention_split]),
        "model_split": join_words([what for what, _ in model_split]),
    }
    return {"tables": {"attention": attention_table, "model": model_table}, "n": n}


# -----------------------------------------------------------------------------------------------
# gradient_checkpointing (beyond the assignment)
# -----------------------------------------------------------------------------------------------


# The model each edition's part (b) asks about: the 2026 handout's xl (canonical 2.7B); the 2025 writeup, where
# this problem is beyond the assignment, shows the 2025 xl.
CHECKPOINTING_SIZE = {"2025": "xl", "2026": "2.7B"}


def load_gradient_checkpointing(res) -> list[dict[str, Any]]:
    size = CHECKPOINTING_SIZE[editions.current()]

    def of_size_on_one_device(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rows = [r for r in rows if r.get("size") == size]  # each model was measured on its own machine
        device = main_device(rows) if rows else None
        return [r for r in rows if r.get("device", "") == device]

    return res.rows("gradient_checkpointing", one_device=False, keep=of_size_on_one_device)


@problem("gradient_checkpointing")
def gradient_checkpointing(res, out: Output) -> dict[str, Any]:
    rows = sorted(load_gradient_checkpointing(res), key=lambda r: (r["group_size"] == 0, r["group_size"]))
    if not rows:  # part (a) is a derivation; part (b) measures
        size = CHECKPOINTING_SIZE[editions.current()]
        return {"n": {}, "missing_parts": {"b": f"writeup/results/gradient_checkpointing.jsonl (no rows of the "
                                                f"{size_name(size)} model, canonical {size})"}}
    first = rows[0]
    n_blocks = first["n_blocks"]
    per_block, boundary = first["saved_per_block_gb"], first["group_input_gb"]
    body = []
    for row in rows:
        k = row["group_size"]
        body.append([
            "none" if k == 0 else str(k), str(math.ceil(n_blocks / k)) if k else "–",
            num(row.get("predicted_activation_gb"), 2), num(row.get("predicted_peak_gb"), 1),
            "OOM" if row.get("oom") else num(row.get("peak_gb"), 1),
            "OOM" if row.get("oom") else pm(row.get("mean_ms"), row.get("std_ms"), 0),
        ])
    caption = (f"{size_name(first['size'])} model, batch {first['batch_size']}, context {first['context_length']}, "
               f"{first['dtype']}, training step (AdamW): group size k (blocks per checkpointed group), predicted "
               "activation and total peak, measured peak and step time.")
    tab = table(["k", "groups", "predicted activations (GB)", "predicted peak (GB)", "measured peak (GB)",
                 "step (ms)"], body, caption)
    measured = [r for r in rows if not r.get("oom") and r.get("peak_gb") and r["group_size"] > 0]
    best = min(measured, key=lambda r: r["peak_gb"]) if measured else None
    none = next((r for r in rows if r["group_size"] == 0), None)
    k_star = math.sqrt(n_blocks * boundary / per_block)
    fig, axes = figures.new(6.0, 2.6, ncols=2)
    ks = [r["group_size"] for r in rows if r["group_size"] > 0]
    axes[0].plot(ks, [r["predicted_peak_gb"] for r in rows if r["group_size"] > 0], "k--", marker="x", label="predicted")
    axes[0].plot([r["group_size"] for r in measured], [r["peak_gb"] for r in measured], marker="o", label="measured")
    axes[0].set_ylabel("peak memory (GB)")
    axes[1].plot([r["group_size"] for r in measured], [r["mean_ms"] for r in measured], marker="o")
    if none and not none.get("oom"):
        axes[1].axhline(none["mean_ms"], color="gray", ls=":", label="no checkpointing")
        axes[1].legend(fontsize=7)
    axes[1].set_ylabel("step time (ms)")
    for ax in axes:
        ax.set_xlabel("blocks per group k")
    axes[0].legend(fontsize=7)
    figure = out.save(fig, "gradient_checkpointing", "Peak memory (predicted and measured) and step time against "
                      "the group size.")
    # The measured peaks of the predicted optimum and its neighbours (the next smaller and larger sizes measured).
    ks = sorted(r["group_size"] for r in measured)
    k_opt = first["predicted_optimum"]
    smaller, larger = [k for k in ks if k < k_opt][-1:], [k for k in ks if k > k_opt][:2]
    compared = [r for k in (*smaller, k_opt, *larger) for r in measured if r["group_size"] == k]
    first_k, last_k = (measured[0], measured[-1]) if measured else (None, None)
    slope = ((last_k["peak_gb"] - first_k["peak_gb"]) / (last_k["group_size"] - first_k["group_size"])
             if len(measured) > 1 else None)
    n = {
        "size": size_name(first["size"]), "n_blocks": str(n_blocks), "b": num(per_block, 3), "a": num(boundary, 3),
        "k_below_one": k_star < 1, "has_smaller": bool(smaller),
        "compared": [{"k": str(r["group_size"]), "peak": gb(r["peak_gb"])} for r in compared],
        "per_block_slope": gb(slope, 2),
        "ms_range": spread(min(r["mean_ms"] for r in measured), max(r["mean_ms"] for r in measured),
                           fmt=lambda x: f"{num(x, 0)} ms") if measured else DASH,
        "ms_spread": pct(max(r["mean_ms"] for r in measured) / min(r["mean_ms"] for r in measured) - 1, 0)
        if measured else DASH,
        "k_star": num(k_star, 2), "k_opt": str(first["predicted_optimum"]),
        "best_k": str(best["group_size"]) if best else DASH, "best_peak": gb(best and best["peak_gb"]),
        "best_ms": num(best and best["mean_ms"], 0),
        "none_oom": bool(none and none.get("oom")), "none_peak": gb(none and none.get("peak_gb")),
        "none_ms": num(none and none.get("mean_ms"), 0),
        "slowdown": times(best["mean_ms"] / none["mean_ms"]) if best and none and not none.get("oom") else DASH,
        "state_gb": num(first.get("model_state_gb"), 1),
        "no_ckpt_act": num(n_blocks * per_block, 1),
        "predicted_min_act": num(accounting.checkpoint_activation_bytes(n_blocks, first["predicted_optimum"],
                                                                       boundary, per_block), 2),
    }
    return {"tables": {"main": tab}, "figures": {"main": figure}, "n": n}
