"""The model of the 2026 leaderboard step (problem ``leaderboard_2026``): its configuration, the matmul FLOPs
of one step by part, and the memory a rank is predicted to hold. Read by the tool, its check and the writeup."""

from __future__ import annotations

from cs336_systems.bench.common import flops
from cs336_systems.train.step import LOSS_CHUNK_TOKENS, SHARDED_STACKS

MODEL = dict(vocab_size=151_936, context_length=32_768, d_model=4096, d_ff=11_008, num_layers=34, num_heads=32)
TINY = dict(vocab_size=300, context_length=64, d_model=64, d_ff=128, num_layers=2, num_heads=4)
BATCH = 2  # sequences per step, one per rank on two ranks
# The row name of each stack of cs336_systems.train.SHARDED_STACKS: the committed rows call PyTorch's stack
# "pytorch" (and their ratio ``ours_over_pytorch``), the library calls it "torch".
ROW_NAMES = {"ours": "ours", "torch": "pytorch"}
STACK_OF_ROW = {row: stack for stack, row in ROW_NAMES.items()}
GB = 1e9


def step_flop_parts(config: dict[str, int], batch: int) -> dict[str, float]:
    """Matmul FLOPs of one training step by part (module docstring): weights 3x their forward, causal attention
    3.5x (FlashAttention's backward runs five matmuls to the forward's two)."""
    weights, attention = flops.lm_forward_flop_parts(config["vocab_size"], config["d_model"], config["d_ff"],
                                                     config["num_layers"], batch, config["context_length"],
                                                     causal_attention=True)
    return {"weights": 3 * weights, "attention": 3.5 * attention}


def step_flops(config: dict[str, int], batch: int) -> float:
    """Matmul FLOPs of one training step (:func:`step_flop_parts`, summed)."""
    return sum(step_flop_parts(config, batch).values())


def memory_budget(config: dict[str, int], stack: str, world_size: int, per_rank_batch: int = 1,
                  loss: str | None = None) -> dict[str, float]:
    """Predicted GB per rank of what the step holds, and its peak (``loss``: the loss part, by default the
    stack's in ``SHARDED_STACKS``).

    Always held: the rank's fp32 master shard and AdamW's two fp32 moments. Held from forward to the block's
    backward: the activations checkpointing keeps (each block's bf16 input, and for ``ours`` its attention
    output). Built up during backward while those drain: the fp32 gradient shard (``zero_grad`` frees it after
    the step). Transients: the loss head at the start of backward (by the stack's ``loss`` part: ``plain``, the
    full bf16 logits, their fp32 softmax and bf16 gradient; ``chunked``, the same for one chunk of tokens;
    ``fused``, the gathered bf16 head and its fp32 gradient) and one block's
    recomputation (q, k, v, attention output, the MLP's three d_ff-wide tensors and their gradients, two gathered
    bf16 blocks). ``peak_gb``: the larger of the start of backward (all activations and the larger transient)
    and its end (all gradients and a block's recomputation)."""
    d, d_ff, layers, vocab = config["d_model"], config["d_ff"], config["num_layers"], config["vocab_size"]
    params = layers * (4 * d * d + 3 * d * d_ff + 2 * d) + 2 * vocab * d + d
    tokens = per_rank_batch * config["context_length"]
    shard = params / world_size
    kept_per_block = tokens * d * 2 * (2 if stack == "ours" else 1)
    block_weights = 4 * d * d + 3 * d * d_ff
    recompute = tokens * (6 * d + 3 * d_ff) * 2 * 2 + 2 * block_weights * 2
    loss = loss or SHARDED_STACKS[stack].loss
    if loss == "fused":
        head = 2 * vocab * d * 2 + 4 * vocab * d
    else:  # the logits of every token (plain) or of one chunk (chunked)
        head = (tokens if loss == "plain" else min(tokens, LOSS_CHUNK_TOKENS)) * vocab * (2 + 4 + 2)
    budget = {
        "params_gb": 4 * shard / GB,
        "optimizer_state_gb": 8 * shard / GB,
        "grads_gb": 4 * shard / GB,
        "saved_activations_gb": layers * kept_per_block / GB,
        "block_recompute_gb": recompute / GB,
        "loss_head_gb": head / GB,
    }
    held = budget["params_gb"] + budget["optimizer_state_gb"]
    start_of_backward = budget["saved_activations_gb"] + max(budget["loss_head_gb"], budget["block_recompute_gb"])
    end_of_backward = budget["grads_gb"] + budget["block_recompute_gb"]
    budget["peak_gb"] = held + max(start_of_backward, end_of_backward)
    return budget
