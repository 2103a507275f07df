"""Toy models, batches and checks shared by the DDP and sharded-optimizer tests.

Each model carries one of the cases a data-parallel wrapper must get right: frozen parameters, a
frozen bias, a buffer, a float64 parameter (buckets cannot mix dtypes), a parameter never used in the
forward pass, tied weights, and a branch some ranks skip.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FrozenPartsNet(nn.Module):
    """``fc1 -> relu -> fc2 (frozen) -> relu -> fc3 (frozen bias) -> * gain (float64)``, a buffer, an unused parameter."""

    in_features, out_features = 8, 4

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(self.in_features, 16)
        self.fc2 = nn.Linear(16, 16).requires_grad_(False)
        self.fc3 = nn.Linear(16, self.out_features)
        self.fc3.bias.requires_grad_(False)
        self.never_used = nn.Parameter(torch.randn(7))
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(self.out_features, dtype=torch.float64))
        self.register_buffer("input_scale", 0.5 + torch.rand(self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.fc2(F.relu(self.fc1(x * self.input_scale))))  # (batch, 16)
        return self.fc3(hidden).double() * self.gain  # (batch, out), float64

    @classmethod
    def batch(cls, step: int, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(batch_size, cls.in_features, generator=generator)
        y = torch.randn(batch_size, cls.out_features, generator=generator, dtype=torch.float64)
        return x.to(device), y.to(device)

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)


class TiedEmbeddingNet(nn.Module):
    """Token embedding, a mixing layer, and an output projection that shares the embedding's weight."""

    vocab_size, d_model, seq_len = 24, 12, 5

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(self.vocab_size, self.d_model)
        self.mix = nn.Linear(self.d_model, self.d_model)
        self.output = nn.Linear(self.d_model, self.vocab_size, bias=False)
        self.output.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mix(self.embedding(tokens)))  # (batch, seq, d_model)
        return self.output(hidden)  # (batch, seq, vocab)

    @classmethod
    def batch(cls, step: int, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(2000 + step)
        tokens = torch.randint(cls.vocab_size, (batch_size, cls.seq_len + 1), generator=generator)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class BranchNet(nn.Module):
    """``trunk -> (+ branch, when asked) -> head``, plus a parameter no rank uses.

    Ranks that skip the branch produce no gradient for it: the case where which parameters get a
    gradient differs between ranks.
    """

    in_features = 6

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(self.in_features, self.in_features)
        self.branch = nn.Linear(self.in_features, self.in_features)
        self.head = nn.Linear(self.in_features, 1)
        self.never_used = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        hidden = torch.tanh(self.trunk(x))  # (batch, in)
        if use_branch:
            hidden = hidden + self.branch(hidden)
        return self.head(hidden).squeeze(-1)  # (batch,)


MODELS = {"frozen_parts": FrozenPartsNet, "tied_embedding": TiedEmbeddingNet}


def build(model_cls: type[nn.Module], seed: int, device: torch.device) -> nn.Module:
    torch.manual_seed(seed)
    return model_cls().to(device)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    params = [param for param in params if param.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, where: str, **tolerance) -> None:
    """``torch.testing.assert_close`` with ``where`` in front of its message."""
    torch.testing.assert_close(actual, expected, **tolerance, msg=lambda message: f"{where}: {message}")


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], context: str, **tolerance):
    """Same names and values (exactly, unless tolerances are given)."""
    assert list(actual) == list(expected), f"{context}: names {list(actual)} != {list(expected)}"
    if not tolerance:
        tolerance = {"rtol": 0.0, "atol": 0.0}
    for name, expected_tensor in expected.items():
        assert_close(actual[name], expected_tensor, f"{context}, {name}", **tolerance)


def assert_same_parameters(model: nn.Module, reference: nn.Module, context: str, **tolerance) -> None:
    """``assert_same_tensors`` on the two models' named parameters."""
    assert_same_tensors(dict(model.named_parameters()), dict(reference.named_parameters()), context, **tolerance)
