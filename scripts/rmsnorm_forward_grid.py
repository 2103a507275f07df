"""Our RMSNorm forward beside Liger's and the copy at the large shapes, on CUDA-graph replays.

Our forward's grid is tuned with its tiles: a few programs per SM each walking its row tiles with the next tile's
loads in flight, or one program per tile as Liger launches (one per row), letting the hardware keep as many
resident as fit. Per shape: ours at each grid size of ``FWD_GRIDS`` (the autotuner's candidates restricted to it),
ours autotuned over all of them, Liger, and the copy both as ``x.clone()`` and as a copy into a preallocated
output. One JSON line per measurement, to stdout and to ``--output``.

    python scripts/rmsnorm_forward_grid.py --output /tmp/forward_grid.jsonl
    python scripts/rmsnorm_forward_grid.py --dtypes bf16 --shapes 32768x4096
"""

from __future__ import annotations

import argparse
import json

import torch

from cs336_systems.bench.common import timing
from cs336_systems.bench.rmsnorm import DTYPES, gbps, make_norm, moved_bytes
from cs336_systems.kernels import rmsnorm

SHAPES = ["16384x4096", "32768x4096", "16384x8192", "32768x8192", "65536x2560", "65536x4096", "65536x1600"]


def measure(fn, inputs, device: torch.device) -> float:
    return timing.graph_replay_ms(fn, inputs, device)["median_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="M x N shapes")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--output", help="also append the lines to this file")
    args = parser.parse_args()
    device = torch.device("cuda")
    l2 = timing.l2_cache_bytes(device)
    tuner = rmsnorm._FORWARD.autotuner
    all_configs = list(tuner.configs)
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
            for per_sm in [*rmsnorm.FWD_GRIDS, None]:  # None: every grid size, as the operator runs
                tuner.configs = [c for c in all_configs if per_sm is None or c.kwargs["PROGRAMS_PER_SM"] == per_sm]
                # Forget the previous pick everywhere it is kept: Triton's autotuner and our launch entries (the
                # configuration and the compiled kernel of each key).
                tuner.cache.clear()
                rmsnorm._FORWARD.entries.clear()
                try:
                    ms = measure(lambda one: ours(one[0]), inputs, device)
                finally:
                    tuner.configs = all_configs
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
