"""The process-group helpers every distributed test relies on: spawn, its rendezvous and time-outs; the tests'
harness (``tests/_distributed.py``); ``init_from_env`` outside torchrun."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cs336_systems.parallel.distributed import init_from_env, spawn
from tests._distributed import assert_all_passed, run_checks


def _all_reduce_ranks(rank: int, world_size: int, results) -> None:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    results.put((rank, t.item(), dist.get_world_size()))


def _hang_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(600)
    dist.barrier()


def _raise_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        raise RuntimeError("rank zero failed on purpose")


@pytest.mark.slow  # spawns ranks: 5-20 s on two cores
def test_spawn_runs_a_collective():
    results = mp.get_context("spawn").SimpleQueue()
    spawn(_all_reduce_ranks, 2, results)
    got = sorted(results.get() for _ in range(2))
    assert got == [(0, 3.0, 2), (1, 3.0, 2)]
    spawn(_all_reduce_ranks, 3, results)  # a second group right after the first, three ranks
    assert sorted(results.get() for _ in range(3)) == [(0, 6.0, 3), (1, 6.0, 3), (2, 6.0, 3)]


@pytest.mark.slow  # spawns ranks: 5-20 s on two cores
def test_spawn_fails_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises((TimeoutError, mp.ProcessRaisedException)):
        spawn(_hang_on_rank_one, 2, timeout_s=6)
    assert time.monotonic() - start < 60


@pytest.mark.slow  # spawns ranks: 5-20 s on two cores
def test_spawn_reports_a_failing_rank():
    with pytest.raises(mp.ProcessRaisedException, match="on purpose"):
        spawn(_raise_on_rank_zero, 2)


def _sums_ranks(rank: int, world_size: int, device: torch.device) -> None:
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2


def _fails_on_rank_one(rank: int, world_size: int, device: torch.device) -> None:
    assert rank != 1, "rank one fails on purpose"


def _skips(rank: int, world_size: int, device: torch.device) -> str:
    return "nothing to do here"


@pytest.mark.slow  # spawns ranks: 5-20 s on two cores
def test_run_checks_reports_each_check_on_each_rank():
    outcomes = run_checks({"sums": _sums_ranks, "fails": _fails_on_rank_one, "skips": _skips}, 2, timeout_s=60)
    assert outcomes["sums"] == ["ok", "ok"] and outcomes["skips"] == ["skip: nothing to do here"] * 2
    assert outcomes["fails"][0] == "ok" and "rank 1/2" in outcomes["fails"][1]
    assert "rank one fails on purpose" in outcomes["fails"][1]
    assert_all_passed({"sums": outcomes["sums"], "skips": outcomes["skips"]})
    with pytest.raises(pytest.fail.Exception, match="fails: rank 1/2"):
        assert_all_passed(outcomes)


def test_init_from_env_outside_torchrun_says_how_to_launch(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"RANK, WORLD_SIZE, MASTER_PORT are not set: launch with `torchrun "
                                           r"--nproc_per_node=N"):
        init_from_env()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="MASTER_PORT is not set"):
        init_from_env()
