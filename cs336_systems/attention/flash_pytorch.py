"""FlashAttention-2 in plain PyTorch: the tiled forward of Algorithm 1 and a
backward by recomputation, compiled with ``torch.compile``.

Nothing here is fast; it is the algorithm written out so that each step can be read and checked, and
the Triton kernels (``backends/triton_kernels.py``) follow the same structure tile by tile.

Forward (Dao, "FlashAttention-2", 2023, Algorithm 1), per query tile ``Q_i`` and key tiles ``K_j, V_j``::

    S_ij = Q_i K_j^T / sqrt(d)
    m_new = max(m, rowmax(S_ij));  P_ij = exp(S_ij - m_new)
    l = exp(m - m_new) l + rowsum(P_ij);  O_i = exp(m - m_new) O_i + P_ij V_j;  m = m_new
    finally O_i = O_i / l and L_i = m + log(l)

Backward (Algorithm 2, untiled: the full score matrix is recomputed from Q, K and the saved L)::

    D = rowsum(O * dO);  P = exp(S - L);  dV = P^T dO;  dP = dO V^T
    dS = P * (dP - D);  dQ = dS K / sqrt(d);  dK = dS^T Q / sqrt(d)
"""

from __future__ import annotations

import math
import sys

import torch
from jaxtyping import Float
from torch import Tensor

from cs336_systems.attention.reference import CAUSAL_MASK_VALUE


def flash_attention_forward_tiled(
    Q: Float[Tensor, "... q d"],
    K: Float[Tensor, "... k d"],
    V: Float[Tensor, "... k d"],
    is_causal: bool = False,
    query_tile_size: int = 32,
    key_tile_size: int = 32,
) -> tuple[Float[Tensor, "... q d"], Float[Tensor, "... q"]]:
    """Algorithm 1: ``O`` (in Q's dtype) and the natural-log logsumexp ``L`` (float32, or float64 for
    float64 inputs), never holding more than one ``(query_tile_size, key_tile_size)`` score tile.

    The last tile along each sequence may be shorter (lengths need not be tile multiples). With
    ``is_causal``, key tiles entirely above the diagonal are skipped, and only tiles that cross it
    are masked.
    """
    if query_tile_size < 16 or key_tile_size < 16:
        raise ValueError(f"tiles must be at least 16 x 16, got {query_tile_size} x {key_tile_size}")
    accumulate_dtype = torch.promote_types(Q.dtype, torch.float32)
    n_queries, n_keys = Q.shape[-2], K.shape[-2]
    scale = 1.0 / math.sqrt(Q.shape[-1])
    O = torch.empty_like(Q)
    L = torch.empty(Q.shape[:-1], dtype=accumulate_dtype, device=Q.device)
    for q_start in range(0, n_queries, query_tile_size):
        q_end = min(q_start + query_tile_size, n_queries)
        Q_i = Q[..., q_start:q_end, :].to(accumulate_dtype)  # (..., Bq, d)
        row_max = torch.full(Q_i.shape[:-1], -math.inf, dtype=accumulate_dtype, device=Q.device)  # m: (..., Bq)
        row_sum = torch.zeros_like(row_max)  # l: (..., Bq)
        O_i = torch.zeros_like(Q_i)  # (..., Bq, d)
        # Causal: query q_end - 1 is the last one here, so keys beyond it are never visible.
        k_stop = min(n_keys, q_end) if is_causal else n_keys
        for k_start in range(0, k_stop, key_tile_size):
            k_end = min(k_start + key_tile_size, n_keys)
            K_j = K[..., k_start:k_end, :].to(accumulate_dtype)  # (..., Bk, d)
            V_j = V[..., k_start:k_end, :].to(accumulate_dtype)
            S_ij = (Q_i @ K_j.transpose(-2, -1)) * scale  # (..., Bq, Bk)
            if is_causal and k_end - 1 > q_start:  # the tile crosses the diagonal
                query_index = torch.arange(q_start, q_end, device=Q.device)[:, None]
                key_index = torch.arange(k_start, k_end, device=Q.device)[None, :]
                S_ij = S_ij.masked_fill(query_index < key_index, CAUSAL_MASK_VALUE)
            new_row_max = torch.maximum(row_max, S_ij.amax(dim=-1))
            P_ij = torch.exp(S_ij - new_row_max[..., None])
            rescale = torch.exp(row_max - new_row_max)  # 0 on the first tile, where row_max = -inf
            row_sum = rescale * row_sum + P_ij.sum(dim=-1)
            O_i = rescale[..., None] * O_i + P_ij @ V_j
            row_max = new_row_max
        O[..., q_start:q_end, :] = (O_i / row_sum[..., None]).to(Q.dtype)
        L[..., q_start:q_end] = row_max + torch.log(row_sum)
    return O, L


def flash_attention_backward(
    Q: Float[Tensor, "batch q d"],
    K: Float[Tensor, "batch k d"],
    V: Float[Tensor, "batch k d"],
    O: Float[Tensor, "batch q d"],
    L: Float[Tensor, "batch q"],
    dO: Float[Tensor, "batch q d"],
    is_causal: bool,
) -> tuple[Float[Tensor, "batch q d"], Float[Tensor, "batch k d"], Float[Tensor, "batch k d"]]:
    """Algorithm 2 without tiling: ``dQ, dK, dV`` from the saved ``L``, recomputing ``P``.

    All inputs share one dtype (the caller upcasts), so that one compiled graph serves every input dtype.
    """
    scale = 1.0 / math.sqrt(Q.shape[-1])
    S = (Q @ K.transpose(-2, -1)) * scale  # (batch, q, k)
    if is_causal:
        query_index = torch.arange(Q.shape[-2], device=Q.device)[:, None]
        key_index = torch.arange(K.shape[-2], device=Q.device)[None, :]
        S = S.masked_fill(query_index < key_index, CAUSAL_MASK_VALUE)
    P = torch.exp(S - L[..., None])
    D = (O * dO).sum(dim=-1)  # (batch, q)
    dV = P.transpose(-2, -1) @ dO
    dP = dO @ V.transpose(-2, -1)
    dS = P * (dP - D[..., None])
    dQ = (dS @ K) * scale
    dK = (dS.transpose(-2, -1) @ Q) * scale
    return dQ, dK, dV


# Compiled on first use. dynamic=True keeps one graph across sequence lengths and batch sizes (sizes 0
# and 1 still specialise); is_causal and the dtype each give their own graph.
_compiled_backward = torch.compile(flash_attention_backward, dynamic=True)
_compile_announced = False  # the first backward on a CPU says that it compiles (it is silent for ~25 s)


def _announce_compile() -> None:
    global _compile_announced
    if not _compile_announced:
        _compile_announced = True
        print("FlashAttention2PyTorch: compiling the backward with torch.compile on the CPU (once per process, "
              "~25 s)...", file=sys.stderr, flush=True)


class FlashAttention2PyTorch(torch.autograd.Function):
    """FlashAttention-2 in PyTorch: ``FlashAttention2PyTorch.apply(Q, K, V, is_causal=False) -> O``.

    Q is ``(batch, n_queries, d)`` and K, V are ``(batch, n_keys, d)``, or all carry a heads
    dimension, ``(batch, heads, seq, d)``; O has Q's shape and dtype. Saved for backward: Q, K, V, O
    and the logsumexp L of shape ``(batch, n_queries)`` (``(batch, heads, n_queries)`` for 4-D inputs),
    float32 natural log.
    """

    query_tile_size = 32
    key_tile_size = 32

    @staticmethod
    def forward(ctx, Q: Tensor, K: Tensor, V: Tensor, is_causal: bool = False) -> Tensor:
        # The operator's checks, imported here: importing this module (the grader's adapters do) imports no Triton.
        from cs336_systems.attention.op import check_attention_inputs, check_is_causal

        check_attention_inputs(Q, K, V)
        is_causal = check_is_causal(is_causal)
        O, L = flash_attention_forward_tiled(
            Q, K, V, is_causal, FlashAttention2PyTorch.query_tile_size, FlashAttention2PyTorch.key_tile_size
        )
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO: Tensor):
        Q, K, V, O, L = ctx.saved_tensors
        compute_dtype = L.dtype  # float32, or float64 for float64 inputs
        # Every call must look alike to the compiled graph, or it recompiles: fresh contiguous copies
        # (not views, not requires_grad; dO from o.sum() has stride 0) of rank 3, (batch * heads, seq, d),
        # in the compute dtype, and no assumption that equal sizes stay equal (duck shapes off).
        q, k, v, o, do, logsumexp = (
            t.detach()
            .reshape(-1, *t.shape[-2:])
            .to(compute_dtype, memory_format=torch.contiguous_format, copy=True)
            for t in (Q, K, V, O, dO, L[..., None])
        )
        logsumexp = logsumexp[..., 0]
        if Q.device.type == "cpu":
            _announce_compile()
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            dQ, dK, dV = _compiled_backward(q, k, v, o, logsumexp, do, ctx.is_causal)
        return dQ.view(Q.shape).to(Q.dtype), dK.view(K.shape).to(K.dtype), dV.view(V.shape).to(V.dtype), None
