"""Our FlashAttention-2 as one operator over kernel backends: the input checks, the choice of backend, the PyTorch
operators and the ``torch.autograd.Function``.

    O = FlashAttention2Triton.apply(Q, K, V, is_causal)       # or flash_attention(Q, K, V, is_causal)

Q is ``(batch, n_queries, d)`` and K, V are ``(batch, n_keys, d)``, or all four-dimensional
``(batch, heads, seq, d)``; any lengths (``n_queries != n_keys`` allowed, the causal rule being ``i >= j`` on
absolute indices), ``d`` in 16, 32, 48, 64, 80, 96, 128 (48, 80 and 96 held in two power-of-two column parts; other
multiples of 8 up to 128 zero-padded to the next of these: zero features change no score or output), dtype float16,
bfloat16 or float32. Inputs may be non-contiguous; a copy is made only when the last dimension is strided.

Backends. Each is a module of ``backends/`` that is a :class:`~cs336_systems.attention.backends.common.Backend`:
``supports(device, dtype, head_dim)`` (why it cannot run such inputs, or None), ``programs(part, Q, K)``,
``forward(Q, K, V, is_causal, sm_scale) -> (O, L)`` and ``backward(Q, K, V, O, L, dO, is_causal, sm_scale) ->
(dQ, dK, dV)``. A call goes op -> backend -> ``Kernel.launch`` -> kernel, and returns.

* ``backends/triton.py``: the portable Triton kernels (any CUDA GPU, every dtype, the CPU interpreter);
* ``backends/hopper.py``: the Gluon kernels for Hopper GPUs (float16/bfloat16), run when
  :data:`cs336_systems.attention.config.FLASH_CONFIG` says so (by default, where they can run, for calls of at
  least ``hopper_min_programs`` programs, as ``hopper.programs`` counts them).

The choice is resolved once per (configuration, device, dtype, head dim, part, shape class) and cached
(:func:`route`).

Host cost. Input checks run once, in the Function's forward. Eager calls go from the Function straight to the
backend (no operator dispatch). Under ``torch.compile`` (or a dispatch mode such as selective checkpointing) the
Function calls the same code through two operators, ``cs336_systems::flash_attention_forward`` and ``_backward``,
which Inductor calls as opaque kernels: no graph break, and CUDA graphs capture them.
"""

from __future__ import annotations

import functools
import math

import torch
from jaxtyping import Float
from torch import Tensor

from cs336_systems.attention.backends import common, hopper
from cs336_systems.attention.backends import triton as portable
from cs336_systems.attention.backends.common import Backend
from cs336_systems.attention.config import FLASH_CONFIG, FlashConfig
from cs336_systems.kernels.compat import dispatch_mode_active
from cs336_systems.kernels.launch import FLOAT_DTYPES, define_operator, unit_last_stride

SUPPORTED_HEAD_DIMS = common.KERNEL_HEAD_DIMS
"""The head dims every backend runs without padding."""
MAX_HEAD_DIM = max(SUPPORTED_HEAD_DIMS)


# ---------------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------------


def check_is_causal(is_causal: object) -> bool:
    """``is_causal`` itself when it is a Python ``bool``; else a ``TypeError`` naming the value. Any truthy
    value (``"no"``, a tensor) would otherwise silently mean True. A NumPy ``bool_`` is not a ``bool``: wrap it
    in ``bool(...)``."""
    if not isinstance(is_causal, bool):
        raise TypeError(
            f"is_causal must be True or False (a Python bool), got {is_causal!r} of type {type(is_causal).__name__}; "
            "pass bool(is_causal) to convert it"
        )
    return is_causal


def check_attention_inputs(Q: Tensor, K: Tensor, V: Tensor) -> None:
    """Raise a ``TypeError``/``ValueError`` naming the problem unless ``Q``, ``K``, ``V`` are valid inputs
    for the FlashAttention functions: tensors of shape ``(batch, seq, d)`` or ``(batch, heads, seq, d)``,
    on one device, of one floating dtype, with matching batch/head dims and ``d``, ``K``/``V`` of one
    length, and no empty sequence or head dimension."""
    for name, tensor in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() not in (3, 4):
            raise ValueError(
                f"{name} must have shape (batch, seq, d) or (batch, heads, seq, d), got shape {tuple(tensor.shape)}"
            )
    # Every check runs on every call: the shapes, device and dtype are read once.
    q_shape, k_shape, v_shape = Q.shape, K.shape, V.shape
    if not len(q_shape) == len(k_shape) == len(v_shape):
        raise ValueError(
            f"Q, K, V must have the same rank, got shapes {tuple(q_shape)}, {tuple(k_shape)}, {tuple(v_shape)}"
        )
    device, dtype = Q.device, Q.dtype
    if not device == K.device == V.device:
        raise ValueError(f"Q, K, V must be on one device, got {device}, {K.device}, {V.device}")
    if not dtype == K.dtype == V.dtype:
        raise TypeError(f"Q, K, V must have one dtype, got {dtype}, {K.dtype}, {V.dtype}")
    if not dtype.is_floating_point:
        raise TypeError(f"attention needs floating-point inputs, got {dtype}")
    if not q_shape == k_shape == v_shape:  # else the batch (and head) dims, d and the K/V lengths all match
        if not q_shape[:-2] == k_shape[:-2] == v_shape[:-2]:
            raise ValueError(
                "Q, K, V must have the same batch (and head) dimensions, got "
                f"{tuple(q_shape[:-2])}, {tuple(k_shape[:-2])}, {tuple(v_shape[:-2])}"
            )
        if not q_shape[-1] == k_shape[-1] == v_shape[-1]:
            raise ValueError(
                f"Q, K, V must have the same head dimension d, got {q_shape[-1]}, {k_shape[-1]}, {v_shape[-1]}"
            )
        if k_shape[-2] != v_shape[-2]:
            raise ValueError(f"K and V must have the same length, got {k_shape[-2]} and {v_shape[-2]}")
    if q_shape[-2] == 0 or k_shape[-2] == 0:
        raise ValueError(f"sequence lengths must be positive, got n_queries={q_shape[-2]}, n_keys={k_shape[-2]}")
    if q_shape[-1] == 0:
        raise ValueError("the head dimension d must be positive, got 0 (scores are scaled by 1/sqrt(d))")


def check_inputs(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool) -> None:
    """Raise a clear error for inputs our operator does not take."""
    check_is_causal(is_causal)
    check_attention_inputs(Q, K, V)
    if Q.device.type == "meta":
        raise ValueError("Q, K, V are meta tensors, which hold no data: the attention kernels run on CUDA tensors "
                         "(CPU tensors under TRITON_INTERPRET=1)")
    if Q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"unsupported dtype {Q.dtype}: the kernels take float16, bfloat16 or float32")
    shape = Q.shape
    if shape[-1] > MAX_HEAD_DIM or shape[-1] % 8:
        raise ValueError(
            f"unsupported head dimension d={shape[-1]}: the kernels run d in {SUPPORTED_HEAD_DIMS}, and other "
            f"multiples of 8 up to {MAX_HEAD_DIM} zero-padded to the next of those"
        )
    batch_heads = common.batch_heads(Q)
    if batch_heads > common.MAX_GRID_Y:  # several kernels' grids run over batch * heads in their second dimension
        raise ValueError(f"batch * heads = {batch_heads} exceeds the grid limit {common.MAX_GRID_Y}")


# ---------------------------------------------------------------------------------------------------
# The choice of backend
# ---------------------------------------------------------------------------------------------------

ROUTE_CACHE_SIZE = 256
"""Choices of backend kept: one per (configuration, device, dtype, head dim, part, shape class) seen."""


def choose_backend(config: FlashConfig, device: torch.device, dtype: torch.dtype, head_dim: int, part: str,
                   hopper_by_default: bool) -> Backend:
    """The backend that runs ``part`` ("forward" or "backward") under ``config`` at ``head_dim`` (one every backend
    runs); ``hopper_by_default`` (the shape class): the Hopper kernels would start at least
    ``config.hopper_min_programs`` programs. Raises where ``config`` asks for the Hopper kernels and they cannot
    run, and where no backend can."""
    if config.kernels != "triton":
        reason = hopper.supports(device, dtype, head_dim)
        if reason is not None and config.kernels == "hopper":
            raise ValueError(f"FlashConfig(kernels='hopper'), but the Hopper {part} cannot run: {reason}")
        if reason is None and (config.kernels == "hopper" or hopper_by_default):
            return hopper
    reason = portable.supports(device, dtype, head_dim)
    if reason is not None:
        raise ValueError(reason)
    return portable


@functools.lru_cache(maxsize=ROUTE_CACHE_SIZE)
def route(config: FlashConfig, device: torch.device, dtype: torch.dtype, head_dim: int, part: str,
          hopper_programs: bool) -> tuple[Backend, int]:
    """The backend that runs ``part`` of inputs of ``head_dim`` and the head dim its kernels run it at (``head_dim``
    itself, or the next of :data:`SUPPORTED_HEAD_DIMS`, to which it is zero-padded); ``hopper_programs``: the Hopper
    kernels would start at least ``config.hopper_min_programs`` programs."""
    padded = min(d for d in SUPPORTED_HEAD_DIMS if d >= head_dim)
    return choose_backend(config, device, dtype, padded, part, hopper_programs), padded


def _route(part: str, Q: Tensor, K: Tensor) -> tuple[Backend, int]:
    """:func:`route` for a call on these (checked) inputs under the current configuration."""
    config = FLASH_CONFIG.get()
    enough = hopper.programs(part, Q, K) >= config.hopper_min_programs
    return route(config, Q.device, Q.dtype, Q.shape[-1], part, enough)


def chosen_backends(Q: Tensor, K: Tensor) -> dict[str, str]:
    """The backends the operator runs for these inputs under the current configuration, by part, with the head dim
    their kernels run it at: e.g. ``{"forward": "triton, d 80", "backward": "hopper, d 80"}`` (benchmarks record
    it beside their times)."""
    chosen = {}
    for part in ("forward", "backward"):
        backend, head_dim = _route(part, Q, K)
        chosen[part] = f"{backend.NAME}, d {head_dim}"
    return chosen


# ---------------------------------------------------------------------------------------------------
# Forward and backward on checked inputs of any strides and any supported d
# ---------------------------------------------------------------------------------------------------


def _pad(x: Tensor, head_dim: int) -> Tensor:
    """``x`` with zeros appended along ``d`` up to ``head_dim`` (a new, contiguous tensor)."""
    return torch.nn.functional.pad(x, (0, head_dim - x.shape[-1]))


def attention_forward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    is_causal: bool,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads q"]]:
    """``O`` (Q's shape and dtype, contiguous) and the natural-log logsumexp ``L`` (float32)."""
    head_dim = Q.shape[-1]
    sm_scale = 1.0 / math.sqrt(head_dim)
    backend, padded = _route("forward", Q, K)
    if padded == head_dim:
        Q, K, V = unit_last_stride(Q), unit_last_stride(K), unit_last_stride(V)
        return backend.forward(Q, K, V, is_causal, sm_scale)
    Q, K, V = _pad(Q, padded), _pad(K, padded), _pad(V, padded)
    O, L = backend.forward(Q, K, V, is_causal, sm_scale)
    return O[..., :head_dim].contiguous(), L


def attention_backward(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    O: Float[Tensor, "batch *heads q d"], L: Float[Tensor, "batch *heads q"], dO: Float[Tensor, "batch *heads q d"],
    is_causal: bool,
) -> tuple[Float[Tensor, "batch *heads q d"], Float[Tensor, "batch *heads k d"], Float[Tensor, "batch *heads k d"]]:
    """``(dQ, dK, dV)`` of :func:`attention_forward`'s inputs, in their dtype, contiguous."""
    dO = unit_last_stride(dO if dO.dtype == O.dtype else dO.to(O.dtype))  # o.sum().backward() sends stride 0
    head_dim = Q.shape[-1]
    sm_scale = 1.0 / math.sqrt(head_dim)
    backend, padded = _route("backward", Q, K)
    if padded == head_dim:
        Q, K, V = unit_last_stride(Q), unit_last_stride(K), unit_last_stride(V)
        return backend.backward(Q, K, V, O, L, dO, is_causal, sm_scale)
    Q, K, V, O, dO = (_pad(x, padded) for x in (Q, K, V, O, dO))
    grads = backend.backward(Q, K, V, O, L, dO, is_causal, sm_scale)
    return tuple(g[..., :head_dim].contiguous() for g in grads)


# ---------------------------------------------------------------------------------------------------
# PyTorch operators (for torch.compile and dispatch modes), the autograd Function, the functional entry point
# ---------------------------------------------------------------------------------------------------

def _forward_shapes(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool) -> tuple[Tensor, Tensor]:
    return Q.new_empty(Q.shape), Q.new_empty(Q.shape[:-1], dtype=torch.float32)


def _backward_shapes(Q: Tensor, K: Tensor, V: Tensor, O: Tensor, L: Tensor, dO: Tensor, is_causal: bool
                     ) -> tuple[Tensor, Tensor, Tensor]:
    return Q.new_empty(Q.shape), K.new_empty(K.shape), V.new_empty(V.shape)


# Opaque to Inductor (the body chooses a backend, Gluon's among them, per call) and registered from a schema,
# straight with the dispatcher: compiled code calls them on every step.
define_operator("cs336_systems::flash_attention_forward", attention_forward, traceable=False, fake=_forward_shapes,
                schema="(Tensor Q, Tensor K, Tensor V, bool is_causal) -> (Tensor, Tensor)")
define_operator("cs336_systems::flash_attention_backward", attention_backward, traceable=False, fake=_backward_shapes,
                schema="(Tensor Q, Tensor K, Tensor V, Tensor O, Tensor L, Tensor dO, bool is_causal) "
                       "-> (Tensor, Tensor, Tensor)")


def _through_operators() -> bool:
    """Whether to call the operators instead of the backends: while torch.compile traces, and under a dispatch mode
    (selective checkpointing keeps the forward operator's outputs by name)."""
    return torch.compiler.is_compiling() or dispatch_mode_active()


class FlashAttention2Triton(torch.autograd.Function):
    """FlashAttention-2 in Triton (and Gluon on Hopper): ``FlashAttention2Triton.apply(Q, K, V, is_causal=False)
    -> O``.

    Saved for backward: Q, K, V, O and the logsumexp L, float32 natural log, of shape
    ``(batch, n_queries)`` (``(batch, heads, n_queries)`` for 4-D inputs), the only saved tensor of
    that shape. Gradients come back in the inputs' dtype.
    """

    @staticmethod
    def forward(ctx, Q: Tensor, K: Tensor, V: Tensor, is_causal: bool = False) -> Tensor:
        check_inputs(Q, K, V, is_causal)
        if _through_operators():
            O, L = torch.ops.cs336_systems.flash_attention_forward.default(Q, K, V, is_causal)
        else:
            O, L = attention_forward(Q, K, V, is_causal)
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO: Tensor):
        if _through_operators():
            grads = torch.ops.cs336_systems.flash_attention_backward.default(*ctx.saved_tensors, dO, ctx.is_causal)
        else:
            grads = attention_backward(*ctx.saved_tensors, dO, ctx.is_causal)
        return *grads, None


def flash_attention(
    Q: Float[Tensor, "batch *heads q d"], K: Float[Tensor, "batch *heads k d"], V: Float[Tensor, "batch *heads k d"],
    is_causal: bool = True,
) -> Float[Tensor, "batch *heads q d"]:
    """FlashAttention-2 with the model's attention protocol ``fn(Q, K, V, is_causal=True) -> O`` (causal by default,
    like every function of :func:`cs336_systems.attention.get_attention`)."""
    return FlashAttention2Triton.apply(Q, K, V, is_causal)
