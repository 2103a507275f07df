"""Process-group set-up shared by the distributed code, its tests and its benchmarks.

Two ways in:

* ``torchrun --nproc_per_node=N script.py``: the script calls :func:`init_from_env`, which reads the
  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` variables torchrun sets.
* tests and single-command benchmarks: :func:`spawn` starts ``world_size`` processes with
  ``torch.multiprocessing``, joined through a file-backed store, and fails with ``TimeoutError``
  (instead of hanging) when a collective never completes; :func:`one_rank_group` makes this process the only
  rank of a group, with no spawn.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast (NVLS) can take a shared host's GPUs out of service; keep it off everywhere.
_SAFE_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def default_backend() -> str:
    """``nccl`` when every rank can have its own GPU, ``gloo`` otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def require_process_group(who: str) -> None:
    """Raise, naming the fix, unless a default process group is initialised (what ``who`` needs)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{who} needs an initialised default process group: call torch.distributed.init_process_group(...) first "
            "(or cs336_systems.parallel.distributed.init_from_env() under torchrun)"
        )


def setup_process_group(
    rank: int,
    world_size: int,
    backend: str = "gloo",
    port: int | None = None,
    timeout_s: float = 120.0,
    store: dist.Store | None = None,
    local_rank: int | None = None,
) -> torch.device:
    """Join a process group and return this rank's device (under NCCL, GPU ``local_rank`` of this host).

    The ranks meet through ``store`` when given, else at ``MASTER_ADDR:port`` (``MASTER_PORT`` when
    ``port`` is None; ``MASTER_ADDR`` defaults to localhost). ``local_rank`` defaults to ``rank`` (one host).
    """
    for key, value in _SAFE_NCCL_ENV.items():
        os.environ.setdefault(key, value)
    if store is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if port is not None:
            os.environ["MASTER_PORT"] = str(port)
        if "MASTER_PORT" not in os.environ:
            raise ValueError("no port: pass port= or set MASTER_PORT")
    if backend == "nccl":
        # One host: every rank needs its GPU here. Several hosts (torchrun): this host's ranks do.
        gpus_needed = world_size if local_rank is None else local_rank + 1
        if torch.cuda.device_count() < gpus_needed:
            raise ValueError(
                f"nccl needs one GPU per rank: world_size={world_size}, local rank {local_rank}, "
                f"GPUs={torch.cuda.device_count()}"
            )
        device = torch.device("cuda", rank if local_rank is None else local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
        store=store,
    )
    return device


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_PORT")  # torchrun sets them (MASTER_ADDR defaults to localhost)


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> torch.device:
    """Join the process group described by torchrun's environment variables (one GPU per local rank)."""
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_from_env() reads the process group from torchrun's environment, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: launch with "
            "`torchrun --nproc_per_node=N your_script.py ...`, or start the ranks in one command with "
            "cs336_systems.parallel.distributed.spawn(fn, world_size)"
        )
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return setup_process_group(
        rank, world_size, backend or default_backend(), timeout_s=timeout_s, local_rank=local_rank
    )


def cleanup() -> None:
    """Leave the process group if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_group(backend: str = "gloo") -> Iterator[torch.device]:
    """This process as the only rank of the default process group (a file store: no port to find), left on exit;
    yields the rank's device (GPU 0 under NCCL)."""
    with tempfile.TemporaryDirectory(prefix="cs336-one-rank-") as folder:
        device = setup_process_group(0, 1, backend, store=dist.FileStore(os.path.join(folder, "store"), 1))
        try:
            yield device
        finally:
            cleanup()


@torch.no_grad()
def broadcast_in_place(tensors_and_sources: Iterable[tuple[torch.Tensor, int]]) -> None:
    """Overwrite each tensor with its source rank's values: all broadcasts in flight at once, then wait.

    NCCL needs contiguous memory, so a non-contiguous tensor travels through a contiguous copy.
    """
    pending = []
    for tensor, src in tensors_and_sources:
        wire = tensor if tensor.is_contiguous() else tensor.contiguous()
        pending.append((tensor, wire, dist.broadcast(wire, src=src, async_op=True)))
    for tensor, wire, work in pending:
        work.wait()
        if wire is not tensor:
            tensor.copy_(wire)


def broadcast_module_state(module: torch.nn.Module, src: int = 0) -> None:
    """Overwrite every parameter and buffer of ``module`` with rank ``src``'s values, in place.

    Frozen parameters are included: they never change afterwards, so every rank must start from the
    same values.
    """
    broadcast_in_place((tensor, src) for tensor in [*module.parameters(), *module.buffers()])


def _run_rank(
    rank: int, fn: Callable[..., Any], world_size: int, backend: str, store_path: str, timeout_s: float, args
):
    faulthandler.enable()  # a rank that dies in native code still shows where its Python was
    store = dist.FileStore(store_path, world_size)
    setup_process_group(rank, world_size, backend, timeout_s=timeout_s, store=store)
    try:
        fn(rank, world_size, *args)
    finally:
        cleanup()
    # The rank's work is done and checked. Skip interpreter finalization: there, torch 2.11's native
    # teardown sometimes aborts a finished gloo rank ("terminate called without an active exception",
    # no Python frame; seen in about 1 of 12 spawns on a 2-core machine), which would fail a passing test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout_s: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in a process group.

    ``fn`` must be picklable (defined at module level). A rank that raises fails the call with its
    traceback; ranks still running after ``timeout_s`` seconds (a hung collective) are killed and
    ``TimeoutError`` is raised.

    The ranks meet through a file-backed store in a fresh temporary folder rather than at a TCP port:
    a port chosen free can be taken by another process before rank 0 binds it.
    """
    with tempfile.TemporaryDirectory(prefix="cs336-rendezvous-") as folder:
        _spawn_and_wait(fn, world_size, args, backend, os.path.join(folder, "store"), timeout_s)


def _spawn_and_wait(fn, world_size: int, args, backend: str, store_path: str, timeout_s: float) -> None:
    context = mp.spawn(
        _run_rank, args=(fn, world_size, backend, store_path, timeout_s, args), nprocs=world_size, join=False
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join()
            raise TimeoutError(f"distributed run of {fn.__name__} did not finish in {timeout_s:.0f} s")
