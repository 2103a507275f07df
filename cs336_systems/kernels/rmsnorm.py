"""Fused RMSNorm in Triton: forward and backward kernels, launch wrappers, an autograd
Function, and :class:`FusedRMSNorm`, a drop-in replacement for ``cs336_basics.model.RMSNorm``.

For a row ``x`` of ``N`` features and the gain ``g``::

    r   = 1 / sqrt(mean(x^2) + eps)                    (float32, saved per row for backward)
    x^  = x * r
    y   = x^ * g                                       (cast to x's dtype, like the plain RMSNorm)

Backward, with ``dy`` the output gradient and ``h = dy * g`` (derivation: ``dr/dx_j = -r^3 x_j / N``)::

    dx  = r * (h - x^ * mean(h * x^))                  (per row)
    dg  = sum over rows of dy * x^                     (a reduction over all rows)

Layout: ``x`` of shape ``(..., N)`` is viewed as ``(n_rows, N)`` (a copy only when that view does not
exist or the last dimension is strided). Every statistic and accumulation is float32.

Both kernels run a grid of ``P`` programs; program ``p`` takes the ``BLOCK_M``-row tiles ``p, p + P, p + 2P,
...``, so that the programs in flight read neighbouring rows. The backward's grid is persistent (a few programs
per SM); the forward's is tuned with its tiles: a few programs per SM, or one program per tile, which lets the
hardware keep as many programs resident as fit (which is faster depends on the shape, by up to 10 %). For a row
that fits in one tile (``next_power_of_2(N) <= MAX_BLOCK_N``) a program that loops over tiles loads its next tile
into registers before it works on the current one, so that loads are always in flight (Triton pipelines only
loads that feed ``tl.dot``).

* Forward: a row is loaded once (a longer row is walked twice in tiles of ``MAX_BLOCK_N`` columns: sum of
  squares, then normalise and store).
* Backward: ``BWD_PROGRAMS_PER_SM`` programs per SM compute ``dx`` tile by tile and accumulate their
  partial ``dg`` as a float32 ``(BLOCK_M, BLOCK_N)`` register tile, summed over its rows once at the end
  into one float32 row per program; a small second kernel adds the ``(n_programs, N)`` partials and rounds
  to the gain's dtype. No atomics, so the result does not depend on scheduling, and re-running a launch (as
  the autotuner does) rewrites the same values. Long rows use a first sweep for ``mean(h * x^)`` per row
  (kept in a float32 scratch vector), then sweep column tiles, each over the program's rows.

Launch parameters: on a GPU ``triton.autotune`` picks ``BLOCK_M`` and ``num_warps`` per row length, a
coarse row count and dtype, the first time each is seen (``RMSNORM_CONFIG``: ``RMSNormConfig(autotune=False)``
for a fixed heuristic instead); under ``TRITON_INTERPRET=1`` (CPU) one small configuration. Each kernel is a
``cs336_systems.kernels.launch.Kernel``: the configuration is chosen once per key, and later eager calls launch
its compiled kernel directly.

``torch.compile``: eager calls launch the kernels directly (the least host overhead); while Dynamo traces,
the Function calls the same launch code, traced (``traced=True``: the fixed configuration, launched through
``wrap_triton``), through two ``torch.library`` operators instead. On a GPU these are ``triton_op``s, so
Inductor emits the kernel launches into its own generated code (no Python launch code per norm in a compiled
model, and CUDA graphs capture them); under the interpreter they are opaque ``custom_op``s.

Under autocast, ``FusedRMSNorm.autocast_output`` (off by default) writes the output directly in the
autocast dtype, which the matmuls that consume it would cast to anyway: half the bytes written, no cast
kernel, and a 16-bit output gradient to read in backward.

The residual add fused in (``cs336_systems.kernels.residual_rmsnorm``, which has the math) runs these kernels with
their residual switches on: the forward's ``ADD_RESIDUAL`` adds a residual tile, stores the sum rounded to x's dtype
and normalises it (a long row's second sweep adds again rather than reading back what other threads stored); the
backward's ``ADD_DS`` adds a second incoming gradient to ``dx`` before the store. Off, they compile to the plain
kernels. The training step's ``fused_residual_norm`` part (``cs336_systems.train.residual_stream``) builds the
model's blocks on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor, nn

from cs336_basics.model import RMSNorm
from cs336_systems.kernels.launch import (
    FLOAT_DTYPES,
    CurrentConfig,
    Kernel,
    aligned,
    check_device,
    define_operator,
    interpreting,
    multiprocessors,
    new_output,
    unit_last_stride,
)

SUPPORTED_DTYPES = FLOAT_DTYPES


@dataclass(frozen=True)
class RMSNormConfig:
    """``autotune``: eager calls autotune ``BLOCK_M`` and ``num_warps`` on a GPU (default), once per key, else take
    :func:`fixed_config`. Traced launches (the operators that compiled graphs call) always take the fixed one."""

    autotune: bool = True


RMSNORM_CONFIG: CurrentConfig[RMSNormConfig] = CurrentConfig(RMSNormConfig())

MAX_BLOCK_N = 8192
"""The widest column tile (elements). Rows up to this many features are held whole in registers; longer
rows are tiled. Tests lower it to exercise the tiled path at small sizes."""

FWD_PROGRAMS_PER_SM = 4
"""Forward programs per streaming multiprocessor of the fixed configuration (a persistent grid; fewer when there
are fewer tiles); the autotuner also tries the grid sizes ``FWD_GRIDS``."""

FWD_GRIDS = (4, 16, 0)
"""Forward grid sizes the autotuner tries, in programs per SM; 0: one program per tile, which loads its tile and
prefetches nothing (half the registers of a looping program, so more programs fit on an SM)."""

BWD_PROGRAMS_PER_SM = 4
"""Backward programs per streaming multiprocessor. Registers decide how many an SM runs at once: two of the
heaviest configurations, four or more of the light ones; programs beyond that run in a second wave of equal
length, which costs nothing. The price of more programs is the partial weight gradients (``n_programs x N``
float32, written and read once more): at 8192 rows of 768 in bf16 about 5 % of the forward+backward
traffic, at 65536 rows under 1 %."""

PREFETCH_MAX_ROW_BYTES = 16384
"""The backward prefetches the next tile for rows of up to this many bytes (``BLOCK_N`` times the element
size): a float32 row of 8192 leaves no registers for a second tile even at 16 warps."""

# ---------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------
#
# Both kernels run a persistent grid: program p takes the BLOCK_M-row tiles p, p + P, p + 2P, ... (P programs),
# so that the programs in flight at any moment read neighbouring rows. A short row's loop holds the next tile's
# loads in registers while it computes the current one: Triton's pipeliner leaves loads that feed no tl.dot
# alone, and without the prefetch every step waits one full memory latency (plus the cross-warp reduction's
# barriers) with nothing in flight.


@triton.jit
def _load_tile(Ptr, rows, n_rows, stride_row, cols, col_mask):
    """Rows ``rows`` (BLOCK_M,) of a (n_rows, n_cols) matrix, columns ``cols``, in its own dtype; zeros outside."""
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    return tl.load(Ptr + rows.to(tl.int64)[:, None] * stride_row + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _add_residual(x, R, S, rows, n_rows, stride_r_row, cols, col_mask):
    """``x + r`` for the residual ``r`` of these rows, rounded to ``S``'s dtype as a separate add would be."""
    r = _load_tile(R, rows, n_rows, stride_r_row, cols, col_mask)
    return (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)


@triton.jit
def _store_tile(Ptr, value, rows, n_rows, stride_row, cols, col_mask):
    """Store ``value`` (BLOCK_M, BLOCK_N) in rows ``rows`` and columns ``cols``, in ``Ptr``'s dtype; in bounds only."""
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    tl.store(Ptr + rows.to(tl.int64)[:, None] * stride_row + cols[None, :], value.to(Ptr.dtype.element_ty), mask=mask)


@triton.jit
def _normalise_tile(x, w, rows, n_rows, n_cols, cols, col_mask, eps, Y, Rstd, stride_y_row, R, S, stride_r_row,
                    stride_s_row, ADD_RESIDUAL: tl.constexpr):
    """Normalise the loaded tile ``x`` (BLOCK_M, BLOCK_N) of whole rows ``rows`` (after adding the residual, and
    writing the sum to ``S``, when ``ADD_RESIDUAL``): store ``y`` and ``1 / rms``."""
    if ADD_RESIDUAL:
        x = _add_residual(x, R, S, rows, n_rows, stride_r_row, cols, col_mask)
        _store_tile(S, x, rows, n_rows, stride_s_row, cols, col_mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # (BLOCK_M,)
    _store_tile(Y, x * rstd[:, None] * w[None, :], rows, n_rows, stride_y_row, cols, col_mask)
    tl.store(Rstd + rows, rstd, mask=rows < n_rows)


# Row counts vary from call to call: don't compile a variant per value (Triton otherwise specialises integers on
# divisibility by 16 and on equality to 1). Column counts and strides keep it: it proves rows aligned.
@triton.jit(do_not_specialize=["n_rows", "rows_key"])
def rmsnorm_fwd_kernel(
    X,  # input (n_rows, n_cols), unit column stride
    W,  # gain (n_cols,), contiguous
    Y,  # output (n_rows, n_cols), contiguous, X's dtype or the requested one
    Rstd,  # output: 1 / rms per row, float32 (n_rows,)
    stride_x_row, stride_y_row,
    n_rows, n_cols, rows_key,  # rows_key: coarsened rows per program, read only by the autotuner
    eps,
    R,  # ADD_RESIDUAL: the residual (n_rows, n_cols), X's dtype, unit column stride (else unused)
    S,  # ADD_RESIDUAL: output X + R (n_rows, n_cols), X's dtype, contiguous; the rows normalised (else unused)
    stride_r_row, stride_s_row,
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # columns per tile: next_power_of_2(n_cols), or MAX_BLOCK_N when tiled
    SINGLE_TILE: tl.constexpr,  # n_cols <= BLOCK_N: a row is loaded once
    ADD_RESIDUAL: tl.constexpr,  # normalise S = X + R, and write S
    PROGRAMS_PER_SM: tl.constexpr,  # the grid's size (see FWD_GRIDS), chosen with the tiles; read by the launch only
):
    pid, n_programs = tl.program_id(0), tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_TILE:
        col_mask = cols < n_cols
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)  # (BLOCK_N,)
        if PROGRAMS_PER_SM == 0:  # one program per tile: nothing to prefetch, and half the registers
            rows = pid * BLOCK_M + offs_m
            x = _load_tile(X, rows, n_rows, stride_x_row, cols, col_mask)
            _normalise_tile(x, w, rows, n_rows, n_cols, cols, col_mask, eps, Y, Rstd, stride_y_row, R, S,
                            stride_r_row, stride_s_row, ADD_RESIDUAL)
        else:
            x_next = _load_tile(X, pid * BLOCK_M + offs_m, n_rows, stride_x_row, cols, col_mask)
            for tile in range(pid, n_tiles, n_programs):
                rows = tile * BLOCK_M + offs_m  # (BLOCK_M,)
                x = x_next
                x_next = _load_tile(X, rows + n_programs * BLOCK_M, n_rows, stride_x_row, cols, col_mask)
                _normalise_tile(x, w, rows, n_rows, n_cols, cols, col_mask, eps, Y, Rstd, stride_y_row, R, S,
                                stride_r_row, stride_s_row, ADD_RESIDUAL)
    else:
        for tile in range(pid, n_tiles, n_programs):
            rows = tile * BLOCK_M + offs_m
            row_mask = rows < n_rows
            sum_sq = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                offs = start + cols
                col_mask = offs < n_cols
                x = _load_tile(X, rows, n_rows, stride_x_row, offs, col_mask)
                if ADD_RESIDUAL:
                    x = _add_residual(x, R, S, rows, n_rows, stride_r_row, offs, col_mask)
                    _store_tile(S, x, rows, n_rows, stride_s_row, offs, col_mask)
                x = x.to(tl.float32)
                sum_sq += x * x
            rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / n_cols + eps)
            Y_rows = Y + rows.to(tl.int64)[:, None] * stride_y_row
            for start in range(0, n_cols, BLOCK_N):
                offs = start + cols
                col_mask = offs < n_cols
                x = _load_tile(X, rows, n_rows, stride_x_row, offs, col_mask)
                if ADD_RESIDUAL:  # the same sum again (the first sweep's stores came from other threads)
                    x = _add_residual(x, R, S, rows, n_rows, stride_r_row, offs, col_mask)
                x = x.to(tl.float32)
                w = tl.load(W + offs, mask=col_mask, other=0.0).to(tl.float32)
                y = x * rstd[:, None] * w[None, :]
                tl.store(Y_rows + offs[None, :], y.to(Y.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
            tl.store(Rstd + rows, rstd, mask=row_mask)


@triton.jit(do_not_specialize=["n_rows", "rows_key"])
def rmsnorm_bwd_kernel(
    DY,  # output gradient (n_rows, n_cols), unit column stride
    X,  # the forward's input (n_rows, n_cols), unit column stride
    W,  # gain (n_cols,), contiguous
    Rstd,  # 1 / rms per row from the forward, float32 (n_rows,)
    DX,  # output: input gradient (n_rows, n_cols), contiguous, X's dtype
    DW_partial,  # output: per program, its rows' sum of dy * x^, float32 (n_programs, n_cols), contiguous
    Coef,  # scratch for long rows: mean(h * x^) / rstd per row, float32 (n_rows,)
    stride_dy_row, stride_x_row, stride_dx_row,
    n_rows, n_cols, rows_key,  # rows_key: coarsened rows per program, for the autotuner
    DS,  # ADD_DS: a gradient added to dx (n_rows, n_cols), unit column stride (else unused)
    stride_ds_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
    PREFETCH: tl.constexpr,  # a single-tile row: load the next tile while working on this one
    COMPUTE_DX: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    ADD_DS: tl.constexpr,  # dx = DS + the norm's input gradient (the input also fed a residual stream)
):
    pid, n_programs = tl.program_id(0), tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    DW_row = DW_partial + pid.to(tl.int64) * n_cols
    if SINGLE_TILE:
        col_mask = cols < n_cols
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)  # (BLOCK_N,)
        # Summed over rows only once, after the loop: one cross-thread reduction instead of one per step.
        dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if PREFETCH:
            rows = pid * BLOCK_M + offs_m
            x_next = _load_tile(X, rows, n_rows, stride_x_row, cols, col_mask)
            dy_next = _load_tile(DY, rows, n_rows, stride_dy_row, cols, col_mask)
            rstd_next = tl.load(Rstd + rows, mask=rows < n_rows, other=0.0)
        for tile in range(pid, n_tiles, n_programs):
            rows = tile * BLOCK_M + offs_m  # (BLOCK_M,)
            if PREFETCH:
                x, dy, rstd = x_next, dy_next, rstd_next
                # The next tile's loads are in flight while this one is reduced and stored (masked off past the end).
                next_rows = rows + n_programs * BLOCK_M
                x_next = _load_tile(X, next_rows, n_rows, stride_x_row, cols, col_mask)
                dy_next = _load_tile(DY, next_rows, n_rows, stride_dy_row, cols, col_mask)
                rstd_next = tl.load(Rstd + next_rows, mask=next_rows < n_rows, other=0.0)
            else:
                x = _load_tile(X, rows, n_rows, stride_x_row, cols, col_mask)
                dy = _load_tile(DY, rows, n_rows, stride_dy_row, cols, col_mask)
                rstd = tl.load(Rstd + rows, mask=rows < n_rows, other=0.0)
            x, dy = x.to(tl.float32), dy.to(tl.float32)  # (BLOCK_M, BLOCK_N)
            x_hat = x * rstd[:, None]  # rows past the end: rstd 0, so x^ 0
            if COMPUTE_DX:
                h = dy * w[None, :]
                c = tl.sum(h * x_hat, axis=1) / n_cols  # mean(h * x^) per row
                dx = (h - x_hat * c[:, None]) * rstd[:, None]
                if ADD_DS:
                    dx += _load_tile(DS, rows, n_rows, stride_ds_row, cols, col_mask).to(tl.float32)
                _store_tile(DX, dx, rows, n_rows, stride_dx_row, cols, col_mask)
            if COMPUTE_DW:
                dw += dy * x_hat  # masked rows and columns are zeros
        if COMPUTE_DW:
            tl.store(DW_row + cols, tl.sum(dw, axis=0), mask=col_mask)
    else:
        # Sweep 1: c = mean(h * x^) / r = r * mean(h * x) per row, so that dx = r * h - r^2 * c * x.
        if COMPUTE_DX:
            for tile in range(pid, n_tiles, n_programs):
                rows = tile * BLOCK_M + offs_m
                row_mask = rows < n_rows
                rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
                dot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for col_start in range(0, n_cols, BLOCK_N):
                    offs = col_start + cols
                    col_mask = offs < n_cols
                    x = _load_tile(X, rows, n_rows, stride_x_row, offs, col_mask).to(tl.float32)
                    dy = _load_tile(DY, rows, n_rows, stride_dy_row, offs, col_mask).to(tl.float32)
                    w = tl.load(W + offs, mask=col_mask, other=0.0).to(tl.float32)
                    dot += dy * w[None, :] * x
                tl.store(Coef + rows, tl.sum(dot, axis=1) * rstd / n_cols, mask=row_mask)
            # The scratch values are read back below by other threads of this program.
            tl.debug_barrier()
        # Sweep 2: column tile by column tile, over the program's rows, so dg stays in registers.
        for col_start in range(0, n_cols, BLOCK_N):
            offs = col_start + cols
            col_mask = offs < n_cols
            w = tl.load(W + offs, mask=col_mask, other=0.0).to(tl.float32)
            dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for tile in range(pid, n_tiles, n_programs):
                rows = tile * BLOCK_M + offs_m
                row_mask = rows < n_rows
                rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
                x = _load_tile(X, rows, n_rows, stride_x_row, offs, col_mask).to(tl.float32)
                dy = _load_tile(DY, rows, n_rows, stride_dy_row, offs, col_mask).to(tl.float32)
                if COMPUTE_DX:
                    c = tl.load(Coef + rows, mask=row_mask, other=0.0)
                    dx = (dy * w[None, :] - x * (rstd * c)[:, None]) * rstd[:, None]
                    if ADD_DS:
                        dx += _load_tile(DS, rows, n_rows, stride_ds_row, offs, col_mask).to(tl.float32)
                    _store_tile(DX, dx, rows, n_rows, stride_dx_row, offs, col_mask)
                if COMPUTE_DW:
                    dw += dy * x * rstd[:, None]
            if COMPUTE_DW:
                tl.store(DW_row + offs, tl.sum(dw, axis=0), mask=col_mask)


@triton.jit
def rmsnorm_dw_reduce_kernel(
    DW_partial,  # per-program partial weight gradients, float32 (n_partials, n_cols), contiguous
    DW,  # output: their sum over programs (n_cols,), the gain's dtype
    n_partials, n_cols,
    BLOCK_P: tl.constexpr,  # partial rows per step
    BLOCK_C: tl.constexpr,  # columns per program
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        acc += _load_tile(DW_partial, rows, n_partials, n_cols, cols, col_mask)
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=col_mask)


# ---------------------------------------------------------------------------------------------------
# Launch parameters
# ---------------------------------------------------------------------------------------------------


def _config(block_m: int, num_warps: int, num_stages: int = 1) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m}, num_warps=num_warps, num_stages=num_stages)


def _fwd_config(block_m: int, num_warps: int, programs_per_sm: int = FWD_PROGRAMS_PER_SM) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "PROGRAMS_PER_SM": programs_per_sm}, num_warps=num_warps, num_stages=1)


FWD_CONFIGS = [_fwd_config(m, w, p) for m, w in [(1, 2), (1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (4, 4), (4, 8),
                                                 (4, 16), (8, 8), (8, 16), (16, 16)] for p in FWD_GRIDS]
BWD_CONFIGS = [_config(m, w) for m, w in [(1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8),
                                          (8, 16)]]
INTERPRETER_BLOCK_M = 4

# The weight-gradient reduction: (n_programs, N) float32 partials to (N,), BLOCK_P x BLOCK_C at a time.
REDUCE_BLOCK_P, REDUCE_BLOCK_C, REDUCE_NUM_WARPS = 128, 32, 4

# Bytes of one tile (one tensor) per thread. At least 16 (one 128-bit load per thread); at most what fits in
# registers beside the float32 copies without spilling even at 16 warps (128 registers a thread): the
# backward holds x and dy, the next tile's x and dy and a float32 dg accumulator; the forward x and the next
# tile's x (checked with ptxas for sm_90).
MIN_BYTES_PER_THREAD = 16
MAX_BYTES_PER_THREAD = {"fwd": 64, "bwd": 32}


def _elements_per_thread(config: triton.Config, block_n: int) -> float:
    return config.kwargs["BLOCK_M"] * block_n / (32 * config.num_warps)


def _pruner(kernel: str):
    """Keep the configurations whose tile suits the row length and dtype and that leave enough programs."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        block_n, element_size = kwargs["BLOCK_N"], named_args["X"].element_size()
        low, high = MIN_BYTES_PER_THREAD / element_size, MAX_BYTES_PER_THREAD[kernel] / element_size
        # The most rows a tile may take: rows_key is about the rows per program (n_rows over the
        # persistent grid), so that every program gets a tile. Long (tiled) rows take one at a time.
        max_block_m = max(named_args["rows_key"], 1) if kwargs["SINGLE_TILE"] else 1
        allowed = [c for c in configs if c.kwargs["BLOCK_M"] <= max_block_m]
        fitting = [c for c in allowed if low <= _elements_per_thread(c, block_n) <= high]
        # Nothing fits (a very short row, or a long row's widest tile in float32): the allowed configuration
        # nearest the range (the fewest idle threads, or the fewest registers).
        def excess(c: triton.Config) -> float:
            elements = _elements_per_thread(c, block_n)
            return max(low / elements, elements / high)

        return fitting or [min(allowed, key=excess)]

    return prune


# The row length and the coarsened row count are the autotuner's keys; the dtypes of the tensor arguments are part
# of every key automatically.
_FORWARD = Kernel(rmsnorm_fwd_kernel, FWD_CONFIGS, ["n_cols", "rows_key", "ADD_RESIDUAL"], _pruner("fwd"))
_BACKWARD = Kernel(rmsnorm_bwd_kernel, BWD_CONFIGS,
                   ["n_cols", "rows_key", "PREFETCH", "COMPUTE_DX", "COMPUTE_DW", "ADD_DS"], _pruner("bwd"))
_DW_REDUCE = Kernel(rmsnorm_dw_reduce_kernel)


def _block_n(n_cols: int) -> tuple[int, bool]:
    """(columns per tile, whether one tile holds the whole row)."""
    block_n = triton.next_power_of_2(n_cols)
    return (block_n, True) if block_n <= MAX_BLOCK_N else (MAX_BLOCK_N, False)


def _prefetch(block_n: int, single_tile: bool, element_size: int) -> bool:
    """Whether the backward prefetches the next tile (see ``PREFETCH_MAX_ROW_BYTES``)."""
    return single_tile and block_n * element_size <= PREFETCH_MAX_ROW_BYTES


def fixed_config(kernel: str, n_cols: int, element_size: int) -> triton.Config:
    """The launch configuration when not autotuning: about 4096 elements a tile and 32 bytes of it a thread (the
    backward of a float32 768-column row: 4 rows, 16 warps; bfloat16: 4 rows, 8 warps)."""
    make = _fwd_config if kernel == "fwd" else _config
    if interpreting():
        return make(INTERPRETER_BLOCK_M, 4)
    block_n, single_tile = _block_n(n_cols)
    block_m = max(1, min(16, 4096 // block_n)) if single_tile else 1
    num_warps = min(16, triton.next_power_of_2(max(1, block_m * block_n * element_size // (32 * 32))))
    return make(block_m, num_warps)


def _reduce_config() -> triton.Config:
    return triton.Config({"BLOCK_P": REDUCE_BLOCK_P, "BLOCK_C": REDUCE_BLOCK_C}, num_warps=REDUCE_NUM_WARPS)


def _rows_key(n: int) -> int:
    return min(triton.next_power_of_2(max(n, 1)), 1 << 16)


def forward_programs(n_rows: int, tiles: dict[str, int], multiprocessors: int) -> int:
    """The forward's grid: one program per ``BLOCK_M``-row tile, at most ``PROGRAMS_PER_SM`` per SM (0: no limit)."""
    n_tiles = triton.cdiv(n_rows, tiles["BLOCK_M"])
    per_sm = tiles["PROGRAMS_PER_SM"]
    return min(n_tiles, multiprocessors * per_sm) if per_sm else n_tiles


# ---------------------------------------------------------------------------------------------------
# Launch wrappers: (n_rows, N) tensors with a unit column stride, checked by the caller. Eager calls (traced=False)
# autotune when RMSNORM_CONFIG says so; the operators' bodies (traced=True) run inside a compiled graph.
# ---------------------------------------------------------------------------------------------------


def rmsnorm_forward(
    x: Float[Tensor, "n_rows N"], weight: Float[Tensor, "N"], eps: float, out_dtype: torch.dtype | None = None,
    traced: bool = False,
) -> tuple[Float[Tensor, "n_rows N"], Float[Tensor, "n_rows"]]:
    """``y`` (``out_dtype``, by default x's; contiguous) and ``1 / rms`` per row (float32)."""
    n_rows, n_cols = x.shape
    y = new_output((n_rows, n_cols), out_dtype or x.dtype, x.device)
    rstd = new_output((n_rows,), torch.float32, x.device)
    launch_rmsnorm_forward(x, weight, y, rstd, eps, traced)
    return y, rstd


def launch_rmsnorm_forward(
    x: Float[Tensor, "n_rows N"], weight: Float[Tensor, "N"], y: Float[Tensor, "n_rows N"],
    rstd: Float[Tensor, "n_rows"], eps: float, traced: bool = False, residual: Float[Tensor, "n_rows N"] | None = None,
    s: Float[Tensor, "n_rows N"] | None = None,
) -> None:
    """Write ``y`` and ``rstd`` (contiguous) for the rows ``x``; with ``residual`` normalise ``s = x + residual``
    instead (summed in float32), and write it to ``s`` (contiguous; rounded to its dtype)."""
    n_rows, n_cols = x.shape
    if n_rows == 0:
        return
    add = residual is not None
    residual, s = (residual, s) if add else (x, y)  # never touched without ADD_RESIDUAL
    block_n, single_tile = _block_n(n_cols)
    n_multiprocessors = multiprocessors(x.device)
    rows_key = _rows_key(triton.cdiv(n_rows, n_multiprocessors * FWD_PROGRAMS_PER_SM))
    args = (x, weight, y, rstd, x.stride(0), y.stride(0), n_rows, n_cols, rows_key, eps, residual, s,
            residual.stride(0), s.stride(0))
    # What the configuration and the compilation depend on (nothing while traced: fake tensors have no data).
    key = None if traced else (x.dtype, weight.dtype, y.dtype, x.stride(0), n_cols, aligned(x, weight, residual, s),
                               rows_key, block_n, add, residual.stride(0), residual.dtype, s.dtype)
    _FORWARD(key, lambda tiles: (forward_programs(n_rows, tiles, n_multiprocessors),), args,
             {"BLOCK_N": block_n, "SINGLE_TILE": single_tile, "ADD_RESIDUAL": add},
             lambda: fixed_config("fwd", n_cols, x.element_size()), traced=traced,
             autotune=RMSNORM_CONFIG.get().autotune)


def rmsnorm_backward(
    dy: Float[Tensor, "n_rows N"], x: Float[Tensor, "n_rows N"], weight: Float[Tensor, "N"],
    rstd: Float[Tensor, "n_rows"],
    compute_dx: bool = True, compute_dw: bool = True, traced: bool = False,
    ds: Float[Tensor, "n_rows N"] | None = None,
) -> tuple[Float[Tensor, "n_rows N"] | None, Float[Tensor, "N"] | None]:
    """``dx`` (x's dtype, contiguous) and ``dg`` (weight's dtype); None for a gradient not asked for. ``ds``: a
    gradient of x from its other uses (unit column stride), added to ``dx``."""
    n_rows, n_cols = x.shape
    dx = new_output((n_rows, n_cols), x.dtype, x.device) if compute_dx else None
    add_ds = ds is not None and compute_dx
    ds = ds if add_ds else x  # never read without ADD_DS
    if n_rows == 0 or not (compute_dx or compute_dw):
        return dx, torch.zeros_like(weight) if compute_dw else None
    block_n, single_tile = _block_n(n_cols)
    # A fixed grid, whatever BLOCK_M the autotuner picks: the partial buffer is allocated before the launch. A
    # program left without a tile (BLOCK_M > 1 and few rows) writes a partial row of zeros.
    n_programs = min(multiprocessors(x.device) * BWD_PROGRAMS_PER_SM, n_rows)
    dw_partial = new_output((n_programs, n_cols), torch.float32, x.device) if compute_dw else rstd
    coef = torch.empty((n_rows,), dtype=torch.float32, device=x.device) if compute_dx and not single_tile else rstd
    dx_arg = dx if compute_dx else x  # never written when COMPUTE_DX is off
    rows_key = _rows_key(triton.cdiv(n_rows, n_programs))
    args = (dy, x, weight, rstd, dx_arg, dw_partial, coef, dy.stride(0), x.stride(0), dx_arg.stride(0),
            n_rows, n_cols, rows_key, ds, ds.stride(0))
    prefetch = _prefetch(block_n, single_tile, max(x.element_size(), dy.element_size()))
    key = None if traced else (dy.dtype, x.dtype, weight.dtype, dy.stride(0), x.stride(0), n_cols,
                               aligned(dy, x, weight, ds), rows_key, block_n, prefetch, compute_dx, compute_dw,
                               ds.dtype, ds.stride(0), add_ds)
    _BACKWARD(key, lambda tiles: (n_programs,), args,
              dict(BLOCK_N=block_n, SINGLE_TILE=single_tile, PREFETCH=prefetch, COMPUTE_DX=compute_dx,
                   COMPUTE_DW=compute_dw, ADD_DS=add_ds),
              lambda: fixed_config("bwd", n_cols, x.element_size()), traced=traced,
              autotune=RMSNORM_CONFIG.get().autotune)
    if not compute_dw:
        return dx, None
    # One small launch that sums the partials and rounds to the gain's dtype (torch would take two: sum, cast).
    dw = new_output((n_cols,), weight.dtype, x.device)
    _DW_REDUCE(None if traced else (weight.dtype, n_programs, n_cols),
               lambda tiles: (triton.cdiv(n_cols, tiles["BLOCK_C"]),), (dw_partial, dw, n_programs, n_cols), {},
               _reduce_config, traced=traced)
    return dx, dw


# ---------------------------------------------------------------------------------------------------
# Operators: torch.compile traces them into its graph (no graph break). On a GPU they are triton_ops, whose
# launches Inductor emits itself, so a compiled model pays no Python launch code per norm; under the interpreter
# opaque custom ops (see define_operator).
# ---------------------------------------------------------------------------------------------------


def _forward_op(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    # Fixed tiles: an autotuned user kernel inside a compiled graph re-ran its benchmarks on every call (measured
    # on an H200: a compiled xl step took 2.1 s instead of 0.1 s).
    return rmsnorm_forward(x, weight, eps, out_dtype, traced=True)


def _forward_shapes(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape[:1], dtype=torch.float32)


def _backward_op(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, compute_dx: bool, compute_dw: bool
) -> tuple[Tensor, Tensor]:
    dx, dw = rmsnorm_backward(dy, x, weight, rstd, compute_dx, compute_dw, traced=True)
    # An operator returns tensors, never None: empty ones stand for gradients not asked for.
    return (dx if dx is not None else x.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


def _backward_shapes(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, compute_dx: bool, compute_dw: bool
) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape if compute_dx else (0,)), weight.new_empty(weight.shape if compute_dw else (0,))


define_operator("cs336_systems::rmsnorm_forward", _forward_op, traceable=True, fake=_forward_shapes)
define_operator("cs336_systems::rmsnorm_backward", _backward_op, traceable=True, fake=_backward_shapes)

# ---------------------------------------------------------------------------------------------------
# Autograd function, functional entry point, module, model switch
# ---------------------------------------------------------------------------------------------------


def check_inputs(x: Tensor, weight: Tensor) -> None:
    """Raise a clear error for inputs the kernels do not take."""
    if weight.dim() != 1:
        raise ValueError(f"the RMSNorm weight must be one-dimensional, got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"the last dimension of x must match the weight's length: x has shape {tuple(x.shape)}, "
            f"the weight {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("cannot normalise rows of zero features")
    for name, tensor in (("x", x), ("weight", weight)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"unsupported dtype {tensor.dtype} for {name}: the fused RMSNorm takes float16, bfloat16 "
                            "or float32")
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on one device, got {x.device} and {weight.device}")
    check_device(x, "the fused RMSNorm kernels", "cs336_systems.kernels.rmsnorm")


class FusedRMSNormFunction(torch.autograd.Function):
    """``FusedRMSNormFunction.apply(x, weight, eps, out_dtype=None) == RMSNorm(x)`` with gain ``weight``, by
    Triton kernels.

    Output in x's dtype (or ``out_dtype``: rounded once, from float32); gradients in x's and weight's dtypes. Saved
    for backward: x (as rows), the weight, and ``1 / rms`` per row in float32.
    """

    @staticmethod
    def forward(
        ctx, x: Float[Tensor, "... N"], weight: Float[Tensor, "N"], eps: float, out_dtype: torch.dtype | None = None
    ) -> Float[Tensor, "... N"]:
        check_inputs(x, weight)
        if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"unsupported output dtype {out_dtype}: the fused RMSNorm writes float16, bfloat16 or "
                            "float32")
        x_rows = unit_last_stride(x.reshape(-1, x.shape[-1]))  # a view when x's layout allows
        weight = unit_last_stride(weight)
        if torch.compiler.is_compiling():
            y, rstd = torch.ops.cs336_systems.rmsnorm_forward(x_rows, weight, eps, out_dtype or x.dtype)
        else:
            y, rstd = rmsnorm_forward(x_rows, weight, eps, out_dtype)
        ctx.save_for_backward(x_rows, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Float[Tensor, "... N"]):
        x_rows, weight, rstd = ctx.saved_tensors
        compute_dx, compute_dw = ctx.needs_input_grad[:2]
        # Any layout, including the all-stride-0 one that y.sum().backward() sends.
        dy_rows = unit_last_stride(dy.reshape(-1, x_rows.shape[-1]))
        if torch.compiler.is_compiling():
            dx, dw = torch.ops.cs336_systems.rmsnorm_backward(dy_rows, x_rows, weight, rstd, compute_dx, compute_dw)
        else:
            dx, dw = rmsnorm_backward(dy_rows, x_rows, weight, rstd, compute_dx, compute_dw)
        return (dx.view(ctx.x_shape) if compute_dx else None), (dw if compute_dw else None), None, None


def fused_rms_norm(
    x: Float[Tensor, "... N"], weight: Float[Tensor, "N"], eps: float = 1e-5, out_dtype: torch.dtype | None = None
) -> Float[Tensor, "... N"]:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` in x's dtype (or ``out_dtype``), through
    :class:`FusedRMSNormFunction`."""
    return FusedRMSNormFunction.apply(x, weight, eps, out_dtype)


class FusedRMSNorm(RMSNorm):
    """``cs336_basics.model.RMSNorm`` computed by the fused Triton kernels.

    Same constructor, ``eps``, parameter (``weight``) and state-dict keys, so it loads the plain module's
    weights; the output dtype is the input's, as there.

    ``autocast_output = True`` (off by default) writes the output in the autocast dtype while autocast is
    on, instead of float32 that the next autocast matmul would cast anyway: the same bf16 values reach
    it (one rounding of the float32 result either way), but the norm writes half the bytes, no cast
    kernel runs, and backward reads a bf16 output gradient. Only for norms whose every consumer is an
    autocast matmul, as in ``BasicsTransformerLM``.
    """

    autocast_output: bool = False

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return FusedRMSNormFunction.apply(x, self.weight, self.eps, self.output_dtype(x))

    def output_dtype(self, x: Tensor) -> torch.dtype | None:
        """The dtype the norm of ``x`` is written in: the autocast dtype under ``autocast_output``, else None (the
        input's)."""
        if self.autocast_output and torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return None


def use_fused_rmsnorm(model: nn.Module, enabled: bool = True, autocast_output: bool = False,
                      norm_class: type[FusedRMSNorm] = FusedRMSNorm) -> nn.Module:
    """Swap every ``RMSNorm`` in ``model`` (plain or fused) for a ``norm_class`` (:class:`FusedRMSNorm` or a
    subclass; ``enabled=False``: back to the plain one), in place.

    The new modules share the old ones' ``weight`` parameters (same tensors), so optimizers and state
    dicts keep working. ``autocast_output``: see :class:`FusedRMSNorm`. Returns ``model``.
    """
    target = norm_class if enabled else RMSNorm
    if isinstance(model, RMSNorm):
        raise TypeError(f"use_fused_rmsnorm swaps the norms inside a model; for a lone norm build a {target.__name__}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if enabled and type(child) is target:
                child.autocast_output = autocast_output
            elif isinstance(child, RMSNorm) and type(child) is not target:
                replacement = target(child.weight.shape[0], eps=child.eps, device="meta")
                replacement.weight = child.weight
                replacement.train(child.training)
                if enabled:
                    replacement.autocast_output = autocast_output
                setattr(parent, name, replacement)
    return model
