"""The 2026 leaderboard step: one training step of the 8B model on two GPUs, both stacks of
``cs336_systems.train.SHARDED_STACKS`` (``leaderboard_2026``), its predicted memory budget, and one profiled step
of each stack at fewer layers (``leaderboard_2026_profile``, written by ``scripts/leaderboard_2026_profile.py``); and
the one-GPU proxy of one rank's work (rows with ``world_size: 1``) with its profile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cs336_systems.bench.common.leaderboard_2026_model import (
    GB, MODEL, STACK_OF_ROW, memory_budget, step_flop_parts, step_flops,
)
from cs336_systems.train.step import LOSS_CHUNK_TOKENS
from pipeline import accounting, figures
from pipeline.markup import DASH, num, pct, sig, table, times
from pipeline.results import Missing
from pipeline.sections import leaderboard_2026_plans as plans
from pipeline.sections.registry import Output, problem
from pipeline.sections.train_step import PART_NAMES

STACKS = ("ours", "pytorch")

# The parts the leaderboard stacks add to those of the single-GPU step (cs336_systems/train/step.py).
LB_PART_NAMES = {
    **PART_NAMES,
    ("compile", "none"): "none (our kernels run as they are)",
    ("compile", "blocks"): "each block",
    ("checkpointing", 1): "every block",
    ("keep_attention", True): "yes: attention output and log-sum-exp",
    ("keep_attention", False): "no: backward recomputes the whole block",
    ("sharding", "ours"): "our FSDP by blocks",
    ("sharding", "fsdp2"): "FSDP2 fully_shard per block",
    ("loss", "chunked"): f"LM head, F.cross_entropy, over checkpointed chunks of {LOSS_CHUNK_TOKENS:,} tokens",
}

# The GPU-time categories of the profile (scripts/leaderboard_2026_profile.py), in the order the writeup shows them.
CATEGORIES = {
    "matmul": "matmuls", "attention_backward": "attention backward", "attention_forward": "attention forward",
    "other": "other kernels", "collectives": "collectives", "cross_entropy": "cross-entropy",
    "optimizer": "optimizer", "rmsnorm": "RMSNorm",
}
OVERRIDE_NAMES = {"attention=sdpa": "SDPA attention", "compile=none": "uncompiled blocks",
                  "keep_attention=false": "whole blocks recomputed"}

# The rows of the memory table: (key of memory_budget, label).
BUDGET = [("params_gb", "fp32 master parameters (shard)"), ("optimizer_state_gb", "AdamW moments (fp32, shard)"),
          ("grads_gb", "fp32 gradients (shard)"), ("saved_activations_gb", "saved activations (all blocks)"),
          ("block_recompute_gb", "one block's recomputation (transient)"),
          ("loss_head_gb", "loss head (transient)")]


def load_steps(res) -> dict[str, dict[str, Any]]:
    """The newest official rows (``official``: the course's do_bench timing) of both stacks from one invocation
    (same commit) in ``leaderboard_2026.jsonl``, by stack."""
    latest = _newest_of_both_stacks(res, lambda r: r.get("official"))
    if latest is None:
        raise Missing("writeup/results/leaderboard_2026.jsonl", "no official row of each stack from one commit")
    return latest


def load_earlier_official(res, steps: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """The newest official pair measured on another device than ``steps`` (the rows before them), or None."""
    device = steps["ours"]["device"]
    return _newest_of_both_stacks(res, lambda r: r.get("official") and r.get("device") != device)


def load_later_trial(res, steps: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """The newest unofficial (shorter do_bench) row of each stack in ``leaderboard_2026.jsonl``, newer than the
    official rows and both from one invocation (same commit; each stack runs in its own ranks, hence its own run
    id); None if there is no such pair."""
    official = max(r["run"] for r in steps.values())
    return _newest_of_both_stacks(res, lambda r: not r.get("official") and r.get("run", "") > official
                                  and r.get("world_size") == 2)


def load_proxy(res) -> dict[str, dict[str, Any]]:
    """The newest one-GPU proxy rows (``world_size: 1``) of both stacks from one invocation (same commit), by stack."""
    latest = _newest_of_both_stacks(res, lambda r: r.get("world_size") == 1)
    if latest is None:
        raise Missing("writeup/results/leaderboard_2026.jsonl", "no one-GPU proxy rows (world_size 1) of both stacks")
    return latest


def _newest_of_both_stacks(res, accept: Callable[[dict[str, Any]], bool]) -> dict[str, dict[str, Any]] | None:
    """The newest row of each stack among the ``leaderboard_2026`` rows ``accept`` takes (of the stacks as defined:
    residual adds separate from the norms), if both exist and come from one commit (each stack runs in its own
    ranks, hence its own run id), by stack; else None."""
    rows = [r for r in res.log_rows("leaderboard_2026", measured=lambda row: False)
            if r.get("stack") in STACKS and r.get("residual_norm", "separate") == "separate" and accept(r)]
    latest = {r["stack"]: r for r in sorted(rows, key=lambda r: r["run"])}
    if set(latest) != set(STACKS) or len({r["env"].get("commit") for r in latest.values()}) != 1:
        return None
    res.used.extend(latest.values())
    return latest


def _with_env(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The profile script prints device, date and commit at the top level; the environment line reads ``env``."""
    return [{**r, "env": r.get("env") or {k: r.get(k) for k in ("device", "date", "commit")}} for r in rows]


def variant_name(r: dict[str, Any]) -> str:
    parts = r.get("parts") or []
    return r["stack"] + (" with " + ", ".join(OVERRIDE_NAMES.get(p, p) for p in parts) if parts else "")


def load_profile(res, world_size: int) -> dict[str, dict[str, Any]]:
    """The latest profiled step of each variant (stack and overrides) on ``world_size`` GPUs in
    ``leaderboard_2026_profile.jsonl`` (rows without ``world_size`` are of 2; rows with the full step's split left out): the two stacks as defined first, then
    the variants."""
    rows = [r for r in _with_env(res.log_rows("leaderboard_2026_profile", measured=lambda row: False))
            if r.get("world_size", 2) == world_size and "split_ms" not in r]  # the full step's split: its own table
    stacks = [r for r in rows if r["stack"] in STACKS and not r.get("parts")]
    if stacks:  # the device of the newest profile of a stack as defined: the variants profiled there
        device = max(stacks, key=lambda r: r.get("date", ""))["device"]
        rows = [r for r in rows if r["device"] == device]
    latest: dict[str, dict[str, Any]] = {}
    for r in rows:
        name = variant_name(r)
        if name not in latest or r.get("date", "") >= latest[name].get("date", ""):
            latest[name] = r
    if not all(stack in latest for stack in STACKS):
        raise Missing("writeup/results/leaderboard_2026_profile.jsonl",
                      f"no profiled step of each stack on {world_size} GPU(s)")
    res.used.extend(latest.values())
    return dict(sorted(latest.items(), key=lambda item: (bool(item[1].get("parts")), STACKS.index(item[1]["stack"])
                                                         if item[1]["stack"] in STACKS else len(STACKS), item[0])))


def load_official(res) -> list[dict[str, Any]]:
    """Every official row of both stacks in ``leaderboard_2026.jsonl``, oldest first."""
    rows = [r for r in res.log_rows("leaderboard_2026", measured=lambda row: False)
            if r.get("official") and r.get("stack") in STACKS]
    res.used.extend(rows)
    return sorted(rows, key=lambda r: r["run"])


def load_paper_profile(res) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """The profiled step of our stack as defined on two H200s that the B200 on paper reads its rates from: the
    newest full-step split if there is one, else the newest profile; with the official H200 row of ours from the
    same commit (None if there is none). None without such a profile."""
    rows = [r for r in _with_env(res.log_rows("leaderboard_2026_profile", measured=lambda row: False))
            if r["stack"] == "ours" and not r.get("parts") and r.get("world_size", 2) == 2
            and "H200" in r["device"]]
    if not rows:
        return None
    profile = max(rows, key=lambda r: ("split_ms" in r, r.get("run", ""), r.get("date", "")))
    commit = profile["env"].get("commit")
    measured = [r for r in load_official(res) if r["stack"] == "ours" and r["device"] == profile["device"]
                and r["env"].get("commit") == commit]
    res.used.append(profile)
    return profile, (measured[-1] if measured else None)


def config_of(r: dict[str, Any]) -> dict[str, int]:
    return {**MODEL, "num_layers": r["num_layers"], "context_length": r["context_length"]}


def part_text(name: str, value: Any) -> str:
    """A part's value as the stacks table shows it: a per-block list as the count of each mode."""
    if isinstance(value, list):
        return plans.modes_summary(tuple(value))
    return LB_PART_NAMES.get((name, value), str(DASH if value is None else value))


def _stacks_table(steps) -> dict[str, Any]:
    parts = {s: steps[s].get("parts") or {} for s in STACKS}
    names = list(dict.fromkeys([*parts["ours"], *parts["pytorch"]]))
    body = [[name, *[part_text(name, parts[s].get(name)) for s in STACKS]] for name in names]
    return table(["part", *STACKS], body, "The two stacks, part by part, as the rows record them (parts). Both "
                 "compute in bf16 from fp32 master weights, reduce gradients in fp32 and checkpoint every block.",
                 align=["left", "left", "left"], size=8)


def _main_table(steps) -> dict[str, Any]:
    body = []
    for s in STACKS:
        r = steps[s]
        plan = plans.row_plan(r)
        body.append([s, plans.modes_summary(plan["modes"]), num(r["step_ms"], 1), times(r["step_ms"] / steps["pytorch"]["step_ms"], 3),
                     pct(r.get("mfu"), 1), num(r.get("matmul_tflops"), 0), num(plan["predicted_gb"], 1),
                     num(plan["measured_gb"], 1), plans.signed_pct(plan["error"]), num(r.get("first_step_s"), 1),
                     num(r.get("cold_total_s"), 1)])
    header = ["stack", "blocks", "step (ms)", "÷ pytorch", "MFU", "matmul TFLOP/s", "predicted peak GB",
              "peak GB per GPU", "error", "first step (s)", "cold run (s)"]
    r = steps["ours"]
    return table(header, body,
                 f"The official step: {r['num_layers']} layers, context {r['context_length']:,}, batch "
                 f"{r['batch_size']} on {r['world_size']} GPUs, timed with do_bench (rep {r['rep_ms']:,.0f} ms, "
                 f"warm-up {r['warmup_ms']:,.0f} ms; its mean), each stack in its own freshly spawned ranks. MFU: "
                 "the step's matmul FLOPs over the bf16 matmul rate measured in the same run (matmul TFLOP/s, per "
                 "GPU). Blocks: the checkpoint plan, what each block's backward recomputes (the next tables; rows "
                 "without a recorded plan ran their stack's default). Peak: the most memory allocated on a GPU, beside "
                 "the peak memory_budget predicts for the row's plan (error: measured over predicted, less one). "
                 "First step: its compilation included. Cold run: from launch to the last timed step, with empty Triton and Inductor caches.", size=8)


def _memory_table(steps, budgets) -> dict[str, Any]:
    layers = steps["ours"]["num_layers"]
    row_plans = {s: plans.row_plan(steps[s]) for s in STACKS}
    body = [["checkpoint plan (blocks)", *[row_plans[s]["label"] for s in STACKS]]]
    body += [[label.replace("all blocks", f"{layers} blocks"), *[num(budgets[s][key], 1) for s in STACKS]]
             for key, label in BUDGET]
    body.append(["predicted peak", *[num(row_plans[s]["predicted_gb"], 1) for s in STACKS]])
    body.append(["measured peak", *[num(row_plans[s]["measured_gb"], 1) for s in STACKS]])
    body.append(["error", *[plans.signed_pct(row_plans[s]["error"]) for s in STACKS]])
    return table(["GB per GPU", *STACKS], body,
                 "The memory budget of one GPU as cs336_systems.bench.common.leaderboard_2026_model.memory_budget predicts it "
                 "for each row's checkpoint plan (rows without a recorded plan: the stack's default, read from their "
                 "parts), and the peak measured. Masters and moments are always held; the saved activations from forward to "
                 "each block's backward; the gradients build up during backward as the activations drain. The "
                 "predicted peak is the larger of the start of backward (all saved activations and the larger "
                 "transient) and its end (all gradients and a block's recomputation), over masters and moments.",
                 size=8)


def gpu(r: dict[str, Any], category: str) -> float:
    """A profiled step's GPU ms in ``category`` (0 when none of its kernels ran)."""
    return r["gpu_ms"].get(category, 0.0)


def _categories(profile) -> list[str]:
    present = {c for r in profile.values() for c in r["gpu_ms"]}
    return [c for c in CATEGORIES if c in present] + sorted(present - set(CATEGORIES))


def _proxy_table(proxy) -> dict[str, Any]:
    body = [[s, num(r["step_ms"], 1), times(r["step_ms"] / proxy["pytorch"]["step_ms"], 3), pct(r.get("mfu"), 1),
             num(r.get("peak_gb_per_rank"), 1), num(r.get("first_step_s"), 1), num(r.get("cold_total_s"), 1)]
            for s, r in proxy.items()]
    r = proxy["ours"]
    return table(["stack", "step (ms)", "÷ pytorch", "MFU", "peak GB", "first step (s)", "cold run (s)"], body,
                 f"The one-GPU proxy: {r['num_layers']} layers, one sequence of {r['context_length']:,} tokens, the full "
                 f"head, on {r['device']}, do_bench (rep {r['rep_ms']:,.0f} ms, warm-up {r['warmup_ms']:,.0f} ms; its "
                 "mean), each stack in its own freshly spawned rank with empty caches.", size=8)


def _profile_table(profile) -> dict[str, Any]:
    names = list(profile)
    body = [[CATEGORIES.get(c, c), *[num(r["gpu_ms"].get(c), 1) for r in profile.values()]]
            for c in _categories(profile)]
    body.append(["sum of the kernels", *[num(sum(r["gpu_ms"].values()), 1) for r in profile.values()]])
    body.append(["step (wall)", *[num(r["wall_ms"], 0) for r in profile.values()]])
    r = profile["ours"]
    world = r.get("world_size", 2)
    where = f"one sequence per GPU, {world} GPUs" if world > 1 else "one sequence, one GPU: the proxy"
    return table(["GPU ms", *names], body,
                 f"One profiled step at {r['layers']} layers (context {r['context_length']:,}, {where}; {r['device']}), "
                 "after warm-up steps: the summed GPU time of the kernels of each category on rank 0 "
                 "(torch.profiler), and the step's wall time. The collectives run beside the computation, so the "
                 "kernels may add up to more than the wall time. A dash: no kernel of the category (PyTorch's RMSNorm "
                 "runs inside the compiled blocks' kernels, counted as other).", size=8)


def _profile_figure(out: Output, profile, file_name: str = "leaderboard_2026_profile") -> dict[str, str]:
    categories = _categories(profile)
    fig, axes = figures.new(6.5, 2.6)
    ax = axes[0]
    width = 0.8 / len(profile)
    for i, (name, r) in enumerate(profile.items()):
        xs = [x + (i - (len(profile) - 1) / 2) * width for x in range(len(categories))]
        values = [gpu(r, c) for c in categories]
        bars = ax.bar(xs, values, width, label=f"{name} (step {r['wall_ms']:,.0f} ms)")
        ax.bar_label(bars, [f"{v:.0f}" if v >= 1 else "" for v in values], fontsize=5.5, padding=1)
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels([CATEGORIES.get(c, c).replace(" ", "\n", 1) for c in categories], fontsize=7)
    ax.set_ylabel("GPU ms (rank 0)")
    figures.legend_below(fig, ax, ncol=len(profile) if len(profile) <= 3 else 2)
    r = profile["ours"]
    return out.save(fig, file_name,
                    f"GPU kernel time by category of one {r['layers']}-layer step (rank 0), per stack; the legend "
                    "gives each step's wall time.")


def signed(x: float, digits: int = 1) -> str:
    """``+4.7`` or ``−5.4`` (a minus sign, not a hyphen); ``0.0`` when it rounds to zero."""
    text = f"{x:+.{digits}f}"
    return text[1:] if float(text) == 0 else text.replace("-", "−")


def top_kernel(r: dict[str, Any], *keys: str) -> float | None:
    """The time of the slowest kernel in the row's ``top_kernels`` whose name holds one of ``keys``."""
    times_ms = [ms for name, ms in (r.get("top_kernels") or {}).items() if any(k in name for k in keys)]
    return max(times_ms) if times_ms else None


@problem("leaderboard_2026")
def leaderboard_2026(res, out: Output) -> dict[str, Any]:
    steps = load_steps(res)
    profile = load_profile(res, world_size=2)
    ours, torch = steps["ours"], steps["pytorch"]
    config = config_of(ours)
    batch, world = ours["batch_size"], ours["world_size"]
    total = step_flops(config, batch)
    if abs(total - ours["flops"]) > 1e-6 * total:
        raise ValueError(f"the row's flops {ours['flops']:.4g} are not step_flops of its configuration {total:.4g}")
    attention = step_flop_parts(config, batch)["attention"]
    budgets = {s: memory_budget(config_of(steps[s]), STACK_OF_ROW[s], world_size=steps[s]["world_size"],
                                per_rank_batch=steps[s]["batch_size"] // steps[s]["world_size"],
                                loss=(steps[s].get("parts") or {}).get("loss"), modes=plans.row_modes(steps[s]))
               for s in STACKS}
    ratio = ours["step_ms"] / torch["step_ms"]
    peak = max(ours.get("peak_gb_ranks") or [ours["peak_gb_per_rank"]])

    p_ours, p_torch = profile["ours"], profile["pytorch"]
    variants = {name: r for name, r in profile.items() if r.get("parts")}
    sdpa = next((r for r in variants.values() if r["stack"] == "ours" and r["parts"] == ["attention=sdpa"]), None)

    bwd_gap = gpu(p_ours, "attention_backward") - gpu(p_torch, "attention_backward")
    wall_gap = p_ours["wall_ms"] - p_torch["wall_ms"]
    ours_bwd_kernel = top_kernel(p_ours, "attn_bwd")
    cudnn_bwd_kernel = top_kernel(p_torch, "bprop")
    layers_note = p_ours["layers"]

    def budget_phase(s):
        b = budgets[s]
        start = b["saved_activations_gb"] + max(b["loss_head_gb"], b["block_recompute_gb"])
        end = b["grads_gb"] + b["block_recompute_gb"]
        return "the start of backward" if start >= end else "the end of backward"

    n = {
        "params_b": num(accounting.parameter_count(**config) / 1e9, 2),
        "vocab": f"{config['vocab_size']:,}", "d_model": f"{config['d_model']:,}", "d_ff": f"{config['d_ff']:,}",
        "layers": str(config["num_layers"]), "heads": str(config["num_heads"]),
        "d_head": str(config["d_model"] // config["num_heads"]),
        "batch": str(batch), "world": str(world), "context": f"{config['context_length']:,}",
        "bench_call": f"triton.testing.do_bench(train_step, rep={ours['rep_ms']:_.0f}, "
                      f"warmup={ours['warmup_ms']:_.0f})",
        "pflop": num(total / 1e15, 2), "weights_pflop": num((total - attention) / 1e15, 2),
        "attention_pflop": num(attention / 1e15, 2),
        "ours_ms": num(ours["step_ms"], 1), "torch_ms": num(torch["step_ms"], 1),
        "ours_s": num(ours["step_ms"] / 1e3, 2), "ratio": times(ratio, 2),
        "ours_mfu": pct(ours.get("mfu"), 1), "torch_mfu": pct(torch.get("mfu"), 1),
        "ours_faster": ratio < 1,
        "ours_peak": num(peak, 1), "torch_peak": num(torch["peak_gb_per_rank"], 1),
        "ours_cold": num(ours["cold_total_s"], 1), "torch_cold": num(torch["cold_total_s"], 1),
        "ours_first": num(ours["first_step_s"], 1), "torch_first": num(torch["first_step_s"], 1),
        # the memory budget
        "ours_predicted": num(budgets["ours"]["peak_gb"], 1), "torch_predicted": num(budgets["pytorch"]["peak_gb"], 1),
        "ours_peak_at": budget_phase("ours"), "torch_peak_at": budget_phase("pytorch"),
        "torch_loss_head": num(budgets["pytorch"]["loss_head_gb"], 1),
        "ours_loss_head": num(budgets["ours"]["loss_head_gb"], 1),
        "ours_error": signed(peak - budgets["ours"]["peak_gb"]),
        "torch_error": signed(torch["peak_gb_per_rank"] - budgets["pytorch"]["peak_gb"]),
        "ours_saved": num(budgets["ours"]["saved_activations_gb"], 1),
        "torch_saved": num(budgets["pytorch"]["saved_activations_gb"], 1),
        # the profile
        "p_layers": str(layers_note),
        "p_ours_wall": num(p_ours["wall_ms"], 0), "p_torch_wall": num(p_torch["wall_ms"], 0),
        "p_ratio": times(p_ours["wall_ms"] / p_torch["wall_ms"], 2), "p_wall_gap": num(wall_gap, 0),
        "p_ours_bwd": num(gpu(p_ours, "attention_backward"), 1),
        "p_torch_bwd": num(gpu(p_torch, "attention_backward"), 1),
        "p_bwd_ratio": times(gpu(p_ours, "attention_backward") / gpu(p_torch, "attention_backward"), 2),
        "p_bwd_gap": num(bwd_gap, 0), "bwd_gap_covers_wall_gap": bwd_gap >= wall_gap,
        "p_ours_faster": wall_gap < 0, "p_wall_lead": num(-wall_gap, 0),
        "has_kernels": bool(ours_bwd_kernel and cudnn_bwd_kernel),
        "ours_bwd_kernel": num(ours_bwd_kernel, 0), "cudnn_bwd_kernel": num(cudnn_bwd_kernel, 0),
        "p_ours_fwd": num(gpu(p_ours, "attention_forward"), 1),
        "p_torch_fwd": num(gpu(p_torch, "attention_forward"), 1),
        "p_ours_ce": num(gpu(p_ours, "cross_entropy"), 1), "p_torch_ce": num(gpu(p_torch, "cross_entropy"), 1),
        "p_ours_other": num(gpu(p_ours, "other"), 1), "p_torch_other": num(gpu(p_torch, "other"), 1),
        "has_sdpa": sdpa is not None,
    }
    ours_parts, torch_parts = ours.get("parts") or {}, torch.get("parts") or {}
    n.update({
        "device": ours["device"], "commit": str(ours["env"].get("commit")), "date": str(ours["env"]["date"])[:10],
        "ours_compiled": ours_parts.get("compile") == "blocks",
        "torch_loss_chunked": torch_parts.get("loss") == "chunked", "chunk_tokens": f"{LOSS_CHUNK_TOKENS:,}",
        "full_logits_gb": num(config["context_length"] * config["vocab_size"] * (2 + 4 + 2) / GB, 0),
        "p_ours_mm": num(gpu(p_ours, "matmul"), 1), "p_torch_mm": num(gpu(p_torch, "matmul"), 1),
        "p_ours_coll": num(gpu(p_ours, "collectives"), 1), "p_torch_coll": num(gpu(p_torch, "collectives"), 1),
    })
    earlier = load_earlier_official(res, steps)
    n["has_earlier"] = earlier is not None
    if earlier is not None:
        e_ours, e_torch = earlier["ours"], earlier["pytorch"]
        n.update({
            "earlier_device": e_ours["device"], "earlier_date": str(e_ours["env"]["date"])[:10],
            "earlier_ours": num(e_ours["step_ms"], 1), "earlier_torch": num(e_torch["step_ms"], 1),
            "earlier_ratio": times(e_ours["step_ms"] / e_torch["step_ms"], 2),
            "earlier_ours_peak": num(e_ours.get("peak_gb_per_rank"), 1),
            "earlier_torch_peak": num(e_torch.get("peak_gb_per_rank"), 1),
            "earlier_ours_compiled": (e_ours.get("parts") or {}).get("compile") == "blocks",
            "earlier_torch_loss": (e_torch.get("parts") or {}).get("loss", "plain"),
        })
    trial = load_later_trial(res, steps)
    n["has_trial"] = trial is not None
    if trial is not None:
        n.update({
            "trial_ours": num(trial["ours"]["step_ms"], 1), "trial_torch": num(trial["pytorch"]["step_ms"], 1),
            "trial_ratio": times(trial["ours"]["step_ms"] / trial["pytorch"]["step_ms"], 3),
            "trial_rep": f"{trial['ours']['rep_ms']:,.0f}", "trial_warmup": f"{trial['ours']['warmup_ms']:,.0f}",
            "trial_commit": str(trial["ours"]["env"].get("commit")), "trial_date": str(trial["ours"]["env"]["date"])[:10],
            "trial_ours_peak": num(trial["ours"].get("peak_gb_per_rank"), 1),
        })
    if sdpa is not None:
        n.update({
            "sdpa_wall": num(sdpa["wall_ms"], 0), "sdpa_ratio": times(sdpa["wall_ms"] / p_torch["wall_ms"], 2),
            "sdpa_bwd": num(gpu(sdpa, "attention_backward"), 1), "sdpa_fwd": num(gpu(sdpa, "attention_forward"), 1),
            "sdpa_fwd_ratio": sig(gpu(p_torch, "attention_forward") / gpu(sdpa, "attention_forward"), 2),
            "sdpa_other": num(gpu(sdpa, "other"), 1), "sdpa_ce": num(gpu(sdpa, "cross_entropy"), 1),
            "sdpa_faster": sdpa["wall_ms"] < p_torch["wall_ms"],
        })
    proxy, proxy_profile = load_proxy(res), load_profile(res, world_size=1)
    n["proxy"] = _proxy_numbers(proxy, proxy_profile)
    tables = {"stacks": _stacks_table(steps), "main": _main_table(steps), "memory": _memory_table(steps, budgets),
              "profile": _profile_table(profile), "proxy": _proxy_table(proxy),
              "proxy_profile": _profile_table(proxy_profile)}
    found = {"profile": _profile_figure(out, profile),
             "proxy_profile": _profile_figure(out, proxy_profile, "leaderboard_2026_proxy_profile")}
    _plans_and_paper(res, out, n, tables, found)
    return {"tables": tables, "figures": found, "n": n}


def _plans_and_paper(res, out: Output, n: dict[str, Any], tables: dict[str, Any], found: dict[str, Any]) -> None:
    """Every official row's plan and peaks, the full step's split (when profiled) and the B200 on paper (when an
    H200 profile exists), into ``n``, ``tables`` and ``found`` (the figures)."""
    official = load_official(res)
    tables["plans"] = plans.plans_table(official)
    n["claim"] = plans.peak_claim_numbers(official)
    split = plans.split_rows(_with_env(res.log_rows("leaderboard_2026_profile", measured=lambda row: False)))
    n["has_split"] = bool(split)
    if split:
        res.used.extend(split.values())
        tables["split"] = plans.split_table(split)
        found["split"] = plans.split_figure(out, split.get("ours") or next(iter(split.values())))
        first = split.get("ours") or next(iter(split.values()))
        n["split"] = {"device": first["device"], "wall": num(first["wall_ms"], 0),
                      "exposed": num(first["split_ms"]["exposed_communication"], 1),
                      "communication": num(first["communication_ms"], 1),
                      "recompute": num(first["split_ms"]["recompute"], 1)}
    paper = load_paper_profile(res)
    n["has_paper"] = paper is not None
    if paper is not None:
        result = plans.paper_step(*paper)
        tables["paper"] = plans.paper_table(result)
        n["paper"] = {**plans.paper_numbers(result), "profile_layers": str(paper[0]["layers"]),
                      "profile_split": "split_ms" in paper[0], "profile_device": paper[0]["device"]}


def _proxy_numbers(proxy, profile) -> dict[str, Any]:
    """The proxy's numbers for the text: the ratio, the elementwise ("other") GPU time of both stacks,
    and the variants profiled beside them (uncompiled blocks, whole blocks recomputed), when present."""
    ours, torch = proxy["ours"], proxy["pytorch"]
    p_ours, p_torch = profile["ours"], profile["pytorch"]
    ratio = ours["step_ms"] / torch["step_ms"]

    def variant(parts):
        return next((r for r in profile.values() if r["stack"] == "ours" and r.get("parts") == parts), None)

    eager, whole = variant(["compile=none"]), variant(["keep_attention=false"])
    n = {
        "layers": str(ours["num_layers"]), "device": ours["device"], "commit": str(ours["env"].get("commit")),
        "ours_ms": num(ours["step_ms"], 1), "torch_ms": num(torch["step_ms"], 1), "ratio": times(ratio, 3),
        "ours_faster": ratio < 1,
        "ours_mfu": pct(ours.get("mfu"), 1), "torch_mfu": pct(torch.get("mfu"), 1),
        "ours_peak": num(ours.get("peak_gb_per_rank"), 1), "torch_peak": num(torch.get("peak_gb_per_rank"), 1),
        "ours_first": num(ours["first_step_s"], 1), "torch_first": num(torch["first_step_s"], 1),
        "ours_other": num(gpu(p_ours, "other"), 1), "torch_other": num(gpu(p_torch, "other"), 1),
        "other_no_more": gpu(p_ours, "other") <= gpu(p_torch, "other"),
        "ours_bwd": num(gpu(p_ours, "attention_backward"), 1), "torch_bwd": num(gpu(p_torch, "attention_backward"), 1),
        "bwd_ratio": times(gpu(p_ours, "attention_backward") / gpu(p_torch, "attention_backward"), 2),
        "ours_fwd": num(gpu(p_ours, "attention_forward"), 1), "torch_fwd": num(gpu(p_torch, "attention_forward"), 1),
        "ours_ce": num(gpu(p_ours, "cross_entropy"), 1), "torch_ce": num(gpu(p_torch, "cross_entropy"), 1),
        "ours_opt": num(gpu(p_ours, "optimizer"), 1), "torch_opt": num(gpu(p_torch, "optimizer"), 1),
        "has_eager": eager is not None, "has_whole": whole is not None,
    }
    if eager is not None:
        n.update(eager_wall=num(eager["wall_ms"], 0), eager_other=num(gpu(eager, "other"), 1),
                 compiled_wall=num(p_ours["wall_ms"], 0))
    if whole is not None:
        n.update(whole_wall=num(whole["wall_ms"], 0), whole_fwd=num(gpu(whole, "attention_forward"), 1),
                 whole_peak=num(whole.get("peak_gb"), 1), kept_peak=num(p_ours.get("peak_gb"), 1))
    return n
