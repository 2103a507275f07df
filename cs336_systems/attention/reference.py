"""Plain PyTorch attention: the reference that FlashAttention-2 is checked against, and an
NVTX-annotated attention for profiling (SPEC sections 2.2 and 3).

Both work on inputs of any leading shape ``(..., seq, d)``. The causal rule is the one the grader
uses: query ``i`` may attend key ``j`` only if ``i >= j`` (absolute indices, also when
``n_queries != n_keys``), and the scores it may not see are set to ``-1e6`` before the softmax.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from cs336_basics.nn_utils import softmax

CAUSAL_MASK_VALUE = -1e6
"""The score given to a key a query may not see (the grader's reference uses this, not -inf)."""


def causal_mask(n_queries: int, n_keys: int, device: torch.device | str | None = None) -> Bool[Tensor, "q k"]:
    """True where query ``i`` may attend key ``j``, i.e. ``i >= j``."""
    query_index = torch.arange(n_queries, device=device)[:, None]
    key_index = torch.arange(n_keys, device=device)[None, :]
    return query_index >= key_index


def reference_attention(
    Q: Float[Tensor, "... q d"], K: Float[Tensor, "... k d"], V: Float[Tensor, "... k d"], is_causal: bool = False
) -> tuple[Float[Tensor, "... q d"], Float[Tensor, "... q"]]:
    """``O = softmax(Q K^T / sqrt(d)) V`` and ``L = logsumexp`` of the scores over keys (natural log).

    Computed in the inputs' dtype, materialising the full ``(..., q, k)`` score matrix; pass float64
    inputs for a reference that is exact to the precision the tests need.
    """
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])  # (..., q, k)
    if is_causal:
        mask_value = max(CAUSAL_MASK_VALUE, torch.finfo(scores.dtype).min)  # -1e6 overflows float16
        scores = scores.masked_fill(~causal_mask(Q.shape[-2], K.shape[-2], Q.device), mask_value)
    logsumexp = torch.logsumexp(scores, dim=-1)  # (..., q)
    probabilities = torch.exp(scores - logsumexp[..., None])
    return probabilities @ V, logsumexp


def nvtx_range(message: str) -> AbstractContextManager:
    """``torch.cuda.nvtx.range(message)`` where CUDA is available, a no-op context elsewhere."""
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range(message)
    return nullcontext()


def annotated_scaled_dot_product_attention(
    Q: Float[Tensor, "... q d"], K: Float[Tensor, "... k d"], V: Float[Tensor, "... k dv"], mask: Bool[Tensor, "q k"] | None = None
) -> Float[Tensor, "... q dv"]:
    """The model's ``scaled_dot_product_attention`` with an NVTX range around each of its three steps.

    Where ``mask`` is False the score is excluded (set to -inf), as in ``cs336_basics.model``.
    Profilers (Nsight Systems, or ``torch.profiler`` through ``record_function`` ranges of the same
    names) then attribute kernel time to the scores, the softmax and the final matmul separately.
    """
    with nvtx_range("computing attention scores"), torch.profiler.record_function("computing attention scores"):
        scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
    with nvtx_range("computing softmax"), torch.profiler.record_function("computing softmax"):
        probabilities = softmax(scores, dim=-1)
    with nvtx_range("final matmul"), torch.profiler.record_function("final matmul"):
        return probabilities @ V


def annotated_attention(
    Q: Float[Tensor, "... q d"], K: Float[Tensor, "... k d"], V: Float[Tensor, "... k d"], is_causal: bool = True
) -> Float[Tensor, "... q d"]:
    """:func:`annotated_scaled_dot_product_attention` with the model's attention protocol
    ``fn(Q, K, V, is_causal) -> O``, so it can replace the model's attention (``model.set_attention``)."""
    mask = causal_mask(Q.shape[-2], K.shape[-2], Q.device) if is_causal else None
    return annotated_scaled_dot_product_attention(Q, K, V, mask)


def check_attention_inputs(Q: Tensor, K: Tensor, V: Tensor) -> None:
    """Raise a ``TypeError``/``ValueError`` naming the problem unless ``Q``, ``K``, ``V`` are valid inputs
    for the FlashAttention functions: tensors of shape ``(batch, seq, d)`` or ``(batch, heads, seq, d)``,
    on one device, of one floating dtype, with matching batch/head dims and ``d``, ``K``/``V`` of one
    length, and no empty sequence."""
    for name, tensor in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() not in (3, 4):
            raise ValueError(
                f"{name} must have shape (batch, seq, d) or (batch, heads, seq, d), got shape {tuple(tensor.shape)}"
            )
    if not Q.dim() == K.dim() == V.dim():
        raise ValueError(f"Q, K, V must have the same rank, got shapes {tuple(Q.shape)}, {tuple(K.shape)}, {tuple(V.shape)}")
    if not Q.device == K.device == V.device:
        raise ValueError(f"Q, K, V must be on one device, got {Q.device}, {K.device}, {V.device}")
    if not Q.dtype == K.dtype == V.dtype:
        raise TypeError(f"Q, K, V must have one dtype, got {Q.dtype}, {K.dtype}, {V.dtype}")
    if not Q.dtype.is_floating_point:
        raise TypeError(f"attention needs floating-point inputs, got {Q.dtype}")
    if not Q.shape[:-2] == K.shape[:-2] == V.shape[:-2]:
        raise ValueError(
            "Q, K, V must have the same batch (and head) dimensions, got "
            f"{tuple(Q.shape[:-2])}, {tuple(K.shape[:-2])}, {tuple(V.shape[:-2])}"
        )
    if not Q.shape[-1] == K.shape[-1] == V.shape[-1]:
        raise ValueError(f"Q, K, V must have the same head dimension d, got {Q.shape[-1]}, {K.shape[-1]}, {V.shape[-1]}")
    if K.shape[-2] != V.shape[-2]:
        raise ValueError(f"K and V must have the same length, got {K.shape[-2]} and {V.shape[-2]}")
    if Q.shape[-2] == 0 or K.shape[-2] == 0:
        raise ValueError(f"sequence lengths must be positive, got n_queries={Q.shape[-2]}, n_keys={K.shape[-2]}")


def check_is_causal(is_causal: object) -> bool:
    """``is_causal`` itself when it is a Python ``bool``; else a ``TypeError`` naming the value. Any truthy
    value (``"no"``, a tensor) would otherwise silently mean True. A NumPy ``bool_`` is not a ``bool``: wrap it
    in ``bool(...)``."""
    if not isinstance(is_causal, bool):
        raise TypeError(
            f"is_causal must be True or False (a Python bool), got {is_causal!r} of type {type(is_causal).__name__}; "
            "pass bool(is_causal) to convert it"
        )
    return is_causal
