"""The bucketed-DDP overhead model (the handout's ``ddp_bucketed_benchmarking`` (b)) against the measured bucketed
step times.

Model. The gradients, ``s`` bytes in all, travel in ``n_b`` buckets of ``s / n_b`` bytes; one all-reduce
of ``x`` bytes costs ``o + x / w`` (per-call overhead ``o``, algorithm bandwidth ``w`` = bytes per rank
over all-reduce time). Assume, as the assignment does, that computing a bucket's gradients takes as long
as communicating it. Then bucket ``k``'s transfer runs while bucket ``k + 1`` is computed, and only the
last bucket's transfer, ``s / (n_b w)``, is left when backward ends. The per-call overheads do not
overlap: each call's launch and completion bookkeeping sits on the path of the step, so all ``n_b`` of
them add up. The overhead of DDP over the same step without communication is then

    overhead(n_b) = n_b * o + s / (n_b * w),

minimised at ``n_b* = sqrt(s / (w o))``, i.e. buckets of ``b* = s / n_b* = sqrt(s w o)`` bytes, where the
overhead is ``2 sqrt(s o / w)``.

``o`` and ``w`` come from the all-reduce benchmark's latency-bandwidth fit
(:func:`~cs336_systems.bench.distributed_communication_single_node.fit_latency_bandwidth`, ``alpha``
and ``beta``) for the backend and world size of the DDP run; the overhead is compared with the measured
``exposed_ms`` of each bucketed variant (``n_b`` and ``s`` are in the rows). The same model fitted
directly to the measured exposed times gives the ``o`` and ``w`` that the step behaves as if it had.

    python -m cs336_systems.bench.ddp_overhead_model            # reads writeup/results/*.jsonl
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cs336_systems.bench.common import cli, result_store
from cs336_systems.bench.common.allreduce_fit import fits_by_setting
from cs336_systems.bench.common.result_store import latest
from cs336_systems.parallel.ddp import bucket_size_mb

MB = 1024**2  # bucket sizes are MiB, as DDPBucketed's bucket_size_mb


@dataclass(frozen=True)
class OverheadModel:
    """``overhead(n_b) = n_b * per_call_s + total_bytes / (n_b * bandwidth_bytes_per_s)``."""

    per_call_s: float  # o
    bandwidth_bytes_per_s: float  # w

    def overhead_s(self, total_bytes: float, n_buckets: float) -> float:
        return n_buckets * self.per_call_s + total_bytes / (n_buckets * self.bandwidth_bytes_per_s)

    def optimal_n_buckets(self, total_bytes: float) -> float:
        return math.sqrt(total_bytes / (self.bandwidth_bytes_per_s * self.per_call_s))

    def optimal_bucket_bytes(self, total_bytes: float) -> float:
        return math.sqrt(total_bytes * self.bandwidth_bytes_per_s * self.per_call_s)


def fit_overhead_model(n_buckets: list[float], total_bytes: list[float], overhead_s: list[float]) -> OverheadModel:
    """Least squares of ``overhead = n_b o + (s / n_b) (1 / w)`` for non-negative ``o`` and ``1 / w``.

    Relative errors, so small and large overheads weigh alike. When the unconstrained fit gives a
    negative coefficient, the better of the two one-term fits is kept (an infinite bandwidth or a zero
    per-call overhead).
    """
    n, s, y = (np.asarray(v, dtype=float) for v in (n_buckets, total_bytes, overhead_s))
    if len(y) < 2:
        raise ValueError("fitting the overhead model needs at least two bucket sizes")
    if np.any(y <= 0):
        raise ValueError("the overhead model needs positive exposed times")
    features = np.stack([n, s / n], axis=1) / y[:, None]
    target = np.ones_like(y)
    coefficients, *_ = np.linalg.lstsq(features, target, rcond=None)
    if np.any(coefficients < 0):
        candidates = []
        for column in range(2):
            f = features[:, column]
            c = float(f @ target / (f @ f))
            candidates.append((float(np.sum((f * c - target) ** 2)), column, c))
        _, column, c = min(candidates)
        coefficients = np.zeros(2)
        coefficients[column] = c
    o, inverse_w = coefficients
    return OverheadModel(float(o), math.inf if inverse_w == 0 else float(1 / inverse_w))


def _bucketed_rows(ddp_rows: list[dict[str, Any]], dtype: str) -> list[dict[str, Any]]:
    """The latest row of each bucketed variant of ``dtype``, on the device and world size of the newest such row,
    by bucket size. Raises ``ValueError`` when there is none."""
    bucketed = [r for r in ddp_rows if r.get("dtype") == dtype and bucket_size_mb(r.get("variant", "")) is not None
                and r.get("exposed_ms") is not None and r.get("n_buckets")]
    if not bucketed:
        raise ValueError(f"no bucketed DDP rows for {dtype}")
    newest = latest(bucketed)[0]
    device, world_size = newest["device"], newest["world_size"]
    bucketed = latest([r for r in bucketed if r["device"] == device and r["world_size"] == world_size],
                      key=lambda r: r["variant"])
    return sorted(bucketed, key=lambda r: r["bucket_mb"])


def _link_model(allreduce_rows: list[dict[str, Any]], device: str, backend: str, world_size: int) -> OverheadModel:
    """The model whose ``o`` and ``w`` are the all-reduce fit of ``backend`` at ``world_size``, from the rows of
    ``device`` when they have that fit. Raises ``ValueError`` when no rows do."""
    fits = fits_by_setting([r for r in allreduce_rows if r.get("device") == device])
    if (backend, world_size) not in fits:
        fits = fits_by_setting(allreduce_rows)  # e.g. all-reduce measured on a larger machine of the same GPUs
    if (backend, world_size) not in fits:
        raise ValueError(f"no all-reduce fit for {backend} with {world_size} ranks")
    link = fits[(backend, world_size)]
    return OverheadModel(link.alpha_s, link.beta_bytes_per_s)


def _overhead_table(bucketed: list[dict[str, Any]], total_bytes: float, model: OverheadModel,
                    fitted: OverheadModel | None) -> list[dict[str, Any]]:
    """Per bucketed variant: its measured step and exposed time beside the predicted and fitted overheads (ms)."""
    return [
        {
            "variant": r["variant"],
            "bucket_mb": r["bucket_mb"],
            "n_buckets": r["n_buckets"],
            "step_ms": r["step_ms"],
            "measured_exposed_ms": r["exposed_ms"],
            "predicted_overhead_ms": model.overhead_s(total_bytes, r["n_buckets"]) * 1e3,
            "fitted_overhead_ms": fitted.overhead_s(total_bytes, r["n_buckets"]) * 1e3 if fitted else None,
        }
        for r in bucketed
    ]


def compare(allreduce_rows: list[dict[str, Any]], ddp_rows: list[dict[str, Any]], dtype: str,
            backend: str = "nccl") -> dict[str, Any]:
    """Predicted against measured DDP overhead for every bucketed variant of ``dtype`` (latest rows).

    The all-reduce fit is that of ``backend`` at the DDP run's world size, from rows of the DDP run's
    device when there are any. Raises ``ValueError`` when a side is missing.
    """
    bucketed = _bucketed_rows(ddp_rows, dtype)
    device, world_size = bucketed[-1]["device"], bucketed[-1]["world_size"]
    model = _link_model(allreduce_rows, device, backend, world_size)
    total_bytes = bucketed[-1]["grad_bytes"]
    n = [r["n_buckets"] for r in bucketed]
    measured = [r["exposed_ms"] / 1e3 for r in bucketed]
    try:
        fitted = fit_overhead_model(n, [total_bytes] * len(n), measured)
    except ValueError:  # fewer than two sizes, or exposed times at or below zero (noise): no fit
        fitted = None
    table = _overhead_table(bucketed, total_bytes, model, fitted)
    best = min(table, key=lambda row: row["measured_exposed_ms"])
    return {
        "dtype": dtype,
        "device": device,
        "world_size": world_size,
        "backend": backend,
        "grad_bytes": total_bytes,
        "per_call_us": model.per_call_s * 1e6,
        "bandwidth_gbps": model.bandwidth_bytes_per_s / 1e9,
        "predicted_optimal_bucket_mb": model.optimal_bucket_bytes(total_bytes) / MB,
        "predicted_optimal_n_buckets": model.optimal_n_buckets(total_bytes),
        "predicted_optimal_overhead_ms": model.overhead_s(total_bytes, model.optimal_n_buckets(total_bytes)) * 1e3,
        "measured_best_bucket_mb": best["bucket_mb"],
        "measured_best_exposed_ms": best["measured_exposed_ms"],
        "fitted_per_call_us": fitted.per_call_s * 1e6 if fitted else None,
        "fitted_bandwidth_gbps": fitted.bandwidth_bytes_per_s / 1e9 if fitted else None,
        "fitted_optimal_bucket_mb": (fitted.optimal_bucket_bytes(total_bytes) / MB
                                     if fitted and fitted.per_call_s > 0 and math.isfinite(fitted.bandwidth_bytes_per_s)
                                     else None),
        "rows": table,
    }


def compare_files(results_dir: Path | None = None, dtypes: tuple[str, ...] = ("fp32", "bf16"),
                  backend: str = "nccl") -> list[dict[str, Any]]:
    """:func:`compare` for each dtype that has rows, from the results files in ``results_dir``."""
    results_dir = Path(results_dir or result_store.RESULTS_DIR)
    problems = ("distributed_communication_single_node", "ddp_benchmarking")
    paths = [results_dir / f"{problem}.jsonl" for problem in problems]
    allreduce, ddp = (result_store.read_rows(path) for path in paths)
    for path, rows in zip(paths, (allreduce, ddp)):
        devices = sorted({row.get("device", "?") for row in rows})
        print(f"# reading {path}: {len(rows)} rows ({', '.join(devices) or 'none'})", file=sys.stderr)
    out = []
    for dtype in dtypes:
        try:
            out.append(compare(allreduce, ddp, dtype, backend))
        except ValueError as error:
            print(f"# {dtype}: {error}")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=None,
                   help=f"where the all-reduce and DDP rows are (default {result_store.RESULTS_DIR}, the committed GPU "
                        f"rows, on any machine; {result_store.SCRATCH_DIR / 'results'} holds your own smoke runs)")
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--quick", action="store_true", help="accepted as by every tool; the model only reads rows")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    for result in compare_files(args.results_dir, backend=args.backend):
        print(f"\n{result['dtype']} on {result['device']}: s = {result['grad_bytes'] / 1e9:.2f} GB, "
              f"o = {result['per_call_us']:.1f} us, w = {result['bandwidth_gbps']:.1f} GB/s "
              f"({result['backend']}, {result['world_size']} ranks)")
        print(f"predicted optimum: {result['predicted_optimal_bucket_mb']:.1f} MiB buckets "
              f"({result['predicted_optimal_n_buckets']:.0f} buckets, "
              f"{result['predicted_optimal_overhead_ms']:.2f} ms); "
              f"measured best: {result['measured_best_bucket_mb']:g} MiB ({result['measured_best_exposed_ms']:.2f} ms)")
        if result["fitted_per_call_us"] is not None:
            optimum = result["fitted_optimal_bucket_mb"]
            print(f"fitted to the measured times: o = {result['fitted_per_call_us']:.1f} us, "
                  f"w = {result['fitted_bandwidth_gbps']:.1f} GB/s, optimum "
                  f"{'-' if optimum is None else f'{optimum:.1f} MiB'}")
        cli.print_table(result["rows"], ["variant", "n_buckets", "step_ms", "measured_exposed_ms",
                                             "predicted_overhead_ms", "fitted_overhead_ms"])


if __name__ == "__main__":
    main()
