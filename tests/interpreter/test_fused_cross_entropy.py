"""The fused cross-entropy's Triton row kernel under the Triton CPU interpreter, at small sizes (see
``conftest.py``).

Lowering ``MAX_BLOCK_V`` to 128 cuts every row into several tiles, the last one ragged (V = 1000: 7 full tiles and
104 columns; V = 257: 2 and 1); at the default (the tests without it) a row is one masked tile.
"""

from __future__ import annotations

import pytest
import torch

from cs336_systems.kernels import cross_entropy
from cs336_systems.kernels.launch import interpreting
from tests import test_fused_cross_entropy
from tests.test_fused_cross_entropy import check_against_float64, make_inputs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PYTORCH_ROWS_STEP = cross_entropy._rows_step_torch
PYTORCH_BF16_FLOOR = test_fused_cross_entropy.ERROR_FLOOR[torch.bfloat16]


@pytest.fixture(autouse=True)
def _triton_only_and_allow_truncation(monkeypatch):
    def refuse(*args):
        raise AssertionError("the PyTorch row step ran instead of the Triton kernel")

    monkeypatch.setattr(cross_entropy, "_rows_step_torch", refuse)
    # The interpreter casts float32 to 16 bits by truncation (a GPU rounds to nearest): up to one ulp of the logits
    # gradient, 2^-7 relative in bfloat16, instead of half of one.
    monkeypatch.setitem(test_fused_cross_entropy.ERROR_FLOOR, torch.bfloat16, 2**-7)


def test_running_in_interpreter():
    assert interpreting()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, d, vocab, chunk", [(1, 48, 257, None), (37, 48, 1000, 16), (37, 16, 257, 5)])
def test_matches_float64_in_tiles(n, d, vocab, chunk, dtype, monkeypatch):
    monkeypatch.setattr(cross_entropy, "MAX_BLOCK_V", 128)
    check_against_float64(*make_inputs(n, d, vocab, dtype), chunk_tokens=chunk, grad_scale=3.0)


@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_ignore_index(ignore_index, monkeypatch):
    monkeypatch.setattr(cross_entropy, "MAX_BLOCK_V", 128)
    hidden, weight, targets = make_inputs(37, 48, 257, torch.float32)
    targets[::3] = ignore_index
    check_against_float64(hidden, weight, targets, chunk_tokens=16, ignore_index=ignore_index)


def test_mixed_dtypes_as_under_autocast():
    check_against_float64(*make_inputs(37, 48, 1000, torch.bfloat16, weight_dtype=torch.float32), chunk_tokens=16)


def test_loss_alone_skips_the_gradient_pass():
    """Under no_grad the kernel runs with WRITE_GRAD off: the same loss."""
    hidden, weight, targets = make_inputs(37, 48, 1000, torch.float32)
    with torch.no_grad():
        loss = cross_entropy.fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens=16)
    expected = test_fused_cross_entropy.plain_loss(torch.float64)(hidden.double(), weight.double(), targets)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)


def test_out_of_range_targets_and_all_ignored():
    hidden, weight, targets = make_inputs(6, 8, 257, torch.float32)
    targets[2] = 257
    hidden.requires_grad_()
    loss = cross_entropy.fused_linear_cross_entropy(hidden, weight, targets)
    assert loss.isnan()
    loss.backward()
    assert hidden.grad[2].isnan().all() and not hidden.grad[[0, 1, 3, 4, 5]].isnan().any()
    hidden.grad = None
    loss = cross_entropy.fused_linear_cross_entropy(hidden, weight, torch.full_like(targets, -100))
    assert loss.isnan()
    loss.backward()
    assert (hidden.grad == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_pytorch_row_step_matches_float64(dtype, monkeypatch):
    """The row step CPU tensors take when the kernels are compiled (no interpreter): with the interpreter on, the
    CPU tests of ``tests/test_fused_cross_entropy.py`` run the Triton row kernel instead, so the PyTorch one is
    checked here, dispatched to as it would be."""
    def refuse(*args):
        raise AssertionError("the Triton row kernel ran instead of the PyTorch row step")

    monkeypatch.setattr(cross_entropy, "_rows_step_torch", PYTORCH_ROWS_STEP)
    monkeypatch.setattr(cross_entropy, "_rows_step_triton", refuse)
    monkeypatch.setattr(cross_entropy, "interpreting", lambda: False)
    monkeypatch.setitem(test_fused_cross_entropy.ERROR_FLOOR, torch.bfloat16, PYTORCH_BF16_FLOOR)  # rounds to nearest
    check_against_float64(*make_inputs(37, 48, 1000, dtype), chunk_tokens=16, grad_scale=3.0)
