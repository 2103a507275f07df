"""The fused RMSNorm Triton kernels under the Triton CPU interpreter, at small sizes (see ``conftest.py``).

Under the interpreter the backward runs 4 programs (``launch.multiprocessors`` is 2), so several rows per
program and ragged row ranges are the rule; lowering ``MAX_BLOCK_N`` sends short rows down the tiled path.
"""

from __future__ import annotations

import pytest
import torch

from cs336_systems.kernels import rmsnorm
from cs336_systems.kernels.launch import interpreting, multiprocessors, poisoned_outputs
from tests import test_rmsnorm
from tests.test_rmsnorm import check_against_float64, make_inputs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _poison_outputs_and_allow_truncation(monkeypatch):
    # The interpreter casts float32 to bfloat16 by truncation (a GPU rounds to nearest): up to one
    # bfloat16 ulp, 2^-7 relative, instead of half of one.
    monkeypatch.setitem(test_rmsnorm.ERROR_FLOOR, torch.bfloat16, 2**-7)
    with poisoned_outputs():
        yield


def test_running_in_interpreter():
    assert interpreting()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 1), (2, 9, 17), (11, 1000), (5, 4099)])
def test_matches_float64(shape, dtype):
    check_against_float64(*make_inputs(shape, dtype, "cpu"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, max_block_n", [((2, 9, 17), 16), ((11, 1000), 128), ((5, 4099), 1024)])
def test_tiled_rows_match_float64(shape, max_block_n, dtype, monkeypatch):
    monkeypatch.setattr(rmsnorm, "MAX_BLOCK_N", max_block_n)
    assert not rmsnorm._block_n(shape[-1])[1]
    check_against_float64(*make_inputs(shape, dtype, "cpu"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_gradient_over_many_rows(dtype):
    """400 rows over 4 programs of up to 104 rows: the per-program partial sums and the final reduction."""
    check_against_float64(*make_inputs((400, 33), dtype, "cpu"))


@pytest.mark.parametrize("programs_per_sm", rmsnorm.FWD_GRIDS)
@pytest.mark.parametrize("shape", [(1, 768), (37, 80), (45, 1600)])
def test_forward_at_each_grid_size(shape, programs_per_sm, monkeypatch):
    """The forward's grid sizes the autotuner chooses from: a persistent loop over several tiles, and one program
    per tile (here 8 or 32 programs of 4-row tiles, or as many programs as tiles)."""
    fixed = rmsnorm.fixed_config
    monkeypatch.setattr(rmsnorm, "fixed_config", lambda kernel, *args: rmsnorm._fwd_config(
        rmsnorm.INTERPRETER_BLOCK_M, 4, programs_per_sm) if kernel == "fwd" else fixed(kernel, *args))
    x, weight, residual = make_inputs(shape, torch.float32, "cpu")
    for add in (False, True):  # the plain norm, and the residual added in
        y, total, rstd = torch.full_like(x, float("nan")), torch.full_like(x, float("nan")), torch.full(shape[:1], 0.0)
        rstd.fill_(float("nan"))
        rmsnorm.launch_rmsnorm_forward(x, weight, y, rstd, 1e-5, residual=residual if add else None,
                                       s=total if add else None)
        x64 = x.double() + residual.double() if add else x.double()
        rstd64 = torch.rsqrt(x64.pow(2).mean(-1) + 1e-5)
        torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-5, atol=0)
        torch.testing.assert_close(y.double(), x64 * rstd64[:, None] * weight.double(), rtol=1e-5, atol=1e-5)
        if add:
            torch.testing.assert_close(total.double(), x64, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 768), (6, 768), (67, 768), (37, 80), (1, 1600), (45, 1600)])
def test_persistent_grid_at_awkward_shapes(shape, dtype, prefetch, monkeypatch):
    """Here 8 programs of 4-row tiles in each kernel: a single row; fewer tiles than programs (the idle backward
    programs must write a zero partial row: the partial buffer starts as NaN too); a ragged last tile; programs
    looping over two or three tiles, some one more than others; rows of 80, 768 and 1600 features (tiles of 128, 1024, 2048). With and
    without the backward's prefetch of the next tile (off for long rows on a GPU)."""
    if not prefetch:
        monkeypatch.setattr(rmsnorm, "PREFETCH_MAX_ROW_BYTES", 0)
    n_rows = shape[0]
    assert multiprocessors(torch.device("cpu")) * rmsnorm.BWD_PROGRAMS_PER_SM == 8 and rmsnorm.INTERPRETER_BLOCK_M == 4
    check_against_float64(*make_inputs(shape, dtype, "cpu"))
    # The backward alone, each gradient by itself, against float64, from the forward's saved 1/rms.
    x, weight, dy = make_inputs(shape, dtype, "cpu")
    _, rstd = rmsnorm.rmsnorm_forward(x, weight, 1e-5)
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    test_rmsnorm.rms_norm_float64(x64, w64).backward(dy.double())
    for compute_dx, compute_dw in [(True, True), (True, False), (False, True)]:
        dx, dw = rmsnorm.rmsnorm_backward(dy, x, weight, rstd, compute_dx, compute_dw)
        assert (dx is not None) == compute_dx and (dw is not None) == compute_dw
        if compute_dx:
            assert dx.shape == (n_rows, shape[1]) and torch.isfinite(dx).all()
            torch.testing.assert_close(dx.double(), x64.grad, rtol=2e-3, atol=2e-3 * x64.grad.abs().max().item())
        if compute_dw:
            assert dw.dtype == weight.dtype and torch.isfinite(dw).all()
            torch.testing.assert_close(dw.double(), w64.grad, rtol=2e-3, atol=2e-3 * w64.grad.abs().max().item())


def test_mixed_dtypes_as_under_autocast():
    """A bfloat16 input with a float32 gain (and the reverse): output and dx in x's dtype, dw in the gain's."""
    check_against_float64(*make_inputs((7, 48), torch.bfloat16, "cpu", weight_dtype=torch.float32))
    check_against_float64(*make_inputs((7, 48), torch.float32, "cpu", weight_dtype=torch.float16))


@pytest.mark.parametrize("layout", ["transposed", "sliced", "strided_features"])
def test_non_contiguous_inputs(layout, monkeypatch):
    rows, n = 12, 40
    if layout == "transposed":  # (5, 12, 40) from a (12, 5, 40) tensor: no 2-D view, copied
        x = torch.randn(rows, 5, n).transpose(0, 1)
    elif layout == "sliced":  # every row a slice of a longer one: a view with row stride 64
        x = torch.randn(3, rows, 64)[..., :n]
    else:  # features two apart: copied to a unit stride
        x = torch.randn(rows, 2 * n)[:, ::2]
    assert not x.is_contiguous()
    weight = 1 + 0.5 * torch.randn(n)
    check_against_float64(3 * x, weight, torch.randn(x.shape).transpose(-1, -2).contiguous().transpose(-1, -2))
    monkeypatch.setattr(rmsnorm, "MAX_BLOCK_N", 16)  # the tiled path with the same strides
    check_against_float64(3 * x, weight, None)


def test_strided_gain():
    from tests.test_rmsnorm import rms_norm_float64

    x, _, dy = make_inputs((6, 30), torch.float32, "cpu")
    every_other = (1 + 0.5 * torch.randn(60)).requires_grad_()
    y = rmsnorm.fused_rms_norm(x, every_other[::2])
    y.backward(dy)
    reference_w = every_other.detach()[::2].double().requires_grad_()
    expected = rms_norm_float64(x, reference_w)
    expected.backward(dy.double())
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(every_other.grad[::2].double(), reference_w.grad, rtol=1e-5, atol=1e-5)
    assert (every_other.grad[1::2] == 0).all()


def test_expanded_output_gradient_from_sum():
    """``y.sum().backward()`` sends an all-stride-0 output gradient."""
    check_against_float64(*make_inputs((6, 50), torch.float32, "cpu")[:2], None)


@pytest.mark.parametrize("shape", [(0, 17), (2, 0, 17)])
def test_zero_rows(shape):
    x = torch.randn(shape, requires_grad=True)
    weight = torch.ones(17, requires_grad=True)
    y = rmsnorm.fused_rms_norm(x, weight)
    assert y.shape == shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == shape
    torch.testing.assert_close(weight.grad, torch.zeros(17), rtol=0, atol=0)


def test_only_the_gradients_asked_for():
    x, weight, dy = make_inputs((9, 24), torch.float32, "cpu")
    reference_x = x.double().requires_grad_()
    reference_w = weight.double().requires_grad_()
    from tests.test_rmsnorm import rms_norm_float64

    rms_norm_float64(reference_x, reference_w).backward(dy.double())
    # Gain frozen: dx only.
    x_leaf = x.clone().requires_grad_()
    rmsnorm.fused_rms_norm(x_leaf, weight).backward(dy)
    torch.testing.assert_close(x_leaf.grad.double(), reference_x.grad, rtol=1e-5, atol=1e-6)
    # Input without gradient (e.g. the first norm over embeddings that are frozen): dw only.
    w_leaf = weight.clone().requires_grad_()
    rmsnorm.fused_rms_norm(x, w_leaf).backward(dy)
    torch.testing.assert_close(w_leaf.grad.double(), reference_w.grad, rtol=1e-5, atol=1e-5)


def test_saves_input_gain_and_float32_inverse_rms():
    x, weight, _ = make_inputs((4, 3, 20), torch.bfloat16, "cpu")
    y = rmsnorm.fused_rms_norm(x, weight.requires_grad_())
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 3
    rstd = saved[2]
    assert rstd.dtype == torch.float32 and rstd.shape == (12,)
    expected = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-5).reshape(-1)
    torch.testing.assert_close(rstd.double(), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("autocast_output", [False, True])
def test_transformer_lm_with_fused_rmsnorm_matches_plain(autocast_output):
    """float32; and with ``autocast_output`` under bfloat16 autocast, where the norms hand bf16 to the matmuls."""
    from cs336_basics.model import BasicsTransformerLM
    from tests._flash_checks import relative_error

    model = BasicsTransformerLM(vocab_size=50, context_length=16, d_model=48, num_layers=2, num_heads=2, d_ff=96)
    token_ids = torch.randint(0, 50, (2, 12))

    def logits_and_grads():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_output):
            logits = model(token_ids)
        logits.float().square().mean().backward()
        return logits.detach().float(), {name: p.grad.clone() for name, p in model.named_parameters()}

    plain_logits, plain_grads = logits_and_grads()
    rmsnorm.use_fused_rmsnorm(model, autocast_output=autocast_output)
    assert sum(isinstance(m, rmsnorm.FusedRMSNorm) for m in model.modules()) == 5
    logits, grads = logits_and_grads()
    if not autocast_output:
        torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-5)
        for name, grad in plain_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        return
    # bf16 matmuls; the interpreter's truncating casts move some norm outputs by one bf16 ulp.
    assert relative_error(logits, plain_logits) < 1e-2
    for name, grad in plain_grads.items():
        assert relative_error(grads[name], grad) < 3e-2, name


@pytest.mark.slow
def test_torch_compile_traces_without_graph_breaks():
    """Under Dynamo the Function calls the custom ops: ``fullgraph=True`` fails on any graph break."""
    x, weight, dy = make_inputs((6, 3, 40), torch.float32, "cpu")

    def norm_of_sum(a, b, w):
        return rmsnorm.fused_rms_norm(a + b, w) * 2 + rmsnorm.fused_rms_norm(a, w, out_dtype=torch.float16)

    compiled = torch.compile(norm_of_sum, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (norm_of_sum, compiled):
        a, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        fn(a, x, w).backward(dy)
        results.append((a.grad, w.grad))
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)


def test_autocast_output_writes_the_autocast_dtype():
    """Under autocast a float32 input gives a bfloat16 output: the plain output rounded once."""
    from tests.test_rmsnorm import plain_rms_norm

    x, weight, dy = make_inputs((5, 3, 40), torch.float32, "cpu")
    norm = rmsnorm.FusedRMSNorm(40)
    norm.load_state_dict({"weight": weight})
    norm.autocast_output = True
    assert norm(x).dtype == torch.float32  # autocast off: as the plain module
    x_leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x_leaf)
    assert y.dtype == torch.bfloat16
    expected = plain_rms_norm(x, weight)
    # One bfloat16 ulp (2^-7 relative): the interpreter truncates where a GPU rounds to nearest.
    torch.testing.assert_close(y.float(), expected, rtol=2**-7, atol=1e-6)
    y.backward(dy.bfloat16())
    reference_x = x.clone().requires_grad_()
    plain_rms_norm(reference_x, weight).backward(dy.bfloat16().float())
    assert x_leaf.grad.dtype == torch.float32
    torch.testing.assert_close(x_leaf.grad, reference_x.grad, rtol=1e-5, atol=1e-5)
