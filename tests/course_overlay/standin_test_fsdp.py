"""Stand-in for the course's 2026 ``tests/test_fsdp.py``: FSDP trains like one process, its full parameters
gathered by name."""

import copy

import torch
from torch import Tensor, nn

from .adapters import fsdp_gather_full_params, fsdp_on_after_backward, get_fsdp
from .common import rank_slice, run_on_ranks, step_beside_reference


class TokenModel(nn.Module):
    """``(batch, seq)`` token ids -> ``(batch, 3)`` logits."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.embedding(tokens).mean(dim=1))


def _check(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = TokenModel()
    reference = copy.deepcopy(model)
    fsdp_model = get_fsdp(model)
    optimizer = torch.optim.SGD(fsdp_model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, 10, (8, 4), generator=generator)
        labels = torch.randint(0, 3, (8,), generator=generator)
        step_beside_reference((fsdp_model, optimizer), (reference, reference_optimizer), tokens, labels,
                              rank_slice(rank, world_size, len(tokens)), fsdp_on_after_backward)
    full = fsdp_gather_full_params(fsdp_model)
    for name, expected in reference.named_parameters():
        torch.testing.assert_close(full[name], expected)


def test_fsdp(world_size):
    run_on_ranks(_check, world_size)
