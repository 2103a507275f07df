"""FLOP accounting of ``BasicsTransformerLM`` (MFU is these FLOPs over the time, against the measured
matmul rate of :func:`cs336_systems.bench.common.timing.measure_matmul_tflops`)."""

from __future__ import annotations


def lm_forward_flops(
    vocab_size: int, d_model: int, d_ff: int, num_layers: int, batch: int, seq: int, causal_attention: bool = False
) -> float:
    """Matmul FLOPs of one ``BasicsTransformerLM`` forward pass on ``batch x seq`` tokens.

    ``2 * tokens * (L * (4 d^2 + 3 d d_ff) + V d)`` for the weight matmuls (Q, K, V, output
    projections; SwiGLU's three matrices; the LM head) plus ``L * 4 * batch * seq^2 * d`` for
    ``Q K^T`` and ``P V`` over all heads. The naive attention computes the whole score matrix, so the
    attention term counts it all unless ``causal_attention`` (a kernel that skips masked tiles: half).
    Element-wise work (norms, softmax, RoPE, SiLU) is left out: it is a few percent at most.
    """
    weights, attention = lm_forward_flop_parts(vocab_size, d_model, d_ff, num_layers, batch, seq, causal_attention)
    return weights + attention


def lm_forward_flop_parts(
    vocab_size: int, d_model: int, d_ff: int, num_layers: int, batch: int, seq: int, causal_attention: bool = False
) -> tuple[float, float]:
    """:func:`lm_forward_flops` split into (weight matmuls, attention matmuls)."""
    tokens = batch * seq
    weights = 2 * tokens * (num_layers * (4 * d_model**2 + 3 * d_model * d_ff) + vocab_size * d_model)
    attention = num_layers * 4 * batch * seq**2 * d_model
    return weights, (attention / 2 if causal_attention else attention)


# Backward costs two matmuls per forward matmul (gradients of inputs and of weights).
FLOPS_MULTIPLIER = {"forward": 1.0, "backward": 2.0, "forward_backward": 3.0, "train_step": 3.0}
