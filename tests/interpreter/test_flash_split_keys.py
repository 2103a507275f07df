"""The portable forward with each query tile's keys split over programs (``split_forward``), under the Triton CPU
interpreter: against a float64 reference, for every number of parts (including parts that get no keys), causal or
not, ragged lengths, 3-D and 4-D inputs; and the rule that chooses the number of parts."""

from __future__ import annotations

import math

import pytest
import torch

from cs336_systems.attention.backends import triton as portable
from cs336_systems.attention.reference import reference_attention
from cs336_systems.kernels.launch import poisoned_outputs


@pytest.mark.parametrize("n_splits", [2, 7])  # 7: parts past the end of short sweeps stay empty
@pytest.mark.parametrize("shape, n_keys, is_causal", [
    ((1, 2, 53, 32), 53, True),
    ((2, 45, 16), 70, False),  # 3-D, more keys than queries
    ((1, 2, 45, 32), 70, True),  # causal on absolute indices: keys past the last query unseen
    ((1, 1, 70, 16), 45, True),  # causal, fewer keys than queries
    ((1, 2, 1, 32), 37, False),  # one query row
])
def test_split_forward_matches_float64_reference(shape, n_keys, is_causal, n_splits):
    generator = torch.Generator().manual_seed(n_splits * 100 + shape[-2])
    Q = torch.randn(shape, generator=generator)
    K = torch.randn(*shape[:-2], n_keys, shape[-1], generator=generator)
    V = torch.randn(*shape[:-2], n_keys, shape[-1], generator=generator)
    with poisoned_outputs():  # unwritten elements would be NaN
        O, L = portable.split_forward(Q, K, V, is_causal, 1 / math.sqrt(shape[-1]), n_splits)
    O_ref, L_ref = reference_attention(Q.double(), K.double(), V.double(), is_causal)
    torch.testing.assert_close(O.double(), O_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(L.double(), L_ref, rtol=1e-5, atol=1e-5)
    assert O.dtype == Q.dtype and L.dtype == torch.float32 and O.shape == Q.shape and L.shape == Q.shape[:-1]


def test_split_forward_refuses_split_head_dims_and_no_parts():
    Q = torch.randn(1, 8, 80)
    with pytest.raises(ValueError, match="power-of-two head dims, not 80"):
        portable.split_forward(Q, Q, Q, True, 0.1, 2)
    Q = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match="n_splits must be at least 1"):
        portable.split_forward(Q, Q, Q, True, 0.1, 0)


def test_key_splits_follow_the_heaviest_tile_against_an_even_share():
    # one causal head on 132 SMs in 64-query tiles (float32, d = 128): the last tile sweeps all keys
    assert portable.key_splits(2048, 2048, 1, 64, True, 132) == 4  # 8 by the ratio, parts of 512 keys at least
    assert portable.key_splits(4096, 4096, 1, 64, True, 132) == 4
    assert portable.key_splits(8192, 8192, 1, 64, True, 132) == 2
    assert portable.key_splits(16384, 16384, 1, 64, True, 132) == 1  # the heaviest tile is under twice a share
    assert portable.key_splits(2048, 2048, 1, 128, False, 132) == 4  # 16 equal tiles: 132 / 16 = 8, 512-key parts
    assert portable.key_splits(2048, 2048, 32, 64, True, 132) == 1  # many heads fill the GPU
    assert portable.key_splits(256, 256, 1, 64, True, 132) == 1  # too few keys to split


def test_calls_on_the_cpu_never_split():
    """The interpreter's CPU tensors take the plain kernels (the GPU tests check the split where it applies)."""
    Q = torch.randn(1, 4096, 16)
    assert portable.forward_key_splits(Q, Q, True) == 1 and portable.backward_splits(Q, Q) == 1


@pytest.mark.parametrize("n_parts", [2, 7])
@pytest.mark.parametrize("shape, n_keys, is_causal", [
    ((1, 2, 53, 32), 53, True),
    ((2, 45, 16), 70, False),
    ((1, 2, 45, 32), 70, True),  # causal, more keys than queries
    ((1, 1, 70, 16), 45, True),  # causal, fewer keys than queries
    ((1, 2, 37, 32), 21, False),  # fewer keys than queries
])
def test_split_backward_matches_float64_reference(shape, n_keys, is_causal, n_parts):
    generator = torch.Generator().manual_seed(n_parts * 100 + shape[-2])
    Q, dO = (torch.randn(shape, generator=generator) for _ in range(2))
    K, V = (torch.randn(*shape[:-2], n_keys, shape[-1], generator=generator) for _ in range(2))
    scale = 1 / math.sqrt(shape[-1])
    O, L = portable.forward(Q, K, V, is_causal, scale)
    with poisoned_outputs():
        grads = portable.split_backward(Q, K, V, O, L, dO, is_causal, scale, n_parts)
    inputs = [x.double().requires_grad_() for x in (Q, K, V)]
    reference_attention(*inputs, is_causal)[0].backward(dO.double())
    for grad, x, name in zip(grads, inputs, ("dQ", "dK", "dV")):
        torch.testing.assert_close(grad.double(), x.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert grad.dtype == torch.float32 and grad.shape == x.shape


def test_sweep_splits_fill_the_programs_the_gpu_holds():
    assert portable.sweep_splits(128, 4096, 264) == 2  # one head of 4096 in 32-row tiles: 128 programs, 2 parts
    assert portable.sweep_splits(64, 2048, 264) == 4
    assert portable.sweep_splits(256, 8192, 264) == 1
    assert portable.sweep_splits(8, 600, 264) == 1  # too few rows to split
