"""The result store and the environment record every benchmark row carries.

Every benchmark tool ``python -m cs336_systems.bench.<problem>`` writes rows to
``<results dir>/<problem>.jsonl`` through a :class:`ResultStore`: one JSON object a line, holding

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

import datetime as dt
import json
import os
import platform
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from cs336_systems.bench.common import model_sizes
from cs336_systems.bench.common.timing import free_memory

REPO_ROOT = Path(__file__).resolve().parents[3]
RESULTS_DIR = Path(os.environ.get("CS336_RESULTS_DIR", REPO_ROOT / "writeup" / "results"))
FIGURES_DIR = Path(os.environ.get("CS336_FIGURES_DIR", REPO_ROOT / "writeup" / "figures"))
SCRATCH_DIR = REPO_ROOT / ".scratch"
"""Where smoke runs (``--quick``) and runs on a machine without a GPU write rows and figures unless told
otherwise (``--results-dir``, ``--figures-dir``): git-ignored, so only deliberate GPU runs reach the writeup."""


def git_commit() -> str:
    """The checkout's commit, with ``+modified`` when tracked files differ from it (``CS336_GIT_COMMIT`` wins: a
    copied tree without its own ``.git``, or with another checkout's, knows no commit of its own)."""
    if os.environ.get("CS336_GIT_COMMIT"):
        return os.environ["CS336_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
        changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=REPO_ROOT, capture_output=True)
        return out.stdout.strip() + ("+modified" if changed.returncode == 1 else "")
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


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a results file (none if it does not exist); a line that is not JSON is a ValueError naming the
    file and the line."""
    if not path.exists():
        return []
    rows = []
    with path.open() as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not a JSON row ({error.msg} at column {error.colno}); "
                                 "repair or delete that line") from None
    return rows


def measured_when(row: dict[str, Any]) -> str:
    """When ``row`` was measured, as a sort key: its date (ISO 8601, UTC; empty if it has none)."""
    return (row.get("env") or {}).get("date", "")


def latest(rows: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], Any] = lambda row: None
           ) -> list[dict[str, Any]]:
    """The latest row of each ``key(row)`` (default: the one latest row), in the order the keys first appear.

    The latest row is the one measured last (:func:`measured_when`); of rows of the same date (to the second), or
    without one, the one further down the file (rows are appended)."""
    newest: dict[Any, dict[str, Any]] = {}
    for row in rows:
        k = key(row)
        if k not in newest or measured_when(row) >= measured_when(newest[k]):
            newest[k] = row
    return list(newest.values())


def _matches(row: dict[str, Any], config: dict[str, Any]) -> bool:
    """Whether ``row`` was measured for exactly ``config`` (same configuration keys, same values)."""
    return set(row.get("config_keys", ())) == set(config) and all(row.get(k) == v for k, v in config.items())


class ResultStore:
    """Rows of one problem in ``<results_dir>/<problem>.jsonl``, appended one line at a time."""

    def __init__(self, problem: str, results_dir: Path | str | None = None, force: bool = False, quiet: bool = False,
                 edition: str | None = None):
        """``quiet``: say nothing on stderr (where rows go, what is skipped), for a caller that reports itself.
        ``edition``: the course edition whose size names the tool took; each row with a ``size`` then also holds
        ``edition`` and ``size_label`` (the size's name in it), beside the configuration, not in it: a row measured
        for one edition is done for the other."""
        self.problem = problem
        self.edition = edition
        self.path = Path(results_dir or RESULTS_DIR) / f"{problem}.jsonl"
        self.force = force
        self.run = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)
        self.env = environment()
        self._said_where = quiet
        self._quiet = quiet
        self._measured = [row for row in self.rows() if row.get("device") == self.env["device"]]
        self._asked: list[dict[str, Any]] = []  # every configuration passed to pending(), in order

    def rows(self) -> list[dict[str, Any]]:
        """Every row in the file (all devices, all runs)."""
        return read_rows(self.path)

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
            **self._labels(config),
            **measurements,
            "config_keys": sorted(config),
            "device": self.env["device"],
            "env": self.env,
        }
        if not self._said_where:
            print(f"# rows go to {self.path}", file=sys.stderr)
            self._said_where = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as file:
            file.write(json.dumps(row) + "\n")
        self._measured.append(row)
        return row

    def _labels(self, config: dict[str, Any]) -> dict[str, Any]:
        if self.edition is None or "size" not in config:
            return {}
        return {"edition": self.edition, "size_label": model_sizes.size_label(config["size"], self.edition)}

    def newest(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """The newest row measured on this device whose fields include every item of ``config`` (None if none)."""
        rows = latest(row for row in self.rows() if row.get("device") == self.env["device"]
                      and all(row.get(key) == value for key, value in config.items()))
        return rows[0] if rows else None

    def asked_rows(self) -> list[dict[str, Any]]:
        """The newest row on this device of every configuration passed to :meth:`pending`, measured now or by an
        earlier run (the rows a tool prints: a re-run with nothing left to measure shows what is stored)."""
        return [row for config in self._asked for row in latest(r for r in self._measured if _matches(r, config))]

    def pending(self, configs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """The configurations not yet measured on this device, in order; says on stderr how many were skipped."""
        configs = list(configs)
        self._asked += [config for config in configs if config not in self._asked]
        left = [config for config in configs if not self.done(config)]
        if not configs or len(left) == len(configs) or self._quiet:
            return left
        if left:
            print(f"# {len(configs) - len(left)} of {len(configs)} cases already in {self.path}: skipped "
                  "(--force measures them again)", file=sys.stderr)
        else:
            print(f"# every case is already in {self.path}: nothing to measure (--force measures again)",
                  file=sys.stderr)
        return left


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
