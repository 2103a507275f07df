"""The residual add fused into the RMSNorm that reads its sum: one kernel writes ``s = x + residual`` and
``y = rmsnorm(s) * g``, and one kernel computes the gradient of both inputs and of the gain.

A pre-norm block ``h = x + attn(norm1(x)); out = h + ffn(norm2(h))`` adds each residual in one kernel and reads
the sum back in the next norm. Fused, the sum is written once and never read back by the norm; the backward
adds the residual stream's gradient while it writes the norm's input gradient, instead of in an add of its own.

For a row of ``N`` features, ``x`` and ``r`` the two inputs, ``g`` the gain::

    s   = x + r                                        (rounded to the two dtypes' promotion, as torch's add)
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

The inputs may differ in dtype, as in a block under autocast: a bf16 branch output added to a float32 residual
stream gives a float32 sum, and the norm's output may be written in another dtype (``out_dtype``: the autocast
dtype its matmul reads). :class:`FusedAddRMSNorm` is the module: ``norm(x)`` as ``FusedRMSNorm``, ``norm(x,
residual)`` the pair; :mod:`cs336_systems.train.residual_stream` builds the model's blocks on it (the
``fused_residual_norm`` part of a training step).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from cs336_systems.kernels.launch import define_operator, new_output, unit_last_stride
from cs336_systems.kernels.rmsnorm import (
    SUPPORTED_DTYPES,
    FusedRMSNorm,
    check_inputs,
    launch_rmsnorm_forward,
    rmsnorm_backward,
)

# ---------------------------------------------------------------------------------------------------
# Launch wrappers: (n_rows, N) tensors with a unit column stride, checked by the caller
# ---------------------------------------------------------------------------------------------------


def add_rmsnorm_forward(
    x: Float[Tensor, "n_rows N"], residual: Float[Tensor, "n_rows N"], weight: Float[Tensor, "N"], eps: float,
    out_dtype: torch.dtype | None = None, traced: bool = False, out_shape: torch.Size | None = None,
) -> tuple[Float[Tensor, "... N"], Float[Tensor, "... N"], Float[Tensor, "n_rows"]]:
    """``s = x + residual`` (the inputs' promoted dtype) and ``y = rmsnorm(s) * weight`` (``out_dtype``, by default
    s's), contiguous, of ``out_shape`` (by default x's), and ``1 / rms`` per row (float32)."""
    out_shape = x.shape if out_shape is None else out_shape
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    s = new_output(out_shape, sum_dtype, x.device)
    y = new_output(out_shape, out_dtype or sum_dtype, x.device)
    rstd = new_output(x.shape[:1], torch.float32, x.device)
    launch_rmsnorm_forward(x, weight, y.view(x.shape), rstd, eps, traced, residual=residual, s=s.view(x.shape))
    return s, y, rstd


def add_rmsnorm_backward(
    dy: Float[Tensor, "n_rows N"], ds: Float[Tensor, "n_rows N"] | None, s: Float[Tensor, "n_rows N"],
    weight: Float[Tensor, "N"], rstd: Float[Tensor, "n_rows"], compute_dx: bool = True, compute_dw: bool = True,
    traced: bool = False,
) -> tuple[Float[Tensor, "n_rows N"] | None, Float[Tensor, "N"] | None]:
    """The gradient of both inputs, ``ds + dnorm(dy)`` (s's dtype, contiguous; ``dnorm(dy)`` alone without ``ds``),
    and of the gain (its dtype); None for one not asked for."""
    return rmsnorm_backward(dy, s, weight, rstd, compute_dx, compute_dw, traced=traced, ds=ds)


# ---------------------------------------------------------------------------------------------------
# Operators (see rmsnorm.py's): traced by torch.compile into its graph; triton_ops on a GPU
# ---------------------------------------------------------------------------------------------------


def _forward_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype
                ) -> tuple[Tensor, Tensor, Tensor]:
    return add_rmsnorm_forward(x, residual, weight, eps, out_dtype, traced=True)


def _forward_shapes(x: Tensor, residual: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype
                    ) -> tuple[Tensor, Tensor, Tensor]:
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (x.new_empty(x.shape, dtype=sum_dtype), x.new_empty(x.shape, dtype=out_dtype),
            x.new_empty(x.shape[:1], dtype=torch.float32))


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
    """Raise a clear error for inputs the kernels do not take (the RMSNorm's checks, and a residual of x's shape on
    x's device; the dtypes may differ)."""
    if residual.shape != x.shape:
        raise ValueError(f"x and residual must have one shape, got {tuple(x.shape)} and {tuple(residual.shape)}")
    if residual.device != x.device:
        raise ValueError(f"x and residual must be on one device, got {x.device} and {residual.device}")
    check_inputs(x, weight)
    if residual.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {residual.dtype} for residual: the fused RMSNorm takes float16, bfloat16 "
                        "or float32")


class FusedAddRMSNormFunction(torch.autograd.Function):
    """``FusedAddRMSNormFunction.apply(x, residual, weight, eps, out_dtype=None) == (s, RMSNorm(s))`` with
    ``s = x + residual`` and gain ``weight``, by Triton kernels: ``s`` in the inputs' promoted dtype, the norm in
    ``out_dtype`` (by default s's); gradients in the inputs' dtypes. A gradient that does not arrive (the sum or the
    norm unused) is not replaced by zeros: without ``ds`` the backward is the plain RMSNorm's."""

    @staticmethod
    def forward(
        ctx, x: Float[Tensor, "... N"], residual: Float[Tensor, "... N"], weight: Float[Tensor, "N"], eps: float,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[Float[Tensor, "... N"], Float[Tensor, "... N"]]:
        check_add_inputs(x, residual, weight)
        if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"unsupported output dtype {out_dtype}: the fused RMSNorm writes float16, bfloat16 or "
                            "float32")
        n_cols = x.shape[-1]
        x_rows = unit_last_stride(x.reshape(-1, n_cols))  # views when the layouts allow
        residual_rows = unit_last_stride(residual.reshape(-1, n_cols))
        weight = unit_last_stride(weight)
        if torch.compiler.is_compiling():
            out_dtype = out_dtype or torch.promote_types(x.dtype, residual.dtype)
            s, y, rstd = torch.ops.cs336_systems.add_rmsnorm_forward(x_rows, residual_rows, weight, eps, out_dtype)
            s, y = s.view(x.shape), y.view(x.shape)
        else:
            # Allocated in x's shape rather than viewed as it: the outputs are no views, so that the caller may
            # change y in place (s is saved: changing it in place fails in backward, as it must).
            s, y, rstd = add_rmsnorm_forward(x_rows, residual_rows, weight, eps, out_dtype, out_shape=x.shape)
        ctx.save_for_backward(s, weight, rstd)
        ctx.input_dtypes = x.dtype, residual.dtype
        ctx.set_materialize_grads(False)
        return s, y

    @staticmethod
    def backward(ctx, ds: Float[Tensor, "... N"] | None, dy: Float[Tensor, "... N"] | None):
        s, weight, rstd = ctx.saved_tensors
        compute_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        compute_dw = ctx.needs_input_grad[2] and dy is not None
        if dy is None:  # only the sum was used: it hands its gradient to both inputs
            dx = ds
        else:
            dx, dw = _backward_rows(dy, ds, s, weight, rstd, compute_dx, compute_dw)
        grads = [None if dx is None or not needed else dx.to(dtype)
                 for needed, dtype in zip(ctx.needs_input_grad[:2], ctx.input_dtypes)]
        return *grads, (dw if compute_dw else None), None, None


def _backward_rows(dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor, rstd: Tensor, compute_dx: bool,
                   compute_dw: bool) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of both inputs (s's dtype, s's shape) and of the gain, for the gradients ``dy`` of the norm and
    ``ds`` of the sum (None: the plain RMSNorm's backward); through the operators while Dynamo traces."""
    n_cols = s.shape[-1]
    s_rows = s.view(-1, n_cols)
    # Any layout, including the all-stride-0 one that .sum().backward() sends.
    dy_rows = unit_last_stride(dy.reshape(-1, n_cols))
    ds_rows = None if ds is None else unit_last_stride(ds.reshape(-1, n_cols))
    if not torch.compiler.is_compiling():
        dx, dw = add_rmsnorm_backward(dy_rows, ds_rows, s_rows, weight, rstd, compute_dx, compute_dw)
    elif ds is None:
        dx, dw = torch.ops.cs336_systems.rmsnorm_backward(dy_rows, s_rows, weight, rstd, compute_dx, compute_dw)
    else:
        dx, dw = torch.ops.cs336_systems.add_rmsnorm_backward(dy_rows, ds_rows, s_rows, weight, rstd, compute_dx,
                                                              compute_dw)
    return (dx.view(s.shape) if compute_dx else None), dw


def fused_add_rmsnorm(
    x: Float[Tensor, "... N"], residual: Float[Tensor, "... N"], weight: Float[Tensor, "N"], eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
) -> tuple[Float[Tensor, "... N"], Float[Tensor, "... N"]]:
    """``(s, y)``: ``s = x + residual`` (the inputs' promoted dtype) and ``y = s / sqrt(mean(s^2, -1) + eps) *
    weight`` (``out_dtype``, by default s's), through :class:`FusedAddRMSNormFunction`."""
    return FusedAddRMSNormFunction.apply(x, residual, weight, eps, out_dtype)


class FusedAddRMSNorm(FusedRMSNorm):
    """:class:`FusedRMSNorm` that also takes the residual its input is added to: ``norm(x)`` is the norm of ``x``,
    ``norm(x, residual)`` the pair ``(x + residual, norm of the sum)`` from one kernel. Same parameter and state
    dict as ``cs336_basics.model.RMSNorm``; ``autocast_output`` as :class:`FusedRMSNorm`'s (the sum keeps the
    inputs' promoted dtype: it is the residual stream)."""

    def forward(
        self, x: Float[Tensor, "... d_model"], residual: Float[Tensor, "... d_model"] | None = None
    ) -> Float[Tensor, "... d_model"] | tuple[Float[Tensor, "... d_model"], Float[Tensor, "... d_model"]]:
        if residual is None:
            return super().forward(x)
        return FusedAddRMSNormFunction.apply(x, residual, self.weight, self.eps, self.output_dtype(x))
