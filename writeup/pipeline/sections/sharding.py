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
    stages = {r["optimizer"]: flatten_breakdown(r.get("breakdown") or r.get("memory")) for r in rows if not r.get("oom")}
    components = list(dict.fromkeys(c for per in stages.values() for parts in per.values() for c in parts))
    body = []
    for optimizer, per in stages.items():
        for stage, parts in per.items():
            body.append([optimizer, stage.replace("_", " "), *[num(parts.get(c), 2) for c in components]])
    if not body:
        raise Missing("writeup/results/optimizer_state_sharding_accounting.jsonl", "no 'memory' breakdown in the rows")
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


def load_fsdp_accounting(res) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of ``fsdp_accounting.jsonl`` by ``measure``: ``step`` (impl ours / fsdp2 / ddp: step time, peak
    and state memory per GPU), ``check`` (ours against single-process training on NCCL) and ``timeline``."""
    rows = res.rows("fsdp_accounting")
    by = lambda m: [r for r in rows if r.get("measure") == m]
    return by("step"), by("check"), by("timeline")


@problem("fsdp_accounting")
def fsdp_accounting(res, out: Output) -> dict[str, Any]:
    steps, checks, timelines = load_fsdp_accounting(res)
    if not steps:
        raise Missing("writeup/results/fsdp_accounting.jsonl", "no rows with measure 'step'")
    size, params, world = model_params(steps)
    order = {"ddp": 0, "fsdp2": 1, "ours": 2}
    steps = sorted(steps, key=lambda r: order.get(r["impl"], 9))
    names = {"ddp": "DDP (no sharding)", "fsdp2": "PyTorch FSDP2", "ours": "ours (FSDP)"}
    body = [[names.get(r["impl"], r["impl"]), r.get("dtype", DASH) or DASH,
             "OOM" if r.get("oom") else num(r.get("step_ms")), "OOM" if r.get("oom") else num(r.get("peak_gb"), 1),
             num(r.get("state_gb"), 1), num(r.get("expected_state_gb"), 1)] for r in steps]
    tab = table(["implementation", "compute dtype", "step (ms)", "peak (GB)", "state (GB)", "expected state (GB)"],
                body, f"{size} model on {world} GPUs, batch {steps[0].get('batch_per_rank')} per GPU, context "
                f"{steps[0].get('context_length')}, AdamW: slowest rank's step time, peak memory per GPU, and the memory "
                "held between steps (state: weights, gradients, AdamW moments) against 16 bytes per local parameter.",
                size=8)
    figs = []
    for r in timelines:
        if r.get("figure"):
            figs.append(out.existing(r["figure"],
                                     f"Profiler timeline of our FSDP ({r.get('dtype')}): all-gathers and "
                                     "reduce-scatters (communication stream) against the layers that use them "
                                     "(compute stream)."))
    ok = {r["impl"]: r for r in steps if not r.get("oom") and r.get("peak_gb")}
    ours, base, fsdp2 = ok.get("ours"), ok.get("ddp"), ok.get("fsdp2")
    expected = accounting.sharding_memory(params, world)
    hp = MODEL_SIZES[size]
    layer_bytes = max(hp["d_model"] * hp["d_ff"], 10_000 * hp["d_model"]) * accounting.FP32
    tl = timelines[0] if timelines else {}
    check_text = "; ".join(
        f"{c.get('dtype')}: {'bit-exact' if c.get('bit_exact') else 'max |Δ| ' + num(c.get('max_abs_diff'), 6)} "
        f"after {c.get('steps')} steps ({'passed' if c.get('passed') else 'FAILED'})" for c in checks)
    n = {
        "size": size, "world": str(world), "params": f"{params / 1e9:.3f}",
        "total": num(expected["total"] / 1e9, 1), "fsdp_total": num(expected["fsdp_total"] / 1e9, 1),
        "expected_saving": num((expected["total"] - expected["fsdp_total"]) / 1e9, 1),
        "gathered_mb": num(3 * layer_bytes / 1e6, 0),
        "has_pair": bool(ours and base), "base": names["ddp"], "ours": names["ours"],
        "measured_saving": num(base["peak_gb"] - ours["peak_gb"], 1) if ours and base else DASH,
        "base_peak": num(base and base["peak_gb"], 1), "ours_peak": num(ours and ours["peak_gb"], 1),
        "slowdown": times(ours["step_ms"] / base["step_ms"]) if ours and base and base.get("step_ms") else DASH,
        "has_fsdp2": bool(ours and fsdp2),
        "fsdp2_peak": num(fsdp2 and fsdp2["peak_gb"], 1),
        "vs_fsdp2": times(ours["step_ms"] / fsdp2["step_ms"]) if ours and fsdp2 else DASH,
        "has_check": bool(checks), "check": check_text,
        "check_setup": (f"{checks[0].get('size')} model, context {checks[0].get('context_length')}, "
                        f"{checks[0].get('world_size')} GPUs over {checks[0].get('backend')}") if checks else "",
        "has_timeline": bool(tl),
        "tl_gathers": str(tl.get("forward_gathers", 0) + tl.get("backward_gathers", 0)) if tl else DASH,
        "tl_exposed": str(tl.get("forward_gathers_exposed", 0) + tl.get("backward_gathers_exposed", 0)) if tl else DASH,
        "tl_stall": num((tl.get("forward_stall_ms") or 0) + (tl.get("backward_stall_ms") or 0), 1) if tl else DASH,
        "tl_comm": num(tl.get("comm_ms"), 1), "tl_compute": num(tl.get("compute_ms"), 1),
        "tl_rs": str(tl.get("reduce_scatters", DASH)),
    }
    return {"tables": {"main": tab}, "figures": figs, "n": n}
