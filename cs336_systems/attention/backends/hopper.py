"""The Hopper backend: the host side of the Gluon kernels of ``hopper_kernels.py`` (H100/H200, float16/bfloat16,
head dims 16, 32, 64, 128, and 48, 80, 96 in two power-of-two column parts: :data:`HEAD_DIMS`). A
:class:`~cs336_systems.attention.backends.common.Backend`; its programs are ``batch * heads`` times the tiles of
``ROWS_PER_PROGRAM`` queries (forward) or keys (backward): the backward's programs, the tiles the persistent
forward deals to at most one program per multiprocessor.

Tensor views. TMA descriptors need a unit stride along ``d`` and 16-byte aligned other strides. A 4-D tensor
``(batch, heads, seq, d)`` is seen as 3-D in one of two ways, without copying: ``(batch * heads, seq, d)`` when
the batch stride is ``heads`` head strides (contiguous tensors), or ``(batch, seq, heads * d)`` when the head
stride is ``d`` (a ``(batch, seq, heads, d)`` tensor transposed, as attention layers make them); anything else is
copied (:func:`tma_view`).

Launches. Each kernel is a :class:`cs336_systems.kernels.launch.Kernel` with one entry per (device, dtype, shapes,
strides, alignment, causal, scale): per descriptor the tensor it views, whether that tensor must be copied, and the
view's shape and strides; the grid, sizes and constexprs; for the persistent forward, its schedule of tiles
(:func:`forward_schedule`), on the GPU. The first call of a key builds full ``TensorDescriptor`` objects (Triton
compiles from them); later calls pass only the tensors they address.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

import torch
import triton
from jaxtyping import Float
from torch import Tensor
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cs336_systems.attention.backends import common, triton_kernels
from cs336_systems.attention.backends.hopper_kernels import attn_bwd_hopper_kernel, attn_fwd_hopper_kernel
from cs336_systems.kernels.launch import (
    Kernel,
    LaunchPlan,
    aligned,
    in_order,
    interpreting,
    multiprocessors,
    new_output,
    new_output_like,
)

NAME = "hopper"
HEAD_DIMS = common.KERNEL_HEAD_DIMS
"""Head dims both kernels run without padding: powers of two, and 48, 80, 96 in two power-of-two column parts
(80 = 64 + 16, ``common.head_dim_parts``)."""
BLOCK_N = 128  # keys per forward step (forward_tiles); keys of a backward program of two warpgroups (backward_tiles)
FORWARD_ROWS = 64  # queries per forward consumer warpgroup (two per program)
BACKWARD_ROWS = 64
"""Queries per backward step, every head dim: S^T, dP^T, dK and dV then fit in the consumers' registers (at 128,
S^T and dP^T alone would take 128 of them at d = 64)."""
STAGES = 2
"""Depth of the K/V and Q/dO rings (3 measured no faster at d = 64; at d = 128 it does not fit in shared memory)."""
ROWS_PER_PROGRAM = 2 * FORWARD_ROWS  # queries per forward program; the unit of keys :func:`programs` counts
DELTA_ROWS = 64  # queries per program of the dQ conversion kernel

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


# ---------------------------------------------------------------------------------------------------
# What the backend runs
# ---------------------------------------------------------------------------------------------------


def supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why these kernels cannot run on such inputs, or None when they can (asked once per device, dtype and head
    dim: the operator caches its choice; it asks at the head dim padded to :data:`HEAD_DIMS`)."""
    if interpreting():
        return "the Triton interpreter (TRITON_INTERPRET=1) runs no Gluon kernels"
    if device.type != "cuda":
        return f"tensors on {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 9:
        return f"compute capability {capability} (needs 9.x, Hopper)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (needs float16 or bfloat16)"
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} (needs one of {HEAD_DIMS})"
    return None


def programs(part: str, Q: Tensor, K: Tensor) -> int:
    """``batch * heads`` times the tiles of ``ROWS_PER_PROGRAM`` queries (forward) or keys (backward)."""
    return common.batch_heads(Q) * -(-(Q.shape[-2] if part == "forward" else K.shape[-2]) // ROWS_PER_PROGRAM)


# ---------------------------------------------------------------------------------------------------
# Views and descriptors
# ---------------------------------------------------------------------------------------------------


def _tma_aligned(t: Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


def tma_view(x: Float[Tensor, "batch *heads seq d"]) -> tuple[Float[Tensor, "rows seq cols"], bool]:
    """A 3-D view of ``x`` that a TMA descriptor can address, and whether the heads are in its columns (see the
    module docstring); a contiguous copy when neither view exists."""
    if x.dim() == 3:
        x = x.unsqueeze(1)
    batch, heads, seq, d = x.shape
    if x.stride(-1) == 1:
        stride_b, stride_h, stride_s, _ = x.stride()
        if heads == 1 or batch == 1 or stride_b == heads * stride_h:
            view = x.as_strided((batch * heads, seq, d), (stride_h if heads > 1 else stride_b, stride_s, 1))
            if _tma_aligned(view):
                return view, False
        if stride_h == d:
            view = x.as_strided((batch, seq, heads * d), (stride_b, stride_s, 1))
            if _tma_aligned(view):
                return view, True
    return _aligned_copy(x).view(batch * heads, seq, d), False


def _aligned_copy(x: Tensor) -> Tensor:
    """A contiguous copy of ``x`` in a new (aligned) allocation: ``x.contiguous()`` would return a contiguous ``x``
    itself, however misaligned its first element."""
    return x.clone(memory_format=torch.contiguous_format)


class DescriptorPlan(NamedTuple):
    """How a descriptor argument sees its tensor: a copy or not, the 3-D view's shape and strides, and the rows of
    the block the kernel moves."""

    copied: bool
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    rows: int
    columns: int = 0  # the block's columns: 0 for the whole head dim

    @classmethod
    def of(cls, x: Tensor, rows: int, columns: int = 0) -> tuple[DescriptorPlan, bool]:
        """The plan of ``x`` (any layout) and whether its heads are in the view's columns."""
        view, heads_in_columns = tma_view(x)
        return (cls(view.data_ptr() != x.data_ptr(), tuple(view.shape), tuple(view.stride()), rows, columns),
                heads_in_columns)

    def full_descriptor(self, source: Tensor) -> TensorDescriptor:
        """The descriptor on ``source`` (the tensor, or its copy where :attr:`copied`) that Triton compiles the
        kernel from (validated, with its shared layout)."""
        block = [1, self.rows, self.columns or source.shape[-1]]
        layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[source.dtype])
        return TensorDescriptor(source, list(self.shape), list(self.strides), block, layout)


def _output_plan(shape: tuple[int, ...], rows: int, columns: int = 0) -> DescriptorPlan:
    """The plan of a contiguous output seen as ``shape`` (batch * heads, seq, d), blocks of ``columns`` (0: all
    ``d``), whatever the shape of the tensor it is given (the backward's DQ_acc is the start of a flat workspace)."""
    return DescriptorPlan(False, shape, (shape[1] * shape[2], shape[2], 1), rows, columns or shape[2])



def _alignment(*tensors: Tensor) -> bool | tuple[bool, ...]:
    """True where every tensor starts on 16 bytes (the usual case, one test: :func:`aligned`); else each tensor's own
    alignment, which decides whether its descriptor views a copy."""
    return True if aligned(*tensors) else tuple(aligned(t) for t in tensors)


TILE_COST = 1
"""A forward tile's fixed cost (loading its Q, writing its O and L), in key blocks, for :func:`forward_schedule`."""
BALANCE_TOLERANCE = 1.02
"""How much longer than the balanced schedule's the head-major one's busiest program may be (see
:func:`forward_schedule`)."""
L2_BUDGET = 32 * 2**20
"""The most bytes of K and V the balanced schedule may have in flight (heads that programs work on at once, times
a head's K and V): of an H100's 50 MB of L2, what the balanced schedule was faster with (optimisation log:
persistent-hopper-forward)."""


def _deal(tiles: list[tuple[int, int, int]], programs: int) -> tuple[list[list[tuple[int, int, int]]], int]:
    """``tiles`` ((bh, i, cost) each) dealt in order, each to the program that would be free first; and the busiest
    program's total cost."""
    free_at = [(0, p) for p in range(programs)]  # a heap of (finish, program)
    dealt: list[list[tuple[int, int, int]]] = [[] for _ in range(programs)]
    for tile in tiles:
        finish, p = heapq.heappop(free_at)
        dealt[p].append(tile)
        heapq.heappush(free_at, (finish + tile[2], p))
    return dealt, max((finish for finish, _ in free_at), default=0)


def _heads_in_flight(dealt: list[list[tuple[int, int, int]]]) -> int:
    """The most heads the programs' ``k``-th tiles cover, over ``k``."""
    steps = max(len(program) for program in dealt)
    return max(len({program[k][0] for program in dealt if k < len(program)}) for k in range(steps))


def forward_tiles(n_keys: int) -> tuple[int, int]:
    """Keys per forward step and the depth of the K/V ring for a call over ``n_keys`` keys: 64 keys through 4
    stages up to :data:`SHORT_FORWARD_KEYS`, 128 through 2 above.

    Causal, the last key block of a tile of 128 queries straddles their diagonal: at 64 keys a step a quarter of it,
    not half, is masked work; at short contexts, where that block is a large share of a tile's, that outweighs
    twice the steps. Measured on an H200 (forward, CUDA graphs, against 128 keys through 2 stages, same run;
    optimisation log: forward-64-key-steps-short-contexts): at context 512 0.94x (d 128, 36 heads), 0.93x and
    0.96x (d 64, 12 and 25 heads), 0.97x (d 80); from 1,024 on 1.05-1.16x."""
    return (SHORT_FORWARD_BLOCK_N, SHORT_FORWARD_STAGES) if n_keys <= SHORT_FORWARD_KEYS else (BLOCK_N, STAGES)


SHORT_FORWARD_KEYS = 512
SHORT_FORWARD_BLOCK_N = 64
SHORT_FORWARD_STAGES = 4  # 197 KB of shared memory at d = 128


def forward_schedule(batch_heads: int, n_queries: int, n_keys: int, is_causal: bool, programs: int,
                     head_bytes: int, block_n: int = BLOCK_N) -> list[int]:
    """The forward's tiles (``bh * query_tiles + i``: queries ``i * ROWS_PER_PROGRAM ..`` of ``bh``) dealt to at
    most ``programs`` persistent programs: each program's first index into the list (``programs + 1`` entries,
    the last the list's length), then each program's tile ids in order (the kernel's ``schedule``).

    A tile costs ``TILE_COST`` plus its key blocks of ``block_n`` keys. Head-major: tiles go head after head, the
    heaviest causal tiles of a head first, each to the program that would be free first (what the hardware's
    scheduler does for a grid of one program per tile): programs running together work on a few heads, whose K and V
    (``head_bytes`` each) stay in L2. Where that leaves the busiest program more than ``BALANCE_TOLERANCE`` times
    the balanced schedule's work, the balanced one, if its heads in flight fit in ``L2_BUDGET``: the heaviest tiles
    first over all heads (longest processing time first), then each program's tiles in head order, so that programs
    still meet on nearby heads."""
    query_tiles = triton.cdiv(n_queries, ROWS_PER_PROGRAM)
    key_blocks = triton.cdiv(n_keys, block_n)
    programs = min(programs, batch_heads * query_tiles)

    def cost(i: int) -> int:
        return TILE_COST + (min(key_blocks, triton.cdiv((i + 1) * ROWS_PER_PROGRAM, block_n)) if is_causal
                            else key_blocks)

    tiles = [(bh, i, cost(i)) for bh in range(batch_heads) for i in reversed(range(query_tiles))]
    dealt, busiest = _deal(tiles, programs)
    balanced, balanced_busiest = _deal(sorted(tiles, key=lambda tile: -tile[2]), programs)
    if busiest > BALANCE_TOLERANCE * balanced_busiest:
        balanced = [sorted(program, key=lambda tile: (tile[0], -tile[1])) for program in balanced]
        if _heads_in_flight(balanced) * head_bytes <= L2_BUDGET:
            dealt = balanced
    offsets = list(itertools.accumulate((len(program) for program in dealt), initial=programs + 1))
    return offsets + [bh * query_tiles + i for program in dealt for bh, i, _ in program]


def _schedule_tensor(schedule: list[int], device: torch.device) -> Tensor:
    """``schedule`` as an int32 tensor on ``device``: copied once per schedule and device and kept for the process
    (:data:`_device_schedules`), or, while a CUDA graph is being captured and the schedule is new, copied by the
    graph from page-locked memory at each replay (a capture allows no synchronous copy)."""
    key = (tuple(schedule), device)
    kept = _device_schedules.get(key)
    if kept is not None:
        return kept
    host = torch.tensor(schedule, dtype=torch.int32)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        kept = _device_schedules[key] = host.to(device)
        return kept
    host = host.pin_memory()
    _captured_sources.append(host)  # kept for as long as the graph may replay the copy
    return torch.empty_like(host, device=device).copy_(host, non_blocking=True)


_device_schedules: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}
"""The schedules copied to a device, by content: a CUDA graph captured after the launch that planned one reads it at
every replay, long after the launch entry that holds it may have left its bounded cache (a few kilobytes each)."""
_captured_sources: list[Tensor] = []
"""The page-locked sources of the schedules that captured graphs copy (a few kilobytes per captured call)."""


# ---------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------

FORWARD = Kernel(attn_fwd_hopper_kernel)


def forward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    is_causal: bool, sm_scale: float,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads q"]]:
    """``O`` (contiguous, Q's shape and dtype) and the natural-log logsumexp ``L`` (contiguous, float32)."""
    O = new_output_like(Q)
    L = new_output(Q.shape[:-1], torch.float32, Q.device)
    key = (Q.device.index, Q.dtype, is_causal, sm_scale, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(),
           _alignment(Q, K, V, L))
    FORWARD.launch(key, (Q, K, V, O, L), _forward_plan, Q, K, V, is_causal, sm_scale, build=_forward_args)
    return O, L


def _forward_plan(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool, sm_scale: float) -> LaunchPlan:
    """The plan of the forward on inputs laid out as these (Q, K, V, then the contiguous output O)."""
    n_heads, batch_heads, n_queries, n_keys, head_dim = common.sizes(Q, K)
    part_a, part_b = common.head_dim_parts(head_dim)
    keys, stages = forward_tiles(n_keys)
    descriptors = []
    for columns in (part_a, part_b) if part_b else (0,):  # 0: the whole head dim
        (q, q_columns), (k, k_columns), (v, v_columns) = (
            DescriptorPlan.of(x, rows, columns) for x, rows in ((Q, FORWARD_ROWS), (K, keys), (V, keys)))
        descriptors += [q, k, v, _output_plan((batch_heads, n_queries, head_dim), FORWARD_ROWS, columns)]
    schedule = forward_schedule(batch_heads, n_queries, n_keys, is_causal, multiprocessors(Q.device),
                                2 * n_keys * head_dim * Q.element_size(), keys)
    capturing = Q.is_cuda and torch.cuda.is_current_stream_capturing()
    # A plan made during a capture is not kept: its schedule lives in the graph's memory, copied at replays.
    return LaunchPlan(lambda tiles: (schedule[0] - 1, 1),
                      dict(schedule=_schedule_tensor(schedule, Q.device), n_heads=n_heads, n_queries=n_queries,
                           n_keys=n_keys, qk_scale=sm_scale * common.LOG2_E, HEAD_DIM=head_dim, IS_CAUSAL=is_causal,
                           ROWS=FORWARD_ROWS, BLOCK_N=keys, STAGES=stages, Q_COLUMNS=q_columns, K_COLUMNS=k_columns,
                           V_COLUMNS=v_columns, HEAD_DIM_B=part_b),
                      triton.Config({}, num_warps=4), tuple(descriptors), keep=not capturing)


def _forward_args(descriptors: tuple[DescriptorPlan, ...], tensors: tuple[Tensor, ...], compiled: bool) -> tuple:
    """The forward's arguments before its trailing ones: a descriptor on each of Q, K, V, O (once compiled, the
    tensor it addresses), the same on their second column parts (None without one), then L."""
    *viewed, L = tensors
    built = _descriptors(descriptors, viewed, compiled)
    return (*built[:4], *(built[4:] or (None,) * 4), L)


def _descriptors(descriptors: tuple[DescriptorPlan, ...], tensors: list[Tensor], compiled: bool) -> tuple:
    """The descriptor arguments on ``tensors`` (each, or its aligned copy where its plan says so; one copy per tensor
    whatever its descriptors; where there are two descriptors per tensor, one per column part, the second ones
    follow all the first): the descriptors Triton compiles the kernel from, or once ``compiled`` only the tensors
    they address (the compiled kernel's launcher keeps their shapes and strides)."""
    sources = tuple([_aligned_copy(x) if p.copied else x for p, x in zip(descriptors, tensors)])
    sources *= len(descriptors) // len(tensors)
    if compiled:
        return sources
    return tuple(p.full_descriptor(source) for p, source in zip(descriptors, sources, strict=True))


# ---------------------------------------------------------------------------------------------------
# Backward: Delta (and DQ_acc zeroed) by a Triton kernel, the Gluon kernel, then dQ = DQ_acc / sqrt(d)
# ---------------------------------------------------------------------------------------------------

BACKWARD = Kernel(attn_bwd_hopper_kernel)
BACKWARD_CONFIG = triton.Config({}, num_warps=8)
SMALL_BACKWARD_KEYS = 64
SMALL_BACKWARD_CONFIG = triton.Config({}, num_warps=4, maxnreg=128)
"""One consumer warpgroup (and the loader's warp, padded to a warpgroup): 256 threads at 128 registers, of which
the consumers get 232 (``setmaxnreg``), so that two programs fit a multiprocessor's 64K registers."""
SMALL_BACKWARD_WAVES = 7
SMALL_BACKWARD_CONTEXT = 2048
DQ_CONVERT = Kernel(triton_kernels.attn_bwd_dq_convert_kernel)
DQ_CONVERT_CONFIG = triton.Config({"BLOCK_M": DELTA_ROWS}, num_warps=4)


def backward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    O: Float[Tensor, "batch *heads q d"], L: Float[Tensor, "batch *heads q"], dO: Float[Tensor, "batch *heads q d"],
    is_causal: bool, sm_scale: float,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads k d"], Float[Tensor, "batch *heads k d"]]:
    """``dQ, dK, dV`` (contiguous, the inputs' dtype) from the forward's ``O`` and ``L`` and the output gradient
    ``dO`` (unit stride along ``d``, O's dtype)."""
    _, batch_heads, n_queries, _, head_dim = common.sizes(Q, K)
    # The Gluon kernel adds dS K over key tiles into a float32 buffer DQ_acc (batch * heads, n_queries, d), which the
    # Delta kernel zeroes. One allocation holds it, at its start (where the kernels address it, without a view), and
    # Delta; one the three gradients where they have one shape: each allocation costs the host more than a view.
    dq_acc_size = batch_heads * n_queries * head_dim
    workspace = new_output((dq_acc_size + batch_heads * n_queries,), torch.float32, Q.device)
    Delta = common.launch_delta(O, dO, workspace, workspace[dq_acc_size:])
    if Q.shape == K.shape:
        dQ, dK, dV = new_output((3, *Q.shape), Q.dtype, Q.device).unbind(0)
    else:
        dQ = new_output_like(Q)
        dK, dV = new_output((2, *K.shape), K.dtype, K.device).unbind(0)
    key = (Q.device.index, Q.dtype, is_causal, sm_scale, Q.shape, K.shape, Q.stride(), K.stride(), V.stride(),
           dO.stride(), _alignment(Q, K, V, dO, L, Delta))
    BACKWARD.launch(key, (Q, K, V, dO, dK, dV, workspace, L, Delta), _backward_plan, Q, K, V, dO, is_causal,
                    sm_scale, build=_backward_args)
    DQ_CONVERT.launch((dQ.dtype, dQ.shape, sm_scale), (workspace, dQ), _dq_convert_plan, dQ, sm_scale)
    return dQ, dK, dV


def backward_tiles(head_dim: int, n_keys: int, programs: int, multiprocessors: int) -> tuple[int, triton.Config]:
    """Keys per backward program and the launch configuration, for a call over ``n_keys`` keys of ``programs``
    tiles of ``ROWS_PER_PROGRAM`` keys (:func:`programs`) on a GPU of ``multiprocessors``: 128 keys on two consumer
    warpgroups (8 warps), or 64 keys on one, with registers capped so that two programs share a multiprocessor.

    The two warpgroups of a 128-key program meet at a barrier every step; two one-warpgroup programs do not, and
    one's start and end (K and V loaded, dK and dV stored) overlap the other's steps, but each loads its own Q and
    dO blocks and reduces its own dQ share. Measured on an H200 (backward against the two-warpgroup kernel,
    optimisation log: backward-64-key-programs), one warpgroup is faster

    * at head dims up to 32 (0.93x at 16 heads of 16,384),
    * up to 64, where 128-key programs would not fill one wave of the multiprocessors (0.85x at one head of
      16,384), or at contexts up to :data:`SMALL_BACKWARD_CONTEXT` where they fill at most
      :data:`SMALL_BACKWARD_WAVES` waves (0.86-0.98x from 192 to 800 programs of 512 to 2,048 keys).

    Elsewhere two are as fast or faster (one warpgroup 0.99-1.07x from 256 programs of 4,096 to 65,536 keys, 1.01x
    at 1,600 programs of 2,048)."""
    if head_dim <= 32 or (head_dim <= 64 and (
            programs <= multiprocessors
            or (n_keys <= SMALL_BACKWARD_CONTEXT and programs <= SMALL_BACKWARD_WAVES * multiprocessors))):
        return SMALL_BACKWARD_KEYS, SMALL_BACKWARD_CONFIG
    return BLOCK_N, BACKWARD_CONFIG


HEADS_FIRST_BYTES = 20 * 2**20
"""The most bytes of Q and dO (all batch-heads together) at which the causal backward's grid runs over the heads
first (:func:`backward_heads_first`)."""


def backward_heads_first(batch_heads: int, n_queries: int, head_dim: int, element_size: int, key_tiles: int,
                         is_causal: bool) -> bool:
    """Whether the backward's grid is ``(batch * heads, key tiles)``, so that the GPU starts every head's first key
    tile, then every head's second, and so on, rather than ``(key tiles, batch * heads)``, a head's tiles after
    another's: causal, where Q and dO of all heads (which the programs running at once then read) fit in
    :data:`HEADS_FIRST_BYTES`.

    Causal, a head's first key tiles see the most queries: heads first starts the longest programs first and
    leaves the short ones for the end. Measured on an H200 (backward, CUDA graphs, bf16; optimisation log:
    backward-heads-first), heads first against keys first, causal: 0.84-0.95x at 12 to 32 heads of 512 (d 64 and
    80), 0.87-0.98x at 12 to 20 heads of 1,024 and 0.89x at 25 heads of 2,048 (6 to 21 MB of Q and dO); from 25 MB
    (24 MiB) on, 0.92-0.97x at some shapes but 1.01-1.04x at others, and 1.01-1.31x from 33 MB up, where the heads
    in flight no longer share L2. Full attention, whose programs are all as long: 1.00-1.02x."""
    return (is_causal and batch_heads * 2 * n_queries * head_dim * element_size <= HEADS_FIRST_BYTES
            and key_tiles <= common.MAX_GRID_Y)


def _backward_plan(Q: Tensor, K: Tensor, V: Tensor, dO: Tensor, is_causal: bool, sm_scale: float) -> LaunchPlan:
    """The plan of the Gluon backward on inputs laid out as these (Q, K, V, dO, then the contiguous dK, dV and the
    float32 dQ accumulator): one descriptor per tensor, and at a head dim of two column parts (48, 80, 96)
    a second one per tensor, over its second part, after them."""
    n_heads, batch_heads, n_queries, n_keys, head_dim = common.sizes(Q, K)
    part_a, part_b = common.head_dim_parts(head_dim)
    keys, config = backward_tiles(head_dim, n_keys, programs("backward", Q, K), multiprocessors(Q.device))
    descriptors = []
    for columns in (part_a, part_b) if part_b else (0,):  # 0: the whole head dim
        inputs = [DescriptorPlan.of(x, rows, columns) for x, rows in
                  ((Q, BACKWARD_ROWS), (K, keys), (V, keys), (dO, BACKWARD_ROWS))]
        (q, q_columns), (k, k_columns), (v, v_columns), (do, do_columns) = inputs
        dk = dv = _output_plan((batch_heads, n_keys, head_dim), keys, columns)
        dq = _output_plan((batch_heads, n_queries, head_dim), BACKWARD_ROWS, columns)
        descriptors += [q, k, v, do, dk, dv, dq]
    scalars = in_order(BACKWARD.fn, dict(n_heads=n_heads, n_queries=n_queries, n_keys=n_keys, sm_scale=sm_scale,
                                         qk_scale=sm_scale * common.LOG2_E), first=9)
    key_tiles = triton.cdiv(n_keys, keys)
    heads_first = backward_heads_first(batch_heads, n_queries, head_dim, Q.element_size(), key_tiles, is_causal)
    grid = (batch_heads, key_tiles) if heads_first else (key_tiles, batch_heads)
    return LaunchPlan(lambda tiles: grid,
                      dict(HEAD_DIM=head_dim, IS_CAUSAL=is_causal, BLOCK_M=BACKWARD_ROWS, BLOCK_N=keys,
                           STAGES=STAGES, Q_COLUMNS=q_columns, K_COLUMNS=k_columns, V_COLUMNS=v_columns,
                           DO_COLUMNS=do_columns, HEAD_DIM_B=part_b, HEADS_FIRST=heads_first),
                      config, (tuple(descriptors), scalars))


_NO_SECOND_PART = (None,) * 7


def _backward_args(plan: tuple, tensors: tuple[Tensor, ...], compiled: bool) -> tuple:
    """The backward's arguments before its constexprs: the descriptors of Q, K, V, dO, dK, dV and the dQ
    accumulator, L, Delta, the sizes and scales, then the second column part's descriptors (None without one)."""
    descriptors, scalars = plan
    *viewed, L, Delta = tensors
    built = _descriptors(descriptors, viewed, compiled)
    return (*built[:7], L, Delta, *scalars, *(built[7:] or _NO_SECOND_PART))


def _dq_convert_plan(dQ: Tensor, sm_scale: float) -> LaunchPlan:
    n_heads, batch_heads, n_queries, _, head_dim = common.sizes(dQ, dQ)
    return LaunchPlan(lambda tiles: (triton.cdiv(n_queries, tiles["BLOCK_M"]), batch_heads),
                      dict(**common.named_strides(dqm=dQ), n_heads=n_heads, n_queries=n_queries, sm_scale=sm_scale,
                           HEAD_DIM=head_dim, HEAD_DIM_B=common.head_dim_parts(head_dim)[1]), DQ_CONVERT_CONFIG)
