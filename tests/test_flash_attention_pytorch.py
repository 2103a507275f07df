"""The tiled PyTorch FlashAttention-2 against a float64 reference, gradients included.

Runs on CPU. The backward is ``torch.compile``d: the first call compiles for ~15-30 s, later shapes
reuse the graph (``dynamic=True``), except for sizes of 1 and for the other value of ``is_causal``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cs336_systems.attention import flash_pytorch
from cs336_systems.attention.flash_pytorch import FlashAttention2PyTorch, flash_attention_forward_tiled
from cs336_systems.attention.op import check_is_causal
from tests import adapters
from tests._flash_checks import QUANTITIES, check_sum_backward, make_qkv, relative_error, run_function, run_reference

# (batch, heads or None for 3-D, n_queries, n_keys, d, is_causal)
CASES = [
    (2, None, 17, 17, 16, False),
    (1, 2, 100, 100, 32, True),
    (2, None, 129, 129, 64, False),
    (1, 2, 33, 70, 16, True),
    (1, 2, 70, 33, 16, True),
    (2, None, 48, 100, 32, False),
    (1, 3, 64, 64, 128, True),
    (2, None, 1, 40, 16, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("batch, heads, n_queries, n_keys, d, is_causal", CASES)
def test_matches_float64_reference(batch, heads, n_queries, n_keys, d, is_causal):
    Q, K, V = make_qkv(batch, heads, n_queries, n_keys, d, torch.float32, "cpu")
    dO = torch.randn(Q.shape)
    result = run_function(FlashAttention2PyTorch, Q, K, V, is_causal, dO)
    reference = run_reference(Q, K, V, is_causal, dO)
    for name in QUANTITIES:
        assert result[name].dtype == torch.float32
        assert relative_error(result[name], reference[name]) <= 1e-5, name


@pytest.mark.parametrize("is_causal", [False, True])
def test_grader_contract(is_causal):
    """The grader's shapes and check, through ``tests/adapters.py``: exactly one saved tensor of shape
    (batch, n_queries), the logsumexp, and everything within rtol = atol = 1e-2 of the reference."""
    function = adapters.get_flashattention_autograd_function_pytorch()
    Q, K, V = make_qkv(4, None, 128, 128, 64, torch.float32, "cpu")
    dO = torch.randn(Q.shape)
    result = run_function(function, Q, K, V, is_causal, dO)
    reference = run_reference(Q, K, V, is_causal, dO, dtype=torch.float32)
    assert result["L"].shape == (4, 128)
    for name in QUANTITIES:
        torch.testing.assert_close(result[name], reference[name], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("query_tile_size, key_tile_size", [(16, 16), (16, 48), (64, 16)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_any_tile_sizes(query_tile_size, key_tile_size, is_causal):
    """Unequal tiles and lengths that are not multiples of them: every diagonal and ragged case."""
    Q, K, V = make_qkv(2, 2, 75, 75, 16, torch.float32, "cpu")
    O, L = flash_attention_forward_tiled(Q, K, V, is_causal, query_tile_size, key_tile_size)
    reference = run_reference(Q, K, V, is_causal, torch.zeros(Q.shape))
    assert relative_error(O, reference["O"]) <= 1e-5
    assert relative_error(L, reference["L"]) <= 1e-5


def test_low_precision_inputs_give_gradients_in_their_dtype():
    Q, K, V = make_qkv(2, 2, 40, 40, 32, torch.bfloat16, "cpu")
    dO = torch.randn(Q.shape).to(torch.bfloat16)
    result = run_function(FlashAttention2PyTorch, Q, K, V, True, dO)
    reference = run_reference(Q, K, V, True, dO)
    for name in QUANTITIES:
        assert result[name].dtype == (torch.float32 if name == "L" else torch.bfloat16)
        assert relative_error(result[name], reference[name]) <= 1e-2, name


def test_expanded_output_gradient_from_sum():
    check_sum_backward(FlashAttention2PyTorch)


def test_rejects_invalid_inputs():
    Q, K, V = make_qkv(2, 2, 20, 24, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="same length"):
        FlashAttention2PyTorch.apply(Q, K, V[..., :20, :], False)
    with pytest.raises(ValueError, match="batch"):
        FlashAttention2PyTorch.apply(Q[:1], K, V, False)
    with pytest.raises(TypeError, match="one dtype"):
        FlashAttention2PyTorch.apply(Q, K.double(), V, False)
    with pytest.raises(ValueError, match="at least 16"):
        flash_attention_forward_tiled(Q, K, V, False, 8, 16)
    with pytest.raises(ValueError, match="head dimension d must be positive"):
        FlashAttention2PyTorch.apply(Q[..., :0], K[..., :0], V[..., :0], False)


@pytest.mark.parametrize("value", ["no", 1, None, torch.tensor(True), np.bool_(True)])
def test_is_causal_must_be_a_bool(value):
    Q, K, V = make_qkv(1, None, 16, 16, 16, torch.float32, "cpu")
    with pytest.raises(TypeError, match="is_causal must be True or False"):
        FlashAttention2PyTorch.apply(Q, K, V, value)
    assert check_is_causal(False) is False and check_is_causal(True) is True


def test_first_cpu_backward_announces_its_compilation(monkeypatch, capsys):
    """The first backward compiles silently for ~25 s on a CPU: it says so first (once per process)."""
    monkeypatch.setattr(flash_pytorch, "_compiled_backward", flash_pytorch.flash_attention_backward)
    monkeypatch.setattr(flash_pytorch, "_compile_announced", False)
    for _ in range(2):
        Q, K, V = make_qkv(1, None, 16, 16, 16, torch.float32, "cpu")
        FlashAttention2PyTorch.apply(Q, K, V, True).sum().backward()
    assert capsys.readouterr().err.count("compiling the backward") == 1
