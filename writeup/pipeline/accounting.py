"""The writeup's derivations as plain functions (bytes, seconds, FLOP/s), so that tests can check them and
the prose quotes their results instead of numbers typed by hand."""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

from cs336_systems.bench.common import allreduce_fit
from cs336_systems.bench.common.model_sizes import parameter_count  # noqa: F401  (the sections' count)

FP32, BF16 = 4, 2


# ---------------------------------------------------------------------------------------------
# Activations and attention memory
# ---------------------------------------------------------------------------------------------


def residual_stream_bytes(batch: int, seq: int, width: int, bytes_per_element: int = FP32) -> int:
    """One activation of shape ``(batch, seq, width)``."""
    return batch * seq * width * bytes_per_element


def attention_scores_bytes(batch: int, heads: int, seq: int, bytes_per_element: int = FP32) -> int:
    """One ``(batch, heads, seq, seq)`` score (or probability) matrix."""
    return batch * heads * seq * seq * bytes_per_element


def model_tensor_bytes(batch: int, seq: int, vocab: int, d_model: int, d_ff: int, num_heads: int,
                       **_: Any) -> dict[str, int]:
    """The bytes of the language model's tensors that a memory trace shows, in fp32 and bf16, by name: an
    allocation of one of these sizes is (most likely) that tensor."""
    shapes = {"attention scores (B·h·T²)": batch * num_heads * seq * seq, "FFN hidden state (B·T·d_ff)": batch * seq * d_ff,
              "logits (B·T·V)": batch * seq * vocab, "residual stream (B·T·d)": batch * seq * d_model,
              "FFN weight (d·d_ff)": d_model * d_ff, "embedding (V·d)": vocab * d_model,
              "attention weight (d·d)": d_model * d_model}
    return {f"{dtype} {name}": elements * size for dtype, size in (("fp32", FP32), ("bf16", BF16))
            for name, elements in shapes.items()}


NAIVE_ATTENTION_SAVED_MATRICES = 3
"""Score-sized float32 matrices the naive causal attention keeps for backward: the masked scores (the softmax's
row maximum and its backward need them), the exponentials and the probabilities."""


def fit_square_matrices(rows: list[dict[str, Any]], batch: int) -> float:
    """How many float32 ``(batch, T, T)`` matrices the naive attention saves for backward, fitted on the
    longest measured lengths (``saved_for_backward_gb``; the causal mask, ``T²`` bools, subtracted)."""
    longest = max(row["seq_len"] for row in rows)
    fits = [(row["saved_for_backward_gb"] * 1e9 - row["seq_len"] ** 2) / (FP32 * batch * row["seq_len"] ** 2)
            for row in rows if row["seq_len"] == longest]
    return statistics.median(fits)


def naive_attention_memory(batch: int, seq: int, d: int, matrices: float) -> dict[str, float]:
    """Bytes the naive causal attention holds on ``(batch, seq, d)`` float32 inputs.

    Saved for backward: ``matrices`` score-sized float32 matrices (the masked scores for the max, the
    exponentials, the probabilities), the ``seq x seq`` boolean mask, the inputs and the output. The
    backward then creates the gradients of the probabilities and of the scores: about two more.
    """
    score = FP32 * batch * seq * seq
    mask = seq * seq
    inputs = 3 * FP32 * batch * seq * d
    output = FP32 * batch * seq * d
    saved = matrices * score + mask + inputs + output
    return {"score_matrix_bytes": score, "mask_bytes": mask, "inputs_bytes": inputs + output, "saved_bytes": saved,
            "backward_peak_bytes": saved + 2 * score}


def device_memory_gb(rows: list[dict[str, Any]]) -> float:
    """The GPU's memory: from an out-of-memory message (``total capacity of 79.18 GiB``) or the device name."""
    for row in rows:
        match = re.search(r"total capacity of ([\d.]+) GiB", str(row.get("error", "")))
        if match:
            return float(match.group(1)) * 2**30 / 1e9
    for row in rows:
        match = re.search(r"(\d+)\s*GB", str(row.get("env", {}).get("gpu_name") or row.get("device", "")))
        if match:
            return float(match.group(1))
    return 80.0


def first_oom_length(longest: int, batch: int, matrices: float, capacity_gb: float) -> int:
    """The first length beyond ``longest`` (doubling) whose naive-attention backward would not fit."""
    seq = longest
    while True:
        seq *= 2
        if naive_attention_memory(batch, seq, 0, matrices)["backward_peak_bytes"] > capacity_gb * 1e9:
            return seq


# ---------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------


def checkpoint_activation_bytes(n_blocks: int, group: int, boundary: float, per_block: float) -> float:
    """Peak activations with one level of recomputation in groups of ``group`` blocks: every group's input
    (``boundary``) kept, plus one group's saved activations (``group * per_block``) rebuilt in backward."""
    if group == 0:
        return n_blocks * per_block
    return math.ceil(n_blocks / group) * boundary + min(group, n_blocks) * per_block


# ---------------------------------------------------------------------------------------------
# communication_accounting
# ---------------------------------------------------------------------------------------------

XXL = {"d_model": 16384, "d_ff": 53248, "num_blocks": 126}
H100_BYTES = 80e9
V5P_BYTES = 95e9
V5P = {"w_ici": 2 * 9e10, "flops": 4.6e14, "m_x": 2, "m_y": 1, "x": 16, "y": 4}


def communication_accounting(d_model: int = XXL["d_model"], d_ff: int = XXL["d_ff"],
                             num_blocks: int = XXL["num_blocks"]) -> dict[str, float]:
    """Every number of the four parts, in bytes, FLOP/s and tokens (see the writeup for the steps)."""
    per_block = 2 * d_model * d_ff  # W_in (d_model x d_ff) and W_out (d_ff x d_model)
    params = num_blocks * per_block
    state_bytes = (FP32 + FP32 + 2 * FP32) * params  # master weights, gradients, Adam m and v
    bf16_weights = BF16 * params  # the weights as the bf16 matmuls see them, saved for backward
    act_per_token = num_blocks * (d_model + d_ff) * BF16  # the inputs of both matmuls of every block
    n_min = math.ceil(state_bytes / V5P_BYTES)
    alpha = V5P["flops"] / V5P["w_ici"]  # FLOPs per byte of ICI bandwidth
    tokens_per_fsdp_shard = alpha / V5P["m_x"]  # B / X >= C / (W_ici M_X)
    devices = V5P["x"] * V5P["y"]
    per_device = tokens_per_fsdp_shard / V5P["y"]  # B / N = (B / X) / Y
    return {
        "per_block": per_block, "params": params, "state_bytes": state_bytes,
        "state_h100": state_bytes / H100_BYTES, "bf16_weights": bf16_weights, "bf16_weights_h100": bf16_weights / H100_BYTES,
        "act_per_token": act_per_token, "tokens_per_h100": H100_BYTES / act_per_token,
        "n_min": n_min, "n_exact": state_bytes / V5P_BYTES, "per_device_state_at_n_min": state_bytes / n_min,
        "alpha": alpha, "tokens_per_fsdp_shard": tokens_per_fsdp_shard, "devices": devices,
        "per_device_batch": per_device, "per_device_batch_int": math.ceil(per_device),
        "global_batch": per_device * devices, "global_batch_int": math.ceil(per_device) * devices,
        "tp_limit": d_ff * V5P["m_y"] / alpha, "f_over_y": d_ff / V5P["y"],
        "state_per_device_at_xy": state_bytes / devices,
    }


# ---------------------------------------------------------------------------------------------
# DDP overhead model
# ---------------------------------------------------------------------------------------------


def fit_latency_bandwidth(sizes_bytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """``t = o + size / w`` fitted to all-reduce times: returns ``(o seconds, w bytes/s)``.

    The fit of ``cs336_systems.bench.common.allreduce_fit`` (least squares on relative errors, so 1 MB weighs as
    much as 1 GB), which ``python -m cs336_systems.bench.ddp_overhead_model`` uses too: the writeup and the tool
    print the same ``o`` and ``w``.
    """
    fit = allreduce_fit.fit_latency_bandwidth(sizes_bytes, seconds)
    return fit.alpha_s, fit.beta_bytes_per_s


def ddp_overhead(total_bytes: float, bandwidth: float, per_call: float, n_buckets: float) -> float:
    """Time after the backward pass: the last bucket's transfer plus one per-call overhead per bucket
    (each bucket's compute hides its own transfer, not the fixed costs, which pile up on the stream)."""
    return total_bytes / (n_buckets * bandwidth) + n_buckets * per_call


def optimal_bucket(total_bytes: float, bandwidth: float, per_call: float) -> dict[str, float]:
    """``n_b* = sqrt(s / (w o))``, bucket size ``b* = s / n_b* = sqrt(s w o)``, overhead ``2 sqrt(s o / w)``."""
    n_b = math.sqrt(total_bytes / (bandwidth * per_call))
    return {"n_buckets": n_b, "bucket_bytes": total_bytes / n_b, "overhead": 2 * math.sqrt(total_bytes * per_call / bandwidth)}


# ---------------------------------------------------------------------------------------------
# Optimizer-state sharding and FSDP
# ---------------------------------------------------------------------------------------------


def sharding_memory(params: int, world: int) -> dict[str, float]:
    """Per-rank bytes of fp32 weights, gradients and AdamW state, without and with optimizer-state sharding."""
    weights = grads = FP32 * params
    state = 2 * FP32 * params
    return {"weights": weights, "grads": grads, "state": state, "state_sharded": state / world,
            "total": weights + grads + state, "total_sharded": weights + grads + state / world,
            "fsdp_total": (weights + grads + state) / world}


def fsdp_shard_bytes(vocab_size: int, d_model: int, d_ff: int, world: int, **_: Any) -> dict[str, int]:
    """fp32 bytes a rank holds of the largest parameter each FSDP gives the optimizer: ours, one flat shard per
    ``TransformerBlock`` (``4d² + 3·d·d_ff + 2d`` elements over ``world`` ranks); FSDP2, a shard of each tensor on
    its own, the largest being the embedding or LM head (``V·d``) or an FFN weight (``d·d_ff``)."""
    block = 4 * d_model**2 + 3 * d_model * d_ff + 2 * d_model
    return {"ours_block": FP32 * math.ceil(block / world),
            "fsdp2_largest": FP32 * math.ceil(max(vocab_size * d_model, d_model * d_ff) / world)}


def sharding_traffic(params: int, world: int) -> dict[str, float]:
    """Bytes each rank receives per step (ring collectives): DDP's all-reduce, ours (all-reduce + broadcasts
    of the parameters owned elsewhere), ZeRO stage 1 (reduce-scatter of gradients + all-gather of parameters)."""
    s = FP32 * params
    share = (world - 1) / world
    all_reduce = 2 * share * s
    return {"all_reduce": all_reduce, "ours": all_reduce + share * s, "zero1": 2 * share * s, "ratio": 1.5}


# ---------------------------------------------------------------------------------------------
# The fast training step
# ---------------------------------------------------------------------------------------------


def adamw_bytes_per_param(param: int, grad: int, moment: int) -> int:
    """Bytes one AdamW step moves per parameter, at best: the parameter read and written, the gradient read, both
    moments read and written (element sizes in bytes). 28 for float32 throughout; 22 for bf16 parameters and
    gradients with float32 moments, 14 with bf16 moments."""
    return 2 * param + grad + 2 * 2 * moment
