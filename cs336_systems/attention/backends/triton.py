"""The portable Triton backend: FlashAttention-2's launch code for the kernels of ``triton_kernels.py`` (any CUDA
GPU; float16, bfloat16, float32; head dims 16, 32, 64, 128, and 48, 80, 96 as two column parts (see
:func:`head_dim_parts`); the CPU under ``TRITON_INTERPRET=1``). Same interface
as every backend: :func:`supports`, :func:`kernel_head_dims`, :func:`forward`, :func:`backward`.

The forward is one launch; the backward two: Delta = rowsum(O * dO), then one kernel whose program ``i`` computes
dK and dV of key tile ``i`` and dQ of query tile ``i``, recomputing P for each (no atomics, deterministic).
Float32 calls of few programs on a GPU (one head of a few thousand tokens) split their sweeps instead: the forward
each query tile's keys over programs, the parts combined by their logsumexp (:func:`split_forward`, two launches;
:func:`key_splits` says when), the backward each program's sweeps into partial sums added in order
(:func:`split_backward`, five launches; :func:`sweep_splits`).

Launch parameters: on a GPU, fixed tiles per dtype and head dim (:func:`fixed_config`, from autotuner timings),
compiled once per (dtype, head dim, causal) whatever the lengths; ``FlashConfig.autotune`` lets
``triton.autotune`` pick them per length bucket instead (its key and pruning below). Under ``TRITON_INTERPRET=1``
(CPU), one small configuration with unequal tiles, so that the tests exercise every masking path at small sizes in
seconds; the interpreter's ``tl.dot`` is wrong on bfloat16, so bfloat16 inputs run there in float32 (rounded back
at the end).

Host cost. A call's launch plan (the arguments after the tensors, the grid, the constexprs) is kept per signature
(dtype, shapes, strides, alignment, constexprs) and scale; the kernels launch as
:class:`cs336_systems.kernels.launch.Kernel` objects, which choose a configuration once per signature and launch
the compiled kernel without Triton's per-call argument binding. Float32 matmuls use TF32 exactly when PyTorch's
may (``torch.backends.cuda.matmul.allow_tf32 = True`` or ``torch.set_float32_matmul_precision("high")``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
from jaxtyping import Float
from torch import Tensor

from cs336_systems.attention.backends import triton_kernels
from cs336_systems.attention.config import FLASH_CONFIG
from cs336_systems.kernels.launch import (
    FLOAT_DTYPES,
    Grid,
    Kernel,
    aligned,
    interpreting,
    new_output,
    unsupported_device,
)

HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128)
"""Head dims the kernels run without padding: a power of two from 16, or (48, 80, 96) the sum of two unequal ones,
each at least 16 (``tl.dot``'s narrowest inner dimension)."""
_LOG2_E = math.log2(math.e)


def head_dim_parts(head_dim: int) -> tuple[int, int]:
    """The two column parts ``(HEAD_DIM_A, HEAD_DIM_B)`` the kernels hold a head dim of :data:`HEAD_DIMS` in:
    ``(head_dim, 0)`` for a power of two, else the largest power of two below it and the rest (``80 = 64 + 16``).
    ``tl.arange`` and ``tl.dot`` take power-of-two widths: each part is one, and QK^T is the sum of the parts'
    products, so that d = 80 does 80 columns of work where padding to 128 did 128."""
    first = 1 << (head_dim.bit_length() - 1)
    return first, head_dim - first


def supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why these kernels cannot run on such inputs, or None when they can."""
    if dtype not in FLOAT_DTYPES:
        return f"unsupported dtype {dtype}: the Triton kernels take float16, bfloat16 or float32"
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} (needs one of {HEAD_DIMS})"
    return unsupported_device(device, "the Triton kernels", "cs336_systems.attention")


def kernel_head_dims(part: str) -> tuple[int, ...]:
    """The head dims the kernels run ``part`` ("forward" or "backward") at without padding: :data:`HEAD_DIMS`."""
    return HEAD_DIMS


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
HOPPER = 90
"""The compute capability the fixed tiles were timed on (H100)."""
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


# Coarsened lengths (next power of two) bound how often the autotuner runs; the dtype of the tensor arguments
# is part of every key automatically.
_AUTOTUNE_KEY = ["n_queries_key", "n_keys_key", "HEAD_DIM", "IS_CAUSAL", "DOT_PRECISION"]
KERNELS = {
    name: Kernel(kernel, [c for group in AUTOTUNE_CONFIGS[name].values() for c in group], _AUTOTUNE_KEY, _pruner(name))
    for name, kernel in (("fwd", triton_kernels.attn_fwd_kernel), ("bwd", triton_kernels.attn_bwd_kernel))
}
"""The forward and the backward as launched: a configuration per key (fixed, or the autotuner's pick; the autotuner
itself keeps one pick per autotune key, so a new shape in a tuned length bucket only looks it up)."""
DELTA_KERNEL = Kernel(triton_kernels.attn_bwd_delta_kernel)
"""Delta = rowsum(O * dO) (and the Hopper backward's float32 dQ accumulator zeroed), at :data:`DELTA_CONFIG`."""


def fixed_config(kernel: str, dtype: torch.dtype, head_dim: int, precision: str = "ieee",
                 capability: int = HOPPER) -> triton.Config:
    """The configuration of ``kernel`` ("fwd" or "bwd") when not autotuning: the fastest in the autotuner's H100
    timings at 16384 tokens (bf16, causal) among those with no register spills at any head dim (checked with
    ptxas for sm_90). Float32 with ``precision`` "tf32x3" (three products on the tensor cores, each operand split in
    two) takes, up to head dim 64, the largest tiles ptxas for sm_90 fits in the registers (none spill); at 128 the
    fastest of a sweep on one H100 (1 x 16384 x 128, causal: forward 64 x 32 tiles 2.73 ms against 5.60 at
    32 x 16, which spill least; backward 32 x 32 keys x queries at 4 warps 7.71 ms against 18.35 at 32 x 16), though
    they spill 256 and 472 bytes.

    Head dim 80 (64 + 16 columns) takes in 16 bits the tiles the autotuner picked on an H100 (``capability`` 90) at
    4 x 32 heads x 2048 x 80 and 1 x 32 x 8192 x 80 (causal): forward 128 x 64 at 4 warps (0.280 ms against 0.346 at
    128's tiles, which run 8 warps), backward 64 x 64 at 4 warps (1.009 against 1.179 ms); for other GPUs the forward
    keeps 8 warps (at 4 it spills 8 bytes for sm_100). 48 and 96 keep the tiles of 64 and 128 (at 96 that forward
    would spill 48 bytes). In IEEE float32 the split head dims take the tiles of the next power of two, whose
    accumulators are as wide or wider; with tf32x3 they keep the 32 x 16 tiles that spill least (the
    backward at 48 spills 224 bytes at 64's tiles and 8 at these; at 80 and 96 152 and 488 bytes; not timed against
    padding to 128)."""
    if interpreting():
        return INTERPRETER_CONFIGS[kernel]
    if dtype == torch.float32 and precision == "tf32x3":
        if kernel == "fwd" and head_dim <= 64:
            return _config(128, 32, 8, 2)
        if head_dim_parts(head_dim)[1]:  # 80 and 96 (and 48's backward): the tiles that spill least
            return _config(32, 16, 8, 2) if kernel == "fwd" else _bwd_config(32, 16, 8, 1)
        return _config(64, 32, 4, 2) if kernel == "fwd" else _bwd_config(32, 32, 4, 1)
    if dtype == torch.float32:
        num_warps = 4 if head_dim <= 64 else 8
        return _config(32, 16, num_warps, 2) if kernel == "fwd" else _bwd_config(32, 16, num_warps, 1)
    if head_dim_parts(head_dim) == (64, 16):  # 80: the autotuner's pick on an H100
        forward_warps = 4 if capability == HOPPER else 8  # 4 warps spill 8 bytes for sm_100
        return _config(128, 64, forward_warps, 3) if kernel == "fwd" else _bwd_config(64, 64, 4, 3)
    if kernel == "fwd":
        return _config(128, 64, 8, 3)
    return _bwd_config(128, 64, 8, 3) if head_dim <= 64 else _bwd_config(128, 32, 8, 3)


def _capability(device: torch.device) -> int:
    """The GPU's compute capability as one number (90 for 9.0); :data:`HOPPER` elsewhere (the interpreter's CPU)."""
    if device.type != "cuda":
        return HOPPER
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _delta_config() -> triton.Config:
    return DELTA_CONFIG


class LaunchPlan(NamedTuple):
    """A launch as fixed by the call's signature (dtype, shapes, strides, alignment, constexprs) and scale: the
    arguments after the tensors (strides, sizes, coarsened lengths, scales), ``(batch * heads, the rows the grid's
    first dimension covers)``, the grid as a function of the tiles, the constexprs, and the rule of the fixed
    configuration (see :class:`cs336_systems.kernels.launch.Kernel`)."""

    tail: tuple
    rows: tuple[int, int]
    grid: Grid
    constexprs: dict
    fixed: Callable[[], triton.Config]


_plans: dict[tuple, LaunchPlan] = {}
"""The launch plans, per ("fwd" | "bwd", signature, scale) and ("delta", signature)."""


def _tiled_grid(batch_heads: int, n_rows: int, tile: str) -> Grid:
    """The grid ``(cdiv(n_rows, tiles[tile]), batch * heads)``."""
    return lambda tiles: (-(-n_rows // tiles[tile]), batch_heads)


def _dot_precision(dtype: torch.dtype) -> str:
    """TF32 for float32 exactly when PyTorch's own matmuls may use it, else ``FlashConfig.fp32_products`` ("ieee" or
    "tf32x3"); 16-bit inputs take the default.

    Reads ``torch.backends.cuda.matmul.fp32_precision``, which ``allow_tf32 = True`` and
    ``torch.set_float32_matmul_precision("high")`` also set, and which (unlike ``allow_tf32``) does not
    raise once a program has mixed the legacy and the new precision APIs.
    """
    if dtype == torch.float32 and not _pytorch_allows_tf32():
        return FLASH_CONFIG.get().fp32_products
    return "tf32"


def _pytorch_allows_tf32() -> bool:
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


def _length_key(n: int) -> int:
    """The next power of two (plain Python: ``triton.next_power_of_2`` costs microseconds per call)."""
    return 1 << (n - 1).bit_length()


def batch_head_strides(x: Tensor) -> tuple[int, int, int]:
    """(batch, head, sequence) strides, with head stride 0 for 3-D tensors."""
    if x.dim() == 3:
        return x.stride(0), 0, x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


def _sizes(Q: Tensor, K: Tensor) -> tuple[int, int, int, int, int]:
    """(heads, batch * heads, n_queries, n_keys, d)."""
    n_heads = Q.shape[1] if Q.dim() == 4 else 1
    return n_heads, Q.shape[0] * n_heads, Q.shape[-2], K.shape[-2], Q.shape[-1]


# ---------------------------------------------------------------------------------------------------
# The kernels' arguments before their constexprs, by name
# ---------------------------------------------------------------------------------------------------


class ForwardArgs(NamedTuple):
    """``attn_fwd_kernel``'s arguments; strides are (batch, head, sequence) (:func:`batch_head_strides`)."""

    Q: Tensor
    K: Tensor
    V: Tensor
    O: Tensor
    L: Tensor
    stride_qb: int
    stride_qh: int
    stride_qm: int
    stride_kb: int
    stride_kh: int
    stride_kn: int
    stride_vb: int
    stride_vh: int
    stride_vn: int
    stride_ob: int
    stride_oh: int
    stride_om: int
    n_heads: int
    n_queries: int
    n_keys: int
    n_queries_key: int  # coarsened lengths: the autotuner's key
    n_keys_key: int
    qk_scale: float


class BackwardArgs(NamedTuple):
    """``attn_bwd_kernel``'s arguments; strides are (batch, head, sequence) (:func:`batch_head_strides`)."""

    Q: Tensor
    K: Tensor
    V: Tensor
    dO: Tensor
    L: Tensor
    Delta: Tensor
    dQ: Tensor
    dK: Tensor
    dV: Tensor
    stride_qb: int
    stride_qh: int
    stride_qm: int
    stride_kb: int
    stride_kh: int
    stride_kn: int
    stride_vb: int
    stride_vh: int
    stride_vn: int
    stride_dob: int
    stride_doh: int
    stride_dom: int
    stride_dqb: int
    stride_dqh: int
    stride_dqm: int
    stride_dkb: int
    stride_dkh: int
    stride_dkn: int
    stride_dvb: int
    stride_dvh: int
    stride_dvn: int
    n_heads: int
    n_queries: int
    n_keys: int
    n_queries_key: int
    n_keys_key: int
    sm_scale: float
    qk_scale: float


class DeltaArgs(NamedTuple):
    """``attn_bwd_delta_kernel``'s arguments."""

    O: Tensor
    dO: Tensor
    Delta: Tensor
    stride_ob: int
    stride_oh: int
    stride_om: int
    stride_dob: int
    stride_doh: int
    stride_dom: int
    n_heads: int
    n_queries: int
    DQ_acc: Tensor


# ---------------------------------------------------------------------------------------------------
# Forward and backward: inputs checked by the operator, with unit stride along d and a supported d
# ---------------------------------------------------------------------------------------------------


def forward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    is_causal: bool, sm_scale: float,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads q"]]:
    """``O`` (Q's shape and dtype, contiguous) and the natural-log logsumexp ``L`` (float32)."""
    if interpreting() and Q.dtype == torch.bfloat16:
        O, L = forward(Q.float(), K.float(), V.float(), is_causal, sm_scale)
        return O.to(torch.bfloat16), L
    n_splits = forward_key_splits(Q, K, is_causal)
    if n_splits > 1:
        return split_forward(Q, K, V, is_causal, sm_scale, n_splits)
    O = new_output(Q.shape, Q.dtype, Q.device)
    L = new_output(Q.shape[:-1], torch.float32, Q.device)
    # What the compilation depends on: Triton specialises the strides and the pointers' alignment; O's strides
    # follow from Q's shape.
    signature = (Q.dtype, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(), aligned(Q, K, V), is_causal,
                 _dot_precision(Q.dtype))
    plan = _plans.get(("fwd", signature, sm_scale))
    if plan is None:
        plan = _plans[("fwd", signature, sm_scale)] = _forward_plan(Q, K, V, O, is_causal, sm_scale)
    KERNELS["fwd"](signature, plan.grid, ForwardArgs(Q, K, V, O, L, *plan.tail), plan.constexprs, plan.fixed,
                   autotune=FLASH_CONFIG.get().autotune)
    return O, L


MIN_KEYS_PER_SPLIT = 512
"""The forward split over keys gives each part at least this many keys (fewer keys per part: the combination's
extra pass costs more than the shorter sweep saves)."""


def key_splits(n_queries: int, n_keys: int, batch_heads: int, block_m: int, is_causal: bool,
               multiprocessors: int) -> int:
    """Into how many parts the forward splits each query tile's keys (1: no split). A call takes at least as long
    as its heaviest tile's sweep (all ``n_keys`` keys, causal or not); when that is at least twice the keys each
    multiprocessor would sweep with the work spread evenly (few tiles, or causal tiles of unequal work), each tile's
    keys are cut into about that ratio of parts, each of at least :data:`MIN_KEYS_PER_SPLIT` keys."""
    tiles = -(-n_queries // block_m)
    if is_causal:  # tile i sweeps the keys up to its last query
        swept = sum(min(n_keys, (i + 1) * block_m) for i in range(tiles))
    else:
        swept = tiles * n_keys
    even_share = batch_heads * swept / multiprocessors
    parts = int(n_keys // max(even_share, 1))
    if parts < 2:
        return 1
    return max(1, min(parts, n_keys // MIN_KEYS_PER_SPLIT))


def _may_split(Q: Tensor) -> bool:
    """Whether a call's sweeps may be split over more programs: float32 on a GPU at a power-of-two head dim (the
    single-head sweeps of ``flash_benchmarking``, where a one-head call gives a few dozen programs)."""
    return Q.dtype == torch.float32 and Q.device.type == "cuda" and not head_dim_parts(Q.shape[-1])[1]


def _check_split(what: str, head_dim: int, count_name: str, count: int) -> None:
    if head_dim_parts(head_dim)[1]:
        raise ValueError(f"{what} takes power-of-two head dims, not {head_dim}")
    if count < 1:
        raise ValueError(f"{count_name} must be at least 1, got {count}")


def forward_key_splits(Q: Tensor, K: Tensor, is_causal: bool) -> int:
    """The parts :func:`forward` splits this call's keys into (:func:`key_splits`, where :func:`_may_split`); else
    1."""
    if not _may_split(Q):
        return 1
    _, batch_heads, n_queries, n_keys, head_dim = _sizes(Q, K)
    return _forward_key_splits(batch_heads, n_queries, n_keys, head_dim, is_causal, _dot_precision(Q.dtype),
                               Q.device)


@functools.cache
def _forward_key_splits(batch_heads: int, n_queries: int, n_keys: int, head_dim: int, is_causal: bool,
                        precision: str, device: torch.device) -> int:
    block_m = fixed_config("fwd", torch.float32, head_dim, precision, _capability(device)).kwargs["BLOCK_M"]
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
    return key_splits(n_queries, n_keys, batch_heads, block_m, is_causal, multiprocessors)


COMBINE_CONFIG = triton.Config({"BLOCK_M": 32}, num_warps=4)
"""The launch of the split forward's combination (and of the split backward's sums): an elementwise pass."""
SPLIT_KERNELS = {name: Kernel(kernel) for name, kernel in (
    ("fwd", triton_kernels.attn_fwd_split_kernel), ("combine", triton_kernels.attn_fwd_combine_kernel),
    ("bwd", triton_kernels.attn_bwd_split_kernel), ("sum", triton_kernels.attn_bwd_sum_parts_kernel))}
"""The split kernels as launched: compiled once per key, then through the short path (Triton's own launch, which
binds and specialises every argument on every call, costs 50-100 us a launch on an H100 host: more than these
kernels run at a few thousand tokens)."""


def split_forward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    is_causal: bool, sm_scale: float, n_splits: int,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads q"]]:
    """:func:`forward`'s ``O`` and ``L`` with each query tile's keys split into ``n_splits`` parts, each part swept
    by a program of its own (``attn_fwd_split_kernel``), then combined by their logsumexp
    (``attn_fwd_combine_kernel``); at the fixed tiles, power-of-two head dims only."""
    n_heads, batch_heads, n_queries, n_keys, head_dim = _sizes(Q, K)
    _check_split("the forward split over keys", head_dim, "n_splits", n_splits)
    precision = _dot_precision(Q.dtype)
    # What the compilation depends on: the inputs' dtype, strides and alignment, and the sizes (the parts and the
    # outputs are fresh and contiguous, so their strides follow from the sizes).
    key = (Q.dtype, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(), aligned(Q, K, V), is_causal, precision,
           n_splits)
    O_part = new_output((n_splits, batch_heads, n_queries, head_dim), torch.float32, Q.device)
    LSE_part = new_output((n_splits, batch_heads, n_queries), torch.float32, Q.device)
    SPLIT_KERNELS["fwd"](
        key, lambda tiles: (-(-n_queries // tiles["BLOCK_M"]), batch_heads, n_splits),
        (Q, K, V, O_part, LSE_part, *batch_head_strides(Q), *batch_head_strides(K), *batch_head_strides(V),
         n_heads, n_queries, n_keys, n_splits, sm_scale * _LOG2_E),
        dict(HEAD_DIM=head_dim, IS_CAUSAL=is_causal, DOT_PRECISION=precision),
        lambda: fixed_config("fwd", Q.dtype, head_dim, precision, _capability(Q.device)))
    O = new_output(Q.shape, Q.dtype, Q.device)
    L = new_output(Q.shape[:-1], torch.float32, Q.device)
    SPLIT_KERNELS["combine"](
        key, lambda tiles: (-(-n_queries // tiles["BLOCK_M"]), batch_heads),
        (O_part, LSE_part, O, L, *batch_head_strides(O), n_heads, n_queries, n_splits), dict(HEAD_DIM=head_dim),
        lambda: COMBINE_CONFIG)
    return O, L


def _forward_plan(Q: Tensor, K: Tensor, V: Tensor, O: Tensor, is_causal: bool, sm_scale: float) -> LaunchPlan:
    n_heads, batch_heads, n_queries, n_keys, head_dim = _sizes(Q, K)
    tail = (*batch_head_strides(Q), *batch_head_strides(K), *batch_head_strides(V), *batch_head_strides(O),
            n_heads, n_queries, n_keys, _length_key(n_queries), _length_key(n_keys), sm_scale * _LOG2_E)
    constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_B=head_dim_parts(head_dim)[1], IS_CAUSAL=is_causal,
                      DOT_PRECISION=_dot_precision(Q.dtype))
    return LaunchPlan(tail, (batch_heads, n_queries), _tiled_grid(batch_heads, n_queries, "BLOCK_M"), constexprs,
                      functools.partial(fixed_config, "fwd", Q.dtype, head_dim, constexprs["DOT_PRECISION"],
                                        _capability(Q.device)))


def launch_delta(O: Float[Tensor, "batch *heads q d"], dO: Float[Tensor, "batch *heads q d"],
                 DQ_acc: Float[Tensor, "batch_heads q d"] | None = None) -> Float[Tensor, "batch_heads q"]:
    """Delta = rowsum(O * dO), float32; also zeroes the float32 ``DQ_acc`` when given (the Hopper backward's)."""
    zero_dq_acc = DQ_acc is not None
    signature = (O.dtype, O.shape, O.stride(), dO.stride(), aligned(O, dO), zero_dq_acc)
    plan = _plans.get(("delta", signature))
    if plan is None:
        plan = _plans[("delta", signature)] = _delta_plan(O, dO, zero_dq_acc)
    Delta = new_output(plan.rows, torch.float32, O.device)
    args = DeltaArgs(O, dO, Delta, *plan.tail, DQ_acc if zero_dq_acc else Delta)
    DELTA_KERNEL(signature, plan.grid, args, plan.constexprs, plan.fixed)
    return Delta


def _delta_plan(O: Tensor, dO: Tensor, zero_dq_acc: bool) -> LaunchPlan:
    n_heads, batch_heads, n_queries, _, head_dim = _sizes(O, O)
    tail = (*batch_head_strides(O), *batch_head_strides(dO), n_heads, n_queries)
    return LaunchPlan(tail, (batch_heads, n_queries), _tiled_grid(batch_heads, n_queries, "BLOCK_M"),
                      dict(HEAD_DIM=head_dim, HEAD_DIM_B=head_dim_parts(head_dim)[1], ZERO_DQ_ACC=zero_dq_acc),
                      _delta_config)


def backward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    O: Float[Tensor, "batch *heads q d"], L: Float[Tensor, "batch *heads q"], dO: Float[Tensor, "batch *heads q d"],
    is_causal: bool, sm_scale: float,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads k d"], Float[Tensor, "batch *heads k d"]]:
    """``dQ, dK, dV`` (in the inputs' dtype, contiguous) from the forward's ``O`` (contiguous) and ``L`` and the
    output gradient ``dO`` (unit stride along ``d``, O's dtype)."""
    if interpreting() and Q.dtype == torch.bfloat16:
        grads = backward(*(x.float() for x in (Q, K, V, O)), L, dO.float(), is_causal, sm_scale)
        return tuple(g.to(torch.bfloat16) for g in grads)
    n_parts = backward_splits(Q, K)
    if n_parts > 1:
        return split_backward(Q, K, V, O, L, dO, is_causal, sm_scale, n_parts)
    Delta = launch_delta(O, dO)
    dQ = new_output(Q.shape, Q.dtype, Q.device)
    dK = new_output(K.shape, K.dtype, K.device)
    dV = new_output(V.shape, V.dtype, V.device)
    signature = (Q.dtype, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(), dO.stride(), aligned(Q, K, V, dO),
                 is_causal, _dot_precision(Q.dtype))
    plan = _plans.get(("bwd", signature, sm_scale))
    if plan is None:
        plan = _plans[("bwd", signature, sm_scale)] = _backward_plan(Q, K, V, dO, dQ, dK, dV, is_causal, sm_scale)
    KERNELS["bwd"](signature, plan.grid, BackwardArgs(Q, K, V, dO, L, Delta, dQ, dK, dV, *plan.tail),
                   plan.constexprs, plan.fixed, autotune=FLASH_CONFIG.get().autotune)
    return dQ, dK, dV


RESIDENT_PROGRAMS_PER_SM = 2
"""Backward programs of the float32 tiles one multiprocessor holds at once (255 registers a thread, 4 warps: 32K of
its 64K registers each)."""


def backward_splits(Q: Tensor, K: Tensor) -> int:
    """Into how many parts :func:`backward` splits each program's sweeps, where :func:`_may_split`: when its
    programs (one per tile of the longer sequence, per batch and head; each does the same work under a causal mask)
    fill less than half of what the multiprocessors hold at once; parts of at least :data:`MIN_KEYS_PER_SPLIT`
    rows (:func:`sweep_splits`). Else 1."""
    if not _may_split(Q):
        return 1
    _, batch_heads, n_queries, n_keys, head_dim = _sizes(Q, K)
    return _backward_splits(batch_heads, n_queries, n_keys, head_dim, _dot_precision(Q.dtype), Q.device)


@functools.cache
def _backward_splits(batch_heads: int, n_queries: int, n_keys: int, head_dim: int, precision: str,
                     device: torch.device) -> int:
    tile = fixed_config("bwd", torch.float32, head_dim, precision, _capability(device)).kwargs["TILE"]
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
    return sweep_splits(batch_heads * -(-max(n_queries, n_keys) // tile), min(n_queries, n_keys),
                        RESIDENT_PROGRAMS_PER_SM * multiprocessors)


def sweep_splits(programs: int, swept: int, slots: int) -> int:
    """Parts that bring ``programs`` up to the ``slots`` the GPU runs at once, each sweeping at least
    :data:`MIN_KEYS_PER_SPLIT` of the ``swept`` rows; 1 when the programs fill half the slots already."""
    if 2 * programs > slots:
        return 1
    return max(1, min(slots // programs, swept // MIN_KEYS_PER_SPLIT))


def split_backward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    O: Float[Tensor, "batch *heads q d"], L: Float[Tensor, "batch *heads q"], dO: Float[Tensor, "batch *heads q d"],
    is_causal: bool, sm_scale: float, n_parts: int,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads k d"], Float[Tensor, "batch *heads k d"]]:
    """:func:`backward`'s ``dQ, dK, dV`` with each program's sweeps split into ``n_parts`` pieces, each swept by a
    program of its own into float32 partial sums (``attn_bwd_split_kernel``), then added in order
    (``attn_bwd_sum_parts_kernel``); at the fixed tiles, power-of-two head dims only."""
    n_heads, batch_heads, n_queries, n_keys, head_dim = _sizes(Q, K)
    _check_split("the backward split", head_dim, "n_parts", n_parts)
    precision = _dot_precision(Q.dtype)
    key = (Q.dtype, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(), dO.stride(), aligned(Q, K, V, dO),
           is_causal, precision, n_parts)
    Delta = launch_delta(O, dO)
    dQ_part, dK_part, dV_part = (new_output((n_parts, batch_heads, n, head_dim), torch.float32, Q.device)
                                 for n in (n_queries, n_keys, n_keys))
    n_rows = max(n_queries, n_keys)
    SPLIT_KERNELS["bwd"](
        key, lambda tiles: (-(-n_rows // tiles["TILE"]), batch_heads, n_parts),
        (Q, K, V, dO, L, Delta, dQ_part, dK_part, dV_part,
         *(stride for x in (Q, K, V, dO) for stride in batch_head_strides(x)),
         n_heads, n_queries, n_keys, n_parts, sm_scale, sm_scale * _LOG2_E),
        dict(HEAD_DIM=head_dim, IS_CAUSAL=is_causal, DOT_PRECISION=precision),
        lambda: fixed_config("bwd", Q.dtype, head_dim, precision, _capability(Q.device)))
    grads = []
    for part, like in ((dQ_part, Q), (dK_part, K), (dV_part, V)):
        grad = new_output(like.shape, like.dtype, like.device)
        rows = like.shape[-2]
        SPLIT_KERNELS["sum"](
            (like.dtype, like.shape, n_parts), lambda tiles, rows=rows: (-(-rows // tiles["BLOCK_M"]), batch_heads),
            (part, grad, *batch_head_strides(grad), n_heads, rows, n_parts), dict(HEAD_DIM=head_dim),
            lambda: COMBINE_CONFIG)
        grads.append(grad)
    return tuple(grads)


def _backward_plan(Q: Tensor, K: Tensor, V: Tensor, dO: Tensor, dQ: Tensor, dK: Tensor, dV: Tensor, is_causal: bool,
                   sm_scale: float) -> LaunchPlan:
    n_heads, batch_heads, n_queries, n_keys, head_dim = _sizes(Q, K)
    tail = (*(stride for x in (Q, K, V, dO, dQ, dK, dV) for stride in batch_head_strides(x)),
            n_heads, n_queries, n_keys, _length_key(n_queries), _length_key(n_keys), sm_scale, sm_scale * _LOG2_E)
    n_rows = max(n_queries, n_keys)  # program i: key tile i, then query tile i
    constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_B=head_dim_parts(head_dim)[1], IS_CAUSAL=is_causal,
                      DOT_PRECISION=_dot_precision(Q.dtype))
    return LaunchPlan(tail, (batch_heads, n_rows), _tiled_grid(batch_heads, n_rows, "TILE"), constexprs,
                      functools.partial(fixed_config, "bwd", Q.dtype, head_dim, constexprs["DOT_PRECISION"],
                                        _capability(Q.device)))
