"""Sections on optimizer-state sharding and, beyond the assignment, FSDP: measured memory and time beside
the accounting."""

from __future__ import annotations

from typing import Any

from cs336_basics.model import MODEL_SIZES
from pipeline import accounting
from pipeline.markup import DASH, num, pm, table, times
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


SHARDING_FILE = "writeup/results/optimizer_state_sharding_accounting.jsonl"
OPTIMIZER_LABEL = {"adamw": "AdamW", "sharded": "ours (ShardedOptimizer)", "zero_redundancy": "ZeroRedundancyOptimizer",
                   "zero1_flat": "ours, ZeRO-1 flat (FlatShardedOptimizer)"}
REQUIRED_KINDS = ("adamw", "sharded", "zero_redundancy")  # zero1_flat rows are shown when measured
DTYPE_ORDER = ["fp32", "bf16"]


def optimizer_kind(name: str) -> str:
    """``adamw``, ``sharded``, ``zero_redundancy`` or ``zero1_flat`` from the row's optimizer name."""
    name = name.lower()
    if "zero1" in name or "flat" in name:
        return "zero1_flat"
    return "zero_redundancy" if "zero" in name else "sharded" if "shard" in name else "adamw"


def load_sharding_accounting(res, world_size: int = 2) -> list[dict[str, Any]]:
    """The rows of ``world_size`` ranks by dtype, then AdamW, ours, ZeRO; ``kind`` normalised (each case ran on
    freshly spawned ranks)."""
    rows = [dict(r, kind=optimizer_kind(r["optimizer"]))
            for r in res.rows("optimizer_state_sharding_accounting", world_size=world_size)]
    order = list(OPTIMIZER_LABEL)
    return sorted(rows, key=lambda r: (DTYPE_ORDER.index(r["dtype"]) if r.get("dtype") in DTYPE_ORDER else 9,
                                       order.index(r["kind"])))


@problem("optimizer_state_sharding_accounting")
def optimizer_state_sharding_accounting(res, out: Output) -> dict[str, Any]:
    rows = load_sharding_accounting(res)
    size, params, world = model_params(rows)
    ok = {(r.get("dtype"), r["kind"]): r for r in rows if not r.get("oom")}
    dtypes = [d for d in DTYPE_ORDER if all((d, k) in ok for k in REQUIRED_KINDS)]
    if dtypes != DTYPE_ORDER:
        raise Missing(SHARDING_FILE, f"AdamW, sharded and zero_redundancy rows in {' and '.join(DTYPE_ORDER)}")

    summary_table = sharding_summary(rows)
    four = load_sharding_accounting(res, world_size=4)
    four_table = sharding_summary(four)
    body = []
    components = []
    for r in rows:
        for parts in flatten_breakdown(r.get("breakdown") or r.get("memory")).values():
            components += [c for c in parts if c not in components]
    for r in rows:
        if r.get("oom"):
            continue
        for stage, parts in flatten_breakdown(r.get("breakdown") or r.get("memory")).items():
            body.append([OPTIMIZER_LABEL[r["kind"]], r.get("dtype", DASH), stage.replace("_", " "),
                         *[num(parts.get(c), 2) for c in components]])
    if not body:
        raise Missing(SHARDING_FILE, "no 'memory' breakdown in the rows")
    breakdown_table = table(["optimizer", "dtype", "when", *[c.removesuffix("_gb").replace("_", " ") for c in components]],
                            body, "Memory per GPU (GB) at each point of the step, by what holds it: peak is the highest "
                            "allocation since the previous point, rest what is neither parameters, gradients nor "
                            "optimizer state (before the step: activations and temporaries at the peak).", size=8)
    expected = accounting.sharding_memory(params, world)
    traffic = accounting.sharding_traffic(params, world)
    gb = lambda b: num(b / 1e9, 1)

    def per_dtype(dtype: str) -> dict[str, Any]:
        plain, sharded, zero = (ok[(dtype, k)] for k in REQUIRED_KINDS)
        return {
            "peak_plain": num(plain["peak_gb"], 1), "peak_sharded": num(sharded["peak_gb"], 1),
            "peak_zero": num(zero["peak_gb"], 1),
            "measured_saving": num(plain["peak_gb"] - sharded["peak_gb"], 1),
            "state_plain": num(plain.get("optimizer_state_gb"), 1), "state_sharded": num(sharded.get("optimizer_state_gb"), 1),
            "step_plain": num(plain["step_ms"]), "step_sharded": num(sharded["step_ms"]), "step_zero": num(zero["step_ms"]),
            "slowdown": times(sharded["step_ms"] / plain["step_ms"]),
            "zero_slowdown": times(zero["step_ms"] / plain["step_ms"]),
            "vs_zero": times(sharded["step_ms"] / zero["step_ms"], 3),
            **flat_numbers(ok.get((dtype, "zero1_flat")), zero),
        }

    def flat_numbers(flat: dict[str, Any] | None, zero: dict[str, Any]) -> dict[str, Any]:
        """The ZeRO-1 flat optimizer beside ZeroRedundancyOptimizer, when measured."""
        if flat is None:
            return {"has_flat": False}
        return {"has_flat": True, "step_flat": num(flat["step_ms"]), "peak_flat": num(flat["peak_gb"], 2),
                "peak_zero_2": num(zero["peak_gb"], 2), "flat_vs_zero": times(flat["step_ms"] / zero["step_ms"], 3),
                "flat_no_worse": flat["step_ms"] <= zero["step_ms"] and flat["peak_gb"] <= zero["peak_gb"]}

    n = {
        "size": size, "world": str(world), "params": f"{params / 1e9:.3f}",
        "weights": gb(expected["weights"]), "state": gb(expected["state"]), "state_sharded": gb(expected["state_sharded"]),
        "total": gb(expected["total"]), "total_sharded": gb(expected["total_sharded"]),
        "saving": gb(expected["total"] - expected["total_sharded"]),
        "all_reduce": gb(traffic["all_reduce"]), "ours_traffic": gb(traffic["ours"]), "zero1": gb(traffic["zero1"]),
        "dtypes": dtypes, **{d: per_dtype(d) for d in dtypes},
    }
    n["has_flat"] = any(n[d]["has_flat"] for d in dtypes)
    # Where these rows and the DDP benchmarks' ran: the launch-to-launch variation quoted from the DDP section was
    # measured on its own machine.
    n["where"] = rows[0].get("device", DASH)
    ddp_rows = res.rows("ddp_benchmarking", world_size=int(world))
    ddp_devices = sorted({r.get("device", DASH) for r in ddp_rows})
    quoted = {id(r) for r in ddp_rows}
    res.used = [r for r in res.used if id(r) not in quoted]  # quoted for their device only: not this section's rows
    n["ddp_where"] = ", ".join(ddp_devices) or DASH
    n["same_machine"] = ddp_devices == [n["where"]]
    n["four"] = flat_at_four(four)
    return {"tables": {"summary": summary_table, "breakdown": breakdown_table, "four": four_table}, "n": n}


def flat_at_four(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Flat ZeRO-1 against ``ZeroRedundancyOptimizer`` per dtype (the rows of one world size)."""
    ok = {(r.get("dtype"), r["kind"]): r for r in rows if not r.get("oom")}
    out = {"world": str(rows[0].get("world_size")), "where": rows[0].get("device", DASH)}
    for dtype in DTYPE_ORDER:
        flat, zero = ok.get((dtype, "zero1_flat")), ok.get((dtype, "zero_redundancy"))
        out[dtype] = {"vs_zero": times(flat["step_ms"] / zero["step_ms"], 3) if flat and zero else DASH,
                      "peak_flat": num(flat and flat["peak_gb"], 2), "peak_zero": num(zero and zero["peak_gb"], 2)}
    return out


def sharding_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Step, ratios to AdamW and to ``ZeroRedundancyOptimizer`` of the same dtype, peak and state, per row."""
    size, _, world = model_params(rows)
    ok = {(r.get("dtype"), r["kind"]): r for r in rows if not r.get("oom")}

    def ratio(r: dict[str, Any], kind: str) -> str:
        base = ok.get((r.get("dtype"), kind))
        return times(r["step_ms"] / base["step_ms"], 3) if base and not r.get("oom") else DASH

    summary = [[OPTIMIZER_LABEL[r["kind"]], r.get("dtype", DASH)]
               + (["OOM", DASH, DASH, DASH, DASH] if r.get("oom") else
                  [num(r.get("step_ms")), ratio(r, "adamw"), ratio(r, "zero_redundancy"), num(r.get("peak_gb"), 2),
                   num(r.get("optimizer_state_gb"), 2)]) for r in rows]
    first = rows[0]
    return table(["optimizer", "dtype", "step (ms)", "vs AdamW", "vs ZeRO", "peak (GB)", "optimizer state (GB)"],
                 summary,
                 f"{size} model on {world} GPUs ({first.get('device', DASH)}) under our bucketed DDP "
                 f"({first.get('ddp', DASH)}), context {first.get('context_length')}, batch {first.get('batch_size')} "
                 f"per GPU, each case on freshly spawned ranks: median step time over {first.get('steps')} steps, its "
                 "ratio to AdamW and to ZeroRedundancyOptimizer of the same dtype, peak memory per GPU and the "
                 "optimizer state each GPU holds.", size=8)


@problem("fsdp")
def fsdp(res, out: Output) -> dict[str, Any]:
    return {}  # implementation only: the text describes the code


FSDP_FILE = "writeup/results/fsdp_accounting.jsonl"
FSDP_NAMES = {"ddp": "DDP (no sharding)", "fsdp2": "PyTorch FSDP2", "ours": "ours (FSDP by blocks)"}
STATE_BYTES = 12  # held between steps: fp32 weights and AdamW's two moments (zero_grad(set_to_none=True) frees gradients)


def checkpointing_label(group: int) -> str:
    return "none" if not group else "every block" if group == 1 else f"groups of {group} blocks"


def load_fsdp_accounting(res) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of ``fsdp_accounting.jsonl`` by ``measure``: ``step`` (impl ours / fsdp2 / ddp: step time, peak
    and state memory per GPU), ``check`` (ours against single-process training on NCCL) and ``timeline``.

    Only ``step`` rows with a ``checkpointing`` key (commit c043a0f on): the rows before it measured an earlier FSDP,
    sharded per Linear layer; they stay in the file, out of the writeup. Likewise only the ``check`` and ``timeline``
    rows no older than the oldest of those step rows (an older one checked or traced the earlier FSDP); timelines
    newest first."""
    when = lambda r: r.get("env", {}).get("date", "")

    def current(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        since = min((when(r) for r in rows if r.get("measure") == "step" and "checkpointing" in r), default="~")
        return [r for r in rows if (r.get("measure") == "step" and "checkpointing" in r)
                or (r.get("measure") in ("check", "timeline") and when(r) >= since)]

    rows = res.rows("fsdp_accounting", keep=current)
    by = lambda m: sorted((r for r in rows if r.get("measure") == m), key=lambda r: (when(r), r.get("run", "")),
                          reverse=True)
    return by("step"), by("check"), by("timeline")


@problem("fsdp_accounting")
def fsdp_accounting(res, out: Output) -> dict[str, Any]:
    steps, checks, timelines = load_fsdp_accounting(res)
    if not steps:
        raise Missing(FSDP_FILE, "no rows with measure 'step' and a 'checkpointing' key")
    size, params, world = model_params(steps)
    order = {"ddp": 0, "fsdp2": 1, "ours": 2}
    steps = sorted(steps, key=lambda r: (r["checkpointing"], order.get(r["impl"], 9)))
    ok = {(r["checkpointing"], r["impl"]): r for r in steps if not r.get("oom") and r.get("peak_gb")}

    def versus(r: dict[str, Any], key: str) -> str:
        fsdp2 = ok.get((r["checkpointing"], "fsdp2"))
        return times(r[key] / fsdp2[key]) if fsdp2 and not r.get("oom") and r.get(key) else DASH

    body = [[checkpointing_label(r["checkpointing"]), FSDP_NAMES.get(r["impl"], r["impl"])]
            + (["OOM", DASH, DASH, DASH, DASH, DASH, DASH] if r.get("oom") else
               [num(r.get("step_ms")), pm(r.get("mean_ms"), r.get("std_ms")), versus(r, "step_ms"),
                num(r.get("peak_gb"), 1), versus(r, "peak_gb"), num(r.get("state_gb"), 1),
                num(STATE_BYTES * r["local_params"] / 1e9 if r.get("local_params") else None, 1)])
            for r in steps]
    first = steps[0]
    tab = table(["checkpointing", "implementation", "step (ms)", "mean ± std (ms)", "vs FSDP2", "peak (GB)",
                 "vs FSDP2", "state (GB)", "expected state (GB)"], body,
                f"{size} model on {world} GPUs, batch {first.get('batch_per_rank')} per GPU, context "
                f"{first.get('context_length')}, {first.get('dtype')} compute, AdamW, each case on freshly spawned ranks, "
                f"without and with activation checkpointing: the slowest rank's median step time over {first.get('steps')} "
                "steps (and mean ± standard deviation), peak memory per GPU, the ratios of both to FSDP2 checkpointed "
                f"alike, and the memory held between steps (state) against {STATE_BYTES} bytes per local parameter (fp32 "
                "weights and AdamW's two moments; the gradients are freed between steps).",
                align=["left", "left", "right", "right", "right", "right", "right", "right", "right"], size=8)
    tl = timelines[0] if timelines else {}
    figs = []
    if tl.get("figure"):
        figs.append(out.existing(tl["figure"],
                                 f"Profiler timeline of one step of our FSDP ({tl.get('dtype')} compute, no "
                                 "checkpointing) on rank 0: all-gathers and reduce-scatters (communication stream) "
                                 "against the blocks that use them (compute stream); an all-gather is red when its "
                                 "block waited for it."))
    expected = accounting.sharding_memory(params, world)
    hp = MODEL_SIZES[size]
    block_params = 4 * hp["d_model"] ** 2 + 3 * hp["d_model"] * hp["d_ff"] + 2 * hp["d_model"]
    compute_bytes = 2 if first.get("dtype") in ("bf16", "fp16") else accounting.FP32

    def case(group: int) -> dict[str, Any]:
        ours, base, fsdp2 = ok.get((group, "ours")), ok.get((group, "ddp")), ok.get((group, "fsdp2"))
        return {
            "has_ours": bool(ours), "has_ddp": bool(ours and base), "has_fsdp2": bool(ours and fsdp2),
            "ours_ms": num(ours and ours["step_ms"]), "ours_peak": num(ours and ours["peak_gb"], 1),
            "ddp_ms": num(base and base["step_ms"]), "ddp_peak": num(base and base["peak_gb"], 1),
            "fsdp2_ms": num(fsdp2 and fsdp2["step_ms"]), "fsdp2_peak": num(fsdp2 and fsdp2["peak_gb"], 1),
            "saving": num(base["peak_gb"] - ours["peak_gb"], 1) if ours and base else DASH,
            "excess": num(base["peak_gb"] - ours["peak_gb"] - (expected["total"] - expected["fsdp_total"]) / 1e9, 1)
            if ours and base else DASH,
            "vs_ddp": times(ours["step_ms"] / base["step_ms"]) if ours and base else DASH,
            "vs_fsdp2": times(ours["step_ms"] / fsdp2["step_ms"]) if ours and fsdp2 else DASH,
            "peak_vs_fsdp2": times(ours["peak_gb"] / fsdp2["peak_gb"]) if ours and fsdp2 else DASH,
            "mean_vs_fsdp2": times(ours["mean_ms"] / fsdp2["mean_ms"])
            if ours and fsdp2 and ours.get("mean_ms") and fsdp2.get("mean_ms") else DASH,
            "fsdp2_std": num(fsdp2 and fsdp2.get("std_ms"), 0), "ours_std": num(ours and ours.get("std_ms"), 0),
        }

    plain, ckpt = ok.get((0, "ours")), ok.get((1, "ours"))
    fsdp2_plain, fsdp2_ckpt = ok.get((0, "fsdp2")), ok.get((1, "fsdp2"))
    check_text = "; ".join(
        f"{c.get('dtype')}: {'bit-exact' if c.get('bit_exact') else 'max |Δ| ' + num(c.get('max_abs_diff'), 6)} "
        f"after {c.get('steps')} steps ({'passed' if c.get('passed') else 'FAILED'})" for c in checks)
    n = {
        "size": size, "world": str(world), "params": f"{params / 1e9:.3f}",
        "total": num(expected["total"] / 1e9, 1), "fsdp_total": num(expected["fsdp_total"] / 1e9, 1),
        "expected_saving": num((expected["total"] - expected["fsdp_total"]) / 1e9, 1),
        "gathered_mb": num(3 * block_params * compute_bytes / 1e6, 0), "dtype": str(first.get("dtype")),
        "bf16_weights_gb": num(2 * params / 1e9, 1),
        "plain": case(0), "ckpt": case(1), "has_ckpt": bool(ckpt),
        "ckpt_cost": times(ckpt["step_ms"] / plain["step_ms"]) if ckpt and plain else DASH,
        "fsdp2_ckpt_cost": times(fsdp2_ckpt["step_ms"] / fsdp2_plain["step_ms"]) if fsdp2_ckpt and fsdp2_plain else DASH,
        "has_check": bool(checks), "check": check_text,
        "check_setup": (f"{checks[0].get('size')} model, context {checks[0].get('context_length')}, "
                        f"{checks[0].get('world_size')} GPUs over {checks[0].get('backend')}") if checks else "",
        "has_timeline": bool(tl),
        "tl_span": num(tl.get("span_ms"), 1), "tl_compute": num(tl.get("compute_ms"), 1),
        "tl_fwd": str(tl.get("forward_gathers", DASH)), "tl_fwd_exposed": str(tl.get("forward_gathers_exposed", DASH)),
        "tl_fwd_stall": num(tl.get("forward_stall_ms"), 1),
        "tl_bwd": str(tl.get("backward_gathers", DASH)), "tl_bwd_exposed": str(tl.get("backward_gathers_exposed", DASH)),
        "tl_bwd_stall": num(tl.get("backward_stall_ms"), 1),
        "tl_comm": num(tl.get("comm_ms"), 1), "tl_hidden": num(tl.get("comm_hidden_ms"), 1),
        "tl_exposed": num(tl.get("comm_exposed_ms"), 1), "tl_rs": str(tl.get("reduce_scatters", DASH)),
    }
    return {"tables": {"main": tab}, "figures": figs, "n": n}
