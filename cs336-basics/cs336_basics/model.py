"""A pre-norm Transformer language model (the model studied throughout cs336-systems).

Small modules first, the language model last. The attention kernel is pluggable: every
:class:`CausalMultiHeadSelfAttention` calls an ``attention_fn(Q, K, V, is_causal) -> O`` on tensors of
shape ``(batch, heads, seq, d_head)``. Pass one to :class:`BasicsTransformerLM` (``attention_fn=``) or
swap it later with :meth:`BasicsTransformerLM.set_attention`; the default is
:func:`causal_attention`, the plain PyTorch attention below. ``cs336_systems.attention.get_attention``
returns the compiled and FlashAttention variants with the same protocol.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn as nn
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .nn_utils import softmax


class AttentionFn(Protocol):
    def __call__(
        self, Q: Float[Tensor, "... q d"], K: Float[Tensor, "... k d"], V: Float[Tensor, "... k d"], is_causal: bool
    ) -> Float[Tensor, "... q d"]: ...


class Linear(nn.Module):
    """``y = x W^T`` without bias; ``W`` has shape ``(d_out, d_in)``, truncated-normal initialised."""

    def __init__(self, d_in: int, d_out: int, device=None, dtype=None):
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.weight = nn.Parameter(torch.empty(d_out, d_in, device=device, dtype=dtype))
        std = math.sqrt(2.0 / (d_in + d_out))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        return x @ self.weight.T

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


class Embedding(nn.Module):
    """Lookup table of shape ``(vocab_size, d_model)``, truncated-normal initialised."""

    def __init__(self, vocab_size: int, d_model: int, device=None, dtype=None):
        super().__init__()
        self.vocab_size, self.d_model = vocab_size, d_model
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model, device=device, dtype=dtype))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: Int[Tensor, "..."]) -> Float[Tensor, "... d_model"]:
        return self.weight[token_ids]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, d_model={self.d_model}"


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * g``, computed in float32 and cast back to the input dtype."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        in_dtype = x.dtype
        x = x.float()
        rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x * rms * self.weight.float()).to(in_dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE) over pairs of adjacent features, with cached cos/sin tables."""

    def __init__(self, context_length: int, dim: int, theta: float = 10000.0, device=None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE needs an even dimension, got {dim}")
        inv_freq = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)  # (dim/2,)
        angles = torch.outer(torch.arange(context_length, device=device, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)  # (context_length, dim/2)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Float[Tensor, "... seq d"], token_positions: Int[Tensor, "... seq"]) -> Float[Tensor, "... seq d"]:
        cos, sin = self.cos[token_positions], self.sin[token_positions]  # (..., seq, d/2)
        x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2).to(x.dtype)


def silu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


class SwiGLU(nn.Module):
    """``W2 (silu(W1 x) * W3 x)``."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self.w2(silu(self.w1(x)) * self.w3(x))


def scaled_dot_product_attention(
    Q: Float[Tensor, "... q d"],
    K: Float[Tensor, "... k d"],
    V: Float[Tensor, "... k dv"],
    mask: Bool[Tensor, "q k"] | None = None,
) -> Float[Tensor, "... q dv"]:
    """``softmax(Q K^T / sqrt(d)) V``; where ``mask`` is False the score is excluded."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores, dim=-1) @ V


def causal_attention(
    Q: Float[Tensor, "... q d"], K: Float[Tensor, "... k d"], V: Float[Tensor, "... k d"], is_causal: bool = True
) -> Float[Tensor, "... q d"]:
    """The default ``attention_fn``: :func:`scaled_dot_product_attention`, query i seeing keys j <= i."""
    mask = None
    if is_causal:
        n_queries, n_keys = Q.shape[-2], K.shape[-2]
        mask = torch.arange(n_queries, device=Q.device)[:, None] >= torch.arange(n_keys, device=Q.device)[None, :]
    return scaled_dot_product_attention(Q, K, V, mask)


class CausalMultiHeadSelfAttention(nn.Module):
    """Multi-head causal self-attention with optional RoPE on queries and keys."""

    def __init__(self, d_model: int, num_heads: int, positional_encoder: RotaryEmbedding | None = None,
                 attention_fn: AttentionFn | None = None, device=None, dtype=None):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.positional_encoder = positional_encoder
        self.attention_fn: AttentionFn = attention_fn or causal_attention

    def forward(
        self, x: Float[Tensor, "batch seq d_model"], token_positions: Int[Tensor, "... seq"] | None = None
    ) -> Float[Tensor, "batch seq d_model"]:
        seq = x.shape[-2]
        q, k, v = (rearrange(proj(x), "b s (h d) -> b h s d", h=self.num_heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.positional_encoder is not None:
            if token_positions is None:
                token_positions = torch.arange(seq, device=x.device)
            q = self.positional_encoder(q, token_positions)
            k = self.positional_encoder(k, token_positions)
        out = self.attention_fn(q, k, v, is_causal=True)  # (b, h, s, d)
        return self.output_proj(rearrange(out, "b h s d -> b s (h d)"))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        positional_encoder: RotaryEmbedding | None = None,
        attention_fn: AttentionFn | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.ln1 = RMSNorm(d_model, device=device, dtype=dtype)
        self.attn = CausalMultiHeadSelfAttention(d_model, num_heads, positional_encoder, attention_fn, device, dtype)
        self.ln2 = RMSNorm(d_model, device=device, dtype=dtype)
        self.ffn = SwiGLU(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Float[Tensor, "batch seq d_model"]) -> Float[Tensor, "batch seq d_model"]:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class BasicsTransformerLM(nn.Module):
    """Token ids ``(batch, seq)`` to next-token logits ``(batch, seq, vocab_size)``.

    ``attention_fn`` (default: :func:`causal_attention`) is the attention kernel every block calls.
    """

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        rope_theta: float = 10000.0,
        attention_fn: AttentionFn | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.context_length = context_length
        self.token_embeddings = Embedding(vocab_size, d_model, device=device, dtype=dtype)
        rope = RotaryEmbedding(context_length, d_model // num_heads, rope_theta, device=device)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, num_heads, d_ff, rope, attention_fn, device, dtype) for _ in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model, device=device, dtype=dtype)
        self.lm_head = Linear(d_model, vocab_size, device=device, dtype=dtype)
        self.checkpoint_group_size = 0
        self.checkpoint_context_fn: Callable | None = None

    def set_activation_checkpointing(self, group_size: int, context_fn: Callable | None = None) -> None:
        """Recompute activations in backward, in groups of ``group_size`` consecutive blocks (0: off).

        Each group runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: forward keeps
        only each group's input; backward re-runs the group's forward to rebuild what its gradients need.
        ``context_fn`` goes to ``checkpoint`` as is: with ``create_selective_checkpoint_contexts`` it keeps the
        outputs of chosen operations too, so that backward does not run them again.
        """
        if group_size < 0:
            raise ValueError(f"group_size must be >= 0, got {group_size}")
        self.checkpoint_group_size = group_size
        self.checkpoint_context_fn = context_fn

    def set_attention(self, attention_fn: AttentionFn) -> None:
        """Make every block use ``attention_fn(Q, K, V, is_causal) -> O``."""
        for layer in self.layers:
            layer.attn.attention_fn = attention_fn

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the token embedding (the LM head is counted)."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.token_embeddings.weight.numel() if non_embedding else total

    def forward(self, token_ids: Int[Tensor, "batch seq"]) -> Float[Tensor, "batch seq vocab_size"]:
        return self.lm_head(self.hidden_states(token_ids))

    def hidden_states(self, token_ids: Int[Tensor, "batch seq"]) -> Float[Tensor, "batch seq d_model"]:
        """The final normalised hidden states, the LM head's input (a fused LM head + loss starts here)."""
        if token_ids.shape[-1] > self.context_length:
            raise ValueError(f"sequence length {token_ids.shape[-1]} exceeds context_length {self.context_length}")
        x = self.token_embeddings(token_ids)
        k = self.checkpoint_group_size
        if k and torch.is_grad_enabled():
            for start in range(0, len(self.layers), k):
                options = {"context_fn": self.checkpoint_context_fn} if self.checkpoint_context_fn else {}
                x = checkpoint(_run_blocks, self.layers[start : start + k], x, use_reentrant=False, **options)
        else:
            x = _run_blocks(self.layers, x)
        return self.ln_final(x)


def _run_blocks(blocks: nn.ModuleList, x: Float[Tensor, "batch seq d_model"]) -> Float[Tensor, "batch seq d_model"]:
    for block in blocks:
        x = block(x)
    return x


MODEL_SIZES: dict[str, dict[str, int]] = {
    "small": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": dict(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": dict(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "2.7B": dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
}
"""The model sizes used throughout the assignment (vocabulary 10,000)."""
