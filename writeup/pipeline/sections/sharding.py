"""Sections on optimizer-state sharding and, beyond the assignment, FSDP: measured memory and time beside
the accounting."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from cs336_basics.model import MODEL_SIZES
from cs336_systems.bench.fsdp_accounting import CHECK_LR, CHECK_TOLERANCE, weight_tolerance
from pipeline import accounting
from pipeline.editions import size_name
from pipeline.markup import DASH, num, span, spread, table, times
from pipeline.results import Missing, config_of, measured_at, measured_when, read_jsonl, row_commit, row_date
from pipeline.sections.registry import Output, problem
from pipeline.snapshot_reports import BEFORE_RECORDING, parse_snapshot_reports


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
OPTIMIZER_SHORT = {"adamw": "AdamW", "sharded": "ours", "zero_redundancy": "ZeroRedundancyOptimizer",
                   "zero1_flat": "flat ZeRO-1"}
REQUIRED_KINDS = ("adamw", "sharded", "zero_redundancy")  # zero1_flat rows are shown when measured
DTYPE_ORDER = ["fp32", "bf16"]


def optimizer_kind(name: str) -> str:
    """``adamw``, ``sharded``, ``zero_redundancy`` or ``zero1_flat`` from the row's optimizer name."""
    name = name.lower()
    if "zero1" in name or "flat" in name:
        return "zero1_flat"
    return "zero_redundancy" if "zero" in name else "sharded" if "shard" in name else "adamw"


def rows_of_one_commit(latest: list[dict[str, Any]], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per dtype, AdamW, ours and ZeRO from one commit: each one's newest row at the newest commit (of ``latest``'s
    device) where all three ran; the other optimizers (the flat ZeRO-1, whose newest rows may measure code newer than
    that commit's) keep their newest row, marked, and a dtype without
    such a commit its newest rows. ``latest``: the newest row per configuration, of one device; ``history``: every
    row of the file."""
    chosen = []
    for dtype in dict.fromkeys(r.get("dtype") for r in latest):
        rows = [r for r in latest if r.get("dtype") == dtype]
        required = {config_of(r) for r in rows if optimizer_kind(r["optimizer"]) in REQUIRED_KINDS}
        by_commit: dict[str, dict[str, dict[str, Any]]] = {}
        for r in sorted(history, key=measured_when):  # the newest row of a configuration at a commit is kept
            if r.get("device") == rows[0].get("device") and config_of(r) in required:
                by_commit.setdefault(row_commit(r), {})[config_of(r)] = r
        complete = [found for found in by_commit.values() if set(found) == required]
        if complete:
            newest = max(complete, key=lambda found: max(measured_when(r) for r in found.values()))
            rows = [newest.get(config_of(r), r) for r in rows]
        chosen += rows
    return chosen


def load_sharding_accounting(res, world_size: int = 2) -> list[dict[str, Any]]:
    """The rows of ``world_size`` ranks (:func:`rows_of_one_commit`) by dtype, then AdamW, ours, ZeRO; ``kind``
    normalised (each case ran on freshly spawned ranks, a launch of its own)."""
    history = read_jsonl(res.path("optimizer_state_sharding_accounting.jsonl"))
    rows = [dict(r, kind=optimizer_kind(r["optimizer"]))
            for r in res.rows("optimizer_state_sharding_accounting", world_size=world_size,
                              keep=lambda latest: rows_of_one_commit(latest, history))]
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

    history = read_jsonl(res.path("optimizer_state_sharding_accounting.jsonl"))
    summary_table = sharding_summary(rows, history)
    four = load_sharding_accounting(res, world_size=4)
    four_table = sharding_summary(four, history)
    for r in rows + four:  # the launches a marked row's ratios divide by are this section's rows too
        for kind in ("adamw", "zero_redundancy"):
            base = ratio_basis(r, kind, {(x.get("dtype"), x["kind"]): x for x in rows + four
                                         if x.get("world_size") == r.get("world_size") and not x.get("oom")}, history)
            if base is not None and not any(same_launch(base, x) for x in res.used):
                res.used.append(base)
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
            # "" when the three rows share a commit, else each one's commit, said next to the ratios
            "commits": "" if len({row_commit(r) for r in (plain, sharded, zero)}) == 1 else commits_phrase(
                [plain, sharded, zero]),
            **flat_numbers(ok.get((dtype, "zero1_flat"))),
        }

    def flat_numbers(flat: dict[str, Any] | None) -> dict[str, Any]:
        """The ZeRO-1 flat optimizer beside ZeroRedundancyOptimizer (the launch its ratio divides by), when
        measured."""
        if flat is None:
            return {"has_flat": False}
        zero = ratio_basis(flat, "zero_redundancy", ok, history)
        note = two_commits(flat, zero)
        return {"has_flat": True, "step_flat": num(flat["step_ms"]), "peak_flat": num(flat["peak_gb"], 2),
                "flat_zero_ms": num(zero["step_ms"]), "peak_zero_2": num(zero["peak_gb"], 2),
                "flat_vs_zero": times(flat["step_ms"] / zero["step_ms"], 3) + (f"; {note}" if note else ""),
                "flat_no_worse": flat["step_ms"] <= zero["step_ms"] and flat["peak_gb"] <= zero["peak_gb"]}

    n = {
        "size": size_name(size), "world": str(world), "params": f"{params / 1e9:.3f}",
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
    n["commits"] = commits_phrase([r for r in rows if r["kind"] in REQUIRED_KINDS])
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
        note = two_commits(flat, zero) if flat and zero and row_commit(flat) != row_commit(zero) else ""
        out[dtype] = {"vs_zero": times(flat["step_ms"] / zero["step_ms"], 3) + (f" ({note})" if note else "")
                      if flat and zero else DASH,
                      "peak_flat": num(flat and flat["peak_gb"], 2), "peak_zero": num(zero and zero["peak_gb"], 2)}
    return out


def commits_phrase(rows: list[dict[str, Any]]) -> str:
    """Where in the history ``rows`` ran: ``commit e615cb1, 2026-11-25``, or each commit with its rows'
    optimizers and dtypes."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        groups.setdefault(f"{row_commit(r)}, {row_date(r)}", []).append(
            f"{OPTIMIZER_SHORT[optimizer_kind(r['optimizer'])]} {r.get('dtype', '')}".strip())
    if len(groups) == 1:
        return f"commit {next(iter(groups))}"
    return "commits " + "; ".join(f"{commit} ({', '.join(what)})" for commit, what in groups.items())


def two_commits(flat: dict[str, Any], zero: dict[str, Any]) -> str:
    """Both rows' commit when the flat ZeRO-1 and ``ZeroRedundancyOptimizer`` rows share one, else each one's."""
    if row_commit(flat) == row_commit(zero):
        return f"both at commit {row_commit(flat)}"
    return f"flat at commit {row_commit(flat)}, ZeroRedundancyOptimizer at commit {row_commit(zero)}"


def _when(row: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(str(row.get("env", {}).get("date", "1970-01-01T00:00:00Z")).replace("Z", "+00:00"))


def same_launch(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two rows (perhaps read apart) are one launch's measurement of one optimizer."""
    return (measured_when(a), a.get("optimizer"), a.get("dtype")) == (measured_when(b), b.get("optimizer"), b.get("dtype"))


def ratio_basis(r: dict[str, Any], kind: str, ok: dict[tuple, dict[str, Any]], history: list[dict[str, Any]]
                ) -> dict[str, Any] | None:
    """The launch ``r``'s step is divided by for its ratio to ``kind``: the table's ``kind`` row of its dtype when
    both ran at one commit; else the newest ``kind`` launch at ``r``'s commit (same machine, ranks and dtype); else
    the ``kind`` launch with as many timed steps nearest in time to ``r``; else the table's row."""
    shown = ok.get((r.get("dtype"), kind))
    if shown is None or row_commit(shown) == row_commit(r):
        return shown
    alike = [h for h in history if optimizer_kind(h["optimizer"]) == kind and not h.get("oom")
             and all(h.get(k) == r.get(k) for k in ("dtype", "device", "world_size"))]
    same_commit = [h for h in alike if row_commit(h) == row_commit(r)]
    if same_commit:
        return max(same_commit, key=measured_when)
    same_steps = [h for h in alike if h.get("steps") == r.get("steps")]
    if same_steps:
        return min(same_steps, key=lambda h: abs((_when(h) - _when(r)).total_seconds()))
    return shown


def sharding_summary(rows: list[dict[str, Any]], history: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """Step, ratios to AdamW and to ``ZeroRedundancyOptimizer`` of the same dtype, peak and state, per row; a row
    of another commit than its dtype's AdamW row is marked (†), and the caption names the commits. A marked row's
    ratio divides by the launch :func:`ratio_basis` finds in ``history`` (every row of the file); where that is not
    the table's row, the ratio is marked (‡) and the caption names the launch."""
    size, _, world = model_params(rows)
    ok = {(r.get("dtype"), r["kind"]): r for r in rows if not r.get("oom")}
    adamw_commit = {r.get("dtype"): row_commit(r) for r in rows if r["kind"] == "adamw"}
    elsewhere = [r for r in rows if row_commit(r) != adamw_commit.get(r.get("dtype"), row_commit(r))]
    other_bases: list[str] = []

    def ratio(r: dict[str, Any], kind: str) -> str:
        base = ratio_basis(r, kind, ok, list(history))
        if not base or r.get("oom"):
            return DASH
        text = times(r["step_ms"] / base["step_ms"], 3)
        shown = ok.get((r.get("dtype"), kind))
        if shown is not None and same_launch(base, shown):
            return text
        other_bases.append(f"{OPTIMIZER_SHORT[r['kind']]} {r.get('dtype')} against {OPTIMIZER_SHORT[kind]}'s "
                           f"launch at {measured_at(base)} ({num(base['step_ms'])} ms over {base.get('steps')} "
                           "timed steps)")
        return text + " ‡"

    summary = [[OPTIMIZER_LABEL[r["kind"]] + (" †" if r in elsewhere else ""), r.get("dtype", DASH)]
               + (["OOM", DASH, DASH, DASH, DASH] if r.get("oom") else
                  [num(r.get("step_ms")), ratio(r, "adamw"), ratio(r, "zero_redundancy"), num(r.get("peak_gb"), 2),
                   num(r.get("optimizer_state_gb"), 2)]) for r in rows]
    first = rows[0]
    steps = " or ".join(str(s) for s in sorted({r["steps"] for r in rows if r.get("steps") is not None}))
    commits = f"Unmarked rows at {commits_phrase([r for r in rows if r not in elsewhere])}"
    if elsewhere:
        commits += (f"; † at another commit than AdamW's of its dtype ({commits_phrase(elsewhere)}): each of its "
                    "ratios divides by the launch of its own commit where one exists, else by the launch nearest in "
                    "time with as many timed steps")
    if other_bases:
        commits += "; ‡ a ratio whose divisor is not the table's row: " + "; ".join(other_bases)
    return table(["optimizer", "dtype", "step (ms)", "vs AdamW", "vs ZeRO", "peak (GB)", "optimizer state (GB)"],
                 summary,
                 f"{size} model on {world} GPUs ({first.get('device', DASH)}) under our bucketed DDP "
                 f"({first.get('ddp', DASH)}), context {first.get('context_length')}, batch {first.get('batch_size')} "
                 f"per GPU, each case on freshly spawned ranks: median step time over {steps} steps, its "
                 "ratio to AdamW and to ZeroRedundancyOptimizer of the same dtype, peak memory per GPU and the "
                 f"optimizer state each GPU holds. {commits}.", size=8)


@problem("fsdp")
def fsdp(res, out: Output) -> dict[str, Any]:
    return {}  # implementation only: the text describes the code


FSDP_FILE = "writeup/results/fsdp_accounting.jsonl"
FSDP_MEMORY_LOG = "h100x2-fsdp-memory/part_fsdp_memory.log"  # allocator snapshots of one step, reported by site
FSDP_OWN_SITE = "cs336_systems/parallel/fsdp"
# Rows without an ``optimizer`` key stepped cs336_basics' AdamW (FSDP2 on its local shards); ``torch`` is
# torch.optim.AdamW with its defaults (the multi-tensor "foreach" step on CUDA).
FSDP_OPTIMIZERS = {"basics": "cs336_basics", "torch": "torch (foreach)"}
FSDP_OPTIMIZER_NAMES = {"basics": "cs336_basics' AdamW", "torch": "torch.optim.AdamW"}


def checkpointing_label(group: int) -> str:
    return "none" if not group else "every block" if group == 1 else f"groups of {group} blocks"


def checkpointing_phrase(group: int) -> str:
    return "no checkpointing" if not group else f"{checkpointing_label(group)} checkpointed"


def load_fsdp_accounting(res) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of ``fsdp_accounting.jsonl`` on every machine, by ``measure``: ``step`` (impl ours / fsdp2 / ddp:
    step time, peak allocated and reserved memory per GPU), ``check`` (ours against single-process training on
    NCCL) and ``timeline``.

    Only ``step`` rows with a ``checkpointing`` key (commit c043a0f on): the rows before it measured an earlier FSDP,
    sharded per Linear layer; they stay in the file, out of the writeup. Likewise only the ``check`` and ``timeline``
    rows no older than the oldest of those step rows (an older one checked or traced the earlier FSDP); timelines
    newest first."""
    when = lambda r: r.get("env", {}).get("date", "")

    def current(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        since = min((when(r) for r in rows if r.get("measure") == "step" and "checkpointing" in r), default="~")
        return [r for r in rows if (r.get("measure") == "step" and "checkpointing" in r)
                or (r.get("measure") in ("check", "timeline") and when(r) >= since)]

    rows = res.rows("fsdp_accounting", one_device=False, keep=current)
    by = lambda m: sorted((r for r in rows if r.get("measure") == m), key=lambda r: (when(r), r.get("run", "")),
                          reverse=True)
    return by("step"), by("check"), by("timeline")


def gpus_label(row: dict[str, Any]) -> str:
    """``2 × H100``: the row's ranks and the GPU model of its device (``2x NVIDIA H100 80GB HBM3``)."""
    model = re.search(r"NVIDIA (\S+)", row.get("device", ""))
    return f"{row.get('world_size', DASH)} × {model.group(1) if model else row.get('device', DASH)}"


def fsdp_settings(steps: list[dict[str, Any]], history: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """One setting per (ranks, device, AdamW, checkpointing), its rows by implementation, with the ratios of ours
    to FSDP2 run alike; ordered by ranks, device, AdamW, checkpointing. ``history``: every step row in file order,
    earlier launches included: each implementation's row is its launch with the most timed steps (ties: the newest),
    and a setting measured again with as many timed steps lists each launch's ratio (``launch_ratios``, oldest
    first)."""
    key = lambda r: (r.get("world_size", 2), r.get("device", ""), r.get("optimizer", "basics"), r["checkpointing"])
    model = lambda r: (r.get("size"), r.get("context_length"), r.get("batch_per_rank"), r.get("dtype"))
    grouped: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in steps:
        grouped.setdefault(key(r), {})[r["impl"]] = r
    # A later run with fewer timed steps (a memory snapshot's, say) does not replace a longer one of the same
    # setting and model; a newest row that ran out of memory stays.
    longest = lambda r: (r.get("steps") or 0, r.get("env", {}).get("date", ""))
    alike = lambda r, row: key(r) == key(row) and model(r) == model(row) and r["impl"] == row["impl"]
    for r in history:
        current = grouped.get(key(r), {}).get(r["impl"])
        if current is not None and alike(r, current) and not r.get("oom") and not current.get("oom") \
                and longest(r) > longest(current):
            grouped[key(r)][r["impl"]] = r
    settings = []
    for (world, device, optimizer, group), rows in sorted(grouped.items()):
        launches = {impl: [h for h in history if alike(h, row) and h.get("steps") == row.get("steps")
                           and not h.get("oom")]
                    for impl, row in rows.items()}
        ours, fsdp2 = (rows.get(i) if rows.get(i) and not rows[i].get("oom") else None for i in ("ours", "fsdp2"))
        both = ours is not None and fsdp2 is not None
        ratio = lambda key: ours[key] / fsdp2[key] if both and ours.get(key) and fsdp2.get(key) else None
        first = next(iter(rows.values()))
        settings.append({"world": world, "device": device, "optimizer": optimizer, "checkpointing": group,
                         "rows": rows, "ours": ours, "fsdp2": fsdp2, "gpus": gpus_label(first),
                         "steps": first.get("steps"), "warmup": first.get("warmup"),
                         "step_ratio": ratio("step_ms"), "mean_ratio": ratio("mean_ms"),
                         "peak_ratio": ratio("peak_gb"),
                         "launch_ratios": [o["step_ms"] / f["step_ms"] for o, f in
                                           zip(launches.get("ours", []), launches.get("fsdp2", []))],
                         "reserved_gap": ours["reserved_gb"] - fsdp2["reserved_gb"]
                         if both and ours.get("reserved_gb") and fsdp2.get("reserved_gb") else None})
    return settings


def fsdp_table(settings: list[dict[str, Any]], size: str) -> dict[str, Any]:
    """Step time, peak allocated and peak reserved memory per GPU of DDP, FSDP2 and ours, a row per setting."""
    def cell(s: dict[str, Any], impl: str, key: str, digits: int) -> str:
        r = s["rows"].get(impl)
        return DASH if r is None else "OOM" if r.get("oom") else num(r.get(key), digits)

    body = [[s["gpus"], checkpointing_label(s["checkpointing"]), FSDP_OPTIMIZERS.get(s["optimizer"], s["optimizer"]),
             str(s["steps"]), *[cell(s, impl, "step_ms", 1) for impl in ("ddp", "fsdp2", "ours")],
             times(s["step_ratio"]), *[cell(s, impl, "peak_gb", 2) for impl in ("ddp", "fsdp2", "ours")],
             *[cell(s, impl, "reserved_gb", 2) for impl in ("fsdp2", "ours")]] for s in settings]
    first = settings[0]["rows"][next(iter(settings[0]["rows"]))]
    devices = "; ".join(dict.fromkeys(f"{s['gpus']}: {s['device']}" for s in settings))
    protocols: dict[tuple, list[str]] = {}
    for s in settings:
        machines = protocols.setdefault((s["warmup"], s["steps"]), [])
        machines += [s["gpus"]] if s["gpus"] not in machines else []
    protocol = "; ".join(f"{steps} timed steps{f' after {warmup} warm-up steps' if warmup else ''} on "
                         f"{' and '.join(machines)}" for (warmup, steps), machines in protocols.items())
    header = [["", "", "", "", span("step (ms)", 4), span("peak allocated (GB)", 3), span("peak reserved (GB)", 2)],
              ["GPUs", "checkpointing", "AdamW", "steps", "DDP", "FSDP2", "ours", "ours / FSDP2", "DDP", "FSDP2",
               "ours", "FSDP2", "ours"]]
    return table(header, body,
                 f"Our FSDP by blocks against PyTorch's FSDP2 (and DDP, where measured): {size} model, batch "
                 f"{first.get('batch_per_rank')} per GPU, context {first.get('context_length')}, {first.get('dtype')} "
                 f"compute, one rank per GPU ({devices}), each case on freshly spawned ranks. Step: the slowest rank's "
                 f"median over the timed steps ({protocol}); peaks: the highest allocated and reserved (by the caching "
                 "allocator) memory per GPU over the timed steps; AdamW: cs336_basics' (FSDP2 steps its local shards) "
                 "or torch.optim.AdamW with its defaults; a dash: not measured.",
                 align=["left", "left", "left", *["right"] * 10], size=7.5)


def fsdp_reference(settings: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """The comparison at ``world`` ranks on the machine with the most timed steps (ties: the latest rows), with
    cs336_basics' AdamW: ours against FSDP2 without and with checkpointing every block."""
    mine = [s for s in settings if s["world"] == world and s["optimizer"] == "basics" and s["step_ratio"]]
    plain = [s for s in mine if s["checkpointing"] == 0]
    if not plain:
        return {"has": False}
    when = lambda s: s["ours"].get("env", {}).get("date", "")
    chosen = max(plain, key=lambda s: (s["steps"] or 0, when(s)))
    ckpt = next((s for s in mine if s["device"] == chosen["device"] and s["checkpointing"] == 1), None)

    def case(s: dict[str, Any] | None) -> dict[str, Any]:
        if s is None:
            return {"has": False}
        repeats = s["launch_ratios"] if len(s["launch_ratios"]) > 1 else []
        return {"has": True, "ratio": times(s["step_ratio"]), "mean_ratio": times(s["mean_ratio"]),
                "launches": ", ".join(times(r) for r in repeats),
                "ours_ms": num(s["ours"]["step_ms"]), "fsdp2_ms": num(s["fsdp2"]["step_ms"]),
                "ours_peak": num(s["ours"]["peak_gb"], 1), "fsdp2_peak": num(s["fsdp2"]["peak_gb"], 1)}

    cost = lambda impl: times(ckpt[impl]["step_ms"] / chosen[impl]["step_ms"]) if ckpt else DASH
    return {"has": True, "world": str(world), "gpus": chosen["gpus"], "steps": str(chosen["steps"]),
            "plain": case(chosen), "ckpt": case(ckpt), "ckpt_cost": cost("ours"), "fsdp2_ckpt_cost": cost("fsdp2"),
            "used": [s for s in (chosen, ckpt) if s]}


def fsdp_memory(settings: list[dict[str, Any]], reports: dict[str, Any], hp: dict[str, int]) -> dict[str, Any]:
    """What the allocator snapshots of one step (ours and FSDP2, torch.optim.AdamW, no checkpointing) hold at the
    allocated peak, and the reserved peaks of the same setting with either AdamW."""
    torch_run = next((s for s in settings if s["optimizer"] == "torch" and s["reserved_gap"] is not None), None)
    ours, fsdp2 = reports.get("fsdp_ours_torch"), reports.get("fsdp_fsdp2_torch")
    if torch_run is None or ours is None or fsdp2 is None:
        return {"has": False}
    basics = next((s for s in settings if s["optimizer"] == "basics" and s["device"] == torch_run["device"]
                   and s["checkpointing"] == torch_run["checkpointing"] and s["reserved_gap"] is not None), None)
    elsewhere = [s for s in settings if s is not torch_run and s is not basics and s["reserved_gap"] is not None
                 and abs(s["reserved_gap"]) >= 1.0]
    world = torch_run["world"]
    shards = accounting.fsdp_shard_bytes(vocab_size=10_000, world=world, **hp)
    compute_bytes = 2 if torch_run["ours"].get("dtype") in ("bf16", "fp16") else accounting.FP32
    root_gb = 10_000 * hp["d_model"] * compute_bytes / 1e9  # the LM head, gathered in the compute dtype
    own = ours.gb_at(FSDP_OWN_SITE)
    state_gap = fsdp2.before_recording_gb - ours.before_recording_gb
    return {
        "has": True, "gpus": torch_run["gpus"], "world": str(world),
        "at_end_of_forward": all(any("cross_entropy" in g.site for g in r.groups) for r in (ours, fsdp2)),
        "ours_state": num(ours.before_recording_gb, 2), "fsdp2_state": num(fsdp2.before_recording_gb, 2),
        "ours_peak": num(ours.peak_gb, 2), "fsdp2_peak": num(fsdp2.peak_gb, 2),
        "activations": num(ours.model_code_gb, 2),
        "same_activations": abs(ours.model_code_gb - fsdp2.model_code_gb) < 0.01,
        "own": num(own, 2), "own_is_root": abs(own - root_gb) < 0.02 * root_gb,
        "peak_gap": num(abs(fsdp2.peak_gb - ours.peak_gb), 2), "state_gap": num(abs(state_gap), 2),
        "largest_mib": num(max(g.mib_per_block for g in ours.model_code), 0),
        "shard_mib": num(shards["ours_block"] / 2**20, 0), "fsdp2_shard_mib": num(shards["fsdp2_largest"] / 2**20, 0),
        "shard_larger": shards["ours_block"] > 2**20 * max(g.mib_per_block for g in ours.model_code),
        "ours_reserved": num(torch_run["ours"]["reserved_gb"], 2),
        "fsdp2_reserved": num(torch_run["fsdp2"]["reserved_gb"], 2),
        "ours_allocated": num(torch_run["ours"]["peak_gb"], 2),
        "fsdp2_allocated": num(torch_run["fsdp2"]["peak_gb"], 2),
        "reserved_gap": num(torch_run["reserved_gap"], 1), "reserved_more": torch_run["reserved_gap"] > 0,
        "has_basics": basics is not None,
        "basics_gap": num(abs(basics["reserved_gap"]), 2) if basics else DASH,
        "basics_ours": num(basics and basics["ours"]["reserved_gb"], 2),
        "basics_fsdp2": num(basics and basics["fsdp2"]["reserved_gb"], 2),
        "elsewhere": "; ".join(
            f"on {s['gpus']} with {checkpointing_phrase(s['checkpointing'])} and "
            f"{FSDP_OPTIMIZER_NAMES.get(s['optimizer'], s['optimizer'])}, ours reserves "
            f"{num(abs(s['reserved_gap']), 2)} GB {'more' if s['reserved_gap'] > 0 else 'less'} than FSDP2 "
            f"({num(s['ours']['reserved_gb'], 2)} against {num(s['fsdp2']['reserved_gb'], 2)} GB)" for s in elsewhere),
    }


def snapshot_tables(reports: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """The snapshots' peaks by what holds them, and the sites live at the peak of ours and of FSDP2."""
    impl_name = {"ours": "ours", "fsdp2": "FSDP2"}
    summary = []
    for name, r in sorted(reports.items()):
        _, impl, optimizer = name.split("_", 2)
        own = r.gb_at(FSDP_OWN_SITE)
        rest = r.peak_gb - r.before_recording_gb - r.model_code_gb - own
        summary.append([impl_name.get(impl, impl), FSDP_OPTIMIZERS.get(optimizer, optimizer), num(r.peak_gb, 2),
                        num(r.before_recording_gb, 3), num(r.model_code_gb, 3), num(own, 3), num(rest, 3)])
    summary_table = table(["implementation", "AdamW", "peak (GB)", "before the step", "model code", "our FSDP",
                           "other"], summary,
                          f"Allocator snapshots of one training step ({where}, no checkpointing): the peak of "
                          "allocated memory over the step and what is live then, in GB: allocated before the step "
                          "(the state held between steps: fp32 shards and AdamW's moments), by the model code "
                          "(cs336_basics: the activations), by our FSDP (cs336_systems/parallel/fsdp), and the rest.",
                          align=["left", "left", *["right"] * 5], size=8)
    ours, fsdp2 = reports.get("fsdp_ours_torch"), reports.get("fsdp_fsdp2_torch")
    if ours is None or fsdp2 is None:
        return {"snapshots": summary_table}
    sites = {g.site: g for g in (*fsdp2.groups, *ours.groups) if g.gb >= 0.01 and g.site != BEFORE_RECORDING}
    by_site = lambda r: {g.site: g for g in r.groups}
    body = [[site, str(g.blocks), num(g.mib_per_block, 1), num(by_site(ours).get(site) and by_site(ours)[site].gb, 3),
             num(by_site(fsdp2).get(site) and by_site(fsdp2)[site].gb, 3)]
            for site, g in sorted(sites.items(), key=lambda item: -item[1].gb)]
    sites_table = table(["allocated at", "blocks", "MiB a block (mean)", "ours (GB)", "FSDP2 (GB)"], body,
                        f"What is live at the allocated peak of one step ({where}, torch.optim.AdamW, no "
                        "checkpointing), by allocation site (the innermost frame in the model or our code), sites of "
                        "at least 0.01 GB; a dash: nothing from that site.",
                        align=["left", "right", "right", "right", "right"], size=7.5)
    return {"snapshots": summary_table, "sites": sites_table}


@problem("fsdp_accounting")
def fsdp_accounting(res, out: Output) -> dict[str, Any]:
    steps, checks, timelines = load_fsdp_accounting(res)
    if not steps:
        raise Missing(FSDP_FILE, "no rows with measure 'step' and a 'checkpointing' key")
    history = [r for r in res.log_rows("fsdp_accounting", measured=lambda row: False)
               if r.get("measure") == "step" and "checkpointing" in r]
    settings = fsdp_settings(steps, history)
    res.used.extend(r for s in settings for r in s["rows"].values())
    compared = [s for s in settings if s["step_ratio"] is not None]
    with_ddp = next((s for s in settings if s["ours"] and s["rows"].get("ddp") and not s["checkpointing"]), None)
    size = steps[0].get("size", "xl")
    hp = MODEL_SIZES[size]
    params = accounting.parameter_count(vocab_size=10_000, **hp)
    world = with_ddp["world"] if with_ddp else compared[0]["world"]
    expected = accounting.sharding_memory(params, world)
    block_params = 4 * hp["d_model"] ** 2 + 3 * hp["d_model"] * hp["d_ff"] + 2 * hp["d_model"]
    compute_bytes = 2 if steps[0].get("dtype") in ("bf16", "fp16") else accounting.FP32
    references = [fsdp_reference(settings, w) for w in sorted({s["world"] for s in compared})]
    used = [id(s) for ref in references if ref["has"] for s in ref.pop("used")]
    others = [s for s in compared if id(s) not in used]
    reports = parse_snapshot_reports(res.text(FSDP_MEMORY_LOG))
    memory = fsdp_memory(settings, reports, hp)
    n = {
        "size": size_name(size), "params": f"{params / 1e9:.3f}", "world": str(world),
        "total": num(expected["total"] / 1e9, 1), "fsdp_total": num(expected["fsdp_total"] / 1e9, 1),
        # Against optimizer-state sharding, which keeps the full fp32 weights and gradients on every rank.
        "sharded_optimizer_total": num(expected["total_sharded"] / 1e9, 1),
        "saving_over_sharded_optimizer": num((expected["total_sharded"] - expected["fsdp_total"]) / 1e9, 1),
        "expected_saving": num((expected["total"] - expected["fsdp_total"]) / 1e9, 1),
        "gathered_mb": num(3 * block_params * compute_bytes / 1e6, 0),
        "dtype": str(steps[0].get("dtype")), "bf16_weights_gb": num(2 * params / 1e9, 1),
        "ddp": ddp_numbers(with_ddp, expected), "ranks": [r for r in references if r["has"]],
        "others": "; ".join(f"{times(s['step_ratio'])} on {s['gpus']} ({checkpointing_phrase(s['checkpointing'])}, "
                            f"{FSDP_OPTIMIZER_NAMES.get(s['optimizer'], s['optimizer'])}, {s['steps']} timed steps)"
                            for s in others),
        "all_faster": all(s["step_ratio"] < 1 for s in compared),
        "peak_ratio": spread(min(s["peak_ratio"] for s in compared), max(s["peak_ratio"] for s in compared),
                             lambda x: times(x, 3)),  # three digits: the peaks differ by tens of MB
        "memory": memory,
        **fsdp_check_and_timeline(checks, timelines),
    }
    tl = timelines[0] if timelines else {}
    timed = next((s for s in compared if tl and s["device"] == tl.get("device") and s["world"] == tl.get("world_size")
                  and not s["checkpointing"] and s["optimizer"] == "basics"), None)
    n["tl_timed_ms"] = num(timed and timed["ours"]["step_ms"])
    figs = [] if not tl.get("figure") else [out.existing(
        tl["figure"], f"Profiler timeline of one step of our FSDP ({tl.get('dtype')} compute, no checkpointing, "
        f"{gpus_label(tl)}) on rank 0: all-gathers and reduce-scatters (communication stream) against the blocks "
        "that use them (compute stream); an all-gather is red when its block waited for it.")]
    tables = {"main": fsdp_table(settings, size), **snapshot_tables(reports, memory.get("gpus", DASH))}
    return {"tables": tables, "figures": figs, "n": n}


def ddp_numbers(s: dict[str, Any] | None, expected: dict[str, float]) -> dict[str, Any]:
    """Ours against DDP (no sharding) in the one setting that measured both."""
    if s is None:
        return {"has": False}
    ours, ddp = s["ours"], s["rows"]["ddp"]
    saving = ddp["peak_gb"] - ours["peak_gb"]
    return {"has": True, "gpus": s["gpus"], "ours_peak": num(ours["peak_gb"], 1), "ddp_peak": num(ddp["peak_gb"], 1),
            "saving": num(saving, 1), "excess": num(saving - (expected["total"] - expected["fsdp_total"]) / 1e9, 1),
            "vs_ddp": times(ours["step_ms"] / ddp["step_ms"]), "ours_ms": num(ours["step_ms"]),
            "ddp_ms": num(ddp["step_ms"])}


def fsdp_check_and_timeline(checks: list[dict[str, Any]], timelines: list[dict[str, Any]]) -> dict[str, Any]:
    """The GPU correctness check against single-process training, and the newest profiled step's gathers."""
    newest: dict[tuple, dict[str, Any]] = {}
    for c in checks:  # newest first: keep the newest row of each (device, backend, ranks, dtype)
        newest.setdefault((c.get("device"), c.get("backend"), c.get("world_size"), c.get("dtype")), c)

    def present_bound(c: dict[str, Any]) -> float:
        return weight_tolerance(c.get("dtype"), c.get("world_size", 2), c.get("lr", CHECK_LR))

    def within_present_bounds(c: dict[str, Any]) -> bool:
        return (c.get("max_abs_diff", 1) <= present_bound(c)
                and c.get("grad_max_abs_diff", 1) <= CHECK_TOLERANCE.get(c.get("dtype"), 0))

    def outcome(c: dict[str, Any]) -> str:
        if c.get("bit_exact"):
            return "bit_exact"
        if c.get("passed"):
            return "passed"
        return "within_present_bound" if within_present_bounds(c) else "failed"

    def verdict(c: dict[str, Any]) -> str:
        if outcome(c) == "bit_exact":
            return "bit-exact"
        text = (f"weights within {c.get('max_abs_diff'):.1e} after {c.get('steps')} AdamW steps, first-step gradients "
                f"within {c.get('grad_max_abs_diff'):.1e}")
        if outcome(c) == "passed":
            return text + f" (bound {c.get('tolerance'):.0e})"
        if outcome(c) == "within_present_bound":
            return (text + f": over the bound of that run ({c.get('tolerance'):.0e}), within the check's present one "
                    f"for AdamW's weights on {c.get('world_size')} ranks ({present_bound(c):.0e})")
        return text + ": FAILED"

    groups: dict[tuple, list[dict[str, Any]]] = {}
    for (device, backend, world, dtype), c in newest.items():
        groups.setdefault((world, gpus_label(c), c.get("backend")), []).append(c)
    ordered = sorted(groups.items(), key=lambda g: g[0][0])
    check_text = "; ".join(f"on {gpus} ({backend}), " + ", ".join(f"{c.get('dtype')} {verdict(c)}" for c in cs)
                           for (world, gpus, backend), cs in ordered)
    tl = timelines[0] if timelines else {}
    return {
        "has_check": bool(checks), "check": check_text,
        "check_outcomes": [{"world": world, "dtype": c.get("dtype"), "outcome": outcome(c)}
                           for (world, _, _), cs in ordered for c in cs],
        "check_setup": (f"{checks[0].get('size')} model, context {checks[0].get('context_length')}, "
                        "one rank per GPU") if checks else "",
        "check_rounding": any(not c.get("bit_exact") and (c.get("passed") or within_present_bounds(c))
                              for c in newest.values()),
        "has_timeline": bool(tl), "tl_gpus": gpus_label(tl) if tl else DASH,
        "tl_span": num(tl.get("span_ms"), 1), "tl_compute": num(tl.get("compute_ms"), 1),
        "tl_fwd": str(tl.get("forward_gathers", DASH)), "tl_fwd_exposed": str(tl.get("forward_gathers_exposed", DASH)),
        "tl_fwd_stall": num(tl.get("forward_stall_ms"), 1),
        "tl_bwd": str(tl.get("backward_gathers", DASH)), "tl_bwd_exposed": str(tl.get("backward_gathers_exposed", DASH)),
        "tl_bwd_stall": num(tl.get("backward_stall_ms"), 1),
        "tl_comm": num(tl.get("comm_ms"), 1), "tl_hidden": num(tl.get("comm_hidden_ms"), 1),
        "tl_exposed": num(tl.get("comm_exposed_ms"), 1), "tl_rs": str(tl.get("reduce_scatters", DASH)),
    }
