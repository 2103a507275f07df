"""Sections on collective communication, the DDP variants and their benchmarks, and the
communication accounting of the XXL model."""

from __future__ import annotations

import math
import statistics
from typing import Any

from cs336_basics.model import MODEL_SIZES
from cs336_systems.bench.common import result_store
from cs336_systems.bench.ddp_overhead_model import fit_overhead_model
from pipeline import accounting, figures
from pipeline.markup import DASH, join_words, num, pct, sci_parts, sig, span, table, times
from pipeline.results import Missing, row_commit, row_date
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


def short_device(device: str) -> str:
    """``'4x NVIDIA H100 80GB HBM3'`` -> ``'H100 host of 4'``; CPU rows keep their name."""
    count, _, name = device.partition("x ")
    if not name:
        return device
    gpu = next((word for word in name.split() if word[:1] in "HAB" and word[1:2].isdigit()), name)
    return f"{gpu} host of {count}"


def load_all_reduce(res, device: str | None = None) -> list[dict[str, Any]]:
    """Rows ``{backend, world_size, size_mb, time_ms, algbw, busbw, device}`` (all devices, or ``device``'s)."""
    rows = []
    for row in res.rows("distributed_communication_single_node", one_device=False):
        if row.get("oom") or (device is not None and row.get("device") != device):
            continue
        rows.append({
            "backend": row["backend"], "world_size": row["world_size"], "size_mb": row["size_mb"],
            "time_ms": first_key(row, "time_ms", "mean_ms", "median_ms", "ms"),
            "algbw": first_key(row, "algbw_gbps", "algbw_gb_s", "algbw"),
            "busbw": first_key(row, "busbw_gbps", "busbw_gb_s", "busbw"), "device": row.get("device", ""),
        })
    return rows


def newest_host_per_setting(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each (backend, world size), the rows of one host: the one measured most recently (a later machine that
    measured more world sizes replaces an earlier one's rows of the same setting)."""
    newest = {(r["backend"], r["world_size"]): r["device"]
              for r in result_store.latest(rows, key=lambda r: (r["backend"], r["world_size"]))}
    return [r for r in rows if newest[(r["backend"], r["world_size"])] == r["device"]]


def all_reduce_fits(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``t = alpha + bytes / beta`` per (backend, world size, host), with the fit's worst relative error on its rows;
    in the rows' order."""
    fits = []
    for backend, ws, device in dict.fromkeys((r["backend"], r["world_size"], r["device"]) for r in rows):
        pts = [r for r in rows if r["backend"] == backend and r["world_size"] == ws and r["device"] == device]
        per_call, bandwidth = accounting.fit_latency_bandwidth([p["size_mb"] * 1e6 for p in pts],
                                                               [p["time_ms"] / 1e3 for p in pts])
        error = max(abs((per_call + p["size_mb"] * 1e6 / bandwidth) / (p["time_ms"] / 1e3) - 1) for p in pts)
        fits.append({"backend": backend, "world_size": ws, "alpha_us": per_call * 1e6, "beta_gbps": bandwidth / 1e9,
                     "busbw_gbps": bandwidth / 1e9 * 2 * (ws - 1) / ws, "error": error, "measured": True,
                     "device": device})
    return fits


def where_label(backend: str, device: str) -> str:
    """Where an all-reduce ran: the GPUs' host for NCCL, that host's CPUs for gloo."""
    return short_device(device) if backend == "nccl" else f"CPU, {short_device(device)}"


def nccl_prediction(fits: list[dict[str, Any]], world_size: int) -> dict[str, Any] | None:
    """NCCL at ``world_size`` ranks predicted from the measured fits: the per-call latency extrapolated linearly in
    the number of ring steps ``n - 1``, and the largest measured bus bandwidth held (NVLink gives every pair the
    same links, so a ring's bus bandwidth does not fall with more ranks)."""
    nccl = sorted((f for f in fits if f["backend"] == "nccl"), key=lambda f: f["world_size"])
    if len(nccl) < 2 or any(f["world_size"] >= world_size for f in nccl):
        return None
    (a, b), busbw = nccl[-2:], max(f["busbw_gbps"] for f in nccl)
    slope = (b["alpha_us"] - a["alpha_us"]) / (b["world_size"] - a["world_size"])
    alpha = b["alpha_us"] + slope * (world_size - b["world_size"])
    return {"backend": "nccl", "world_size": world_size, "alpha_us": alpha, "busbw_gbps": busbw,
            "beta_gbps": busbw * world_size / (2 * (world_size - 1)), "error": None, "measured": False, "device": ""}


def all_reduce_tables(rows: list[dict[str, Any]], fits: list[dict[str, Any]], sizes: list[float]) -> dict[str, Any]:
    body = [[r["backend"], str(r["world_size"]), where_label(r["backend"], r["device"]),
             num(r["size_mb"], 0), sig(r["time_ms"], 3), sig(r["algbw"], 3), sig(r["busbw"], 3)] for r in rows]
    for f in fits:
        if not f["measured"]:
            body += [[f["backend"], str(f["world_size"]), "not measured", num(size, 0),
                      sig(f["alpha_us"] / 1e3 + size * 1e6 / (f["beta_gbps"] * 1e9) * 1e3, 3) + " (model)", DASH, DASH]
                     for size in sizes]
    main = table(["backend", "processes", "where", "size (MB)", "time (ms)", "algbw (GB/s)", "busbw (GB/s)"], body,
                 "All-reduce of float32 tensors, one process per GPU (NCCL) or per CPU core group (gloo): time over "
                 "ranks after warm-up, algorithm bandwidth = size / time, bus bandwidth = algbw · 2(n − 1)/n. No "
                 "machine with 6 GPUs could be had: the NCCL rows at 6 processes are the model's prediction (the "
                 "latency-bandwidth fits, in the appendix), not measurements.",
                 align=["left", "right", "left", "right", "right", "right", "right"], size=8)
    fit_body = [[f["backend"], str(f["world_size"]),
                 where_label(f["backend"], f["device"]) if f["measured"] else "not measured",
                 num(f["alpha_us"], 0), num(f["beta_gbps"], 1),
                 num(f["busbw_gbps"], 1), pct(f["error"]) if f["measured"] else "predicted"] for f in fits]
    fit_table = table(["backend", "processes", "where", "α (μs)", "β (GB/s)", "β · 2(n − 1)/n (GB/s)", "worst error"],
                      fit_body,
                      "The latency-bandwidth model t = α + size / β fitted per backend, process count and host "
                      "(least squares on relative errors) and its worst relative error on the measured sizes. NCCL at "
                      "6 processes is predicted from the newest host of each measured process count: α extrapolated "
                      "linearly in n, the bus bandwidth of the measured fits held.",
                      align=["left", "right", "left", "right", "right", "right", "right"], size=8)
    return {"main": main, "fits": fit_table}


@problem("distributed_communication_single_node")
def distributed_communication_single_node(res, out: Output) -> dict[str, Any]:
    loaded = load_all_reduce(res)
    hosts = list(dict.fromkeys(r["device"] for r in loaded))  # file order: oldest host first
    rows = sorted(loaded, key=lambda r: (r["backend"], r["world_size"], hosts.index(r["device"]), r["size_mb"]))
    sizes = sorted({r["size_mb"] for r in rows})
    fits = all_reduce_fits(rows)
    newest = {(r["backend"], r["world_size"], r["device"]) for r in newest_host_per_setting(loaded)}
    six = nccl_prediction([f for f in fits if (f["backend"], f["world_size"], f["device"]) in newest], 6)
    fits += [six] if six else []
    fig, axes = figures.new(6.5, 2.7, ncols=2)
    for f in (f for f in fits if f["measured"]):
        backend, ws = f["backend"], f["world_size"]
        pts = [r for r in rows if r["backend"] == backend and r["world_size"] == ws and r["device"] == f["device"]]
        several_hosts = len({r["device"] for r in rows if r["backend"] == backend}) > 1
        style = "-" if backend == "nccl" else "--"
        axes[0].plot([p["size_mb"] for p in pts], [p["time_ms"] for p in pts], style, marker="o", ms=3,
                     label=f"{backend}, {ws} processes" + (f", {short_device(f['device'])}" if several_hosts else ""))
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

    def at(backend: str, ws: int, size: float, device: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["backend"] == backend and r["world_size"] == ws and r["size_mb"] == size
                     and r["device"] == device), None)

    largest, smallest = max(sizes), min(sizes)
    # NCCL against gloo on one host (its GPUs against its CPUs), at the fewest processes both measured there.
    pairs = sorted((r["world_size"], hosts.index(r["device"]), r["device"]) for r in rows
                   if r["backend"] == "nccl" and r["size_mb"] == largest and at("gloo", r["world_size"], largest,
                                                                                r["device"]))
    ws, _, host = pairs[0] if pairs else (None, None, "")
    nccl_big, gloo_big = (at("nccl", ws, largest, host), at("gloo", ws, largest, host)) if ws else (None, None)
    nccl_busbw = [r["busbw"] for r in rows if r["backend"] == "nccl" and r["size_mb"] == largest]
    nccl_small = [r["busbw"] for r in rows if r["backend"] == "nccl" and r["size_mb"] == smallest]
    measured = [f for f in fits if f["measured"]]
    nccl_hosts = list(dict.fromkeys(f["device"] for f in measured if f["backend"] == "nccl"))
    nccl_where = join_words([
        f"the {short_device(device)} ("
        + " and ".join(str(f["world_size"]) for f in measured if f["backend"] == "nccl" and f["device"] == device)
        + " processes)" for device in nccl_hosts])
    n = {
        "ws": str(ws), "largest": num(largest, 0), "smallest": num(smallest, 0),
        "compare_where": short_device(host),
        "nccl_over_gloo": times(gloo_big["time_ms"] / nccl_big["time_ms"], 0) if nccl_big and gloo_big else DASH,
        "nccl_busbw_lo": sig(min(nccl_busbw, default=math.nan), 3), "nccl_busbw_hi": sig(max(nccl_busbw, default=math.nan), 3),
        "nccl_small_busbw": sig(max(nccl_small, default=math.nan), 3),
        "gloo_busbw": sig(gloo_big and gloo_big["busbw"], 3),
        "nccl_where": nccl_where,
        "gloo_where": join_words([short_device(d) for d in dict.fromkeys(r["device"] for r in rows
                                                                          if r["backend"] == "gloo")]),
        "fit_error": pct(max((f["error"] for f in measured), default=None)),
        "six_alpha": num(six and six["alpha_us"], 0), "six_busbw": num(six and six["busbw_gbps"], 0),
        "six_big_ms": sig(six and six["alpha_us"] / 1e3 + largest * 1e6 / (six["beta_gbps"] * 1e9) * 1e3, 3),
        "has_six": six is not None,
    }
    tables = all_reduce_tables(rows, fits, sizes)
    return {"tables": tables, "figures": {"main": figure}, "n": n}


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

VARIANT_ORDER = ["naive", "flattened", "overlapped", "bucketed", "torch_ddp", "local"]
DTYPE_ORDER = ["fp32", "bf16"]
VARIANT_LABEL = {"naive": "naive (per parameter)", "flattened": "flattened (one all-reduce)",
                 "overlapped": "overlapped (per parameter)", "bucketed": "bucketed", "torch_ddp": "PyTorch DDP",
                 "local": "one GPU alone (no communication)"}
DDP_FILE = "writeup/results/ddp_benchmarking.jsonl"

RATIO_CHECK_FILE = "writeup/results/ddp_ratio_check.jsonl"


def ratio_checks(res, ddp_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The independent check of the bucketed / PyTorch DDP ratio (``scripts/ddp_ratio_check.py``: both wrappers in its
    own plain loop on the same ranks, alternating rounds) on the DDP rows' device, model and world size: the newest
    row per dtype, its bucket size and where it ran."""
    first = ddp_rows[0]
    # Every run is a row of its own (the script appends), so the file is read as a log, once.
    runs = [r for r in res.log_rows("ddp_ratio_check", measured=lambda row: row.get("backend") == "nccl")
            if r["backend"] == "nccl"]
    same = [r for r in runs
            if (r["device"], r["size"], r["world_size"]) == (first["device"], first.get("size"), first["world_size"])]
    by_dtype = {r["dtype"]: r for r in result_store.latest(same, key=lambda r: r["dtype"])}
    if not by_dtype:
        raise Missing(RATIO_CHECK_FILE, f"a ratio check on {first['device']} ({first.get('size')}, "
                                        f"{first['world_size']} ranks)")
    row = next(iter(by_dtype.values()))
    where = f"{row['device']}, commit {row['env'].get('commit')}, {str(row['env'].get('date'))[:10]}"
    elsewhere = [r for r in runs if r["device"] != first["device"]]
    others = {"runs": ", ".join(num(r["ratio"], 3) for r in sorted(elsewhere, key=lambda r: r["run"])),
              "where": short_device(elsewhere[-1]["device"]) if elsewhere else DASH,
              "size": elsewhere[-1]["size"] if elsewhere else DASH,
              "world": str(elsewhere[-1]["world_size"]) if elsewhere else DASH, "any": bool(elsewhere)}
    return {"bucket_mb": row["bucket_mb"], "ratios": {d: r["ratio"] for d, r in by_dtype.items()}, "where": where,
            "others": others}


def variant_of(name: str) -> str:
    name = name.lower()
    for key, fragments in (("torch_ddp", ("torch", "pytorch")), ("flattened", ("flat",)), ("bucketed", ("bucket",)),
                           ("overlapped", ("overlap", "individual")), ("naive", ("naive",)), ("local", ("local",))):
        if any(f in name for f in fragments):
            return key
    return name


def _order(values: list[str], value: Any) -> int:
    return values.index(value) if value in values else len(values)


def load_ddp(res, world_size: int = 2) -> list[dict[str, Any]]:
    """Rows ``{variant, dtype, step_ms, compute_ms, comm_ms, exposed_ms, n_buckets, grad_bytes}`` (+
    ``bucket_size_mb`` from ``bucket_mb``), ``variant`` normalised to
    :data:`VARIANT_ORDER`. Every variant ran on freshly spawned ranks that first timed the step without
    communication (``local``): ``compute_ms`` is that launch's local step and ``exposed_ms = step_ms - compute_ms``."""
    rows = []
    for row in res.rows("ddp_benchmarking", world_size=world_size):
        rows.append(dict(row, variant=variant_of(row["variant"]), bucket_size_mb=row.get("bucket_mb")))
    return sorted(rows, key=lambda r: (_order(VARIANT_ORDER, r["variant"]), _order(DTYPE_ORDER, r.get("dtype")),
                                       r.get("bucket_size_mb") or 0))


def ddp_setup(rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    parts = [f"{first[k]}" if k == "size" else f"{k.replace('_', ' ')} {first[k]}"
             for k in ("size", "batch_size", "context_length", "world_size") if first.get(k) is not None]
    return ", ".join(parts) or "xl model, 2 GPUs"


def variant_label(r: dict[str, Any]) -> str:
    label = VARIANT_LABEL.get(r["variant"], r["variant"])
    return label + (f", {r['bucket_size_mb']:g} MiB" if r.get("bucket_size_mb") is not None else "")


def exposed_of(r: dict[str, Any]) -> float | None:
    return r.get("exposed_ms") if r.get("exposed_ms") is not None else r.get("comm_ms")


def ddp_table(rows: list[dict[str, Any]], caption: str) -> dict[str, Any]:
    body = []
    for r in rows:
        if r.get("oom"):
            body.append([variant_label(r), r.get("dtype", DASH), "OOM", DASH, DASH, DASH, DASH])
            continue
        step, exposed = r.get("step_ms"), exposed_of(r)
        body.append([variant_label(r), r.get("dtype", DASH), num(step), num(r.get("compute_ms")), num(r.get("comm_ms")),
                     num(exposed), pct(exposed / step if step and exposed is not None else None)])
    return table(["variant", "dtype", "step (ms)", "local (ms)", "communication (ms)", "exposed (ms)", "exposed share"],
                 body, caption, align=["left", "left", "right", "right", "right", "right", "right"], size=8)


def by_variant(rows: list[dict[str, Any]], variant: str, dtype: str | None = None) -> list[dict[str, Any]]:
    return [r for r in rows if r["variant"] == variant and not r.get("oom") and (dtype is None or r.get("dtype") == dtype)]


def ddp_numbers(rows: list[dict[str, Any]], variant: str, dtype: str = "fp32") -> dict[str, Any]:
    """Step time, communication and its share of ``variant``'s ``dtype`` row (the first, for bucketed)."""
    found = by_variant(rows, variant, dtype)
    if not found:
        raise Missing(DDP_FILE, f"no {variant!r} rows in {dtype}")
    row = found[0]
    exposed = exposed_of(row)
    return {"step": num(row["step_ms"]), "comm": num(row.get("comm_ms")), "exposed": num(exposed),
            "local": num(row.get("compute_ms")), "calls": str(row.get("n_buckets") or DASH),
            "share": pct(exposed / row["step_ms"] if exposed is not None else None),
            "comm_share": pct(row["comm_ms"] / row["step_ms"] if row.get("comm_ms") is not None else None),
            "overlap_share": pct(row.get("trace_overlap_share")), "trace_busy": num(row.get("trace_comm_busy_ms")),
            "dtype": str(row.get("dtype", "")), "_step": row["step_ms"]}


def per_dtype(rows: list[dict[str, Any]], variant: str) -> dict[str, dict[str, Any]]:
    return {dtype: ddp_numbers(rows, variant, dtype) for dtype in DTYPE_ORDER}


def local_spread(rows: list[dict[str, Any]]) -> dict[str, str]:
    """How much the step without communication (each launch's ``local``) varied between launches, per dtype."""
    out = {}
    for dtype in DTYPE_ORDER:
        local = [r["compute_ms"] for r in rows if r.get("dtype") == dtype and r.get("compute_ms") is not None]
        out[f"{dtype}_lo"], out[f"{dtype}_hi"] = num(min(local, default=None), 0), num(max(local, default=None), 0)
    return out


def grad_gb(rows: list[dict[str, Any]]) -> str:
    grad = next((r["grad_bytes"] for r in rows if r.get("grad_bytes")), None)
    return num(grad / 1e9, 2) if grad else DASH


CAPTION = ("{setup}: time per training step (median over the timed steps) and the device time from the end of the "
           "backward pass to the end of the gradient synchronisation (communication). Every variant runs on freshly "
           "spawned ranks, which first time the same step without communication (local); exposed = step − local of "
           "the same launch (PyTorch DDP waits inside backward, so only its exposed time is known).")


@problem("naive_ddp_benchmarking")
def naive_ddp_benchmarking(res, out: Output) -> dict[str, Any]:
    rows = load_ddp(res)
    naive = by_variant(rows, "naive")
    return {"tables": {"main": ddp_table(naive, CAPTION.format(setup=ddp_setup(rows)))},
            "n": {**per_dtype(rows, "naive"), **local_spread(rows), "grad_gb": grad_gb(rows)}}


@problem("minimal_ddp_flat_benchmarking")
def minimal_ddp_flat_benchmarking(res, out: Output) -> dict[str, Any]:
    rows = load_ddp(res)
    naive, flat = per_dtype(rows, "naive"), per_dtype(rows, "flattened")
    shown = [r for r in rows if r["variant"] in ("naive", "flattened")]
    return {"tables": {"main": ddp_table(shown, CAPTION.format(setup=ddp_setup(rows)))},
            "n": {"naive": naive, "flat": flat,
                  "speedup": {d: times(naive[d]["_step"] / flat[d]["_step"]) for d in DTYPE_ORDER}}}


TRACED = ("naive", "overlapped")  # part (b): the naive DDP against the per-parameter overlapped one


def traced_rows(res, variants: tuple[str, ...] = TRACED) -> dict[tuple[str, str], dict[str, Any]]:
    """The newest row with a profiler-trace figure of each (variant, dtype) of ``variants``, on 2 GPUs of any
    device (a trace may be recorded on another host than the timing sweep; its figure names its device)."""
    rows = res.rows("ddp_benchmarking", one_device=False, world_size=2, keep=lambda rows: [
        r for r in rows if r.get("trace_figure") and variant_of(r["variant"]) in variants])
    newest = result_store.latest(rows, key=lambda row: (variant_of(row["variant"]), row.get("dtype")))
    return {(variant_of(row["variant"]), row.get("dtype")): dict(row, variant=variant_of(row["variant"]))
            for row in newest}


def trace_figure(out: Output, row: dict[str, Any] | None) -> dict[str, str] | None:
    """The traced step's figure (``None`` while its row is missing; a row whose PNG is missing stops the build,
    naming it)."""
    if row is None:
        return None
    caption = (f"Profiler timeline of one training step, {VARIANT_LABEL[row['variant']]} DDP, {row.get('dtype')}, "
               f"{row.get('world_size')} ranks on {row.get('device')}: per rank, the phases, the compute kernels and the NCCL kernels (green where "
               "they overlap computation).")
    # A path on the GPU machine: Output.existing falls back to the same name in the figures directory.
    return out.existing(row["trace_figure"], caption)


def rank_phases(row: dict[str, Any] | None) -> dict[str, Any]:
    """Per traced rank: the traced step's span, its forward and backward, its compute and NCCL kernels' busy time
    (ms); the untraced step and its exposed communication."""
    ranks = (row or {}).get("trace_ranks") or []
    if len(ranks) < 2:
        return {"has": False}
    forwards = [r["forward_ms"] for r in ranks]
    return {"has": True, "forward": [num(f) for f in forwards], "backward": [num(r["backward_ms"]) for r in ranks],
            "comm": [num(r["comm_busy_ms"]) for r in ranks], "compute": [num(r["compute_busy_ms"]) for r in ranks],
            "span": [num(r["span_ms"]) for r in ranks], "bucket_mb": f"{row.get('bucket_mb') or 0:g}",
            "step": num(row.get("step_ms")), "exposed": num(row.get("exposed_ms")),
            "share": pct(row.get("exposed_share")), "device": short_device(str(row.get("device", "")))}


def trace_numbers(row: dict[str, Any] | None) -> dict[str, Any]:
    """NCCL busy time, its share overlapped with computation and the rest, exposed (ms, mean over ranks)."""
    if row is None or row.get("trace_comm_busy_ms") is None:
        return {"pending": True}
    return {"pending": False, "busy": num(row["trace_comm_busy_ms"]), "overlap": pct(row.get("trace_overlap_share")),
            "exposed": num(row.get("trace_comm_exposed_ms")), "step_exposed": num(row.get("exposed_ms")),
            "device": str(row.get("device", DASH))}


def machine_and_commit(rows: list[dict[str, Any]], ranks: bool = False) -> str:
    """Each distinct device and commit of ``rows`` (with the ranks used, if ``ranks``), e.g. ``2 ranks of 4x NVIDIA
    H100 80GB HBM3 at commit a0d588e (2026-11-26)``."""
    places = []
    for r in rows:
        where = f"{r.get('world_size')} ranks of {r.get('device', DASH)}" if ranks else r.get("device", DASH)
        places.append(f"{where} at commit {row_commit(r)} ({row_date(r)})")
    return " and ".join(dict.fromkeys(places))


@problem("ddp_overlap_individual_parameters_benchmarking")
def ddp_overlap_individual_parameters_benchmarking(res, out: Output) -> dict[str, Any]:
    rows = load_ddp(res)
    shown = [r for r in rows if r["variant"] in ("naive", "flattened", "overlapped", "torch_ddp")]
    numbers = {v: per_dtype(rows, v) for v in ("naive", "flattened", "overlapped", "torch_ddp")}
    traced = traced_rows(res)
    figures = {f"{v}_{d}": trace_figure(out, traced.get((v, d))) for v in TRACED for d in DTYPE_ORDER}
    # Part (b)'s fp32 traces may come from another machine or commit than the table's rows: the text names both.
    fp32_traces = [traced[(v, "fp32")] for v in TRACED if (v, "fp32") in traced]
    same = {(r.get("device"), row_commit(r)) for r in fp32_traces} <= {(r.get("device"), row_commit(r)) for r in shown}
    return {"tables": {"main": ddp_table(shown, CAPTION.format(setup=ddp_setup(rows)))},
            "figures": figures,
            "n": {**numbers, "torch": numbers["torch_ddp"],
                  "speedup": {d: times(numbers["naive"][d]["_step"] / numbers["overlapped"][d]["_step"])
                              for d in DTYPE_ORDER},
                  "vs_torch": {d: times(numbers["overlapped"][d]["_step"] / numbers["torch_ddp"][d]["_step"])
                               for d in DTYPE_ORDER},
                  "trace": {v: {d: trace_numbers(traced.get((v, d))) for d in DTYPE_ORDER} for v in TRACED},
                  "trace_where": {"same": same, "trace": machine_and_commit(fp32_traces, ranks=True),
                                  "table": machine_and_commit(shown)}}}


def overhead_fits(bucketed: list[dict[str, Any]], collective: list[dict[str, Any]]) -> dict[str, Any]:
    """The overhead model's ``o`` and ``w`` from the NCCL all-reduce rows, and the same model fitted to the measured
    exposed times of each dtype (``n_b`` is each row's number of all-reduce calls, ``s`` its gradient bytes)."""
    per_call, bandwidth = accounting.fit_latency_bandwidth([r["size_mb"] * 1e6 for r in collective],
                                                           [r["time_ms"] / 1e3 for r in collective])
    fitted = {}
    for dtype in DTYPE_ORDER:
        series = [r for r in bucketed if r.get("dtype") == dtype and r.get("n_buckets") and exposed_of(r) is not None]
        try:
            fitted[dtype] = fit_overhead_model([r["n_buckets"] for r in series], [r["grad_bytes"] for r in series],
                                               [exposed_of(r) / 1e3 for r in series])
        except ValueError:  # fewer than two sizes, or an exposed time at or below zero (noise)
            fitted[dtype] = None
    return {"per_call": per_call, "bandwidth": bandwidth, "fitted": fitted}


@problem("ddp_bucketed_benchmarking")
def ddp_bucketed_benchmarking(res, out: Output) -> dict[str, Any]:
    rows = load_ddp(res)
    bucketed = [r for r in by_variant(rows, "bucketed") if r.get("bucket_size_mb") is not None]
    if not {r.get("dtype") for r in bucketed} >= set(DTYPE_ORDER):
        raise Missing(DDP_FILE, f"bucketed rows with bucket_mb in {' and '.join(DTYPE_ORDER)}")
    if any(not r.get("n_buckets") or not r.get("grad_bytes") for r in bucketed):
        raise Missing(DDP_FILE, "bucketed rows without n_buckets or grad_bytes (the overhead model's n_b and s)")
    reference = [r for r in rows if r["variant"] in ("overlapped", "torch_ddp") and not r.get("oom")]
    tab = ddp_table(bucketed + reference, CAPTION.format(setup=ddp_setup(rows)))
    series = {d: sorted((r for r in bucketed if r.get("dtype") == d), key=lambda r: r["bucket_size_mb"])
              for d in DTYPE_ORDER}
    torch_ms = {d: ddp_numbers(rows, "torch_ddp", d)["_step"] for d in DTYPE_ORDER}

    # The overhead model: s from the rows, o and w fitted on the NCCL all-reduce of the same world size.
    size = rows[0].get("size", "xl")
    world = rows[0].get("world_size", 2)
    params = accounting.parameter_count(vocab_size=10_000, **MODEL_SIZES[size])
    grad_bytes = bucketed[0]["grad_bytes"]
    collective = [r for r in load_all_reduce(res, device=rows[0]["device"])
                  if r["backend"] == "nccl" and r["world_size"] == world]
    if len(collective) < 2:
        raise Missing("writeup/results/distributed_communication_single_node.jsonl",
                      f"NCCL rows for {world} processes on {rows[0]['device']} (the overhead model's bandwidth and "
                      "latency)")
    fits = overhead_fits(bucketed, collective)
    per_call, bandwidth, fitted = fits["per_call"], fits["bandwidth"], fits["fitted"]
    optimum = accounting.optimal_bucket(grad_bytes, bandwidth, per_call)
    model_ms = lambda n_b: accounting.ddp_overhead(grad_bytes, bandwidth, per_call, n_b) * 1e3
    sizes = sorted({r["bucket_size_mb"] for r in bucketed})

    fig, axes = figures.new(6.5, 2.7, ncols=2)
    colors = {"fp32": "C0", "bf16": "C1"}
    for dtype, pts in series.items():
        mb = [r["bucket_size_mb"] for r in pts]
        axes[0].plot(mb, [r["step_ms"] / torch_ms[dtype] for r in pts], marker="o", color=colors[dtype], label=dtype)
        axes[1].plot(mb, [exposed_of(r) for r in pts], marker="o", color=colors[dtype], label=f"measured, {dtype}")
        if fitted[dtype] is not None:
            axes[1].plot(mb, [fitted[dtype].overhead_s(r["grad_bytes"], r["n_buckets"]) * 1e3 for r in pts], ls=":",
                         color=colors[dtype], label=f"model fitted, {dtype}")
    model_pts = series[DTYPE_ORDER[0]]
    axes[1].plot([r["bucket_size_mb"] for r in model_pts], [model_ms(r["n_buckets"]) for r in model_pts], ls="--",
                 color="k", marker="x", label="model, all-reduce fit")
    axes[0].axhline(1.0, ls=":", color="gray")
    axes[0].annotate("PyTorch DDP", (sizes[0], 1.0), fontsize=7, color="gray", va="bottom")
    axes[1].axvline(optimum["bucket_bytes"] / 2**20, color="k", ls="-", lw=0.6)
    axes[1].annotate("b*", (optimum["bucket_bytes"] / 2**20, 0), fontsize=7, va="bottom", ha="left")
    for ax, label in zip(axes, ("step / PyTorch DDP step", "exposed communication (ms)")):
        ax.set_xscale("log")
        ax.set_xticks(sizes)
        ax.set_xticklabels([f"{s:g}" for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("bucket size (MiB)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=6)
    figure = out.save(fig, "ddp_bucketed", "Bucketed DDP against bucket size: step time relative to PyTorch's DDP "
                      "of the same dtype (left); exposed communication measured, predicted by the overhead model from "
                      "the all-reduce fit at the measured number of buckets, and the model fitted to the measured times "
                      "(right); b*: the model's optimum.")

    model_rows = []
    for mb in sizes:
        at = {d: next((r for r in series[d] if r["bucket_size_mb"] == mb), None) for d in DTYPE_ORDER}
        calls = next(r["n_buckets"] for r in at.values() if r)
        cells = [f"{mb:g}", str(calls), num(grad_bytes / (mb * 2**20), 0), num(model_ms(calls), 1)]
        for d in DTYPE_ORDER:
            r = at[d]
            cells += [num(r and exposed_of(r), 1),
                      num(fitted[d].overhead_s(r["grad_bytes"], r["n_buckets"]) * 1e3, 1) if r and fitted[d] else DASH]
        model_rows.append(cells)
    model_table = table([["", "", "", "", *[span(f"exposed, {d} (ms)", 2) for d in DTYPE_ORDER]],
                         ["bucket (MiB)", "calls n_b", "s / bucket", "model (ms)",
                          *[c for _ in DTYPE_ORDER for c in ("measured", "fitted")]]],
                        model_rows, "The overhead model against the measured exposed communication: the number of "
                        "all-reduce calls per step (a tensor larger than the cap is a bucket of its own, so it is not "
                        "s / bucket size), the model's overhead with o and w from the all-reduce fit, and the model "
                        "fitted to each dtype's measured times.", size=8)

    check_rows = ratio_checks(res, rows)

    def dtype_numbers(dtype: str) -> dict[str, str]:
        pts = series[dtype]
        best, worst = min(pts, key=lambda r: r["step_ms"]), max(pts, key=lambda r: r["step_ms"])
        check = next((r for r in pts if r["bucket_size_mb"] == check_rows["bucket_mb"]), None)
        cli = check["step_ms"] / torch_ms[dtype] if check else None
        loop = check_rows["ratios"].get(dtype)
        f = fitted[dtype]
        usable = f is not None and f.per_call_s > 0 and math.isfinite(f.bandwidth_bytes_per_s)
        return {
            "best_mb": f"{best['bucket_size_mb']:g}", "best_ms": num(best["step_ms"]),
            "best_exposed": num(exposed_of(best)), "best_share": pct(exposed_of(best) / best["step_ms"]),
            "best_vs_torch": times(best["step_ms"] / torch_ms[dtype], 3), "torch_ms": num(torch_ms[dtype]),
            "worst_mb": f"{worst['bucket_size_mb']:g}", "worst_ms": num(worst["step_ms"]),
            "spread": pct(worst["step_ms"] / best["step_ms"] - 1),
            "steps": ", ".join(f"{r['bucket_size_mb']:g} MiB: {num(r['step_ms'])} ms" for r in pts),
            "cli_ratio": num(cli, 3), "loop_ratio": num(loop, 3),
            "agree": bool(cli and loop and abs(loop / cli - 1) <= 0.05),
            "fit_o_us": num(f.per_call_s * 1e6, 0) if f else DASH,
            "fit_w_gbs": num(f.bandwidth_bytes_per_s / 1e9, 1) if usable else DASH,
            "fit_b_mb": num(f.optimal_bucket_bytes(grad_bytes) / 2**20, 0) if usable else DASH,
            "w_over_fit": num(bandwidth / f.bandwidth_bytes_per_s, 0) if usable else DASH,
        }

    smallest = series[DTYPE_ORDER[0]][0]
    n = {
        **{d: dtype_numbers(d) for d in DTYPE_ORDER}, **local_spread(rows),
        "check_mb": f"{check_rows['bucket_mb']:g}", "check_where": check_rows["where"],
        "check_others": check_rows["others"],
        "size": size, "params": f"{params / 1e9:.3f}", "s_gb": num(grad_bytes / 1e9, 2), "world": str(world),
        "w_gbs": num(bandwidth / 1e9, 1), "o_us": num(per_call * 1e6, 0), "fit_where": short_device(rows[0]["device"]),
        "n_star": num(optimum["n_buckets"], 1), "b_star_mb": num(optimum["bucket_bytes"] / 2**20, 0),
        "overhead_ms": num(optimum["overhead"] * 1e3, 1), "one_bucket_ms": num(model_ms(1), 1),
        "small_mb": f"{smallest['bucket_size_mb']:g}", "small_calls": str(smallest["n_buckets"]),
        "small_naive": num(grad_bytes / (smallest["bucket_size_mb"] * 2**20), 0),
    }
    pairs = ddp_pairs(res)
    n["pairs"] = pairs["n"]
    four = load_ddp(res, world_size=4)
    four_table = ddp_table(four, CAPTION.format(setup=ddp_setup(four)) + f" {short_device(four[0]['device'])}.")
    n["four"] = {d: {"best": best_bucketed(four, d), "torch": ddp_numbers(four, "torch_ddp", d)} for d in DTYPE_ORDER}
    traced = traced_rows(res, ("bucketed",)).get(("bucketed", "bf16"))
    n["trace"] = rank_phases(traced)
    return {"tables": {"main": tab, "model": model_table, "pairs": pairs["table"], "four": four_table},
            "figures": {"main": figure, "trace": trace_figure(out, traced) if n["trace"]["has"] else None}, "n": n}


def best_bucketed(rows: list[dict[str, Any]], dtype: str) -> dict[str, Any]:
    """The fastest bucketed row of ``dtype``: its bucket size, step, exposed share and ratio to PyTorch DDP's."""
    best = min(by_variant(rows, "bucketed", dtype), key=lambda r: r["step_ms"])
    torch_ms = ddp_numbers(rows, "torch_ddp", dtype)["_step"]
    return {"mb": f"{best['bucket_size_mb']:g}", "step": num(best["step_ms"]),
            "share": pct(exposed_of(best) / best["step_ms"]), "vs_torch": times(best["step_ms"] / torch_ms, 3)}


PAIR_VARIANTS = ("torch_ddp", "bucketed_1000mb")


def ddp_pairs(res) -> dict[str, Any]:
    """PyTorch's DDP against our best bucketed DDP over every launch of each on the newest multi-GPU host (the
    alternating launches and the sweep's): per world size and dtype, each launch's step, the median and spread."""
    rows = [r for r in res.log_rows("ddp_benchmarking", measured=lambda row: False)
            if r.get("variant") in PAIR_VARIANTS and not r.get("oom")]
    host = rows[-1]["device"]
    res.used.extend(r for r in rows if r["device"] == host)
    groups: dict[tuple[int, str], dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        if r["device"] == host:
            groups.setdefault((r["world_size"], r["dtype"]), {}).setdefault(r["variant"], []).append(r)
    body, numbers = [], {}
    for (ws, dtype), by in sorted(groups.items(), key=lambda item: (item[0][0], _order(DTYPE_ORDER, item[0][1]))):
        if len(by) < 2 or min(len(v) for v in by.values()) < 3:
            continue
        medians = {v: statistics.median(r["step_ms"] for r in launches) for v, launches in by.items()}
        for variant in PAIR_VARIANTS:
            steps = [r["step_ms"] for r in by[variant]]
            shares = [r["exposed_ms"] / r["step_ms"] for r in by[variant] if r.get("exposed_ms") is not None]
            body.append([str(ws), dtype, variant_label(dict(variant=variant_of(variant),
                                                            bucket_size_mb=by[variant][0].get("bucket_mb"))),
                         ", ".join(num(t, 0) for t in steps), num(medians[variant]),
                         pct(max(steps) / min(steps) - 1), f"{pct(min(shares))} to {pct(max(shares))}"])
        ratio = medians["bucketed_1000mb"] / medians["torch_ddp"]
        numbers[f"w{ws}_{dtype}"] = {"ratio": times(ratio, 3), "launches": str(len(by["torch_ddp"]))}
    caption = (f"PyTorch's DDP and our bucketed DDP (1000 MiB), every launch of each on {short_device(host)} "
               "(alternating launches, three each, and the sweep's where it measured the same case); each launch "
               "spawns fresh ranks, times its own step without communication, then the wrapper's: its median step "
               "over 10 timed steps. Spread: largest over smallest launch.")
    tab = table(["processes", "dtype", "variant", "steps of each launch (ms)", "median (ms)", "spread",
                 "exposed share"], body, caption, align=["right", "left", "left", "left", "right", "right", "right"],
                size=8)
    return {"table": tab, "n": numbers}


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
        "total_tb": num((a["state_bytes"] + a["bf16_weights"]) / 1e12, 2),
        "total_h100": num((a["state_bytes"] + a["bf16_weights"]) / accounting.H100_BYTES, 1),
        "total_h100_int": str(math.ceil((a["state_bytes"] + a["bf16_weights"]) / accounting.H100_BYTES)),
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
