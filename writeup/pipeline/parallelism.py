"""Closed forms of the parallelism analysis of one FFN layer, as functions of the handout's symbols.

The layer: ``x`` of shape ``(B, D)``; ``W1``, ``W2`` of shape ``(D, D_FF)``, ``W3`` of shape ``(D_FF, D)``;
``x1 = x W1``, ``x2 = x W2``, ``z = f(x1) * x2``, ``y = z W3``. Weights and activations are fp16 (2 bytes); only
matmuls count as FLOPs (``(A, B) @ (B, C)`` costs ``2ABC``). ``N`` devices (``N_DP``, ``N_FSDP``, ``N_TP``) each
compute ``C`` FLOP/s and send ``W`` bytes/s; a ring all-gather or reduce-scatter of ``S`` bytes takes
``(N - 1) / N * S / W``, an all-reduce twice that.

FLOPs are per device. Times of collectives are wall-clock seconds of the collective, the same on every device of
the group (each device sends as many bytes as the others). Communication overlaps computation, so a strategy is
communication-bound when its communication time exceeds its computation time; the ``max_*`` functions give the
largest device count that is not, as a real bound ``N <= ...`` (the largest integer is its floor).

The functions do plain arithmetic: given :class:`fractions.Fraction` arguments they return exact fractions (the tests
count with them), given floats, floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

FP16 = 2  # bytes per element

# ---------------------------------------------------------------------------------------------
# Collectives on a ring
# ---------------------------------------------------------------------------------------------


def all_gather_time(s: Any, n: Any, w: Any) -> Any:
    """Ring all-gather of ``s`` bytes in all (each device starts with ``s / n``): ``n - 1`` steps of ``s / n``."""
    return (n - 1) * s / (n * w)


def reduce_scatter_time(s: Any, n: Any, w: Any) -> Any:
    """Ring reduce-scatter of ``s`` bytes per device: ``n - 1`` steps of ``s / n``, like the all-gather."""
    return (n - 1) * s / (n * w)


def all_reduce_time(s: Any, n: Any, w: Any) -> Any:
    """Ring all-reduce of ``s`` bytes: a reduce-scatter then an all-gather, ``2 (n - 1) / n * s / w``."""
    return reduce_scatter_time(s, n, w) + all_gather_time(s, n, w)


def alternate_ring_all_reduce_time(s: Any, n: Any, w: Any) -> Any:
    """The all-reduce in which every device forwards whole original tensors: ``n - 1`` steps, each sending ``s``
    bytes per device, ``(n - 1) s / w`` (``n / 2`` times the ring all-reduce)."""
    return (n - 1) * s / w


# ---------------------------------------------------------------------------------------------
# The layer on one device
# ---------------------------------------------------------------------------------------------


def ffn_forward_flops(b: Any, d: Any, d_ff: Any) -> Any:
    """Forward matmuls of ``b`` tokens: ``x W1``, ``x W2``, ``z W3``, each ``2 b d d_ff``."""
    return 6 * b * d * d_ff


def ffn_backward_flops(b: Any, d: Any, d_ff: Any) -> Any:
    """Backward matmuls of ``b`` tokens: ``dz = dy W3^T``, ``dx1 W1^T``, ``dx2 W2^T`` (for ``dx``), and ``dW3 =
    z^T dy``, ``dW2 = x^T dx2``, ``dW1 = x^T dx1``: six of ``2 b d d_ff``, twice the forward."""
    return 12 * b * d * d_ff


def ffn_weight_bytes(d: Any, d_ff: Any) -> Any:
    """``W1``, ``W2`` and ``W3`` in fp16 (and as many bytes of their gradients): ``3 d d_ff`` elements."""
    return 3 * d * d_ff * FP16


def compute_time(flops: Any, c: Any) -> Any:
    """Seconds of ``flops`` at ``c`` FLOP/s."""
    return flops / c


def is_communication_bound(communication_s: Any, computation_s: Any) -> bool:
    """Communication overlaps computation: the step waits for the network only when it takes longer."""
    return communication_s > computation_s


# ---------------------------------------------------------------------------------------------
# data_parallel_calcs: the batch split over N_DP devices, gradients all-reduced
# ---------------------------------------------------------------------------------------------


def dp_backward_flops(b: Any, d: Any, d_ff: Any, n_dp: Any) -> Any:
    """Per device: the backward of ``b / n_dp`` tokens, ``12 b d d_ff / n_dp``."""
    return ffn_backward_flops(b, d, d_ff) / n_dp


def dp_backward_comm_time(d: Any, d_ff: Any, n_dp: Any, w: Any) -> Any:
    """All-reduce of the fp16 gradients of all three weights, ``2 (n_dp - 1) / n_dp * 6 d d_ff / w``."""
    return all_reduce_time(ffn_weight_bytes(d, d_ff), n_dp, w)


def dp_max_devices(b: Any, c: Any, w: Any) -> Any:
    """Backward not communication-bound while ``12 (N - 1) d d_ff / (N w) <= 12 b d d_ff / (N c)``:
    ``N_DP <= 1 + b w / c`` (``d`` and ``d_ff`` cancel)."""
    return 1 + b * w / c


# ---------------------------------------------------------------------------------------------
# fsdp_calcs: data parallelism with every weight sharded, gathered before forward and backward
# ---------------------------------------------------------------------------------------------


def fsdp_forward_flops(b: Any, d: Any, d_ff: Any, n_fsdp: Any) -> Any:
    """Per device: the forward of ``b / n_fsdp`` tokens on the gathered weights, ``6 b d d_ff / n_fsdp``."""
    return ffn_forward_flops(b, d, d_ff) / n_fsdp


def fsdp_backward_flops(b: Any, d: Any, d_ff: Any, n_fsdp: Any) -> Any:
    """Per device: the backward of ``b / n_fsdp`` tokens, ``12 b d d_ff / n_fsdp``."""
    return ffn_backward_flops(b, d, d_ff) / n_fsdp


def fsdp_forward_comm_time(d: Any, d_ff: Any, n_fsdp: Any, w: Any) -> Any:
    """All-gather of the three weights, ``(n_fsdp - 1) / n_fsdp * 6 d d_ff / w``."""
    return all_gather_time(ffn_weight_bytes(d, d_ff), n_fsdp, w)


def fsdp_backward_comm_time(d: Any, d_ff: Any, n_fsdp: Any, w: Any) -> Any:
    """All-gather of the weights again and reduce-scatter of their gradients, ``2 (n_fsdp - 1) / n_fsdp * 6 d
    d_ff / w``."""
    weights = ffn_weight_bytes(d, d_ff)
    return all_gather_time(weights, n_fsdp, w) + reduce_scatter_time(weights, n_fsdp, w)


def fsdp_max_devices_forward(b: Any, c: Any, w: Any) -> Any:
    """``6 (N - 1) d d_ff / (N w) <= 6 b d d_ff / (N c)``: ``N_FSDP <= 1 + b w / c``."""
    return 1 + b * w / c


def fsdp_max_devices_backward(b: Any, c: Any, w: Any) -> Any:
    """``12 (N - 1) d d_ff / (N w) <= 12 b d d_ff / (N c)``: ``N_FSDP <= 1 + b w / c``, as in the forward."""
    return 1 + b * w / c


# ---------------------------------------------------------------------------------------------
# tp_calcs: W1, W2 split by columns, W3 by rows; y and dx all-reduced
# ---------------------------------------------------------------------------------------------


def tp_forward_flops(b: Any, d: Any, d_ff: Any, n_tp: Any) -> Any:
    """Per device: ``x W1^(i)``, ``x W2^(i)``, ``z^(i) W3^(i)`` on ``d_ff / n_tp`` of the hidden units,
    ``6 b d d_ff / n_tp``."""
    return ffn_forward_flops(b, d, d_ff) / n_tp


def tp_backward_flops(b: Any, d: Any, d_ff: Any, n_tp: Any) -> Any:
    """Per device: the six backward matmuls on ``d_ff / n_tp`` hidden units, ``12 b d d_ff / n_tp``."""
    return ffn_backward_flops(b, d, d_ff) / n_tp


def tp_forward_comm_time(b: Any, d: Any, n_tp: Any, w: Any) -> Any:
    """All-reduce of the partial outputs ``y^(i)`` (``b x d`` fp16), ``2 (n_tp - 1) / n_tp * 2 b d / w``."""
    return all_reduce_time(b * d * FP16, n_tp, w)


def tp_backward_comm_time(b: Any, d: Any, n_tp: Any, w: Any) -> Any:
    """All-reduce of the partial input gradients ``dx^(i)`` (``b x d`` fp16), as in the forward."""
    return all_reduce_time(b * d * FP16, n_tp, w)


def tp_max_devices_forward(d_ff: Any, c: Any, w: Any) -> Any:
    """``4 (N - 1) b d / (N w) <= 6 b d d_ff / (N c)``: ``N_TP <= 1 + 3 w d_ff / (2 c)`` (``b``, ``d`` cancel)."""
    return 1 + 3 * w * d_ff / (2 * c)


def tp_max_devices_backward(d_ff: Any, c: Any, w: Any) -> Any:
    """``4 (N - 1) b d / (N w) <= 12 b d d_ff / (N c)``: ``N_TP <= 1 + 3 w d_ff / c``."""
    return 1 + 3 * w * d_ff / c


# ---------------------------------------------------------------------------------------------
# fsdp_tp_calcs: a grid N = N_TP x N_FSDP, TP inside, FSDP over batch and the dimension TP leaves whole
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """A device grid: ``n_tp`` devices along the tensor-parallel axis times ``n_fsdp`` along the FSDP axis."""

    n_tp: Any
    n_fsdp: Any

    @property
    def n(self) -> Any:
        return self.n_tp * self.n_fsdp


def fsdp_tp_forward_flops(b: Any, d: Any, d_ff: Any, n_tp: Any, n_fsdp: Any) -> Any:
    """Per device: the TP forward of ``b / n_fsdp`` tokens, ``6 b d d_ff / (n_tp n_fsdp) = 6 b d d_ff / N``."""
    return ffn_forward_flops(b, d, d_ff) / (n_tp * n_fsdp)


def fsdp_tp_backward_flops(b: Any, d: Any, d_ff: Any, n_tp: Any, n_fsdp: Any) -> Any:
    """Per device: the TP backward of ``b / n_fsdp`` tokens, ``12 b d d_ff / N``."""
    return ffn_backward_flops(b, d, d_ff) / (n_tp * n_fsdp)


def fsdp_tp_forward_fsdp_axis_time(d: Any, d_ff: Any, n_tp: Any, n_fsdp: Any, w: Any) -> Any:
    """All-gather over the FSDP axis of each device's TP shards (``6 d d_ff / n_tp`` bytes in all),
    ``(n_fsdp - 1) / n_fsdp * 6 d d_ff / (n_tp w)``."""
    return all_gather_time(ffn_weight_bytes(d, d_ff) / n_tp, n_fsdp, w)


def fsdp_tp_forward_tp_axis_time(b: Any, d: Any, n_tp: Any, n_fsdp: Any, w: Any) -> Any:
    """All-reduce over the TP axis of ``y`` on the batch shard (``(b / n_fsdp) x d``),
    ``2 (n_tp - 1) / n_tp * 2 b d / (n_fsdp w)``."""
    return all_reduce_time(b * d * FP16 / n_fsdp, n_tp, w)


def fsdp_tp_forward_comm_time_overlapped(b: Any, d: Any, d_ff: Any, n_tp: Any, n_fsdp: Any, w: Any) -> Any:
    """Each axis has its own links and the two run at once: the longer of the two."""
    return max(fsdp_tp_forward_fsdp_axis_time(d, d_ff, n_tp, n_fsdp, w),
               fsdp_tp_forward_tp_axis_time(b, d, n_tp, n_fsdp, w))


def fsdp_tp_forward_comm_time_shared(b: Any, d: Any, d_ff: Any, n_tp: Any, n_fsdp: Any, w: Any) -> Any:
    """The two axes share each device's ``w`` and cannot overlap: the sum of the two."""
    return (fsdp_tp_forward_fsdp_axis_time(d, d_ff, n_tp, n_fsdp, w)
            + fsdp_tp_forward_tp_axis_time(b, d, n_tp, n_fsdp, w))


def fsdp_tp_backward_fsdp_axis_time(d: Any, d_ff: Any, n_tp: Any, n_fsdp: Any, w: Any) -> Any:
    """Backward, FSDP axis: the TP shards gathered again and their gradients reduce-scattered, twice the
    forward's."""
    shards = ffn_weight_bytes(d, d_ff) / n_tp
    return all_gather_time(shards, n_fsdp, w) + reduce_scatter_time(shards, n_fsdp, w)


def fsdp_tp_backward_tp_axis_time(b: Any, d: Any, n_tp: Any, n_fsdp: Any, w: Any) -> Any:
    """Backward, TP axis: the all-reduce of ``dx`` on the batch shard, as the forward's of ``y``."""
    return all_reduce_time(b * d * FP16 / n_fsdp, n_tp, w)


def fsdp_tp_best_grid_overlapped(n: int, b: Any, d: Any, d_ff: Any, w: Any) -> Grid:
    """The integer factorisation ``n = n_tp * n_fsdp`` of least overlapped forward communication (ties: more
    TP). The compute ``6 b d d_ff / (n c)`` does not depend on the split."""
    grids = [Grid(n_tp, n // n_tp) for n_tp in range(1, n + 1) if n % n_tp == 0]
    return min(grids, key=lambda g: (fsdp_tp_forward_comm_time_overlapped(b, d, d_ff, g.n_tp, g.n_fsdp, w), -g.n_tp))


def fsdp_tp_max_grid_overlapped(b: Any, d_ff: Any, c: Any, w: Any) -> Grid:
    """The largest grid whose forward is not communication-bound, each axis on its own links.

    Against the compute ``6 b d d_ff / (N c)`` the two axes' conditions separate: the FSDP axis needs
    ``n_fsdp <= 1 + b w / c`` (FSDP's bound: the weight shards it gathers and the compute both shrink by ``n_tp``),
    the TP axis ``n_tp <= 1 + 3 w d_ff / (2 c)`` (TP's forward bound: the ``y`` it all-reduces and the compute both
    shrink by ``n_fsdp``). Each condition involves its own axis only, so the largest ``N`` is the product of the
    two integer bounds."""
    return Grid(math.floor(tp_max_devices_forward(d_ff, c, w)), math.floor(fsdp_max_devices_forward(b, c, w)))


def _sqrt(x: Any) -> Any:
    """Exact for a fraction of two perfect squares, a float otherwise."""
    if isinstance(x, Fraction):
        num, den = math.isqrt(x.numerator), math.isqrt(x.denominator)
        if num * num == x.numerator and den * den == x.denominator:
            return Fraction(num, den)
    return math.sqrt(x)


def fsdp_tp_best_grid_shared(n: Any, b: Any, d_ff: Any) -> Grid:
    """The real split of ``n`` of least shared forward communication.

    Over the compute, the shared time is ``a (n_fsdp - 1) + g (n_tp - 1)`` with ``a = c / (b w)`` and
    ``g = 2 c / (3 w d_ff)``; with ``n_tp = n / n_fsdp`` its minimum is where ``a = g n / n_fsdp^2``:
    ``n_fsdp = sqrt(2 b n / (3 d_ff))``, ``n_tp = sqrt(3 d_ff n / (2 b))`` (each kept within ``[1, n]``)."""
    n_fsdp = _sqrt(2 * b * n / (3 * d_ff))
    n_fsdp = min(max(n_fsdp, 1), n)
    return Grid(n / n_fsdp, n_fsdp)


def fsdp_tp_max_grid_shared(b: Any, d_ff: Any, c: Any, w: Any) -> Grid:
    """The largest real grid whose forward is not communication-bound when the axes share the network.

    Not bound while ``a (n_fsdp - 1) + g (n_tp - 1) <= 1`` (``a``, ``g`` as in :func:`fsdp_tp_best_grid_shared`):
    a product ``n_fsdp n_tp`` under a linear constraint ``a n_fsdp + g n_tp <= k = 1 + a + g`` is largest where both
    terms are ``k / 2``: ``n_fsdp = k / (2 a)``, ``n_tp = k / (2 g)``, ``N = k^2 / (4 a g)
    = (3 w b d_ff + 3 c d_ff + 2 c b)^2 / (24 c^2 b d_ff)``. When that puts an axis below one device, the other
    takes all: ``n = 1 + 1 / a`` (FSDP alone) or ``1 + 1 / g`` (TP alone)."""
    a = c / (b * w)
    g = 2 * c / (3 * w * d_ff)
    k = 1 + a + g
    if k < 2 * a:  # n_fsdp would fall below 1
        return Grid(1 + 1 / g, 1)
    if k < 2 * g:  # n_tp would fall below 1
        return Grid(1, 1 + 1 / a)
    return Grid(k / (2 * g), k / (2 * a))


def fsdp_tp_max_integer_grid_shared(b: Any, d_ff: Any, c: Any, w: Any) -> Grid:
    """The largest integer grid whose forward is not communication-bound when the axes share the network (ties:
    more TP): each axis is at most its bound alone (the other at one device), so the search is finite."""
    def fits(grid: Grid) -> bool:
        comm = fsdp_tp_forward_comm_time_shared(b, 1, d_ff, grid.n_tp, grid.n_fsdp, w)
        return comm <= compute_time(fsdp_tp_forward_flops(b, 1, d_ff, grid.n_tp, grid.n_fsdp), c)

    grids = [Grid(n_tp, n_fsdp) for n_tp in range(1, math.floor(tp_max_devices_forward(d_ff, c, w)) + 1)
             for n_fsdp in range(1, math.floor(fsdp_max_devices_forward(b, c, w)) + 1)]
    return max((g for g in grids if fits(g)), key=lambda g: (g.n, g.n_tp))


# ---------------------------------------------------------------------------------------------
# Datasheet numbers for the examples
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Accelerator:
    """A device of the analysis: ``c`` dense fp16/bf16 FLOP/s and ``w`` bytes/s of NVLink egress per direction."""

    name: str
    c: float
    w: float


H100 = Accelerator("H100 SXM", c=989e12, w=450e9)  # NVLink 4: 900 GB/s both directions together
B200 = Accelerator("B200", c=2.25e15, w=900e9)  # NVLink 5: 1.8 TB/s both directions together
EXAMPLE_LAYER = {"d": 8192, "d_ff": 28672, "b": 4 * 4096}  # an 8B-class FFN, a batch of 4 sequences of 4096
