"""Reading the benchmark results: rows of ``<results_dir>/<problem>.jsonl`` written by ``cs336_systems.bench.common.result_store.ResultStore``.

A row is flat: ``run``, ``problem``, its configuration keys (listed in ``config_keys``), its measurements
(or ``"oom": true``), ``device`` and ``env`` (GPU name, torch/triton/CUDA versions, date, commit).
A file may hold several runs of the same configuration (``--force``) and several devices; a section
reads the latest row of each configuration (the latest date, then the furthest down the file), on one device unless
it spans machines itself.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cs336_systems.bench.common.result_store import latest, measured_when
from pipeline import editions

REPO_ROOT = Path(__file__).resolve().parents[2]


class Missing(Exception):
    """A results file (or a figure a results row names) that a section needs does not exist."""

    def __init__(self, path: Path | str, why: str = ""):
        self.path = str(path)
        self.why = why
        super().__init__(f"{self.path}{f' ({why})' if why else ''}")


def display_path(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (error messages stay short)."""
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise Missing(display_path(path))
    with path.open() as file:
        rows = [json.loads(line) for line in file if line.strip()]
    if not rows:
        raise Missing(display_path(path), "the file holds no rows")
    return rows


def config_of(row: dict[str, Any]) -> str:
    """A hashable identity of the row's configuration (its ``config_keys`` and their values)."""
    keys = row.get("config_keys") or sorted(k for k in row if k not in ("env", "run", "device"))
    return json.dumps({k: row.get(k) for k in sorted(keys)}, sort_keys=True, default=str)


def latest_per_config(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latest row of each (device, configuration), in the order the configurations first appear (the
    benchmarks' rule, :func:`cs336_systems.bench.common.result_store.latest`)."""
    return latest(rows, key=lambda row: (row.get("device", ""), config_of(row)))


def main_device(rows: list[dict[str, Any]]) -> str:
    """The device with the most rows (ties: the latest measured)."""
    counts = Counter(row.get("device", "") for row in rows)
    last_date = {row.get("device", ""): measured_when(row) for row in sorted(rows, key=measured_when)}
    return max(counts, key=lambda device: (counts[device], last_date[device]))


class Results:
    """The results directory, read lazily; every row a section reads is remembered for its environment line."""

    def __init__(self, results_dir: Path):
        self.results_dir = Path(results_dir)
        self.used: list[dict[str, Any]] = []
        self.read: dict[Path, list[dict[str, Any]]] = {}  # the rows of every file read since the last take_used

    def path(self, name: str) -> Path:
        return self.results_dir / name

    def rows(self, problem: str, one_device: bool = True,
             keep: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
             world_size: int | None = None) -> list[dict[str, Any]]:
        """Latest row per configuration of ``<problem>.jsonl``, of those the edition being built reads
        (:mod:`pipeline.editions`); only rows of ``world_size`` ranks, if given; then
        only the main device's rows if ``one_device``; only those ``keep`` returns, if given (the rows a section
        leaves out stay out of its environment line).

        Raises :class:`Missing` naming the file when it does not exist or lacks the rows the edition needs.
        """
        rows = latest_per_config(self._read(f"{problem}.jsonl"))
        rows = [row for row in rows if editions.keeps(problem, row)]  # those the edition's answers read
        lacking = editions.lacking(problem, rows)
        if lacking or not rows:
            raise Missing(display_path(self.path(f"{problem}.jsonl")),
                          f"{lacking or 'no rows'} (the {editions.current()} edition)")
        if world_size is not None:
            rows = [row for row in rows if row.get("world_size") == world_size]
            if not rows:
                raise Missing(display_path(self.path(f"{problem}.jsonl")), f"no rows of {world_size} ranks")
        if one_device:
            device = main_device(rows)
            rows = [row for row in rows if row.get("device", "") == device]
        if keep is not None:
            rows = keep(rows)
        self.used.extend(rows)
        return rows

    def log_rows(self, problem: str, measured: Callable[[dict[str, Any]], bool] = lambda row: True
                 ) -> list[dict[str, Any]]:
        """Every row of ``<problem>.jsonl`` in file order, all devices: a log, whose later rows amend earlier
        ones of the same configuration (the section merges them) instead of replacing them. Only the rows
        ``measured`` accepts go into the environment line.

        Raises :class:`Missing` naming the file when it does not exist.
        """
        rows = self._read(f"{problem}.jsonl")
        self.used.extend(row for row in rows if measured(row))
        return rows

    def json(self, name: str) -> Any:
        """A JSON results file other than rows (e.g. the GPU test run's error summary)."""
        path = self.path(name)
        if not path.exists():
            raise Missing(display_path(path))
        data = json.loads(path.read_text())
        self.used.append({"env": {k: data.get(k) for k in ("device", "torch", "triton", "date")}})
        return data

    def text(self, name: str) -> str:
        path = self.path(name)
        if not path.exists():
            raise Missing(display_path(path))
        return path.read_text()

    def _read(self, name: str) -> list[dict[str, Any]]:
        path = self.path(name)
        self.read[path] = read_jsonl(path)
        return self.read[path]

    def take_used(self) -> list[dict[str, Any]]:
        used, self.used, self.read = self.used, [], {}
        return used

    def missing_column(self, key: object) -> Missing | None:
        """A :class:`Missing` naming the first file read since the last ``take_used`` whose rows lack ``key``
        (say a tool's error rows, written where it could not measure), or None if every row has it."""
        for path, rows in self.read.items():
            lacking = [row for row in rows if key not in row]
            if lacking:
                example = next((row["error"] for row in lacking if row.get("error")), None)
                why = f"no column {key!r} in {len(lacking)} of its {len(rows)} rows"
                return Missing(display_path(path), why + (f"; one says: {str(example)[:160]}" if example else ""))
        return None


def _unique(values) -> list[str]:
    return list(dict.fromkeys(str(v) for v in values if v not in (None, "")))


def environment_line(rows: list[dict[str, Any]]) -> str | None:
    """Where and when ``rows`` were measured: devices, software versions, dates and commits, in one line."""
    envs = [row.get("env") or {} for row in rows]
    if not envs:
        return None
    devices = _unique(env.get("device") or row.get("device") or row.get("gpu") for env, row in zip(envs, rows))
    parts = [", ".join(devices) or "unknown device"]
    for label, key in (("torch", "torch"), ("Triton", "triton"), ("CUDA", "cuda")):
        versions = _unique(env.get(key) for env in envs)
        if versions:
            parts.append(f"{label} {', '.join(versions)}")
    dates = sorted(_unique(str(env.get("date", ""))[:10] for env in envs))
    if dates:
        parts.append(dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}")
    commits = _unique(str(env.get("commit", ""))[:7] for env in envs if env.get("commit") not in (None, "unknown"))
    if commits:
        parts.append(f"commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}")
    return " · ".join(parts)


def row_date(row: dict[str, Any]) -> str:
    """The day a row was measured (its environment's date), or "?"."""
    return str((row.get("env") or {}).get("date", ""))[:10] or "?"


def row_commit(row: dict[str, Any]) -> str:
    """The commit a row was measured at (its first seven characters), or "?"."""
    return str((row.get("env") or {}).get("commit") or row.get("git_commit") or "?")[:7]


def measured_at(row: dict[str, Any]) -> str:
    """``commit 8224ee2, 2026-11-22``: the code and the day of a row."""
    return f"commit {row_commit(row)}, {row_date(row)}"
