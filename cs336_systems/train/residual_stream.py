"""Transformer blocks whose residual adds run inside the norms that read the sums (the ``fused_residual_norm``
part of a training step).

``cs336_basics``' pre-norm block adds each branch to the residual stream and then normalises the sum::

    x = x + attn(ln1(x))
    x = x + ffn(ln2(x))
    ...                                      (every block; then ln_final(x) feeds the LM head)

Every norm but the first reads the sum just written. Here a block takes the residual stream and the branch output
not yet added to it (``pending``, None before the first block) and returns the same pair, so that each "add, then
normalise" is one :class:`cs336_systems.kernels.residual_rmsnorm.FusedAddRMSNorm` call (one kernel writes the sum
and its norm; one backward kernel adds the stream's gradient to the norm's)::

    x, h = ln1(pending, residual)            (x = residual + pending; h = ln1(x))
    x, h = ln2(attn(h), x)
    return x, ffn(h)                         (the next block's residual and pending)

and the last block's pending output is added by ``ln_final``. The values are the plain model's: the sum is
rounded as torch's add of the two dtypes would (a bf16 branch onto a float32 stream gives float32), the norm's
statistics are float32 as in the fused RMSNorm, and its output is written in the autocast dtype as there.

The block's forward is replaced on the instance (its modules, parameters and state-dict names stay), so a block is
still called as a module: sharding wrappers' hooks, ``torch.compile`` of a block and checkpointing see one call
per block, now with two tensors in and out.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from cs336_basics.model import BasicsTransformerLM, TransformerBlock

BlockGroup = tuple[Sequence[nn.Module], dict | None]
"""Consecutive blocks and the ``torch.utils.checkpoint`` options they run under together (None: not checkpointed)."""


def pending_residual_forward(
    block: TransformerBlock, residual: Float[Tensor, "batch seq d_model"],
    pending: Float[Tensor, "batch seq d_model"] | None,
) -> tuple[Float[Tensor, "batch seq d_model"], Float[Tensor, "batch seq d_model"]]:
    """One block on the stream ``residual + pending`` (``pending`` None: the stream is ``residual``): the stream
    after its attention branch, and its feed-forward branch's output, not yet added."""
    if pending is None:
        x, h = residual, block.ln1(residual)
    else:
        x, h = block.ln1(pending, residual)
    x, h = block.ln2(block.attn(h), x)
    return x, block.ffn(h)


def use_fused_residual_norm(model: BasicsTransformerLM, autocast_output: bool = True) -> BasicsTransformerLM:
    """Make ``model``'s norms :class:`FusedAddRMSNorm` (sharing their weights; ``autocast_output`` as
    ``FusedRMSNorm``'s) and each block's forward :func:`pending_residual_forward`, in place. The model's hidden
    states are then :func:`hidden_states_with_fused_residual_norm`'s (its own ``hidden_states`` passes one tensor
    between blocks). Returns ``model``."""
    from cs336_systems.kernels.residual_rmsnorm import FusedAddRMSNorm
    from cs336_systems.kernels.rmsnorm import use_fused_rmsnorm

    use_fused_rmsnorm(model, autocast_output=autocast_output, norm_class=FusedAddRMSNorm)
    for block in model.layers:
        block.forward = types.MethodType(pending_residual_forward, block)
    return model


def block_groups(model: BasicsTransformerLM, block_modes: tuple[str, ...], options_of_mode) -> list[BlockGroup]:
    """One group per block of ``model``, under ``options_of_mode(mode)`` of its mode in ``block_modes``."""
    return [(model.layers[index:index + 1], options_of_mode(mode)) for index, mode in enumerate(block_modes)]


def run_blocks(blocks: Sequence[nn.Module], residual: Tensor, pending: Tensor | None) -> tuple[Tensor, Tensor | None]:
    for block in blocks:
        residual, pending = block(residual, pending)
    return residual, pending


def hidden_states_with_fused_residual_norm(
    model: BasicsTransformerLM, token_ids: Int[Tensor, "batch seq"], groups: list[BlockGroup]
) -> Float[Tensor, "batch seq d_model"]:
    """``model.hidden_states(token_ids)`` of a model set up by :func:`use_fused_residual_norm`, its blocks run in
    ``groups`` (:func:`block_groups`), each checkpointed as its options say."""
    if token_ids.shape[-1] > model.context_length:
        raise ValueError(f"sequence length {token_ids.shape[-1]} exceeds context_length {model.context_length}")
    residual, pending = model.token_embeddings(token_ids), None
    for blocks, options in groups:
        if options is None or not torch.is_grad_enabled():
            residual, pending = run_blocks(blocks, residual, pending)
        else:
            residual, pending = checkpoint(run_blocks, blocks, residual, pending, use_reentrant=False, **options)
    if pending is None:  # no blocks
        return model.ln_final(residual)
    return model.ln_final(pending, residual)[1]
