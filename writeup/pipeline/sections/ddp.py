"""Sections of SPEC part 4: collective communication, the DDP variants and their benchmarks, and the
communication accounting of the XXL model."""

from __future__ import annotations

import math
from typing import Any

from cs336_basics.model import MODEL_SIZES
from pipeline import accounting, figures
from pipeline.markup import DASH, num, pct, sci_parts, sig, table, times
from pipeline.results import Missing
from pipeline.sections.registry import Output, problem

TOY_LOG = "h200x2-tests/toy_training.log"  # written by scripts/device_tests.sh on two GPUs
TOY_ENV = "h200x2-tests/environment.txt"


def first_key(row: dict[str, Any], *keys: str) -> Any:
    """The value of the first of ``keys`` that ``row`` has (result files name the same thing differently)."""
    for key in keys:
        if row.get(key) is not None:
            return row[key]
    return None


# -----------------------------------------------------------------------------------------------
# distributed_communication_single_node
# -----------------------------------------------------------------------------------------------


def load_all_reduce(res) -> list[dict[str, Any]]:
    """Rows ``{backend, world_size, size_mb, time_ms, algbw, busbw}`` (several machines: all devices kept)."""
    rows = []
    for row in res.rows("distributed_communication_single_node", one_device=False):
        if row.get("oom"):
            continue
        rows.append({
            "backend": row["backend"], "world_size": row["world_size"], "size_mb": row["size_mb"],
            "time_ms": first_key(row, "time_ms", "mean_ms", "median_ms", "ms"),
            "algbw": first_key(row, "algbw_gbps", "algbw_gb_s", "algbw"),
            "busbw": first_key(row, "busbw_gbps", "busbw_gb_s", "busbw"),
        })
    return rows


@problem("distributed_communication_single_node")
def distributed_communication_single_node(res, out: Output) -> dict[str, Any]:
    rows = sorted(load_all_reduce(res), key=lambda r: (r["backend"], r["world_size"], r["size_mb"]))
    body = [[r["backend"], str(r["world_size"]), num(r["size_mb"], 0), sig(r["time_ms"], 3), sig(r["algbw"], 3),
             sig(r["busbw"], 3)] for r in rows]
    tab = table(["backend", "processes", "size (MB)", "time (ms)", "algbw (GB/s)", "busbw (GB/s)"], body,
                "All-reduce of float32 tensors, one process per GPU (NCCL) or per CPU core group (gloo): time over "
                "ranks after warm-up, algorithm bandwidth = size / time, bus bandwidth = algbw · 2(n − 1)/n.",
                align=["left", "right", "right", "right", "right", "right"], size=8)
    fig, axes = figures.new(6.5, 2.7, ncols=2)
    sizes = sorted({r["size_mb"] for r in rows})
    for backend in sorted({r["backend"] for r in rows}):
        for ws in sorted({r["world_size"] for r in rows if r["backend"] == backend}):
            pts = [r for r in rows if r["backend"] == backend and r["world_size"] == ws]
            style = "-" if backend == "nccl" else "--"
            axes[0].plot([p["size_mb"] for p in pts], [p["time_ms"] for p in pts], style, marker="o", ms=3,
                         label=f"{backend}, {ws} processes")
            axes[1].plot([p["size_mb"] for p in pts], [p["busbw"] for p in pts], style, marker="o", ms=3)
    for ax, label in zip(axes, ("time (ms)", "bus bandwidth (GB/s)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.set_xticklabels([f"{s:g}" for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("tensor size (MB)")
        ax.set_ylabel(label)
    figures.legend_below(fig, axes[0], ncol=3)
    figure = out.save(fig, "all_reduce", "All-reduce time and bus bandwidth against tensor size (log-log).")

    def at(backend: str, ws: int, size: float) -> dict[str, Any] | None:
        return next((r for r in rows if r["backend"] == backend and r["world_size"] == ws and r["size_mb"] == size), None)

    largest, smallest = max(sizes), min(sizes)
    common = sorted({r["world_size"] for r in rows if r["backend"] == "nccl"} & {r["world_size"] for r in rows
                                                                                if r["backend"] == "gloo"})
    ws = common[0] if common else None
    nccl_big, gloo_big = (at("nccl", ws, largest), at("gloo", ws, largest)) if ws else (None, None)
    nccl_busbw = [r["busbw"] for r in rows if r["backend"] == "nccl" and r["size_mb"] == largest]
    nccl_small = [r["busbw"] for r in rows if r["backend"] == "nccl" and r["size_mb"] == smallest]
    n = {
        "ws": str(ws), "largest": num(largest, 0), "smallest": num(smallest, 0),
        "nccl_over_gloo": times(gloo_big["time_ms"] / nccl_big["time_ms"], 0) if nccl_big and gloo_big else DASH,
        "nccl_busbw_lo": sig(min(nccl_busbw, default=math.nan), 3), "nccl_busbw_hi": sig(max(nccl_busbw, default=math.nan), 3),
        "nccl_small_busbw": sig(max(nccl_small, default=math.nan), 3),
        "gloo_busbw": sig(gloo_big and gloo_big["busbw"], 3),
    }
    return {"tables": {"main": tab}, "figures": {"main": figure}, "n": n}


# -----------------------------------------------------------------------------------------------
# naive_ddp
# -----------------------------------------------------------------------------------------------


@problem("naive_ddp")
def naive_ddp(res, out: Output) -> dict[str, Any]:
    log = res.text(TOY_LOG).strip()
    env = res.text(TOY_ENV).strip().splitlines()
    versions = env[-1] if env else ""
    return {"log": log, "n": {"where": f"{env[1].split(',')[0]} ×{len(env) - 2}, {versions}, {env[0][:10]}"
                              if len(env) >= 3 else DASH}}


# -----------------------------------------------------------------------------------------------
# The DDP benchmarks (XL model, 2 GPUs)
# -----------------------------------------------------------------------------------------------

VARIANT_ORDER = ["naive", "flattened", "overlapped", "bucketed", "torch_ddp"]
VARIANT_LABEL = {"naive": "naive (per parameter)", "flattened": "flattened (one all-reduce)",
                 "overlapped": "overlapped (per parameter)", "bucketed": "bucketed", "torch_ddp": "PyTorch DDP"}


def variant_of(name: str) -> str:
    name = name.lower()
    for key, fragments in (("torch_ddp", ("torch", "pytorch")), ("flattened", ("flat",)), ("bucketed", ("bucket",)),
                           ("overlapped", ("overlap", "individual")), ("naive", ("naive",))):
        if any(f in name for f in fragments):
            return key
    return name


def load_ddp(res) -> list[dict[str, Any]]:
    """Rows ``{variant, dtype, step_ms, comm_ms, exposed_ms}`` (+ ``bucket_size_mb`` from ``bucket_mb``,
    ``figure`` from ``trace_figure``), ``variant`` normalised to :data:`VARIANT_ORDER`."""
    rows = []
    for row in res.rows("ddp_benchmarking"):
        row = dict(row, variant=variant_of(row["variant"]), bucket_size_mb=row.get("bucket_mb"))
        if row.get("trace_figure"):  # a path on the GPU machine; Output.existing falls back to the figures dir
            row["figure"] = row["trace_figure"]
        rows.append(row)
    return sorted(rows, key=lambda r: (VARIANT_ORDER.index(r["variant"]) if r["variant"] in VARIANT_ORDER else 99,
                                       r.get("dtype", ""), r.get("bucket_size_mb") or 0))


def ddp_setup(rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    parts = [f"{first[k]}" if k == "size" else f"{k.replace('_', ' ')} {first[k]}"
             for k in ("size", "batch_size", "context_length", "world_size") if first.get(k) is not None]
    return ", ".join(parts) or "xl model, 2 GPUs"


def ddp_table(rows: list[dict[str, Any]], caption: str) -> dict[str, Any]:
    body = []
    for r in rows:
        label = VARIANT_LABEL.get(r["variant"], r["variant"])
        if r.get("bucket_size_mb") is not None:
            label += f", {r['bucket_size_mb']:g} MiB"
        if r.get("oom"):
            body.append([label, r.get("dtype", DASH), "OOM", DASH, DASH, DASH])
            continue
        step, comm, exposed = r.get("step_ms"), r.get("comm_ms"), r.get("exposed_ms")
        body.append([label, r.get("dtype", DASH), num(step), num(comm), num(exposed),
                     pct((exposed if exposed is not None else comm) / step if step else None)])
    return table(["variant", "dtype", "step (ms)", "communication (ms)", "exposed (ms)", "exposed share"], body,
                 caption, align=["left", "left", "right", "right", "right", "right"])


def by_variant(rows: list[dict[str, Any]], variant: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["variant"] == variant and not r.get("oom")]


def ddp_numbers(rows: list[dict[str, Any]], variant: str) -> dict[str, str]:
    """Step time and communication share of ``variant`` (its fp32 row if there is one, else its first)."""
    found = by_variant(rows, variant)
    if not found:
        raise Missing("writeup/results/ddp_benchmarking.jsonl", f"no {variant!r} rows")
    row = next((r for r in found if r.get("dtype") in ("fp32", "float32")), found[0])
    exposed = row.get("exposed_ms") if row.get("exposed_ms") is not None else row.get("comm_ms")
    return {"step": num(row["step_ms"]), "comm": num(row.get("comm_ms")), "exposed": num(exposed),
            "share": pct(exposed / row["step_ms"] if exposed is not None else None),
            "comm_share": pct(row["comm_ms"] / row["step_ms"] if row.get("comm_ms") is not None else None),
            "dtype": str(row.get("dtype", "")), "_step": row["step_ms"]}


CAPTION = ("{setup}: time per training step and time spent communicating gradients (mean over the timed steps); "
           "exposed: communication not hidden behind the backward pass (after it ends, before the optimizer step).")


@problem("naive_ddp_benchmarking")
def naive_ddp_benchmarking(res, out: Output) -> dict[str, Any]:
    rows = load_ddp(res)
    naive = by_variant(rows, "naive")
    return {"tables": {"main": ddp_table(naive, CAPTION.format(setup=ddp_setup(rows)))},
            "n": ddp_numbers(rows, "naive")}


@problem("minimal_ddp_flat_benchmarking")
def minimal_ddp_flat_benchmarking(res, out: Output) -> dict[str, Any]:
    rows = load_ddp(res)
    naive, flat = ddp_numbers(rows, "naive"), ddp_numbers(rows, "flattened")
    shown = [r for r in rows if r["variant"] in ("naive", "flattened")]
    return {"tables": {"main": ddp_table(shown, CAPTION.format(setup=ddp_setup(rows)))},
            "n": {"naive": naive, "flat": flat, "speedup": times(naive["_step"] / flat["_step"])}}


@problem("ddp_overlap_individual_parameters_benchmarking")
def ddp_overlap_individual_parameters_benchmarking(res, out: Output) -> dict[str, Any]:
    rows = load_ddp(res)
    shown = [r for r in rows if r["variant"] in ("naive", "flattened", "overlapped", "torch_ddp")]
    traces = [r for r in rows if r.get("figure") and r["variant"] in ("naive", "flattened", "overlapped")]
    if not traces:
        raise Missing("writeup/results/ddp_benchmarking.jsonl", "no profiler-trace figure rows (key 'figure')")
    figs = [out.existing(r["figure"], f"Profiler timeline of one training step, {VARIANT_LABEL[r['variant']]}"
                         f"{', ' + r['dtype'] if r.get('dtype') else ''}: compute stream above, NCCL below.")
            for r in traces]
    numbers = {v: ddp_numbers(rows, v) for v in ("naive", "flattened", "overlapped")}
    torch_rows = by_variant(rows, "torch_ddp")
    return {"tables": {"main": ddp_table(shown, CAPTION.format(setup=ddp_setup(rows)))}, "figures": figs,
            "n": {**numbers, "has_torch": bool(torch_rows),
                  "torch": ddp_numbers(rows, "torch_ddp") if torch_rows else {},
                  "speedup": times(numbers["naive"]["_step"] / numbers["overlapped"]["_step"])}}


@problem("ddp_bucketed_benchmarking")
def ddp_bucketed_benchmarking(res, out: Output) -> dict[str, Any]:
    rows = load_ddp(res)
    bucketed = [r for r in by_variant(rows, "bucketed") if r.get("bucket_size_mb") is not None]
    if not bucketed:
        raise Missing("writeup/results/ddp_benchmarking.jsonl", "no bucketed rows with bucket_size_mb")
    reference = [r for r in rows if r["variant"] in ("overlapped", "torch_ddp") and not r.get("oom")]
    tab = ddp_table(bucketed + reference, CAPTION.format(setup=ddp_setup(rows)))
    dtype = bucketed[0].get("dtype")
    series = sorted((r for r in bucketed if r.get("dtype") == dtype), key=lambda r: r["bucket_size_mb"])
    best = min(series, key=lambda r: r["step_ms"])

    # The overhead model's constants: s from the model, w and o fitted on the NCCL all-reduce of the same world size.
    size = rows[0].get("size", "xl")
    world = rows[0].get("world_size", 2)
    params = accounting.parameter_count(vocab_size=10_000, **MODEL_SIZES[size])
    grad_bytes = params * accounting.FP32
    collective = [r for r in load_all_reduce(res) if r["backend"] == "nccl" and r["world_size"] == world]
    if len(collective) < 2:
        raise Missing("writeup/results/distributed_communication_single_node.jsonl",
                      f"NCCL rows for {world} processes (the overhead model's bandwidth and latency)")
    per_call, bandwidth = accounting.fit_latency_bandwidth([r["size_mb"] * 1e6 for r in collective],
                                                           [r["time_ms"] / 1e3 for r in collective])
    optimum = accounting.optimal_bucket(grad_bytes, bandwidth, per_call)
    fig, axes = figures.new(5.0, 2.6)
    ax = axes[0]
    ax.plot([r["bucket_size_mb"] for r in series], [r["step_ms"] for r in series], marker="o", label="measured step")
    for r in reference:
        if r.get("dtype") == dtype:
            ax.axhline(r["step_ms"], ls=":", color="gray")
            ax.annotate(VARIANT_LABEL.get(r["variant"], r["variant"]), (series[0]["bucket_size_mb"], r["step_ms"]),
                        fontsize=7, color="gray", va="bottom")
    ax.axvline(optimum["bucket_bytes"] / 2**20, color="k", ls="--", lw=0.8, label="model optimum b*")
    ax.set_xscale("log")
    ax.set_xticks([r["bucket_size_mb"] for r in series])
    ax.set_xticklabels([f"{r['bucket_size_mb']:g}" for r in series])
    ax.minorticks_off()
    ax.set_xlabel("bucket size (MiB)")
    ax.set_ylabel("step (ms)")
    ax.legend(fontsize=7)
    figure = out.save(fig, "ddp_bucketed", f"Step time against bucket size ({dtype}), with the overhead model's "
                      "optimum.")
    model_overheads = {r["bucket_size_mb"]: accounting.ddp_overhead(
        grad_bytes, bandwidth, per_call, max(1.0, grad_bytes / (r["bucket_size_mb"] * 2**20))) for r in series}
    n = {
        "best_mb": f"{best['bucket_size_mb']:g}", "best_ms": num(best["step_ms"]), "dtype": str(dtype),
        "worst_mb": f"{max(series, key=lambda r: r['step_ms'])['bucket_size_mb']:g}",
        "worst_ms": num(max(r["step_ms"] for r in series)),
        "size": size, "params": f"{params / 1e9:.3f}", "s_gb": num(grad_bytes / 1e9, 2), "world": str(world),
        "w_gbs": num(bandwidth / 1e9, 1), "o_us": num(per_call * 1e6, 0),
        "n_star": num(optimum["n_buckets"], 1), "b_star_mb": num(optimum["bucket_bytes"] / 2**20, 0),
        "overhead_ms": num(optimum["overhead"] * 1e3, 1),
        "model_rows": ", ".join(f"{mb:g} MiB: {num(t * 1e3, 1)} ms" for mb, t in model_overheads.items()),
        "one_bucket_ms": num(accounting.ddp_overhead(grad_bytes, bandwidth, per_call, 1) * 1e3, 1),
    }
    traces = [out.existing(r["figure"], f"Profiler timeline of one training step, bucketed "
                           f"{r['bucket_size_mb']:g} MiB, {r.get('dtype')}: compute stream above, NCCL below.")
              for r in bucketed if r.get("figure")]
    return {"tables": {"main": tab}, "figures": {"main": figure}, "traces": traces, "n": n}


# -----------------------------------------------------------------------------------------------
# communication_accounting
# -----------------------------------------------------------------------------------------------


@problem("communication_accounting")
def communication_accounting(res, out: Output) -> dict[str, Any]:
    a = accounting.communication_accounting()
    xxl, tpu = accounting.XXL, accounting.V5P
    n = {
        "d": f"{xxl['d_model']:,}", "dff": f"{xxl['d_ff']:,}", "blocks": str(xxl["num_blocks"]),
        "per_block": f"{a['per_block']:,}", "params": f"{a['params']:,}", "params_m": sci_parts(a["params"], 3)[0], "params_x": sci_parts(a["params"], 3)[1],
        "state_tb": num(a["state_bytes"] / 1e12, 2), 
        "state_h100": num(a["state_h100"], 1), "state_h100_int": str(math.ceil(a["state_h100"])),
        "bf16_gb": num(a["bf16_weights"] / 1e9, 1), "bf16_h100": num(a["bf16_weights_h100"], 1),
        "act_token": f"{a['act_per_token']:,}", "act_token_mb": num(a["act_per_token"] / 1e6, 1),
        "tokens_h100": f"{a['tokens_per_h100']:,.0f}",
        "n_exact": num(a["n_exact"], 2), "n_min": str(a["n_min"]), "at_n_min": num(a["per_device_state_at_n_min"] / 1e9, 1),
        "w_m": sci_parts(tpu["w_ici"], 1)[0], "w_x": sci_parts(tpu["w_ici"], 1)[1],
        "c_m": sci_parts(tpu["flops"], 1)[0], "c_x": sci_parts(tpu["flops"], 1)[1], "mx": str(tpu["m_x"]), "my": str(tpu["m_y"]),
        "x": str(tpu["x"]), "y": str(tpu["y"]), "alpha": num(a["alpha"], 1),
        "shard_tokens": num(a["tokens_per_fsdp_shard"], 1), "devices": str(a["devices"]),
        "per_device": num(a["per_device_batch"], 1), "per_device_int": str(a["per_device_batch_int"]),
        "global": f"{a['global_batch']:,.0f}", "global_int": f"{a['global_batch_int']:,}",
        "f_over_y": f"{a['f_over_y']:,.0f}", "tp_limit": num(a["tp_limit"], 1),
        "state_at_xy": num(a["state_per_device_at_xy"] / 1e9, 1),
    }
    return {"n": n}


@problem("ddp_overlap_individual_parameters")
def ddp_overlap_individual_parameters(res, out: Output) -> dict[str, Any]:
    return {}  # implementation only: the text describes the code


@problem("ddp_overlap_bucketed")
def ddp_overlap_bucketed(res, out: Output) -> dict[str, Any]:
    return {}  # implementation only: the text describes the code
