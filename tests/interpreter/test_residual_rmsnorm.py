"""The residual add fused into the RMSNorm, under the Triton CPU interpreter at small sizes (see ``conftest.py``).

As for the RMSNorm: the backward runs 8 programs of 4-row tiles here, so ragged row ranges are the rule, and
lowering ``MAX_BLOCK_N`` sends short rows down the tiled path (two sweeps, the sum recomputed in the second).
"""

from __future__ import annotations

import pytest
import torch

from cs336_systems.kernels import residual_rmsnorm, rmsnorm
from tests.interpreter.test_rmsnorm import _poison_outputs_and_allow_truncation  # noqa: F401  (autouse)
from tests.test_residual_rmsnorm import add_rms_norm_float64, check_against_float64, make_inputs

# bfloat16 has no tl.dot here to go wrong; its casts truncate (see conftest.py), which the fixture allows for.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 1), (2, 9, 17), (11, 1000), (37, 80)])
def test_matches_float64(shape, dtype):
    check_against_float64(*make_inputs(shape, dtype, "cpu"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, max_block_n", [((2, 9, 17), 16), ((11, 1000), 128), ((1, 300), 64)])
def test_tiled_rows_match_float64(shape, max_block_n, dtype, monkeypatch):
    monkeypatch.setattr(rmsnorm, "MAX_BLOCK_N", max_block_n)
    assert not rmsnorm._block_n(shape[-1])[1]
    check_against_float64(*make_inputs(shape, dtype, "cpu"))


def test_weight_gradient_over_many_rows():
    """400 rows over 8 programs: the per-program partial sums of dw and their reduction."""
    check_against_float64(*make_inputs((400, 33), torch.float32, "cpu"))


def test_gain_in_another_dtype():
    check_against_float64(*make_inputs((7, 48), torch.bfloat16, "cpu", weight_dtype=torch.float32))


@pytest.mark.parametrize("layout", ["transposed", "sliced", "strided_features"])
def test_non_contiguous_inputs(layout, monkeypatch):
    rows, n = 12, 40
    residual = torch.randn(3, rows, 64)[..., 10:10 + n]  # rows 64 apart: a view, read in place
    if layout == "transposed":  # (3, 12, 40) from a (12, 3, 40) tensor: no 2-D view, copied
        x = torch.randn(rows, 3, n).transpose(0, 1)
    elif layout == "sliced":
        x = torch.randn(3, rows, 50)[..., :n]
    else:  # features two apart: copied to a unit stride
        x = torch.randn(3, rows, 2 * n)[..., ::2]
    assert not x.is_contiguous() and not residual.is_contiguous()
    weight = 1 + 0.5 * torch.randn(n)
    dy = torch.randn(x.shape).transpose(-1, -2).contiguous().transpose(-1, -2)  # features strided
    ds = torch.randn(rows, 2, n)[:, 0].expand(3, rows, n)  # repeated along the first dimension
    check_against_float64(3 * x, residual, weight, dy, ds)
    monkeypatch.setattr(rmsnorm, "MAX_BLOCK_N", 16)  # the tiled path with the same strides
    check_against_float64(3 * x, residual, weight, None, None)


def test_one_gradient_flowing_in():
    """Only y used (ds zero) and only s used (dy zero): each alone reaches x and the residual."""
    x, residual, weight, dy, ds = make_inputs((6, 24), torch.float32, "cpu")
    for use_y, use_s in [(True, False), (False, True)]:
        leaves = [t.clone().requires_grad_() for t in (x, residual, weight)]
        s, y = residual_rmsnorm.fused_add_rmsnorm(*leaves)
        ((y * dy).sum() if use_y else (s * ds).sum()).backward()
        references = [t.double().requires_grad_() for t in (x, residual, weight)]
        s64, y64 = add_rms_norm_float64(*references)
        ((y64 * dy.double()).sum() if use_y else (s64 * ds.double()).sum()).backward()
        for leaf, reference in zip(leaves[:2], references[:2]):
            torch.testing.assert_close(leaf.grad.double(), reference.grad, rtol=1e-5, atol=1e-5)
        if use_y:
            torch.testing.assert_close(leaves[2].grad.double(), references[2].grad, rtol=1e-5, atol=1e-5)
        else:
            assert leaves[2].grad is None or (leaves[2].grad == 0).all()


def test_only_the_gradients_asked_for():
    x, residual, weight, dy, ds = make_inputs((9, 24), torch.float32, "cpu")
    references = [t.double().requires_grad_() for t in (x, residual, weight)]
    s64, y64 = add_rms_norm_float64(*references)
    torch.autograd.backward((s64, y64), (ds.double(), dy.double()))
    for needs in [(True, False, False), (False, True, False), (False, False, True), (True, True, False)]:
        leaves = [t.clone().requires_grad_(need) for t, need in zip((x, residual, weight), needs)]
        s, y = residual_rmsnorm.fused_add_rmsnorm(*leaves)
        torch.autograd.backward((s, y), (ds, dy))
        for leaf, reference, need in zip(leaves, references, needs):
            if need:
                torch.testing.assert_close(leaf.grad.double(), reference.grad, rtol=1e-5, atol=1e-5)
            else:
                assert leaf.grad is None


def test_saves_the_sum_gain_and_float32_inverse_rms():
    x, residual, weight, _, _ = make_inputs((4, 3, 20), torch.bfloat16, "cpu")
    s, y = residual_rmsnorm.fused_add_rmsnorm(x, residual, weight.requires_grad_())
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 3
    assert saved[0].data_ptr() == s.data_ptr() and saved[0].shape == s.shape  # the output itself, no copy
    rstd = saved[2]
    assert rstd.dtype == torch.float32 and rstd.shape == (12,)
    expected = torch.rsqrt(s.double().pow(2).mean(-1) + 1e-5).reshape(-1)
    torch.testing.assert_close(rstd.double(), expected, rtol=1e-5, atol=0)


def test_sum_rounds_as_a_separate_add():
    """The sum written is x + residual in x's dtype: exactly torch's in float32 and float16 (float16 rounds to
    nearest under the interpreter; only the casts to bfloat16 truncate)."""
    for dtype in (torch.float32, torch.float16):
        x, residual, weight, _, _ = make_inputs((5, 77), dtype, "cpu")
        s, _ = residual_rmsnorm.fused_add_rmsnorm(x, residual, weight)
        torch.testing.assert_close(s, x + residual, rtol=0, atol=0)


def test_outputs_changed_in_place():
    """y may be changed in place (not saved); s is saved, so changing it fails in backward instead of giving
    wrong gradients."""
    x, residual, weight, dy, _ = make_inputs((2, 3, 16), torch.float32, "cpu")
    leaf = x.clone().requires_grad_()
    s, y = residual_rmsnorm.fused_add_rmsnorm(leaf, residual, weight)
    y.mul_(2)
    y.backward(dy)
    reference = x.double().requires_grad_()
    (2 * add_rms_norm_float64(reference, residual, weight)[1]).backward(dy.double())
    torch.testing.assert_close(leaf.grad.double(), reference.grad, rtol=1e-5, atol=1e-5)
    s, y = residual_rmsnorm.fused_add_rmsnorm(x.clone().requires_grad_(), residual, weight)
    s.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)


@pytest.mark.parametrize("shape", [(0, 17), (2, 0, 17)])
def test_zero_rows(shape):
    x, residual = torch.randn(shape, requires_grad=True), torch.randn(shape, requires_grad=True)
    weight = torch.ones(17, requires_grad=True)
    s, y = residual_rmsnorm.fused_add_rmsnorm(x, residual, weight)
    assert s.shape == y.shape == shape
    (s.sum() + y.sum()).backward()
    assert x.grad.shape == residual.grad.shape == shape
    torch.testing.assert_close(weight.grad, torch.zeros(17), rtol=0, atol=0)


def test_operators_pass_opcheck():
    """Schema and shape functions of both operators (their autograd is the Function's)."""
    x, residual, weight, dy, ds = make_inputs((6, 40), torch.float32, "cpu")
    forward = torch.ops.cs336_systems.add_rmsnorm_forward.default
    for inputs in [(x, residual, weight, 1e-5, torch.float32), (x.half(), residual, weight, 1e-5, torch.float16)]:
        torch.library.opcheck(forward, inputs,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    s, _, rstd = forward(x, residual, weight, 1e-5, torch.float32)
    backward = torch.ops.cs336_systems.add_rmsnorm_backward.default
    for compute_dx, compute_dw in [(True, True), (False, True), (True, False)]:
        torch.library.opcheck(backward, (dy, ds, s, weight, rstd, compute_dx, compute_dw),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow
def test_torch_compile_traces_without_graph_breaks():
    """Under Dynamo the Function calls the operators: ``fullgraph=True`` fails on any graph break."""
    x, residual, weight, dy, ds = make_inputs((6, 3, 40), torch.float32, "cpu")

    def two_blocks(a, r, w):
        h, y = residual_rmsnorm.fused_add_rmsnorm(a, r, w)
        out, y2 = residual_rmsnorm.fused_add_rmsnorm(h, y * 2, w)
        return out, y2

    compiled = torch.compile(two_blocks, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (two_blocks, compiled):
        a, r, w = (t.clone().requires_grad_() for t in (x, residual, weight))
        torch.autograd.backward(fn(a, r, w), (ds, dy))
        results.append((a.grad, r.grad, w.grad))
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)
