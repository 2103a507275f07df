"""The residual add fused into the RMSNorm that reads its sum: one kernel writes ``s = x + residual`` and
``y = rmsnorm(s) * g``, and one kernel computes the gradient of both inputs and of the gain.

A pre-norm block ``h = x + attn(norm1(x)); out = h + ffn(norm2(h))`` adds each residual in one kernel and reads
the sum back in the next norm. Fused, the sum is written once and never read back by the norm; the backward
adds the residual stream's gradient while it writes the norm's input gradient, instead of in an add of its own.

For a row of ``N`` features, ``x`` and ``r`` the two inputs, ``g`` the gain::

    s   = x + r                                        (rounded to x's dtype, as a separate add would be)
    q   = 1 / sqrt(mean(s^2) + eps)                    (float32, saved per row for backward)
    s^  = s * q
    y   = s^ * g

Backward. The output ``y`` receives ``dy``; ``s`` itself is also used elsewhere (the residual stream goes on
past the norm), whose gradient ``ds`` arrives beside ``dy``. With ``h = dy * g`` (the gradient of ``s^``)::

    dq/ds_j    = -q^3 s_j / N                          (q = (mean(s^2) + eps)^(-1/2))
    ds^_i/ds_j = q [i = j] + s_i dq/ds_j = q ([i = j] - s^_i s^_j / N)
    dnorm_j    = sum_i h_i ds^_i/ds_j = q (h_j - s^_j mean(h * s^))

so the total gradient of ``s`` is ``ds + dnorm``, and since ``s = x + r`` has Jacobian one in each input::

    dx = dr = ds + q (h - s^ mean(h * s^))             (per row; one tensor serves both inputs)
    dg      = sum over rows of dy * s^                 (the same per-program float32 partials as the RMSNorm)

The kernels are the RMSNorm's (``cs336_systems.kernels.rmsnorm``) with their residual switches on: the forward's
``ADD_RESIDUAL`` (adds the residual tile, stores the rounded sum, normalises it) and the backward's ``ADD_DS``
(adds ``ds`` to the input gradient before it is stored). Saved for backward: ``s`` (an output, so nothing extra
is kept alive), the gain and ``1 / rms``; ``x`` and ``r`` are not needed.

Not wired into the model: whether it pays against ``torch.compile``'s own fusion of the add with the plain norm
wants a measurement on a GPU first.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from cs336_systems.kernels.launch import define_operator, new_output, unit_last_stride
from cs336_systems.kernels.rmsnorm import check_inputs, launch_rmsnorm_forward, rmsnorm_backward

# ---------------------------------------------------------------------------------------------------
# Launch wrappers: (n_rows, N) tensors with a unit column stride, checked by the caller
# ---------------------------------------------------------------------------------------------------


def add_rmsnorm_forward(
    x: Float[Tensor, "n_rows N"], residual: Float[Tensor, "n_rows N"], weight: Float[Tensor, "N"], eps: float,
    traced: bool = False, out_shape: torch.Size | None = None,
) -> tuple[Float[Tensor, "... N"], Float[Tensor, "... N"], Float[Tensor, "n_rows"]]:
    """``s = x + residual`` and ``y = rmsnorm(s) * weight`` (x's dtype, contiguous, of ``out_shape``: by default
    x's) and ``1 / rms`` per row (float32)."""
    out_shape = x.shape if out_shape is None else out_shape
    s = new_output(out_shape, x.dtype, x.device)
    y = new_output(out_shape, x.dtype, x.device)
    rstd = new_output(x.shape[:1], torch.float32, x.device)
    launch_rmsnorm_forward(x, weight, y.view(x.shape), rstd, eps, traced, residual=residual, s=s.view(x.shape))
    return s, y, rstd


def add_rmsnorm_backward(
    dy: Float[Tensor, "n_rows N"], ds: Float[Tensor, "n_rows N"], s: Float[Tensor, "n_rows N"],
    weight: Float[Tensor, "N"], rstd: Float[Tensor, "n_rows"], compute_dx: bool = True, compute_dw: bool = True,
    traced: bool = False,
) -> tuple[Float[Tensor, "n_rows N"] | None, Float[Tensor, "N"] | None]:
    """The gradient of both inputs, ``ds + dnorm(dy)`` (s's dtype, contiguous), and of the gain (its dtype);
    None for one not asked for."""
    return rmsnorm_backward(dy, s, weight, rstd, compute_dx, compute_dw, traced=traced, ds=ds)


# ---------------------------------------------------------------------------------------------------
# Operators (see rmsnorm.py's): traced by torch.compile into its graph; triton_ops on a GPU
# ---------------------------------------------------------------------------------------------------


def _forward_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return add_rmsnorm_forward(x, residual, weight, eps, traced=True)


def _forward_shapes(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(x.shape[:1], dtype=torch.float32)


def _backward_op(dy: Tensor, ds: Tensor, s: Tensor, weight: Tensor, rstd: Tensor, compute_dx: bool,
                 compute_dw: bool) -> tuple[Tensor, Tensor]:
    dx, dw = add_rmsnorm_backward(dy, ds, s, weight, rstd, compute_dx, compute_dw, traced=True)
    # An operator returns tensors, never None: empty ones stand for gradients not asked for.
    return (dx if dx is not None else s.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


def _backward_shapes(dy: Tensor, ds: Tensor, s: Tensor, weight: Tensor, rstd: Tensor, compute_dx: bool,
                     compute_dw: bool) -> tuple[Tensor, Tensor]:
    return s.new_empty(s.shape if compute_dx else (0,)), weight.new_empty(weight.shape if compute_dw else (0,))


define_operator("cs336_systems::add_rmsnorm_forward", _forward_op, traceable=True, fake=_forward_shapes)
define_operator("cs336_systems::add_rmsnorm_backward", _backward_op, traceable=True, fake=_backward_shapes)

# ---------------------------------------------------------------------------------------------------
# Autograd function and functional entry point
# ---------------------------------------------------------------------------------------------------


def check_add_inputs(x: Tensor, residual: Tensor, weight: Tensor) -> None:
    """Raise a clear error for inputs the kernels do not take (the RMSNorm's checks, and a residual like x)."""
    if residual.shape != x.shape:
        raise ValueError(f"x and residual must have one shape, got {tuple(x.shape)} and {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"x and residual must have one dtype, got {x.dtype} and {residual.dtype}")
    if residual.device != x.device:
        raise ValueError(f"x and residual must be on one device, got {x.device} and {residual.device}")
    check_inputs(x, weight)


class FusedAddRMSNormFunction(torch.autograd.Function):
    """``FusedAddRMSNormFunction.apply(x, residual, weight, eps) == (s, RMSNorm(s))`` with ``s = x + residual``
    and gain ``weight``, by Triton kernels; both outputs in x's dtype, gradients in the inputs' dtypes."""

    @staticmethod
    def forward(
        ctx, x: Float[Tensor, "... N"], residual: Float[Tensor, "... N"], weight: Float[Tensor, "N"], eps: float
    ) -> tuple[Float[Tensor, "... N"], Float[Tensor, "... N"]]:
        check_add_inputs(x, residual, weight)
        n_cols = x.shape[-1]
        x_rows = unit_last_stride(x.reshape(-1, n_cols))  # views when the layouts allow
        residual_rows = unit_last_stride(residual.reshape(-1, n_cols))
        weight = unit_last_stride(weight)
        if torch.compiler.is_compiling():
            s, y, rstd = torch.ops.cs336_systems.add_rmsnorm_forward(x_rows, residual_rows, weight, eps)
            s, y = s.view(x.shape), y.view(x.shape)
        else:
            # Allocated in x's shape rather than viewed as it: the outputs are no views, so that the caller may
            # change y in place (s is saved: changing it in place fails in backward, as it must).
            s, y, rstd = add_rmsnorm_forward(x_rows, residual_rows, weight, eps, out_shape=x.shape)
        ctx.save_for_backward(s, weight, rstd)
        return s, y

    @staticmethod
    def backward(ctx, ds: Float[Tensor, "... N"], dy: Float[Tensor, "... N"]):
        s, weight, rstd = ctx.saved_tensors
        x_shape, s = s.shape, s.view(-1, s.shape[-1])
        compute_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        compute_dw = ctx.needs_input_grad[2]
        n_cols = s.shape[-1]
        # Any layout, including the all-stride-0 one that .sum().backward() sends.
        dy_rows = unit_last_stride(dy.reshape(-1, n_cols))
        ds_rows = unit_last_stride(ds.reshape(-1, n_cols))
        if torch.compiler.is_compiling():
            dx, dw = torch.ops.cs336_systems.add_rmsnorm_backward(dy_rows, ds_rows, s, weight, rstd, compute_dx,
                                                                  compute_dw)
        else:
            dx, dw = add_rmsnorm_backward(dy_rows, ds_rows, s, weight, rstd, compute_dx, compute_dw)
        dx = dx.view(x_shape) if compute_dx else None
        return (dx if ctx.needs_input_grad[0] else None), (dx if ctx.needs_input_grad[1] else None), \
            (dw if compute_dw else None), None


def fused_add_rmsnorm(
    x: Float[Tensor, "... N"], residual: Float[Tensor, "... N"], weight: Float[Tensor, "N"], eps: float = 1e-5
) -> tuple[Float[Tensor, "... N"], Float[Tensor, "... N"]]:
    """``(s, y)``: ``s = x + residual`` and ``y = s / sqrt(mean(s^2, -1) + eps) * weight``, both in x's dtype,
    through :class:`FusedAddRMSNormFunction`."""
    return FusedAddRMSNormFunction.apply(x, residual, weight, eps)
