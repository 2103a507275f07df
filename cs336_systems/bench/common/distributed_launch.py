"""Running a benchmark on several processes: under ``torchrun``, or spawning one rank per GPU itself.

Every multi-process benchmark is a function ``worker(rank, world_size, args)`` run on every rank.
:func:`launch` runs it either way:

* ``torchrun --nproc_per_node=2 -m cs336_systems.bench.<problem> ...``: this process is one rank; it
  joins the group that torchrun describes (works across nodes unchanged);
* ``python -m cs336_systems.bench.<problem> ...``: this process spawns the ranks (NCCL with one GPU per
  rank when there are enough GPUs, else gloo on CPU processes, saying so).

Only rank 0 reads and writes results: it decides what is still to measure and tells the others
(:func:`from_rank0`), and rank-local timings reach it through :func:`gather`.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.bench.common import model_sizes, result_store
from cs336_systems.parallel.distributed import cleanup, init_from_env, spawn


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def is_rank0_process() -> bool:
    """Whether this process prints and writes: always when it spawns the ranks, rank 0's under torchrun."""
    return not under_torchrun() or int(os.environ["RANK"]) == 0


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(world_size: int) -> tuple[str, str]:
    """``nccl`` when each of ``world_size`` ranks can have its own GPU here, else ``gloo``; and why."""
    if under_torchrun():
        world_size = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else world_size
    gpus = gpu_count()
    if gpus >= world_size and dist.is_nccl_available():
        return "nccl", f"{gpus} GPU(s), one per rank"
    return "gloo", f"{gpus} GPU(s) for {world_size} ranks: gloo on CPU processes"


def launch(worker: Callable[..., None], world_size: int, *args: Any, backend: str, timeout_s: float) -> None:
    """Run ``worker(rank, world_size, *args)`` on every rank: in this process under torchrun, else spawned.

    Under torchrun the world size is torchrun's (``world_size`` is ignored, with a note if it differs).
    """
    if under_torchrun():
        rank, torchrun_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if torchrun_world != world_size and rank == 0:
            print(f"# torchrun: world size {torchrun_world} (not {world_size})", file=sys.stderr)
        init_from_env(backend, timeout_s=timeout_s)
        try:
            _run_worker(rank, torchrun_world, worker, *args)
        finally:
            cleanup()
    else:
        spawn(_run_worker, world_size, worker, *args, backend=backend, timeout_s=timeout_s)


def _run_worker(rank: int, world_size: int, worker: Callable[..., None], *args: Any) -> None:
    if dist.get_backend() == "gloo":
        # CPU ranks share the host's cores; each taking all of them oversubscribes it many times over.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    worker(rank, world_size, *args)


def rank_device() -> torch.device:
    """This rank's device: its GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def least_free_bytes(device: torch.device) -> float:
    """The least free memory of the ranks' devices, on every rank: the GPU's (``torch.cuda.mem_get_info``), or on
    CPU ranks the host's available memory."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return float(min(gather(free)))


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (what rank 0 decided: e.g. the cases left to measure)."""
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank of ``group``."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def mean_over_ranks(per_rank: list[list[float]]) -> list[float]:
    """Element-wise mean of equally long per-rank lists: ``[mean over ranks of step i for each i]``."""
    return [statistics.fmean(values) for values in zip(*per_rank, strict=True)]


def launch_lm_benchmark(problem: str, worker: Callable[..., None], args: Any,
                        wanted_cases: Callable[[Any, int], list[dict[str, Any]]],
                        isolate: Callable[[Any], list[Any]] | None = None) -> None:
    """The entry of a distributed language-model benchmark: choose the world size and backend, fill in the
    model defaults (the edition's xl, context 512, 4 sequences per rank under NCCL; the tiny model otherwise), and
    launch ``worker(args)`` on every rank unless every case of ``wanted_cases(args, world_size)`` is measured.

    ``args`` needs ``quick``, ``world_size``, ``edition``, ``size``, ``context_length``, ``batch_size``,
    ``warmup``, ``steps``, ``results_dir``, ``force`` and ``timeout_s``.

    ``isolate(args)`` splits the work into parts (copies of ``args`` asking for one variant each) that are
    launched one after another, each on freshly spawned ranks, so that no variant measures memory or time
    another one left behind (seen: optimizer or DDP variants run after others in one process showed gigabytes
    of their predecessors' allocations and 1.5x their isolated step times). Under ``torchrun`` the ranks cannot
    be respawned: every part runs in the same processes, one after another.
    """
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size
    backend, reason = choose_backend(world_size)
    tiny = args.quick or backend != "nccl"
    if is_rank0_process():
        print(f"# {world_size} ranks, {backend}: {reason}" + ("; tiny model" if tiny else ""), file=sys.stderr)
        if args.quick:
            print("# --quick: smoke-test configuration", file=sys.stderr)
    args.size = args.size or ("tiny" if tiny else model_sizes.canonical_size("xl", args.edition))
    args.context_length = args.context_length or (32 if tiny else 512)
    args.batch_size = args.batch_size or (2 if tiny else 4)
    if args.quick:
        args.warmup, args.steps = 1, 2
    parts = isolate(args) if isolate is not None and not under_torchrun() else [args]
    for part in parts:
        store = result_store.ResultStore(problem, part.results_dir, part.force, edition=part.edition)
        if not store.pending(wanted_cases(part, world_size)):
            continue  # the store said so
        launch(worker, world_size, part, backend=backend, timeout_s=part.timeout_s)
