"""Analyzing parallelism strategies (2026 edition): no measurements. The closed forms of
:mod:`pipeline.parallelism`, evaluated for an example FFN layer on datasheet H100s and B200s."""

from __future__ import annotations

import math
from typing import Any

from pipeline import parallelism as par
from pipeline.markup import num, sig, table
from pipeline.sections.registry import Output, problem

LAYER = par.EXAMPLE_LAYER
DEVICES = {"h100": par.H100, "b200": par.B200}


def ms(seconds: float) -> str:
    return num(seconds * 1e3, 1)


def bound(x: float) -> dict[str, str]:
    """A real bound ``N <= x`` and the largest integer within it."""
    return {"real": num(x, 2), "int": str(math.floor(x))}


def grid_text(grid: par.Grid, digits: int = 0) -> str:
    """``N_TP x N_FSDP = N``."""
    return f"{num(grid.n_tp, digits)} × {num(grid.n_fsdp, digits)} = {num(grid.n, digits)}"


def setting() -> dict[str, Any]:
    """The example layer and the devices' datasheet numbers, as the text prints them."""
    return {"d": f"{LAYER['d']:,}", "d_ff": f"{LAYER['d_ff']:,}", "b": f"{LAYER['b']:,}",
            "seqs": str(LAYER["b"] // 4096),
            **{key: {"name": dev.name, "c": sig(dev.c / 1e12, 3), "w": num(dev.w / 1e9, 0),
                     "c_over_w": num(dev.c / dev.w, 0)} for key, dev in DEVICES.items()}}


@problem("alternate_ring_all_reduce")
def alternate_ring_all_reduce(res, out: Output) -> dict[str, Any]:
    s, n = par.ffn_weight_bytes(LAYER["d"], LAYER["d_ff"]), 8
    w = par.H100.w
    return {"n": {"setting": setting(), "s_gb": num(s / 1e9, 2), "devices": str(n), "device": par.H100.name,
                  "alternate_ms": ms(par.alternate_ring_all_reduce_time(s, n, w)),
                  "ring_ms": ms(par.all_reduce_time(s, n, w)),
                  "ratio": num(par.alternate_ring_all_reduce_time(s, n, w) / par.all_reduce_time(s, n, w), 0)}}


@problem("data_parallel_calcs")
def data_parallel_calcs(res, out: Output) -> dict[str, Any]:
    b, d, d_ff = LAYER["b"], LAYER["d"], LAYER["d_ff"]
    numbers = {}
    for key, dev in DEVICES.items():
        limit = par.dp_max_devices(b, dev.c, dev.w)
        n = math.floor(limit)
        numbers[key] = {**bound(limit),
                        "compute_ms": ms(par.compute_time(par.dp_backward_flops(b, d, d_ff, n), dev.c)),
                        "comm_ms": ms(par.dp_backward_comm_time(d, d_ff, n, dev.w))}
    return {"n": numbers}


@problem("fsdp_calcs")
def fsdp_calcs(res, out: Output) -> dict[str, Any]:
    b, d, d_ff = LAYER["b"], LAYER["d"], LAYER["d_ff"]
    numbers = {}
    for key, dev in DEVICES.items():
        forward = par.fsdp_max_devices_forward(b, dev.c, dev.w)
        backward = par.fsdp_max_devices_backward(b, dev.c, dev.w)
        n = math.floor(forward)
        numbers[key] = {"forward": bound(forward), "backward": bound(backward),
                        "forward_compute_ms": ms(par.compute_time(par.fsdp_forward_flops(b, d, d_ff, n), dev.c)),
                        "forward_comm_ms": ms(par.fsdp_forward_comm_time(d, d_ff, n, dev.w))}
    return {"n": numbers}


@problem("tp_calcs")
def tp_calcs(res, out: Output) -> dict[str, Any]:
    numbers = {key: {"forward": bound(par.tp_max_devices_forward(LAYER["d_ff"], dev.c, dev.w)),
                     "backward": bound(par.tp_max_devices_backward(LAYER["d_ff"], dev.c, dev.w))}
               for key, dev in DEVICES.items()}
    return {"n": numbers}


@problem("fsdp_tp_calcs")
def fsdp_tp_calcs(res, out: Output) -> dict[str, Any]:
    b, d_ff = LAYER["b"], LAYER["d_ff"]
    numbers, rows = {}, []
    for key, dev in DEVICES.items():
        overlapped = par.fsdp_tp_max_grid_overlapped(b, d_ff, dev.c, dev.w)
        shared = par.fsdp_tp_max_grid_shared(b, d_ff, dev.c, dev.w)
        shared_int = par.fsdp_tp_max_integer_grid_shared(b, d_ff, dev.c, dev.w)
        numbers[key] = {"overlapped": grid_text(overlapped), "shared": grid_text(shared, 2),
                        "shared_int": grid_text(shared_int)}
    for label, fn, real in [
        ("DP and FSDP, forward and backward", lambda dev: par.dp_max_devices(b, dev.c, dev.w), True),
        ("TP, forward", lambda dev: par.tp_max_devices_forward(d_ff, dev.c, dev.w), True),
        ("TP, backward", lambda dev: par.tp_max_devices_backward(d_ff, dev.c, dev.w), True),
        ("FSDP + TP forward, axes overlapped (c)", lambda dev: par.fsdp_tp_max_grid_overlapped(b, d_ff, dev.c, dev.w),
         False),
        ("FSDP + TP forward, axes sharing the network (d)",
         lambda dev: par.fsdp_tp_max_grid_shared(b, d_ff, dev.c, dev.w), False),
        ("the same, integer grids", lambda dev: par.fsdp_tp_max_integer_grid_shared(b, d_ff, dev.c, dev.w), False),
    ]:
        cells = []
        for dev in DEVICES.values():
            value = fn(dev)
            if real:
                cells.append(f"{num(value, 2)} → {math.floor(value)}")
            else:
                cells.append(grid_text(value, 0 if isinstance(value.n_tp, int) else 2))
        rows.append([label, *cells])
    caption = (f"The largest device counts before the example layer ({LAYER['d']:,} wide, {LAYER['d_ff']:,} hidden "
               f"units, {b:,} tokens) is communication-bound, from datasheet numbers: "
               + "; ".join(f"{dev.name} {sig(dev.c / 1e12, 3)} TFLOP/s dense bf16, NVLink {num(dev.w / 1e9, 0)} GB/s "
                           "per direction" for dev in DEVICES.values())
               + ". Real bounds and the largest integer within them; grids as TP devices × FSDP devices = N.")
    header = ["bound", *(dev.name for dev in DEVICES.values())]
    return {"n": numbers, "tables": {"bounds": table(header, rows, caption, size=9)}}
