"""The latency-bandwidth model ``t = alpha + bytes / beta`` fitted to all-reduce timings, per backend and
world size: written by ``distributed_communication_single_node``, read by ``ddp_overhead_model``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cs336_systems.bench.common.result_store import latest


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """A ring all-reduce moves ``2 (n - 1) / n`` times the data through each rank's link."""
    return algbw * 2 * (world_size - 1) / world_size


@dataclass(frozen=True)
class LatencyBandwidth:
    """``t(bytes) = alpha_s + bytes / beta_bytes_per_s`` for one all-reduce call."""

    alpha_s: float
    beta_bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_bytes_per_s


def fit_latency_bandwidth(nbytes: list[float], seconds: list[float]) -> LatencyBandwidth:
    """Least squares of ``t = alpha + bytes / beta`` on relative errors (so 1 MB counts as much as 1 GB).

    A negative intercept (noise on tiny per-call times) is clamped to zero and ``beta`` refitted alone.
    """
    x, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(x) < 2 or len(set(x)) < 2:
        raise ValueError("fitting latency and bandwidth needs at least two different sizes")
    design = np.stack([np.ones_like(x), x], axis=1) / t[:, None]
    (alpha, inverse_beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha = 0.0
        inverse_beta = float(np.sum(x / t) / np.sum((x / t) ** 2))  # argmin sum (x/t * b - 1)^2
    if inverse_beta <= 0:
        raise ValueError("all-reduce times do not grow with size: no bandwidth to fit")
    return LatencyBandwidth(float(alpha), float(1 / inverse_beta))


def latest_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latest row of each (backend, world size, size) that has a time."""
    return latest((row for row in rows if row.get("mean_ms") is not None),
                  key=lambda row: (row["backend"], row["world_size"], row["bytes"]))


def fits_by_setting(rows: list[dict[str, Any]]) -> dict[tuple[str, int], LatencyBandwidth]:
    """One latency-bandwidth fit per (backend, world size) from the mean call times of ``rows``.

    Settings with fewer than two sizes, or whose times do not grow with size (tiny, noisy tensors), have none.
    """
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in latest_rows(rows):
        groups.setdefault((row["backend"], row["world_size"]), []).append(row)
    fits = {}
    for key, group in sorted(groups.items()):
        try:
            fits[key] = fit_latency_bandwidth([r["bytes"] for r in group], [r["mean_ms"] / 1e3 for r in group])
        except ValueError:
            continue
    return fits
