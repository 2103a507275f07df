"""The 2026 leaderboard step: one training step of the 8B model on two GPUs, both stacks of
``cs336_systems.train.SHARDED_STACKS`` (``leaderboard_2026``), its predicted memory budget, and one profiled step
of each stack at fewer layers (``leaderboard_2026_profile``, written by ``scripts/leaderboard_2026_profile.py``); and
the one-GPU proxy of one rank's work (rows with ``world_size: 1``) with its profile."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from cs336_systems.bench.common.leaderboard_2026_model import (
    GB, MODEL, STACK_OF_ROW, memory_budget, step_flop_parts, step_flops,
)
from cs336_systems.bench.common import result_store
from cs336_systems.train.step import LOSS_CHUNK_TOKENS
from pipeline import accounting, figures
from pipeline.markup import DASH, num, pct, sig, table, times
from pipeline.results import Missing
from pipeline.sections import leaderboard_2026_plans as plans
from pipeline.sections.registry import Output, problem
from pipeline.sections.train_step import PART_NAMES

STACKS = ("ours", "pytorch")
WHOSE = {"ours": "ours", "pytorch": "PyTorch's"}  # a stack's step, as the text names it

# The parts the leaderboard stacks add to those of the single-GPU step (cs336_systems/train/step.py).
LB_PART_NAMES = {
    **PART_NAMES,
    ("compile", "none"): "none (our kernels run as they are)",
    ("compile", "blocks"): "each block",
    ("checkpointing", 1): "every block",
    ("checkpointing", "selective"): "every block, its attention output and log-sum-exp kept",
    ("checkpointing", "full"): "every block, recomputed whole",
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
                  "keep_attention=false": "whole blocks recomputed", "checkpointing=full": "whole blocks recomputed"}

COUNT_WORDS = {1: "One", 2: "Two", 3: "Three", 4: "Four", 5: "Five", 6: "Six"}

# An idle stretch of the GPU this long is no launch latency: the host waited on the device (a synchronisation).
LONG_IDLE_MS = 50.0

# The rows of the memory table: (key of memory_budget, label).
BUDGET = [("params_gb", "fp32 master parameters (shard)"), ("optimizer_state_gb", "AdamW moments (fp32, shard)"),
          ("grads_gb", "fp32 gradients (shard)"), ("saved_activations_gb", "saved activations (all blocks)"),
          ("block_recompute_gb", "one block's recomputation (transient)"),
          ("loss_head_gb", "loss head (transient)")]


def official_pairs(res) -> list[dict[str, dict[str, Any]]]:
    """The official rows (``official``: the course's do_bench timing) of ``leaderboard_2026.jsonl`` as the pairs the
    invocations wrote, oldest first: an invocation times both stacks one after the other (each in its own ranks,
    hence its own run id), so a pair is two rows next to each other in run order, of one device and commit, one of
    each stack (of the stacks as defined: residual adds separate from the norms)."""
    rows = sorted((r for r in res.log_rows("leaderboard_2026", measured=lambda row: False)
                   if r.get("official") and r.get("stack") in STACKS
                   and r.get("residual_norm", "separate") == "separate"), key=lambda r: r["run"])
    pairs, i = [], 0
    while i + 1 < len(rows):
        first, second = rows[i], rows[i + 1]
        if (first["stack"] != second["stack"] and first["device"] == second["device"]
                and first["env"].get("commit") == second["env"].get("commit")):
            pairs.append({first["stack"]: first, second["stack"]: second})
            i += 2
        else:
            i += 1
    for pair in pairs:
        res.used.extend(pair.values())
    return pairs


def planned(pair: dict[str, dict[str, Any]]) -> bool:
    """Whether both rows ran a recorded ``--checkpoint-plan`` plan (rows before the planner ran the defaults)."""
    return all(r.get("checkpoint_plan") for r in pair.values())


def same_plan(pair: dict[str, dict[str, Any]]) -> bool:
    return plans.row_modes(pair["ours"]) == plans.row_modes(pair["pytorch"])


def headline_pair(pairs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The pair the section leads with: among the planned pairs (all pairs if none is), each stack with its own
    planner's plan, those of the device whose rows reached the largest peak (the largest card lent, the nearest to
    the leaderboard's); of these the newest."""
    pool = [p for p in pairs if planned(p)] or pairs
    if not pool:
        raise Missing("writeup/results/leaderboard_2026.jsonl", "no official pair of both stacks from one invocation")
    device = max(pool, key=lambda p: max(plans.row_plan(r)["measured_gb"] for r in p.values()))["ours"]["device"]
    on_device = [p for p in pool if p["ours"]["device"] == device]
    return on_device[-1]


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
    latest = {r["stack"]: r for r in result_store.latest(rows, key=lambda r: r["stack"])}
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
        device = result_store.latest(stacks)[0]["device"]
        rows = [r for r in rows if r["device"] == device]
    latest = {variant_name(r): r for r in result_store.latest(rows, key=variant_name)}
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


def load_paper_profile(res, headline_ours: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """The profiled step of our stack as defined on two H200s that the B200 on paper reads its rates from: a
    full-step split before a profile without one, then one of the headline row's commit, then one under the
    headline row's plan, then the newest; with the headline row of ours when it is an H200 row of the same commit
    (else the newest official H200 row of ours of the profile's commit; None if there is none). None without such
    a profile."""
    rows = [r for r in _with_env(res.log_rows("leaderboard_2026_profile", measured=lambda row: False))
            if r["stack"] == "ours" and not r.get("parts") and r.get("world_size", 2) == 2
            and "H200" in r["device"]]
    if not rows:
        return None
    commit, modes = headline_ours["env"].get("commit"), plans.row_modes(headline_ours)
    profile = max(rows, key=lambda r: (plans.has_split(r), r["env"].get("commit") == commit,
                                       plans.profile_modes(r) == modes, r.get("run", ""), r.get("date", "")))
    commit = profile["env"].get("commit")
    measured = [r for r in load_official(res) if r["stack"] == "ours" and r["device"] == profile["device"]
                and r["env"].get("commit") == commit]
    if headline_ours in measured:
        measured.append(headline_ours)
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
    if any(parts[s].get("block_checkpointing") for s in STACKS):  # the per-block plan replaces the uniform flags
        names = [name for name in names if name not in ("checkpointing", "keep_attention")]
    body = [[name, *[part_text(name, parts[s].get(name)) for s in STACKS]] for name in names]
    return table(["part", *STACKS], body, "The two stacks of the headline pair, part by part, as the rows record "
                 "them (parts). Both compute in bf16 from fp32 master weights, reduce gradients in fp32 and "
                 "checkpoint each block as the run's plan says (block_checkpointing).",
                 align=["left", "left", "left"], size=8)


def alloc_retries(r: dict[str, Any]) -> int | None:
    """The caching allocator's retries during the timed steps, the most of any rank (None: not recorded). Each
    retry frees the cached blocks and synchronises the device."""
    events = r.get("allocator_events_ranks")
    return max(e["num_alloc_retries"] for e in events) if events else None


def plan_margin(r: dict[str, Any], what: str = "margin of ([0-9.]+) GiB") -> str | None:
    """The memory margin the plan left (``6.9`` GiB), or another number ``what`` finds in its description."""
    found = re.search(what, (r.get("checkpoint_plan") or {}).get("describe", ""))
    return found.group(1) if found else None


BUDGET_TEXT = "budget of ([0-9.]+) GB"  # the memory a plan was fitted to, in its description


def pair_time(pair: dict[str, dict[str, Any]]) -> str:
    """``2026-11-26 17:13``: when the pair's first run started (UTC)."""
    return str(min(r["env"]["date"] for r in pair.values()))[:16].replace("T", " ")


def pair_numbers(pair: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One pair's numbers for the tables and the text."""
    ours, torch = pair["ours"], pair["pytorch"]
    p = {s: plans.row_plan(pair[s]) for s in STACKS}
    retries = {s: alloc_retries(pair[s]) for s in STACKS}
    return {
        "device": ours["device"], "time": pair_time(pair), "commit": str(ours["env"].get("commit")),
        "ours_plan": plans.modes_count(p["ours"]["modes"]), "torch_plan": plans.modes_count(p["pytorch"]["modes"]),
        "same_plan": same_plan(pair), "margin": plan_margin(ours),
        "earlier_model": any(p[s]["earlier_model"] for s in STACKS),
        "ours_kept": p["ours"]["modes"].count("keep"), "torch_kept": p["pytorch"]["modes"].count("keep"),
        "ours_ms": num(ours["step_ms"], 1), "torch_ms": num(torch["step_ms"], 1),
        "ratio": times(ours["step_ms"] / torch["step_ms"], 3), "ratio_value": ours["step_ms"] / torch["step_ms"],
        "ours_peak": num(p["ours"]["measured_gb"], 1), "torch_peak": num(p["pytorch"]["measured_gb"], 1),
        "ours_predicted": num(p["ours"]["predicted_gb"], 1), "torch_predicted": num(p["pytorch"]["predicted_gb"], 1),
        "predicted_text": f"{num(p['ours']['predicted_gb'], 1)} GB for both"
        if num(p["ours"]["predicted_gb"], 1) == num(p["pytorch"]["predicted_gb"], 1)
        else f"{num(p['ours']['predicted_gb'], 1)} GB (ours) and {num(p['pytorch']['predicted_gb'], 1)} GB (PyTorch's)",
        "ours_retries": retries["ours"], "torch_retries": retries["pytorch"],
        "has_retries": None not in retries.values(),
        "ours_tflops": num(ours.get("matmul_tflops"), 0), "torch_tflops": num(torch.get("matmul_tflops"), 0),
        # Rows before the parts recorded it ran the gradient shards on the reduction stream.
        "gradient_memory": (ours.get("parts") or {}).get("gradient_memory", "reduce_stream"),
    }


def _pairs_table(pairs: list[dict[str, dict[str, Any]]], headline) -> dict[str, Any]:
    body = []
    for pair in pairs:
        x = pair_numbers(pair)
        mark = " (headline)" if pair is headline else ""
        body.append([x["device"], x["time"] + mark, x["ours_plan"], x["torch_plan"], x["margin"] or DASH,
                     x["ours_ms"], x["torch_ms"], x["ratio"], f"{x['ours_peak']} ({x['ours_predicted']})",
                     f"{x['torch_peak']} ({x['torch_predicted']})",
                     f"{num(x['ours_retries'], 0)} / {num(x['torch_retries'], 0)}",
                     f"{x['ours_tflops']} / {x['torch_tflops']}"])
    r = headline["ours"]
    return table(["GPUs", "pair (UTC)", "plan: ours", "plan: PyTorch", "margin GiB", "ours ms", "PyTorch ms",
                  "÷ PyTorch", "ours peak GB (predicted)", "PyTorch peak GB (predicted)",
                  "allocator retries ours / PyTorch", "matmul TFLOP/s ours / PyTorch"], body,
                 f"The official step with --checkpoint-plan auto: {r['num_layers']} layers, context "
                 f"{r['context_length']:,}, batch {r['batch_size']} on {r['world_size']} GPUs, timed with do_bench "
                 f"(rep {r['rep_ms']:,.0f} ms, warm-up {r['warmup_ms']:,.0f} ms; its mean), each stack in its own "
                 "freshly spawned ranks, both stacks in one invocation (a pair). Plan: the blocks by checkpoint "
                 "mode (keep: nothing recomputed; selective: the attention output kept; full: the whole block "
                 "recomputed); margin: the memory the planner left free. Peak: the most memory allocated on a GPU, "
                 "beside the peak the plan was chosen by. Allocator retries: the caching allocator's during the "
                 "timed steps, per rank (each frees its cached blocks and synchronises the device; a dash: not "
                 "recorded). Matmul TFLOP/s: an 8192³ bf16 matmul measured right after each stack's timing, per "
                 "GPU.", align=["left", "left", "left", "left", *["right"] * 8], size=7)


def _earlier_table(pairs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    body = []
    for pair in pairs:
        x = pair_numbers(pair)
        body.append([x["device"], x["time"], x["commit"], x["ours_ms"], x["torch_ms"], x["ratio"],
                     f"{x['ours_peak']} / {x['torch_peak']}", f"{x['ours_tflops']} / {x['torch_tflops']}"])
    return table(["GPUs", "pair (UTC)", "commit", "ours ms", "PyTorch ms", "÷ PyTorch", "peak GB ours / PyTorch",
                  "matmul TFLOP/s ours / PyTorch"], body,
                 "The official pairs from before the planner, same protocol, each stack with its default "
                 "checkpointing (ours every block selective, PyTorch's every block whole) and the parts of its "
                 "commit.", align=["left", "left", "left", *["right"] * 5], size=8)


def _listing(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _range(values: list[int]) -> str:
    """``24`` or ``24 to 60``."""
    return str(values[0]) if min(values) == max(values) else f"{min(values)} to {max(values)}"


def device_numbers(pairs: list[dict[str, dict[str, Any]]], headline) -> dict[str, Any]:
    """The planned pairs of the headline's device for the text: the headline, the others, the spread of the
    ratios, what differs (plans, margins, allocator retries) and the drift of the matmul rate over the runs."""
    xs = [pair_numbers(p) for p in pairs]
    h = pair_numbers(headline)
    others = [pair_numbers(p) for p in pairs if p is not headline]
    ratios = [x["ratio_value"] for x in xs]

    def other_text(x):
        margin = f", a {x['margin']} GiB margin" if x["margin"] and x["margin"] != h["margin"] else ""
        kept = (f"{x['ours_kept']} blocks kept whole in both" if x["same_plan"]
                else f"PyTorch's {x['torch_kept']} blocks kept whole, ours {x['ours_kept']}")
        return f"{x['ratio']} ({x['time'][11:]}: {kept}{margin})"

    retries = [v for x in others for v in (x["ours_retries"], x["torch_retries"]) if v is not None]
    tflops = [r["matmul_tflops"] for p in pairs for r in sorted(p.values(), key=lambda r: r["run"])
              if r.get("matmul_tflops") is not None]
    fewest_kept = min(min(x["ours_kept"], x["torch_kept"]) for x in others) if others else 0
    return {
        "device": h["device"], "count": str(len(xs)), "headline": h,
        "count_word": COUNT_WORDS.get(len(xs), str(len(xs))),
        "ratio_low": times(min(ratios), 3), "ratio_high": times(max(ratios), 3),
        "headline_fastest": h["ratio_value"] == min(ratios), "has_others": bool(others),
        "others": _listing([other_text(x) for x in others]) if others else "",
        "others_keep_more": bool(others) and fewest_kept > max(h["ours_kept"], h["torch_kept"]),
        "headline_gradient_change": h["gradient_memory"] == "compute_stream" and bool(others)
        and all(x["gradient_memory"] == "reduce_stream" for x in others),
        "others_peaks": _listing([f"{x['torch_peak']} / {x['ours_peak']}" for x in others]) if others else "",
        "others_retries": _range(retries) if retries else "",
        "others_all_retry": bool(others) and all(x["has_retries"] and x["ours_retries"] and x["torch_retries"]
                                                 for x in others),
        "headline_retries_recorded": h["has_retries"],
        "has_tflops": bool(tflops), "tflops_list": _listing([num(t, 0) for t in tflops]) if tflops else "",
        "tflops_spread": pct((max(tflops) - min(tflops)) / max(tflops), 0) if tflops else DASH,
    }


def other_devices_numbers(pairs: list[dict[str, dict[str, Any]]], device: str) -> list[dict[str, Any]]:
    """Each planned pair on another device than the headline's, for one sentence each."""
    return [pair_numbers(p) for p in pairs if p["ours"]["device"] != device]


def _memory_table(steps, budgets) -> dict[str, Any]:
    layers = steps["ours"]["num_layers"]
    row_plans = {s: plans.row_plan(steps[s]) for s in STACKS}
    body = [["checkpoint plan (blocks)", *[row_plans[s]["label"] for s in STACKS]]]
    body += [[label.replace("all blocks", f"{layers} blocks"), *[num(budgets[s][key], 1) for s in STACKS]]
             for key, label in BUDGET]
    body.append(["predicted peak", *[num(budgets[s]["peak_gb"], 1) for s in STACKS]])
    if any(row_plans[s]["earlier_model"] for s in STACKS):
        body.append(["predicted when planned (earlier model)",
                     *[num(row_plans[s]["predicted_gb"], 1) for s in STACKS]])
    body.append(["measured peak", *[num(row_plans[s]["measured_gb"], 1) for s in STACKS]])
    body.append(["error", *[plans.signed_pct(row_plans[s]["measured_gb"] / budgets[s]["peak_gb"] - 1)
                            for s in STACKS]])
    return table(["GB per GPU", *STACKS], body,
                 "The memory budget of one GPU as cs336_systems.bench.common.leaderboard_2026_model.memory_budget predicts it "
                 "today for the headline pair's checkpoint plans (beside the prediction the plans were chosen by, "
                 "where an earlier model made it), and the peak measured (error: measured over today's prediction, "
                 "less one). Masters and moments are always held; the saved activations from forward to "
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
    pairs = official_pairs(res)
    steps = headline_pair(pairs)
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
        "p_default_plans": not any(r.get("checkpoint_option") for r in profile.values()),
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
    today = [p for p in pairs if planned(p)]
    earlier = [p for p in pairs if not planned(p)] if today else []
    n["planned"] = planned(steps)
    on_device = [p for p in today if p["ours"]["device"] == ours["device"]] if planned(steps) else [steps]
    n["pairs"] = device_numbers(on_device, steps)
    n["other_devices"] = other_devices_numbers(today, ours["device"])
    n["has_earlier"] = bool(earlier)
    if earlier:
        last = pair_numbers(earlier[-1])
        n["earlier"] = {"count": str(len(earlier)), "devices": _listing(list(dict.fromkeys(
            p["ours"]["device"] for p in earlier))), "ratios": _listing([pair_numbers(p)["ratio"] for p in earlier]),
            "last_device": last["device"], "last_ratio": last["ratio"],
            "count_word": COUNT_WORDS.get(len(earlier), str(len(earlier))).lower()}
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
    tables = {"stacks": _stacks_table(steps), "main": _pairs_table(today or [steps], steps),
              "memory": _memory_table(steps, budgets),
              "profile": _profile_table(profile), "proxy": _proxy_table(proxy),
              "proxy_profile": _profile_table(proxy_profile)}
    found = {"profile": _profile_figure(out, profile),
             "proxy_profile": _profile_figure(out, proxy_profile, "leaderboard_2026_proxy_profile")}
    if earlier:
        tables["earlier"] = _earlier_table(earlier)
    _plans_and_paper(res, out, n, tables, found, steps)
    return {"tables": tables, "figures": found, "n": n}


def _plans_and_paper(res, out: Output, n: dict[str, Any], tables: dict[str, Any], found: dict[str, Any],
                     steps: dict[str, dict[str, Any]]) -> None:
    """Every official row's plan and peaks, the full step's split (when profiled; each stack's under the headline
    pair's plan where there is one) and the B200 on paper (when an H200 profile exists), into ``n``, ``tables`` and
    ``found`` (the figures)."""
    official = load_official(res)
    tables["plans"] = plans.plans_table(official)
    n["claim"] = plans.peak_claim_numbers(official)
    profiles = _with_env(res.log_rows("leaderboard_2026_profile", measured=lambda row: False))
    split = plans.split_rows(profiles, {s: plans.row_modes(steps[s]) for s in STACKS})
    # The newest split that records the GPU's idle stretches, beside the others when it is not one of them.
    gap_rows = [r for r in plans.split_rows([r for r in profiles if r.get("idle_gaps")], {}).values()
                if r not in split.values()]
    gap_row = max(gap_rows, key=lambda r: r["run"]) if gap_rows else None
    if gap_row is not None:
        split[f"{gap_row['stack']} (another plan)"] = gap_row
    n["has_split"] = bool(split)
    if split:
        res.used.extend(split.values())
        tables["split"] = plans.split_table(split)
        found["split"] = plans.split_figure(out, split.get("ours") or next(iter(split.values())))
        first = split.get("ours") or next(iter(split.values()))
        n["split"] = _split_numbers(split, first, steps, gap_row or first)
    found_gm, gm = gradient_memory(res, profiles)
    n["gradient_memory"] = gm
    if found_gm is not None:
        tables["gradient_memory"] = found_gm
    paper = load_paper_profile(res, steps["ours"])
    n["has_paper"] = paper is not None
    if paper is not None:
        result = plans.paper_step(*paper)
        tables["paper"] = plans.paper_table(result)
        n["paper"] = {**plans.paper_numbers(result), "profile_layers": str(paper[0]["layers"]),
                      "profile_split": plans.has_split(paper[0]), "profile_device": paper[0]["device"]}


GRADIENT_MEMORY_NAMES = {"reduce_stream": "reduction stream", "compute_stream": "compute stream"}


def gradient_memory(res, profiles: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Our step profiled with its FSDP's gradient shards allocated on each stream (the ``profiles`` rows that record
    ``gradient_memory``): the newest on the reduction stream and the newest on the compute stream before it on the
    same device, plan and number of profiled steps (the device part profiles both in one call); a table and its
    numbers, or None."""
    rows = sorted((r for r in profiles if r["stack"] == "ours" and r.get("gradient_memory")),
                  key=lambda r: r.get("run", ""))

    def setting(r):
        return r["device"], plans.profile_modes(r), r.get("profiled_steps", 1)

    reduce = [r for r in rows if r["gradient_memory"] == "reduce_stream"]
    compute = [r for r in rows if r["gradient_memory"] == "compute_stream" and reduce
               and setting(r) == setting(reduce[-1]) and r["run"] < reduce[-1]["run"]]
    if not compute:
        return None, {"has_gradient_memory": False}
    ordered = [reduce[-1], compute[-1]]
    res.used.extend(ordered)

    def longest(r):
        gaps = (r.get("idle_gaps") or {}).get("largest") or []
        return gaps[0]["ms"] if gaps else None

    steps = ordered[0].get("profiled_steps", 1)
    body = [[GRADIENT_MEMORY_NAMES[r["gradient_memory"]], num(r["wall_ms"], 0), num(r.get("idle_ms"), 1),
             num(longest(r), 1), num((r.get("allocator_events") or {}).get("num_alloc_retries"), 0),
             num(r.get("peak_gb"), 1)] for r in ordered]
    r = ordered[0]
    caption = (f"Our step with the FSDP's float32 gradient shards allocated on the reduction stream or on the "
               f"compute stream ({r['layers']} layers, {r['world_size']} GPUs, {r['device']}, plan "
               f"{plans.modes_count(plans.profile_modes(r))}): {steps} profiled steps after "
               f"{r.get('warmup_steps', 1)} warm-up, rank 0.")
    found = table(["gradient shards on", "step ms (wall)", "GPU idle ms a step", "longest idle stretch, ms",
                   f"allocator retries ({steps} steps)", "peak GB"], body, caption,
                  align=["left", *["right"] * 5])
    before, after = ordered
    return found, {"has_gradient_memory": True, "gm_saved": num(before["wall_ms"] - after["wall_ms"], 0),
                   "gm_idle_before": num(before.get("idle_ms"), 0), "gm_idle_after": num(after.get("idle_ms"), 0),
                   "gm_device": before["device"], "gm_commit": str(before["env"].get("commit"))}


def _split_numbers(split: dict[str, dict[str, Any]], first: dict[str, Any], steps,
                   gap_row: dict[str, Any]) -> dict[str, Any]:
    """The split's numbers for the text: ``first`` (ours where profiled) with its plan, whether each stack's split
    ran its headline row's plan, and ``gap_row``'s largest idle stretches with the allocator's retries when
    recorded."""
    gaps = (gap_row.get("idle_gaps") or {}).get("largest") or []
    retries = (gap_row.get("allocator_events") or {}).get("num_alloc_retries")
    matches = {s: plans.profile_modes(split[s]) == plans.row_modes(steps[s]) for s in STACKS if s in split}
    budgets = {s: plan_margin(split[s], BUDGET_TEXT) for s in matches}
    return {"device": first["device"], "stack": first["stack"], "wall": num(first["wall_ms"], 0),
            "plan": plans.modes_count(plans.profile_modes(first)),
            "exposed": num(first["split_ms"]["exposed_communication"], 1),
            "communication": num(first["communication_ms"], 1), "idle": num(first.get("idle_ms"), 1),
            "recompute": num(first["split_ms"]["recompute"], 1),
            "all_match": all(matches.values()), "mismatched": _listing(
                [f"{WHOSE[s]} ran {plans.modes_count(plans.profile_modes(split[s]))}"
                 for s, ok in matches.items() if not ok]) if not all(matches.values()) else "",
            "budgets": _listing([f"{budgets[s]} GB for {WHOSE[s]}" for s in matches])
            if None not in budgets.values() else "",
            "has_gaps": len(gaps) >= 2, "gap_1": num(gaps[0]["ms"], 1) if gaps else DASH,
            "gap_2": num(gaps[1]["ms"], 1) if len(gaps) >= 2 else DASH,
            "gaps_count": f"{(gap_row.get('idle_gaps') or {}).get('gap_count', 0):,}",
            "gap_plan": plans.modes_count(plans.profile_modes(gap_row)), "gap_stack": gap_row["stack"],
            "gap_idle": num(gap_row.get("idle_ms"), 1), "gap_wall": num(gap_row["wall_ms"], 0),
            "gap_is_first": gap_row is first, "has_retries": retries is not None, "retries": str(retries),
            "gaps_match_retries": retries is not None and retries == sum(g["ms"] > LONG_IDLE_MS for g in gaps)}


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
