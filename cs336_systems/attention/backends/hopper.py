"""The Hopper backend: the host side of the Gluon kernels of ``hopper_kernels.py`` (H100/H200, float16/bfloat16,
head dims 16, 32, 64, 128; the backward also 48, 80, 96 in two column parts, :data:`SPLIT_HEAD_DIMS`). Same
interface as every backend: :func:`supports`, :func:`kernel_head_dims`, :func:`forward`, :func:`backward`; the
operator weighs a call's tiles (``batch * heads`` times the tiles of ``ROWS_PER_PROGRAM`` queries forward, keys
backward: the backward's programs; the persistent forward runs them in at most one program per multiprocessor)
against ``FlashConfig.hopper_min_programs``.

Tensor views. TMA descriptors need a unit stride along ``d`` and 16-byte aligned other strides. A 4-D tensor
``(batch, heads, seq, d)`` is seen as 3-D in one of two ways, without copying: ``(batch * heads, seq, d)`` when
the batch stride is ``heads`` head strides (contiguous tensors), or ``(batch, seq, heads * d)`` when the head
stride is ``d`` (a ``(batch, seq, heads, d)`` tensor transposed, as attention layers make them); anything else is
copied (:func:`tma_view`).

Launch plans. A call's launch is planned once per (device, dtype, shapes, strides, alignment, causal): per
descriptor the tensor it views, whether that tensor must be copied, and the view's shape and strides; the grid and
the kernel's constexprs; for the persistent forward, its schedule of tiles (:func:`forward_schedule`), on the GPU.
The first call of a key builds full ``TensorDescriptor`` objects from its plan (Triton compiles from them); later
calls build only what holds the tensors' addresses (``DescriptorArg``) and launch the compiled kernel directly
(:class:`cs336_systems.kernels.launch.Launcher`).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from typing import Any, NamedTuple

import torch
import triton
from jaxtyping import Float
from torch import Tensor
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cs336_systems.attention.backends import triton_kernels
from cs336_systems.attention.backends.hopper_kernels import attn_bwd_hopper_kernel, attn_fwd_hopper_kernel
from cs336_systems.attention.backends.triton import HEAD_DIMS as PORTABLE_HEAD_DIMS
from cs336_systems.attention.backends.triton import batch_head_strides, head_dim_parts, launch_delta
from cs336_systems.kernels.launch import DescriptorArg, Launcher, aligned, interpreting, new_output

HEAD_DIMS = (16, 32, 64, 128)
"""Head dims both kernels run without padding."""
SPLIT_HEAD_DIMS = tuple(d for d in PORTABLE_HEAD_DIMS if head_dim_parts(d)[1])
"""Head dims the backward also runs without padding (48, 80, 96), in two power-of-two column parts (80 = 64 + 16,
see ``triton.head_dim_parts``); the forward pads them to 128."""
BLOCK_N = 128  # keys held per backward program (64 per consumer warpgroup), keys per forward step
FORWARD_ROWS = 64  # queries per forward consumer warpgroup (two per program)
BACKWARD_ROWS = 64
"""Queries per backward step, every head dim: S^T, dP^T, dK and dV then fit in the consumers' registers (at 128,
S^T and dP^T alone would take 128 of them at d = 64)."""
STAGES = 2
"""Depth of the K/V and Q/dO rings (3 measured no faster at d = 64; at d = 128 it does not fit in shared memory)."""
ROWS_PER_PROGRAM = 2 * FORWARD_ROWS  # queries per forward program; BLOCK_N keys per backward program
DELTA_ROWS = 64  # queries per program of the Delta and dQ conversion kernels

_LOG2_E = math.log2(math.e)
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}


# ---------------------------------------------------------------------------------------------------
# What the backend runs
# ---------------------------------------------------------------------------------------------------


def supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why these kernels cannot run on such inputs, or None when they can (asked once per device, dtype and head
    dim: the operator caches its choice; it asks at the head dim padded to :data:`HEAD_DIMS`, and gives the backward
    :data:`SPLIT_HEAD_DIMS` unpadded)."""
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


def kernel_head_dims(part: str) -> tuple[int, ...]:
    """The head dims the kernels run ``part`` ("forward" or "backward") at without padding."""
    return HEAD_DIMS + SPLIT_HEAD_DIMS if part == "backward" else HEAD_DIMS


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
    """The plan of a contiguous output seen as ``shape`` (batch * heads, seq, d)."""
    return DescriptorPlan(False, shape, (shape[1] * shape[2], shape[2], 1), rows, columns)


class Plan(NamedTuple):
    """A planned launch: the grid, one :class:`DescriptorPlan` per descriptor argument (in the kernel's order), the
    other arguments fixed by the call's key (sizes and scales; the forward's schedule first), the kernel's
    constexprs and its warps."""

    grid: tuple[int, int]
    descriptors: tuple[DescriptorPlan, ...]
    scalars: tuple
    constexprs: dict[str, Any]
    num_warps: int

    def descriptor_args(self, tensors: tuple[Tensor, ...]) -> tuple[DescriptorArg, ...]:
        """What the compiled kernel's launcher reads of each descriptor on ``tensors`` (in the plan's order; where
        the plan has two descriptors per tensor, one per column part, the second ones follow all the first)."""
        return tuple(DescriptorArg(source, p.shape, p.strides)
                     for p, source in zip(self.descriptors, self._sources(tensors), strict=True))

    def full_descriptors(self, tensors: tuple[Tensor, ...]) -> tuple[TensorDescriptor, ...]:
        """The descriptors on ``tensors`` that Triton compiles the kernel from (in :meth:`descriptor_args`' order)."""
        return tuple(p.full_descriptor(source) for p, source in zip(self.descriptors, self._sources(tensors),
                                                                     strict=True))

    def _sources(self, tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """Each tensor, or its aligned copy where its plan says so (one copy per tensor, whatever its descriptors),
        once per descriptor."""
        sources = tuple(_aligned_copy(x) if p.copied else x for p, x in zip(self.descriptors, tensors))
        return sources * (len(self.descriptors) // len(tensors))


class ForwardArgs(NamedTuple):
    """The arguments of ``attn_fwd_hopper_kernel`` before its constexprs."""

    q_desc: Any
    k_desc: Any
    v_desc: Any
    o_desc: Any
    L: Tensor
    schedule: Tensor
    n_heads: int
    n_queries: int
    n_keys: int
    qk_scale: float


class BackwardArgs(NamedTuple):
    """The arguments of ``attn_bwd_hopper_kernel`` before its constexprs."""

    q_desc: Any
    k_desc: Any
    v_desc: Any
    do_desc: Any
    dk_desc: Any
    dv_desc: Any
    dq_desc: Any
    L: Tensor
    Delta: Tensor
    n_heads: int
    n_queries: int
    n_keys: int
    sm_scale: float
    qk_scale: float
    q_desc_b: Any  # the second column part's descriptors at a head dim of two parts, else None
    k_desc_b: Any
    v_desc_b: Any
    do_desc_b: Any
    dk_desc_b: Any
    dv_desc_b: Any
    dq_desc_b: Any


class DqConvertArgs(NamedTuple):
    """The arguments of ``attn_bwd_dq_convert_kernel`` before its constexprs."""

    DQ_acc: Tensor
    dQ: Tensor
    stride_dqb: int
    stride_dqh: int
    stride_dqm: int
    n_heads: int
    n_queries: int
    sm_scale: float


def _sizes(Q: Tensor, K: Tensor) -> tuple[int, int, int, int, int]:
    """(heads, batch * heads, n_queries, n_keys, d)."""
    n_heads = Q.shape[1] if Q.dim() == 4 else 1
    return n_heads, Q.shape[0] * n_heads, Q.shape[-2], K.shape[-2], Q.shape[-1]


class Launch(NamedTuple):
    """One launch ``kernel[grid](*args, **kwargs)``, for compiling it ahead of time (``scripts/flash_hopper_sass.py``,
    the tests)."""

    kernel: Any
    grid: tuple[int, int]
    args: tuple
    kwargs: dict[str, Any]


def _layout_key(x: Tensor) -> tuple:
    return x.shape, x.stride(), aligned(x)


_plans: dict[tuple, Plan] = {}
"""The backend's cache: the launch plan per ("forward" | "backward", device, dtype, causal, scale, layouts)."""


# ---------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------

_FORWARD = Launcher(attn_fwd_hopper_kernel)


TILE_COST = 1
"""A forward tile's fixed cost (loading its Q, writing its O and L), in key blocks, for :func:`forward_schedule`."""
BALANCE_TOLERANCE = 1.02
"""How much longer than the balanced schedule's the head-major one's busiest program may be (see
:func:`forward_schedule`)."""
L2_BUDGET = 32 * 2**20
"""The most bytes of K and V the balanced schedule may have in flight (heads that programs work on at once, times
a head's K and V). An H100's L2 holds 50 MB; measured on one (forward, causal): the balanced schedule ran faster
with 24 and 32 MB in flight ((4, 25, 2048, 64) 0.150 against 0.157 ms, (1, 25, 8192, 64) 0.498 against 0.516),
slower with 48 and 80 ((4, 32, 2048, 128) 0.329 against 0.303, (1, 32, 8192, 128) 1.09 against 0.98)."""


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


def forward_schedule(batch_heads: int, n_queries: int, n_keys: int, is_causal: bool, programs: int,
                     head_bytes: int) -> list[int]:
    """The forward's tiles (``bh * query_tiles + i``: queries ``i * ROWS_PER_PROGRAM ..`` of ``bh``) dealt to at
    most ``programs`` persistent programs: each program's first index into the list (``programs + 1`` entries,
    the last the list's length), then each program's tile ids in order (the kernel's ``schedule``).

    A tile costs ``TILE_COST`` plus its key blocks. Head-major: tiles go head after head, the heaviest causal tiles
    of a head first, each to the program that would be free first (what the hardware's scheduler does for a grid
    of one program per tile): programs running together work on a few heads, whose K and V (``head_bytes`` each)
    stay in L2. Where that leaves the busiest program more than ``BALANCE_TOLERANCE`` times the balanced schedule's
    work, the balanced one, if its heads in flight fit in ``L2_BUDGET``: the heaviest tiles first over all heads
    (longest processing time first), then each program's tiles in head order, so that programs still meet on
    nearby heads."""
    query_tiles = triton.cdiv(n_queries, ROWS_PER_PROGRAM)
    key_blocks = triton.cdiv(n_keys, BLOCK_N)
    programs = min(programs, batch_heads * query_tiles)

    def cost(i: int) -> int:
        return TILE_COST + (min(key_blocks, triton.cdiv((i + 1) * ROWS_PER_PROGRAM, BLOCK_N)) if is_causal
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


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors: the forward's persistent programs (one each). Elsewhere (launches
    compiled ahead of time on the CPU) an H100's 132."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _schedule_tensor(schedule: list[int], device: torch.device) -> Tensor:
    """``schedule`` as an int32 tensor on ``device``: copied before this returns (so that a launch on any stream
    finds it there), or, while a CUDA graph is being captured, copied by the graph from page-locked memory at each
    replay (a capture allows no synchronous copy)."""
    host = torch.tensor(schedule, dtype=torch.int32)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return host.to(device)
    host = host.pin_memory()
    _captured_sources.append(host)  # kept for as long as the graph may replay the copy
    return torch.empty_like(host, device=device).copy_(host, non_blocking=True)


_captured_sources: list[Tensor] = []
"""The page-locked sources of the schedules that captured graphs copy (a few kilobytes per captured call)."""


def _forward_plan(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool, sm_scale: float) -> Plan:
    """The plan of the forward on inputs laid out as these (Q, K, V, then the contiguous output O)."""
    n_heads, batch_heads, n_queries, n_keys, head_dim = _sizes(Q, K)
    (q, q_columns), (k, k_columns), (v, v_columns) = (
        DescriptorPlan.of(x, rows) for x, rows in ((Q, FORWARD_ROWS), (K, BLOCK_N), (V, BLOCK_N)))
    o = _output_plan((batch_heads, n_queries, head_dim), FORWARD_ROWS)
    constexprs = dict(HEAD_DIM=head_dim, IS_CAUSAL=is_causal, ROWS=FORWARD_ROWS, BLOCK_N=BLOCK_N, STAGES=STAGES,
                      Q_COLUMNS=q_columns, K_COLUMNS=k_columns, V_COLUMNS=v_columns)
    schedule = forward_schedule(batch_heads, n_queries, n_keys, is_causal, _multiprocessors(Q.device),
                                2 * n_keys * head_dim * Q.element_size())
    return Plan((schedule[0] - 1, 1), (q, k, v, o),
                (_schedule_tensor(schedule, Q.device), n_heads, n_queries, n_keys, sm_scale * _LOG2_E), constexprs, 4)


def forward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    is_causal: bool, sm_scale: float,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads q"]]:
    """``O`` (contiguous, Q's shape and dtype) and the natural-log logsumexp ``L`` (contiguous, float32)."""
    O = new_output(Q.shape, Q.dtype, Q.device)
    L = new_output(Q.shape[:-1], torch.float32, Q.device)
    key = ("forward", Q.device.index, Q.dtype, is_causal, sm_scale, _layout_key(Q), _layout_key(K), _layout_key(V),
           aligned(L))
    plan = _plans.get(key)
    if plan is not None and _FORWARD.compiled(key):  # the short path: only what holds the tensors' addresses
        _FORWARD(key, plan.grid, ForwardArgs(*plan.descriptor_args((Q, K, V, O)), L, *plan.scalars), {})
    else:
        plan = _forward_plan(Q, K, V, is_causal, sm_scale)
        # A plan made during a capture is not kept: its schedule lives in the graph's memory, copied at replays.
        if not (Q.is_cuda and torch.cuda.is_current_stream_capturing()):
            _plans[key] = plan
        _FORWARD(key, plan.grid, ForwardArgs(*plan.full_descriptors((Q, K, V, O)), L, *plan.scalars),
                 plan.constexprs, num_warps=plan.num_warps)
    return O, L


def forward_launch(Q: Tensor, K: Tensor, V: Tensor, O: Tensor, L: Tensor, is_causal: bool, sm_scale: float) -> Launch:
    """The forward's launch on these tensors (``O`` contiguous), without running it."""
    plan = _forward_plan(Q, K, V, is_causal, sm_scale)
    return Launch(attn_fwd_hopper_kernel, plan.grid, ForwardArgs(*plan.full_descriptors((Q, K, V, O)), L, *plan.scalars),
                  dict(plan.constexprs, num_warps=plan.num_warps))


# ---------------------------------------------------------------------------------------------------
# Backward: Delta (and DQ_acc zeroed) by a Triton kernel, the Gluon kernel, then dQ = DQ_acc / sqrt(d)
# ---------------------------------------------------------------------------------------------------

_BACKWARD = Launcher(attn_bwd_hopper_kernel)
_DQ_CONVERT = Launcher(triton_kernels.attn_bwd_dq_convert_kernel)
_NO_SECOND_PART = (None,) * 7


def _backward_plan(Q: Tensor, K: Tensor, V: Tensor, dO: Tensor, is_causal: bool, sm_scale: float) -> Plan:
    """The plan of the Gluon backward on inputs laid out as these (Q, K, V, dO, then the contiguous dK, dV and the
    float32 dQ accumulator): one descriptor per tensor, and at a head dim of two column parts (:data:`SPLIT_HEAD_DIMS`)
    a second one per tensor, over its second part, after them."""
    n_heads, batch_heads, n_queries, n_keys, head_dim = _sizes(Q, K)
    part_a, part_b = head_dim_parts(head_dim)
    descriptors = []
    for columns in (part_a, part_b) if part_b else (0,):  # 0: the whole head dim
        inputs = [DescriptorPlan.of(x, rows, columns) for x, rows in
                  ((Q, BACKWARD_ROWS), (K, BLOCK_N), (V, BLOCK_N), (dO, BACKWARD_ROWS))]
        (q, q_columns), (k, k_columns), (v, v_columns), (do, do_columns) = inputs
        dk = dv = _output_plan((batch_heads, n_keys, head_dim), BLOCK_N, columns)
        dq = _output_plan((batch_heads, n_queries, head_dim), BACKWARD_ROWS, columns)
        descriptors += [q, k, v, do, dk, dv, dq]
    constexprs = dict(HEAD_DIM=head_dim, IS_CAUSAL=is_causal, BLOCK_M=BACKWARD_ROWS, BLOCK_N=BLOCK_N, STAGES=STAGES,
                      Q_COLUMNS=q_columns, K_COLUMNS=k_columns, V_COLUMNS=v_columns, DO_COLUMNS=do_columns,
                      HEAD_DIM_B=part_b)
    return Plan((triton.cdiv(n_keys, BLOCK_N), batch_heads), tuple(descriptors),
                (n_heads, n_queries, n_keys, sm_scale, sm_scale * _LOG2_E), constexprs, 8)


def _backward_args(descriptors: tuple, L: Tensor, Delta: Tensor, scalars: tuple) -> BackwardArgs:
    """The kernel's arguments from a plan's descriptors (one or two per tensor) and the other values."""
    return BackwardArgs(*descriptors[:7], L, Delta, *scalars, *(descriptors[7:] or _NO_SECOND_PART))


def backward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    O: Float[Tensor, "batch *heads q d"], L: Float[Tensor, "batch *heads q"], dO: Float[Tensor, "batch *heads q d"],
    is_causal: bool, sm_scale: float,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads k d"], Float[Tensor, "batch *heads k d"]]:
    """``dQ, dK, dV`` (contiguous, the inputs' dtype) from the forward's ``O`` and ``L`` and the output gradient
    ``dO`` (unit stride along ``d``, O's dtype)."""
    n_heads, batch_heads, n_queries, _, head_dim = _sizes(Q, K)
    # The Gluon kernel adds dS K over key tiles into a float32 buffer, which the Delta kernel zeroes.
    DQ_acc = torch.empty((batch_heads, n_queries, head_dim), dtype=torch.float32, device=Q.device)
    Delta = launch_delta(O, dO, DQ_acc)
    dQ = new_output(Q.shape, Q.dtype, Q.device)
    dK = new_output(K.shape, K.dtype, K.device)
    dV = new_output(V.shape, V.dtype, V.device)
    key = ("backward", Q.device.index, Q.dtype, is_causal, sm_scale, _layout_key(Q), _layout_key(K), _layout_key(V),
           _layout_key(dO), aligned(L, Delta))
    plan = _plans.get(key)
    tensors = (Q, K, V, dO, dK, dV, DQ_acc)
    if plan is not None and _BACKWARD.compiled(key):
        _BACKWARD(key, plan.grid, _backward_args(plan.descriptor_args(tensors), L, Delta, plan.scalars), {})
    else:
        plan = _plans[key] = _backward_plan(Q, K, V, dO, is_causal, sm_scale)
        _BACKWARD(key, plan.grid, _backward_args(plan.full_descriptors(tensors), L, Delta, plan.scalars),
                  plan.constexprs, num_warps=plan.num_warps)
    _DQ_CONVERT((dQ.dtype, dQ.shape), (triton.cdiv(n_queries, DELTA_ROWS), batch_heads),
                DqConvertArgs(DQ_acc, dQ, *batch_head_strides(dQ), n_heads, n_queries, sm_scale),
                dict(HEAD_DIM=head_dim, HEAD_DIM_B=plan.constexprs["HEAD_DIM_B"], BLOCK_M=DELTA_ROWS), num_warps=4)
    return dQ, dK, dV


def backward_launch(Q: Tensor, K: Tensor, V: Tensor, dO: Tensor, L: Tensor, Delta: Tensor, dK: Tensor, dV: Tensor,
                    DQ_acc: Tensor, is_causal: bool, sm_scale: float) -> Launch:
    """The Gluon backward's launch on these tensors (``dK``, ``dV``, ``DQ_acc`` contiguous), without running it."""
    plan = _backward_plan(Q, K, V, dO, is_causal, sm_scale)
    args = _backward_args(plan.full_descriptors((Q, K, V, dO, dK, dV, DQ_acc)), L, Delta, plan.scalars)
    return Launch(attn_bwd_hopper_kernel, plan.grid, args, dict(plan.constexprs, num_warps=plan.num_warps))
