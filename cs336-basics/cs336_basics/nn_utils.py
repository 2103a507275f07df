"""Numerically stable softmax and cross-entropy, and gradient clipping."""

from __future__ import annotations

from typing import Iterable

import torch
from jaxtyping import Float, Int
from torch import Tensor


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """``exp(x) / sum(exp(x))`` along ``dim``, shifted by the maximum so large inputs do not overflow."""
    shifted = x - x.amax(dim=dim, keepdim=True)
    exp = shifted.exp()
    return exp / exp.sum(dim=dim, keepdim=True)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """``x - logsumexp(x)`` along ``dim``, computed stably."""
    shifted = x - x.amax(dim=dim, keepdim=True)
    return shifted - shifted.exp().sum(dim=dim, keepdim=True).log()


def cross_entropy(logits: Float[Tensor, "... vocab"], targets: Int[Tensor, "..."]) -> Float[Tensor, ""]:
    """Mean over all leading positions of ``-log softmax(logits)[target]``."""
    log_probs = log_softmax(logits, dim=-1)
    return -log_probs.gather(-1, targets.unsqueeze(-1)).mean()


def clip_gradient(parameters: Iterable[torch.nn.Parameter], max_l2_norm: float, eps: float = 1e-6) -> None:
    """Scale all gradients in place so that their combined L2 norm is at most ``max_l2_norm``."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    total_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    if total_norm > max_l2_norm:
        scale = max_l2_norm / (total_norm + eps)
        for g in grads:
            g.mul_(scale.to(g.dtype))
