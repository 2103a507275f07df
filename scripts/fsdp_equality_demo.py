"""Why a data-parallel gradient is not bit for bit the full-batch gradient.

With the batch split over two ranks, each rank computes the gradient of the mean loss over its half of the
sequences, and the ranks average the two: ``(g_a + g_b) / 2``. One process computes the gradient of the mean
loss over the whole batch in one backward pass, where each weight's gradient is one sum over all the tokens
that touch it, accumulated inside a single matmul (or index-put, for an embedding) in an order the kernel
chooses. The two are equal in exact arithmetic, but floating-point addition is not associative: two partial
sums, each already rounded, then added and halved, round differently from one sum over all the terms, so
many elements differ in their last bit or two (about 1e-7 relative in fp32). The difference comes from
splitting the batch, not from the communication, so every correct data-parallel implementation (DDP, ZeRO,
FSDP) shows it, and each SGD step carries it into the weights as lr times a last-bit gradient difference. A
check that compares data-parallel training with one process through ``torch.equal`` can therefore fail for a
correct implementation; it needs a tolerance (``torch.testing.assert_close``'s fp32 defaults, or rtol/atol
near 1e-6), or a reference that itself accumulates the ranks' half-batch gradients.

This script shows the effect on the course's 2026 toy setup without any process group: ``Embedding(vocab, d)
-> RMSNorm -> Linear``, a batch of 20 sequences of 8 tokens, the loss on the last token only, SGD (lr 0.01)
for 3 steps, two simulated ranks in one process (each half-batch gradient computed, then averaged) against
one process on the full batch. Per step and per parameter it prints the largest absolute difference of the
gradients and of the weights after the step, and how many elements differ bitwise.

    uv run python scripts/fsdp_equality_demo.py
    uv run python scripts/fsdp_equality_demo.py --ranks 4 --steps 5
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from cs336_basics.model import Embedding, Linear, RMSNorm
from cs336_basics.nn_utils import cross_entropy


class ToyModel(nn.Module):
    """``Embedding -> RMSNorm -> Linear``: token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``."""

    def __init__(self, vocab: int, d_model: int):
        super().__init__()
        self.embedding = Embedding(vocab, d_model)
        self.norm = RMSNorm(d_model)
        self.head = Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embedding(tokens)))


def last_token_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return cross_entropy(model(tokens)[:, -1], targets)  # logits (batch, vocab) of the last position


def gradients(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    last_token_loss(model, tokens, targets).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def data_parallel_gradients(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, ranks: int):
    """Each simulated rank's gradient on its slice of the batch, then their mean (what an AVG all-reduce or
    reduce-scatter leaves on every rank: the sum of the ranks' gradients divided by their number)."""
    per_rank = [gradients(model, x, y) for x, y in zip(tokens.chunk(ranks), targets.chunk(ranks))]
    return {name: torch.stack([g[name] for g in per_rank]).sum(0) / ranks for name in per_rank[0]}


@torch.no_grad()
def sgd_step(model: nn.Module, grads: dict[str, torch.Tensor], lr: float) -> None:
    for name, p in model.named_parameters():
        p.add_(grads[name], alpha=-lr)  # the update torch.optim.SGD makes without momentum


def differences(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Largest absolute difference, and how many elements differ bitwise."""
    return (a - b).abs().max().item(), int((a != b).sum().item())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size (default 64)")
    p.add_argument("--d-model", type=int, default=32, help="embedding width (default 32)")
    p.add_argument("--batch", type=int, default=20, help="sequences in the full batch (default 20)")
    p.add_argument("--seq", type=int, default=8, help="tokens per sequence (default 8)")
    p.add_argument("--ranks", type=int, default=2, help="simulated ranks; must divide --batch (default 2)")
    p.add_argument("--steps", type=int, default=3, help="SGD steps (default 3)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.batch % args.ranks:
        p.error(f"--ranks {args.ranks} must divide --batch {args.batch}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    single = ToyModel(args.vocab, args.d_model)  # fp32
    parallel = copy.deepcopy(single)  # the same initial weights
    print(f"{args.ranks} simulated ranks vs one process: batch {args.batch} x {args.seq} tokens, loss on the last "
          f"token, SGD lr {args.lr}, fp32")
    header = f"{'step':>4}  {'parameter':<18} {'elements':>8}  {'max |grad diff|':>15} {'grads differ':>12}  " \
             f"{'max |weight diff|':>17} {'weights differ':>14}"
    print(header)
    print("-" * len(header))
    generator = torch.Generator().manual_seed(args.seed + 1)
    for step in range(args.steps):
        tokens = torch.randint(args.vocab, (args.batch, args.seq), generator=generator)
        targets = torch.randint(args.vocab, (args.batch,), generator=generator)  # the next token after each sequence
        full_grads = gradients(single, tokens, targets)
        parallel_grads = data_parallel_gradients(parallel, tokens, targets, args.ranks)
        sgd_step(single, full_grads, args.lr)
        sgd_step(parallel, parallel_grads, args.lr)
        weights = dict(parallel.named_parameters())
        for name, p in single.named_parameters():
            grad_diff, grads_differ = differences(parallel_grads[name], full_grads[name])
            weight_diff, weights_differ = differences(weights[name].detach(), p.detach())
            print(f"{step:>4}  {name:<18} {p.numel():>8}  {grad_diff:>15.3e} {grads_differ:>12}  "
                  f"{weight_diff:>17.3e} {weights_differ:>14}")
    equal = all(torch.equal(p, q) for p, q in zip(single.parameters(), parallel.parameters()))
    print(f"torch.equal on every parameter after {args.steps} steps: {equal}")


if __name__ == "__main__":
    main()
