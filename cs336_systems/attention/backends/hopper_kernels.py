"""FlashAttention on Hopper (sm_90) in Gluon: a forward and a backward written with Hopper's own machinery. The host
side (descriptors, launch plans, when these kernels run) is ``hopper.py``.

Both are warp-specialised (``gl.warp_specialize``): a one-warp worker partition streams tiles through the copy
engine (TMA) into a ring of shared-memory stages guarded by mbarriers, refilling a stage once the consumers have
released it, while consumer warpgroups (their registers raised by ``setmaxnreg``) run asynchronous ``wgmma``.

Forward. Persistent: one program per multiprocessor runs the tiles of 128 queries that the host's schedule
deals it (``hopper.forward_schedule``), one after another, 64 queries per consumer warpgroup, each warpgroup its own
partition: they meet only at the rings' barriers, so that they drift apart and one's softmax runs while the other's
matmuls occupy the tensor cores. S_(j+1) = Q K_(j+1)^T is issued behind P V_j; P goes to ``wgmma`` from registers.
Q tiles come in two slots and the K/V ring runs on across tiles, so that the loader fetches the next tile's Q and
first blocks while the consumers finish a tile, and a tile's O, staged in its Q slot, leaves during the next tile.

Backward. One program holds ``BLOCK_N`` keys, 64 per consumer warpgroup (K and V in shared memory, dK and dV
accumulating in registers): 128 on two warpgroups, or 64 on one where two such programs per multiprocessor run
faster (``hopper.backward_tiles``). It sweeps the query blocks that see its keys, ``BLOCK_M`` queries at a time; the
loader also stores each block's base-2 logsumexp and Delta into the ring. Per step, five matmuls, in
FlashAttention-3's order: S^T = K Q^T and dP^T = V dO^T from shared memory (K and V from registers, loaded once, at
head dims up to 32), each warpgroup the rows of its keys, so that P^T and dS^T stay in its registers for
dV += P^T dO and dK += dS^T Q (register-sourced wgmma; P is never written to shared memory); dS^T is written once,
for dQ_j = dS K, which is added into a float32 buffer by the copy engine's bulk reduction (``cp.reduce.async.bulk``)
from a double-buffered staging tile, so that the warps go on at once. The next block's S^T and dP^T are issued
behind dK and all matmuls are waited for before the step ends: a wgmma whose accumulator crosses the loop's back
edge in flight makes ptxas serialise every wgmma of the kernel (its info C7514; the test suite compiles the kernel
and checks). Two barriers of the consumer warps per step order the shared buffers.

Head dims of two power-of-two parts (48, 80, 96). Tensor descriptors move power-of-two blocks only: both kernels
move each tensor as two column blocks and run every product over the head dim as two matmuls, with the same steps
otherwise: the forward's S accumulates both parts and O is two accumulators; the backward's S^T and dP^T
accumulate both parts, and dV, dK and dQ are two accumulators each.

Code. The file reads: what both directions share (the :class:`Ring` of stages with its barriers), the forward,
then the backward, with the same names on both sides (``_fwd_load_partition`` / ``_bwd_load_partition``,
``_fwd_issue_scores``, ``_fwd_step``, ``_fwd_compute_partition`` and their ``_bwd_`` twins). The state a function
needs travels in aggregates: the kernel's constexpr configuration (``FwdConfig`` / ``BwdConfig``: tile sizes,
flags, register layouts), the program's coordinates (``FwdProgram`` / ``BwdProgram``), the shared-memory buffers
(``FwdBuffers``; the backward's ``BwdBuffers`` and its Q/dO ring ``BwdRing``), each ring's barriers and phases
(``Ring``) and the accumulators a loop carries (``FwdState`` / ``BwdState``). An aggregate adds no instruction:
it is flattened into its fields where a function is called. The order of the fields of the aggregates a worker
partition takes is the order its arguments had when they were spelled out one by one: it orders the values that
``gl.warp_specialize`` hands to the workers, and so the generated code.

Tensor views. TMA descriptors need a unit stride along ``d`` and 16-byte aligned other strides. The host sees a
4-D tensor ``(batch, heads, seq, d)`` as 3-D in one of two ways, without copying: ``(batch * heads, seq, d)``
(contiguous tensors) or ``(batch, seq, heads * d)`` (a ``(batch, seq, heads, d)`` tensor transposed, as attention
layers make them); the ``*_COLUMNS`` flags say which, and the kernel addresses a block at ``[b * heads + h, m, 0]``
or ``[b, m, h * d]`` accordingly.
"""

# No ``from __future__ import annotations`` here: an aggregate checks the values of its fields against its
# annotations, which must then be types, not strings.

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cs336_systems.attention.backends.gluon_compat import aggregate, tma_reduce_add
from cs336_systems.attention.backends.triton_kernels import LN_2, LOG2_E

# ---------------------------------------------------------------------------------------------------
# Shared by the forward and the backward
# ---------------------------------------------------------------------------------------------------


@gluon.jit
def _block_coord(b, h, m, n_heads, HEAD_DIM: gl.constexpr, HEADS_IN_COLUMNS: gl.constexpr, COLUMN: gl.constexpr):
    """The descriptor coordinate of rows ``m ..`` of head ``h`` of batch ``b`` (see the module docstring), from the
    head's column ``COLUMN`` (0, or the second column part's first)."""
    if HEADS_IN_COLUMNS:
        return [b, m, h * HEAD_DIM + COLUMN]
    else:
        return [b * n_heads + h, m, COLUMN]


@gluon.constexpr_function
def _acc_layout(columns, warps):
    """The register layout of a wgmma accumulator of ``columns`` columns over ``warps`` warps (16 rows each)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, columns, 16])


@gluon.constexpr_function
def _optional(value):
    """A field that is None at a power-of-two head dim: ``None`` arrives unwrapped, wrap it as a constexpr."""
    return gl.constexpr(None) if value is None else value


@gluon.jit
def _load_pair(config, program, row, landed, x_desc, x_ring, X_COLUMNS: gl.constexpr, y_desc, y_ring,
               Y_COLUMNS: gl.constexpr, s, x_desc_b, x_ring_b, y_desc_b, y_ring_b):
    """Copy rows ``row ..`` of the program's batch-head of two tensors (K and V, or Q and dO) into stage ``s`` of
    their rings, first parts first, then (at a two-part head dim) the second column parts into ``x_ring_b`` and
    ``y_ring_b`` (None at a power of two), all landing at ``landed``."""
    tma.async_copy_global_to_shared(
        x_desc, _block_coord(program.b, program.h, row, program.n_heads, config.HEAD_DIM, X_COLUMNS, 0), landed,
        x_ring.index(s))
    tma.async_copy_global_to_shared(
        y_desc, _block_coord(program.b, program.h, row, program.n_heads, config.HEAD_DIM, Y_COLUMNS, 0), landed,
        y_ring.index(s))
    if config.HEAD_DIM_B > 0:
        tma.async_copy_global_to_shared(
            x_desc_b, _block_coord(program.b, program.h, row, program.n_heads, config.HEAD_DIM, X_COLUMNS,
                                   config.HEAD_DIM_A), landed, x_ring_b.index(s))
        tma.async_copy_global_to_shared(
            y_desc_b, _block_coord(program.b, program.h, row, program.n_heads, config.HEAD_DIM, Y_COLUMNS,
                                   config.HEAD_DIM_A), landed, y_ring_b.index(s))


@gluon.jit
def _operand_tiles(dtype: gl.constexpr, COUNT: gl.constexpr, ROWS: gl.constexpr, COLUMNS: gl.constexpr):
    """``COUNT`` tiles of (ROWS, COLUMNS) in shared memory, in the swizzled layout that both the copy engine and
    ``wgmma`` address."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, COLUMNS], dtype)
    return gl.allocate_shared_memory(dtype, [COUNT, ROWS, COLUMNS], layout)


@aggregate
class Ring:
    """The barriers of a ring of ``STAGES`` shared-memory stages that a producer fills with blocks ``0, 1, 2, ..``
    and consumers drain in the same order: block ``j`` goes to stage ``j % STAGES``, landed when ``ready[s]``
    completes its phase ``(j // STAGES) & 1``, and the stage is refilled once ``free[s]`` completes the same phase
    (each barrier (STAGES, 1) int64)."""

    ready: gl.shared_memory_descriptor
    free: gl.shared_memory_descriptor
    STAGES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ready, free, STAGES):
        self.ready = ready
        self.free = free
        self.STAGES = gl.constexpr(STAGES)

    @gluon.jit
    def init(self, ready_count: gl.constexpr, free_count: gl.constexpr):
        """Each stage's barriers: ``ready`` completes after ``ready_count`` arrivals, ``free`` after ``free_count``."""
        for s in gl.static_range(self.STAGES):
            mbarrier.init(self.ready.index(s), count=ready_count)
            mbarrier.init(self.free.index(s), count=free_count)

    @gluon.jit
    def acquire(self, j, nbytes: gl.constexpr):
        """Producer: the stage for block ``j``, once the consumers have released its previous block (the first
        ``STAGES`` fills need no wait), and its ``ready`` barrier, told to expect ``nbytes`` from the copy engine."""
        s = j % self.STAGES
        mbarrier.wait(self.free.index(s), ((j // self.STAGES) & 1) ^ 1, pred=j >= self.STAGES)
        landed = self.ready.index(s)
        mbarrier.expect(landed, nbytes)
        return s, landed

    @gluon.jit
    def wait_landed(self, j, n_blocks, first):
        """Consumer: the stage of block ``first + j`` of a sweep over blocks ``first .. first + n_blocks`` once it
        has landed. Past the sweep's last block (``j == n_blocks``) the last block's stage, unwaited: the caller
        recomputes that block instead of waiting for one that never comes, so that every step of its loop finds the
        next matmuls in flight."""
        j_valid = first + gl.maximum(gl.minimum(j, n_blocks - 1), 0)
        s = j_valid % self.STAGES
        mbarrier.wait(self.ready.index(s), (j_valid // self.STAGES) & 1, pred=j < n_blocks)
        return s

    @gluon.jit
    def wait(self, j):
        """Consumer: the stage of block ``j`` once it has landed."""
        s = j % self.STAGES
        mbarrier.wait(self.ready.index(s), (j // self.STAGES) & 1)
        return s

    @gluon.jit
    def stage(self, j):
        """The stage of block ``j``."""
        return j % self.STAGES

    @gluon.jit
    def release(self, j):
        """Consumer: done with block ``j``'s stage (one arrival)."""
        mbarrier.arrive(self.free.index(j % self.STAGES))

    @gluon.jit
    def release_previous(self, j):
        """Consumer: done with block ``j - 1``'s stage (no arrival for ``j == 0``)."""
        mbarrier.arrive(self.free.index((j + self.STAGES - 1) % self.STAGES), pred=j > 0)


# ---------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------
# A program runs tiles of 128 queries one after another (the host's schedule): two consumer warpgroups of 64 rows
# each, each its own partition, so that they drift apart: while one runs its softmax on the CUDA cores, the other's
# matmuls run on the tensor cores (the effect FlashAttention-3 gets by ping-pong scheduling). A one-warp partition
# streams each tile's Q into one of two slots and K and V blocks through a ring that runs on across tiles; a slot or
# stage is refilled once both warpgroups have released it (mbarriers of count 2).


@aggregate
class FwdConfig:
    """The forward's compile-time configuration: the kernel's constexpr arguments and the consumers' register
    layouts."""

    HEAD_DIM: gl.constexpr
    IS_CAUSAL: gl.constexpr
    ROWS: gl.constexpr  # queries per consumer warpgroup (the program holds 2 * ROWS)
    BLOCK_N: gl.constexpr  # keys per step
    Q_COLUMNS: gl.constexpr  # whether the heads are in the columns of Q's, K's, V's views (module docstring)
    K_COLUMNS: gl.constexpr
    V_COLUMNS: gl.constexpr
    s_layout: gl.constexpr  # S (ROWS, BLOCK_N) of one warpgroup
    o_layout: gl.constexpr  # O (ROWS, HEAD_DIM_A) of one warpgroup
    HEAD_DIM_A: gl.constexpr
    HEAD_DIM_B: gl.constexpr
    o_layout_b: gl.constexpr  # O's second column part (ROWS, HEAD_DIM_B), or None

    @gluon.constexpr_function
    def __init__(self, HEAD_DIM, HEAD_DIM_B, IS_CAUSAL, ROWS, BLOCK_N, Q_COLUMNS, K_COLUMNS, V_COLUMNS):
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.IS_CAUSAL = gl.constexpr(IS_CAUSAL)
        self.ROWS = gl.constexpr(ROWS)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.Q_COLUMNS = gl.constexpr(Q_COLUMNS)
        self.K_COLUMNS = gl.constexpr(K_COLUMNS)
        self.V_COLUMNS = gl.constexpr(V_COLUMNS)
        self.s_layout = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, BLOCK_N, 16]))
        self.HEAD_DIM_A = gl.constexpr(HEAD_DIM - HEAD_DIM_B)
        self.HEAD_DIM_B = gl.constexpr(HEAD_DIM_B)
        self.o_layout = gl.constexpr(_acc_layout(HEAD_DIM - HEAD_DIM_B, 4))
        self.o_layout_b = gl.constexpr(_acc_layout(HEAD_DIM_B, 4) if HEAD_DIM_B else None)


@aggregate
class FwdProgram:
    """One tile of the forward: batch ``b``, head ``h`` (``bh = b * heads + h``), queries ``start_m ..
    start_m + 2 * ROWS``, key blocks ``0 .. n_blocks`` of which the first ``n_full`` need no mask."""

    b: gl.tensor
    h: gl.tensor
    bh: gl.tensor
    n_heads: gl.tensor
    start_m: gl.tensor
    n_blocks: gl.tensor
    n_full: gl.tensor
    n_queries: gl.tensor
    n_keys: gl.tensor

    @gluon.constexpr_function
    def __init__(self, b, h, bh, n_heads, start_m, n_blocks, n_full, n_queries, n_keys):
        self.b = b
        self.h = h
        self.bh = bh
        self.n_heads = n_heads
        self.start_m = start_m
        self.n_blocks = n_blocks
        self.n_full = n_full
        self.n_queries = n_queries
        self.n_keys = n_keys


@gluon.jit
def _fwd_tile(config, tile, n_heads, n_queries, n_keys):
    """The :class:`FwdProgram` of tile ``tile = bh * query_tiles + i`` (queries ``i * 2 * ROWS ..`` of ``bh``)."""
    query_tiles = gl.cdiv(n_queries, 2 * config.ROWS)
    bh = tile // query_tiles
    start_m = (tile % query_tiles) * (2 * config.ROWS)
    n_blocks = gl.cdiv(n_keys, config.BLOCK_N)
    if config.IS_CAUSAL:
        # Keys past the tile's last query are invisible; blocks reaching past its first query need the mask.
        n_blocks = gl.minimum(n_blocks, gl.cdiv(start_m + 2 * config.ROWS, config.BLOCK_N))
        n_full = gl.minimum(start_m // config.BLOCK_N, n_keys // config.BLOCK_N)
    else:
        n_full = n_keys // config.BLOCK_N
    n_full = gl.minimum(n_full, n_blocks)
    return FwdProgram(bh // n_heads, bh % n_heads, bh, n_heads, start_m, n_blocks, n_full, n_queries, n_keys)


@gluon.jit
def _fwd_schedule(schedule):
    """Where this program's tile ids are: ``schedule[first:last]`` (the schedule starts with each program's
    ``first``, and the last program's ``last``)."""
    pid = gl.program_id(0)
    return gl.load(schedule + pid), gl.load(schedule + pid + 1)


@aggregate
class FwdBuffers:
    """The forward's shared memory: the warpgroups' Q tiles in two slots (slot ``t % 2`` holds tile ``t``'s, for
    warpgroup ``w`` at index ``2 * slot + w``: (4, ROWS, HEAD_DIM_A)), its ring barriers ``q`` (a slot is landed by
    the copy engine, released by both warpgroups once its tile's O, staged in it, has left); the K/V ring
    (STAGES, BLOCK_N, HEAD_DIM_A) and its barriers ``kv`` (a stage is released by both warpgroups); the second
    column parts of the Q slots and the K/V ring ((4, ROWS, HEAD_DIM_B), (STAGES, BLOCK_N, HEAD_DIM_B)), or None."""

    q_smem: gl.shared_memory_descriptor
    k_ring: gl.shared_memory_descriptor
    v_ring: gl.shared_memory_descriptor
    q: Ring
    kv: Ring
    q_smem_b: (gl.shared_memory_descriptor, gl.constexpr)
    k_ring_b: (gl.shared_memory_descriptor, gl.constexpr)
    v_ring_b: (gl.shared_memory_descriptor, gl.constexpr)

    @gluon.constexpr_function
    def __init__(self, q_smem, k_ring, v_ring, q, kv, q_smem_b, k_ring_b, v_ring_b):
        self.q_smem = q_smem
        self.k_ring = k_ring
        self.v_ring = v_ring
        self.q = q
        self.kv = kv
        self.q_smem_b = _optional(q_smem_b)
        self.k_ring_b = _optional(k_ring_b)
        self.v_ring_b = _optional(v_ring_b)


@aggregate
class FwdState:
    """One warpgroup's online softmax: the unnormalised O (ROWS, HEAD_DIM_A), and per row the sum of the
    probabilities and the running maximum of the scaled base-2 scores (ROWS,), all float32; O's second column part
    (ROWS, HEAD_DIM_B) or None."""

    acc: gl.tensor
    row_sum: gl.tensor
    row_max: gl.tensor
    acc_b: (gl.tensor, gl.constexpr)

    @gluon.constexpr_function
    def __init__(self, acc, row_sum, row_max, acc_b):
        self.acc = acc
        self.row_sum = row_sum
        self.row_max = row_max
        self.acc_b = _optional(acc_b)


@gluon.jit
def _fwd_load_partition(config, q_desc, k_desc, v_desc, buffers, schedule, n_heads, n_queries, n_keys, q_desc_b,
                        k_desc_b, v_desc_b):
    """Worker partition: per tile, both warpgroups' Q tiles into a free slot, then K and V blocks into the ring, as
    far ahead of the consumers as they have room, across tiles (each in two column blocks at a two-part head
    dim)."""
    first, last = _fwd_schedule(schedule)
    block = 0  # K/V blocks streamed so far: the ring's position
    for k in range(first, last):
        program = _fwd_tile(config, gl.load(schedule + k), n_heads, n_queries, n_keys)
        slot, landed = buffers.q.acquire(k - first,
                                         2 * config.ROWS * config.HEAD_DIM * q_desc.dtype.primitive_bitwidth // 8)
        for w in gl.static_range(2):
            tma.async_copy_global_to_shared(
                q_desc, _block_coord(program.b, program.h, program.start_m + w * config.ROWS, program.n_heads,
                                     config.HEAD_DIM, config.Q_COLUMNS, 0), landed, buffers.q_smem.index(2 * slot + w))
            if config.HEAD_DIM_B > 0:
                tma.async_copy_global_to_shared(
                    q_desc_b, _block_coord(program.b, program.h, program.start_m + w * config.ROWS, program.n_heads,
                                           config.HEAD_DIM, config.Q_COLUMNS, config.HEAD_DIM_A),
                    landed, buffers.q_smem_b.index(2 * slot + w))
        for j in range(program.n_blocks):
            s, landed = buffers.kv.acquire(block + j,
                                           2 * config.BLOCK_N * config.HEAD_DIM * k_desc.dtype.primitive_bitwidth // 8)
            _load_pair(config, program, j * config.BLOCK_N, landed, k_desc, buffers.k_ring, config.K_COLUMNS, v_desc,
                       buffers.v_ring, config.V_COLUMNS, s, k_desc_b, buffers.k_ring_b, v_desc_b, buffers.v_ring_b)
        block += program.n_blocks


@gluon.jit
def _fwd_issue_scores(config, program, buffers, block, j, q, q_b):
    """Start S_j = Q K_j^T once the tile's block ``j`` (the ring's ``block + j``) has landed (see
    :meth:`Ring.wait_landed` past the last block); ``q`` is (ROWS, HEAD_DIM_A), ``q_b`` the second column part
    (ROWS, HEAD_DIM_B) or None."""
    s = buffers.kv.wait_landed(j, program.n_blocks, block)
    zero = gl.zeros([config.ROWS, config.BLOCK_N], gl.float32, config.s_layout)
    scores = warpgroup_mma(q, buffers.k_ring.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    if config.HEAD_DIM_B > 0:
        scores = warpgroup_mma(q_b, buffers.k_ring_b.index(s).permute((1, 0)), scores, is_async=True)
    return scores


@gluon.jit
def _fwd_step(config, program, buffers, state, scores, block, j, q, q_b, offs_m, qk_scale, MASKED: gl.constexpr):
    """Key block ``j`` of the tile (the ring's ``block + j``), whose S is in flight: online softmax, then P V_j,
    with S_(j+1) started behind it."""
    s = buffers.kv.stage(block + j)
    scores = warpgroup_mma_wait(0, deps=[scores])
    if MASKED:
        offs_n = j * config.BLOCK_N + gl.arange(0, config.BLOCK_N, layout=gl.SliceLayout(0, config.s_layout))
        visible = offs_n[None, :] < program.n_keys
        if config.IS_CAUSAL:
            visible = visible & (offs_m[:, None] >= offs_n[None, :])
        scores = gl.where(visible, scores, -1.0e30)
    # Base 2, maximum over unscaled scores (qk_scale > 0): the scale joins the exponent in one FMA per score.
    new_row_max = gl.maximum(state.row_max, gl.max(scores, 1) * qk_scale)
    p = gl.exp2(scores * qk_scale - new_row_max[:, None])
    rescale = gl.exp2(state.row_max - new_row_max)
    row_sum = state.row_sum * rescale + gl.sum(p, 1)
    acc = state.acc * gl.convert_layout(rescale, gl.SliceLayout(1, config.o_layout))[:, None]
    p_op = gl.convert_layout(p.to(q.dtype), gl.DotOperandLayout(operand_index=0, parent=config.o_layout, k_width=2))
    acc = warpgroup_mma(p_op, buffers.v_ring.index(s), acc, is_async=True)
    acc_b = state.acc_b
    if config.HEAD_DIM_B > 0:
        acc_b = acc_b * gl.convert_layout(rescale, gl.SliceLayout(1, config.o_layout_b))[:, None]
        p_op_b = gl.convert_layout(p.to(q.dtype),
                                   gl.DotOperandLayout(operand_index=0, parent=config.o_layout_b, k_width=2))
        acc_b = warpgroup_mma(p_op_b, buffers.v_ring_b.index(s), acc_b, is_async=True)
    scores = _fwd_issue_scores(config, program, buffers, block, j + 1, q, q_b)
    if config.HEAD_DIM_B > 0:
        acc, acc_b = warpgroup_mma_wait(2, deps=[acc, acc_b])  # S_(j+1)'s two matmuls may run on
    else:
        acc = warpgroup_mma_wait(1, deps=[acc])
    # This warpgroup is done with stage s (K_j long since, V_j now): one arrive from it, after its own barrier.
    # Past the tile's last block the S in flight reads a released stage, which the loader may be refilling with
    # the next tile's block: that S is never used.
    buffers.kv.release(block + j)
    return FwdState(acc, row_sum, new_row_max, acc_b), scores


@gluon.jit
def _fwd_compute_partition(config, buffers, o_desc, L, schedule, n_heads, n_queries, n_keys, qk_scale,
                           w: gl.constexpr, o_desc_b):
    """Warpgroup ``w`` (the default partition for 0, a worker for 1): per tile, rows ``start_m + w * ROWS ..``
    of O (staged in the tile's Q slot for the copy engine, the store overlapping the next tile) and L."""
    row_layout: gl.constexpr = gl.SliceLayout(1, config.s_layout)
    first, last = _fwd_schedule(schedule)
    block = 0
    for k in range(first, last):
        program = _fwd_tile(config, gl.load(schedule + k), n_heads, n_queries, n_keys)
        first_row = program.start_m + w * config.ROWS
        offs_m = first_row + gl.arange(0, config.ROWS, layout=row_layout)
        acc_b = None
        if config.HEAD_DIM_B > 0:
            acc_b = gl.zeros([config.ROWS, config.HEAD_DIM_B], gl.float32, config.o_layout_b)
        state = FwdState(gl.zeros([config.ROWS, config.HEAD_DIM_A], gl.float32, config.o_layout),
                         gl.zeros([config.ROWS], gl.float32, row_layout),
                         gl.full([config.ROWS], float("-inf"), gl.float32, row_layout), acc_b)

        slot = buffers.q.wait(k - first)
        q = buffers.q_smem.index(2 * slot + w)
        q_b = buffers.q_smem_b
        if config.HEAD_DIM_B > 0:
            q_b = buffers.q_smem_b.index(2 * slot + w)
        scores = _fwd_issue_scores(config, program, buffers, block, 0, q, q_b)
        for j in range(0, program.n_full):
            state, scores = _fwd_step(config, program, buffers, state, scores, block, j, q, q_b, offs_m, qk_scale,
                                      False)
        # The previous tile's O has left its slot by now (waited here, not at the tile's start, where the store
        # has just been issued): the loader may refill the slot with the next tile's Q.
        tma.store_wait(0)
        gl.thread_barrier()
        buffers.q.release_previous(k - first)
        for j in range(program.n_full, program.n_blocks):
            state, scores = _fwd_step(config, program, buffers, state, scores, block, j, q, q_b, offs_m, qk_scale,
                                      True)
        if config.HEAD_DIM_B > 0:
            acc, acc_b, scores = warpgroup_mma_wait(0, deps=[state.acc, state.acc_b, scores])
        else:
            acc = warpgroup_mma_wait(0, deps=[state.acc, scores])[0]
        block += program.n_blocks

        L_row = L + program.bh.to(gl.int64) * program.n_queries
        gl.store(L_row + offs_m, (state.row_max + gl.log2(state.row_sum)) * LN_2, mask=offs_m < program.n_queries)
        out = acc / gl.convert_layout(state.row_sum, gl.SliceLayout(1, config.o_layout))[:, None]
        q.store(out.to(q.dtype))  # Q is no longer read: its buffer stages O for the copy engine
        if config.HEAD_DIM_B > 0:
            out_b = acc_b / gl.convert_layout(state.row_sum, gl.SliceLayout(1, config.o_layout_b))[:, None]
            q_b.store(out_b.to(q.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [program.bh, first_row, 0], q)
        if config.HEAD_DIM_B > 0:
            tma.async_copy_shared_to_global(o_desc_b, [program.bh, first_row, config.HEAD_DIM_A], q_b)
    tma.store_wait(0)


@gluon.jit
def _fwd_operand_buffers(dtype: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         COLUMNS: gl.constexpr):
    """One column part's (``COLUMNS`` of the head dim) shared memory for the matmuls' operands: the Q slots
    (4, ROWS, COLUMNS), the K and V rings (STAGES, BLOCK_N, COLUMNS)."""
    q_smem = _operand_tiles(dtype, 4, ROWS, COLUMNS)
    k_ring = _operand_tiles(dtype, STAGES, BLOCK_N, COLUMNS)
    v_ring = _operand_tiles(dtype, STAGES, BLOCK_N, COLUMNS)
    return q_smem, k_ring, v_ring


@gluon.jit(do_not_specialize=["n_heads", "n_queries", "n_keys"])
def attn_fwd_hopper_kernel(
    q_desc, k_desc, v_desc,  # 3-D views of Q, K, V, blocks (1, ROWS or BLOCK_N, HEAD_DIM_A)
    o_desc,  # contiguous (batch * heads, n_queries, HEAD_DIM) output, blocks (1, ROWS, HEAD_DIM_A)
    q_desc_b, k_desc_b, v_desc_b, o_desc_b,  # the second column blocks, or None
    L,  # float32 (batch * heads, n_queries) output: natural-log logsumexp
    schedule,  # int32: where each program's tile ids start (programs + 1 entries), then the ids
    n_heads, n_queries, n_keys,
    qk_scale,  # log2(e) / sqrt(d)
    HEAD_DIM: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    ROWS: gl.constexpr,  # queries per consumer warpgroup (the program holds 2 * ROWS)
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    Q_COLUMNS: gl.constexpr, K_COLUMNS: gl.constexpr, V_COLUMNS: gl.constexpr,
    HEAD_DIM_B: gl.constexpr,  # columns of the second part, 0 for none (the first: HEAD_DIM - HEAD_DIM_B)
):
    """Persistent program ``i``: O and L of the tiles the schedule gives it, one after another."""
    config = FwdConfig(HEAD_DIM, HEAD_DIM_B, IS_CAUSAL, ROWS, BLOCK_N, Q_COLUMNS, K_COLUMNS, V_COLUMNS)
    dtype: gl.constexpr = q_desc.dtype

    q_smem, k_ring, v_ring = _fwd_operand_buffers(dtype, ROWS, BLOCK_N, STAGES, HEAD_DIM - HEAD_DIM_B)
    if HEAD_DIM_B > 0:
        q_smem_b, k_ring_b, v_ring_b = _fwd_operand_buffers(dtype, ROWS, BLOCK_N, STAGES, HEAD_DIM_B)
    else:
        q_smem_b = None
        k_ring_b = None
        v_ring_b = None
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q = Ring(q_ready, q_free, 2)
    kv = Ring(kv_ready, kv_free, STAGES)
    q.init(1, 2)  # landed by the copy engine's bytes; released by both consumer warpgroups
    kv.init(1, 2)
    fence_async_shared()
    buffers = FwdBuffers(q_smem, k_ring, v_ring, q, kv, q_smem_b, k_ring_b, v_ring_b)

    gl.warp_specialize(
        [
            (_fwd_compute_partition, (config, buffers, o_desc, L, schedule, n_heads, n_queries, n_keys, qk_scale, 0,
                                      o_desc_b)),
            (_fwd_compute_partition, (config, buffers, o_desc, L, schedule, n_heads, n_queries, n_keys, qk_scale, 1,
                                      o_desc_b)),
            (_fwd_load_partition, (config, q_desc, k_desc, v_desc, buffers, schedule, n_heads, n_queries, n_keys,
                                   q_desc_b, k_desc_b, v_desc_b)),
        ],
        [4, 1],
        [240, 24],
    )


# ---------------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------------
# A program holds BLOCK_N keys (128 or 64): BLOCK_N // 64 consumer warpgroups in one partition, each owning 64 of
# the keys' rows of S^T, dP^T, dK and dV, meeting at the partition's barriers around the shared dS^T and the dQ
# staging tile. A one-warp partition streams Q and dO blocks, with their rows' logsumexp and Delta, through a ring.
#
# At a head dim of two power-of-two parts (80 = 64 + 16; tensor descriptors move power-of-two blocks only) every
# tensor moves as two column blocks and every product over the head dim is two matmuls: S^T and dP^T accumulate
# both parts, dV, dK and dQ are two accumulators each. The second part's buffers, descriptors and accumulators
# (the ``*_b`` names) are constexpr ``None`` at a power of two, where the code is the one-part kernel's.


@aggregate
class BwdConfig:
    """The backward's compile-time configuration: the kernel's constexpr arguments and the consumers' register
    layouts (of each column part: ``HEAD_DIM_A`` columns, then ``HEAD_DIM_B``, 0 for none)."""

    HEAD_DIM: gl.constexpr
    IS_CAUSAL: gl.constexpr
    BLOCK_M: gl.constexpr  # queries per step
    BLOCK_N: gl.constexpr  # keys per program
    Q_COLUMNS: gl.constexpr  # whether the heads are in the columns of Q's, K's, V's, dO's views (module docstring)
    K_COLUMNS: gl.constexpr
    V_COLUMNS: gl.constexpr
    DO_COLUMNS: gl.constexpr
    KV_IN_REGISTERS: gl.constexpr  # K and V the register operands of S^T = K Q^T and dP^T = V dO^T
    DQ_ODD_ROWS_MOVED: gl.constexpr  # dQ staged through _dq_odd_rows_moved (a warpgroup's dQ of 32 columns or more)
    st_layout: gl.constexpr
    acc_layout: gl.constexpr
    dq_layout: gl.constexpr
    HEAD_DIM_A: gl.constexpr
    HEAD_DIM_B: gl.constexpr
    acc_layout_b: gl.constexpr
    dq_layout_b: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, HEAD_DIM, HEAD_DIM_B, IS_CAUSAL, BLOCK_M, BLOCK_N, Q_COLUMNS, K_COLUMNS, V_COLUMNS,
                 DO_COLUMNS):
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.IS_CAUSAL = gl.constexpr(IS_CAUSAL)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.Q_COLUMNS = gl.constexpr(Q_COLUMNS)
        self.K_COLUMNS = gl.constexpr(K_COLUMNS)
        self.V_COLUMNS = gl.constexpr(V_COLUMNS)
        self.DO_COLUMNS = gl.constexpr(DO_COLUMNS)
        self.KV_IN_REGISTERS = gl.constexpr(HEAD_DIM <= 32)
        self.HEAD_DIM_A = gl.constexpr(HEAD_DIM - HEAD_DIM_B)
        self.HEAD_DIM_B = gl.constexpr(HEAD_DIM_B)
        warpgroups = BLOCK_N // 64
        self.DQ_ODD_ROWS_MOVED = gl.constexpr(self.HEAD_DIM_A // warpgroups >= 32)
        # S^T = K Q^T (BLOCK_N, BLOCK_M): warpgroup w computes the rows of its keys, so that P^T and dS^T are in
        # the registers of the warpgroup whose dV and dK rows they feed (register-sourced wgmma). A warp holds 16
        # keys: BLOCK_N // 16 consumer warps.
        warps = BLOCK_N // 16
        self.st_layout = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                                                instr_shape=[16, BLOCK_M, 16]))
        # dK, dV (BLOCK_N, columns): warpgroup w accumulates the rows of its keys; dQ (BLOCK_M, columns): each
        # warpgroup its share of the columns.
        self.acc_layout = gl.constexpr(_acc_layout(HEAD_DIM - HEAD_DIM_B, warps))
        self.dq_layout = gl.constexpr(_dq_layout(HEAD_DIM - HEAD_DIM_B, warps))
        self.acc_layout_b = gl.constexpr(_acc_layout(HEAD_DIM_B, warps) if HEAD_DIM_B else None)
        self.dq_layout_b = gl.constexpr(_dq_layout(HEAD_DIM_B, warps) if HEAD_DIM_B else None)


@gluon.constexpr_function
def _dq_staging_layout(rows, columns, odd_rows_moved):
    """The 128-byte swizzle of a float32 (rows, columns) staging tile as a linear layout (offset bit k holds the
    logical (row, column) of offset 2^k); with ``odd_rows_moved``, logical column c of an odd row is stored where
    column c xor 16 would be (see :func:`_dq_odd_rows_moved`)."""
    bases = [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [1, 20 if odd_rows_moved else 4], [2, 8], [4, 16]]
    row = 8
    while row < rows:
        bases.append([row, 0])
        row *= 2
    column = 32
    while column < columns:
        bases.append([0, column])
        column *= 2
    return gl.SharedLinearLayout(bases)


@gluon.jit
def _dq_odd_rows_moved(dq):
    """``dq`` (BLOCK_M, COLUMNS) with its odd rows' columns c and c xor 16 exchanged: stored through
    ``_dq_staging_layout(.., True)`` every value lands where the plain tile has it, but a half-warp's four rows of 32
    bytes then cover all of a 128-byte swizzled row's banks (rows r and r xor 1 otherwise share two 16-byte bank
    groups: ncu counted twice the ideal shared-memory wavefronts)."""
    BLOCK_M: gl.constexpr = dq.shape[0]
    COLUMNS: gl.constexpr = dq.shape[1]
    halves = dq.reshape([BLOCK_M, COLUMNS // 32, 2, 16]).permute((0, 1, 3, 2))
    low, high = halves.split()
    swapped = gl.join(high, low).permute((0, 1, 3, 2)).reshape([BLOCK_M, COLUMNS])
    swapped = gl.convert_layout(swapped, dq.type.layout)
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq.type.layout))
    return gl.where((rows % 2 == 1)[:, None], swapped, dq)


@gluon.constexpr_function
def _dq_layout(columns, warps):
    warpgroups = warps // 4
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, warpgroups],
                                     instr_shape=[16, columns // warpgroups, 16])


@aggregate
class BwdProgram:
    """Where a backward program works: batch ``b``, head ``h`` (batch-head ``bh``), keys ``start_n ..
    start_n + BLOCK_N``, ``n_steps`` query blocks from ``query_start`` (0 when not causal: a constexpr)."""

    b: gl.tensor
    h: gl.tensor
    bh: gl.tensor
    n_heads: gl.tensor
    start_n: gl.tensor
    query_start: (gl.tensor, gl.constexpr)  # either: the field's check is an isinstance
    n_steps: gl.tensor
    n_queries: gl.tensor

    @gluon.constexpr_function
    def __init__(self, b, h, bh, n_heads, start_n, query_start, n_steps, n_queries):
        self.b = b
        self.h = h
        self.bh = bh
        self.n_heads = n_heads
        self.start_n = start_n
        # A constexpr reaches this constructor unwrapped (a Python int): wrap it again.
        self.query_start = gl.constexpr(query_start) if isinstance(query_start, int) else query_start
        self.n_steps = n_steps
        self.n_queries = n_queries


@aggregate
class BwdRing:
    """The Q/dO ring: per stage a block of Q and of dO (STAGES, BLOCK_M, HEAD_DIM_A) and their rows' base-2
    logsumexp and Delta (STAGES, BLOCK_M), and the stages' barriers ``barriers``; ``q_b``, ``do_b``: the blocks'
    second column parts (STAGES, BLOCK_M, HEAD_DIM_B), or None."""

    q: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor
    lse: gl.shared_memory_descriptor
    delta: gl.shared_memory_descriptor
    barriers: Ring
    q_b: (gl.shared_memory_descriptor, gl.constexpr)
    do_b: (gl.shared_memory_descriptor, gl.constexpr)

    @gluon.constexpr_function
    def __init__(self, q, do, lse, delta, barriers, q_b, do_b):
        self.q = q
        self.do = do
        self.lse = lse
        self.delta = delta
        self.barriers = barriers
        self.q_b = _optional(q_b)
        self.do_b = _optional(do_b)


@aggregate
class BwdBuffers:
    """The backward's other shared memory: K and V (1, BLOCK_N, HEAD_DIM_A), landed at ``kv_ready`` (later dK and
    dV); dS^T (1, BLOCK_N, BLOCK_M), for dQ = dS K; the double-buffered float32 dQ staging tile
    (2, BLOCK_M, HEAD_DIM_A); the second column parts of K, V and the staging tile, or None."""

    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor
    dq_smem: gl.shared_memory_descriptor
    kv_ready: gl.shared_memory_descriptor
    k_smem_b: (gl.shared_memory_descriptor, gl.constexpr)
    v_smem_b: (gl.shared_memory_descriptor, gl.constexpr)
    dq_smem_b: (gl.shared_memory_descriptor, gl.constexpr)

    @gluon.constexpr_function
    def __init__(self, k_smem, v_smem, ds_smem, dq_smem, kv_ready, k_smem_b, v_smem_b, dq_smem_b):
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.ds_smem = ds_smem
        self.dq_smem = dq_smem
        self.kv_ready = kv_ready
        self.k_smem_b = _optional(k_smem_b)
        self.v_smem_b = _optional(v_smem_b)
        self.dq_smem_b = _optional(dq_smem_b)


@aggregate
class BwdState:
    """The two warpgroups' accumulators: dK (without the 1/sqrt(d)) and dV, float32 (BLOCK_N, HEAD_DIM_A), and
    their second column parts (BLOCK_N, HEAD_DIM_B) or None."""

    dk: gl.tensor
    dv: gl.tensor
    dk_b: (gl.tensor, gl.constexpr)
    dv_b: (gl.tensor, gl.constexpr)

    @gluon.constexpr_function
    def __init__(self, dk, dv, dk_b, dv_b):
        self.dk = dk
        self.dv = dv
        self.dk_b = _optional(dk_b)
        self.dv_b = _optional(dv_b)


@gluon.jit
def _bwd_load_partition(config, q_desc, do_desc, ring, L_row, Delta_row, program, q_desc_b, do_desc_b):
    """Worker partition: stream Q and dO blocks (copy engine; each in two column blocks at a two-part head dim)
    and their rows' base-2 logsumexp and Delta (plain loads, stored to shared memory) into the ring, as far ahead
    of the consumers as it has stages. A stage is ready after two arrivals: the copy engine's bytes and this warp's
    stores."""
    BLOCK_M: gl.constexpr = config.BLOCK_M
    row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    for j in range(program.n_steps):
        s, landed = ring.barriers.acquire(j, 2 * BLOCK_M * config.HEAD_DIM * q_desc.dtype.primitive_bitwidth // 8)
        m = program.query_start + j * BLOCK_M
        _load_pair(config, program, m, landed, q_desc, ring.q, config.Q_COLUMNS, do_desc, ring.do, config.DO_COLUMNS,
                   s, q_desc_b, ring.q_b, do_desc_b, ring.do_b)
        offs_m = m + gl.arange(0, BLOCK_M, layout=row_layout)
        in_bounds = offs_m < program.n_queries
        ring.lse.index(s).store(gl.load(L_row + offs_m, mask=in_bounds, other=0.0) * LOG2_E)
        ring.delta.index(s).store(gl.load(Delta_row + offs_m, mask=in_bounds, other=0.0))
        mbarrier.arrive(landed)


@gluon.jit
def _bwd_issue_scores(config, program, ring, j, k, v, k_smem_b, v_smem_b):
    """Start S_j^T = K Q_j^T and dP_j^T = V dO_j^T on the tensor cores once block ``j`` has landed (see
    :meth:`Ring.wait_landed` past the last block); ``k`` and ``v`` are (BLOCK_N, HEAD_DIM_A), in shared memory or,
    where ``config.KV_IN_REGISTERS``, in registers; ``k_smem_b`` and ``v_smem_b`` the second column parts
    (BLOCK_N, HEAD_DIM_B) or None."""
    s = ring.barriers.wait_landed(j, program.n_steps, 0)
    zero = gl.zeros([config.BLOCK_N, config.BLOCK_M], gl.float32, config.st_layout)
    scores_t = warpgroup_mma(k, ring.q.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    if config.HEAD_DIM_B > 0:
        scores_t = warpgroup_mma(k_smem_b, ring.q_b.index(s).permute((1, 0)), scores_t, is_async=True)
    dp_t = warpgroup_mma(v, ring.do.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    if config.HEAD_DIM_B > 0:
        dp_t = warpgroup_mma(v_smem_b, ring.do_b.index(s).permute((1, 0)), dp_t, is_async=True)
    return scores_t, dp_t


@gluon.jit
def _bwd_step(config, program, buffers, ring, dq_desc, qk_scale, state, scores_t, dp_t, j, dq_desc_b, kv_op):
    """Query block ``j`` of the sweep, whose S^T and dP^T have landed: accumulate its share of dK and dV, add its dQ
    rows by TMA, and compute block ``j + 1``'s S^T and dP^T behind dK (from ``kv_op``, K and V in registers, where
    ``config.KV_IN_REGISTERS``).

    P^T and dS^T never leave the registers of the warpgroup that computed them for dV += P^T dO and dK += dS^T Q
    (register-sourced wgmma, as FlashAttention-3 does); dS^T is written to shared memory once, for dQ = dS K.

    The single-tile buffers (``(1, rows, cols)``) are indexed by ``j >> 30``, always 0, which the compiler cannot
    prove: the matmuls' shared-memory descriptors are then recomputed each step (a few uniform integer adds)
    instead of being hoisted out of the loop, where the 40-odd 64-bit values spilled to local memory."""
    BLOCK_M: gl.constexpr = config.BLOCK_M
    st_layout: gl.constexpr = config.st_layout
    operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=config.acc_layout, k_width=2)
    zero = j >> 30
    k_smem = buffers.k_smem.index(zero)
    v_smem = buffers.v_smem.index(zero)
    ds_smem = buffers.ds_smem.index(zero)
    k_smem_b = buffers.k_smem_b
    v_smem_b = buffers.v_smem_b
    if config.HEAD_DIM_B > 0:
        k_smem_b = buffers.k_smem_b.index(zero)
        v_smem_b = buffers.v_smem_b.index(zero)
    s = ring.barriers.stage(j)
    m = program.query_start + j * BLOCK_M
    offs_m = m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    lse = ring.lse.index(s).load(gl.SliceLayout(0, st_layout))
    delta = ring.delta.index(s).load(gl.SliceLayout(0, st_layout))
    q = ring.q.index(s)
    do = ring.do.index(s)

    p_t = gl.exp2(scores_t * qk_scale - lse[None, :])
    # Only blocks that reach the program's diagonal (causal) or past the last query are masked: a branch around the
    # mask, not two copies of the step (which compiled to more spills than they saved). At d = 128 the branch spills
    # (three local loads a step) and measured no faster: every block is masked there.
    needs_mask = (m + BLOCK_M > program.n_queries) | (config.HEAD_DIM == 128)
    if config.IS_CAUSAL:
        needs_mask = needs_mask | (m < program.start_n + config.BLOCK_N)
    if needs_mask:
        visible = (offs_m < program.n_queries)[None, :]
        if config.IS_CAUSAL:
            offs_n = program.start_n + gl.arange(0, config.BLOCK_N, layout=gl.SliceLayout(1, st_layout))
            visible = visible & (offs_m[None, :] >= offs_n[:, None])
        p_t = gl.where(visible, p_t, 0.0)
    dv = warpgroup_mma(gl.convert_layout(p_t.to(q.dtype), operand_layout), do, state.dv, is_async=True)
    dv_b = state.dv_b
    if config.HEAD_DIM_B > 0:
        operand_layout_b: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=config.acc_layout_b, k_width=2)
        dv_b = warpgroup_mma(gl.convert_layout(p_t.to(q.dtype), operand_layout_b), ring.do_b.index(s), dv_b,
                             is_async=True)
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    ds_smem.store(ds_t)
    fence_async_shared()
    dq_buffer = buffers.dq_smem.index(j % 2)
    # The reductions of block j - 2, from the same buffers, have read them (one a column part, issued per step).
    if config.HEAD_DIM_B > 0:
        tma.store_wait(2)
    else:
        tma.store_wait(1)
    # One barrier for three orders: dQ_j = dS K reads both warpgroups' rows of dS^T; dq_buffer is free for every
    # thread; both warpgroups have waited for block j - 1's last matmuls, so that its stage is free. (Triton
    # follows the single-thread arrive with a bar.sync of its own: three per step in the PTX.)
    gl.thread_barrier()
    ring.barriers.release_previous(j)

    zero_dq = gl.zeros([BLOCK_M, config.HEAD_DIM_A], gl.float32, config.dq_layout)
    dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, zero_dq, use_acc=False, is_async=True)
    if config.HEAD_DIM_B > 0:
        zero_dq_b = gl.zeros([BLOCK_M, config.HEAD_DIM_B], gl.float32, config.dq_layout_b)
        dq_b = warpgroup_mma(ds_smem.permute((1, 0)), k_smem_b, zero_dq_b, use_acc=False, is_async=True)
    dk = warpgroup_mma(gl.convert_layout(ds_t, operand_layout), q, state.dk, is_async=True)
    dk_b = state.dk_b
    if config.HEAD_DIM_B > 0:
        dk_b = warpgroup_mma(gl.convert_layout(ds_t, operand_layout_b), ring.q_b.index(s), dk_b, is_async=True)
        dq, dq_b = warpgroup_mma_wait(2, deps=[dq, dq_b])
    else:
        dq = warpgroup_mma_wait(1, deps=[dq])
    if config.DQ_ODD_ROWS_MOVED:
        staging: gl.constexpr = _dq_staging_layout(BLOCK_M, config.HEAD_DIM_A, True)
        dq_buffer._reinterpret(gl.float32, [BLOCK_M, config.HEAD_DIM_A], staging).store(_dq_odd_rows_moved(dq))
    else:
        dq_buffer.store(dq)
    if config.HEAD_DIM_B > 0:
        dq_buffer_b = buffers.dq_smem_b.index(j % 2)
        dq_buffer_b.store(dq_b)
    fence_async_shared()
    # Also orders this step's dS^T reads (every warpgroup's dQ matmul is done) before next step's dS^T writes.
    gl.thread_barrier()
    tma_reduce_add(dq_desc, [program.bh, m, 0], dq_buffer.reshape([1, BLOCK_M, config.HEAD_DIM_A]))
    if config.HEAD_DIM_B > 0:
        tma_reduce_add(dq_desc_b, [program.bh, m, config.HEAD_DIM_A],
                       dq_buffer_b.reshape([1, BLOCK_M, config.HEAD_DIM_B]))
    k, v = kv_op if config.KV_IN_REGISTERS else (k_smem, v_smem)
    scores_t, dp_t = _bwd_issue_scores(config, program, ring, j + 1, k, v, k_smem_b, v_smem_b)
    # Nothing crosses the loop's back edge in flight: an accumulator carried there while its wgmma runs makes
    # ptxas serialise every wgmma of the kernel (C7514).
    if config.HEAD_DIM_B > 0:
        dv, dk, dv_b, dk_b, scores_t, dp_t = warpgroup_mma_wait(0, deps=[dv, dk, dv_b, dk_b, scores_t, dp_t])
    else:
        dv, dk, scores_t, dp_t = warpgroup_mma_wait(0, deps=[dv, dk, scores_t, dp_t])
    return BwdState(dk, dv, dk_b, dv_b), scores_t, dp_t


@gluon.jit
def _bwd_compute_partition(config, buffers, ring, dq_desc, program, qk_scale, dq_desc_b):
    """Default partition (one or two warpgroups, each owning 64 of the keys): five matmuls per query block (two per
    product over the head dim at a two-part head dim); returns dK (without the 1/sqrt(d)) and dV, float32
    (BLOCK_N, HEAD_DIM_A), and their second column parts or None."""
    zero_acc = gl.zeros([config.BLOCK_N, config.HEAD_DIM_A], gl.float32, config.acc_layout)
    zero_acc_b = None
    if config.HEAD_DIM_B > 0:
        zero_acc_b = gl.zeros([config.BLOCK_N, config.HEAD_DIM_B], gl.float32, config.acc_layout_b)
    state = BwdState(zero_acc, zero_acc, zero_acc_b, zero_acc_b)
    mbarrier.wait(buffers.kv_ready, 0)
    k_smem_b = buffers.k_smem_b
    v_smem_b = buffers.v_smem_b
    if config.HEAD_DIM_B > 0:
        k_smem_b = buffers.k_smem_b.index(0)
        v_smem_b = buffers.v_smem_b.index(0)
    kv_op = (buffers.k_smem.index(0), buffers.v_smem.index(0))
    if config.KV_IN_REGISTERS:
        # Loaded once: the tensor cores then read only Q and dO from shared memory for S^T and dP^T (1.5-3.5 %
        # faster at d = 16 and 32, no faster at 64).
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=config.st_layout, k_width=2)
        kv_op = (kv_op[0].load(a_layout), kv_op[1].load(a_layout))
    scores_t, dp_t = _bwd_issue_scores(config, program, ring, 0, kv_op[0], kv_op[1], k_smem_b, v_smem_b)
    scores_t, dp_t = warpgroup_mma_wait(0, deps=[scores_t, dp_t])
    for j in range(program.n_steps):
        state, scores_t, dp_t = _bwd_step(config, program, buffers, ring, dq_desc, qk_scale, state, scores_t, dp_t,
                                          j, dq_desc_b, kv_op)
    tma.store_wait(0)
    if config.HEAD_DIM_B > 0:
        return state.dk, state.dv, state.dk_b, state.dv_b
    else:
        return state.dk, state.dv


@gluon.jit
def _bwd_operand_buffers(dtype: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                         COLUMNS: gl.constexpr):
    """One column part's (``COLUMNS`` of the head dim) shared memory for the matmuls' operands: K and V
    (1, BLOCK_N, COLUMNS), the Q and dO rings (STAGES, BLOCK_M, COLUMNS)."""
    k_smem = _operand_tiles(dtype, 1, BLOCK_N, COLUMNS)
    v_smem = _operand_tiles(dtype, 1, BLOCK_N, COLUMNS)
    q_ring = _operand_tiles(dtype, STAGES, BLOCK_M, COLUMNS)
    do_ring = _operand_tiles(dtype, STAGES, BLOCK_M, COLUMNS)
    return k_smem, v_smem, q_ring, do_ring


@gluon.jit(do_not_specialize=["n_heads", "n_queries", "n_keys"])
def attn_bwd_hopper_kernel(
    q_desc, k_desc, v_desc, do_desc,  # 3-D views of Q, K, V, dO, blocks (1, BLOCK_M or BLOCK_N, HEAD_DIM_A)
    dk_desc, dv_desc,  # contiguous (batch * heads, n_keys, HEAD_DIM) outputs, blocks (1, BLOCK_N, HEAD_DIM_A)
    dq_desc,  # float32 (batch * heads, n_queries, HEAD_DIM), zeroed, blocks (1, BLOCK_M, HEAD_DIM_A)
    L, Delta,  # float32 (batch * heads, n_queries): natural-log logsumexp and rowsum(O * dO)
    n_heads, n_queries, n_keys,
    sm_scale, qk_scale,  # 1 / sqrt(d) and log2(e) / sqrt(d)
    q_desc_b, k_desc_b, v_desc_b, do_desc_b, dk_desc_b, dv_desc_b, dq_desc_b,  # the second column blocks, or None
    HEAD_DIM: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    Q_COLUMNS: gl.constexpr, K_COLUMNS: gl.constexpr, V_COLUMNS: gl.constexpr, DO_COLUMNS: gl.constexpr,
    HEAD_DIM_B: gl.constexpr,  # columns of the second part, 0 for none (the first: HEAD_DIM - HEAD_DIM_B)
    HEADS_FIRST: gl.constexpr,  # the grid is (batch * heads, key tiles) rather than (key tiles, batch * heads)
):
    """Program ``(i, bh)`` (``(bh, i)`` when ``HEADS_FIRST``): dK and dV of keys ``i * BLOCK_N ..`` of batch-head
    ``bh``, and their share of dQ."""
    config = BwdConfig(HEAD_DIM, HEAD_DIM_B, IS_CAUSAL, BLOCK_M, BLOCK_N, Q_COLUMNS, K_COLUMNS, V_COLUMNS,
                       DO_COLUMNS)
    HEAD_DIM_A: gl.constexpr = HEAD_DIM - HEAD_DIM_B
    dtype: gl.constexpr = q_desc.dtype
    if HEADS_FIRST:
        start_n = gl.program_id(1) * BLOCK_N
        bh = gl.program_id(0)
    else:
        start_n = gl.program_id(0) * BLOCK_N
        bh = gl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    if IS_CAUSAL:
        query_start = gl.minimum(start_n // BLOCK_M * BLOCK_M, n_queries)
    else:
        query_start = 0
    n_steps = gl.cdiv(n_queries - query_start, BLOCK_M)
    program = BwdProgram(b, h, bh, n_heads, start_n, query_start, n_steps, n_queries)

    k_smem, v_smem, q_ring, do_ring = _bwd_operand_buffers(dtype, BLOCK_N, BLOCK_M, STAGES, HEAD_DIM_A)
    ds_smem = _operand_tiles(dtype, 1, BLOCK_N, BLOCK_M)
    dq_smem = _operand_tiles(gl.float32, 2, BLOCK_M, HEAD_DIM_A)
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    if HEAD_DIM_B > 0:
        k_smem_b, v_smem_b, q_ring_b, do_ring_b = _bwd_operand_buffers(dtype, BLOCK_N, BLOCK_M, STAGES, HEAD_DIM_B)
        dq_smem_b = _operand_tiles(gl.float32, 2, BLOCK_M, HEAD_DIM_B)
    else:
        k_smem_b = None
        v_smem_b = None
        q_ring_b = None
        do_ring_b = None
        dq_smem_b = None
    barriers = Ring(ready, free, STAGES)
    barriers.init(2, 1)  # landed by the copy engine's bytes (with the expect) and the loader's stores
    mbarrier.init(kv_ready, count=1)
    fence_async_shared()
    ring = BwdRing(q_ring, do_ring, lse_ring, delta_ring, barriers, q_ring_b, do_ring_b)
    buffers = BwdBuffers(k_smem, v_smem, ds_smem, dq_smem, kv_ready, k_smem_b, v_smem_b, dq_smem_b)

    mbarrier.expect(kv_ready, 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(k_desc, _block_coord(b, h, start_n, n_heads, HEAD_DIM, K_COLUMNS, 0), kv_ready,
                                    k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, _block_coord(b, h, start_n, n_heads, HEAD_DIM, V_COLUMNS, 0), kv_ready,
                                    v_smem.index(0))
    if HEAD_DIM_B > 0:
        tma.async_copy_global_to_shared(k_desc_b, _block_coord(b, h, start_n, n_heads, HEAD_DIM, K_COLUMNS, HEAD_DIM_A),
                                        kv_ready, k_smem_b.index(0))
        tma.async_copy_global_to_shared(v_desc_b, _block_coord(b, h, start_n, n_heads, HEAD_DIM, V_COLUMNS, HEAD_DIM_A),
                                        kv_ready, v_smem_b.index(0))

    # The worker's arguments in this order (see the module docstring): Q's and dO's descriptors, the ring, the
    # rows of L and Delta, the program (then the second column parts' descriptors, None at a power of two).
    accumulators = gl.warp_specialize(
        [
            (_bwd_compute_partition, (config, buffers, ring, dq_desc, program, qk_scale, dq_desc_b)),
            (_bwd_load_partition, (config, q_desc, do_desc, ring, L + bh.to(gl.int64) * n_queries,
                                   Delta + bh.to(gl.int64) * n_queries, program, q_desc_b, do_desc_b)),
        ],
        [1],
        [24],
    )
    dk = accumulators[0]
    dv = accumulators[1]

    # K and V are no longer read: their buffers stage dK and dV for the copy engine.
    gl.thread_barrier()
    k_smem.index(0).store((dk * sm_scale).to(dtype))
    v_smem.index(0).store(dv.to(dtype))
    if HEAD_DIM_B > 0:
        k_smem_b.index(0).store((accumulators[2] * sm_scale).to(dtype))
        v_smem_b.index(0).store(accumulators[3].to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [bh, start_n, 0], k_smem.index(0))
    tma.async_copy_shared_to_global(dv_desc, [bh, start_n, 0], v_smem.index(0))
    if HEAD_DIM_B > 0:
        tma.async_copy_shared_to_global(dk_desc_b, [bh, start_n, HEAD_DIM_A], k_smem_b.index(0))
        tma.async_copy_shared_to_global(dv_desc_b, [bh, start_n, HEAD_DIM_A], v_smem_b.index(0))
    tma.store_wait(0)
