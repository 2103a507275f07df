"""Head dims 48, 80 and 96 in the portable Triton kernels, held as two power-of-two column parts (80 = 64 + 16),
under the Triton CPU interpreter at small sizes; and where the operator pads (head dims no kernel holds).

float32 and float16 only: the interpreter's ``tl.dot`` multiplies the raw bits of bfloat16 values. The interpreter's
small unequal tiles (``INTERPRETER_CONFIGS``) make these lengths cover full, ragged, diagonal and skipped tiles.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from cs336_systems.attention import op
from cs336_systems.attention.backends import hopper
from cs336_systems.attention.backends import triton as portable
from cs336_systems.attention.backends.common import head_dim_parts
from tests._flash_checks import QUANTITIES, make_qkv, relative_error, run_function, run_reference
from tests.interpreter.test_attention import TOLERANCE, _poison_outputs, check_matches_float64_reference  # noqa: F401


def test_split_head_dims_are_two_powers_of_two_of_at_least_16():
    assert [d for d in range(8, 129, 8) if d in portable.HEAD_DIMS] == [16, 32, 48, 64, 80, 96, 128]
    assert {d: head_dim_parts(d) for d in (16, 48, 64, 80, 96, 128)} == {
        16: (16, 0), 48: (32, 16), 64: (64, 0), 80: (64, 16), 96: (64, 32), 128: (128, 0)}
    for d in portable.HEAD_DIMS:
        first, second = head_dim_parts(d)
        assert first + second == d and first >= 16 and (second == 0 or 16 <= second < first)
        assert all(part & (part - 1) == 0 for part in (first, second))


# (batch, heads or None for 3-D, n_queries, n_keys, d, is_causal, dtype)
CASES = [
    (1, 2, 37, 53, 80, True, torch.float32),
    (2, None, 37, 53, 80, False, torch.float16),
    (1, 2, 1, 53, 80, True, torch.float32),  # one query row
    (2, 2, 53, 37, 96, True, torch.float16),
    (1, 3, 37, 21, 96, False, torch.float32),
    (2, None, 37, 53, 48, True, torch.float16),
    (1, 2, 21, 37, 48, False, torch.float32),
]


@pytest.mark.parametrize("batch, heads, n_queries, n_keys, d, is_causal, dtype", CASES)
def test_split_head_dims_match_float64_reference(batch, heads, n_queries, n_keys, d, is_causal, dtype):
    check_matches_float64_reference(batch, heads, n_queries, n_keys, d, is_causal, dtype)


def test_split_head_dim_of_non_contiguous_inputs():
    """Heads-from-features layout (as the model's rearrange gives) and a transposed view, d = 80."""
    batch, seq, heads, d = 2, 37, 2, 80
    Q = torch.randn(batch, seq, heads, d).transpose(1, 2).requires_grad_()  # (batch, heads, seq, d), strided
    K = torch.randn(batch, seq, heads, d).transpose(1, 2).requires_grad_()
    V = torch.randn(batch, heads, d, seq).transpose(-1, -2).requires_grad_()  # unit stride broken along d
    assert not (Q.is_contiguous() or K.is_contiguous() or V.is_contiguous())
    dO = torch.randn(batch, seq, heads, d).transpose(1, 2)
    result = run_function(op.FlashAttention2Triton, Q, K, V, True, dO)
    reference = run_reference(Q, K, V, True, dO)
    for name in QUANTITIES:
        assert relative_error(result[name], reference[name]) <= TOLERANCE[torch.float32], name


def _recorded_pads(monkeypatch) -> list[int]:
    """The widths the operator pads tensors to from now on."""
    widths = []
    pad = op._pad

    def recording_pad(x, head_dim):
        widths.append(head_dim)
        return pad(x, head_dim)

    monkeypatch.setattr(op, "_pad", recording_pad)
    return widths


def test_portable_kernels_take_split_head_dims_unpadded_and_pad_the_others_to_the_next(monkeypatch):
    """d = 80 reaches the kernels as it is; d = 72 is padded to 80 (not 128), with the scale of the true d."""
    widths = _recorded_pads(monkeypatch)
    Q, K, V = make_qkv(1, 2, 21, 37, 80, torch.float32, "cpu")
    run_function(op.FlashAttention2Triton, Q, K, V, True, torch.randn(Q.shape))
    assert widths == []
    Q, K, V = make_qkv(1, 2, 21, 37, 72, torch.float32, "cpu")
    dO = torch.randn(Q.shape)
    result = run_function(op.FlashAttention2Triton, Q, K, V, True, dO)
    assert widths == [80] * 3 + [80] * 5  # Q, K, V; then Q, K, V, O, dO
    reference = run_reference(Q, K, V, True, dO)
    for name in QUANTITIES:
        assert relative_error(result[name], reference[name]) <= TOLERANCE[torch.float32], name


def test_hopper_kernels_get_split_head_dims_unpadded(monkeypatch):
    """Where the Hopper backend is chosen, the forward and the backward get d = 80 as it is (their kernels hold
    64 + 16 columns) and d = 72 padded to 80, each with the scale of the true d."""
    widths = _recorded_pads(monkeypatch)
    seen = []

    def hopper_forward(Q, K, V, is_causal, sm_scale):
        seen.append((Q.shape[-1], K.shape[-1], V.shape[-1], sm_scale))
        return torch.zeros_like(Q), torch.zeros(Q.shape[:-1])

    def hopper_backward(Q, K, V, O, L, dO, is_causal, sm_scale):
        seen.append((Q.shape[-1], K.shape[-1], V.shape[-1], sm_scale))
        return torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)

    monkeypatch.setattr(hopper, "forward", hopper_forward)
    monkeypatch.setattr(hopper, "backward", hopper_backward)
    monkeypatch.setattr(op, "choose_backend", lambda *args: hopper)
    # a cache of its own, so that the choices made here are not kept past the test
    monkeypatch.setattr(op, "route", functools.lru_cache(maxsize=8)(op.route.__wrapped__))
    Q, K, V = (torch.randn(1, 2, 21, 80) for _ in range(3))
    O, L = op.attention_forward(Q, K, V, True)
    grads = op.attention_backward(Q, K, V, O, L, torch.randn_like(O), True)
    assert seen == [(80, 80, 80, 80 ** -0.5)] * 2 and widths == [] and O.shape == grads[0].shape == (1, 2, 21, 80)
    Q, K, V = (torch.randn(1, 2, 21, 72) for _ in range(3))
    O, L = op.attention_forward(Q, K, V, True)
    grads = op.attention_backward(Q, K, V, O, L, torch.randn_like(O), True)
    assert seen[2:] == [(80, 80, 80, 1 / math.sqrt(72))] * 2 and widths == [80] * 3 + [80] * 5
    assert O.shape == grads[0].shape == (1, 2, 21, 72)
