"""The residual add fused into the RMSNorm (``cs336_systems.kernels.residual_rmsnorm``) against a float64
reference: through the Triton CPU interpreter (``tests/interpreter/test_residual_rmsnorm.py``) and on a GPU; the
input checks, and the kernels' residual variants compiled for sm_90 without spills."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests._flash_checks import relative_error
from tests.test_rmsnorm import (  # noqa: F401  (fixed_launch: the same fixture)
    ERROR_FACTOR,
    ERROR_FLOOR,
    GPU_SHAPES,
    assert_candidates_compile_without_spills,
    fixed_launch,
    plain_rms_norm,
)

QUANTITIES = ("s", "y", "dx", "dresidual", "dw")


def add_rms_norm_float64(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    s = x.double() + residual.double()
    return s, s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.double()


def plain_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """The model's two steps: the add in x's dtype, then ``cs336_basics.model.RMSNorm`` of the sum."""
    s = x + residual
    return s, plain_rms_norm(s, weight, eps)


def run(add_norm, x: Tensor, residual: Tensor, weight: Tensor, dy: Tensor | None, ds: Tensor | None
        ) -> dict[str, Tensor]:
    """s, y, and the gradients of x, the residual and the gain for the output gradients dy and ds (the sums of
    y and s when None)."""
    x, residual, weight = (t.detach().clone().requires_grad_() for t in (x, residual, weight))
    s, y = add_norm(x, residual, weight)
    loss = (y.sum() if dy is None else (y * dy).sum()) + (s.sum() if ds is None else (s * ds).sum())
    loss.backward()
    return {"s": s.detach(), "y": y.detach(), "dx": x.grad, "dresidual": residual.grad, "dw": weight.grad}


def check_against_float64(x: Tensor, residual: Tensor, weight: Tensor, dy: Tensor | None = None,
                          ds: Tensor | None = None) -> None:
    """Both outputs and the three gradients of the fused add + RMSNorm against float64, with an error at most
    about the plain add and RMSNorm's at the same precision; dtypes as theirs."""
    from cs336_systems.kernels.residual_rmsnorm import fused_add_rmsnorm

    ours = run(fused_add_rmsnorm, x, residual, weight, dy, ds)
    plain = run(plain_add_rms_norm, x, residual, weight, dy, ds)
    as_double = [None if t is None else t.double() for t in (dy, ds)]
    reference = run(add_rms_norm_float64, x.double(), residual.double(), weight.double(), *as_double)
    for name in QUANTITIES:
        value = ours[name]
        assert value.dtype == plain[name].dtype == (weight.dtype if name == "dw" else x.dtype), name
        assert value.shape == reference[name].shape, name
        assert torch.isfinite(value).all(), f"{name} has elements that were never written"
        error, plain_error = relative_error(value, reference[name]), relative_error(plain[name], reference[name])
        floor = max(ERROR_FLOOR[x.dtype], ERROR_FLOOR[weight.dtype]) if name == "dw" else ERROR_FLOOR[x.dtype]
        assert error <= ERROR_FACTOR * plain_error + floor, f"{name}: relative error {error:.2e}, plain {plain_error:.2e}"


def make_inputs(shape, dtype, device, weight_dtype=None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x, a residual, a gain around 1, and the gradients dy of the norm's output and ds of the sum."""
    x = (2.0 * torch.randn(shape, device=device)).to(dtype)
    residual = (2.0 * torch.randn(shape, device=device)).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], device=device)).to(weight_dtype or dtype)
    dy, ds = (torch.randn(shape, device=device).to(dtype) for _ in range(2))
    return x, residual, weight, dy, ds


def test_rejects_mismatched_inputs():
    """Checked before any kernel: the errors are the same with kernels interpreted or compiled."""
    from cs336_systems.kernels.residual_rmsnorm import fused_add_rmsnorm

    x, weight = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(ValueError, match="one shape"):
        fused_add_rmsnorm(x, torch.randn(4, 7), weight)
    with pytest.raises(ValueError, match="one shape"):
        fused_add_rmsnorm(x, torch.randn(8), weight)  # no broadcasting
    with pytest.raises(TypeError, match="int64 for residual"):
        fused_add_rmsnorm(x, x.long(), weight)
    with pytest.raises(TypeError, match="output dtype torch.float64"):
        fused_add_rmsnorm(x, x, weight, out_dtype=torch.float64)
    with pytest.raises(ValueError, match="last dimension of x must match"):
        fused_add_rmsnorm(x, x, torch.ones(7))
    with pytest.raises(TypeError, match="int64 for x"):
        fused_add_rmsnorm(x.long(), x.long(), weight)
    with pytest.raises(TypeError, match="float64 for weight"):
        fused_add_rmsnorm(x, x, weight.double())
    with pytest.raises(ValueError, match="zero features"):
        fused_add_rmsnorm(torch.randn(4, 0), torch.randn(4, 0), torch.ones(0))


@pytest.mark.compiled_kernels
def test_rejects_cpu_tensors_when_compiled():
    from cs336_systems.kernels.residual_rmsnorm import fused_add_rmsnorm

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the kernels take its tensors")
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fused_add_rmsnorm(x, x, torch.ones(8))


@pytest.mark.compiled_kernels
def test_operators_are_triton_ops_when_compiled():
    """So that Inductor emits their launches in a compiled graph (under the interpreter they are opaque)."""
    from torch._library.triton import triton_ops_to_kernels

    from cs336_systems.kernels import residual_rmsnorm  # noqa: F401 (registers the operators)
    from cs336_systems.kernels.launch import interpreting

    assert not interpreting()
    for name in ("add_rmsnorm_forward", "add_rmsnorm_backward"):
        assert f"cs336_systems::{name}" in triton_ops_to_kernels


@pytest.mark.compiled_kernels
@pytest.mark.parametrize("n_cols", [pytest.param(n, marks=() if n == 768 else pytest.mark.slow)
                                    for n in (80, 768, 2560, 9000)])
def test_residual_variants_compile_for_h100_without_spills(n_cols):
    """Ahead-of-time compile for sm_90 (see ``_flash_aot.py``) of the residual forward (a residual tile loaded per
    step beside the prefetched input) and the backward that adds ``ds``, at the fixed configuration and the
    heaviest autotune candidate per warp count."""
    from cs336_systems.kernels.launch import interpreting
    from tests._flash_aot import nvidia_toolchain_available

    if interpreting() or not nvidia_toolchain_available():
        pytest.skip("needs Triton's NVIDIA backend and ptxas, outside the interpreter")
    assert_candidates_compile_without_spills(n_cols, residual=True)


# ---------------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_matches_float64_on_gpu(shape, dtype, fixed_launch):
    check_against_float64(*make_inputs(shape, dtype, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("autotune", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_on_gpu(dtype, autotune):
    from cs336_systems.kernels.rmsnorm import RMSNORM_CONFIG

    with RMSNORM_CONFIG.use(autotune=autotune):
        for _ in range(2):  # the second time through the launch cache
            check_against_float64(*make_inputs((65536 + 5, 768), dtype, "cuda"))
            check_against_float64(*make_inputs((3000, 40), dtype, "cuda", weight_dtype=torch.float32))


@pytest.mark.gpu
def test_non_contiguous_inputs_and_expanded_gradients_on_gpu(fixed_launch):
    x = 3 * torch.randn(40, 8, 1024, device="cuda").transpose(0, 1)
    residual = torch.randn(8, 40, 2048, device="cuda")[..., 512:1536]  # rows 2048 apart
    weight = 1 + 0.5 * torch.randn(1024, device="cuda")
    check_against_float64(x, residual, weight)
    wide = torch.randn(2, 300, 2048, device="cuda")
    check_against_float64(3 * wide[..., :1600], wide[..., 300:1900], 1 + torch.rand(1600, device="cuda"))


@pytest.mark.gpu
def test_torch_compile_keeps_one_graph_on_gpu(fixed_launch):
    from cs336_systems.kernels.residual_rmsnorm import fused_add_rmsnorm

    x, residual, weight, dy, ds = make_inputs((4, 64, 768), torch.bfloat16, "cuda")

    def block_tail(a, r, w):
        s, y = fused_add_rmsnorm(a, r, w)
        return s, y * 2

    compiled = torch.compile(block_tail, fullgraph=True)
    results = []
    for fn in (block_tail, compiled):
        a, r, w = (t.clone().requires_grad_() for t in (x, residual, weight))
        s, y = fn(a, r, w)
        torch.autograd.backward((s, y), (ds, dy))
        results.append((s, y, a.grad, r.grad, w.grad))
    # Inductor fuses the surrounding product and the gradient sums into its own kernels, which may round an element
    # of a bf16 result the other way: one bf16 ulp apart is the same computation
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager, rtol=2**-7, atol=2**-7)


@pytest.mark.gpu
def test_torch_compile_keeps_one_graph_with_a_bf16_branch_on_a_float32_stream_on_gpu(fixed_launch):
    """The blocks' use under autocast, compiled with ``fullgraph=True``: a bf16 branch onto a float32 stream, the norm
    written in bf16, and a last call whose sum is unused (no gradient arrives for it)."""
    from cs336_systems.kernels.residual_rmsnorm import fused_add_rmsnorm

    x, _, weight, _, _ = make_inputs((4, 64, 768), torch.bfloat16, "cuda", weight_dtype=torch.float32)
    stream, dy = torch.randn(4, 64, 768, device="cuda"), torch.randn(4, 64, 768, device="cuda").bfloat16()

    def two_norms(a, r, w):
        s, y = fused_add_rmsnorm(a, r, w, out_dtype=torch.bfloat16)
        return fused_add_rmsnorm(y, s, w, out_dtype=torch.bfloat16)[1]

    compiled = torch.compile(two_norms, fullgraph=True)
    results = []
    for fn in (two_norms, compiled):
        a, r, w = (t.clone().requires_grad_() for t in (x, stream, weight))
        y = fn(a, r, w)
        y.backward(dy)
        assert (y.dtype, a.grad.dtype, r.grad.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
        results.append((y, a.grad, r.grad, w.grad))
    # the float32 stream's gradient passes through bf16 norms: an element rounded the other way by Inductor's fused
    # sums moves it by a bf16 ulp of its terms
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager, rtol=2**-7, atol=1e-4)
