"""Sections of SPEC part 5 (optimizer-state sharding) and FSDP (part 6): measured memory and time beside
the accounting."""

from __future__ import annotations

from typing import Any

from cs336_basics.model import MODEL_SIZES
from pipeline import accounting
from pipeline.markup import DASH, num, table, times
from pipeline.results import Missing
from pipeline.sections.registry import Output, problem


def model_params(rows: list[dict[str, Any]]) -> tuple[str, int, int]:
    """The model size, its parameter count and the world size the rows were measured with (xl on 2 GPUs unless
    the rows say otherwise)."""
    size = rows[0].get("size", "xl")
    world = rows[0].get("world_size", 2)
    return size, accounting.parameter_count(vocab_size=10_000, **MODEL_SIZES[size]), world


def flatten_breakdown(breakdown: Any) -> dict[str, dict[str, float]]:
    """``{stage: {component: GB}}`` from a breakdown that is either nested by stage or one flat dict."""
    if not isinstance(breakdown, dict):
        return {}
    if all(isinstance(v, dict) for v in breakdown.values()):
        return {stage: dict(parts) for stage, parts in breakdown.items()}
    return {"peak": dict(breakdown)}


@problem("optimizer_state_sharding")
def optimizer_state_sharding(res, out: Output) -> dict[str, Any]:
    return {}  # implementation only: the text describes the code


def load_sharding_accounting(res) -> list[dict[str, Any]]:
    return res.rows("optimizer_state_sharding_accounting")


@problem("optimizer_state_sharding_accounting")
def optimizer_state_sharding_accounting(res, out: Output) -> dict[str, Any]:
    rows = load_sharding_accounting(res)
    size, params, world = model_params(rows)
    summary = [[r["optimizer"], "OOM" if r.get("oom") else num(r.get("step_ms")),
                "OOM" if r.get("oom") else num(r.get("peak_gb"), 2)] for r in rows]
    summary_table = table(["optimizer", "step (ms)", "peak (GB)"], summary,
                          f"{size} model on {world} GPUs: time per training step and peak memory per GPU.")
    stages = {r["optimizer"]: flatten_breakdown(r.get("breakdown")) for r in rows if not r.get("oom")}
    components = list(dict.fromkeys(c for per in stages.values() for parts in per.values() for c in parts))
    body = []
    for optimizer, per in stages.items():
        for stage, parts in per.items():
            body.append([optimizer, stage.replace("_", " "), *[num(parts.get(c), 2) for c in components]])
    if not body:
        raise Missing("writeup/results/optimizer_state_sharding_accounting.jsonl", "no 'breakdown' in the rows")
    breakdown_table = table(["optimizer", "when", *[c.replace("_", " ") for c in components]], body,
                            "Memory per GPU (GB) broken down by what holds it, at each point of the step.", size=8)
    expected = accounting.sharding_memory(params, world)
    traffic = accounting.sharding_traffic(params, world)
    sharded = next((r for r in rows if "shard" in r["optimizer"].lower() and not r.get("oom")), None)
    plain = next((r for r in rows if r is not sharded and "zero" not in r["optimizer"].lower()
                  and not r.get("oom")), None)
    zero = next((r for r in rows if "zero" in r["optimizer"].lower() and not r.get("oom")), None)
    gb = lambda b: num(b / 1e9, 1)
    n = {
        "size": size, "world": str(world), "params": f"{params / 1e9:.3f}",
        "weights": gb(expected["weights"]), "state": gb(expected["state"]), "state_sharded": gb(expected["state_sharded"]),
        "total": gb(expected["total"]), "total_sharded": gb(expected["total_sharded"]),
        "saving": gb(expected["total"] - expected["total_sharded"]),
        "all_reduce": gb(traffic["all_reduce"]), "ours_traffic": gb(traffic["ours"]), "zero1": gb(traffic["zero1"]),
        "has_pair": bool(sharded and plain),
        "peak_plain": num(plain and plain.get("peak_gb"), 1), "peak_sharded": num(sharded and sharded.get("peak_gb"), 1),
        "measured_saving": num(plain["peak_gb"] - sharded["peak_gb"], 1) if sharded and plain else DASH,
        "step_plain": num(plain and plain.get("step_ms")), "step_sharded": num(sharded and sharded.get("step_ms")),
        "slowdown": times(sharded["step_ms"] / plain["step_ms"]) if sharded and plain else DASH,
        "has_zero": bool(zero), "zero_name": zero["optimizer"] if zero else "",
        "step_zero": num(zero and zero.get("step_ms")), "peak_zero": num(zero and zero.get("peak_gb"), 1),
    }
    return {"tables": {"summary": summary_table, "breakdown": breakdown_table}, "n": n}


@problem("fsdp")
def fsdp(res, out: Output) -> dict[str, Any]:
    return {}  # implementation only: the text describes the code


def load_fsdp_accounting(res) -> list[dict[str, Any]]:
    return res.rows("fsdp_accounting")


@problem("fsdp_accounting")
def fsdp_accounting(res, out: Output) -> dict[str, Any]:
    rows = load_fsdp_accounting(res)
    size, params, world = model_params(rows)
    body = [[r["impl"], r.get("dtype", DASH) or DASH, "OOM" if r.get("oom") else num(r.get("step_ms")),
             "OOM" if r.get("oom") else num(r.get("peak_gb"), 2)] for r in rows]
    tab = table(["implementation", "dtype", "step (ms)", "peak (GB)"], body,
                f"{size} model on {world} GPUs, training step with AdamW: time and peak memory per GPU.")
    traces = [r for r in rows if r.get("figure")]
    if not traces:
        raise Missing("writeup/results/fsdp_accounting.jsonl", "no profiler-timeline figure rows (key 'figure')")
    figs = [out.existing(r["figure"], f"Profiler timeline, {r['impl']}: all-gathers (communication stream) against "
                         "the layers that use them (compute stream).") for r in traces]
    ok = [r for r in rows if not r.get("oom") and r.get("peak_gb")]
    ours = next((r for r in ok if "fsdp" in r["impl"].lower()), None)
    base = next((r for r in ok if "fsdp" not in r["impl"].lower()), None)
    expected = accounting.sharding_memory(params, world)
    hp = MODEL_SIZES[size]
    layer_bytes = max(hp["d_model"] * hp["d_ff"], 10_000 * hp["d_model"]) * accounting.FP32
    n = {
        "size": size, "world": str(world), "params": f"{params / 1e9:.3f}",
        "total": num(expected["total"] / 1e9, 1), "fsdp_total": num(expected["fsdp_total"] / 1e9, 1),
        "expected_saving": num((expected["total"] - expected["fsdp_total"]) / 1e9, 1),
        "gathered_mb": num(3 * layer_bytes / 1e6, 0),
        "has_pair": bool(ours and base), "base": base["impl"] if base else "", "ours": ours["impl"] if ours else "",
        "measured_saving": num(base["peak_gb"] - ours["peak_gb"], 1) if ours and base else DASH,
        "base_peak": num(base and base["peak_gb"], 1), "ours_peak": num(ours and ours["peak_gb"], 1),
        "slowdown": times(ours["step_ms"] / base["step_ms"]) if ours and base and base.get("step_ms") else DASH,
    }
    return {"tables": {"main": tab}, "figures": figs, "n": n}
