"""The process-group helpers every distributed test relies on: spawn, its rendezvous and time-outs."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cs336_systems.parallel.distributed import spawn


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


def test_spawn_runs_a_collective():
    results = mp.get_context("spawn").SimpleQueue()
    spawn(_all_reduce_ranks, 2, results)
    got = sorted(results.get() for _ in range(2))
    assert got == [(0, 3.0, 2), (1, 3.0, 2)]
    spawn(_all_reduce_ranks, 3, results)  # a second group right after the first, three ranks
    assert sorted(results.get() for _ in range(3)) == [(0, 6.0, 3), (1, 6.0, 3), (2, 6.0, 3)]


def test_spawn_fails_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises((TimeoutError, mp.ProcessRaisedException)):
        spawn(_hang_on_rank_one, 2, timeout_s=6)
    assert time.monotonic() - start < 60


def test_spawn_reports_a_failing_rank():
    with pytest.raises(mp.ProcessRaisedException, match="on purpose"):
        spawn(_raise_on_rank_zero, 2)
