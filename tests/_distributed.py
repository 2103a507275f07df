"""The one harness of the distributed tests: run named checks on N spawned ranks, then assert each check's outcome.

``run_checks(checks, world_size, backend=..., timeout_s=...)`` spawns ``world_size`` processes (gloo on CPU by
default; the ranks meet through a file-backed store, and a hung collective fails after ``timeout_s``), and runs
every check ``check(rank, world_size, device)`` in order on every rank. A check returns None, or a reason to skip;
its outcome on each rank (``ok``, ``skip: why`` or the traceback) is written after each check, so a crash or a hang
later keeps what finished. :func:`assert_passed` turns one check's outcomes into a pass, a skip or a failure naming
the rank; :func:`assert_all_passed` does it for every check of a run.

Every spawn costs seconds of imports: a test module runs all its checks in one spawn per configuration (a
module-scoped fixture) and asserts each in its own test, or loops inside one check.
"""

from __future__ import annotations

import json
import tempfile
import traceback
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cs336_systems.parallel.distributed import spawn

Check = Callable[[int, int, torch.device], "str | None"]  # (rank, world_size, device) -> None or why it skipped


def current_device() -> torch.device:
    """This rank's device: its GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gpu_world_size() -> int:
    """Ranks for the NCCL tests: 4 when this host has 4 GPUs, else 2."""
    return 4 if torch.cuda.device_count() >= 4 else 2


def _run_on_rank(rank: int, world_size: int, checks: Mapping[str, Check], out_dir: str, warnings_as_errors: bool):
    if warnings_as_errors:
        warnings.simplefilter("error")
    torch.set_num_threads(1)  # the ranks share the host's cores
    device = current_device()
    outcomes = {}
    for name, check in checks.items():
        try:
            skipped = check(rank, world_size, device)
            outcomes[name] = f"skip: {skipped}" if skipped else "ok"
        except Exception:  # noqa: BLE001  (recorded for this check's own assertion; the next checks still run)
            outcomes[name] = f"rank {rank}/{world_size}:\n{traceback.format_exc()}"
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(outcomes))


def run_checks(checks: Mapping[str, Check], world_size: int = 2, backend: str = "gloo", timeout_s: float = 180.0,
               warnings_as_errors: bool = False) -> dict[str, list[str]]:
    """Each check's outcome on every rank, by check name (a spawn that failed or hung stands in for the checks it
    never reached). ``checks`` must be picklable: module-level functions, or ``functools.partial`` of them."""
    with tempfile.TemporaryDirectory(prefix="cs336-checks-") as out_dir:
        try:
            spawn(_run_on_rank, world_size, checks, out_dir, warnings_as_errors, backend=backend, timeout_s=timeout_s)
            spawn_error = None
        except Exception as error:  # noqa: BLE001  (a timeout or a crash: reported by the checks it cut short)
            spawn_error = f"the spawned ranks failed: {type(error).__name__}: {error}"
        per_rank = [json.loads(path.read_text()) for path in sorted(Path(out_dir).glob("rank*.json"))]
    missing = spawn_error or "never ran"
    return {name: [outcomes.get(name, missing) for outcomes in per_rank] or [missing] for name in checks}


def assert_passed(outcomes: list[str]) -> None:
    """Fail with the first failing rank's traceback; skip if the check skipped; else pass."""
    failed = [outcome for outcome in outcomes if outcome != "ok" and not outcome.startswith("skip: ")]
    if failed:
        pytest.fail(failed[0], pytrace=False)
    if any(outcome.startswith("skip: ") for outcome in outcomes):
        pytest.skip(outcomes[0].removeprefix("skip: "))


def assert_all_passed(outcomes: Mapping[str, list[str]]) -> None:
    """Every check passed (or skipped) on every rank; else fail naming the first failing check."""
    for name, per_rank in outcomes.items():
        failed = [outcome for outcome in per_rank if outcome != "ok" and not outcome.startswith("skip: ")]
        if failed:
            pytest.fail(f"{name}: {failed[0]}", pytrace=False)
