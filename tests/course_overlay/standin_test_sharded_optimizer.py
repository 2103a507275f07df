"""Stand-in for the course's ``tests/test_sharded_optimizer.py``: AdamW with its state sharded over the ranks steps
like AdamW in one process."""

import copy

import torch
from torch import nn

from .adapters import get_sharded_optimizer
from .common import ToyModel, run_on_ranks, toy_batch


def _check(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = ToyModel()
    reference = copy.deepcopy(model)
    optimizer = get_sharded_optimizer(model.parameters(), torch.optim.AdamW, lr=0.1, weight_decay=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.1)
    inputs, labels = toy_batch()
    for _ in range(3):
        for net, opt in ((model, optimizer), (reference, reference_optimizer)):
            opt.zero_grad()
            nn.functional.cross_entropy(net(inputs), labels).backward()
            opt.step()
        for param, expected in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(param, expected)


def test_sharded_optimizer(world_size):
    run_on_ranks(_check, world_size)
