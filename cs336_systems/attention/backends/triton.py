"""The portable Triton backend: FlashAttention-2's launch code for the kernels of ``triton_kernels.py`` (any CUDA
GPU; float16, bfloat16, float32; head dims 16, 32, 64, 128, and 48, 80, 96 in two column parts; the CPU under
``TRITON_INTERPRET=1``). A :class:`~cs336_systems.attention.backends.common.Backend`.

The forward is one launch; the backward two: Delta = rowsum(O * dO), then one kernel whose program ``i`` computes
dK and dV of key tile ``i`` and dQ of query tile ``i``, recomputing P for each (no atomics, deterministic).
Float32 calls of few programs on a GPU (one head of a few thousand tokens) split their sweeps instead: the forward
each query tile's keys over programs, the parts combined by their logsumexp (:func:`split_forward`, two launches;
:func:`key_splits` says when), the backward each program's sweeps into partial sums added in order
(:func:`split_backward`, five launches; :func:`sweep_splits`).

Launch parameters: on a GPU, fixed tiles per dtype, float32 products and head dim (:data:`FIXED_TILES`), compiled
once per launch signature whatever the lengths; ``FlashConfig.autotune`` lets ``triton.autotune`` pick them per
length bucket instead (its key and pruning below). Under ``TRITON_INTERPRET=1`` (CPU), one small configuration with
unequal tiles, so that the tests exercise every masking path at small sizes in seconds; the interpreter's
``tl.dot`` is wrong on bfloat16, so bfloat16 inputs run there in float32 (rounded back at the end). Each kernel is a
:class:`cs336_systems.kernels.launch.Kernel`: one entry per launch signature (dtype, shapes, strides, alignment,
causal, products), made once from a plan that names the kernel's arguments. Float32 matmuls use TF32 exactly when
PyTorch's may (``torch.backends.cuda.matmul.allow_tf32 = True`` or ``torch.set_float32_matmul_precision("high")``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from jaxtyping import Float
from torch import Tensor

from cs336_systems.attention.backends import triton_kernels
from cs336_systems.attention.backends.common import (
    KERNEL_HEAD_DIMS,
    LOG2_E,
    head_dim_parts,
    launch_delta,
    named_strides,
    sizes,
)
from cs336_systems.attention.config import FLASH_CONFIG
from cs336_systems.kernels.launch import (
    FLOAT_DTYPES,
    LAUNCH_CACHE_SIZE,
    Kernel,
    LaunchPlan,
    aligned,
    interpreting,
    multiprocessors,
    new_output,
    new_output_like,
    unsupported_device,
)

NAME = "triton"
HEAD_DIMS = KERNEL_HEAD_DIMS
"""Head dims the kernels run without padding."""


def supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why these kernels cannot run on such inputs, or None when they can."""
    if dtype not in FLOAT_DTYPES:
        return f"unsupported dtype {dtype}: the Triton kernels take float16, bfloat16 or float32"
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} (needs one of {HEAD_DIMS})"
    return unsupported_device(device, "the Triton kernels", "cs336_systems.attention")


def programs(part: str, Q: Tensor, K: Tensor) -> int:
    """The programs ``part`` of a call on these inputs starts at the fixed tiles (unsplit): one per query tile
    (forward) or per tile of the longer sequence (backward), per batch and head."""
    _, batch_heads, n_queries, n_keys, head_dim = sizes(Q, K)
    kernel, rows = ("fwd", n_queries) if part == "forward" else ("bwd", max(n_queries, n_keys))
    tiles = fixed_config(kernel, Q.dtype, head_dim, _dot_precision(Q.dtype), _capability(Q.device)).kwargs
    return batch_heads * -(-rows // tiles["BLOCK_M" if part == "forward" else "TILE"])


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


class FixedTiles(NamedTuple):
    """The tiles a (dtype size, float32 products, head dim) runs at when not autotuning, and why (the results or
    the optimisation-log step, ``writeup/results/flash_optimisation_log.jsonl``, that chose them)."""

    forward: triton.Config
    backward: triton.Config
    why: str


_TILE_ROWS = [  # (bits, products, head dims, forward, backward, why)
    (16, "any", (16, 32, 48, 64), _config(128, 64, 8, 3), _bwd_config(128, 64, 8, 3),
     "the autotuner's fastest without spills on an H100, bf16 causal 16384 tokens (log: fixed-tiles)"),
    (16, "any", (96, 128), _config(128, 64, 8, 3), _bwd_config(128, 32, 8, 3),
     "as above; the backward's slices halved to fit the wider accumulators (log: fixed-tiles)"),
    (16, "any", (80,), _config(128, 64, 4, 3), _bwd_config(64, 64, 4, 3),
     "the autotuner's pick on an H100 at (4, 32, 2048, 80) and (1, 32, 8192, 80) (log: fixed-tiles)"),
    (32, "ieee", (16, 32, 48, 64), _config(32, 16, 4, 2), _bwd_config(32, 16, 4, 1),
     "products on the FMA units: the tiles that do not spill (log: fixed-tiles)"),
    (32, "ieee", (80, 96, 128), _config(32, 16, 8, 2), _bwd_config(32, 16, 8, 1),
     "as above, 8 warps for the wider accumulators (log: fixed-tiles)"),
    (32, "tf32x3", (16, 32, 64), _config(128, 32, 8, 2), _bwd_config(32, 32, 4, 1),
     "the largest tiles ptxas fits in the registers for sm_90 (log: fixed-tiles)"),
    (32, "tf32x3", (48,), _config(128, 32, 8, 2), _bwd_config(32, 16, 8, 1),
     "forward as 64's; the backward's tiles that spill least (log: fixed-tiles)"),
    (32, "tf32x3", (80, 96), _config(32, 16, 8, 2), _bwd_config(32, 16, 8, 1),
     "two column parts: the tiles that spill least (log: fixed-tiles)"),
    (32, "tf32x3", (128,), _config(64, 32, 4, 2), _bwd_config(32, 32, 4, 1),
     "the fastest of a sweep on one H100, though they spill (log: fixed-tiles)"),
]
FIXED_TILES = {(bits, products, head_dim): FixedTiles(forward, backward, why)
               for bits, products, head_dims, forward, backward, why in _TILE_ROWS for head_dim in head_dims}
"""The fixed tiles by (bits of the dtype, float32 products: "ieee" (also TF32's), "tf32x3", or "any" for 16 bits,
head dim), timed or compiled for an H100."""
HOPPER = 90
"""The compute capability the fixed tiles were chosen on (H100)."""
OTHER_GPU_FORWARD = {(16, "any", 80): _config(128, 64, 8, 3)}
"""Forward tiles that differ off Hopper: at 4 warps the d = 80 forward spills 8 bytes for sm_100 (log: fixed-tiles)."""


def fixed_config(kernel: str, dtype: torch.dtype, head_dim: int, precision: str = "ieee",
                 capability: int = HOPPER) -> triton.Config:
    """The configuration of ``kernel`` ("fwd" or "bwd") when not autotuning: :data:`FIXED_TILES` for a GPU of
    ``capability``, or the interpreter's."""
    if interpreting():
        return INTERPRETER_CONFIGS[kernel]
    if dtype == torch.float32:
        key = (32, "tf32x3" if precision == "tf32x3" else "ieee", head_dim)
    else:
        key = (16, "any", head_dim)
    if kernel == "fwd" and capability != HOPPER and key in OTHER_GPU_FORWARD:
        return OTHER_GPU_FORWARD[key]
    tiles = FIXED_TILES[key]
    return tiles.forward if kernel == "fwd" else tiles.backward


def _capability(device: torch.device) -> int:
    """The GPU's compute capability as one number (90 for 9.0); :data:`HOPPER` elsewhere (the interpreter's CPU)."""
    if device.type != "cuda":
        return HOPPER
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


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


def _tiled_grid(batch_heads: int, n_rows: int, tile: str, *more: int):
    """The grid ``(cdiv(n_rows, tiles[tile]), batch * heads, *more)``."""
    return lambda tiles: (-(-n_rows // tiles[tile]), batch_heads, *more)


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
    O = new_output_like(Q)
    L = new_output(Q.shape[:-1], torch.float32, Q.device)
    # What the compilation depends on: Triton specialises the strides and the pointers' alignment; O's strides
    # follow from Q's shape.
    key = (Q.dtype, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(), aligned(Q, K, V), is_causal,
           _dot_precision(Q.dtype), sm_scale)
    KERNELS["fwd"].launch(key, (Q, K, V, O, L), _forward_plan, Q, K, V, O, is_causal, sm_scale,
                          autotune=FLASH_CONFIG.get().autotune)
    return O, L


def _forward_plan(Q: Tensor, K: Tensor, V: Tensor, O: Tensor, is_causal: bool, sm_scale: float) -> LaunchPlan:
    n_heads, batch_heads, n_queries, n_keys, head_dim = sizes(Q, K)
    precision = _dot_precision(Q.dtype)
    return LaunchPlan(
        _tiled_grid(batch_heads, n_queries, "BLOCK_M"),
        dict(**named_strides(qm=Q, kn=K, vn=V, om=O), n_heads=n_heads, n_queries=n_queries, n_keys=n_keys,
             n_queries_key=_length_key(n_queries), n_keys_key=_length_key(n_keys), qk_scale=sm_scale * LOG2_E,
             HEAD_DIM=head_dim, HEAD_DIM_B=head_dim_parts(head_dim)[1], IS_CAUSAL=is_causal, DOT_PRECISION=precision),
        fixed_config("fwd", Q.dtype, head_dim, precision, _capability(Q.device)))


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
    dQ, dK, dV = new_output_like(Q), new_output_like(K), new_output_like(V)
    key = (Q.dtype, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(), dO.stride(), aligned(Q, K, V, dO),
           is_causal, _dot_precision(Q.dtype), sm_scale)
    KERNELS["bwd"].launch(key, (Q, K, V, dO, L, Delta, dQ, dK, dV), _backward_plan, Q, K, V, dO, dQ, dK, dV,
                          is_causal, sm_scale, autotune=FLASH_CONFIG.get().autotune)
    return dQ, dK, dV


def _backward_plan(Q: Tensor, K: Tensor, V: Tensor, dO: Tensor, dQ: Tensor, dK: Tensor, dV: Tensor, is_causal: bool,
                   sm_scale: float) -> LaunchPlan:
    n_heads, batch_heads, n_queries, n_keys, head_dim = sizes(Q, K)
    precision = _dot_precision(Q.dtype)
    return LaunchPlan(
        _tiled_grid(batch_heads, max(n_queries, n_keys), "TILE"),  # program i: key tile i, then query tile i
        dict(**named_strides(qm=Q, kn=K, vn=V, dom=dO, dqm=dQ, dkn=dK, dvn=dV), n_heads=n_heads,
             n_queries=n_queries, n_keys=n_keys, n_queries_key=_length_key(n_queries), n_keys_key=_length_key(n_keys),
             sm_scale=sm_scale, qk_scale=sm_scale * LOG2_E, HEAD_DIM=head_dim,
             HEAD_DIM_B=head_dim_parts(head_dim)[1], IS_CAUSAL=is_causal, DOT_PRECISION=precision),
        fixed_config("bwd", Q.dtype, head_dim, precision, _capability(Q.device)))


# ---------------------------------------------------------------------------------------------------
# Float32 calls of few programs: sweeps split over more programs
# ---------------------------------------------------------------------------------------------------

MIN_KEYS_PER_SPLIT = 512
"""The forward split over keys gives each part at least this many keys (fewer keys per part: the combination's
extra pass costs more than the shorter sweep saves)."""
RESIDENT_PROGRAMS_PER_SM = 2
"""Backward programs of the float32 tiles one multiprocessor holds at once (255 registers a thread, 4 warps: 32K of
its 64K registers each)."""
COMBINE_CONFIG = triton.Config({"BLOCK_M": 32}, num_warps=4)
"""The launch of the split forward's combination (and of the split backward's sums): an elementwise pass."""
SPLIT_KERNELS = {name: Kernel(kernel) for name, kernel in (
    ("fwd", triton_kernels.attn_fwd_split_kernel), ("combine", triton_kernels.attn_fwd_combine_kernel),
    ("bwd", triton_kernels.attn_bwd_split_kernel), ("sum", triton_kernels.attn_bwd_sum_parts_kernel))}


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


def sweep_splits(programs: int, swept: int, slots: int) -> int:
    """Parts that bring ``programs`` up to the ``slots`` the GPU runs at once, each sweeping at least
    :data:`MIN_KEYS_PER_SPLIT` of the ``swept`` rows; 1 when the programs fill half the slots already."""
    if 2 * programs > slots:
        return 1
    return max(1, min(slots // programs, swept // MIN_KEYS_PER_SPLIT))


def _may_split(Q: Tensor) -> bool:
    """Whether a call's sweeps may be split over more programs: float32 on a GPU at a power-of-two head dim (the
    single-head sweeps of ``flash_benchmarking``, where a one-head call gives a few dozen programs)."""
    return Q.dtype == torch.float32 and Q.device.type == "cuda" and not head_dim_parts(Q.shape[-1])[1]


def forward_key_splits(Q: Tensor, K: Tensor, is_causal: bool) -> int:
    """The parts :func:`forward` splits this call's keys into (:func:`key_splits`, where :func:`_may_split`); else
    1."""
    if not _may_split(Q):
        return 1
    _, batch_heads, n_queries, n_keys, head_dim = sizes(Q, K)
    return _forward_key_splits(batch_heads, n_queries, n_keys, head_dim, is_causal, _dot_precision(Q.dtype),
                               Q.device)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _forward_key_splits(batch_heads: int, n_queries: int, n_keys: int, head_dim: int, is_causal: bool,
                        precision: str, device: torch.device) -> int:
    block_m = fixed_config("fwd", torch.float32, head_dim, precision, _capability(device)).kwargs["BLOCK_M"]
    return key_splits(n_queries, n_keys, batch_heads, block_m, is_causal, multiprocessors(device))


def backward_splits(Q: Tensor, K: Tensor) -> int:
    """Into how many parts :func:`backward` splits each program's sweeps, where :func:`_may_split`: when its
    programs (one per tile of the longer sequence, per batch and head; each does the same work under a causal mask)
    fill less than half of what the multiprocessors hold at once; parts of at least :data:`MIN_KEYS_PER_SPLIT`
    rows (:func:`sweep_splits`). Else 1."""
    if not _may_split(Q):
        return 1
    _, batch_heads, n_queries, n_keys, head_dim = sizes(Q, K)
    return _backward_splits(batch_heads, n_queries, n_keys, head_dim, _dot_precision(Q.dtype), Q.device)


@functools.lru_cache(maxsize=LAUNCH_CACHE_SIZE)
def _backward_splits(batch_heads: int, n_queries: int, n_keys: int, head_dim: int, precision: str,
                     device: torch.device) -> int:
    tile = fixed_config("bwd", torch.float32, head_dim, precision, _capability(device)).kwargs["TILE"]
    return sweep_splits(batch_heads * -(-max(n_queries, n_keys) // tile), min(n_queries, n_keys),
                        RESIDENT_PROGRAMS_PER_SM * multiprocessors(device))


def _check_split(what: str, head_dim: int, count_name: str, count: int) -> None:
    if head_dim_parts(head_dim)[1]:
        raise ValueError(f"{what} takes power-of-two head dims, not {head_dim}")
    if count < 1:
        raise ValueError(f"{count_name} must be at least 1, got {count}")


def split_forward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    is_causal: bool, sm_scale: float, n_splits: int,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads q"]]:
    """:func:`forward`'s ``O`` and ``L`` with each query tile's keys split into ``n_splits`` parts, each part swept
    by a program of its own (``attn_fwd_split_kernel``), then combined by their logsumexp
    (``attn_fwd_combine_kernel``); at the fixed tiles, power-of-two head dims only."""
    _check_split("the forward split over keys", Q.shape[-1], "n_splits", n_splits)
    _, batch_heads, n_queries, _, head_dim = sizes(Q, K)
    # What the compilation depends on: the inputs' dtype, strides and alignment, and the sizes (the parts and the
    # outputs are fresh and contiguous, so their strides follow from the sizes).
    key = (Q.dtype, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(), aligned(Q, K, V), is_causal,
           _dot_precision(Q.dtype), n_splits, sm_scale)
    O_part = new_output((n_splits, batch_heads, n_queries, head_dim), torch.float32, Q.device)
    LSE_part = new_output((n_splits, batch_heads, n_queries), torch.float32, Q.device)
    SPLIT_KERNELS["fwd"].launch(key, (Q, K, V, O_part, LSE_part), _split_forward_plan, Q, K, V, is_causal, sm_scale,
                                n_splits)
    O = new_output_like(Q)
    L = new_output(Q.shape[:-1], torch.float32, Q.device)
    SPLIT_KERNELS["combine"].launch(key, (O_part, LSE_part, O, L), _parts_plan, O, n_splits, "n_queries",
                                    "n_splits")
    return O, L


def _split_forward_plan(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool, sm_scale: float,
                        n_splits: int) -> LaunchPlan:
    n_heads, batch_heads, n_queries, n_keys, head_dim = sizes(Q, K)
    precision = _dot_precision(Q.dtype)
    return LaunchPlan(
        _tiled_grid(batch_heads, n_queries, "BLOCK_M", n_splits),
        dict(**named_strides(qm=Q, kn=K, vn=V), n_heads=n_heads, n_queries=n_queries, n_keys=n_keys,
             n_splits=n_splits, qk_scale=sm_scale * LOG2_E, HEAD_DIM=head_dim, IS_CAUSAL=is_causal,
             DOT_PRECISION=precision),
        fixed_config("fwd", Q.dtype, head_dim, precision, _capability(Q.device)))


def _parts_plan(out: Tensor, n_parts: int, rows: str, parts: str) -> LaunchPlan:
    """The plan of an elementwise pass over ``n_parts`` float32 parts into ``out`` (the split forward's combination,
    or the split backward's sum of one gradient), whose kernel calls its sizes ``rows`` and ``parts``."""
    n_heads, batch_heads, n_rows, _, head_dim = sizes(out, out)
    return LaunchPlan(_tiled_grid(batch_heads, n_rows, "BLOCK_M"),
                      {**named_strides(om=out), "n_heads": n_heads, rows: n_rows, parts: n_parts, "HEAD_DIM": head_dim},
                      COMBINE_CONFIG)


def split_backward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    O: Float[Tensor, "batch *heads q d"], L: Float[Tensor, "batch *heads q"], dO: Float[Tensor, "batch *heads q d"],
    is_causal: bool, sm_scale: float, n_parts: int,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads k d"], Float[Tensor, "batch *heads k d"]]:
    """:func:`backward`'s ``dQ, dK, dV`` with each program's sweeps split into ``n_parts`` pieces, each swept by a
    program of its own into float32 partial sums (``attn_bwd_split_kernel``), then added in order
    (``attn_bwd_sum_parts_kernel``); at the fixed tiles, power-of-two head dims only."""
    _check_split("the backward split", Q.shape[-1], "n_parts", n_parts)
    _, batch_heads, n_queries, n_keys, head_dim = sizes(Q, K)
    key = (Q.dtype, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(), dO.stride(), aligned(Q, K, V, dO),
           is_causal, _dot_precision(Q.dtype), n_parts, sm_scale)
    Delta = launch_delta(O, dO)
    dQ_part, dK_part, dV_part = (new_output((n_parts, batch_heads, n, head_dim), torch.float32, Q.device)
                                 for n in (n_queries, n_keys, n_keys))
    SPLIT_KERNELS["bwd"].launch(key, (Q, K, V, dO, L, Delta, dQ_part, dK_part, dV_part), _split_backward_plan,
                                Q, K, V, dO, is_causal, sm_scale, n_parts)
    grads = []
    for part, like in ((dQ_part, Q), (dK_part, K), (dV_part, V)):
        grad = new_output(like.shape, like.dtype, like.device)
        SPLIT_KERNELS["sum"].launch((like.dtype, like.shape, n_parts), (part, grad), _parts_plan, grad, n_parts,
                                    "n_rows", "n_parts")
        grads.append(grad)
    return tuple(grads)


def _split_backward_plan(Q: Tensor, K: Tensor, V: Tensor, dO: Tensor, is_causal: bool, sm_scale: float,
                         n_parts: int) -> LaunchPlan:
    n_heads, batch_heads, n_queries, n_keys, head_dim = sizes(Q, K)
    precision = _dot_precision(Q.dtype)
    return LaunchPlan(
        _tiled_grid(batch_heads, max(n_queries, n_keys), "TILE", n_parts),
        dict(**named_strides(qm=Q, kn=K, vn=V, dom=dO), n_heads=n_heads, n_queries=n_queries, n_keys=n_keys,
             n_parts=n_parts, sm_scale=sm_scale, qk_scale=sm_scale * LOG2_E, HEAD_DIM=head_dim, IS_CAUSAL=is_causal,
             DOT_PRECISION=precision),
        fixed_config("bwd", Q.dtype, head_dim, precision, _capability(Q.device)))
