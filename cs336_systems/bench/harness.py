"""What every benchmark shares: the environment record, timing, FLOP accounting and the result store.

Every benchmark tool ``python -m cs336_systems.bench.<problem>`` writes rows to
``writeup/results/<problem>.jsonl`` through a :class:`ResultStore`: one JSON object a line, holding

* ``run``: an id per invocation (UTC time plus a random suffix), and ``problem``,
* the configuration's keys (what was measured: the keys that identify the row; resume compares them),
* the measurements (``mean_ms``, ``std_ms``, ``median_ms``, ..., or ``"oom": true``),
* ``device`` (GPU count and name, or ``cpu``) and ``env``: GPU name and count, torch/triton/CUDA
  versions, date, git commit.

Re-running a tool skips every configuration already measured on the same device (GPU name and count),
so a sweep can be split over several short runs; ``--force`` measures again. An out-of-memory case
becomes a row with ``"oom": true`` instead of a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import secrets
import statistics
import subprocess
import sys
import timeit
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = Path(os.environ.get("CS336_RESULTS_DIR", REPO_ROOT / "writeup" / "results"))
FIGURES_DIR = Path(os.environ.get("CS336_FIGURES_DIR", REPO_ROOT / "writeup" / "figures"))

# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------


def git_commit() -> str:
    """The checkout's commit (``CS336_GIT_COMMIT`` wins: a copied tree without ``.git`` knows no commit)."""
    if os.environ.get("CS336_GIT_COMMIT"):
        return os.environ["CS336_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict[str, Any]:
    """Where a row was measured: device, software versions, date and commit."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    has_cuda = torch.cuda.is_available()
    gpu_name = torch.cuda.get_device_name(0) if has_cuda else None
    gpu_count = torch.cuda.device_count() if has_cuda else 0
    return {
        "device": f"{gpu_count}x {gpu_name}" if has_cuda else f"cpu ({platform.processor() or platform.machine()})",
        "gpu_name": gpu_name,
        "gpu_count": gpu_count,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
    }


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Result store
# ---------------------------------------------------------------------------------------------


def _matches(row: dict[str, Any], config: dict[str, Any]) -> bool:
    """Whether ``row`` was measured for exactly ``config`` (same configuration keys, same values)."""
    return set(row.get("config_keys", ())) == set(config) and all(row.get(k) == v for k, v in config.items())


class ResultStore:
    """Rows of one problem in ``<results_dir>/<problem>.jsonl``, appended one line at a time."""

    def __init__(self, problem: str, results_dir: Path | str | None = None, force: bool = False):
        self.problem = problem
        self.path = Path(results_dir or RESULTS_DIR) / f"{problem}.jsonl"
        self.force = force
        self.run = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)
        self.env = environment()
        self._measured = [row for row in self.rows() if row.get("device") == self.env["device"]]

    def rows(self) -> list[dict[str, Any]]:
        """Every row in the file (all devices, all runs)."""
        if not self.path.exists():
            return []
        with self.path.open() as file:
            return [json.loads(line) for line in file if line.strip()]

    def done(self, config: dict[str, Any]) -> bool:
        """Whether ``config`` was already measured on this device (always False with ``force``)."""
        return not self.force and any(_matches(row, config) for row in self._measured)

    def add(self, config: dict[str, Any], measurements: dict[str, Any]) -> dict[str, Any]:
        """Append one row (``config`` and ``measurements`` side by side) and return it."""
        clash = set(config) & set(measurements)
        if clash:
            raise ValueError(f"measurement keys {sorted(clash)} clash with configuration keys")
        row = {
            "run": self.run,
            "problem": self.problem,
            **config,
            **measurements,
            "config_keys": sorted(config),
            "device": self.env["device"],
            "env": self.env,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as file:
            file.write(json.dumps(row) + "\n")
        self._measured.append(row)
        return row

    def pending(self, configs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """The configurations not yet measured on this device, in order."""
        return [config for config in configs if not self.done(config)]


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def measure_or_oom(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure()``, or ``{"oom": True, "error": ...}`` when it runs out of device memory."""
    try:
        return {"oom": False, **measure()}
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_oom(error):
            raise
        message = str(error).splitlines()[0][:300]
    free_memory()
    return {"oom": True, "error": message}


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def progress(items: list, desc: str):
    """A tqdm progress bar over ``items`` (on stderr, so printed tables stay clean); ``.update()`` steps it."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def summarize_ms(seconds: list[float], prefix: str = "") -> dict[str, float]:
    """Mean, standard deviation, median, min and max of ``seconds``, in milliseconds."""
    ms = [s * 1e3 for s in seconds]
    if not ms:
        return {}
    return {
        f"{prefix}mean_ms": statistics.fmean(ms),
        f"{prefix}std_ms": statistics.stdev(ms) if len(ms) > 1 else 0.0,
        f"{prefix}median_ms": statistics.median(ms),
        f"{prefix}min_ms": min(ms),
        f"{prefix}max_ms": max(ms),
    }


def time_calls(fn: Callable[[], Any], warmup: int, steps: int, device: torch.device | str | None = None) -> list[float]:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then ``steps`` timed ones, each synchronised."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(steps):
        start = timeit.default_timer()
        fn()
        synchronize(device)
        times.append(timeit.default_timer() - start)
    return times


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, float]]:
    """Yields a dict that holds, on exit, ``peak_gb``: the peak allocated device memory inside the block."""
    result: dict[str, float] = {}
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    yield result
    if device.type == "cuda":
        synchronize(device)
        result["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9


def measure_matmul_tflops(device: torch.device, n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The device's measured dense matmul rate (TFLOP/s) on an ``n^3`` product of random ``dtype`` matrices.

    MFU is stated against this measured rate rather than a datasheet number. None on a CPU.
    """
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_calls(lambda: a @ b, warmup=3, steps=10, device=device)
    return 2 * n**3 / statistics.median(seconds) / 1e12


# ---------------------------------------------------------------------------------------------
# FLOP accounting
# ---------------------------------------------------------------------------------------------


def lm_forward_flops(
    vocab_size: int, d_model: int, d_ff: int, num_layers: int, batch: int, seq: int, causal_attention: bool = False
) -> float:
    """Matmul FLOPs of one ``BasicsTransformerLM`` forward pass on ``batch x seq`` tokens.

    ``2 * tokens * (L * (4 d^2 + 3 d d_ff) + V d)`` for the weight matmuls (Q, K, V, output
    projections; SwiGLU's three matrices; the LM head) plus ``L * 4 * batch * seq^2 * d`` for
    ``Q K^T`` and ``P V`` over all heads. The naive attention computes the whole score matrix, so the
    attention term counts it all unless ``causal_attention`` (a kernel that skips masked tiles: half).
    Element-wise work (norms, softmax, RoPE, SiLU) is left out: it is a few percent at most.
    """
    tokens = batch * seq
    weights = 2 * tokens * (num_layers * (4 * d_model**2 + 3 * d_model * d_ff) + vocab_size * d_model)
    attention = num_layers * 4 * batch * seq**2 * d_model
    return weights + (attention / 2 if causal_attention else attention)


# Backward costs two matmuls per forward matmul (gradients of inputs and of weights).
FLOPS_MULTIPLIER = {"forward": 1.0, "backward": 2.0, "forward_backward": 3.0, "train_step": 3.0}


# ---------------------------------------------------------------------------------------------
# Command lines
# ---------------------------------------------------------------------------------------------


def base_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: the smallest configuration, few steps")
    parser.add_argument("--results-dir", type=Path, default=None, help=f"where rows go (default {RESULTS_DIR})")
    parser.add_argument("--force", action="store_true", help="measure again configurations already in the results")
    return parser


def announce(device: torch.device, quick: bool) -> None:
    """Say on which machine the tool runs and whether it chose the tiny CPU configuration."""
    if device.type == "cuda":
        print(f"# device: {torch.cuda.get_device_name(device)} ({torch.cuda.device_count()} GPU(s))", file=sys.stderr)
    else:
        print("# device: CPU (no GPU found): running a tiny CPU configuration", file=sys.stderr)
    if quick:
        print("# --quick: smoke-test configuration", file=sys.stderr)


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: numbers rounded, None and NaN as a dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(rows: list[dict[str, Any]], columns: list[str], digits: int = 2) -> None:
    """A plain fixed-width table of ``columns`` from ``rows`` on stdout."""
    cells = [[fmt(row.get(col), digits) for col in columns] for row in rows]
    widths = [max(len(col), *(len(c[i]) for c in cells)) if cells else len(col) for i, col in enumerate(columns)]
    print("  ".join(col.rjust(w) for col, w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))
