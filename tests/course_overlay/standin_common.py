"""Stand-in for the course's ``tests/common.py``: what its test files share (a toy model, the batch in
``fixtures/``, ranks joined in a gloo process group)."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

FIXTURES_PATH = Path(__file__).resolve().parent / "fixtures"


class ToyModel(nn.Module):
    """``(batch, 5) -> (batch, 3)`` logits, with a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 8, bias=False)
        self.fc2 = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.full((3,), 2.0), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def toy_batch() -> tuple[Tensor, Tensor]:
    """``(8, 5)`` inputs and ``(8,)`` class labels."""
    rows = np.loadtxt(FIXTURES_PATH / "toy_batch.csv", delimiter=",")
    return torch.tensor(rows[:, :5], dtype=torch.float32), torch.tensor(rows[:, 5], dtype=torch.long)


def rank_slice(rank: int, world_size: int, batch_size: int) -> slice:
    share = batch_size // world_size
    return slice(rank * share, (rank + 1) * share)


def run_on_ranks(fn: Callable[[int, int], None], world_size: int, timeout_s: float = 120.0) -> None:
    """``fn(rank, world_size)`` in ``world_size`` forked processes joined in a gloo process group; a rank that
    raises fails the call with its traceback."""
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        context = mp.start_processes(_on_rank, args=(fn, world_size, store), nprocs=world_size, join=False,
                                     start_method="fork")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"the ranks did not finish in {timeout_s:.0f} s")


def _on_rank(rank: int, fn: Callable[[int, int], None], world_size: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size)
    finally:
        dist.destroy_process_group()


def step_beside_reference(wrapped: tuple[nn.Module, torch.optim.Optimizer],
                          reference: tuple[nn.Module, torch.optim.Optimizer], inputs: Tensor, labels: Tensor,
                          mine: slice, after_backward: Callable) -> None:
    """One cross-entropy step of the wrapped model on this rank's rows ``mine`` of the batch (``after_backward``
    between its backward and its optimizer step), and one of the reference model on the whole batch."""
    model, optimizer = wrapped
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(inputs[mine]), labels[mine]).backward()
    after_backward(model, optimizer)
    optimizer.step()
    model, optimizer = reference
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(inputs), labels).backward()
    optimizer.step()


def check_ddp_trains_like_one_process(rank: int, world_size: int, wrap: Callable[[nn.Module], nn.Module],
                                      after_backward: Callable, batch_start: Callable | None = None) -> None:
    """Each rank starts from its own weights and trains on its share of the batch; after the wrapper's broadcast
    and every step, the weights equal one process's trained on the whole batch."""
    torch.manual_seed(rank)
    ddp_model = wrap(ToyModel())
    torch.manual_seed(0)
    reference = ToyModel()
    for param, expected in zip(ddp_model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=0, atol=0)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    inputs, labels = toy_batch()
    mine = rank_slice(rank, world_size, len(inputs))
    for _ in range(3):
        if batch_start is not None:
            batch_start(ddp_model, optimizer)
        step_beside_reference((ddp_model, optimizer), (reference, reference_optimizer), inputs, labels, mine,
                              after_backward)
        for param, expected in zip(ddp_model.parameters(), reference.parameters()):
            torch.testing.assert_close(param, expected)
