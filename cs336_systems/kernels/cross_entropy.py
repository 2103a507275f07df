"""Fused LM head + cross-entropy: the mean cross-entropy of ``hidden @ weight.T`` against ``targets``, with the
gradients of ``hidden`` and ``weight``, computed a chunk of tokens at a time so that the ``(N, V)`` logits never
exist.

Math. For a token with hidden state ``h`` (d,), logits ``z = W h`` (V,), target ``t``, and ``n`` counted tokens
(those whose target is not ``ignore_index``)::

    lse   = log sum_j exp(z_j)                              (float32, max-shifted)
    loss  = sum over counted tokens of (lse - z_t), / n
    dz_j  = (softmax(z)_j - [j == t]) / n = (exp(z_j - lse) - [j == t]) / n     (0 for an ignored token)
    dH    = dZ W         (N, d)
    dW    = dZ^T H       (V, d), a sum over tokens

The loss is the last node of the graph: its input gradients depend on what follows only through the scalar
``grad_output``, which multiplies them all. So the forward computes the loss, dH and dW together, and the backward
only scales them by it (one elementwise pass each; reading the scalar to skip the pass when it is 1 would
synchronise the host with the device on every step). The scaling rounds a 16-bit dH or dW a second time when the
scalar is not a power of two.

For each chunk of ``C`` tokens (rows of H):

1. ``Z_c = H_c W^T``: a PyTorch matmul (cuBLAS) in ``compute_dtype``, into one reused ``(C, V)`` buffer.
2. One Triton kernel, a program per row: a pass over the row in tiles of ``BLOCK_V`` columns keeps the running
   max and per-lane sums rescaled to it (an online logsumexp in float32); the row's loss is ``lse - z_t``; a
   second pass overwrites the logits in place with ``dz`` in the buffer's dtype.
3. ``dH_c = dZ_c W``, written into dH; ``dW += dZ_c^T H_c``, accumulated in float32 (on CUDA one cuBLAS call with
   a float32 output, ``torch.addmm(..., out_dtype=torch.float32)``; elsewhere the operands are upcast).

Memory at peak, with ``s`` the bytes of an element of ``compute_dtype`` (2 for bf16):

* fused: the chunk's logits ``C V s``; the float32 dW accumulator ``V d 4`` (itself the returned dW when
  ``weight`` is float32; for a 16-bit weight, cast once at the end, both held for that moment); dH ``N d``; W cast
  to ``compute_dtype`` (``V d s``, only when its dtype differs, as autocast's own cast would); a float32 loss per
  token. dH and dW live on until the backward hands them over.
* unfused ``F.cross_entropy(H @ W.T, targets)`` under bf16 autocast: the logits ``N V 2`` (held by the caller)
  and their float32 ``log_softmax`` ``N V 4`` (saved for backward); in backward, the gradient that ``nll_loss``
  hands to the log-softmax and the logits' own, both float32 (``N V 4`` each), then the latter's bf16 cast
  (``N V 2``): about 14 bytes a logit at the peak, besides the same dH and dW. At N = 16384 tokens and
  V = 151936: 35 GB, against at most a 1 GiB chunk here.

Chunk rule (:func:`default_chunk_tokens`): the most rows whose logits fit both in ``CHUNK_LOGITS_BYTES`` (1 GiB)
and in the size of the float32 dW accumulator (``C V s <= V d 4``, so ``C <= 4 d / s``: the chunk never outweighs
what the op holds anyway), rounded down to a multiple of 128 above 128 (whole matmul tiles); at least 1, at
most N.

Where the per-row step (2.) runs: CUDA tensors, the Triton kernel; CPU tensors with ``TRITON_INTERPRET=1`` set
before this module is imported, the same kernel in Triton's interpreter; CPU tensors otherwise, a PyTorch version
of the step (same chunks, same in-place overwrite), so that the op works, slowly, without a GPU.

``torch.compile``: the forward is the custom op ``cs336_systems::fused_linear_cross_entropy`` (``torch.library``,
with a fake implementation and an autograd formula), opaque to the compiler, so ``fullgraph=True`` traces through
it. Custom ops do not see autocast: :func:`fused_linear_cross_entropy` picks ``compute_dtype`` (the autocast dtype
when autocast is on) and passes it in, and the op runs with autocast off.

Targets outside ``[0, V)`` other than ``ignore_index`` are not checked on the host, which would synchronise with
the device: their rows get a NaN loss and NaN gradients, so the mean loss is NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from jaxtyping import Float, Int
from torch import Tensor, nn

from cs336_systems.kernels.launch import FLOAT_DTYPES, Kernel, aligned, define_operator, interpreting

SUPPORTED_DTYPES = FLOAT_DTYPES

CHUNK_LOGITS_BYTES = 1 << 30
"""The most bytes of logits one chunk may hold (see :func:`default_chunk_tokens`)."""

CHUNK_ROWS_MULTIPLE = 128
"""Chunks above this many rows are a multiple of it: whole tiles for the matmuls."""

MAX_BLOCK_V = 4096
"""The widest column tile of the row kernel (elements). On a GPU, 16 elements a thread at 8 warps: two 128-bit
loads per tile in 16-bit dtypes. Not tuned on a GPU yet. Tests lower it to cut rows into several ragged tiles."""


# ---------------------------------------------------------------------------------------------------
# Row kernel: loss per row, and the logits overwritten by their gradient
# ---------------------------------------------------------------------------------------------------


@triton.jit
def cross_entropy_rows_kernel(
    Logits,  # in: a chunk's logits (n_rows, n_cols), unit column stride; out: overwritten by dz
    Targets,  # target per row (n_rows,), int64
    Loss,  # out: loss per row (n_rows,), float32; 0 for an ignored row
    Scale,  # 1 / number of counted tokens in the whole batch, float32 (1,)
    stride_row,
    n_cols,
    ignore_index,
    BLOCK_V: tl.constexpr,  # columns per tile
    WRITE_GRAD: tl.constexpr,  # overwrite the logits with dz (off when no gradient is wanted)
):
    row = tl.program_id(0).to(tl.int64)  # row * stride may exceed 2^31
    Row = Logits + row * stride_row
    target = tl.load(Targets + row)
    counted = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    cols = tl.arange(0, BLOCK_V)

    # Pass 1: running max m (one reduction a tile) and per-lane sums of exp(x - m), rescaled when m grows.
    # Every tile holds at least one real column, so m is finite from the first tile on (for finite logits).
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        x = tl.load(Row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)  # masked lanes add exp(-inf) = 0
        m = m_new
    lse = m + tl.log(tl.sum(s, axis=0))

    target_logit = tl.load(Row + target, mask=counted & in_range, other=0.0).to(tl.float32)
    loss = tl.where(in_range, lse - target_logit, float("nan"))
    tl.store(Loss + row, tl.where(counted, loss, 0.0))

    # Pass 2: dz = (exp(x - lse) - onehot) * scale, with scale 0 for an ignored row and NaN for a bad target.
    if WRITE_GRAD:
        scale = tl.where(in_range, tl.load(Scale), float("nan"))
        scale = tl.where(counted, scale, 0.0)
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            x = tl.load(Row + offs, mask=mask, other=0.0).to(tl.float32)
            dz = (tl.exp(x - lse) - tl.where(offs == target, 1.0, 0.0)) * scale
            tl.store(Row + offs, dz.to(Logits.dtype.element_ty), mask=mask)


def _block_v(n_cols: int) -> tuple[int, int]:
    """(columns per tile, warps) for rows of ``n_cols``."""
    block_v = min(triton.next_power_of_2(n_cols), MAX_BLOCK_V)
    return block_v, max(1, min(8, block_v // 512))


def _rows_config(n_cols: int) -> triton.Config:
    block_v, num_warps = _block_v(n_cols)
    return triton.Config({"BLOCK_V": block_v}, num_warps=num_warps)


_ROWS_KERNEL = Kernel(cross_entropy_rows_kernel)


def _rows_step_triton(logits: Tensor, targets: Tensor, row_loss: Tensor, scale: Tensor, ignore_index: int,
                      write_grad: bool) -> None:
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    # MAX_BLOCK_V: the tile rule's bound, which tests lower.
    key = (logits.dtype, targets.dtype, logits.stride(0), n_cols, ignore_index, aligned(logits, targets, row_loss),
           write_grad, MAX_BLOCK_V)
    args = (logits, targets, row_loss, scale, logits.stride(0), n_cols, ignore_index)
    _ROWS_KERNEL(key, lambda tiles: (n_rows,), args, {"WRITE_GRAD": write_grad}, lambda: _rows_config(n_cols))


def _rows_step_torch(logits: Tensor, targets: Tensor, row_loss: Tensor, scale: Tensor, ignore_index: int,
                     write_grad: bool) -> None:
    """The row kernel's job in PyTorch (for CPU tensors without the interpreter): same outputs, in float32."""
    n_rows, n_cols = logits.shape
    counted = targets != ignore_index
    in_range = (targets >= 0) & (targets < n_cols)
    safe_targets = torch.where(in_range, targets, 0)
    x = logits.float()
    lse = torch.logsumexp(x, dim=1)  # (n_rows,)
    loss = lse - x.gather(1, safe_targets[:, None]).squeeze(1)
    loss = torch.where(in_range, loss, float("nan"))
    row_loss.copy_(torch.where(counted, loss, 0.0))
    if write_grad:
        row_scale = torch.where(counted, torch.where(in_range, scale, float("nan")), 0.0)  # (n_rows,)
        dz = torch.exp(x - lse[:, None])
        dz[torch.arange(n_rows, device=logits.device), safe_targets] -= in_range.float()
        logits.copy_(dz * row_scale[:, None])


def _rows_step(logits: Tensor, *args) -> None:
    if logits.device.type == "cuda" or (logits.device.type == "cpu" and interpreting()):
        _rows_step_triton(logits, *args)
    else:
        _rows_step_torch(logits, *args)


# ---------------------------------------------------------------------------------------------------
# The chunked forward: loss, dH and dW
# ---------------------------------------------------------------------------------------------------


def default_chunk_tokens(n_tokens: int, vocab_size: int, d_model: int, compute_dtype: torch.dtype) -> int:
    """Tokens per chunk: the chunk's logits fit in ``CHUNK_LOGITS_BYTES`` and in the float32 dW accumulator's size
    (``chunk * V * s <= V * d * 4``), rounded down to a multiple of ``CHUNK_ROWS_MULTIPLE`` above it; in [1, N]."""
    element_size = torch.empty((), dtype=compute_dtype).element_size()
    rows = min(CHUNK_LOGITS_BYTES // (vocab_size * element_size), 4 * d_model // element_size)
    if rows > CHUNK_ROWS_MULTIPLE:
        rows -= rows % CHUNK_ROWS_MULTIPLE
    return max(1, min(rows, n_tokens))


def _accumulate_weight_grad(dw: Float[Tensor, "V d"], dz: Float[Tensor, "C V"], h: Float[Tensor, "C d"]) -> None:
    """``dw += dz^T h`` with the products summed and added in float32 (``dw`` is float32)."""
    if dz.dtype == torch.float32:
        dw.addmm_(dz.t(), h)
    elif dw.device.type == "cuda":
        # fp16/bf16 operands, float32 output and addend: one cuBLAS call, no rounding to 16 bits.
        torch.addmm(dw, dz.t(), h, out_dtype=torch.float32, out=dw)
    else:
        dw.addmm_(dz.t().float(), h.float())  # products of 16-bit values are exact in float32


def linear_cross_entropy_forward(
    hidden: Float[Tensor, "N d"], weight: Float[Tensor, "V d"], targets: Int[Tensor, "N"], chunk_tokens: int,
    compute_dtype: torch.dtype, ignore_index: int, need_dh: bool, need_dw: bool,
) -> tuple[Float[Tensor, ""], Float[Tensor, "N d"], Float[Tensor, "V d"]]:
    """The mean loss (float32), dH (hidden's dtype) and dW (weight's dtype), chunk by chunk; an empty tensor
    stands for a gradient not asked for. Inputs as checked by :func:`fused_linear_cross_entropy`."""
    n_tokens, d_model = hidden.shape
    vocab_size = weight.shape[0]
    device = hidden.device
    targets = targets.contiguous()  # the row kernel reads one target a row at unit stride
    with torch.autocast(device.type, enabled=False):  # the matmuls must run in compute_dtype, whatever the caller's
        w = weight.to(compute_dtype)  # (V, d); no copy when the dtypes agree
        n_counted = (targets != ignore_index).sum()
        # 1/N stays on the device (no synchronisation); N clamped at 1: with no counted token every dz row is 0.
        scale = n_counted.clamp(min=1).to(torch.float32).reciprocal().reshape(1)
        # The row kernel writes the unscaled dz = softmax - onehot (entries in [-1, 1]); 1/N is applied to dH and dW
        # afterwards, in their precision: scaled first, dz's entries (~1/(V N)) would underflow in float16.
        unit = torch.ones(1, dtype=torch.float32, device=device)
        row_loss = torch.empty(n_tokens, dtype=torch.float32, device=device)
        dh = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_dw else weight.new_empty(0)
        logits_buffer = torch.empty(min(chunk_tokens, n_tokens), vocab_size, dtype=compute_dtype, device=device)
        for start in range(0, n_tokens, chunk_tokens):
            end = min(start + chunk_tokens, n_tokens)
            h = hidden[start:end].to(compute_dtype)  # (C, d)
            z = logits_buffer[: end - start]  # (C, V), contiguous
            torch.mm(h, w.t(), out=z)
            _rows_step(z, targets[start:end], row_loss[start:end], unit, ignore_index, need_dh or need_dw)
            if need_dh:
                if dh.dtype == compute_dtype:
                    torch.mm(z, w, out=dh[start:end])
                    dh[start:end].mul_(scale)
                else:
                    dh[start:end] = (z @ w).to(dh.dtype) * scale
            if need_dw:
                _accumulate_weight_grad(dw, z, h)
        loss = row_loss.sum() / n_counted  # NaN when no token counts, as F.cross_entropy
        if need_dw:
            dw = dw.mul_(scale).to(weight.dtype)
        return loss, dh, dw


# ---------------------------------------------------------------------------------------------------
# The operator, its shapes and its autograd formula. Opaque to torch.compile: Inductor calls it as it is, so the
# chunk loop keeps its one reused logits buffer.
# ---------------------------------------------------------------------------------------------------


def _forward_op(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int, compute_dtype: torch.dtype,
    ignore_index: int, need_dh: bool, need_dw: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return linear_cross_entropy_forward(hidden, weight, targets, chunk_tokens, compute_dtype, ignore_index,
                                        need_dh, need_dw)


def _forward_shapes(hidden, weight, targets, chunk_tokens, compute_dtype, ignore_index, need_dh, need_dw):
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape if need_dh else (0,)),
            weight.new_empty(weight.shape if need_dw else (0,)))


def _setup_context(ctx, inputs, output) -> None:
    _, dh, dw = output
    ctx.mark_non_differentiable(dh, dw)
    ctx.save_for_backward(dh, dw)


def _backward(ctx, grad_loss: Tensor, _grad_dh, _grad_dw):
    dh, dw = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[:2]
    dh, dw = dh * grad_loss.to(dh.dtype), dw * grad_loss.to(dw.dtype)  # empty when not asked for
    return (dh if need_dh else None), (dw if need_dw else None), None, None, None, None, None, None


define_operator("cs336_systems::fused_linear_cross_entropy", _forward_op, traceable=False, fake=_forward_shapes,
                backward=_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------
# Functional entry point, module
# ---------------------------------------------------------------------------------------------------


def check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, compute_dtype: torch.dtype) -> None:
    """Raise a clear error for inputs the op does not take."""
    if weight.dim() != 2:
        raise ValueError(f"the weight must be (vocab_size, d_model), got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"the last dimension of hidden must be the weight's d_model: hidden has shape "
                         f"{tuple(hidden.shape)}, the weight {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("the vocabulary is empty (the weight has 0 rows)")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have hidden's shape without its last dimension, "
                         f"{tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    if targets.dtype != torch.int64:
        raise TypeError(f"targets must be int64 class indices, got {targets.dtype}")
    for name, dtype in (("hidden", hidden.dtype), ("weight", weight.dtype), ("compute_dtype", compute_dtype)):
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"unsupported dtype {dtype} for {name}: float16, bfloat16 or float32")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(f"hidden, weight and targets must be on one device, got {hidden.device}, {weight.device} "
                         f"and {targets.device}")


def fused_linear_cross_entropy(
    hidden: Float[Tensor, "... d"],
    weight: Float[Tensor, "V d"],
    targets: Int[Tensor, "..."],
    *,
    chunk_tokens: int | None = None,
    compute_dtype: torch.dtype | None = None,
    ignore_index: int = -100,
) -> Float[Tensor, ""]:
    """``F.cross_entropy(hidden @ weight.T, targets, ignore_index=ignore_index)`` (mean over the counted tokens,
    float32) without holding the logits; gradients for ``hidden`` (its dtype) and ``weight`` (its dtype).

    ``chunk_tokens``: tokens per chunk (default :func:`default_chunk_tokens`). ``compute_dtype``: the dtype of
    the matmuls and of the chunk's logits and their gradient; by default the autocast dtype when autocast is on
    for hidden's device, else hidden's dtype. CUDA tensors, or CPU tensors (the Triton interpreter under
    ``TRITON_INTERPRET=1``, otherwise a PyTorch row step); see the module docstring.
    """
    if compute_dtype is None:
        device_type = hidden.device.type
        autocast = torch.is_autocast_enabled(device_type)
        compute_dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
    check_inputs(hidden, weight, targets, compute_dtype)
    d_model = weight.shape[1]
    hidden_rows = hidden.reshape(-1, d_model)
    targets_flat = targets.reshape(-1)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(hidden_rows.shape[0], weight.shape[0], d_model, compute_dtype)
    elif chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    grad = torch.is_grad_enabled()
    loss, _, _ = torch.ops.cs336_systems.fused_linear_cross_entropy(
        hidden_rows, weight, targets_flat, chunk_tokens, compute_dtype, ignore_index,
        grad and hidden.requires_grad, grad and weight.requires_grad,
    )
    return loss


class FusedLinearCrossEntropy(nn.Module):
    """``F.cross_entropy(hidden @ weight.T, targets)`` by :func:`fused_linear_cross_entropy`; holds no parameters
    (pass the LM head's weight), only the options."""

    def __init__(self, chunk_tokens: int | None = None, compute_dtype: torch.dtype | None = None,
                 ignore_index: int = -100):
        super().__init__()
        self.chunk_tokens, self.compute_dtype, self.ignore_index = chunk_tokens, compute_dtype, ignore_index

    def forward(self, hidden: Float[Tensor, "... d"], weight: Float[Tensor, "V d"],
                targets: Int[Tensor, "..."]) -> Float[Tensor, ""]:
        return fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens=self.chunk_tokens,
                                          compute_dtype=self.compute_dtype, ignore_index=self.ignore_index)

    def extra_repr(self) -> str:
        return f"chunk_tokens={self.chunk_tokens}, compute_dtype={self.compute_dtype}, ignore_index={self.ignore_index}"
