"""Measure the GPU error grid of our attention operator and write it where the writeup reads it: per case the
relative errors of O, L, dQ, dK, dV against float64 beside plain PyTorch's at the same precision (the cases and
bounds of ``tests/_flash_error_grid.py``, which the GPU tests assert), the worst per precision, and three notes
(the autotuned kernels at d = 64 and 128; the leaderboard shape against float32 SDPA, with times).

    python scripts/flash_error_grid.py --results-dir DIR     # writes DIR/flash_attention_triton_errors.json

Groups: the whole grid with the default kernel choice; on a Hopper GPU its 16-bit cases with the Gluon kernels
forced; its awkward cases with the Triton kernels forced. Exits non-zero when a case breaks its bound (the file is
written all the same).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests._flash_checks import hopper_gpu  # noqa: E402
from tests._flash_error_grid import (  # noqa: E402
    CHECK_KEYS,
    ERROR_FLOOR,
    ERRORS_FILE_NAME,
    GROUPS,
    TORCH_ERROR_FACTOR,
    failures,
    measure,
    measure_autotuned,
    measure_leaderboard_shape,
    summarize,
)


def grid_records() -> tuple[list[dict], list[str]]:
    """The records of every group's cases, and the failures (case: what broke)."""
    records, broken = [], []
    for kernels, cases in GROUPS.items():
        if kernels == "hopper" and not hopper_gpu():
            continue
        for case in cases():
            record = measure(case, kernels)
            broken += [f"{kernels} {case}: {failure}" for failure in failures(record)]
            records.append({key: value for key, value in record.items() if key not in CHECK_KEYS})
            print(f"{kernels:6s} {case}: " + " ".join(f"{k} {v:.1e}" for k, v in record["errors"].items()), flush=True)
    return records, broken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", required=True, type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("the error grid needs a CUDA GPU")
    records, broken = grid_records()
    for head_dim in (64, 128):
        records.append({k: v for k, v in measure_autotuned(head_dim).items() if k != "non_finite"})
    records.append({k: v for k, v in measure_leaderboard_shape(timed=True).items() if k != "non_finite"})
    path = args.results_dir / ERRORS_FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "error_floor": ERROR_FLOOR, "torch_error_factor": TORCH_ERROR_FACTOR,
        "summary": summarize(records), "records": records,
    }, indent=1))
    print(f"written to {path}")
    if broken:
        sys.exit("cases over their bounds:\n" + "\n".join(broken))


if __name__ == "__main__":
    main()
