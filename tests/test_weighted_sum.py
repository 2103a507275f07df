"""The weighted-sum warm-up kernels against ``(x * w).sum(-1)``: through the Triton
CPU interpreter (``tests/interpreter/test_weighted_sum.py``), and on a GPU."""

from __future__ import annotations

import pytest
import torch


def check_against_torch(shape, dtype, device, x=None, use_sum=False):
    """Forward and both gradients of ``weighted_sum`` against float64 PyTorch on the same inputs."""
    from cs336_systems.kernels.weighted_sum import weighted_sum

    if x is None:
        x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    weight = torch.randn(shape[-1], device=device).to(dtype).requires_grad_()
    y = weighted_sum(x, weight)
    assert y.shape == x.shape[:-1] and y.dtype == dtype
    grad_y = torch.ones_like(y).expand_as(y) if use_sum else torch.randn_like(y)
    if use_sum:
        y.sum().backward()
    else:
        y.backward(grad_y)
    x64, weight64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    y64 = (x64 * weight64).sum(-1)
    y64.backward(grad_y.double())
    # Tolerances: rounding of the outputs to dtype, relative to their magnitude.
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for name, value, expected in (("y", y, y64), ("grad_x", x.grad, x64.grad), ("grad_w", weight.grad, weight64.grad)):
        assert value.dtype == dtype, name
        scale = expected.abs().max().item()
        torch.testing.assert_close(value.double(), expected, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{name}: {m}")


@pytest.mark.compiled_kernels
def test_rejects_bad_inputs():
    from cs336_systems.kernels.weighted_sum import weighted_sum

    with pytest.raises(ValueError, match="shape"):
        weighted_sum(torch.randn(4, 5), torch.randn(6))
    with pytest.raises(TypeError):
        weighted_sum(torch.randn(4, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            weighted_sum(torch.randn(4, 5), torch.randn(5))


@pytest.mark.compiled_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_compile_for_h100(dtype):
    """Ahead-of-time compile for sm_90 (see ``_flash_aot.py``): what the interpreter cannot check."""
    from cs336_systems.kernels import weighted_sum as module
    from cs336_systems.kernels.launch import interpreting
    from tests._flash_aot import (
        compile_for_gpu,
        nvidia_toolchain_available,
        resource_usage,
    )

    if interpreting() or not nvidia_toolchain_available():
        pytest.skip("needs Triton's NVIDIA backend and ptxas, outside the interpreter")
    n_rows, D = 100, 300
    x, weight, y = torch.randn(n_rows, D, dtype=dtype), torch.randn(D, dtype=dtype), torch.empty(n_rows, dtype=dtype)
    tiles = dict(ROWS_TILE=module.ROWS_TILE, D_TILE=module._d_tile(D))
    forward = compile_for_gpu(module.weighted_sum_fwd_kernel, (x, weight, y, D, 1, 1, 1, n_rows, D), tiles)
    partial = torch.empty(4, D)
    backward = compile_for_gpu(
        module.weighted_sum_bwd_kernel, (x, weight, y, torch.empty_like(x), partial, D, 1, 1, 1, D, 1, D, n_rows, D), tiles
    )
    for compiled in (forward, backward):
        assert resource_usage(compiled).spill_bytes == 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, dtype",
    [((5, 7), torch.float32), ((3, 40, 33), torch.float32), ((1000, 1000), torch.float32),
     ((4096, 257), torch.float16), ((77, 128), torch.bfloat16), ((64,), torch.bfloat16)],
)
def test_weighted_sum_gpu(shape, dtype):
    check_against_torch(shape, dtype, "cuda")


@pytest.mark.gpu
def test_weighted_sum_gpu_non_contiguous_and_expanded_gradient():
    x = torch.randn(300, 200, device="cuda").t().requires_grad_()
    check_against_torch(x.shape, torch.float32, "cuda", x=x, use_sum=True)
