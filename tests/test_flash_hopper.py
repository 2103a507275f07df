"""The Hopper kernels in Gluon (``cs336_systems/attention/flash_hopper.py``).

On a machine without a GPU: the kernels compile for sm_90 down to a cubin (Triton's own ptxas) at the
supported head dims with no register spills and within the shared memory of a block, the forward's and the
backward's wgmma kept asynchronous by ptxas (no C7514 serialisation); the TMA views of
Q/K/V/dO address the right elements without copying where they can; the choice between this backward and the
Triton one follows the explicit ``FlashConfig`` and refuses to force an impossible one. Its numerics are checked on
a Hopper GPU (H100 or H200) by the GPU grid of ``test_flash_attention_triton.py``, which runs it by default on
Hopper, and by ``test_hopper_and_triton_kernels_agree_gpu`` below.
"""

from __future__ import annotations

import math

import pytest
import torch

from cs336_systems.attention import flash_hopper
from cs336_systems.attention.config import FLASH_CONFIG, FlashConfig, runs_hopper, why_not_hopper
from cs336_systems.kernels.launch import poisoned_outputs
from tests._flash_aot import compile_for_gpu, nvidia_toolchain_available, resource_usage, serialized_wgmma
from tests._flash_checks import hopper_gpu, relative_error

HOPPER_SHARED_MEMORY = 227 * 1024  # bytes a block may use on an H100/H200


def _launch_on_cpu_tensors(batch, heads, n_queries, n_keys, d, dtype, is_causal):
    shape_q = (batch, heads, n_queries, d)
    shape_k = (batch, heads, n_keys, d)
    Q, dO = torch.empty(shape_q, dtype=dtype), torch.empty(shape_q, dtype=dtype)
    K, V, dK, dV = (torch.empty(shape_k, dtype=dtype) for _ in range(4))
    L, Delta = (torch.empty(batch * heads, n_queries) for _ in range(2))
    DQ_acc = torch.empty(batch * heads, n_queries, d)
    return flash_hopper.backward_launch_arguments(Q, K, V, dO, L, Delta, dK, dV, DQ_acc, is_causal, 1 / math.sqrt(d))


# Two configurations each (a few seconds of ptxas apiece): the largest head dim, causal, and the smallest, not
# causal; every head dim runs on the GPU.
@pytest.mark.slow
@pytest.mark.compiled_kernels
@pytest.mark.parametrize("d, dtype, is_causal", [(128, torch.bfloat16, True), (16, torch.float16, False)])
def test_compiles_for_sm90_without_spills(d, dtype, is_causal):
    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    grid, args, kwargs = _launch_on_cpu_tensors(2, 3, 1000, 777, d, dtype, is_causal)
    assert grid == (math.ceil(777 / flash_hopper.BLOCK_N), 6)
    compiled = compile_for_gpu(flash_hopper.attn_bwd_hopper_kernel, args, kwargs)
    usage = resource_usage(compiled)
    assert usage.spill_bytes == 0, usage
    assert usage.shared_bytes <= HOPPER_SHARED_MEMORY, usage
    ptx = compiled.asm["ptx"]
    # The point of this kernel: Hopper's asynchronous matmuls, copy engine and register reallocation.
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "cp.reduce.async.bulk.tensor", "setmaxnreg"):
        assert instruction in ptx, instruction


@pytest.mark.compiled_kernels
@pytest.mark.parametrize("d, dtype, is_causal", [pytest.param(128, torch.bfloat16, True, marks=pytest.mark.slow),
                                                (64, torch.float16, False)])
def test_forward_compiles_for_sm90_without_spills(d, dtype, is_causal):
    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    Q, K, V, O = (torch.empty(2, 3, 1000, d, dtype=dtype) for _ in range(4))
    L = torch.empty(6, 1000)
    grid, args, kwargs = flash_hopper.forward_launch_arguments(Q, K, V, O, L, is_causal, 1 / math.sqrt(d))
    assert grid == (math.ceil(1000 / (2 * flash_hopper.FORWARD_ROWS)), 6)
    compiled = compile_for_gpu(flash_hopper.attn_fwd_hopper_kernel, args, kwargs)
    usage = resource_usage(compiled)
    assert usage.spill_bytes == 0, usage
    assert usage.shared_bytes <= HOPPER_SHARED_MEMORY, usage
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg"):
        assert instruction in compiled.asm["ptx"], instruction
    assert serialized_wgmma(compiled) is None  # S_(j+1) is waited for in the next step, yet nothing reads it early


@pytest.mark.slow
@pytest.mark.compiled_kernels
def test_backward_wgmma_are_not_serialized():
    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    grid, args, kwargs = _launch_on_cpu_tensors(2, 3, 1000, 777, 128, torch.bfloat16, True)
    compiled = compile_for_gpu(flash_hopper.attn_bwd_hopper_kernel, args, kwargs)
    assert serialized_wgmma(compiled) is None


def _heads(view: torch.Tensor, heads_in_columns: bool, batch: int, heads: int, d: int) -> torch.Tensor:
    """Read the view back as (batch, heads, seq, d) the way the kernel addresses it."""
    if heads_in_columns:
        return view.unflatten(2, (heads, d)).transpose(1, 2)
    return view.unflatten(0, (batch, heads))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "three_d", "one_head", "strided_d", "odd_stride",
                                    "misaligned"])
def test_tma_view_addresses_every_head(layout):
    batch, heads, seq, d = 2, 3, 5, 16
    base = torch.randn(batch, seq, heads, 2 * d)
    if layout == "contiguous":
        x = torch.randn(batch, heads, seq, d)
    elif layout == "transposed":  # what attention layers make: (batch, seq, heads, d) -> (batch, heads, seq, d)
        x = base[..., :d].contiguous().transpose(1, 2)
    elif layout == "three_d":
        x = torch.randn(batch * heads, seq, d)
    elif layout == "one_head":
        x = torch.randn(batch, 1, seq, d)[:, :, 1:]
    elif layout == "strided_d":  # the head dim is not unit-stride: needs a copy
        x = torch.randn(batch, heads, seq, 2 * d)[..., ::2]
    elif layout == "odd_stride":  # rows 9 elements apart: not 16-byte aligned, needs a copy
        x = torch.randn(batch, heads, seq, 9)[..., :8]
    else:  # contiguous, but starting 4 bytes into its allocation: needs a copy
        x = torch.randn(batch * heads * seq * d + 1)[1:].view(batch, heads, seq, d)
        assert x.is_contiguous() and x.data_ptr() % 16 != 0
    view, heads_in_columns = flash_hopper.tma_view(x)
    x4 = x if x.dim() == 4 else x.unsqueeze(1)
    b, h, s, dd = x4.shape
    assert view.dim() == 3 and view.stride(-1) == 1
    assert view.data_ptr() % 16 == 0 and all(st * view.element_size() % 16 == 0 for st in view.stride()[:-1])
    torch.testing.assert_close(_heads(view, heads_in_columns, b, h, dd), x4, rtol=0, atol=0)
    shares_storage = view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert shares_storage == (layout in ("contiguous", "transposed", "three_d", "one_head"))
    assert heads_in_columns == (layout == "transposed")


def test_kernel_choice_follows_the_configuration():
    cpu = torch.device("cpu")
    for kernels in ("auto", "triton"):
        for part in ("forward", "backward"):  # CPU tensors: the Triton path
            assert not runs_hopper(FlashConfig(kernels=kernels), cpu, torch.bfloat16, 64, part, True)
    with pytest.raises(ValueError, match="backward cannot run: tensors on cpu"):
        runs_hopper(FlashConfig(kernels="hopper"), cpu, torch.bfloat16, 64, "backward", True)
    assert why_not_hopper(cpu, torch.bfloat16, 64) == "tensors on cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_gpu(), reason="needs a Hopper GPU")
def test_kernel_choice_on_hopper_gpu():
    gpu = torch.device("cuda", torch.cuda.current_device())
    auto, forced = FlashConfig(), FlashConfig(kernels="hopper")
    for part in ("forward", "backward"):
        assert runs_hopper(auto, gpu, torch.bfloat16, 64, part, True)
        assert not runs_hopper(auto, gpu, torch.bfloat16, 64, part, False)  # too few programs: Triton
        assert not runs_hopper(auto, gpu, torch.float32, 64, part, True)
        assert not runs_hopper(auto, gpu, torch.bfloat16, 80, part, True)
    assert runs_hopper(forced, gpu, torch.bfloat16, 64, "forward", False)
    with pytest.raises(ValueError, match="float32"):
        runs_hopper(forced, gpu, torch.float32, 64, "backward", True)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_gpu(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_hopper_and_triton_kernels_agree_gpu(d, layout):
    """Forced Gluon and forced Triton forwards and backwards against float64, at a length with many key tiles and
    a ragged end, for the two TMA views; gradients NaN-poisoned so that unwritten rows show."""
    from cs336_systems.attention import flash_triton

    torch.manual_seed(d)
    batch, heads, seq = 2, 4, 1000 + d
    if layout == "contiguous":
        Q, K, V = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    else:
        Q, K, V = (torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))
    dO = torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16)
    leaves = [x.detach().double().requires_grad_() for x in (Q, K, V)]
    reference_output = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    reference_output.backward(dO.double())
    reference = [x.grad for x in leaves]
    expected_output = reference_output.detach()
    for kernels in ("hopper", "triton"):
        inputs = [x.detach().requires_grad_() for x in (Q, K, V)]
        with FLASH_CONFIG.use(kernels=kernels), poisoned_outputs():
            output = flash_triton.flash_attention(*inputs, True)
            output.backward(dO)
        results = [("O", output.detach(), expected_output)] + [
            (f"d{name}", x.grad, expected) for name, x, expected in zip("QKV", inputs, reference)]
        for name, value, expected in results:
            error = relative_error(value, expected)
            assert error < 1e-2, f"{kernels}: {name} relative error {error:.2e}"
