"""Triton kernels of FlashAttention-2; their launch code is the portable backend, ``triton.py`` beside this file
(also the Delta and dQ-conversion kernels of the Hopper backend, ``hopper.py``).

Layout. Every kernel sees its tensors as ``(batch, heads, seq, HEAD_DIM)`` through explicit strides
(3-D inputs pass a head stride of 0 and ``n_heads = 1``), with a unit stride along ``HEAD_DIM``.
Program ``(i, bh)`` handles tile ``i`` of the sequence it is parallel over, for batch
``bh // n_heads`` and head ``bh % n_heads``. ``L`` (logsumexp) and ``Delta`` (``rowsum(O * dO)``)
are float32 ``(batch * heads, n_queries)``, contiguous.

Head dims. ``tl.arange`` and ``tl.dot`` take power-of-two widths, so a head dim ``HEAD_DIM`` that is not one is held
as two column parts: the first ``HEAD_DIM_A = HEAD_DIM - HEAD_DIM_B`` columns (a power of two) and the last
``HEAD_DIM_B`` (another, at least 16: 80 = 64 + 16), each read and written through its own block pointer. Products
over d sum the parts' (``Q K^T = Q_A K_A^T + Q_B K_B^T``, two ``tl.dot`` into one score tile); products into d
are made per part (``P V_A`` and ``P V_B``: each accumulator is two tiles). Tiles of the first part keep the plain
names (``q``, ``acc``), those of the second end in ``_b``. ``HEAD_DIM_B = 0`` (a power of two) removes every
second-part line at compile time (``if HEAD_DIM_B > 0`` on a constexpr); the ``_b`` arguments are then placeholders
that are never read.

Speed-ups, each visible in the code:

* Scores live in the base-2 domain: ``qk_scale = log2(e) / sqrt(d)`` is folded into one multiply,
  and ``exp2`` replaces ``exp``; ``L`` is converted back to a natural log when stored, and to base 2
  again when loaded by the backward kernels.
* Causal early exit: key tiles entirely above the diagonal are never loaded.
* Each sweep is split into tiles that need no mask (full, below the diagonal) and the few that do
  (crossing the diagonal, or ragged at the end of the sequence), chosen by constexpr flags
  (``MASKED``, ``MASK_CAUSAL``, ``MASK_ROWS``) so that the common loop carries no mask arithmetic.
* The backward is two sweeps in one launch: program ``i`` holds key tile ``i`` and sweeps the queries that see
  it for dK and dV, then holds query tile ``i`` and sweeps the keys it sees for dQ, recomputing P and dP
  (7 matmuls per tile instead of 5) so that no atomics are needed and the result is deterministic. Under a
  causal mask key tile ``i`` and query tile ``i`` balance, so every program does the same work. (The one-pass
  backward, dQ added by atomics or the copy engine's reductions, lost its measurements: optimisation log.)
* The forward runs its query tiles last-first: the heavy ones start early, the light ones fill the tail;
  it takes each row's maximum over unscaled scores, so that the scale joins the exponent's argument in
  one fused multiply-add per score.

All accumulators are float32; ``P`` and ``dS`` are cast to the input dtype before the matmuls that
consume them, as in the paper. ``DOT_PRECISION`` is ``"ieee"`` or ``"tf32"`` for float32 inputs
(chosen by the caller from PyTorch's float32 matmul precision) and ignored for 16-bit ones.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Globals read inside kernels must be tl.constexpr objects (Triton refuses plain Python globals).
LOG2_E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2_E)
LN_2 = tl.constexpr(0.6931471805599453)  # ln(2): ln(x) = log2(x) * LN_2
MASKED_SCORE = tl.constexpr(-1.0e30)
"""Unscaled score given to invisible keys in the forward. Finite, so that a row whose first tile were
fully invisible would still rescale to the right answer instead of producing ``-inf - -inf = nan``."""

# Sizes vary from call to call: don't compile a variant per size (Triton otherwise specialises
# integers on divisibility by 16 and on equality to 1). The autotune keys are coarsened lengths that
# the kernels do not read.
_SIZE_ARGS = ["n_heads", "n_queries", "n_keys", "n_queries_key", "n_keys_key"]


# ---------------------------------------------------------------------------------------------------
# Tiles of a head dim held in one or two column parts
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _column_block(base, n_rows, stride_row, row_start, BLOCK_ROWS: tl.constexpr, SECOND: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_B: tl.constexpr):
    """Block pointer to the ``BLOCK_ROWS`` rows from ``row_start`` of a (n_rows, HEAD_DIM) matrix with unit column
    stride: their first ``HEAD_DIM - HEAD_DIM_B`` columns, or (``SECOND``) their last ``HEAD_DIM_B``. A second
    part of a head dim held whole (``HEAD_DIM_B = 0``) is the first again: a placeholder, never read."""
    block = tl.make_block_ptr(base, shape=(n_rows, HEAD_DIM), strides=(stride_row, 1), offsets=(row_start, 0),
                              block_shape=(BLOCK_ROWS, HEAD_DIM - HEAD_DIM_B), order=(1, 0))
    if SECOND:
        if HEAD_DIM_B > 0:
            block = tl.make_block_ptr(base, shape=(n_rows, HEAD_DIM), strides=(stride_row, 1),
                                      offsets=(row_start, HEAD_DIM - HEAD_DIM_B), block_shape=(BLOCK_ROWS, HEAD_DIM_B),
                                      order=(1, 0))
    return block


@triton.jit
def _load_rows(block, CHECK_ROWS: tl.constexpr):
    """The tile at ``block``; with ``CHECK_ROWS``, rows past the end read as zeros."""
    if CHECK_ROWS:
        tile = tl.load(block, boundary_check=(0,), padding_option="zero")
    else:
        tile = tl.load(block)
    return tile


@triton.jit
def _zeros_second_part(BLOCK_ROWS: tl.constexpr, HEAD_DIM_B: tl.constexpr):
    """A float32 accumulator of the second part, zero; 0.0 (a placeholder, never read) when there is none."""
    zeros = 0.0
    if HEAD_DIM_B > 0:
        zeros = tl.zeros([BLOCK_ROWS, HEAD_DIM_B], dtype=tl.float32)
    return zeros


# ---------------------------------------------------------------------------------------------------
# Forward: O = softmax(Q K^T / sqrt(d)) V and L = logsumexp, one query tile per program.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _attn_fwd_sweep(
    acc, acc_b, row_sum, row_max,  # running state of the online softmax: O's two parts, (BLOCK_M,), (BLOCK_M,)
    q, q_b,  # the query tile's two parts
    K_block, K_B_block, V_block, V_B_block,  # block pointers to key/value tiles' two parts, positioned at key 0
    key_start, key_stop,  # sweep key tiles starting at key_start (a multiple of BLOCK_N) up to key_stop
    offs_m,  # query indices of the tile's rows, (BLOCK_M,)
    n_keys,
    qk_scale,
    IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,  # apply the causal and the key-bounds mask (tiles crossing the diagonal or the end)
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM_B: tl.constexpr,
):
    K_block = tl.advance(K_block, (key_start, 0))
    V_block = tl.advance(V_block, (key_start, 0))
    if HEAD_DIM_B > 0:
        K_B_block = tl.advance(K_B_block, (key_start, 0))
        V_B_block = tl.advance(V_B_block, (key_start, 0))
    for start_n in range(key_start, key_stop, BLOCK_N):
        k = _load_rows(K_block, MASKED)
        v = _load_rows(V_block, MASKED)
        # Unscaled scores: the row maximum is taken before scaling (qk_scale > 0), so the scale costs one
        # multiply per row, and joins the subtraction below in one fused multiply-add per score.
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if HEAD_DIM_B > 0:
            k_b = _load_rows(K_B_block, MASKED)
            v_b = _load_rows(V_B_block, MASKED)
            qk = tl.dot(q_b, tl.trans(k_b), qk, input_precision=DOT_PRECISION)
        if MASKED:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            visible = offs_n[None, :] < n_keys
            if IS_CAUSAL:
                visible = visible & (offs_m[:, None] >= offs_n[None, :])
            qk = tl.where(visible, qk, MASKED_SCORE)
        new_row_max = tl.maximum(row_max, tl.max(qk, 1) * qk_scale)  # base 2
        p = tl.math.exp2(qk * qk_scale - new_row_max[:, None])
        rescale = tl.math.exp2(row_max - new_row_max)  # 0 on the first tile, where row_max = -inf
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        if HEAD_DIM_B > 0:
            acc_b = acc_b * rescale[:, None]
            acc_b = tl.dot(p.to(v_b.dtype), v_b, acc_b, input_precision=DOT_PRECISION)
            K_B_block = tl.advance(K_B_block, (BLOCK_N, 0))
            V_B_block = tl.advance(V_B_block, (BLOCK_N, 0))
        row_max = new_row_max
        K_block = tl.advance(K_block, (BLOCK_N, 0))
        V_block = tl.advance(V_block, (BLOCK_N, 0))
    return acc, acc_b, row_sum, row_max


@triton.jit(do_not_specialize=_SIZE_ARGS)
def attn_fwd_kernel(
    Q, K, V,  # inputs: (batch, heads, n_queries | n_keys, HEAD_DIM) through the strides below
    O,  # output, like Q
    L,  # output logsumexp (natural log), float32 (batch * heads, n_queries)
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    n_heads, n_queries, n_keys,
    n_queries_key, n_keys_key,  # coarsened lengths, read only by the autotuner
    qk_scale,  # log2(e) / sqrt(HEAD_DIM)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_B: tl.constexpr,  # columns of the second part, 0 for none (see the module's docstring)
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Last query tile first: under a causal mask it sweeps the most keys, and the light tiles fill the tail.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // n_heads).to(tl.int64)  # int64: batch offsets can exceed 2^31 elements
    off_h = (off_bh % n_heads).to(tl.int64)
    Q_block = _column_block(Q + off_b * stride_qb + off_h * stride_qh, n_queries, stride_qm, start_m, BLOCK_M,
                            False, HEAD_DIM, HEAD_DIM_B)
    K_block = _column_block(K + off_b * stride_kb + off_h * stride_kh, n_keys, stride_kn, 0, BLOCK_N,
                            False, HEAD_DIM, HEAD_DIM_B)
    V_block = _column_block(V + off_b * stride_vb + off_h * stride_vh, n_keys, stride_vn, 0, BLOCK_N,
                            False, HEAD_DIM, HEAD_DIM_B)
    q = _load_rows(Q_block, True)
    K_B_block = _column_block(K + off_b * stride_kb + off_h * stride_kh, n_keys, stride_kn, 0, BLOCK_N,
                              True, HEAD_DIM, HEAD_DIM_B)
    V_B_block = _column_block(V + off_b * stride_vb + off_h * stride_vh, n_keys, stride_vn, 0, BLOCK_N,
                              True, HEAD_DIM, HEAD_DIM_B)
    q_b = q  # stands for the absent second part (never read)
    if HEAD_DIM_B > 0:
        q_b = _load_rows(_column_block(Q + off_b * stride_qb + off_h * stride_qh, n_queries, stride_qm, start_m,
                                       BLOCK_M, True, HEAD_DIM, HEAD_DIM_B), True)
    offs_m = start_m + tl.arange(0, BLOCK_M)

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM - HEAD_DIM_B], dtype=tl.float32)
    acc_b = _zeros_second_part(BLOCK_M, HEAD_DIM_B)

    full_tiles_end = n_keys // BLOCK_N * BLOCK_N  # keys in complete tiles
    if IS_CAUSAL:
        # Keys beyond the tile's last query are invisible (early exit). A key tile is visible to
        # every row iff its last key <= start_m, the tile's first query.
        key_stop = tl.minimum(n_keys, start_m + BLOCK_M)
        unmasked_end = tl.minimum((start_m + 1) // BLOCK_N * BLOCK_N, full_tiles_end)
    else:
        key_stop = n_keys
        unmasked_end = full_tiles_end
    # Key 0 is in the first tile swept and visible to every query, so row_max is finite after it.
    acc, acc_b, row_sum, row_max = _attn_fwd_sweep(
        acc, acc_b, row_sum, row_max, q, q_b, K_block, K_B_block, V_block, V_B_block, 0, unmasked_end, offs_m,
        n_keys, qk_scale, IS_CAUSAL, False, DOT_PRECISION, BLOCK_N, HEAD_DIM_B)
    acc, acc_b, row_sum, row_max = _attn_fwd_sweep(
        acc, acc_b, row_sum, row_max, q, q_b, K_block, K_B_block, V_block, V_B_block, unmasked_end, key_stop,
        offs_m, n_keys, qk_scale, IS_CAUSAL, True, DOT_PRECISION, BLOCK_N, HEAD_DIM_B)

    acc = acc / row_sum[:, None]
    O_ptr = O + off_b * stride_ob + off_h * stride_oh
    O_block = _column_block(O_ptr, n_queries, stride_om, start_m, BLOCK_M, False, HEAD_DIM, HEAD_DIM_B)
    tl.store(O_block, acc.to(O.dtype.element_ty), boundary_check=(0,))
    if HEAD_DIM_B > 0:
        O_B_block = _column_block(O_ptr, n_queries, stride_om, start_m, BLOCK_M, True, HEAD_DIM, HEAD_DIM_B)
        tl.store(O_B_block, (acc_b / row_sum[:, None]).to(O.dtype.element_ty), boundary_check=(0,))
    logsumexp = (row_max + tl.math.log2(row_sum)) * LN_2  # back to natural log
    tl.store(L + off_bh.to(tl.int64) * n_queries + offs_m, logsumexp, mask=offs_m < n_queries)


# ---------------------------------------------------------------------------------------------------
# Forward split over keys: for calls of few query tiles (one head of a few thousand tokens), each tile's keys are
# cut into ``n_splits`` parts swept by programs of their own, which store their normalised partial output and
# logsumexp; a second kernel weighs the parts by their logsumexp. The critical path is then a part's sweep, not the
# heaviest tile's whole sweep.
# ---------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_heads", "n_queries", "n_keys", "n_splits"])
def attn_fwd_split_kernel(
    Q, K, V,  # inputs: (batch, heads, n_queries | n_keys, HEAD_DIM) through the strides below
    O_part,  # float32 (n_splits, batch * heads, n_queries, HEAD_DIM), contiguous: each part's normalised output
    LSE_part,  # float32 (n_splits, batch * heads, n_queries): each part's base-2 logsumexp (-inf: no keys)
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    n_heads, n_queries, n_keys, n_splits,
    qk_scale,  # log2(e) / sqrt(HEAD_DIM)
    HEAD_DIM: tl.constexpr,  # a power of two
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    off_bh = tl.program_id(1)
    split = tl.program_id(2)
    off_b = (off_bh // n_heads).to(tl.int64)
    off_h = (off_bh % n_heads).to(tl.int64)
    Q_block = _column_block(Q + off_b * stride_qb + off_h * stride_qh, n_queries, stride_qm, start_m, BLOCK_M,
                            False, HEAD_DIM, 0)
    K_block = _column_block(K + off_b * stride_kb + off_h * stride_kh, n_keys, stride_kn, 0, BLOCK_N,
                            False, HEAD_DIM, 0)
    V_block = _column_block(V + off_b * stride_vb + off_h * stride_vh, n_keys, stride_vn, 0, BLOCK_N,
                            False, HEAD_DIM, 0)
    q = _load_rows(Q_block, True)
    offs_m = start_m + tl.arange(0, BLOCK_M)

    full_tiles_end = n_keys // BLOCK_N * BLOCK_N
    if IS_CAUSAL:
        key_stop = tl.minimum(n_keys, start_m + BLOCK_M)
        unmasked_end = tl.minimum((start_m + 1) // BLOCK_N * BLOCK_N, full_tiles_end)
    else:
        key_stop = n_keys
        unmasked_end = full_tiles_end
    # This program's part of the tile's keys: whole key tiles, the last part ending at key_stop.
    tiles_per_split = tl.cdiv(tl.cdiv(key_stop, BLOCK_N), n_splits)
    split_start = split * tiles_per_split * BLOCK_N
    split_stop = tl.minimum(split_start + tiles_per_split * BLOCK_N, key_stop)

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, _, row_sum, row_max = _attn_fwd_sweep(
        acc, 0.0, row_sum, row_max, q, q, K_block, K_block, V_block, V_block, split_start,
        tl.minimum(split_stop, unmasked_end), offs_m, n_keys, qk_scale, IS_CAUSAL, False, DOT_PRECISION, BLOCK_N, 0)
    acc, _, row_sum, row_max = _attn_fwd_sweep(
        acc, 0.0, row_sum, row_max, q, q, K_block, K_block, V_block, V_block, tl.maximum(split_start, unmasked_end),
        split_stop, offs_m, n_keys, qk_scale, IS_CAUSAL, True, DOT_PRECISION, BLOCK_N, 0)

    # A row that sees none of the part's keys (no keys at all, or only masked ones: its maximum is then a masked
    # score, and its sums are not to be trusted, since exp2 of a fused multiply-add's rounding error near
    # MASKED_SCORE * qk_scale overflows) gets a zero output and logsumexp -inf: weight 0 in the combination,
    # beside the part that holds key 0, which every row sees.
    swept = row_max > 0.5 * MASKED_SCORE * qk_scale
    part = _part_rows(split, tl.num_programs(1), off_bh, n_queries)
    rows = offs_m < n_queries
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(O_part + (part + offs_m[:, None]) * HEAD_DIM + offs_d[None, :],
             tl.where(swept[:, None], acc / tl.where(swept, row_sum, 1.0)[:, None], 0.0), mask=rows[:, None])
    lse = row_max + tl.math.log2(tl.where(swept, row_sum, 1.0))
    tl.store(LSE_part + part + offs_m, tl.where(swept, lse, float("-inf")), mask=rows)


@triton.jit
def _part_rows(part, batch_heads, off_bh, n_rows):
    """The first row of head ``off_bh`` in part ``part`` of a part-major buffer (n_parts, batch * heads, n_rows,
    ..), as an int64 row index."""
    return (part * batch_heads + off_bh).to(tl.int64) * n_rows


@triton.jit
def _parts_pass_program(n_rows, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program ``(i, bh)`` of a pass over part-major buffers: ``bh``, batch * heads, its rows ``i * BLOCK_M ..``
    (BLOCK_M,), which of them exist, and the columns (HEAD_DIM,)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return tl.program_id(1), tl.num_programs(1), offs_m, offs_m < n_rows, tl.arange(0, HEAD_DIM)


@triton.jit
def _head_rows(base, off_bh, n_heads, stride_b, stride_h, stride_m, offs_m, offs_d):
    """Pointers (BLOCK_M, HEAD_DIM) to rows ``offs_m`` of head ``off_bh`` of a (batch, heads, rows, HEAD_DIM)
    tensor through its strides."""
    off_b = (off_bh // n_heads).to(tl.int64)
    off_h = (off_bh % n_heads).to(tl.int64)
    return base + off_b * stride_b + off_h * stride_h + offs_m[:, None] * stride_m + offs_d[None, :]


@triton.jit(do_not_specialize=["n_heads", "n_queries", "n_splits"])
def attn_fwd_combine_kernel(
    O_part, LSE_part,  # as attn_fwd_split_kernel wrote them
    O,  # output, (batch, heads, n_queries, HEAD_DIM) through the strides below
    L,  # output logsumexp (natural log), float32 (batch * heads, n_queries)
    stride_ob, stride_oh, stride_om,
    n_heads, n_queries, n_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    off_bh, batch_heads, offs_m, rows, offs_d = _parts_pass_program(n_queries, HEAD_DIM, BLOCK_M)
    lse_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for split in range(0, n_splits):
        part = _part_rows(split, batch_heads, off_bh, n_queries)
        lse_max = tl.maximum(lse_max, tl.load(LSE_part + part + offs_m, mask=rows, other=float("-inf")))
    lse_max = tl.where(rows, lse_max, 0.0)  # finite on every stored row: the part holding key 0 swept it
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for split in range(0, n_splits):
        part = _part_rows(split, batch_heads, off_bh, n_queries)
        weight = tl.math.exp2(tl.load(LSE_part + part + offs_m, mask=rows, other=float("-inf")) - lse_max)
        o = tl.load(O_part + (part + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], mask=rows[:, None], other=0.0)
        acc += weight[:, None] * o
        total += weight
    total = tl.where(rows, total, 1.0)
    O_ptr = _head_rows(O, off_bh, n_heads, stride_ob, stride_oh, stride_om, offs_m, offs_d)
    tl.store(O_ptr, (acc / total[:, None]).to(O.dtype.element_ty), mask=rows[:, None])
    tl.store(L + off_bh.to(tl.int64) * n_queries + offs_m, (lse_max + tl.math.log2(total)) * LN_2, mask=rows)


# ---------------------------------------------------------------------------------------------------
# Backward (Algorithm 2), with P = exp(S - L) recomputed tile by tile:
#   Delta = rowsum(O * dO);  dV = P^T dO;  dP = dO V^T;  dS = P * (dP - Delta)
#   dQ = dS K / sqrt(d);  dK = dS^T Q / sqrt(d)
# ---------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_heads", "n_queries"])
def attn_bwd_delta_kernel(
    O, dO,  # (batch, heads, n_queries, HEAD_DIM) through the strides below
    Delta,  # output rowsum(O * dO), float32 (batch * heads, n_queries)
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    n_heads, n_queries,
    DQ_acc,  # float32 (batch * heads, n_queries, HEAD_DIM) to zero when ZERO_DQ_ACC (for the Hopper backward)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_B: tl.constexpr,  # columns of the second part, 0 for none
    ZERO_DQ_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // n_heads).to(tl.int64)
    off_h = (off_bh % n_heads).to(tl.int64)
    O_ptr = O + off_b * stride_ob + off_h * stride_oh
    O_block = _column_block(O_ptr, n_queries, stride_om, start_m, BLOCK_M, False, HEAD_DIM, HEAD_DIM_B)
    dO_ptr = dO + off_b * stride_dob + off_h * stride_doh
    dO_block = _column_block(dO_ptr, n_queries, stride_dom, start_m, BLOCK_M, False, HEAD_DIM, HEAD_DIM_B)
    o = _load_rows(O_block, True).to(tl.float32)
    do = _load_rows(dO_block, True).to(tl.float32)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    in_bounds = offs_m < n_queries
    Delta_rows = Delta + off_bh.to(tl.int64) * n_queries + offs_m
    delta = tl.sum(o * do, 1)
    if HEAD_DIM_B > 0:
        o_b = _load_rows(_column_block(O_ptr, n_queries, stride_om, start_m, BLOCK_M, True, HEAD_DIM, HEAD_DIM_B),
                         True).to(tl.float32)
        do_b = _load_rows(_column_block(dO_ptr, n_queries, stride_dom, start_m, BLOCK_M, True, HEAD_DIM, HEAD_DIM_B),
                          True).to(tl.float32)
        delta += tl.sum(o_b * do_b, 1)
    tl.store(Delta_rows, delta, mask=in_bounds)
    if ZERO_DQ_ACC:
        rows = DQ_acc + (off_bh.to(tl.int64) * n_queries + offs_m[:, None]) * HEAD_DIM
        HEAD_DIM_A: tl.constexpr = HEAD_DIM - HEAD_DIM_B
        tl.store(rows + tl.arange(0, HEAD_DIM_A)[None, :], tl.zeros([BLOCK_M, HEAD_DIM_A], tl.float32),
                 mask=offs_m[:, None] < n_queries)
        if HEAD_DIM_B > 0:
            tl.store(rows + HEAD_DIM_A + tl.arange(0, HEAD_DIM_B)[None, :], tl.zeros([BLOCK_M, HEAD_DIM_B], tl.float32),
                     mask=offs_m[:, None] < n_queries)


@triton.jit(do_not_specialize=["n_heads", "n_queries"])
def attn_bwd_dq_convert_kernel(
    DQ_acc,  # float32 (batch * heads, n_queries, HEAD_DIM): dS K summed over key tiles
    dQ,  # output (batch, heads, n_queries, HEAD_DIM) through the strides below
    stride_dqb, stride_dqh, stride_dqm,
    n_heads, n_queries,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_B: tl.constexpr,  # columns of the second part, 0 for none
    BLOCK_M: tl.constexpr,
):
    """dQ = DQ_acc / sqrt(d), in dQ's dtype."""
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // n_heads).to(tl.int64)
    off_h = (off_bh % n_heads).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    HEAD_DIM_A: tl.constexpr = HEAD_DIM - HEAD_DIM_B
    offs_d = tl.arange(0, HEAD_DIM_A)
    in_bounds = offs_m[:, None] < n_queries
    accumulated = DQ_acc + (off_bh.to(tl.int64) * n_queries + offs_m[:, None]) * HEAD_DIM
    dq = tl.load(accumulated + offs_d[None, :], mask=in_bounds)
    rows = dQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm
    tl.store(rows + offs_d[None, :], (dq * sm_scale).to(dQ.dtype.element_ty), mask=in_bounds)
    if HEAD_DIM_B > 0:
        offs_d_b = HEAD_DIM_A + tl.arange(0, HEAD_DIM_B)
        dq_b = tl.load(accumulated + offs_d_b[None, :], mask=in_bounds)
        tl.store(rows + offs_d_b[None, :], (dq_b * sm_scale).to(dQ.dtype.element_ty), mask=in_bounds)


@triton.jit
def _attn_bwd_dkdv_sweep(
    dk, dk_b, dv, dv_b,  # accumulators' two parts, float32 (BLOCK_N, HEAD_DIM_A | HEAD_DIM_B)
    k, k_b, v, v_b,  # this program's key/value tile's two parts
    offs_n,  # key indices of the tile's rows, (BLOCK_N,)
    Q_ptr, dO_ptr, L_ptr, Delta_ptr,  # bases for this (batch, head)
    stride_qm, stride_dom,
    query_start, query_stop,  # sweep query tiles from query_start (a multiple of BLOCK_M) up to query_stop
    n_queries,
    qk_scale,
    MASK_CAUSAL: tl.constexpr,  # tiles crossing the diagonal
    MASK_ROWS: tl.constexpr,  # tiles that may extend past n_queries
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    Q_block = _column_block(Q_ptr, n_queries, stride_qm, query_start, BLOCK_M, False, HEAD_DIM, HEAD_DIM_B)
    dO_block = _column_block(dO_ptr, n_queries, stride_dom, query_start, BLOCK_M, False, HEAD_DIM, HEAD_DIM_B)
    Q_B_block = _column_block(Q_ptr, n_queries, stride_qm, query_start, BLOCK_M, True, HEAD_DIM, HEAD_DIM_B)
    dO_B_block = _column_block(dO_ptr, n_queries, stride_dom, query_start, BLOCK_M, True, HEAD_DIM, HEAD_DIM_B)
    for start_m in range(query_start, query_stop, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(Q_block, MASK_ROWS)
        do = _load_rows(dO_block, MASK_ROWS)
        if MASK_ROWS:
            in_bounds = offs_m < n_queries
            logsumexp = tl.load(L_ptr + offs_m, mask=in_bounds, other=0.0) * LOG2_E
            delta = tl.load(Delta_ptr + offs_m, mask=in_bounds, other=0.0)
        else:
            logsumexp = tl.load(L_ptr + offs_m) * LOG2_E
            delta = tl.load(Delta_ptr + offs_m)
        # Transposed tile (keys x queries), so that dK and dV accumulate without transposing them.
        scores_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        if HEAD_DIM_B > 0:
            q_b = _load_rows(Q_B_block, MASK_ROWS)
            do_b = _load_rows(dO_B_block, MASK_ROWS)
            scores_t = tl.dot(k_b, tl.trans(q_b), scores_t, input_precision=DOT_PRECISION)
        p_t = tl.math.exp2(scores_t * qk_scale - logsumexp[None, :])
        if MASK_CAUSAL:
            visible = offs_m[None, :] >= offs_n[:, None]
            if MASK_ROWS:
                visible = visible & (offs_m[None, :] < n_queries)
            p_t = tl.where(visible, p_t, 0.0)
        elif MASK_ROWS:
            p_t = tl.where(offs_m[None, :] < n_queries, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        if HEAD_DIM_B > 0:
            dv_b = tl.dot(p_t.to(do_b.dtype), do_b, dv_b, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v_b, tl.trans(do_b), dp_t, input_precision=DOT_PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
        Q_block = tl.advance(Q_block, (BLOCK_M, 0))
        dO_block = tl.advance(dO_block, (BLOCK_M, 0))
        if HEAD_DIM_B > 0:
            dk_b = tl.dot(ds_t, q_b, dk_b, input_precision=DOT_PRECISION)
            Q_B_block = tl.advance(Q_B_block, (BLOCK_M, 0))
            dO_B_block = tl.advance(dO_B_block, (BLOCK_M, 0))
    return dk, dk_b, dv, dv_b


@triton.jit
def _attn_bwd_dq_sweep(
    dq, dq_b,  # accumulator's two parts, float32 (BLOCK_M, HEAD_DIM_A | HEAD_DIM_B)
    q, q_b, do, do_b,  # this program's query and output-gradient tiles' two parts
    logsumexp, delta,  # base-2 logsumexp and rowsum(O * dO) of the tile's rows, (BLOCK_M,)
    offs_m,  # query indices of the tile's rows, (BLOCK_M,)
    K_block, K_B_block, V_block, V_B_block,  # block pointers to key/value tiles' two parts, positioned at key 0
    key_start, key_stop,  # sweep key tiles from key_start (a multiple of BLOCK_N) up to key_stop
    n_keys,
    qk_scale,
    IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,  # apply the causal and the key-bounds mask
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM_B: tl.constexpr,
):
    K_block = tl.advance(K_block, (key_start, 0))
    V_block = tl.advance(V_block, (key_start, 0))
    if HEAD_DIM_B > 0:
        K_B_block = tl.advance(K_B_block, (key_start, 0))
        V_B_block = tl.advance(V_B_block, (key_start, 0))
    for start_n in range(key_start, key_stop, BLOCK_N):
        k = _load_rows(K_block, MASKED)
        v = _load_rows(V_block, MASKED)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N), unscaled
        if HEAD_DIM_B > 0:
            k_b = _load_rows(K_B_block, MASKED)
            v_b = _load_rows(V_B_block, MASKED)
            scores = tl.dot(q_b, tl.trans(k_b), scores, input_precision=DOT_PRECISION)
        p = tl.math.exp2(scores * qk_scale - logsumexp[:, None])
        if MASKED:
            # Zero the padded keys too: exp2(0 - L) may overflow, and inf * 0 would reach valid rows of dQ.
            offs_n = start_n + tl.arange(0, BLOCK_N)
            visible = offs_n[None, :] < n_keys
            if IS_CAUSAL:
                visible = visible & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if HEAD_DIM_B > 0:
            dp = tl.dot(do_b, tl.trans(v_b), dp, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        K_block = tl.advance(K_block, (BLOCK_N, 0))
        V_block = tl.advance(V_block, (BLOCK_N, 0))
        if HEAD_DIM_B > 0:
            dq_b = tl.dot(ds.to(k_b.dtype), k_b, dq_b, input_precision=DOT_PRECISION)
            K_B_block = tl.advance(K_B_block, (BLOCK_N, 0))
            V_B_block = tl.advance(V_B_block, (BLOCK_N, 0))
    return dq, dq_b


@triton.jit
def _part_of(start, stop, ALIGN: tl.constexpr, part, n_parts):
    """The ``part``-th of ``n_parts`` consecutive pieces of ``start .. stop``, cut at multiples of ``ALIGN`` from
    ``start`` (a multiple of it); the last ends at ``stop``, and pieces past it are empty."""
    piece = tl.cdiv(tl.cdiv(stop - start, ALIGN), n_parts) * ALIGN
    part_start = start + part * piece
    return part_start, tl.minimum(part_start + piece, stop)


@triton.jit
def _attn_bwd_dkdv_part(
    dk, dk_b, dv, dv_b, k, k_b, v, v_b, offs_n, Q_ptr, dO_ptr, L_ptr, Delta_ptr, stride_qm, stride_dom,
    start_n, n_queries, qk_scale, part, n_parts,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """:func:`_attn_bwd_dkdv_tile`'s three sweeps (slices crossing the diagonal, full slices, the ragged last one),
    each clipped to the ``part``-th of ``n_parts`` pieces of the queries that see the key tile (the bounds stay
    multiples of BLOCK_M but for n_queries)."""
    if IS_CAUSAL:
        diagonal_start = start_n // BLOCK_M * BLOCK_M
        diagonal_stop = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, n_queries)
    else:
        diagonal_start = 0
        diagonal_stop = 0
    full_slices_end = tl.maximum(n_queries // BLOCK_M * BLOCK_M, diagonal_stop)
    part_start, part_stop = _part_of(diagonal_start, n_queries, BLOCK_M, part, n_parts)
    if IS_CAUSAL:
        dk, dk_b, dv, dv_b = _attn_bwd_dkdv_sweep(
            dk, dk_b, dv, dv_b, k, k_b, v, v_b, offs_n, Q_ptr, dO_ptr, L_ptr, Delta_ptr, stride_qm, stride_dom,
            part_start, tl.minimum(diagonal_stop, part_stop), n_queries, qk_scale, True, True, DOT_PRECISION,
            HEAD_DIM, HEAD_DIM_B, BLOCK_M)
    dk, dk_b, dv, dv_b = _attn_bwd_dkdv_sweep(
        dk, dk_b, dv, dv_b, k, k_b, v, v_b, offs_n, Q_ptr, dO_ptr, L_ptr, Delta_ptr, stride_qm, stride_dom,
        tl.maximum(diagonal_stop, part_start), tl.minimum(full_slices_end, part_stop), n_queries, qk_scale, False,
        False, DOT_PRECISION, HEAD_DIM, HEAD_DIM_B, BLOCK_M)
    dk, dk_b, dv, dv_b = _attn_bwd_dkdv_sweep(
        dk, dk_b, dv, dv_b, k, k_b, v, v_b, offs_n, Q_ptr, dO_ptr, L_ptr, Delta_ptr, stride_qm, stride_dom,
        tl.maximum(full_slices_end, part_start), part_stop, n_queries, qk_scale, False, True, DOT_PRECISION,
        HEAD_DIM, HEAD_DIM_B, BLOCK_M)
    return dk, dk_b, dv, dv_b


@triton.jit
def _attn_bwd_dkdv_tile(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dK_ptr, dV_ptr,  # bases for this (batch, head)
    stride_qm, stride_kn, stride_vn, stride_dom, stride_dkn, stride_dvn,
    start_n,  # the key tile's first key
    n_queries, n_keys,
    sm_scale, qk_scale,
    part, n_parts,  # with PARTS: sweep only this part of the queries
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_B: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query slice swept
    BLOCK_N: tl.constexpr,  # key tile held
    PARTS: tl.constexpr,
):
    """dK and dV of the keys ``start_n .. start_n + BLOCK_N``, sweeping every query that sees them (with ``PARTS``,
    the ``part``-th of ``n_parts`` pieces of those queries: a partial sum)."""
    K_block = _column_block(K_ptr, n_keys, stride_kn, start_n, BLOCK_N, False, HEAD_DIM, HEAD_DIM_B)
    V_block = _column_block(V_ptr, n_keys, stride_vn, start_n, BLOCK_N, False, HEAD_DIM, HEAD_DIM_B)
    # Rows past n_keys load as zeros; what they accumulate stays in rows that are never stored.
    k = _load_rows(K_block, True)
    v = _load_rows(V_block, True)
    k_b, v_b = k, v  # stand for the absent second parts (never read)
    if HEAD_DIM_B > 0:
        k_b = _load_rows(_column_block(K_ptr, n_keys, stride_kn, start_n, BLOCK_N, True, HEAD_DIM, HEAD_DIM_B), True)
        v_b = _load_rows(_column_block(V_ptr, n_keys, stride_vn, start_n, BLOCK_N, True, HEAD_DIM, HEAD_DIM_B), True)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    dk = tl.zeros([BLOCK_N, HEAD_DIM - HEAD_DIM_B], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM - HEAD_DIM_B], dtype=tl.float32)
    dk_b = _zeros_second_part(BLOCK_N, HEAD_DIM_B)
    dv_b = _zeros_second_part(BLOCK_N, HEAD_DIM_B)

    if PARTS:
        dk, dk_b, dv, dv_b = _attn_bwd_dkdv_part(
            dk, dk_b, dv, dv_b, k, k_b, v, v_b, offs_n, Q_ptr, dO_ptr, L_ptr, Delta_ptr, stride_qm, stride_dom,
            start_n, n_queries, qk_scale, part, n_parts, IS_CAUSAL, DOT_PRECISION, HEAD_DIM, HEAD_DIM_B, BLOCK_M,
            BLOCK_N)
    else:
        if IS_CAUSAL:
            # Queries before start_n see none of these keys (early exit). A query slice sees every key
            # here iff its first query >= the tile's last key, start_n + BLOCK_N - 1.
            diagonal_start = start_n // BLOCK_M * BLOCK_M
            diagonal_stop = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, n_queries)
            dk, dk_b, dv, dv_b = _attn_bwd_dkdv_sweep(
                dk, dk_b, dv, dv_b, k, k_b, v, v_b, offs_n, Q_ptr, dO_ptr, L_ptr, Delta_ptr, stride_qm, stride_dom,
                diagonal_start, diagonal_stop, n_queries, qk_scale, True, True, DOT_PRECISION, HEAD_DIM, HEAD_DIM_B,
                BLOCK_M)
        else:
            diagonal_stop = 0
        # diagonal_stop is a multiple of BLOCK_M unless it was clipped to n_queries, which ends the sweep.
        full_slices_end = tl.maximum(n_queries // BLOCK_M * BLOCK_M, diagonal_stop)
        dk, dk_b, dv, dv_b = _attn_bwd_dkdv_sweep(
            dk, dk_b, dv, dv_b, k, k_b, v, v_b, offs_n, Q_ptr, dO_ptr, L_ptr, Delta_ptr, stride_qm, stride_dom,
            diagonal_stop, full_slices_end, n_queries, qk_scale, False, False, DOT_PRECISION, HEAD_DIM, HEAD_DIM_B,
            BLOCK_M)
        dk, dk_b, dv, dv_b = _attn_bwd_dkdv_sweep(
            dk, dk_b, dv, dv_b, k, k_b, v, v_b, offs_n, Q_ptr, dO_ptr, L_ptr, Delta_ptr, stride_qm, stride_dom,
            full_slices_end, n_queries, n_queries, qk_scale, False, True, DOT_PRECISION, HEAD_DIM, HEAD_DIM_B,
            BLOCK_M)

    dK_block = _column_block(dK_ptr, n_keys, stride_dkn, start_n, BLOCK_N, False, HEAD_DIM, HEAD_DIM_B)
    dV_block = _column_block(dV_ptr, n_keys, stride_dvn, start_n, BLOCK_N, False, HEAD_DIM, HEAD_DIM_B)
    tl.store(dK_block, (dk * sm_scale).to(dK_ptr.dtype.element_ty), boundary_check=(0,))
    tl.store(dV_block, dv.to(dV_ptr.dtype.element_ty), boundary_check=(0,))
    if HEAD_DIM_B > 0:
        dK_B_block = _column_block(dK_ptr, n_keys, stride_dkn, start_n, BLOCK_N, True, HEAD_DIM, HEAD_DIM_B)
        dV_B_block = _column_block(dV_ptr, n_keys, stride_dvn, start_n, BLOCK_N, True, HEAD_DIM, HEAD_DIM_B)
        tl.store(dK_B_block, (dk_b * sm_scale).to(dK_ptr.dtype.element_ty), boundary_check=(0,))
        tl.store(dV_B_block, dv_b.to(dV_ptr.dtype.element_ty), boundary_check=(0,))


@triton.jit
def _attn_bwd_dq_tile(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_ptr,  # bases for this (batch, head)
    stride_qm, stride_kn, stride_vn, stride_dom, stride_dqm,
    start_m,  # the query tile's first query
    n_queries, n_keys,
    sm_scale, qk_scale,
    part, n_parts,  # with PARTS: sweep only this part of the keys
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_B: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tile held
    BLOCK_N: tl.constexpr,  # key slice swept
    PARTS: tl.constexpr,
):
    """dQ of the queries ``start_m .. start_m + BLOCK_M``, sweeping every key they see (with ``PARTS``, the
    ``part``-th of ``n_parts`` pieces of those keys: a partial sum)."""
    Q_block = _column_block(Q_ptr, n_queries, stride_qm, start_m, BLOCK_M, False, HEAD_DIM, HEAD_DIM_B)
    dO_block = _column_block(dO_ptr, n_queries, stride_dom, start_m, BLOCK_M, False, HEAD_DIM, HEAD_DIM_B)
    K_block = _column_block(K_ptr, n_keys, stride_kn, 0, BLOCK_N, False, HEAD_DIM, HEAD_DIM_B)
    V_block = _column_block(V_ptr, n_keys, stride_vn, 0, BLOCK_N, False, HEAD_DIM, HEAD_DIM_B)
    K_B_block = _column_block(K_ptr, n_keys, stride_kn, 0, BLOCK_N, True, HEAD_DIM, HEAD_DIM_B)
    V_B_block = _column_block(V_ptr, n_keys, stride_vn, 0, BLOCK_N, True, HEAD_DIM, HEAD_DIM_B)
    # Rows past n_queries load as zeros (and logsumexp 0), so they stay finite; they are never stored.
    q = _load_rows(Q_block, True)
    do = _load_rows(dO_block, True)
    q_b, do_b = q, do  # stand for the absent second parts (never read)
    if HEAD_DIM_B > 0:
        q_b = _load_rows(_column_block(Q_ptr, n_queries, stride_qm, start_m, BLOCK_M, True, HEAD_DIM, HEAD_DIM_B),
                         True)
        do_b = _load_rows(_column_block(dO_ptr, n_queries, stride_dom, start_m, BLOCK_M, True, HEAD_DIM, HEAD_DIM_B),
                          True)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    in_bounds = offs_m < n_queries
    logsumexp = tl.load(L_ptr + offs_m, mask=in_bounds, other=0.0) * LOG2_E
    delta = tl.load(Delta_ptr + offs_m, mask=in_bounds, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM - HEAD_DIM_B], dtype=tl.float32)
    dq_b = _zeros_second_part(BLOCK_M, HEAD_DIM_B)

    full_slices_end = n_keys // BLOCK_N * BLOCK_N
    if IS_CAUSAL:  # the same key ranges as the forward
        key_stop = tl.minimum(n_keys, start_m + BLOCK_M)
        unmasked_end = tl.minimum((start_m + 1) // BLOCK_N * BLOCK_N, full_slices_end)
    else:
        key_stop = n_keys
        unmasked_end = full_slices_end
    if PARTS:  # the part-th of n_parts pieces of the keys the tile sees
        part_start, part_stop = _part_of(0, key_stop, BLOCK_N, part, n_parts)
        dq, dq_b = _attn_bwd_dq_sweep(dq, dq_b, q, q_b, do, do_b, logsumexp, delta, offs_m, K_block, K_B_block,
                                      V_block, V_B_block, part_start, tl.minimum(unmasked_end, part_stop), n_keys,
                                      qk_scale, IS_CAUSAL, False, DOT_PRECISION, BLOCK_N, HEAD_DIM_B)
        dq, dq_b = _attn_bwd_dq_sweep(dq, dq_b, q, q_b, do, do_b, logsumexp, delta, offs_m, K_block, K_B_block,
                                      V_block, V_B_block, tl.maximum(unmasked_end, part_start), part_stop, n_keys,
                                      qk_scale, IS_CAUSAL, True, DOT_PRECISION, BLOCK_N, HEAD_DIM_B)
    else:
        dq, dq_b = _attn_bwd_dq_sweep(dq, dq_b, q, q_b, do, do_b, logsumexp, delta, offs_m, K_block, K_B_block,
                                      V_block, V_B_block, 0, unmasked_end, n_keys, qk_scale, IS_CAUSAL, False,
                                      DOT_PRECISION, BLOCK_N, HEAD_DIM_B)
        dq, dq_b = _attn_bwd_dq_sweep(dq, dq_b, q, q_b, do, do_b, logsumexp, delta, offs_m, K_block, K_B_block,
                                      V_block, V_B_block, unmasked_end, key_stop, n_keys, qk_scale, IS_CAUSAL, True,
                                      DOT_PRECISION, BLOCK_N, HEAD_DIM_B)

    dQ_block = _column_block(dQ_ptr, n_queries, stride_dqm, start_m, BLOCK_M, False, HEAD_DIM, HEAD_DIM_B)
    tl.store(dQ_block, (dq * sm_scale).to(dQ_ptr.dtype.element_ty), boundary_check=(0,))
    if HEAD_DIM_B > 0:
        dQ_B_block = _column_block(dQ_ptr, n_queries, stride_dqm, start_m, BLOCK_M, True, HEAD_DIM, HEAD_DIM_B)
        tl.store(dQ_B_block, (dq_b * sm_scale).to(dQ_ptr.dtype.element_ty), boundary_check=(0,))


@triton.jit(do_not_specialize=_SIZE_ARGS)
def attn_bwd_kernel(
    Q, K, V, dO,  # inputs: (batch, heads, n_queries | n_keys, HEAD_DIM) through the strides below
    L, Delta,  # float32 (batch * heads, n_queries): logsumexp (natural log) and rowsum(O * dO)
    dQ, dK, dV,  # outputs, like Q, K and V
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    n_heads, n_queries, n_keys,
    n_queries_key, n_keys_key,  # coarsened lengths, read only by the autotuner
    sm_scale,  # 1 / sqrt(HEAD_DIM)
    qk_scale,  # log2(e) / sqrt(HEAD_DIM)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_B: tl.constexpr,  # columns of the second part, 0 for none (see the module's docstring)
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TILE: tl.constexpr,  # keys (dK/dV part) and queries (dQ part) held by the program
    SLICE: tl.constexpr,  # queries (dK/dV part) and keys (dQ part) per step of the sweeps
):
    """Program ``i`` computes dK and dV of key tile ``i``, then dQ of query tile ``i`` (the grid covers the longer
    of the two sequences).

    Under a causal mask key tile ``i`` sees the queries from ``i * TILE`` on and query tile ``i`` the keys up to
    ``(i + 1) * TILE``, so every program does the same work. The held tile is large and the swept slice small,
    which keeps the two float32 accumulators of the dK/dV part in registers.
    """
    tile_start = tl.program_id(0) * TILE
    off_bh = tl.program_id(1)
    off_b = (off_bh // n_heads).to(tl.int64)
    off_h = (off_bh % n_heads).to(tl.int64)
    Q_ptr = Q + off_b * stride_qb + off_h * stride_qh
    K_ptr = K + off_b * stride_kb + off_h * stride_kh
    V_ptr = V + off_b * stride_vb + off_h * stride_vh
    dO_ptr = dO + off_b * stride_dob + off_h * stride_doh
    L_ptr = L + off_bh.to(tl.int64) * n_queries
    Delta_ptr = Delta + off_bh.to(tl.int64) * n_queries

    if tile_start < n_keys:
        _attn_bwd_dkdv_tile(Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr,
                            dK + off_b * stride_dkb + off_h * stride_dkh, dV + off_b * stride_dvb + off_h * stride_dvh,
                            stride_qm, stride_kn, stride_vn, stride_dom, stride_dkn, stride_dvn,
                            tile_start, n_queries, n_keys, sm_scale, qk_scale, 0, 1,
                            HEAD_DIM, HEAD_DIM_B, IS_CAUSAL, DOT_PRECISION, SLICE, TILE, False)
    if tile_start < n_queries:
        _attn_bwd_dq_tile(Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dQ + off_b * stride_dqb + off_h * stride_dqh,
                          stride_qm, stride_kn, stride_vn, stride_dom, stride_dqm,
                          tile_start, n_queries, n_keys, sm_scale, qk_scale, 0, 1,
                          HEAD_DIM, HEAD_DIM_B, IS_CAUSAL, DOT_PRECISION, TILE, SLICE, False)


# ---------------------------------------------------------------------------------------------------
# Backward split over the swept sequence: as the forward's split over keys, for calls of few tiles. Program
# (i, bh, part) sweeps the part-th piece of the queries that see key tile i (dK, dV) and of the keys query tile i
# sees (dQ), and stores float32 partial sums; a second kernel adds each gradient's parts in order (deterministic).
# ---------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_heads", "n_queries", "n_keys", "n_parts"])
def attn_bwd_split_kernel(
    Q, K, V, dO,  # inputs: (batch, heads, n_queries | n_keys, HEAD_DIM) through the strides below
    L, Delta,  # float32 (batch * heads, n_queries): logsumexp (natural log) and rowsum(O * dO)
    dQ_part, dK_part, dV_part,  # float32 (n_parts, batch * heads, n_queries | n_keys, HEAD_DIM), contiguous
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    n_heads, n_queries, n_keys, n_parts,
    sm_scale, qk_scale,
    HEAD_DIM: tl.constexpr,  # a power of two
    IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TILE: tl.constexpr,
    SLICE: tl.constexpr,
):
    """``attn_bwd_kernel``'s program ``i`` for one part of its sweeps (``program_id(2)``), into partial sums."""
    tile_start = tl.program_id(0) * TILE
    off_bh = tl.program_id(1)
    part = tl.program_id(2)
    batch_heads = tl.num_programs(1)
    off_b = (off_bh // n_heads).to(tl.int64)
    off_h = (off_bh % n_heads).to(tl.int64)
    Q_ptr = Q + off_b * stride_qb + off_h * stride_qh
    K_ptr = K + off_b * stride_kb + off_h * stride_kh
    V_ptr = V + off_b * stride_vb + off_h * stride_vh
    dO_ptr = dO + off_b * stride_dob + off_h * stride_doh
    L_ptr = L + off_bh.to(tl.int64) * n_queries
    Delta_ptr = Delta + off_bh.to(tl.int64) * n_queries
    slot = (part * batch_heads + off_bh).to(tl.int64)

    if tile_start < n_keys:
        _attn_bwd_dkdv_tile(Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr,
                            dK_part + slot * n_keys * HEAD_DIM, dV_part + slot * n_keys * HEAD_DIM,
                            stride_qm, stride_kn, stride_vn, stride_dom, HEAD_DIM, HEAD_DIM,
                            tile_start, n_queries, n_keys, sm_scale, qk_scale, part, n_parts,
                            HEAD_DIM, 0, IS_CAUSAL, DOT_PRECISION, SLICE, TILE, True)
    if tile_start < n_queries:
        _attn_bwd_dq_tile(Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_part + slot * n_queries * HEAD_DIM,
                          stride_qm, stride_kn, stride_vn, stride_dom, HEAD_DIM,
                          tile_start, n_queries, n_keys, sm_scale, qk_scale, part, n_parts,
                          HEAD_DIM, 0, IS_CAUSAL, DOT_PRECISION, TILE, SLICE, True)


@triton.jit(do_not_specialize=["n_heads", "n_rows", "n_parts"])
def attn_bwd_sum_parts_kernel(
    Parts,  # float32 (n_parts, batch * heads, n_rows, HEAD_DIM), contiguous
    Out,  # (batch, heads, n_rows, HEAD_DIM) through the strides below
    stride_ob, stride_oh, stride_om,
    n_heads, n_rows, n_parts,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``Out = sum of the parts``, added in part order, in Out's dtype."""
    off_bh, batch_heads, offs_m, rows, offs_d = _parts_pass_program(n_rows, HEAD_DIM, BLOCK_M)
    total = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for part in range(0, n_parts):
        slot = _part_rows(part, batch_heads, off_bh, n_rows)
        total += tl.load(Parts + (slot + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], mask=rows[:, None], other=0.0)
    out = _head_rows(Out, off_bh, n_heads, stride_ob, stride_oh, stride_om, offs_m, offs_d)
    tl.store(out, total.to(Out.dtype.element_ty), mask=rows[:, None])
