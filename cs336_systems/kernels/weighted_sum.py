"""The assignment's Triton warm-up: ``y = (x * w).sum(-1)`` with a forward and a
backward kernel and a ``torch.autograd.Function`` around them.

For ``x`` of shape ``(..., D)`` (viewed as ``(n_rows, D)``) and ``w`` of shape ``(D,)``::

    forward:   y[r] = sum_d x[r, d] w[d]
    backward:  grad_x[r, d] = grad_y[r] w[d]                 (an outer product)
               grad_w[d]    = sum_r grad_y[r] x[r, d]        (a reduction over rows)

Each program owns ``ROWS_TILE`` rows and walks the ``D`` dimension in tiles of ``D_TILE``. The
backward program writes its rows of ``grad_x`` and, for ``grad_w``, one partial sum over its rows;
the partial sums, shape ``(n_row_tiles, D)``, are added up by PyTorch afterwards (no atomics, so the
result does not depend on the order programs run in).

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before this module is
imported). Each kernel launches through ``cs336_systems.kernels.launch.Kernel`` with fixed tiles, chosen once per
key of what determines the launch (dtypes, strides, ``D``, alignment).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from jaxtyping import Float
from torch import Tensor

from cs336_systems.kernels.launch import FLOAT_DTYPES, Kernel, aligned, check_device

ROWS_TILE = 32
MAX_D_TILE = 128


# Row counts vary from call to call: no variant compiled per value (Triton otherwise specialises integers on
# divisibility by 16 and on equality to 1).
@triton.jit(do_not_specialize=["n_rows"])
def weighted_sum_fwd_kernel(
    X,  # input (n_rows, D)
    W,  # weights (D,)
    Y,  # output (n_rows,)
    stride_x_row, stride_x_col, stride_w, stride_y,
    n_rows, D,
    ROWS_TILE: tl.constexpr,
    D_TILE: tl.constexpr,
):
    row_tile = tl.program_id(0)
    X_block = tl.make_block_ptr(X, shape=(n_rows, D), strides=(stride_x_row, stride_x_col),
                                offsets=(row_tile * ROWS_TILE, 0), block_shape=(ROWS_TILE, D_TILE), order=(1, 0))
    W_block = tl.make_block_ptr(W, shape=(D,), strides=(stride_w,), offsets=(0,), block_shape=(D_TILE,), order=(0,))
    acc = tl.zeros([ROWS_TILE], dtype=tl.float32)
    for _ in range(tl.cdiv(D, D_TILE)):
        x = tl.load(X_block, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        w = tl.load(W_block, boundary_check=(0,), padding_option="zero").to(tl.float32)
        acc += tl.sum(x * w[None, :], axis=1)
        X_block = tl.advance(X_block, (0, D_TILE))
        W_block = tl.advance(W_block, (D_TILE,))
    Y_block = tl.make_block_ptr(Y, shape=(n_rows,), strides=(stride_y,), offsets=(row_tile * ROWS_TILE,),
                                block_shape=(ROWS_TILE,), order=(0,))
    tl.store(Y_block, acc.to(Y.dtype.element_ty), boundary_check=(0,))


@triton.jit(do_not_specialize=["n_rows"])
def weighted_sum_bwd_kernel(
    X,  # input (n_rows, D)
    W,  # weights (D,)
    GradY,  # upstream gradient (n_rows,)
    GradX,  # output (n_rows, D)
    PartialGradW,  # output: per row tile, the sum over its rows of grad_y * x, float32 (n_row_tiles, D)
    stride_x_row, stride_x_col, stride_w, stride_gy,
    stride_gx_row, stride_gx_col, stride_pgw_row,
    n_rows, D,
    ROWS_TILE: tl.constexpr,
    D_TILE: tl.constexpr,
):
    row_tile = tl.program_id(0)
    n_row_tiles = tl.num_programs(0)
    GradY_block = tl.make_block_ptr(GradY, shape=(n_rows,), strides=(stride_gy,), offsets=(row_tile * ROWS_TILE,),
                                    block_shape=(ROWS_TILE,), order=(0,))
    grad_y = tl.load(GradY_block, boundary_check=(0,), padding_option="zero").to(tl.float32)  # (ROWS_TILE,)
    X_block = tl.make_block_ptr(X, shape=(n_rows, D), strides=(stride_x_row, stride_x_col),
                                offsets=(row_tile * ROWS_TILE, 0), block_shape=(ROWS_TILE, D_TILE), order=(1, 0))
    W_block = tl.make_block_ptr(W, shape=(D,), strides=(stride_w,), offsets=(0,), block_shape=(D_TILE,), order=(0,))
    GradX_block = tl.make_block_ptr(GradX, shape=(n_rows, D), strides=(stride_gx_row, stride_gx_col),
                                    offsets=(row_tile * ROWS_TILE, 0), block_shape=(ROWS_TILE, D_TILE), order=(1, 0))
    PartialGradW_block = tl.make_block_ptr(PartialGradW, shape=(n_row_tiles, D), strides=(stride_pgw_row, 1),
                                           offsets=(row_tile, 0), block_shape=(1, D_TILE), order=(1, 0))
    for _ in range(tl.cdiv(D, D_TILE)):
        w = tl.load(W_block, boundary_check=(0,), padding_option="zero").to(tl.float32)  # (D_TILE,)
        grad_x = grad_y[:, None] * w[None, :]  # (ROWS_TILE, D_TILE)
        tl.store(GradX_block, grad_x.to(GradX.dtype.element_ty), boundary_check=(0, 1))
        # Rows past n_rows load as zeros (x and grad_y), so they add nothing to the partial sum.
        x = tl.load(X_block, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        partial = tl.sum(x * grad_y[:, None], axis=0, keep_dims=True)  # (1, D_TILE)
        tl.store(PartialGradW_block, partial, boundary_check=(1,))
        X_block = tl.advance(X_block, (0, D_TILE))
        W_block = tl.advance(W_block, (D_TILE,))
        GradX_block = tl.advance(GradX_block, (0, D_TILE))
        PartialGradW_block = tl.advance(PartialGradW_block, (0, D_TILE))


def _check_inputs(x: Tensor, weight: Tensor) -> None:
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"need x of shape (..., D) and weight of shape (D,), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on one device, got {x.device} and {weight.device}")
    if x.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"need float16, bfloat16 or float32 tensors, got {x.dtype} and {weight.dtype}")
    check_device(x, "the weighted-sum kernels", "cs336_systems.kernels.weighted_sum")


def _d_tile(D: int) -> int:
    return min(triton.next_power_of_2(D), MAX_D_TILE)


def _tiles(D: int) -> triton.Config:
    return triton.Config({"ROWS_TILE": ROWS_TILE, "D_TILE": _d_tile(D)}, num_warps=4)


def _row_tiles(tiles: dict[str, int], n_rows: int) -> tuple[int]:
    return (triton.cdiv(n_rows, tiles["ROWS_TILE"]),)


_FORWARD = Kernel(weighted_sum_fwd_kernel)
_BACKWARD = Kernel(weighted_sum_bwd_kernel)


class WeightedSumFunction(torch.autograd.Function):
    """``WeightedSumFunction.apply(x, weight) == (x * weight).sum(-1)``, computed by Triton kernels."""

    @staticmethod
    def forward(ctx, x: Float[Tensor, "... D"], weight: Float[Tensor, "D"]) -> Float[Tensor, "..."]:
        _check_inputs(x, weight)
        D, output_shape = x.shape[-1], x.shape[:-1]
        x_rows = x.reshape(-1, D)  # (n_rows, D), a view when x's layout allows
        n_rows = x_rows.shape[0]
        y = torch.empty(n_rows, dtype=x.dtype, device=x.device)
        strides = (x_rows.stride(0), x_rows.stride(1), weight.stride(0), y.stride(0))
        _FORWARD((x.dtype, weight.dtype, *strides, D, aligned(x_rows, weight)),
                 lambda tiles: _row_tiles(tiles, n_rows), (x_rows, weight, y, *strides, n_rows, D), {},
                 lambda: _tiles(D))
        ctx.save_for_backward(x_rows, weight)
        ctx.x_shape = x.shape
        return y.view(output_shape)

    @staticmethod
    def backward(ctx, grad_y: Float[Tensor, "..."]):
        x_rows, weight = ctx.saved_tensors
        n_rows, D = x_rows.shape
        grad_y = grad_y.reshape(-1)  # (n_rows,); any strides, including 0 from y.sum().backward()
        n_row_tiles = triton.cdiv(n_rows, ROWS_TILE)
        grad_x = torch.empty_like(x_rows, memory_format=torch.contiguous_format)
        partial_grad_w = torch.empty(n_row_tiles, D, dtype=torch.float32, device=x_rows.device)
        strides = (x_rows.stride(0), x_rows.stride(1), weight.stride(0), grad_y.stride(0),
                   grad_x.stride(0), grad_x.stride(1), partial_grad_w.stride(0))
        _BACKWARD((x_rows.dtype, weight.dtype, grad_y.dtype, *strides, D, aligned(x_rows, weight, grad_y)),
                  lambda tiles: _row_tiles(tiles, n_rows),
                  (x_rows, weight, grad_y, grad_x, partial_grad_w, *strides, n_rows, D), {}, lambda: _tiles(D))
        return grad_x.view(ctx.x_shape), partial_grad_w.sum(dim=0).to(weight.dtype)


def weighted_sum(x: Float[Tensor, "... D"], weight: Float[Tensor, "D"]) -> Float[Tensor, "..."]:
    """``(x * weight).sum(-1)`` through :class:`WeightedSumFunction`."""
    return WeightedSumFunction.apply(x, weight)
