"""The model of the 2026 leaderboard step (problem ``leaderboard_2026``): its configuration, the matmul FLOPs
of one step by part (and what a checkpoint plan recomputes), the memory a rank is predicted to hold, the checkpoint
plan that fills a rank's memory, and the step's time on another card from measured rates and published peaks.
Read by the tool, its check and the writeup."""

from __future__ import annotations

from cs336_systems.bench.common import flops
from cs336_systems.bench.common.model_sizes import parameter_count
from cs336_systems.train.checkpoint_plan import GiB, CheckpointPlan, plan_checkpointing, uniform_modes
from cs336_systems.train.step import LOSS_CHUNK_TOKENS, SHARDED_STACKS

MODEL = dict(vocab_size=151_936, context_length=32_768, d_model=4096, d_ff=11_008, num_layers=34, num_heads=32)
TINY = dict(vocab_size=300, context_length=64, d_model=64, d_ff=128, num_layers=2, num_heads=4)
BATCH = 2  # sequences per step, one per rank on two ranks
# The row name of each stack of cs336_systems.train.SHARDED_STACKS: the committed rows call PyTorch's stack
# "pytorch" (and their ratio ``ours_over_pytorch``), the library calls it "torch".
ROW_NAMES = {"ours": "ours", "torch": "pytorch"}
STACK_OF_ROW = {row: stack for stack, row in ROW_NAMES.items()}
GB = 1e9
# What each stack's backward recomputes today in every block (the tool's default plan).
DEFAULT_CHECKPOINT_MODE = {"ours": "selective", "torch": "full"}
DEFAULT_MARGIN_BYTES = 4 * GiB  # what the allocator's rounding and fragmentation, NCCL and the CUDA context may take
# The model's peak has come out below the measured one (ours, 2 H100s: 75.4 against 77.9 GB, 3.3 %): on a larger
# card, with more blocks kept whole, the unmodelled part grows with the memory in use, so the margin does too.
MARGIN_SHARE = 0.05


def default_margin_bytes(free_bytes: float) -> float:
    """The memory an automatic plan leaves out of ``free_bytes``: the larger of 4 GiB and 5 % of it."""
    return max(DEFAULT_MARGIN_BYTES, MARGIN_SHARE * free_bytes)


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


def stack_modes(config: dict[str, int], stack: str) -> tuple[str, ...]:
    """Each block's checkpoint mode in ``stack`` as built today (:data:`DEFAULT_CHECKPOINT_MODE`)."""
    return uniform_modes(DEFAULT_CHECKPOINT_MODE[stack], config["num_layers"])


# The d_model- and d_ff-wide bf16 values a token of a block kept whole holds in each stack, measured: eager
# autograd would save 9 d_model + 4 d_ff (:func:`kept_bytes_per_token`), but the compiled blocks' backward recomputes
# the SwiGLU product from its two inputs, and ours holds one d_model-wide tensor fewer. Fitted to the peaks of the
# official step on 2 H200s with 13 blocks kept (ours 127.0 GB, PyTorch's 129.5) against the same step's with
# every block selective or full.
KEPT_WIDTHS = {"ours": (8, 3), "torch": (9, 3)}


def kept_bytes_per_token(config: dict[str, int], mode: str, stack: str = "ours") -> int:
    """bf16 bytes per token a block of ``stack`` holds from its forward to its backward under checkpoint ``mode``.

    ``full``: its input. ``selective``: its input and attention output (the log-sum-exp, 4 bytes per head, left
    out). ``keep``: all its backward reads. Counted as eager autograd saves them, that is the input, both norms'
    outputs, q, k, v, the attention output and its re-laid-out copy (the output projection's input), the input
    of the MLP's residual, and the MLP's three d_ff-wide products with the SwiGLU gate (9 d_model + 4 d_ff); the
    stacks' compiled blocks hold less (:data:`KEPT_WIDTHS`)."""
    d, d_ff = config["d_model"], config["d_ff"]
    d_widths, d_ff_widths = KEPT_WIDTHS[stack]
    return 2 * {"full": d, "selective": 2 * d, "keep": d_widths * d + d_ff_widths * d_ff}[mode]


def memory_budget(config: dict[str, int], stack: str, world_size: int, per_rank_batch: int = 1,
                  loss: str | None = None, modes: tuple[str, ...] | None = None) -> dict[str, float]:
    """Predicted GB per rank of what the step holds, and its peak (``loss``: the loss part, by default the
    stack's in ``SHARDED_STACKS``; ``modes``: each block's checkpoint mode, by default :func:`stack_modes`).

    Always held: the rank's fp32 master shard and AdamW's two fp32 moments. Held from forward to the block's
    backward: the activations each block's checkpoint mode keeps (:func:`kept_bytes_per_token`). Built up
    during backward while those drain: the fp32 gradient shard (``zero_grad`` frees it after
    the step). Transients: the loss head at the start of backward (by the stack's ``loss`` part: ``plain``, the
    full bf16 logits, their fp32 softmax and bf16 gradient; ``chunked``, the same for one chunk of tokens;
    ``fused``, the gathered bf16 head and its fp32 gradient) and one block's
    recomputation (q, k, v, attention output, the MLP's three d_ff-wide tensors and their gradients, two gathered
    bf16 blocks; counted for a kept block's backward too). ``peak_gb``: the larger of the start of backward (all
    activations and the larger transient) and its end (all gradients and a block's recomputation)."""
    d, d_ff, layers, vocab = config["d_model"], config["d_ff"], config["num_layers"], config["vocab_size"]
    params = parameter_count(**config)
    tokens = per_rank_batch * config["context_length"]
    shard = params / world_size
    modes = stack_modes(config, stack) if modes is None else modes
    if len(modes) != layers:
        raise ValueError(f"{len(modes)} checkpoint modes for {layers} blocks")
    kept = tokens * sum(kept_bytes_per_token(config, mode, stack) for mode in modes)
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
        "saved_activations_gb": kept / GB,
        "block_recompute_gb": recompute / GB,
        "loss_head_gb": head / GB,
    }
    held = budget["params_gb"] + budget["optimizer_state_gb"]
    start_of_backward = budget["saved_activations_gb"] + max(budget["loss_head_gb"], budget["block_recompute_gb"])
    end_of_backward = budget["grads_gb"] + budget["block_recompute_gb"]
    budget["peak_gb"] = held + max(start_of_backward, end_of_backward)
    return budget


def checkpoint_plan(config: dict[str, int], stack: str, world_size: int, per_rank_batch: int,
                    free_bytes: float, margin_bytes: float | None = None) -> CheckpointPlan:
    """The checkpoint plan of ``stack`` that fills ``free_bytes`` less ``margin_bytes`` (default
    :func:`default_margin_bytes`) per rank, by :func:`memory_budget`
    (:func:`cs336_systems.train.checkpoint_plan.plan_checkpointing`)."""
    if margin_bytes is None:
        margin_bytes = default_margin_bytes(free_bytes)

    def peak_bytes(modes: tuple[str, ...]) -> float:
        return memory_budget(config, stack, world_size, per_rank_batch, modes=modes)["peak_gb"] * GB

    return plan_checkpointing(config["num_layers"], peak_bytes, free_bytes, margin_bytes)


def fixed_plan(config: dict[str, int], stack: str, world_size: int, per_rank_batch: int,
               modes: tuple[str, ...]) -> CheckpointPlan:
    """``modes`` as a plan with its predicted peak (no budget)."""
    peak = memory_budget(config, stack, world_size, per_rank_batch, modes=modes)["peak_gb"] * GB
    return CheckpointPlan(tuple(modes), peak)


def plan_of_option(option: str | None, config: dict[str, int], stack: str, world_size: int, per_rank_batch: int,
                   free_bytes: float | None = None, margin_bytes: float | None = None) -> CheckpointPlan:
    """The plan a ``--checkpoint-plan`` option names: ``auto`` fills ``free_bytes`` (:func:`checkpoint_plan`),
    ``selective`` / ``full`` put every block in that mode, None is the stack's own (:func:`stack_modes`)."""
    if option == "auto":
        if free_bytes is None:
            raise ValueError("an automatic checkpoint plan needs the free memory (free_bytes)")
        return checkpoint_plan(config, stack, world_size, per_rank_batch, free_bytes, margin_bytes)
    modes = uniform_modes(option, config["num_layers"]) if option else stack_modes(config, stack)
    return fixed_plan(config, stack, world_size, per_rank_batch, modes)


def plan_for_card(card_gb: float, stack: str = "ours", margin_bytes: float | None = None) -> CheckpointPlan:
    """On paper: the plan of the official step (two ranks, one sequence each) on cards of ``card_gb`` GB, all of
    it free (80: H100, 141: H200, 180: B200)."""
    return checkpoint_plan(MODEL, stack, world_size=2, per_rank_batch=1, free_bytes=card_gb * GB,
                           margin_bytes=margin_bytes)


# ---------------------------------------------------------------------------------------------------
# The step's time on another card, on paper
# ---------------------------------------------------------------------------------------------------

# The vendor's published peak figures per GPU: dense bf16 matmul TFLOP/s, HBM TB/s, NVLink TB/s (both directions).
PUBLISHED_PEAKS = {
    "H200": {"bf16_tflops": 989.0, "hbm_tbs": 4.8, "nvlink_tbs": 0.9},
    "B200": {"bf16_tflops": 2250.0, "hbm_tbs": 8.0, "nvlink_tbs": 1.8},
}


def plan_flop_parts(config: dict[str, int], batch: int, modes: tuple[str, ...]) -> dict[str, float]:
    """Matmul FLOPs of one training step on ``batch`` sequences under the checkpoint ``modes`` (one per block):
    :func:`step_flop_parts` (``weights``, ``attention``) and what the backward recomputes. ``recompute_weights``:
    a ``selective`` or ``full`` block's weight matmuls once more (selective keeps the attention output, but the
    MLP's input needs the output projection again, and the attention's backward needs q, k, v);
    ``recompute_attention``: a ``full`` block's attention forward once more. A ``keep`` block recomputes nothing."""
    if len(modes) != config["num_layers"]:
        raise ValueError(f"{len(modes)} checkpoint modes for {config['num_layers']} blocks")
    d, d_ff, seq = config["d_model"], config["d_ff"], config["context_length"]
    block_weights = 2 * batch * seq * (4 * d * d + 3 * d * d_ff)
    block_attention = 4 * batch * seq**2 * d / 2  # causal: half the score matrix
    recomputed = sum(mode != "keep" for mode in modes)
    return {**step_flop_parts(config, batch), "recompute_weights": recomputed * block_weights,
            "recompute_attention": modes.count("full") * block_attention}


def predict_step_ms(flop_parts: dict[str, float], rates: dict[str, float], measured_on: str,
                    predicted_for: str) -> dict[str, float]:
    """One rank's step time on card ``predicted_for`` from rates measured on card ``measured_on``
    (:data:`PUBLISHED_PEAKS` names both): each part at the measured rate scaled by the ratio of the published peaks.

    ``flop_parts``: one rank's :func:`plan_flop_parts`. ``rates``: on the measured card, ``matmul_tflops`` and
    ``attention_tflops`` achieved by the step's weight matmuls and attention kernels, ``memory_bound_ms`` (the
    elementwise, norm, loss and optimizer kernels: scaled by HBM bandwidth) and ``communication_ms`` (exposed
    communication: scaled by NVLink bandwidth). Returns each part's ms and their sum, ``step_ms``: the parts run one
    after the other, as the kernels of one stream do."""
    was, will = PUBLISHED_PEAKS[measured_on], PUBLISHED_PEAKS[predicted_for]
    compute = will["bf16_tflops"] / was["bf16_tflops"]
    weights = flop_parts["weights"] + flop_parts["recompute_weights"]
    attention = flop_parts["attention"] + flop_parts["recompute_attention"]
    parts = {
        "matmul_ms": weights / (rates["matmul_tflops"] * 1e12 * compute) * 1e3,
        "attention_ms": attention / (rates["attention_tflops"] * 1e12 * compute) * 1e3,
        "memory_bound_ms": rates["memory_bound_ms"] * was["hbm_tbs"] / will["hbm_tbs"],
        "communication_ms": rates["communication_ms"] * was["nvlink_tbs"] / will["nvlink_tbs"],
    }
    return {**parts, "step_ms": sum(parts.values())}
