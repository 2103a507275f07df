"""The parallelism analysis of one FFN layer (``writeup/pipeline/parallelism.py``) against counts made independently.

Collectives run on a simulated ring, step by step, counting the bytes each device sends; the layer runs sharded on
simulated devices (list entries, float64) under DP, FSDP, TP and FSDP + TP, its matmuls and collectives recorded as
they happen, and its results compared with the unsharded layer under torch's autograd. Every count is an integer or
a :class:`fractions.Fraction`, and it must equal the closed form exactly.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

WRITEUP = Path(__file__).resolve().parents[1] / "writeup"
if str(WRITEUP) not in sys.path:
    sys.path.insert(0, str(WRITEUP))  # the writeup's `pipeline` package

from pipeline import parallelism as par

BYTES = 2  # every element travels in fp16
LAYERS = [(48, 12, 36), (12, 24, 60)]  # (B, D, D_FF): every ratio of the two differs
DEVICE_COUNTS = [1, 2, 3, 4, 6]  # divide every dimension of both layers
GRIDS = [(n_tp, n_fsdp) for n_tp in (1, 2, 3, 4) for n_fsdp in (1, 2, 3)]


def exact(fn, *args):
    """``fn`` on the arguments, ints made fractions; the result must be exact (no float crept in)."""
    result = fn(*(Fraction(a) if isinstance(a, int) else a for a in args))
    values = (result.n_tp, result.n_fsdp) if isinstance(result, par.Grid) else (result,)
    assert all(isinstance(v, (int, Fraction)) for v in values), f"{fn.__name__} gave a float: {result!r}"
    return result


# ---------------------------------------------------------------------------------------------
# Ring collectives, one message per device and step
# ---------------------------------------------------------------------------------------------


@dataclass
class Transfer:
    """``sent[step][device]``: the bytes each device sent to its neighbour at each step."""

    sent: list[list[int]]

    def seconds_times_w(self) -> int:
        """Each step lasts as long as its largest message: summed over steps, in bytes (divide by ``W``)."""
        return sum(max(step) for step in self.sent)


def ring_all_gather(chunks: list[np.ndarray]) -> tuple[list[list[np.ndarray]], Transfer]:
    """Device ``i`` starts with ``chunks[i]``; at step ``t`` it forwards chunk ``(i - t) mod n`` to ``i + 1``.
    Returns every device's ``n`` chunks in order."""
    n = len(chunks)
    held = [{i: chunks[i].copy()} for i in range(n)]
    sent = []
    for t in range(n - 1):
        messages = [(i, (i - t) % n, held[i][(i - t) % n]) for i in range(n)]
        sent.append([chunk.size * BYTES for _, _, chunk in messages])
        for i, k, chunk in messages:
            receiver = held[(i + 1) % n]
            assert k not in receiver
            receiver[k] = chunk.copy()
    assert all(sorted(h) == list(range(n)) for h in held)
    return [[h[k] for k in range(n)] for h in held], Transfer(sent)


def ring_reduce_scatter(parts: list[list[np.ndarray]]) -> tuple[list[np.ndarray], Transfer]:
    """Device ``i`` holds its tensor as ``n`` chunks ``parts[i]``; at step ``t`` it sends its running sum of chunk
    ``(i - t - 1) mod n`` to ``i + 1``, which adds its own. Returns each device's summed chunk ``i``."""
    n = len(parts)
    sums = [[chunk.copy() for chunk in part] for part in parts]
    sent = []
    for t in range(n - 1):
        messages = [(i, (i - t - 1) % n, sums[i][(i - t - 1) % n].copy()) for i in range(n)]
        sent.append([chunk.size * BYTES for _, _, chunk in messages])
        for i, k, chunk in messages:
            sums[(i + 1) % n][k] = sums[(i + 1) % n][k] + chunk
    return [sums[i][i] for i in range(n)], Transfer(sent)


def ring_all_reduce(tensors: list[np.ndarray]) -> tuple[list[np.ndarray], Transfer]:
    """A reduce-scatter of ``n`` equal flat chunks, then an all-gather of the summed chunks."""
    n = len(tensors)
    assert tensors[0].size % n == 0
    summed, first = ring_reduce_scatter([np.split(t.reshape(-1), n) for t in tensors])
    gathered, second = ring_all_gather(summed)
    return [np.concatenate(chunks).reshape(tensors[0].shape) for chunks in gathered], Transfer(first.sent + second.sent)


def alternate_all_reduce(tensors: list[np.ndarray]) -> tuple[list[np.ndarray], Transfer, list[set[int]]]:
    """For ``t = 1 .. n-1`` device ``i`` sends the original ``x^((i - t + 1) mod n)`` (its own at ``t = 1``, then
    the one it received last) to ``i + 1``, and adds the ``x^((i - t) mod n)`` it receives. Returns the sums, the
    transfer and which originals each device received."""
    n = len(tensors)
    received: list[dict[int, np.ndarray]] = [{} for _ in range(n)]
    sums = [t.copy() for t in tensors]
    sent = []
    for t in range(1, n):
        messages = []
        for i in range(n):
            k = (i - t + 1) % n
            messages.append((i, k, tensors[i] if k == i else received[i][k]))
        sent.append([x.size * BYTES for _, _, x in messages])
        for i, k, x in messages:
            j = (i + 1) % n
            assert k == (j - t) % n and k != j and k not in received[j]
            received[j][k] = x.copy()
            sums[j] = sums[j] + x
    return sums, Transfer(sent), [set(r) for r in received]


RUN = {"all_gather": ring_all_gather, "reduce_scatter": ring_reduce_scatter, "all_reduce": ring_all_reduce}


# ---------------------------------------------------------------------------------------------
# Simulated devices: each one's matmuls, and the collectives they issue
# ---------------------------------------------------------------------------------------------


@dataclass
class Cluster:
    """Devices are keys. ``phase`` ("forward" or "backward") labels what is recorded: each device's matmul shapes
    ``(A, B, C)``, each axis's communication in bytes on the critical path, and every collective issued as
    ``(phase, axis, kind, S bytes, group size, number of groups)``."""

    phase: str = "forward"
    matmuls: dict = field(default_factory=lambda: defaultdict(list))
    comm: dict = field(default_factory=lambda: defaultdict(int))
    issued: list = field(default_factory=list)

    def mm(self, device):
        def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            assert a.ndim == b.ndim == 2 and a.shape[1] == b.shape[0]
            self.matmuls[(self.phase, device)].append((a.shape[0], a.shape[1], b.shape[1]))
            return a @ b
        return matmul

    def flops(self, device, phase: str) -> int:
        return sum(2 * a * b * c for a, b, c in self.matmuls[(phase, device)])

    def collective(self, axis: str, kind: str, groups: list[list]) -> list[list]:
        """``kind`` run on every group at once (each group a list of its devices' inputs): the step lasts as long
        as its slowest group. Returns each group's outputs."""
        outputs, transfers = zip(*(RUN[kind](group) for group in groups))
        self.comm[(self.phase, axis)] += max(t.seconds_times_w() for t in transfers)
        first = groups[0]
        whole = first if kind == "all_gather" else first[0] if kind == "reduce_scatter" else first[:1]
        size = sum(part.size for part in whole) * BYTES  # S: the tensor gathered, reduce-scattered or all-reduced
        self.issued.append((self.phase, axis, kind, size, len(first), len(groups)))
        return list(outputs)

    def comm_time(self, phase: str, axis: str, w) -> Fraction:
        return Fraction(self.comm[(phase, axis)]) / w


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------


def silu(x):
    return x / (1 + np.exp(-x))


def silu_grad(x):
    s = 1 / (1 + np.exp(-x))
    return s * (1 + x * (1 - s))


def ffn_forward(mm, x, w1, w2, w3):
    """``y = (f(x W1) * (x W2)) W3`` on what one device holds; returns ``y`` and what the backward reads."""
    x1, x2 = mm(x, w1), mm(x, w2)
    z = silu(x1) * x2
    return mm(z, w3), (x, x1, x2, z)


def ffn_backward(mm, dy, saved, w1, w2, w3):
    """The handout's backward on what one device holds. Under TP, with the shards ``W1^(i), W2^(i), W3^(i)`` and
    ``x1^(i), x2^(i), z^(i)``, it is the per-device backward: ``dz^(i) = dy W3^(i)T``, ``dx2^(i) = dz^(i) *
    f(x1^(i))``, ``dx1^(i) = dz^(i) * f'(x1^(i)) * x2^(i)``, ``dW3^(i) = z^(i)T dy``, ``dW2^(i) = x^T dx2^(i)``,
    ``dW1^(i) = x^T dx1^(i)``, and the partial ``dx^(i) = dx1^(i) W1^(i)T + dx2^(i) W2^(i)T`` (all-reduced)."""
    x, x1, x2, z = saved
    dz = mm(dy, w3.T)
    dx2 = dz * silu(x1)
    dx1 = dz * silu_grad(x1) * x2
    dx = mm(dx1, w1.T) + mm(dx2, w2.T)
    return dx, (mm(x.T, dx1), mm(x.T, dx2), mm(z.T, dy))


@dataclass
class Layer:
    """The inputs, and the unsharded layer's outputs from torch's autograd (the reference)."""

    x: np.ndarray
    w: tuple[np.ndarray, np.ndarray, np.ndarray]
    dy: np.ndarray
    y: np.ndarray = None
    dx: np.ndarray = None
    dw: tuple = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.x.shape[0], self.x.shape[1], self.w[0].shape[1]


def make_layer(b: int, d: int, d_ff: int, seed: int = 0) -> Layer:
    rng = np.random.default_rng(seed)
    layer = Layer(rng.standard_normal((b, d)), (rng.standard_normal((d, d_ff)), rng.standard_normal((d, d_ff)),
                                                rng.standard_normal((d_ff, d))), rng.standard_normal((b, d)))
    x = torch.tensor(layer.x, requires_grad=True)
    w1, w2, w3 = (torch.tensor(w, requires_grad=True) for w in layer.w)
    y = (torch.nn.functional.silu(x @ w1) * (x @ w2)) @ w3
    y.backward(torch.tensor(layer.dy))
    layer.y, layer.dx = y.detach().numpy(), x.grad.numpy()
    layer.dw = tuple(w.grad.numpy() for w in (w1, w2, w3))
    return layer


def close(a, b) -> bool:
    return a.shape == b.shape and np.allclose(a, b, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# The four strategies on simulated devices
# ---------------------------------------------------------------------------------------------


def run_dp(layer: Layer, n: int) -> Cluster:
    """Batch split over ``n`` devices, every weight replicated, the gradients all-reduced."""
    cl = Cluster()
    batch = np.split(np.arange(layer.shape[0]), n)
    outputs = [ffn_forward(cl.mm(j), layer.x[batch[j]], *layer.w) for j in range(n)]
    assert close(np.concatenate([y for y, _ in outputs]), layer.y)
    cl.phase = "backward"
    local = [ffn_backward(cl.mm(j), layer.dy[batch[j]], outputs[j][1], *layer.w) for j in range(n)]
    assert close(np.concatenate([dx for dx, _ in local]), layer.dx)
    for k in range(3):
        (summed,) = cl.collective("dp", "all_reduce", [[grads[k] for _, grads in local]])
        assert all(close(g, layer.dw[k]) for g in summed)
    return cl


def run_fsdp(layer: Layer, n: int) -> Cluster:
    """Batch and weights (by rows) split over ``n`` devices; weights gathered before forward and backward,
    gradients reduce-scattered back to the rows each device owns."""
    cl = Cluster()
    batch = np.split(np.arange(layer.shape[0]), n)
    shards = [np.split(w, n, axis=0) for w in layer.w]

    def gather():
        gathered = [cl.collective("fsdp", "all_gather", [shards[k]])[0] for k in range(3)]
        return [[np.concatenate(gathered[k][j], axis=0) for k in range(3)] for j in range(n)]

    weights = gather()
    outputs = [ffn_forward(cl.mm(j), layer.x[batch[j]], *weights[j]) for j in range(n)]
    assert close(np.concatenate([y for y, _ in outputs]), layer.y)
    cl.phase = "backward"
    weights = gather()
    local = [ffn_backward(cl.mm(j), layer.dy[batch[j]], outputs[j][1], *weights[j]) for j in range(n)]
    assert close(np.concatenate([dx for dx, _ in local]), layer.dx)
    for k in range(3):
        (owned,) = cl.collective("fsdp", "reduce_scatter", [[np.split(grads[k], n, axis=0) for _, grads in local]])
        assert all(close(owned[j], np.split(layer.dw[k], n, axis=0)[j]) for j in range(n))
    return cl


def tp_shards(layer: Layer, n: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``W1``, ``W2`` by columns and ``W3`` by rows: device ``i`` holds hidden units ``i``."""
    w1, w2, w3 = layer.w
    return list(zip(np.split(w1, n, axis=1), np.split(w2, n, axis=1), np.split(w3, n, axis=0)))


def run_tp(layer: Layer, n: int) -> Cluster:
    """Hidden units split over ``n`` devices; ``y`` all-reduced in the forward, ``dx`` in the backward."""
    cl = Cluster()
    shards = tp_shards(layer, n)
    outputs = [ffn_forward(cl.mm(i), layer.x, *shards[i]) for i in range(n)]
    (ys,) = cl.collective("tp", "all_reduce", [[y for y, _ in outputs]])
    assert all(close(y, layer.y) for y in ys)
    cl.phase = "backward"
    local = [ffn_backward(cl.mm(i), layer.dy, outputs[i][1], *shards[i]) for i in range(n)]
    (dxs,) = cl.collective("tp", "all_reduce", [[dx for dx, _ in local]])
    assert all(close(dx, layer.dx) for dx in dxs)
    for i, (_, grads) in enumerate(local):
        expected = tp_shards(Layer(layer.x, layer.dw, layer.dy), n)[i]
        assert all(close(g, e) for g, e in zip(grads, expected))
    return cl


def run_fsdp_tp(layer: Layer, n_tp: int, n_fsdp: int) -> Cluster:
    """Device ``(i, j)``: TP index ``i``, FSDP index ``j``. It holds ``W1[rows j, columns i]`` (``W2`` alike) and
    ``W3[rows i, columns j]`` and the tokens ``j``; weights are gathered over ``j`` (the FSDP axis), ``y`` and
    ``dx`` all-reduced over ``i`` (the TP axis), gradients reduce-scattered over ``j``."""
    cl = Cluster()
    batch = np.split(np.arange(layer.shape[0]), n_fsdp)
    split_axis = (0, 0, 1)  # the dimension TP leaves whole: D, the rows of W1 and W2 and the columns of W3
    shards = [[[np.split(w, n_fsdp, axis=split_axis[k])[j] for j in range(n_fsdp)]
               for w in [tp_shards(layer, n_tp)[i][k] for i in range(n_tp)]] for k in range(3)]
    devices = list(itertools.product(range(n_tp), range(n_fsdp)))

    def gather():
        gathered = [cl.collective("fsdp", "all_gather", shards[k]) for k in range(3)]  # [k][i][j]: chunks
        return {(i, j): [np.concatenate(gathered[k][i][j], axis=split_axis[k]) for k in range(3)] for i, j in devices}

    def all_reduce_over_tp(partial):
        reduced = cl.collective("tp", "all_reduce", [[partial[(i, j)] for i in range(n_tp)] for j in range(n_fsdp)])
        return {(i, j): reduced[j][i] for i, j in devices}

    weights = gather()
    outputs = {(i, j): ffn_forward(cl.mm((i, j)), layer.x[batch[j]], *weights[(i, j)]) for i, j in devices}
    ys = all_reduce_over_tp({key: y for key, (y, _) in outputs.items()})
    assert all(close(ys[(i, j)], layer.y[batch[j]]) for i, j in devices)
    cl.phase = "backward"
    weights = gather()
    local = {(i, j): ffn_backward(cl.mm((i, j)), layer.dy[batch[j]], outputs[(i, j)][1], *weights[(i, j)])
             for i, j in devices}
    dxs = all_reduce_over_tp({key: dx for key, (dx, _) in local.items()})
    assert all(close(dxs[(i, j)], layer.dx[batch[j]]) for i, j in devices)
    expected = tp_shards(Layer(layer.x, layer.dw, layer.dy), n_tp)
    for k in range(3):
        groups = [[np.split(local[(i, j)][1][k], n_fsdp, axis=split_axis[k]) for j in range(n_fsdp)]
                  for i in range(n_tp)]
        owned = cl.collective("fsdp", "reduce_scatter", groups)
        assert all(close(owned[i][j], np.split(expected[i][k], n_fsdp, axis=split_axis[k])[j]) for i, j in devices)
    return cl


# ---------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
def test_ring_collectives_take_the_primitive_times(n):
    rng = np.random.default_rng(n)
    w = Fraction(3)
    chunk = 6  # elements per device's chunk
    s = n * chunk * BYTES
    chunks = [rng.integers(-9, 9, chunk) for _ in range(n)]
    gathered, transfer = ring_all_gather(chunks)
    assert all(all((a == b).all() for a, b in zip(g, chunks)) for g in gathered)
    assert len(transfer.sent) == n - 1 and all(step == [s // n] * n for step in transfer.sent)
    assert transfer.seconds_times_w() / w == exact(par.all_gather_time, s, n, w)

    parts = [[rng.integers(-9, 9, chunk) for _ in range(n)] for _ in range(n)]
    owned, transfer = ring_reduce_scatter(parts)
    assert all((owned[i] == sum(p[i] for p in parts)).all() for i in range(n))
    assert len(transfer.sent) == n - 1 and transfer.seconds_times_w() / w == exact(par.reduce_scatter_time, s, n, w)

    tensors = [rng.integers(-9, 9, (2, n * chunk // 2)) for _ in range(n)]
    reduced, transfer = ring_all_reduce(tensors)
    assert all((r == sum(tensors)).all() for r in reduced)
    assert len(transfer.sent) == 2 * (n - 1) and transfer.seconds_times_w() / w == exact(par.all_reduce_time, s, n, w)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_alternate_ring_all_reduce(n):
    rng = np.random.default_rng(n)
    w = Fraction(7)
    tensors = [rng.integers(-99, 99, (3, 5)) for _ in range(n)]
    s = tensors[0].size * BYTES
    sums, transfer, received = alternate_all_reduce(tensors)
    assert all((total == sum(tensors)).all() for total in sums)
    assert all(got == set(range(n)) - {i} for i, got in enumerate(received))
    assert len(transfer.sent) == n - 1 and all(step == [s] * n for step in transfer.sent)
    assert transfer.seconds_times_w() / w == exact(par.alternate_ring_all_reduce_time, s, n, w)
    assert exact(par.alternate_ring_all_reduce_time, s, n, w) == Fraction(n, 2) * exact(par.all_reduce_time, s, n, w)


def test_a_collective_of_one_device_costs_nothing():
    assert exact(par.all_reduce_time, 100, 1, 1) == exact(par.alternate_ring_all_reduce_time, 100, 1, 1) == 0


# ---------------------------------------------------------------------------------------------
# FLOPs, communication and the collectives issued, per strategy
# ---------------------------------------------------------------------------------------------

W = Fraction(5)  # any bandwidth: the times scale as 1 / W


def assert_every_device_computes(cl: Cluster, devices, forward_flops, backward_flops) -> None:
    """Each device's matmul FLOPs in the forward and in the backward are the closed forms' values."""
    for device in devices:
        assert cl.flops(device, "forward") == forward_flops, device
        assert cl.flops(device, "backward") == backward_flops, device


def assert_axis_communicates(cl: Cluster, axis: str, forward_time, backward_time) -> None:
    """The collectives over ``axis`` take the closed forms' times, at bandwidth ``W``, in the forward and in the
    backward."""
    assert cl.comm_time("forward", axis, W) == forward_time
    assert cl.comm_time("backward", axis, W) == backward_time


@pytest.mark.parametrize("b, d, d_ff", LAYERS)
def test_the_layer_alone(b, d, d_ff):
    cl = run_dp(make_layer(b, d, d_ff), 1)
    assert cl.flops(0, "forward") == exact(par.ffn_forward_flops, b, d, d_ff)
    forward = exact(par.ffn_forward_flops, b, d, d_ff)
    assert cl.flops(0, "backward") == exact(par.ffn_backward_flops, b, d, d_ff) == 2 * forward
    assert len(cl.matmuls[("backward", 0)]) == 6
    assert exact(par.ffn_weight_bytes, d, d_ff) == sum(w.size for w in make_layer(b, d, d_ff).w) * BYTES


@pytest.mark.parametrize("b, d, d_ff", LAYERS)
@pytest.mark.parametrize("n", DEVICE_COUNTS)
def test_data_parallel_calcs(b, d, d_ff, n):
    cl = run_dp(make_layer(b, d, d_ff), n)
    assert_every_device_computes(cl, range(n), exact(par.ffn_forward_flops, Fraction(b, n), d, d_ff),
                                 exact(par.dp_backward_flops, b, d, d_ff, Fraction(n)))
    assert cl.issued == [("backward", "dp", "all_reduce", d * d_ff * BYTES, n, 1)] * 3
    assert_axis_communicates(cl, "dp", 0, exact(par.dp_backward_comm_time, d, d_ff, n, W))
    assert sum(exact(par.all_reduce_time, size, group, W) for *_, size, group, _ in cl.issued) == cl.comm_time(
        "backward", "dp", W)


@pytest.mark.parametrize("b, d, d_ff", LAYERS)
@pytest.mark.parametrize("n", DEVICE_COUNTS)
def test_fsdp_calcs(b, d, d_ff, n):
    cl = run_fsdp(make_layer(b, d, d_ff), n)
    assert_every_device_computes(cl, range(n), exact(par.fsdp_forward_flops, b, d, d_ff, Fraction(n)),
                                 exact(par.fsdp_backward_flops, b, d, d_ff, Fraction(n)))
    sizes = [d * d_ff * BYTES, d * d_ff * BYTES, d_ff * d * BYTES]
    assert cl.issued == ([("forward", "fsdp", "all_gather", s, n, 1) for s in sizes]
                         + [("backward", "fsdp", "all_gather", s, n, 1) for s in sizes]
                         + [("backward", "fsdp", "reduce_scatter", s, n, 1) for s in sizes])
    assert_axis_communicates(cl, "fsdp", exact(par.fsdp_forward_comm_time, d, d_ff, n, W),
                             exact(par.fsdp_backward_comm_time, d, d_ff, n, W))


@pytest.mark.parametrize("b, d, d_ff", LAYERS)
@pytest.mark.parametrize("n", DEVICE_COUNTS)
def test_tp_calcs(b, d, d_ff, n):
    """Runs the per-device backward equations of (a) (see ``ffn_backward``) and checks them against autograd."""
    cl = run_tp(make_layer(b, d, d_ff), n)
    assert_every_device_computes(cl, range(n), exact(par.tp_forward_flops, b, d, d_ff, Fraction(n)),
                                 exact(par.tp_backward_flops, b, d, d_ff, Fraction(n)))
    assert cl.issued == [("forward", "tp", "all_reduce", b * d * BYTES, n, 1),
                         ("backward", "tp", "all_reduce", b * d * BYTES, n, 1)]
    assert_axis_communicates(cl, "tp", exact(par.tp_forward_comm_time, b, d, n, W),
                             exact(par.tp_backward_comm_time, b, d, n, W))


@pytest.mark.parametrize("b, d, d_ff", LAYERS)
@pytest.mark.parametrize("n_tp, n_fsdp", GRIDS)
def test_fsdp_tp_calcs(b, d, d_ff, n_tp, n_fsdp):
    cl = run_fsdp_tp(make_layer(b, d, d_ff), n_tp, n_fsdp)
    assert_every_device_computes(cl, itertools.product(range(n_tp), range(n_fsdp)),
                                 exact(par.fsdp_tp_forward_flops, b, d, d_ff, n_tp, Fraction(n_fsdp)),
                                 exact(par.fsdp_tp_backward_flops, b, d, d_ff, n_tp, Fraction(n_fsdp)))
    shard = d * d_ff * BYTES // n_tp  # one weight's TP shard, gathered over the FSDP axis
    y = b * d * BYTES // n_fsdp  # y (and dx) on one batch shard, all-reduced over the TP axis
    assert cl.issued == ([("forward", "fsdp", "all_gather", shard, n_fsdp, n_tp)] * 3
                         + [("forward", "tp", "all_reduce", y, n_tp, n_fsdp)]
                         + [("backward", "fsdp", "all_gather", shard, n_fsdp, n_tp)] * 3
                         + [("backward", "tp", "all_reduce", y, n_tp, n_fsdp)]
                         + [("backward", "fsdp", "reduce_scatter", shard, n_fsdp, n_tp)] * 3)
    fsdp = cl.comm_time("forward", "fsdp", W)
    tp = cl.comm_time("forward", "tp", W)
    assert fsdp == exact(par.fsdp_tp_forward_fsdp_axis_time, d, d_ff, n_tp, n_fsdp, W)
    assert tp == exact(par.fsdp_tp_forward_tp_axis_time, b, d, n_tp, n_fsdp, W)
    assert max(fsdp, tp) == exact(par.fsdp_tp_forward_comm_time_overlapped, b, d, d_ff, n_tp, n_fsdp, W)
    assert fsdp + tp == exact(par.fsdp_tp_forward_comm_time_shared, b, d, d_ff, n_tp, n_fsdp, W)
    assert cl.comm_time("backward", "fsdp", W) == exact(par.fsdp_tp_backward_fsdp_axis_time, d, d_ff, n_tp, n_fsdp, W)
    assert cl.comm_time("backward", "tp", W) == exact(par.fsdp_tp_backward_tp_axis_time, b, d, n_tp, n_fsdp, W)


def test_fsdp_tp_on_one_axis_is_fsdp_or_tp():
    b, d, d_ff, n = Fraction(48), 12, 36, 4
    fsdp_only = exact(par.fsdp_tp_forward_comm_time_shared, b, d, d_ff, 1, n, W)
    tp_only = exact(par.fsdp_tp_forward_comm_time_shared, b, d, d_ff, n, 1, W)
    assert fsdp_only == exact(par.fsdp_forward_comm_time, d, d_ff, n, W)
    assert tp_only == exact(par.tp_forward_comm_time, b, d, n, W)


def test_the_checks_against_the_reference_can_fail():
    """TP on shards of W3 whose rows do not match W1's columns gives a wrong ``y``."""
    layer = make_layer(12, 24, 60)
    w1, w2, w3 = layer.w
    with pytest.raises(AssertionError):
        run_tp(Layer(layer.x, (w1, w2, w3[::-1]), layer.dy, layer.y, layer.dx, layer.dw), 2)


# ---------------------------------------------------------------------------------------------
# Communication-bound thresholds, counted on the simulated devices
# ---------------------------------------------------------------------------------------------


def bound(cl: Cluster, phase: str, axes: list[str], c, w) -> int:
    """-1, 0 or 1: device 0's communication time below, equal to or above its computation time."""
    comm = sum(cl.comm_time(phase, axis, w) for axis in axes)
    compute = Fraction(cl.flops(next(k for p, k in cl.matmuls if p == phase), phase)) / c
    return (comm > compute) - (comm < compute)


def test_data_parallel_bound():
    b, d, d_ff, w = 12, 24, 60, Fraction(1)
    c = Fraction(6)  # 1 + B W / C = 3
    assert exact(par.dp_max_devices, b, c, w) == 3
    assert [bound(run_dp(make_layer(b, d, d_ff), n), "backward", ["dp"], c, w) for n in (2, 3, 4)] == [-1, 0, 1]


def test_fsdp_bounds():
    b, d, d_ff, w = 12, 24, 60, Fraction(1)
    c = Fraction(6)
    assert exact(par.fsdp_max_devices_forward, b, c, w) == exact(par.fsdp_max_devices_backward, b, c, w) == 3
    clusters = [run_fsdp(make_layer(b, d, d_ff), n) for n in (2, 3, 4)]
    assert [bound(cl, "forward", ["fsdp"], c, w) for cl in clusters] == [-1, 0, 1]
    assert [bound(cl, "backward", ["fsdp"], c, w) for cl in clusters] == [-1, 0, 1]


def test_tp_bounds():
    b, d, d_ff, w = 12, 24, 60, Fraction(1)
    clusters = [run_tp(make_layer(b, d, d_ff), n) for n in (2, 3, 4)]
    c = Fraction(45)  # forward: 1 + 3 W D_FF / (2 C) = 3
    assert exact(par.tp_max_devices_forward, d_ff, c, w) == 3
    assert [bound(cl, "forward", ["tp"], c, w) for cl in clusters] == [-1, 0, 1]
    c = Fraction(90)  # backward: 1 + 3 W D_FF / C = 3
    assert exact(par.tp_max_devices_backward, d_ff, c, w) == 3
    assert [bound(cl, "backward", ["tp"], c, w) for cl in clusters] == [-1, 0, 1]


def test_fsdp_tp_bounds():
    """B = 36, D_FF = 24, C = 18 W: both axes may take 3 devices when they overlap (grid 3 x 3), and 2 x 2 when
    they share the network (a = g = 1/2)."""
    b, d, d_ff, w, c = 36, 12, 24, Fraction(1), Fraction(18)
    assert exact(par.fsdp_tp_max_grid_overlapped, b, d_ff, c, w) == par.Grid(3, 3)
    assert exact(par.fsdp_tp_max_grid_shared, b, d_ff, c, w) == par.Grid(2, 2)
    layer = make_layer(b, d, d_ff)
    overlapped = {grid: max(bound(run_fsdp_tp(layer, *grid), "forward", [axis], c, w) for axis in ("fsdp", "tp"))
                  for grid in [(3, 3), (4, 3), (3, 4), (2, 2)]}
    assert overlapped == {(3, 3): 0, (4, 3): 1, (3, 4): 1, (2, 2): -1}
    shared = {grid: bound(run_fsdp_tp(layer, *grid), "forward", ["fsdp", "tp"], c, w)
              for grid in [(2, 2), (3, 2), (2, 3), (1, 3), (3, 1)]}
    assert shared == {(2, 2): 0, (3, 2): 1, (2, 3): 1, (1, 3): 0, (3, 1): 0}


# ---------------------------------------------------------------------------------------------
# The best grids, against enumeration (closed-form times, checked above)
# ---------------------------------------------------------------------------------------------

SETTINGS = [(Fraction(b), d_ff, Fraction(c), Fraction(w)) for b, d_ff, c, w in
            [(36, 24, 18, 1), (64, 12, 40, 3), (16, 40, 9, 2), (10, 6, 7, 5), (100, 8, 33, 1), (5, 90, 11, 4),
             (5, 90, 30, 4)]]
D = 12  # cancels out of every bound


def overlapped_fits(grid, b, d_ff, c, w) -> bool:
    comm = exact(par.fsdp_tp_forward_comm_time_overlapped, b, D, d_ff, grid.n_tp, grid.n_fsdp, w)
    return comm <= exact(par.fsdp_tp_forward_flops, b, D, d_ff, grid.n_tp, grid.n_fsdp) / c


def shared_slack(grid, b, d_ff, c, w):
    """Computation minus shared communication time: not communication-bound when >= 0."""
    comm = exact(par.fsdp_tp_forward_comm_time_shared, b, D, d_ff, grid.n_tp, grid.n_fsdp, w)
    return exact(par.fsdp_tp_forward_flops, b, D, d_ff, grid.n_tp, grid.n_fsdp) / c - comm


@pytest.mark.parametrize("b, d_ff, c, w", SETTINGS)
def test_the_largest_overlapped_grid_is_the_product_of_the_axes_bounds(b, d_ff, c, w):
    best = exact(par.fsdp_tp_max_grid_overlapped, b, d_ff, c, w)
    limit = best.n + 40
    best_splits = [par.fsdp_tp_best_grid_overlapped(n, b, D, d_ff, w) for n in range(1, limit)]
    assert max(grid.n for grid in best_splits if overlapped_fits(grid, b, d_ff, c, w)) == best.n
    assert overlapped_fits(best, b, d_ff, c, w)
    every_split = [par.Grid(t, n // t) for n in range(1, limit) for t in range(1, n + 1) if n % t == 0]
    assert max(g.n for g in every_split if overlapped_fits(g, b, d_ff, c, w)) == best.n


@pytest.mark.parametrize("b, d_ff, c, w", SETTINGS)
def test_the_largest_shared_grid(b, d_ff, c, w):
    best = exact(par.fsdp_tp_max_grid_shared, b, d_ff, c, w)
    assert best.n_tp >= 1 and best.n_fsdp >= 1 and shared_slack(best, b, d_ff, c, w) == 0
    a, g = c / (b * w), 2 * c / (3 * w * d_ff)
    if best.n_tp > 1 and best.n_fsdp > 1:
        assert best.n == (3 * w * b * d_ff + 3 * c * d_ff + 2 * c * b) ** 2 / (24 * c**2 * b * d_ff)
        assert exact(par.fsdp_tp_best_grid_shared, best.n, b, d_ff) == best  # the split of least communication
    # Every real split on a fine grid, each axis as large as the other allows: none has more devices.
    for step in range(401):
        n_fsdp = 1 + Fraction(step, 400) / a  # from 1 to 1 + 1 / a, where the FSDP axis alone uses up the compute
        n_tp = 1 + (1 - a * (n_fsdp - 1)) / g
        assert shared_slack(par.Grid(n_tp, n_fsdp), b, d_ff, c, w) == 0 and n_tp * n_fsdp <= best.n
    # Integer grids (each axis within its bound alone): none that fits is larger; a little more TP does not fit.
    grids = [par.Grid(t, f) for t in range(1, math.floor(1 + 1 / g) + 2) for f in range(1, math.floor(1 + 1 / a) + 2)]
    fitting = [grid for grid in grids if shared_slack(grid, b, d_ff, c, w) >= 0]
    assert max(grid.n for grid in fitting) == exact(par.fsdp_tp_max_integer_grid_shared, b, d_ff, c, w).n <= best.n
    assert shared_slack(par.Grid(best.n_tp + Fraction(1, 1000), best.n_fsdp), b, d_ff, c, w) < 0


@pytest.mark.parametrize("n", [1, 4, 9, 16, 36, 100])
def test_the_shared_split_of_a_given_n_minimises_the_sum(n):
    """B = 6, D_FF = 4: ``n_fsdp = sqrt(2 B n / (3 D_FF)) = sqrt(n)``; no rational split sends less."""
    b, d_ff, w = Fraction(6), 4, Fraction(2)
    best = exact(par.fsdp_tp_best_grid_shared, n, b, d_ff)
    assert best == par.Grid(math.isqrt(n), math.isqrt(n))
    least = exact(par.fsdp_tp_forward_comm_time_shared, b, D, d_ff, best.n_tp, best.n_fsdp, w)
    for n_fsdp in [Fraction(k, 8) for k in range(8, 8 * n + 1)]:
        assert exact(par.fsdp_tp_forward_comm_time_shared, b, D, d_ff, n / n_fsdp, n_fsdp, w) >= least


def test_the_grid_functions_take_floats():
    grid = par.fsdp_tp_max_grid_shared(16384, 28672, 989e12, 450e9)
    assert grid.n == pytest.approx((3 * 450e9 * 16384 * 28672 + 3 * 989e12 * 28672 + 2 * 989e12 * 16384) ** 2
                                   / (24 * 989e12**2 * 16384 * 28672))
    assert par.fsdp_tp_best_grid_shared(grid.n, 16384, 28672).n_fsdp == pytest.approx(grid.n_fsdp)


# ---------------------------------------------------------------------------------------------
# The writeup's numbers
# ---------------------------------------------------------------------------------------------


def numbers_in(text: str) -> list[float]:
    """``'20 × 8 = 160'`` -> ``[20.0, 8.0, 160.0]``; ``'8.45'`` -> ``[8.45]``."""
    return [float(part.replace(",", "")) for part in text.replace("×", " ").replace("=", " ").split()]


def test_the_writeup_section_prints_the_functions_values():
    from pipeline.sections import SECTIONS

    b, d, d_ff = par.EXAMPLE_LAYER["b"], par.EXAMPLE_LAYER["d"], par.EXAMPLE_LAYER["d_ff"]
    data = {name: SECTIONS[name](None, None)["n"] for name in
            ("alternate_ring_all_reduce", "data_parallel_calcs", "fsdp_calcs", "tp_calcs", "fsdp_tp_calcs")}
    ring = data["alternate_ring_all_reduce"]
    s = par.ffn_weight_bytes(d, d_ff)
    def ms(seconds):
        return [pytest.approx(1e3 * seconds, abs=0.05)]

    assert numbers_in(ring["alternate_ms"]) == ms(par.alternate_ring_all_reduce_time(s, 8, par.H100.w))
    assert numbers_in(ring["ring_ms"]) == ms(par.all_reduce_time(s, 8, par.H100.w))
    for key, dev in (("h100", par.H100), ("b200", par.B200)):
        dp_limit = par.dp_max_devices(b, dev.c, dev.w)
        dp = data["data_parallel_calcs"][key]
        assert numbers_in(dp["real"]) == [pytest.approx(dp_limit, abs=0.005)] and dp["int"] == str(math.floor(dp_limit))
        n = math.floor(dp_limit)
        backward = par.compute_time(par.dp_backward_flops(b, d, d_ff, n), dev.c)
        assert numbers_in(dp["compute_ms"]) == ms(backward)
        assert numbers_in(dp["comm_ms"]) == ms(par.dp_backward_comm_time(d, d_ff, n, dev.w))
        fsdp = data["fsdp_calcs"][key]
        assert fsdp["forward"]["int"] == fsdp["backward"]["int"] == str(math.floor(par.fsdp_max_devices_forward(
            b, dev.c, dev.w)))
        tp = data["tp_calcs"][key]
        assert numbers_in(tp["forward"]["real"]) == [pytest.approx(par.tp_max_devices_forward(d_ff, dev.c, dev.w),
                                                                   abs=0.005)]
        assert tp["backward"]["int"] == str(math.floor(par.tp_max_devices_backward(d_ff, dev.c, dev.w)))
        grids = data["fsdp_tp_calcs"][key]
        for text, grid in ((grids["overlapped"], par.fsdp_tp_max_grid_overlapped(b, d_ff, dev.c, dev.w)),
                           (grids["shared"], par.fsdp_tp_max_grid_shared(b, d_ff, dev.c, dev.w)),
                           (grids["shared_int"], par.fsdp_tp_max_integer_grid_shared(b, d_ff, dev.c, dev.w))):
            assert numbers_in(text) == [pytest.approx(x, abs=0.005) for x in (grid.n_tp, grid.n_fsdp, grid.n)]
    # The example's shared grid: fewer devices than the overlapped one, more than either axis alone.
    h100 = data["fsdp_tp_calcs"]["h100"]
    assert numbers_in(h100["shared"])[2] < numbers_in(h100["overlapped"])[2]
    assert numbers_in(h100["shared"])[2] > par.tp_max_devices_forward(d_ff, par.H100.c, par.H100.w)
