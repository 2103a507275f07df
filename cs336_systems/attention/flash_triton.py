"""FlashAttention-2 in Triton (SPEC sections 3.2-3.4): input checks, launch parameters, the launch code, the
PyTorch operators and the ``torch.autograd.Function``. The kernels are in ``flash_triton_kernels.py`` (portable)
and ``flash_hopper.py`` (Gluon, Hopper GPUs).

    O = FlashAttention2Triton.apply(Q, K, V, is_causal)       # or flash_attention(Q, K, V, is_causal)

Q is ``(batch, n_queries, d)`` and K, V are ``(batch, n_keys, d)``, or all four-dimensional
``(batch, heads, seq, d)``; any lengths (``n_queries != n_keys`` allowed, the causal rule being
``i >= j`` on absolute indices), ``d`` in 16, 32, 64, 128 (other multiples of 8 up to 128 zero-padded), dtype
float16, bfloat16 or float32 (float32 matmuls use TF32 exactly when PyTorch's may:
``torch.backends.cuda.matmul.allow_tf32 = True`` or ``torch.set_float32_matmul_precision("high")``).
Inputs may be non-contiguous; a copy is made only when the last dimension is strided.

Which kernels run is :data:`cs336_systems.attention.config.FLASH_CONFIG`: on Hopper GPUs, 16-bit inputs with
enough work run the Gluon kernels; everything else the portable Triton kernels: a forward, then a backward of
two launches (Delta = rowsum(O * dO); then one kernel whose program ``i`` computes dK and dV of key tile ``i``
and dQ of query tile ``i``, recomputing P for each: no atomics, deterministic).

Launch parameters of the Triton kernels: on a GPU, fixed tiles per dtype and head dim (:func:`fixed_config`, from
autotuner timings), compiled once per (dtype, head dim, causal) whatever the lengths; ``FlashConfig.autotune``
lets ``triton.autotune`` pick them per length bucket instead. Under ``TRITON_INTERPRET=1`` (CPU), one small
configuration with unequal tiles, so that the tests exercise every masking path at small sizes in seconds.

Host cost. Eager calls go from the autograd Function straight to the launch code (no operator dispatch); the
launch code caches what a call's launches need under the call's shapes, strides and dtype, and launches through
:class:`cs336_systems.kernels.launch.Launcher` (no per-call argument binding by Triton). Input checks run once,
in the Function's forward. Under ``torch.compile`` (or a dispatch mode such as selective checkpointing) the
Function calls the same code through two operators, ``cs336_systems::flash_attention_forward`` and
``_backward``, which Inductor calls as opaque kernels: no graph break, and CUDA graphs capture them.
"""

from __future__ import annotations

import math

import torch
import triton
from jaxtyping import Float
from torch import Tensor

from cs336_systems.attention import flash_hopper
from cs336_systems.attention import flash_triton_kernels as kernels
from cs336_systems.attention.config import FLASH_CONFIG, runs_hopper
from cs336_systems.attention.reference import check_attention_inputs, check_is_causal
from cs336_systems.kernels.launch import (
    FLOAT_DTYPES,
    RUNNING_IN_INTERPRETER,
    Launcher,
    aligned,
    check_device,
    new_output,
    unit_last_stride,
)

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension, which runs over batch * heads


# ---------------------------------------------------------------------------------------------------
# Launch parameters of the Triton kernels
# ---------------------------------------------------------------------------------------------------


def _config(block_m: int, block_n: int, num_warps: int, num_stages: int) -> triton.Config:
    """A forward configuration: BLOCK_M queries held, BLOCK_N keys per step."""
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages)


def _bwd_config(tile: int, slice_: int, num_warps: int, num_stages: int) -> triton.Config:
    """A backward configuration: TILE keys (then queries) held, SLICE queries (then keys) per step."""
    return triton.Config({"TILE": tile, "SLICE": slice_}, num_warps=num_warps, num_stages=num_stages)


# The forward holds a query tile and sweeps key tiles. The backward holds a large tile (keys for dK/dV, then
# queries for dQ) and sweeps small slices, which keeps its two float32 accumulators in registers. Float32 gets
# smaller tiles: without TF32, tl.dot runs on the FMA units and larger tiles spill registers (checked by compiling
# for sm_90 with ptxas).
AUTOTUNE_CONFIGS = {
    "fwd": {
        "16-bit": [_config(128, 64, 4, 3), _config(128, 64, 8, 3), _config(128, 128, 8, 3), _config(128, 32, 4, 4),
                   _config(128, 64, 4, 4), _config(128, 128, 8, 4), _config(64, 64, 4, 3), _config(64, 32, 4, 2)],
        "32-bit": [_config(32, 16, 4, 2), _config(32, 16, 8, 2), _config(32, 32, 4, 2), _config(64, 16, 8, 2)],
    },
    "bwd": {
        "16-bit": [_bwd_config(128, 64, 8, 3), _bwd_config(128, 32, 8, 3), _bwd_config(128, 32, 8, 4),
                   _bwd_config(64, 64, 4, 2), _bwd_config(64, 64, 4, 3), _bwd_config(64, 32, 4, 3),
                   _bwd_config(64, 32, 8, 2), _bwd_config(64, 16, 4, 3)],
        "32-bit": [_bwd_config(32, 16, 4, 1), _bwd_config(32, 16, 8, 1), _bwd_config(32, 32, 8, 1)],
    },
}
INTERPRETER_CONFIGS = {"fwd": _config(32, 16, 4, 1), "bwd": _bwd_config(32, 16, 4, 1)}
DELTA_CONFIG = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=1)  # also the dQ conversion's

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
        fitting = [c for c in candidates
                   if _shared_memory_estimate(kernel, c, head_dim, element_size) <= SHARED_MEMORY_BUDGET]
        return fitting or [min(candidates, key=lambda c: _shared_memory_estimate(kernel, c, head_dim, element_size))]

    return prune


_PLAIN = {"fwd": kernels.attn_fwd_kernel, "bwd": kernels.attn_bwd_kernel}
_PARALLEL_BLOCK = {"fwd": "BLOCK_M", "bwd": "TILE"}
# Coarsened lengths (next power of two) bound how often the autotuner runs; the dtype of the tensor arguments
# is part of every key automatically.
_AUTOTUNE_KEY = ["n_queries_key", "n_keys_key", "HEAD_DIM", "IS_CAUSAL", "DOT_PRECISION"]
_AUTOTUNED = {
    name: triton.autotune([c for group in AUTOTUNE_CONFIGS[name].values() for c in group], key=_AUTOTUNE_KEY,
                          prune_configs_by={"early_config_prune": _pruner(name)})(_PLAIN[name])
    for name in _PLAIN
}
_LAUNCHERS = {name: Launcher(fn) for name, fn in _PLAIN.items()}
_DELTA = Launcher(kernels.attn_bwd_delta_kernel)
_DQ_CONVERT = Launcher(kernels.attn_bwd_dq_convert_kernel)


def fixed_config(kernel: str, dtype: torch.dtype, head_dim: int) -> triton.Config:
    """The configuration of ``kernel`` ("fwd" or "bwd") when not autotuning: the fastest in the autotuner's H100
    timings at 16384 tokens (bf16, causal) among those with no register spills at any head dim (checked with
    ptxas for sm_90)."""
    if RUNNING_IN_INTERPRETER:
        return INTERPRETER_CONFIGS[kernel]
    if dtype == torch.float32:
        num_warps = 4 if head_dim <= 64 else 8
        return _config(32, 16, num_warps, 2) if kernel == "fwd" else _bwd_config(32, 16, num_warps, 1)
    if kernel == "fwd":
        return _config(128, 64, 8, 3)
    return _bwd_config(128, 64, 8, 3) if head_dim <= 64 else _bwd_config(128, 32, 8, 3)


_chosen: dict[tuple, triton.Config] = {}
"""The autotuner's choice per (kernel, autotune key)."""


def _tiles(kernel: str, dtype: torch.dtype, head_dim: int, autotune_key: tuple, args: tuple, meta: dict,
           n_parallel: int, batch_heads: int) -> triton.Config | None:
    """The configuration to launch ``kernel`` with: fixed, or the autotuner's choice for this key (None when the
    autotuner has just run, and launched, for it)."""
    if not FLASH_CONFIG.get().autotune or RUNNING_IN_INTERPRETER:
        return fixed_config(kernel, dtype, head_dim)
    key = (kernel, dtype, *autotune_key, *meta.values())
    if key not in _chosen:
        block = _PARALLEL_BLOCK[kernel]
        _AUTOTUNED[kernel][lambda META: (triton.cdiv(n_parallel, META[block]), batch_heads)](*args, **meta)
        _chosen[key] = _AUTOTUNED[kernel].best_config
        return None
    return _chosen[key]


def _launch(kernel: str, n_parallel: int, batch_heads: int, signature: tuple, args: tuple, meta: dict,
            autotune_key: tuple) -> None:
    """Run ``kernel`` on the grid ``(cdiv(n_parallel, tile), batch * heads)``; ``signature`` holds what its
    compilation depends on beyond ``meta`` (dtype, strides, alignment)."""
    dtype, head_dim = signature[0], meta["HEAD_DIM"]
    config = _tiles(kernel, dtype, head_dim, autotune_key, args, meta, n_parallel, batch_heads)
    if config is None:
        return
    grid = (triton.cdiv(n_parallel, config.kwargs[_PARALLEL_BLOCK[kernel]]), batch_heads)
    key = (signature, *meta.values(), *config.kwargs.values(), config.num_warps, config.num_stages)
    # Only the tiles, warps and stages: torch.compile refuses num_ctas passed as a launch argument.
    _LAUNCHERS[kernel](key, grid, args, {**meta, **config.kwargs}, num_warps=config.num_warps,
                       num_stages=config.num_stages)


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


def _strides(x: Tensor) -> tuple[int, int, int]:
    """(batch, head, sequence) strides, with head stride 0 for 3-D tensors."""
    if x.dim() == 3:
        return x.stride(0), 0, x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


# ---------------------------------------------------------------------------------------------------
# Launch code: inputs checked by the caller, with unit stride along d and a supported d
# ---------------------------------------------------------------------------------------------------


def _uses_hopper(Q: Tensor, batch_heads: int, n_tiles: int, part: str) -> bool:
    if RUNNING_IN_INTERPRETER:
        return False
    config = FLASH_CONFIG.get()
    return runs_hopper(config, Q.device, Q.dtype, Q.shape[-1], part,
                       batch_heads * n_tiles >= config.hopper_min_programs)


def flash_attention_forward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    is_causal: bool, sm_scale: float | None = None,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads q"]]:
    """``O`` (Q's shape and dtype, contiguous) and the natural-log logsumexp ``L`` (float32)."""
    n_heads, batch_heads, n_queries, n_keys, head_dim = flash_hopper.attention_sizes(Q, K)
    O = new_output(Q.shape, Q.dtype, Q.device)
    L = new_output(Q.shape[:-1], torch.float32, Q.device)
    sm_scale = sm_scale or 1.0 / math.sqrt(head_dim)
    if _uses_hopper(Q, batch_heads, -(-n_queries // (2 * flash_hopper.FORWARD_ROWS)), "forward"):
        flash_hopper.forward(Q, K, V, O, L, is_causal, sm_scale)
        return O, L
    args = (
        Q, K, V, O, L,
        *_strides(Q), *_strides(K), *_strides(V), *_strides(O),
        n_heads, n_queries, n_keys, _length_key(n_queries), _length_key(n_keys),
        sm_scale * math.log2(math.e),
    )
    meta = dict(HEAD_DIM=head_dim, IS_CAUSAL=is_causal, DOT_PRECISION=_dot_precision(Q.dtype))
    # Triton specialises the strides (and the pointers' alignment); O's follow from Q's shape.
    signature = (Q.dtype, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(), aligned(Q, K, V))
    _launch("fwd", n_queries, batch_heads, signature, args, meta, (args[-3], args[-2]))
    return O, L


def flash_attention_backward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    O: Float[Tensor, "batch *heads q d"], L: Float[Tensor, "batch *heads q"], dO: Float[Tensor, "batch *heads q d"],
    is_causal: bool, sm_scale: float | None = None,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads k d"], Float[Tensor, "batch *heads k d"]]:
    """``dQ, dK, dV`` (in the inputs' dtype, contiguous) from the saved forward state and the output gradient.
    ``O`` and ``L`` are the forward's (contiguous)."""
    dO = unit_last_stride(dO if dO.dtype == O.dtype else dO.to(O.dtype))  # o.sum().backward() sends stride 0
    n_heads, batch_heads, n_queries, n_keys, head_dim = flash_hopper.attention_sizes(Q, K)
    sm_scale = sm_scale or 1.0 / math.sqrt(head_dim)
    hopper = _uses_hopper(Q, batch_heads, -(-n_keys // flash_hopper.BLOCK_N), "backward")
    Delta = new_output((batch_heads, n_queries), torch.float32, Q.device)
    # The Hopper backward adds dS K over key tiles into a float32 buffer, which the delta kernel zeroes.
    DQ_acc = torch.empty((batch_heads, n_queries, head_dim), dtype=torch.float32, device=Q.device) if hopper else L
    delta_grid = (-(-n_queries // DELTA_CONFIG.kwargs["BLOCK_M"]), batch_heads)
    _DELTA((O.dtype, O.shape, O.stride(), dO.stride(), aligned(O, dO), hopper), delta_grid,
           (O, dO, Delta, *_strides(O), *_strides(dO), n_heads, n_queries, DQ_acc),
           dict(HEAD_DIM=head_dim, ZERO_DQ_ACC=hopper, **DELTA_CONFIG.kwargs), num_warps=DELTA_CONFIG.num_warps)
    dQ = new_output(Q.shape, Q.dtype, Q.device)
    dK = new_output(K.shape, K.dtype, K.device)
    dV = new_output(V.shape, V.dtype, V.device)
    if hopper:
        flash_hopper.backward(Q, K, V, dO, L, Delta, dK, dV, DQ_acc, is_causal, sm_scale)
        _DQ_CONVERT((dQ.dtype, dQ.shape), delta_grid, (DQ_acc, dQ, *_strides(dQ), n_heads, n_queries, sm_scale),
                    dict(HEAD_DIM=head_dim, **DELTA_CONFIG.kwargs), num_warps=DELTA_CONFIG.num_warps)
        return dQ, dK, dV
    args = (
        Q, K, V, dO, L, Delta, dQ, dK, dV,
        *_strides(Q), *_strides(K), *_strides(V), *_strides(dO), *_strides(dQ), *_strides(dK), *_strides(dV),
        n_heads, n_queries, n_keys, _length_key(n_queries), _length_key(n_keys), sm_scale, sm_scale * math.log2(math.e),
    )
    meta = dict(HEAD_DIM=head_dim, IS_CAUSAL=is_causal, DOT_PRECISION=_dot_precision(Q.dtype))
    signature = (Q.dtype, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(), dO.stride(), aligned(Q, K, V, dO))
    _launch("bwd", max(n_queries, n_keys), batch_heads, signature, args, meta, (args[-5], args[-4]))
    return dQ, dK, dV


# ---------------------------------------------------------------------------------------------------
# Head dims between the kernels' run zero-padded (zero features change no score or output)
# ---------------------------------------------------------------------------------------------------


def _padded_head_dim(head_dim: int) -> int:
    return min(d for d in SUPPORTED_HEAD_DIMS if d >= head_dim)


def _pad(x: Tensor, head_dim: int) -> Tensor:
    """``x`` with zeros appended along ``d`` up to ``head_dim`` (a new, contiguous tensor)."""
    return torch.nn.functional.pad(x, (0, head_dim - x.shape[-1]))


def attention_forward(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool) -> tuple[Tensor, Tensor]:
    """``(O, L)`` for inputs of any strides and any supported ``d`` (checked by the caller)."""
    head_dim = Q.shape[-1]
    if head_dim in SUPPORTED_HEAD_DIMS:
        return flash_attention_forward(unit_last_stride(Q), unit_last_stride(K), unit_last_stride(V), is_causal)
    padded = _padded_head_dim(head_dim)
    O, L = flash_attention_forward(_pad(Q, padded), _pad(K, padded), _pad(V, padded), is_causal,
                                   1.0 / math.sqrt(head_dim))
    return O[..., :head_dim].contiguous(), L


def attention_backward(Q: Tensor, K: Tensor, V: Tensor, O: Tensor, L: Tensor, dO: Tensor,
                       is_causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV)`` of :func:`attention_forward`'s inputs."""
    head_dim = Q.shape[-1]
    if head_dim in SUPPORTED_HEAD_DIMS:
        return flash_attention_backward(unit_last_stride(Q), unit_last_stride(K), unit_last_stride(V), O, L, dO,
                                        is_causal)
    padded = _padded_head_dim(head_dim)
    Q, K, V, O, dO = (_pad(x, padded) for x in (Q, K, V, O, dO))
    dQ, dK, dV = flash_attention_backward(Q, K, V, O, L, dO, is_causal, 1.0 / math.sqrt(head_dim))
    return tuple(g[..., :head_dim].contiguous() for g in (dQ, dK, dV))


# ---------------------------------------------------------------------------------------------------
# PyTorch operators (for torch.compile and dispatch modes), the autograd Function, the functional entry point
# ---------------------------------------------------------------------------------------------------

_LIBRARY = torch.library.Library("cs336_systems", "FRAGMENT")
_LIBRARY.define("flash_attention_forward(Tensor Q, Tensor K, Tensor V, bool is_causal) -> (Tensor, Tensor)")
_LIBRARY.define("flash_attention_backward(Tensor Q, Tensor K, Tensor V, Tensor O, Tensor L, Tensor dO, "
                "bool is_causal) -> (Tensor, Tensor, Tensor)")
# Registered straight with the dispatcher (not custom_op, whose Python wrappers cost tens of microseconds a call).
# The CPU kernels serve the Triton interpreter; elsewhere the launch code raises on CPU tensors.
for _device_key in ("CUDA", "CPU"):
    _LIBRARY.impl("flash_attention_forward", attention_forward, _device_key)
    _LIBRARY.impl("flash_attention_backward", attention_backward, _device_key)


@torch.library.register_fake("cs336_systems::flash_attention_forward")
def _(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool) -> tuple[Tensor, Tensor]:
    return Q.new_empty(Q.shape), Q.new_empty(Q.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("cs336_systems::flash_attention_backward")
def _(Q: Tensor, K: Tensor, V: Tensor, O: Tensor, L: Tensor, dO: Tensor, is_causal: bool) -> tuple[Tensor, ...]:
    return Q.new_empty(Q.shape), K.new_empty(K.shape), V.new_empty(V.shape)


def _through_operators() -> bool:
    """Whether to call the operators instead of the launch code: while torch.compile traces, and under a dispatch
    mode (selective checkpointing keeps the forward operator's outputs by name)."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def check_inputs(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool) -> None:
    """Raise a clear error for inputs our attention does not take."""
    check_is_causal(is_causal)
    check_attention_inputs(Q, K, V)
    if Q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"unsupported dtype {Q.dtype}: the Triton kernels take float16, bfloat16 or float32")
    if Q.shape[-1] > max(SUPPORTED_HEAD_DIMS) or Q.shape[-1] % 8:
        raise ValueError(
            f"unsupported head dimension d={Q.shape[-1]}: the Triton kernels run d in {SUPPORTED_HEAD_DIMS}, and "
            f"other multiples of 8 up to {max(SUPPORTED_HEAD_DIMS)} zero-padded to the next of those"
        )
    check_device(Q, "the Triton kernels", "cs336_systems.attention.flash_triton_kernels")
    batch_heads = math.prod(Q.shape[:-2])
    if batch_heads > MAX_GRID_Y:
        raise ValueError(f"batch * heads = {batch_heads} exceeds the grid limit {MAX_GRID_Y}")


class FlashAttention2Triton(torch.autograd.Function):
    """FlashAttention-2 in Triton: ``FlashAttention2Triton.apply(Q, K, V, is_causal=False) -> O``.

    Saved for backward: Q, K, V, O and the logsumexp L, float32 natural log, of shape
    ``(batch, n_queries)`` (``(batch, heads, n_queries)`` for 4-D inputs), the only saved tensor of
    that shape. Gradients come back in the inputs' dtype.
    """

    @staticmethod
    def forward(ctx, Q: Tensor, K: Tensor, V: Tensor, is_causal: bool = False) -> Tensor:
        check_inputs(Q, K, V, is_causal)
        if _through_operators():
            O, L = torch.ops.cs336_systems.flash_attention_forward.default(Q, K, V, is_causal)
        else:
            O, L = attention_forward(Q, K, V, is_causal)
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO: Tensor):
        if _through_operators():
            grads = torch.ops.cs336_systems.flash_attention_backward.default(*ctx.saved_tensors, dO, ctx.is_causal)
        else:
            grads = attention_backward(*ctx.saved_tensors, dO, ctx.is_causal)
        return *grads, None


def flash_attention(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    is_causal: bool = False,
) -> Float[Tensor, "batch *heads q d"]:
    """FlashAttention-2 with the model's attention protocol ``fn(Q, K, V, is_causal) -> O``."""
    return FlashAttention2Triton.apply(Q, K, V, is_causal)
