"""FlashAttention-2 in Triton (SPEC sections 3.2-3.4): input checks, launch parameters, the launch
wrappers and the ``torch.autograd.Function``. The kernels are in ``flash_triton_kernels.py``.

    O = FlashAttention2Triton.apply(Q, K, V, is_causal)       # or flash_attention(Q, K, V, is_causal)

Q is ``(batch, n_queries, d)`` and K, V are ``(batch, n_keys, d)``, or all four-dimensional
``(batch, heads, seq, d)``; any lengths (``n_queries != n_keys`` allowed, the causal rule being
``i >= j`` on absolute indices), ``d`` in 16, 32, 64, 128, dtype float16, bfloat16 or float32 (float32
matmuls use TF32 exactly when PyTorch's may: ``torch.backends.cuda.matmul.allow_tf32 = True`` or
``torch.set_float32_matmul_precision("high")``).
Inputs may be non-contiguous; a copy is made only when the last dimension is strided.

Launch parameters:

* on a GPU, one fixed configuration per dtype and head dim (:func:`fixed_config`, from autotuner timings),
  which compiles each kernel once and never again at a new length; ``CS336_FLASH_AUTOTUNE=1`` (or
  ``AUTOTUNE = True`` here) lets ``triton.autotune`` pick the tiles per (coarsened lengths, head dim,
  causal, dtype) instead, which costs tens of seconds of compiling and timing per new length bucket;
* under ``TRITON_INTERPRET=1`` (CPU), one small configuration with unequal tiles, so that the tests
  exercise every masking path at small sizes in seconds.

On Hopper GPUs (compute capability 9.x), fp16 and bf16 inputs with enough work run the Gluon kernels of
``flash_hopper.py`` instead, behind the same functions and operators (``CS336_FLASH_KERNELS`` chooses; see
:data:`flash_hopper.KERNELS`); everything below is the portable path.

Requires the environment variable to be set before this module is first imported: ``@triton.jit``
decides at definition time whether it builds GPU kernels or interpreter functions.
"""

from __future__ import annotations

import math
import os

import torch
import triton
from jaxtyping import Float
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from cs336_systems.attention import flash_hopper
from cs336_systems.attention import flash_triton_kernels as kernels
from cs336_systems.attention.reference import check_attention_inputs

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension, which runs over batch * heads

AUTOTUNE: bool = os.environ.get("CS336_FLASH_AUTOTUNE", "0") == "1"
"""Autotune the tiles on a GPU (``CS336_FLASH_AUTOTUNE=1``), or use :func:`fixed_config` (default): fixed
tiles per dtype and head dim compile each kernel once per (dtype, head dim, causal), whatever the lengths, so a
cold first call costs one compilation of each kernel it launches, and none at a new sequence length."""

FILL_OUTPUTS_WITH_NAN: bool = False
"""Tests set this so that outputs start as NaN instead of uninitialised memory: an element a kernel
fails to write then shows."""


# ---------------------------------------------------------------------------------------------------
# Launch parameters
# ---------------------------------------------------------------------------------------------------


def _config(block_m: int, block_n: int, num_warps: int, num_stages: int) -> triton.Config:
    """A forward configuration: BLOCK_M queries held, BLOCK_N keys per step."""
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages)


def _bwd_config(tile: int, slice_: int, num_warps: int, num_stages: int) -> triton.Config:
    """A backward configuration: TILE keys (then queries) held, SLICE queries (then keys) per step."""
    return triton.Config({"TILE": tile, "SLICE": slice_}, num_warps=num_warps, num_stages=num_stages)


# The forward holds a query tile and sweeps key tiles. The backward holds a large tile (keys for
# dK/dV, then queries for dQ) and sweeps small slices, which keeps its two float32 accumulators in
# registers. Float32 gets smaller tiles: without TF32, tl.dot runs on the FMA units and larger tiles
# spill registers (checked by compiling for sm_90 with ptxas).
AUTOTUNE_CONFIGS = {
    "fwd": {
        "16-bit": [_config(128, 64, 4, 3), _config(128, 64, 8, 3), _config(128, 128, 8, 3), _config(128, 32, 4, 4),
                   _config(128, 64, 4, 4), _config(128, 128, 8, 4), _config(64, 64, 4, 3), _config(64, 32, 4, 2)],
        "32-bit": [_config(32, 16, 4, 2), _config(32, 16, 8, 2), _config(32, 32, 4, 2), _config(64, 16, 8, 2)],
    },
    # The backward parts run as two launches at head dims up to 64 and as one above (see
    # FUSED_BACKWARD_MIN_HEAD_DIM); TILE is the held tile, SLICE the swept one.
    "bwd_dkdv": {
        "16-bit": [_bwd_config(64, 32, 4, 4), _bwd_config(64, 32, 4, 3), _bwd_config(128, 64, 8, 3),
                   _bwd_config(128, 64, 8, 4), _bwd_config(128, 32, 8, 3), _bwd_config(128, 32, 4, 5),
                   _bwd_config(64, 64, 4, 3), _bwd_config(64, 16, 4, 2)],
        "32-bit": [_bwd_config(32, 16, 4, 1), _bwd_config(32, 16, 8, 1), _bwd_config(32, 32, 8, 1)],
    },
    "bwd_dq": {
        "16-bit": [_bwd_config(64, 64, 4, 4), _bwd_config(64, 64, 4, 3), _bwd_config(128, 32, 8, 3),
                   _bwd_config(128, 64, 8, 3), _bwd_config(128, 32, 4, 5), _bwd_config(64, 32, 4, 2)],
        "32-bit": [_bwd_config(32, 16, 4, 1), _bwd_config(32, 16, 8, 1), _bwd_config(32, 32, 8, 1)],
    },
    "bwd_both": {
        "16-bit": [_bwd_config(128, 64, 8, 3), _bwd_config(128, 32, 8, 3), _bwd_config(128, 32, 8, 4),
                   _bwd_config(64, 64, 4, 2), _bwd_config(64, 64, 4, 3), _bwd_config(64, 32, 4, 3),
                   _bwd_config(64, 32, 8, 2), _bwd_config(64, 16, 4, 3)],
        "32-bit": [_bwd_config(32, 16, 4, 1), _bwd_config(32, 16, 8, 1), _bwd_config(32, 32, 8, 1)],
    },
}


def _set_dq_descriptor_block(nargs: dict) -> None:
    """The dQ accumulator's descriptor moves blocks of one step: (1, SLICE, HEAD_DIM)."""
    if nargs["dq_acc_desc"] is not None:
        nargs["dq_acc_desc"].block_shape = [1, nargs["SLICE"], nargs["HEAD_DIM"]]


def _one_pass_config(tile: int, slice_: int, num_warps: int, num_stages: int) -> triton.Config:
    """A one-pass backward configuration: TILE keys held, SLICE queries per step (and per dQ reduction)."""
    return triton.Config({"TILE": tile, "SLICE": slice_}, num_warps=num_warps, num_stages=num_stages,
                         pre_hook=_set_dq_descriptor_block)


AUTOTUNE_CONFIGS["bwd_one_pass"] = {
    "16-bit": [_one_pass_config(128, 64, 8, 2), _one_pass_config(128, 64, 8, 3), _one_pass_config(128, 64, 8, 4),
               _one_pass_config(64, 64, 4, 3), _one_pass_config(128, 32, 8, 3), _one_pass_config(64, 32, 4, 3)],
    "32-bit": [_one_pass_config(32, 16, 4, 1), _one_pass_config(32, 16, 8, 1), _one_pass_config(32, 32, 8, 1)],
}
BACKWARD: str = os.environ.get("CS336_FLASH_BACKWARD", "auto")
"""How the backward computes dQ (the "auto" choice was measured on an H100, bf16, causal):

* "one_pass": one sweep over the queries per key tile computes dK and dV and adds each step's dS K into a
  float32 dQ accumulator, by element-wise atomics (head dims up to 64) or by the copy engine's bulk
  reductions through a tensor descriptor (d = 128; the CPU interpreter has none and runs atomics). Five
  matmuls per tile instead of seven; 4-8 % faster than "two_pass" once there are enough key tiles to fill
  the GPU, slower below (one program per key tile, the first one sweeping every query).
* "two_pass": a second sweep, over the keys per query tile, recomputes P and dP for dQ: no atomics, and
  the results are deterministic;
* "auto": "one_pass" for 16-bit inputs with at least ONE_PASS_MIN_KEY_TILES key tiles of 128 in all, else
  "two_pass".
"""
ONE_PASS_MIN_KEY_TILES = 256
FUSED_BACKWARD_MIN_HEAD_DIM = 128
"""Head dims from which the two-pass backward runs its two parts in one launch ("bwd_both"): measured on an
H100 (bf16, causal), one launch was 5-25 % faster at d = 128 and 3-4 % slower at d = 64."""
_BWD_PARTS = {"bwd_dkdv": "dkdv", "bwd_dq": "dq", "bwd_both": "both", "bwd_one_pass": "dkdv"}
INTERPRETER_CONFIGS = {"fwd": _config(32, 16, 4, 1), **dict.fromkeys(_BWD_PARTS, _bwd_config(32, 16, 4, 1)),
                       "bwd_one_pass": _one_pass_config(32, 16, 4, 1)}
DELTA_BLOCK_M = 64

SHARED_MEMORY_BUDGET = 200 * 1024  # bytes; an H100 has 227 KiB per block, leave room for the compiler's own


def _shared_memory_estimate(kernel: str, config: triton.Config, head_dim: int, element_size: int) -> int:
    """Bytes of the tiles a kernel keeps in shared memory: held tiles once, the two swept ones per stage
    (the forward holds q; the backward k and v, or q and dO)."""
    if kernel == "fwd":
        held, swept, n_held = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], 1
    else:
        held, swept, n_held = config.kwargs["TILE"], config.kwargs["SLICE"], 2
    return element_size * head_dim * (n_held * held + 2 * swept * max(config.num_stages, 1))


def _precision_class(element_size: int) -> str:
    return "32-bit" if element_size == 4 else "16-bit"


def _pruner(kernel: str):
    """Keep the configurations meant for the input's precision that fit in shared memory."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        head_dim, element_size = kwargs["HEAD_DIM"], named_args["Q"].element_size()
        meant_for_this_precision = AUTOTUNE_CONFIGS[kernel][_precision_class(element_size)]
        candidates = [c for c in configs if c in meant_for_this_precision]
        fitting = [c for c in candidates if _shared_memory_estimate(kernel, c, head_dim, element_size) <= SHARED_MEMORY_BUDGET]
        return fitting or [min(candidates, key=lambda c: _shared_memory_estimate(kernel, c, head_dim, element_size))]

    return prune


# Coarsened lengths (next power of two) bound how often the autotuner runs; the dtype of the tensor
# arguments is part of every key automatically.
_AUTOTUNE_KEY = ["n_queries_key", "n_keys_key", "HEAD_DIM", "IS_CAUSAL", "DOT_PRECISION"]
_plain = {"fwd": kernels.attn_fwd_kernel, "delta": kernels.attn_bwd_delta_kernel, "dq_convert": kernels.attn_bwd_dq_convert_kernel,
          **dict.fromkeys(_BWD_PARTS, kernels.attn_bwd_kernel)}
_length_key_positions = {name: tuple(_plain[name].arg_names.index(arg) for arg in _AUTOTUNE_KEY[:2])
                         for name in AUTOTUNE_CONFIGS}
"""Where each autotuned kernel's coarsened lengths are among its arguments."""
_autotuned = {
    name: triton.autotune(
        [config for group in AUTOTUNE_CONFIGS[name].values() for config in group],
        key=_AUTOTUNE_KEY,
        prune_configs_by={"early_config_prune": _pruner(name)},
        # The one-pass backward adds into DQ_acc: every timed run must start from zeros.
        reset_to_zero=["DQ_acc"] if name == "bwd_one_pass" else None,
    )(_plain[name])
    for name in AUTOTUNE_CONFIGS
}


def fixed_config(kernel: str, dtype: torch.dtype, head_dim: int) -> triton.Config:
    """The configuration of ``kernel`` ("fwd", "bwd_dkdv", "bwd_dq", "bwd_both", "bwd_one_pass", "delta" or
    "dq_convert") when not autotuning: the fastest in the autotuner's H100 timings at 16384 tokens (bf16,
    causal) among those with no register spills at any head dim (checked with ptxas for sm_90)."""
    if kernel in ("delta", "dq_convert"):
        return triton.Config({"BLOCK_M": DELTA_BLOCK_M}, num_warps=4, num_stages=1)
    if kernels.RUNNING_IN_INTERPRETER:
        return INTERPRETER_CONFIGS[kernel]
    make = _one_pass_config if kernel == "bwd_one_pass" else _bwd_config
    if dtype == torch.float32:
        num_warps = 4 if head_dim <= 64 else 8
        return _config(32, 16, num_warps, 2) if kernel == "fwd" else make(32, 16, num_warps, 1)
    if kernel == "fwd":
        return _config(128, 64, 8, 3)
    if kernel == "bwd_dq":
        return make(64, 64, 4, 3)
    return make(128, 64, 8, 3) if head_dim <= 64 else make(128, 32, 8, 3)


_chosen: dict[tuple, triton.Config] = {}
"""The autotuner's choice per (kernel, autotune key): later launches skip the autotuner's own per-call
work (binding every argument to compute its key), which costs tens of microseconds of host time."""

def _launch(kernel: str, n_parallel: int, parallel_block: str, batch_heads: int, args: tuple, meta: dict) -> None:
    """Run ``kernel`` on the grid ``(cdiv(n_parallel, parallel_block), batch * heads)``, autotuned or
    with :func:`fixed_config`. ``args[0]`` is Q (or O) and ``meta`` holds the constexprs but the tiles."""
    if kernel in _autotuned and AUTOTUNE and not kernels.RUNNING_IN_INTERPRETER:
        n_queries_at, n_keys_at = _length_key_positions[kernel]
        key = (kernel, args[0].dtype, args[n_queries_at], args[n_keys_at], *meta.values())
        config = _chosen.get(key)
        if config is None:
            autotuner = _autotuned[kernel]
            autotuner[lambda META: (triton.cdiv(n_parallel, META[parallel_block]), batch_heads)](*args, **meta)
            _chosen[key] = autotuner.best_config
            return
    else:
        config = fixed_config(kernel, args[0].dtype, meta["HEAD_DIM"])
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(_plain[kernel].arg_names, args)), **meta, **config.kwargs})
    grid = (triton.cdiv(n_parallel, config.kwargs[parallel_block]), batch_heads)
    # Only the tiles, warps and stages: torch.compile refuses num_ctas passed as a launch argument.
    _plain[kernel][grid](*args, **meta, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def _dot_precision(dtype: torch.dtype) -> str:
    """TF32 for float32 exactly when PyTorch's own matmuls may use it; 16-bit inputs take the default.

    Reads ``torch.backends.cuda.matmul.fp32_precision``, which ``allow_tf32 = True`` and
    ``torch.set_float32_matmul_precision("high")`` also set, and which (unlike ``allow_tf32``) does not
    raise once a program has mixed the legacy and the new precision APIs.
    """
    if dtype == torch.float32 and torch.backends.cuda.matmul.fp32_precision != "tf32":
        return "ieee"
    return "tf32"


def _length_key(n: int) -> int:
    """The next power of two (plain Python: ``triton.next_power_of_2`` costs microseconds per call)."""
    return 1 << (n - 1).bit_length()


# ---------------------------------------------------------------------------------------------------
# Launch wrappers
# ---------------------------------------------------------------------------------------------------


def _check_triton_inputs(Q: Tensor, K: Tensor, V: Tensor) -> None:
    check_attention_inputs(Q, K, V)
    if Q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {Q.dtype}: the Triton kernels take float16, bfloat16 or float32")
    if Q.shape[-1] > max(SUPPORTED_HEAD_DIMS) or Q.shape[-1] % 8:
        raise ValueError(
            f"unsupported head dimension d={Q.shape[-1]}: the Triton kernels run d in {SUPPORTED_HEAD_DIMS}, and "
            f"other multiples of 8 up to {max(SUPPORTED_HEAD_DIMS)} zero-padded to the next of those"
        )
    if Q.device.type != "cuda" and not kernels.RUNNING_IN_INTERPRETER:
        raise ValueError(
            f"the Triton kernels need CUDA tensors, got tensors on {Q.device}; to run them on the CPU through the "
            "Triton interpreter, set TRITON_INTERPRET=1 before cs336_systems.attention.flash_triton_kernels is imported"
        )
    batch_heads = math.prod(Q.shape[:-2])
    if batch_heads > MAX_GRID_Y:
        raise ValueError(f"batch * heads = {batch_heads} exceeds the grid limit {MAX_GRID_Y}")


def _unit_last_stride(x: Tensor) -> Tensor:
    """The kernels address the head dimension with stride 1; copy only when it is not."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(x: Tensor) -> tuple[int, int, int]:
    """(batch, head, sequence) strides, with head stride 0 for 3-D tensors."""
    if x.dim() == 3:
        return x.stride(0), 0, x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


def _new_output(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    if FILL_OUTPUTS_WITH_NAN:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def flash_attention_forward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    is_causal: bool, sm_scale: float | None = None,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads q"]]:
    """``O`` (Q's shape and dtype) and the natural-log logsumexp ``L`` (float32). Inputs are checked by
    the caller and have unit stride along ``d``."""
    n_heads = Q.shape[1] if Q.dim() == 4 else 1
    batch_heads, (n_queries, head_dim), n_keys = Q.shape[0] * n_heads, Q.shape[-2:], K.shape[-2]
    O = _new_output(Q.shape, Q.dtype, Q.device)
    L = _new_output((batch_heads, n_queries), torch.float32, Q.device)
    sm_scale = sm_scale or 1.0 / math.sqrt(head_dim)
    if not kernels.RUNNING_IN_INTERPRETER and flash_hopper.runs_on(
            Q, batch_heads * triton.cdiv(n_queries, 2 * flash_hopper.FORWARD_ROWS), "forward"):
        flash_hopper.forward(Q, K, V, O, L, is_causal, sm_scale)
        return O, L.view(Q.shape[:-1])
    args = (
        Q, K, V, O, L,
        *_strides(Q), *_strides(K), *_strides(V), *_strides(O),
        n_heads, n_queries, n_keys, _length_key(n_queries), _length_key(n_keys),
        sm_scale * math.log2(math.e),
    )
    meta = dict(HEAD_DIM=head_dim, IS_CAUSAL=is_causal, DOT_PRECISION=_dot_precision(Q.dtype))
    _launch("fwd", n_queries, "BLOCK_M", batch_heads, args, meta)
    return O, L.view(Q.shape[:-1])


def flash_attention_backward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    O: Float[Tensor, "batch *heads q d"], L: Float[Tensor, "batch *heads q"], dO: Float[Tensor, "batch *heads q d"],
    is_causal: bool, sm_scale: float | None = None,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads k d"], Float[Tensor, "batch *heads k d"]]:
    """``dQ, dK, dV`` (in the inputs' dtype) from the saved forward state and the output gradient."""
    dO = _unit_last_stride(dO.to(O.dtype))  # o.sum().backward() sends an expanded, all-stride-0 dO
    n_heads = Q.shape[1] if Q.dim() == 4 else 1
    batch_heads, (n_queries, head_dim), n_keys = Q.shape[0] * n_heads, Q.shape[-2:], K.shape[-2]

    hopper = not kernels.RUNNING_IN_INTERPRETER and flash_hopper.runs_on(
        Q, batch_heads * triton.cdiv(n_keys, flash_hopper.BLOCK_N), "backward")
    dq_mode = "hopper" if hopper else _dq_mode(Q.dtype, batch_heads, n_keys, head_dim)
    Delta = _new_output((batch_heads, n_queries), torch.float32, Q.device)
    # dS K summed over key tiles; the delta kernel zeroes it (one pass only).
    DQ_acc = torch.empty((batch_heads, n_queries, head_dim), dtype=torch.float32, device=Q.device) if dq_mode != "none" else None
    _launch("delta", n_queries, "BLOCK_M", batch_heads,
            (O, dO, Delta, *_strides(O), *_strides(dO), n_heads, n_queries, DQ_acc),
            dict(HEAD_DIM=head_dim, ZERO_DQ_ACC=DQ_acc is not None))

    dQ = _new_output(Q.shape, Q.dtype, Q.device)
    dK = _new_output(K.shape, K.dtype, K.device)
    dV = _new_output(V.shape, V.dtype, V.device)
    sm_scale = sm_scale or 1.0 / math.sqrt(head_dim)
    if hopper:
        flash_hopper.backward_dkdv_dq(Q, K, V, dO, L, Delta, dK, dV, DQ_acc, is_causal, sm_scale)
        _launch("dq_convert", n_queries, "BLOCK_M", batch_heads,
                (DQ_acc, dQ, *_strides(dQ), n_heads, n_queries, sm_scale), dict(HEAD_DIM=head_dim))
        return dQ, dK, dV
    dq_acc_desc = None
    if dq_mode == "tma":  # the block shape is the configuration's (set before each launch)
        dq_acc_desc = TensorDescriptor(DQ_acc, list(DQ_acc.shape), list(DQ_acc.stride()), [1, 16, head_dim])
    args = (
        Q, K, V, dO, L, Delta, dQ, dK, dV, DQ_acc, dq_acc_desc,
        *_strides(Q), *_strides(K), *_strides(V), *_strides(dO), *_strides(dQ), *_strides(dK), *_strides(dV),
        n_heads, n_queries, n_keys, _length_key(n_queries), _length_key(n_keys), sm_scale, sm_scale * math.log2(math.e),
    )
    meta = dict(HEAD_DIM=head_dim, IS_CAUSAL=is_causal, DOT_PRECISION=_dot_precision(Q.dtype))
    if dq_mode != "none":
        _launch("bwd_one_pass", n_keys, "TILE", batch_heads, args, {**meta, "PART": "dkdv", "DQ_MODE": dq_mode})
        _launch("dq_convert", n_queries, "BLOCK_M", batch_heads,
                (DQ_acc, dQ, *_strides(dQ), n_heads, n_queries, sm_scale), dict(HEAD_DIM=head_dim))
    elif head_dim >= FUSED_BACKWARD_MIN_HEAD_DIM:
        _launch("bwd_both", max(n_queries, n_keys), "TILE", batch_heads, args, {**meta, "PART": "both", "DQ_MODE": "none"})
    else:
        _launch("bwd_dkdv", n_keys, "TILE", batch_heads, args, {**meta, "PART": "dkdv", "DQ_MODE": "none"})
        _launch("bwd_dq", n_queries, "TILE", batch_heads, args, {**meta, "PART": "dq", "DQ_MODE": "none"})
    return dQ, dK, dV


def _dq_mode(dtype: torch.dtype, batch_heads: int, n_keys: int, head_dim: int) -> str:
    """DQ_MODE of the backward kernel: "none" for the two-pass backward, else how the one pass adds into
    the dQ accumulator (see :data:`BACKWARD`)."""
    if BACKWARD not in ("auto", "one_pass", "two_pass"):
        raise ValueError(f"CS336_FLASH_BACKWARD / BACKWARD must be auto, one_pass or two_pass, not {BACKWARD!r}")
    one_pass = BACKWARD == "one_pass" or (
        BACKWARD == "auto" and dtype != torch.float32 and batch_heads * triton.cdiv(n_keys, 128) >= ONE_PASS_MIN_KEY_TILES
    )
    if not one_pass:
        return "none"
    return "tma" if head_dim >= 128 and not kernels.RUNNING_IN_INTERPRETER else "atomics"


# ---------------------------------------------------------------------------------------------------
# PyTorch operators, the autograd Function and the functional entry point
# ---------------------------------------------------------------------------------------------------
# The forward and the backward are operators (torch.library.custom_op), so torch.compile traces any model
# or function that calls them without a graph break (Inductor calls them as opaque kernels), CUDA graphs
# capture them, and eager calls go through the dispatcher once. Both run on any device: on the CPU only
# under the Triton interpreter (the launch code raises otherwise).


def _padded_head_dim(head_dim: int) -> int:
    return min(d for d in SUPPORTED_HEAD_DIMS if d >= head_dim)


def _pad_head_dim(x: Tensor, head_dim: int) -> Tensor:
    """``x`` with zeros appended along ``d`` up to ``head_dim`` (zero features change no score or output),
    else ``x`` with a unit stride along ``d``."""
    if x.shape[-1] == head_dim:
        return _unit_last_stride(x)
    return torch.nn.functional.pad(x, (0, head_dim - x.shape[-1]))


@torch.library.custom_op("cs336_systems::flash_attention_forward", mutates_args=())
def flash_attention_forward_op(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool) -> tuple[Tensor, Tensor]:
    """``(O, L)`` of :func:`flash_attention_forward` (inputs of any strides and any supported ``d``; checked by
    the caller). A head dim between the kernels' runs padded, with the scale of the true one."""
    head_dim = Q.shape[-1]
    padded = _padded_head_dim(head_dim)
    Q, K, V = (_pad_head_dim(x, padded) for x in (Q, K, V))
    O, L = flash_attention_forward(Q, K, V, is_causal, 1.0 / math.sqrt(head_dim))
    return (O if padded == head_dim else O[..., :head_dim].contiguous()), L


@flash_attention_forward_op.register_fake
def _(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool) -> tuple[Tensor, Tensor]:
    return Q.new_empty(Q.shape), Q.new_empty(Q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("cs336_systems::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
    Q: Tensor, K: Tensor, V: Tensor, O: Tensor, L: Tensor, dO: Tensor, is_causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV)`` of :func:`flash_attention_backward` (padded like the forward)."""
    head_dim = Q.shape[-1]
    padded = _padded_head_dim(head_dim)
    Q, K, V, O, dO = (_pad_head_dim(x, padded) for x in (Q, K, V, O, dO.to(O.dtype)))
    dQ, dK, dV = flash_attention_backward(Q, K, V, O, L, dO, is_causal, 1.0 / math.sqrt(head_dim))
    if padded == head_dim:
        return dQ, dK, dV
    return tuple(g[..., :head_dim].contiguous() for g in (dQ, dK, dV))


@flash_attention_backward_op.register_fake
def _(Q: Tensor, K: Tensor, V: Tensor, O: Tensor, L: Tensor, dO: Tensor, is_causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    return Q.new_empty(Q.shape), K.new_empty(K.shape), V.new_empty(V.shape)


def _save_for_backward(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    Q, K, V, is_causal = inputs
    O, L = output
    ctx.save_for_backward(Q, K, V, O, L)
    ctx.is_causal = is_causal
    ctx.mark_non_differentiable(L)


def _forward_op_backward(ctx, dO: Tensor, dL: Tensor | None):
    Q, K, V, O, L = ctx.saved_tensors
    dQ, dK, dV = flash_attention_backward_op(Q, K, V, O, L, dO, ctx.is_causal)
    return dQ, dK, dV, None


flash_attention_forward_op.register_autograd(_forward_op_backward, setup_context=_save_for_backward)


class FlashAttention2Triton(torch.autograd.Function):
    """FlashAttention-2 in Triton: ``FlashAttention2Triton.apply(Q, K, V, is_causal=False) -> O``.

    Saved for backward: Q, K, V, O and the logsumexp L, float32 natural log, of shape
    ``(batch, n_queries)`` (``(batch, heads, n_queries)`` for 4-D inputs), the only saved tensor of
    that shape. Gradients come back in the inputs' dtype.
    """

    @staticmethod
    def forward(ctx, Q: Tensor, K: Tensor, V: Tensor, is_causal: bool = False) -> Tensor:
        _check_triton_inputs(Q, K, V)
        O, L = flash_attention_forward_op(Q, K, V, bool(is_causal))
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.is_causal = bool(is_causal)
        return O

    @staticmethod
    def backward(ctx, dO: Tensor):
        Q, K, V, O, L = ctx.saved_tensors
        dQ, dK, dV = flash_attention_backward_op(Q, K, V, O, L, dO, ctx.is_causal)
        return dQ, dK, dV, None


def flash_attention(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    is_causal: bool = False,
) -> Float[Tensor, "batch *heads q d"]:
    """FlashAttention-2 with the model's attention protocol: the forward operator, differentiated through its
    registered autograd formula (the backward operator). Same results as :class:`FlashAttention2Triton`."""
    _check_triton_inputs(Q, K, V)
    return flash_attention_forward_op(Q, K, V, bool(is_causal))[0]
