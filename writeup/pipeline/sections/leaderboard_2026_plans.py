"""The 2026 leaderboard step's checkpoint plans and what they predict: the plan each row ran with its predicted and
measured peak, the split of a profiled full step, and the step on a B200 on paper (the planner at 180 GB, the time
from the FLOP model, rates achieved on an H200 and the vendor's published peaks). Read by
:mod:`pipeline.sections.leaderboard_2026`."""

from __future__ import annotations

from typing import Any

from cs336_systems.bench.common.leaderboard_2026_model import (
    GB, MODEL, PUBLISHED_PEAKS, STACK_OF_ROW, memory_budget, plan_flop_parts, plan_for_card, predict_step_ms,
    stack_modes,
)
from cs336_systems.bench.common.step_split import SPLIT
from cs336_systems.train.checkpoint_plan import CHECKPOINT_MODES, mode_runs
from pipeline.markup import DASH, num, table

PEAK_CLAIM = 0.05  # the memory model's claim: the measured peak within 5 % of the predicted one
MODEL_CHANGED = 0.005  # a recorded prediction this far from today's model came from an earlier model
SPLIT_NAMES = {"matmul": "matmuls", "attention_forward": "attention forward",
               "attention_backward": "attention backward", "recompute": "recompute (forward in backward)",
               "elementwise": "elementwise", "norms": "norms", "loss": "loss", "optimizer": "optimizer",
               "exposed_communication": "exposed communication"}


def row_modes(r: dict[str, Any]) -> tuple[str, ...]:
    """Each block's checkpoint mode as the row's ``parts`` record it: per block, or one mode for every block
    (rows from before the plans existed checkpoint every block, ``selective`` where they keep the attention
    output, else ``full``; rows before the modes record a group size, ``keep_attention`` and
    ``block_checkpointing``)."""
    parts = r.get("parts") or {}
    if isinstance(parts.get("checkpointing"), (str, list)):
        modes = parts["checkpointing"]
        return tuple(modes) if isinstance(modes, list) else (modes,) * r["num_layers"]
    if parts.get("block_checkpointing"):
        return tuple(parts["block_checkpointing"])
    if not parts.get("checkpointing", 1):
        return ("keep",) * r["num_layers"]
    return ("selective" if parts.get("keep_attention") else "full",) * r["num_layers"]


def modes_summary(modes: tuple[str, ...]) -> str:
    """``34 selective``, ``13 selective (0–12), 21 keep (13–33)`` or ``33 selective (0–32), 1 keep (33)``: the
    count of each mode and, when they mix, the blocks of each run."""
    counts = {mode: modes.count(mode) for mode in CHECKPOINT_MODES if mode in modes}
    if len(counts) == 1:
        return f"{len(modes)} {modes[0]}"
    return ", ".join(f"{modes.count(mode)} {mode} ({first}{'' if first == last else f'–{last}'})"
                     for mode, first, last in mode_runs(modes))


def modes_count(modes: tuple[str, ...]) -> str:
    """``13 keep, 21 selective``: the count of each mode, from least recomputation to most."""
    return ", ".join(f"{modes.count(mode)} {mode}" for mode in CHECKPOINT_MODES if mode in modes)


def model_peak_gb(r: dict[str, Any], modes: tuple[str, ...]) -> float:
    """The peak :func:`memory_budget` predicts today for the row's configuration, loss part and ``modes``."""
    config = {**MODEL, "num_layers": r["num_layers"], "context_length": r["context_length"]}
    return memory_budget(config, STACK_OF_ROW[r["stack"]], r["world_size"], r["batch_size"] // r["world_size"],
                         loss=(r.get("parts") or {}).get("loss"), modes=modes)["peak_gb"]


def row_plan(r: dict[str, Any]) -> dict[str, Any]:
    """The plan the row ran: its modes, whether the row recorded the plan (``checkpoint_plan``) or it is read from
    the row's parts, the predicted peak (the recorded one, else today's :func:`memory_budget`), today's model's
    peak for the same plan (``model_gb``; ``earlier_model``: the recorded prediction came from an earlier memory
    model, off today's by over :data:`MODEL_CHANGED`), the measured peak and the error of the prediction."""
    modes = row_modes(r)
    recorded = r.get("checkpoint_plan")
    model_gb = model_peak_gb(r, modes)
    predicted = recorded["predicted_peak_gb"] if recorded else model_gb
    measured = max(r.get("peak_gb_ranks") or [r.get("peak_gb_per_rank")])
    error = (measured - predicted) / predicted if measured is not None else None
    default = modes == stack_modes({"num_layers": r["num_layers"]}, STACK_OF_ROW[r["stack"]])
    label = modes_summary(modes) + ("" if recorded else " (stack default)" if default else " (from parts)")
    return {"modes": modes, "label": label, "recorded": bool(recorded), "predicted_gb": predicted,
            "model_gb": model_gb, "earlier_model": abs(predicted - model_gb) > MODEL_CHANGED * model_gb,
            "measured_gb": measured, "error": error}


def signed_pct(x: float | None, digits: int = 1) -> str:
    """``+3.3 %`` or ``−5.5 %`` (a minus sign)."""
    if x is None:
        return DASH
    text = f"{100 * x:+.{digits}f}"
    return (text[1:] if float(text) == 0 else text.replace("-", "−")) + " %"


def plans_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every official row: device, date, stack, the checkpoint plan it ran, predicted peak (and today's model's
    where it differs), measured peak, error."""
    body = []
    for r in rows:
        p = row_plan(r)
        today = num(p["model_gb"], 1) if p["earlier_model"] else DASH
        body.append([r["device"], str(r["env"]["date"])[:16].replace("T", " "), r["stack"], p["label"],
                     num(p["predicted_gb"], 1), today, num(p["measured_gb"], 1), signed_pct(p["error"])])
    return table(["GPUs", "date (UTC)", "stack", "checkpoint plan (blocks)", "predicted peak GB",
                  "today's model GB", "measured peak GB", "error"], body,
                 "Every official row: the checkpoint plan it ran and its peak memory per GPU, predicted by "
                 "memory_budget and measured (max_memory_allocated, the largest of the ranks). Rows run with "
                 "--checkpoint-plan record their plan and its predicted peak (checkpoint_plan); where that came from "
                 "the model before its kept blocks were calibrated, today's model's peak for the same plan stands "
                 "beside it. Rows from before the planner ran every block the way their parts say, the stack's "
                 "default (ours selective: attention output and log-sum-exp kept; PyTorch's full: the whole block "
                 "recomputed), and their prediction is today's memory_budget of those modes and the row's loss part. "
                 "Error: measured over predicted, less one.",
                 align=["left", "left", "left", "left", "right", "right", "right", "right"], size=7)


def stack_name(r: dict[str, Any]) -> str:
    """``(ours)`` or ``(PyTorch's)``: whose row ``r`` is, after a number."""
    return "(ours)" if r["stack"] == "ours" else "(PyTorch's)"


def _pct_range(errors: list[float]) -> str:
    """``1.1 to 2.6 %`` (absolute values), or one value."""
    low, high = f"{100 * min(errors):.1f}", f"{100 * max(errors):.1f}"
    return f"{low} %" if low == high else f"{low} to {high} %"


def peak_claim_numbers(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The memory model's claim over the official rows it predicted as it stands today (rows planned by an earlier
    model apart): how many have their measured peak within :data:`PEAK_CLAIM` of the prediction, the largest
    error; and the rows planned by the earlier model: how far their prediction lay above the measured peaks, and
    what today's model predicts for their plans."""
    plans = [(r, row_plan(r)) for r in rows]
    today = [p["error"] for _, p in plans if p["error"] is not None and not p["earlier_model"]]
    planned = [abs(p["error"]) for r, p in plans if p["recorded"] and not p["earlier_model"]]
    earlier = [(r, p) for r, p in plans if p["earlier_model"]]
    worst = max(today, key=abs)
    n = {"claim_rows": str(len(today)), "claim_within": str(sum(abs(e) <= PEAK_CLAIM for e in today)),
         "claim_pct": f"{100 * PEAK_CLAIM:.0f} %", "claim_worst": signed_pct(worst),
         "claim_holds": all(abs(e) <= PEAK_CLAIM for e in today),
         "has_planned": bool(planned), "planned_rows": str(len(planned)),
         "planned_within": _pct_range(planned) if planned else DASH, "has_earlier_model": bool(earlier)}
    if earlier:
        over = [p["predicted_gb"] / p["measured_gb"] - 1 for _, p in earlier]
        n.update({
            "earlier_rows": str(len(earlier)),
            "earlier_predicted": " and ".join(dict.fromkeys(num(p["predicted_gb"], 1) for _, p in earlier)),
            "earlier_measured": " and ".join(f"{num(p['measured_gb'], 1)} {stack_name(r)}" for r, p in earlier),
            "earlier_over": _pct_range(over),
            "earlier_today": " and ".join(f"{num(p['model_gb'], 1)} {stack_name(r)}" for r, p in earlier),
            "earlier_device": earlier[0][0]["device"],
            "earlier_time": str(min(r["env"]["date"] for r, _ in earlier))[:16].replace("T", " "),
            "earlier_plans": " and ".join(dict.fromkeys(modes_count(p["modes"]) for _, p in earlier)),
        })
    return n


# ---------------------------------------------------------------------------------------------------
# The full step's split, and the B200 on paper
# ---------------------------------------------------------------------------------------------------


def full_step_rates(profile: dict[str, Any], modes: tuple[str, ...]) -> dict[str, float]:
    """The rates :func:`predict_step_ms` takes, from one profiled step of ``profile["layers"]`` blocks (one
    sequence per rank) that ran checkpoint ``modes``, for the full step of ``MODEL["num_layers"]`` blocks.

    A row with the split (``split_ms``) gives matmul time (the recomputation counted with it: mostly the blocks'
    matmuls), attention forward and backward, the memory-bound kernels (elementwise, norms, loss, optimizer) and the
    exposed communication; an older row only the kernels by name (``gpu_ms``), whose collectives are counted whole
    (an upper bound on the exposed part). The matmul and attention rates are the FLOPs of the profiled step over
    those times; the per-block kernels (elementwise, norms) scale with the blocks, the optimizer and the
    communication with the parameters, the loss not at all."""
    layers, full = profile["layers"], MODEL["num_layers"]
    config = {**MODEL, "num_layers": layers, "context_length": profile.get("context_length", MODEL["context_length"])}
    flop = plan_flop_parts(config, 1, modes)
    if has_split(profile):
        ms = profile["split_ms"]
        matmul_ms = ms["matmul"] + ms["recompute"]
        per_block, loss, optimizer, comm = (ms["elementwise"] + ms["norms"], ms["loss"], ms["optimizer"],
                                            ms["exposed_communication"])
    else:
        ms = profile["gpu_ms"]
        matmul_ms = ms.get("matmul", 0.0)
        per_block, loss, optimizer, comm = (ms.get("other", 0.0) + ms.get("rmsnorm", 0.0),
                                            ms.get("cross_entropy", 0.0), ms.get("optimizer", 0.0),
                                            ms.get("collectives", 0.0))
    d, d_ff, vocab = MODEL["d_model"], MODEL["d_ff"], MODEL["vocab_size"]
    block, head = 4 * d * d + 3 * d * d_ff, 2 * vocab * d
    params_ratio = (full * block + head) / (layers * block + head)
    return {
        "matmul_tflops": (flop["weights"] + flop["recompute_weights"]) / (matmul_ms / 1e3) / 1e12,
        "attention_tflops": (flop["attention"] + flop["recompute_attention"])
        / ((ms["attention_forward"] + ms["attention_backward"]) / 1e3) / 1e12,
        "memory_bound_ms": per_block * full / layers + loss + optimizer * params_ratio,
        "communication_ms": comm * params_ratio,
    }


def profile_modes(profile: dict[str, Any]) -> tuple[str, ...]:
    """Each block's checkpoint mode in a profiled step: whole blocks where its overrides drop the attention output,
    else the plan it recorded (``checkpoint_plan``), else one ``--checkpoint-plan`` mode, else the stack's
    default."""
    if "keep_attention=false" in (profile.get("parts") or []):
        return ("full",) * profile["layers"]
    if (profile.get("checkpoint_plan") or {}).get("modes"):
        return tuple(profile["checkpoint_plan"]["modes"])
    if profile.get("checkpoint_option") in CHECKPOINT_MODES:
        return (profile["checkpoint_option"],) * profile["layers"]
    return stack_modes({"num_layers": profile["layers"]}, STACK_OF_ROW[profile["stack"]])


def paper_step(profile: dict[str, Any], measured_row: dict[str, Any] | None, card_gb: float = 180.0) -> dict[str, Any]:
    """The official step of ours predicted on the H200 with the plan of ``measured_row`` (beside its measured step;
    without it, the profiled plan at the full depth) and on a B200 with the plan the planner picks for ``card_gb``
    GB: each part's ms. The rates are per FLOP (or per block), so they carry over to another plan."""
    profiled_modes = profile_modes(profile)
    rates = full_step_rates(profile, profiled_modes)
    if measured_row is not None:
        h200_modes = row_modes(measured_row)
    elif len(profiled_modes) == MODEL["num_layers"]:
        h200_modes = profiled_modes
    else:
        h200_modes = (profiled_modes[0],) * MODEL["num_layers"]
    b200_plan = plan_for_card(card_gb)
    h200 = predict_step_ms(plan_flop_parts(MODEL, 1, h200_modes), rates, "H200", "H200")
    b200 = predict_step_ms(plan_flop_parts(MODEL, 1, b200_plan.modes), rates, "H200", "B200")
    b200_same_plan = predict_step_ms(plan_flop_parts(MODEL, 1, h200_modes), rates, "H200", "B200")
    return {"rates": rates, "h200": h200, "h200_modes": h200_modes, "b200": b200, "b200_plan": b200_plan,
            "b200_same_plan": b200_same_plan,
            "measured_ms": measured_row["step_ms"] if measured_row else None, "card_gb": card_gb,
            "measured_time": str(measured_row["env"]["date"])[:16].replace("T", " ") if measured_row else None}


def paper_table(paper: dict[str, Any]) -> dict[str, Any]:
    parts = ("matmul_ms", "attention_ms", "memory_bound_ms", "communication_ms", "step_ms")
    h200_label = f"H200, {modes_summary(paper['h200_modes'])}"
    b200_label = f"B200 ({paper['card_gb']:.0f} GB), {modes_summary(paper['b200_plan'].modes)}"
    same_label = f"B200, {modes_summary(paper['h200_modes'])}"
    body = [[h200_label, *[num(paper["h200"][k], 0) for k in parts], num(paper["measured_ms"], 0)],
            [same_label, *[num(paper["b200_same_plan"][k], 0) for k in parts], DASH],
            [b200_label, *[num(paper["b200"][k], 0) for k in parts], DASH]]
    r = paper["rates"]
    peaks = "; ".join(f"{card}: {p['bf16_tflops'] / 1e3:.2f} PFLOP/s dense bf16, HBM {p['hbm_tbs']:g} TB/s, NVLink "
                      f"{p['nvlink_tbs']:g} TB/s" for card, p in PUBLISHED_PEAKS.items())
    return table(["card, checkpoint plan", "matmuls", "attention", "memory-bound", "communication",
                  "predicted step", "measured step"], body,
                 f"Our stack's official step (one rank's work, ms), predicted: the FLOPs of each plan over the rates "
                 f"achieved on two H200s (matmuls {num(r['matmul_tflops'], 0)} TFLOP/s, attention "
                 f"{num(r['attention_tflops'], 0)} TFLOP/s), the memory-bound kernels and the communication as "
                 f"profiled there, each scaled to a B200 by the ratio of the vendor's published peak figures "
                 f"({peaks}). Nothing on the B200 line is measured.",
                 align=["left", "right", "right", "right", "right", "right", "right"], size=8)


def paper_numbers(paper: dict[str, Any]) -> dict[str, Any]:
    plan, b200, h200 = paper["b200_plan"], paper["b200"], paper["h200"]
    counts = {mode: plan.modes.count(mode) for mode in CHECKPOINT_MODES}
    measured = paper["measured_ms"]
    return {
        "card_gb": f"{paper['card_gb']:.0f}", "plan": plan.describe(), "plan_summary": modes_summary(plan.modes),
        "kept": str(counts["keep"]), "selective": str(counts["selective"]), "full": str(counts["full"]),
        "plan_peak": num(plan.peak_bytes / GB, 1), "plan_budget": num(plan.budget_bytes / GB, 1),
        "b200_ms": num(b200["step_ms"], 0), "h200_ms": num(h200["step_ms"], 0),
        "speedup": f"{h200['step_ms'] / b200['step_ms']:.2f}×",
        "same_plan_ms": num(paper["b200_same_plan"]["step_ms"], 0),
        "same_plan_speedup": f"{h200['step_ms'] / paper['b200_same_plan']['step_ms']:.2f}×",
        "compute_ratio": f"{PUBLISHED_PEAKS['B200']['bf16_tflops'] / PUBLISHED_PEAKS['H200']['bf16_tflops']:.2f}×",
        "recompute_saved": num(paper["b200_same_plan"]["step_ms"] - b200["step_ms"], 0),
        "h200_measured": num(measured, 0), "has_measured": measured is not None,
        "measured_time": paper["measured_time"], "h200_plan": modes_count(paper["h200_modes"]),
        "h200_under": measured is not None and h200["step_ms"] < measured,
        "h200_model_error": signed_pct((h200["step_ms"] - measured) / measured if measured else None),
        "matmul_tflops": num(paper["rates"]["matmul_tflops"], 0),
        "attention_tflops": num(paper["rates"]["attention_tflops"], 0),
    }


def split_figure(out, profile: dict[str, Any]) -> dict[str, str]:
    """A stacked bar of the full step's split (rank 0): the categories of :data:`SPLIT`, then the idle time."""
    from pipeline import figures

    fig, axes = figures.new(6.5, 2.4)
    ax = axes[0]
    left = 0.0
    values = [(SPLIT_NAMES[c].split(" (")[0], profile["split_ms"][c]) for c in SPLIT]
    for name, ms in values + [("GPU idle", profile.get("idle_ms", 0.0))]:
        ax.barh([0], [ms], left=left, label=f"{name} ({ms:,.0f})")
        left += ms
    ax.set_yticks([])
    ax.set_xlabel("ms of one step (rank 0)")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.3, 1, 1))
    return out.save(fig, "leaderboard_2026_split",
                    f"One full {profile['layers']}-layer step of {profile['stack']} (rank 0, "
                    f"{profile['device']}), its time by category (ms; the wall time {profile['wall_ms']:,.0f} ms).")


def has_split(r: dict[str, Any]) -> bool:
    """Whether a profile row's split can be shown (rows with a ``split_note`` say their split is wrong)."""
    return "split_ms" in r and "split_note" not in r


def split_rows(rows: list[dict[str, Any]], plans: dict[str, tuple[str, ...]]) -> dict[str, dict[str, Any]]:
    """A profile row with a split (``split_ms``) of each stack at the full depth, by stack: the newest whose plan is
    ``plans[stack]`` (the plan of the official row it stands beside) where there is one, else the newest."""
    latest: dict[str, dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r.get("run", "")):
        if has_split(r) and r.get("layers") == MODEL["num_layers"] and not r.get("parts"):
            held = latest.get(r["stack"])
            if held is None or profile_modes(r) == plans.get(r["stack"]) or profile_modes(held) != plans.get(r["stack"]):
                latest[r["stack"]] = r
    return latest


def split_table(split: dict[str, dict[str, Any]]) -> dict[str, Any]:
    stacks = list(split)
    body = [[SPLIT_NAMES[c], *[num(split[s]["split_ms"][c], 1) for s in stacks]] for c in SPLIT]
    body.append(["GPU idle", *[num(split[s].get("idle_ms"), 1) for s in stacks]])
    body.append(["all communication (mostly hidden)", *[num(split[s].get("communication_ms"), 1) for s in stacks]])
    body.append(["step (wall)", *[num(split[s]["wall_ms"], 0) for s in stacks]])
    body.append(["allocator retries in the step",
                 *[num((split[s].get("allocator_events") or {}).get("num_alloc_retries"), 0) for s in stacks]])
    r = split[stacks[0]]
    header = ["ms, rank 0", *[f"{s}: {modes_count(profile_modes(split[s]))} ({str(split[s]['env']['date'])[11:16]})"
                              for s in stacks]]
    return table(header, body,
                 f"One full step ({r['layers']} layers, {r['world_size']} GPUs, {r['device']}) after "
                 f"{r.get('warmup_steps', 1)} warm-up step(s), split by kernel category "
                 "(cs336_systems.bench.common.step_split): compute kernels summed per category, recompute being "
                 "the forward kernels the backward runs again, and the communication time no compute kernel "
                 "covered. The categories and the idle time add up to the wall time when no two compute kernels "
                 "overlap. Each column is headed by the checkpoint plan its step ran (blocks by mode) and the time "
                 "of the profile (UTC); allocator retries: the caching allocator's, in the profiled step (a dash: "
                 "not recorded).", size=8)
