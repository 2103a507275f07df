"""Attention implementations by name, each with the model's protocol ``fn(Q, K, V, is_causal) -> O``
on tensors of shape ``(batch, heads, seq, d_head)``, so that benchmarks and the model can switch
between them (``BasicsTransformerLM(..., attention_fn=fn)`` or ``model.set_attention(fn)``):

| name | what |
|---|---|
| ``naive`` | the model's own ``scaled_dot_product_attention`` with a causal mask |
| ``compiled`` | ``torch.compile`` of ``naive`` |
| ``annotated`` | ``naive`` with NVTX ranges around scores, softmax and the final matmul |
| ``flash_pytorch`` | the tiled PyTorch FlashAttention-2 (slow; a readable reference) |
| ``triton`` | the Triton FlashAttention-2 |
| ``sdpa`` | PyTorch's fused ``torch.nn.functional.scaled_dot_product_attention`` (the competitor) |

Every function takes ``is_causal`` with the default True: the model's protocol is causal attention (the
autograd Functions' ``apply(Q, K, V, is_causal=False)`` keep the grader's signature).

Modules are imported on first use, so that asking for ``naive`` never imports Triton.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

AttentionFn = Callable[[Tensor, Tensor, Tensor, bool], Tensor]

ATTENTION_NAMES = ("naive", "compiled", "annotated", "flash_pytorch", "triton", "sdpa")


def _naive() -> AttentionFn:
    from cs336_basics.model import causal_attention

    return causal_attention


def _annotated() -> AttentionFn:
    from cs336_systems.attention.reference import annotated_attention

    return annotated_attention


def _flash_pytorch() -> AttentionFn:
    from cs336_systems.attention.flash_pytorch import FlashAttention2PyTorch

    def flash_pytorch_attention(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool = True) -> Tensor:
        return FlashAttention2PyTorch.apply(Q, K, V, is_causal)

    return flash_pytorch_attention


def _triton() -> AttentionFn:
    from cs336_systems.attention.op import flash_attention

    return flash_attention


def _sdpa() -> AttentionFn:
    def sdpa_attention(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool = True) -> Tensor:
        return torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=is_causal)

    return sdpa_attention


@functools.cache
def _compiled() -> AttentionFn:
    # One compiled function per process, so that every model layer shares its compiled graphs.
    return torch.compile(_naive())


_FACTORIES: dict[str, Callable[[], AttentionFn]] = {
    "naive": _naive,
    "compiled": _compiled,
    "annotated": _annotated,
    "flash_pytorch": _flash_pytorch,
    "triton": _triton,
    "sdpa": _sdpa,
}


def get_attention(name: str) -> AttentionFn:
    """The attention implementation called ``name``, one of :data:`ATTENTION_NAMES`."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of {', '.join(ATTENTION_NAMES)}")
    return _FACTORIES[name]()
