"""What the attention backends share: the interface each one is (:class:`Backend`), the head dims their kernels
hold, sizes and strides as the kernels read them, and the Delta launch (rowsum(O * dO)) both backwards start with.
Each backend imports this module and none imports another."""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
import triton
from jaxtyping import Float
from torch import Tensor

from cs336_systems.attention.backends import triton_kernels
from cs336_systems.kernels.launch import Kernel, LaunchPlan, aligned, in_order, new_output

POWER_OF_TWO_HEAD_DIMS = (16, 32, 64, 128)
"""Head dims a kernel holds in one column block (``tl.arange`` and ``tl.dot`` take power-of-two widths, at least
16)."""
TWO_PART_HEAD_DIMS = (48, 80, 96)
"""Head dims a kernel may hold in two power-of-two column blocks (:func:`head_dim_parts`) instead of padding."""
KERNEL_HEAD_DIMS = tuple(sorted(POWER_OF_TWO_HEAD_DIMS + TWO_PART_HEAD_DIMS))
"""The head dims every backend's kernels run without padding, in one or two column blocks."""
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (and third)
LOG2_E = math.log2(math.e)  # the kernels take exp2: exp(x) = exp2(x * log2(e)), the scale folded in


@runtime_checkable
class Backend(Protocol):
    """A kernel family of our attention operator (a module of ``backends/``). The operator checks inputs once and
    hands a backend contiguous-last-dimension tensors at one of its head dims (:data:`POWER_OF_TWO_HEAD_DIMS` and
    :data:`TWO_PART_HEAD_DIMS`)."""

    NAME: str

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why the kernels cannot run such inputs, or None when they can."""

    def programs(self, part: str, Q: Tensor, K: Tensor) -> int:
        """How many programs (tiles of work) ``part`` of a call on these inputs would start."""

    def forward(self, Q: Tensor, K: Tensor, V: Tensor, is_causal: bool, sm_scale: float) -> tuple[Tensor, Tensor]:
        """``O`` (Q's shape and dtype, contiguous) and the natural-log logsumexp ``L`` (float32)."""

    def backward(self, Q: Tensor, K: Tensor, V: Tensor, O: Tensor, L: Tensor, dO: Tensor, is_causal: bool,
                 sm_scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """``dQ, dK, dV`` (the inputs' dtype, contiguous) from the forward's ``O`` and ``L`` and ``dO`` (unit
        stride along ``d``, O's dtype)."""


def head_dim_parts(head_dim: int) -> tuple[int, int]:
    """The two column parts ``(HEAD_DIM_A, HEAD_DIM_B)`` a kernel holds a head dim in: ``(head_dim, 0)`` for a
    power of two, else the largest power of two below it and the rest (``80 = 64 + 16``). QK^T is the sum of the
    parts' products, so that d = 80 does 80 columns of work where padding to 128 did 128."""
    first = 1 << (head_dim.bit_length() - 1)
    return first, head_dim - first


def batch_heads(x: Tensor) -> int:
    """``batch * heads`` of a 4-D ``(batch, heads, seq, d)`` tensor, ``batch`` of a 3-D ``(batch, seq, d)`` one."""
    shape = x.shape
    return shape[0] * shape[1] if len(shape) == 4 else shape[0]


def sizes(Q: Tensor, K: Tensor) -> tuple[int, int, int, int, int]:
    """(heads, batch * heads, n_queries, n_keys, d) of 3-D ``(batch, seq, d)`` or 4-D inputs."""
    n_heads = Q.shape[1] if Q.dim() == 4 else 1
    return n_heads, Q.shape[0] * n_heads, Q.shape[-2], K.shape[-2], Q.shape[-1]


def batch_head_strides(x: Tensor) -> tuple[int, int, int]:
    """(batch, head, sequence) strides, with head stride 0 for 3-D tensors."""
    if x.dim() == 3:
        return x.stride(0), 0, x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


def named_strides(**tensors: Tensor) -> dict[str, int]:
    """Each tensor's (batch, head, sequence) strides under the kernels' parameter names: ``qm=Q`` gives
    ``stride_qb``, ``stride_qh`` and ``stride_qm`` (the last letter names the sequence axis, ``m`` or ``n``)."""
    named = {}
    for name, x in tensors.items():
        stride_b, stride_h, stride_s = batch_head_strides(x)
        named.update({f"stride_{name[:-1]}b": stride_b, f"stride_{name[:-1]}h": stride_h, f"stride_{name}": stride_s})
    return named


# ---------------------------------------------------------------------------------------------------
# Delta = rowsum(O * dO)
# ---------------------------------------------------------------------------------------------------

DELTA_CONFIG = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=1)
DELTA = Kernel(triton_kernels.attn_bwd_delta_kernel)


def launch_delta(O: Float[Tensor, "batch *heads q d"], dO: Float[Tensor, "batch *heads q d"],
                 DQ_acc: Float[Tensor, "batch_heads q d"] | None = None,
                 Delta: Float[Tensor, "batch_heads q"] | None = None) -> Float[Tensor, "batch_heads q"]:
    """Delta = rowsum(O * dO), float32, into ``Delta`` (contiguous) or a new tensor; also zeroes the float32
    ``DQ_acc`` when given (the Hopper backward's)."""
    zero_dq_acc = DQ_acc is not None
    if Delta is None:
        Delta = new_output((batch_heads(O), O.shape[-2]), torch.float32, O.device)
    key = (O.dtype, O.shape, O.stride(), dO.stride(), aligned(O, dO), zero_dq_acc)
    DELTA.launch(key, (O, dO, Delta, DQ_acc if zero_dq_acc else Delta), _delta_plan, O, dO, zero_dq_acc,
                 build=_delta_args)
    return Delta


def _delta_args(strides_and_sizes: tuple, tensors: tuple, compiled: bool) -> tuple:
    """The kernel's arguments before its constexprs: ``DQ_acc`` comes after the strides and sizes."""
    O, dO, Delta, DQ_acc = tensors
    return O, dO, Delta, *strides_and_sizes, DQ_acc


def _delta_plan(O: Tensor, dO: Tensor, zero_dq_acc: bool) -> LaunchPlan:
    n_heads, batch_heads, n_queries, _, head_dim = sizes(O, O)
    strides_and_sizes = in_order(DELTA.fn, {**named_strides(om=O, dom=dO), "n_heads": n_heads, "n_queries": n_queries},
                                 first=3)
    return LaunchPlan(lambda tiles: (triton.cdiv(n_queries, tiles["BLOCK_M"]), batch_heads),
                      dict(HEAD_DIM=head_dim, HEAD_DIM_B=head_dim_parts(head_dim)[1], ZERO_DQ_ACC=zero_dq_acc),
                      DELTA_CONFIG, strides_and_sizes)

