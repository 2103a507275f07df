"""Our RMSNorm forward at several persistent-grid sizes beside Liger's and the copy, on CUDA-graph replays.

The forward runs ``FWD_PROGRAMS_PER_SM`` programs per SM, each walking its row tiles with the next tile's loads in
flight; Liger launches one program per row and lets the hardware keep as many resident as fit. This measures which
gets closer to the copy bandwidth, at the large shapes where the forward trails: per shape, ours at each grid size
(``0`` = one program per tile, no persistent loop), Liger, and the copy both as ``x.clone()`` and as a copy into a
preallocated output. One JSON line per measurement, to stdout and to ``--output``.

    python scripts/rmsnorm_forward_grid.py --output /tmp/forward_grid.jsonl
    python scripts/rmsnorm_forward_grid.py --programs-per-sm 4 8 0 --dtypes bf16 --shapes 32768x4096
"""

from __future__ import annotations

import argparse
import json

import torch

from cs336_systems.bench.common import timing
from cs336_systems.bench.rmsnorm import DTYPES, gbps, make_norm, moved_bytes
from cs336_systems.kernels import rmsnorm

SHAPES = ["16384x4096", "32768x4096", "16384x8192", "32768x8192", "65536x2560", "65536x4096", "65536x1600"]
ONE_PROGRAM_PER_TILE = 1 << 20  # programs per SM large enough that the grid is one program per tile


def measure(fn, inputs, device: torch.device) -> float:
    return timing.graph_replay_ms(fn, inputs, device)["median_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="M x N shapes")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--programs-per-sm", nargs="+", type=int, default=[4, 8, 16, 0],
                        help="forward programs per SM to try (0: one program per tile)")
    parser.add_argument("--output", help="also append the lines to this file")
    args = parser.parse_args()
    device = torch.device("cuda")
    l2 = timing.l2_cache_bytes(device)
    default_programs = rmsnorm.FWD_PROGRAMS_PER_SM
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for shape in args.shapes:
            rows, cols = map(int, shape.split("x"))
            sets = timing.rotation_count(rows * cols * dtype.itemsize, l2)
            inputs = [(torch.randn(rows, cols, device=device, dtype=dtype),) for _ in range(sets)]
            outputs = [torch.empty_like(one[0]) for one in inputs]
            moved = moved_bytes("fwd", rows, cols, dtype.itemsize, dtype.itemsize)
            copied = moved_bytes("copy", rows, cols, dtype.itemsize, 0)
            cases = {"copy_clone": (lambda one: one[0].clone(), copied)}
            by_input = {id(one[0]): out for one, out in zip(inputs, outputs)}
            cases["copy_into"] = (lambda one: by_input[id(one[0])].copy_(one[0]), copied)
            liger = make_norm("liger", cols, dtype, device)
            cases["liger"] = (lambda one: liger(one[0]), moved)
            for name, (fn, nbytes) in cases.items():
                emit(args, dtype_name, rows, cols, name, None, gbps(nbytes, measure(fn, inputs, device)))
            ours = make_norm("ours", cols, dtype, device)
            for per_sm in args.programs_per_sm:
                rmsnorm.FWD_PROGRAMS_PER_SM = per_sm or ONE_PROGRAM_PER_TILE
                try:
                    ms = measure(lambda one: ours(one[0]), inputs, device)
                finally:
                    rmsnorm.FWD_PROGRAMS_PER_SM = default_programs
                emit(args, dtype_name, rows, cols, "ours", per_sm, gbps(moved, ms))
            del inputs, outputs, by_input
            torch.cuda.empty_cache()


def emit(args, dtype: str, rows: int, cols: int, provider: str, per_sm: int | None, gb_per_s: float) -> None:
    line = json.dumps({"dtype": dtype, "rows": rows, "cols": cols, "provider": provider,
                       "programs_per_sm": per_sm, "gbps": round(gb_per_s, 1),
                       "device": torch.cuda.get_device_name()})
    print(line, flush=True)
    if args.output:
        with open(args.output, "a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
