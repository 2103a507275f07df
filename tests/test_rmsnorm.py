"""The fused Triton RMSNorm (``cs336_systems.kernels.rmsnorm``) against a float64 reference: through the
Triton CPU interpreter (``tests/interpreter/test_rmsnorm.py``), and on a GPU; input checks,
the drop-in module and the model switch on the CPU. The benchmark's tests: ``tests/test_bench_rmsnorm.py``."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests._flash_checks import relative_error

QUANTITIES = ("y", "dx", "dw")
# Our error may exceed the plain RMSNorm's (same dtype, same inputs) by this factor plus this floor:
# both round the same float32 results to the output dtype; the floor covers float32 summation order.
ERROR_FACTOR = 2.0
ERROR_FLOOR = {torch.float32: 1e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}


def rms_norm_float64(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    x, weight = x.double(), weight.double()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def plain_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """``cs336_basics.model.RMSNorm`` with the given gain."""
    from cs336_basics.model import RMSNorm

    module = RMSNorm(x.shape[-1], eps=eps, device=x.device, dtype=weight.dtype)
    return torch.func.functional_call(module, {"weight": weight}, (x,))


def run(norm, x: Tensor, weight: Tensor, dy: Tensor | None) -> dict[str, Tensor]:
    """y, and the gradients dx, dw for the output gradient dy (``y.sum()`` when dy is None)."""
    x = x.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    y = norm(x, weight)
    if dy is None:
        y.sum().backward()
    else:
        y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dw": weight.grad}


def check_against_float64(x: Tensor, weight: Tensor, dy: Tensor | None = None) -> None:
    """Forward and both gradients of the fused RMSNorm against float64, with an error at most about the
    plain RMSNorm's at the same precision; output and gradient dtypes as the plain module's."""
    from cs336_systems.kernels.rmsnorm import fused_rms_norm

    ours = run(fused_rms_norm, x, weight, dy)
    plain = run(plain_rms_norm, x, weight, dy)
    reference = run(rms_norm_float64, x.double(), weight.double(), None if dy is None else dy.double())
    expected_dtypes = {"y": x.dtype, "dx": x.dtype, "dw": weight.dtype}
    for name in QUANTITIES:
        value = ours[name]
        assert value.dtype == plain[name].dtype == expected_dtypes[name], name
        assert value.shape == reference[name].shape, name
        assert torch.isfinite(value).all(), f"{name} has elements that were never written"
        error, plain_error = relative_error(value, reference[name]), relative_error(plain[name], reference[name])
        floor = max(ERROR_FLOOR[x.dtype], ERROR_FLOOR[weight.dtype]) if name == "dw" else ERROR_FLOOR[x.dtype]
        assert error <= ERROR_FACTOR * plain_error + floor, f"{name}: relative error {error:.2e}, plain {plain_error:.2e}"


def make_inputs(shape, dtype, device, weight_dtype=None) -> tuple[Tensor, Tensor, Tensor]:
    """x, a gain around 1 and an output gradient; x scaled away from 1 so that rms matters.

    A one-feature row normalises to about +-1 and its dx (proportional to eps / (x^2 + eps)) is all
    cancellation unless x^2 is comparable to eps: such rows get x of that size.
    """
    scale = 3.0 if shape[-1] > 1 else 3e-3
    x = (scale * torch.randn(shape, device=device)).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], device=device)).to(weight_dtype or dtype)
    dy = torch.randn(shape, device=device).to(dtype)
    return x, weight, dy


@pytest.mark.compiled_kernels
def test_rejects_unsupported_inputs():
    from cs336_systems.kernels.rmsnorm import fused_rms_norm

    x, weight = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(ValueError, match="last dimension of x must match"):
        fused_rms_norm(torch.randn(4, 7), weight)
    with pytest.raises(ValueError, match="one-dimensional"):
        fused_rms_norm(x, torch.ones(1, 8))
    with pytest.raises(ValueError, match="last dimension"):
        fused_rms_norm(torch.tensor(1.0), torch.ones(1))
    with pytest.raises(ValueError, match="zero features"):
        fused_rms_norm(torch.randn(4, 0), torch.ones(0))
    with pytest.raises(TypeError, match="int64 for x"):
        fused_rms_norm(torch.ones(4, 8, dtype=torch.int64), weight)
    with pytest.raises(TypeError, match="float64 for weight"):
        fused_rms_norm(x, weight.double())
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            fused_rms_norm(x, weight)


def test_fused_module_is_a_drop_in_for_the_plain_one():
    from cs336_basics.model import RMSNorm
    from cs336_systems.kernels.rmsnorm import FusedRMSNorm

    plain = RMSNorm(12)
    plain.weight.data.normal_()
    fused = FusedRMSNorm(12, eps=1e-5)
    assert isinstance(fused, RMSNorm) and fused.eps == plain.eps == 1e-5
    assert fused.state_dict().keys() == plain.state_dict().keys() == {"weight"}
    fused.load_state_dict(plain.state_dict())
    torch.testing.assert_close(fused.weight, plain.weight, rtol=0, atol=0)
    assert FusedRMSNorm(6, eps=1e-3, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    assert FusedRMSNorm(6, eps=1e-3).eps == 1e-3


def test_use_fused_rmsnorm_swaps_every_norm_keeping_its_parameter():
    from cs336_basics.model import BasicsTransformerLM, RMSNorm
    from cs336_systems.kernels.rmsnorm import FusedRMSNorm, use_fused_rmsnorm

    model = BasicsTransformerLM(vocab_size=50, context_length=16, d_model=32, num_layers=3, num_heads=2, d_ff=64)
    model.eval()
    parameters = dict(model.named_parameters())
    state = {name: value.clone() for name, value in model.state_dict().items()}
    norm_names = [name for name, m in model.named_modules() if isinstance(m, RMSNorm)]
    assert len(norm_names) == 2 * 3 + 1
    assert use_fused_rmsnorm(model) is model
    modules = dict(model.named_modules())
    assert all(type(modules[name]) is FusedRMSNorm and not modules[name].training for name in norm_names)
    # The same Parameter objects (an optimizer built before the swap still updates them), the same state dict.
    assert all(p is parameters[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == list(state)
    use_fused_rmsnorm(model, enabled=False)
    assert all(type(m) is RMSNorm for name, m in model.named_modules() if name in norm_names)
    assert all(p is parameters[name] for name, p in model.named_parameters())
    with pytest.raises(TypeError, match="inside a model"):
        use_fused_rmsnorm(RMSNorm(4))


def assert_candidates_compile_without_spills(n_cols: int, residual: bool) -> None:
    """Compile for sm_90 the forward and backward kernels at the fixed configuration and at the heaviest
    candidate per warp count that the pruner lets the autotuner try, in bfloat16 and float32, and assert that
    none spills; ``residual``: with the residual switches on (``ADD_RESIDUAL``, ``ADD_DS``)."""
    from cs336_systems.kernels import rmsnorm
    from tests._flash_aot import compile_for_gpu, resource_usage

    block_n, single_tile = rmsnorm._block_n(n_cols)
    for dtype in (torch.bfloat16, torch.float32):
        x, weight = torch.empty(16, n_cols, dtype=dtype), torch.empty(n_cols, dtype=dtype)
        rstd, partial = torch.empty(16), torch.empty(4, n_cols)
        for kernel, configs in (("fwd", rmsnorm.FWD_CONFIGS), ("bwd", rmsnorm.BWD_CONFIGS)):
            candidates = rmsnorm._pruner(kernel)(configs, {"X": x, "rows_key": 64}, BLOCK_N=block_n,
                                                 SINGLE_TILE=single_tile)
            heaviest = {}
            for c in candidates:
                if c.num_warps not in heaviest or c.kwargs["BLOCK_M"] > heaviest[c.num_warps].kwargs["BLOCK_M"]:
                    heaviest[c.num_warps] = c
            configs = [*heaviest.values(), rmsnorm.fixed_config(kernel, n_cols, x.element_size())]
            if kernel == "fwd":  # one program per tile compiles another body (no prefetch): its most registers
                most = max(heaviest.values(), key=lambda c: rmsnorm._elements_per_thread(c, block_n))
                configs.append(rmsnorm._fwd_config(most.kwargs["BLOCK_M"], most.num_warps, 0))
            for config in configs:
                meta = dict(BLOCK_N=block_n, SINGLE_TILE=single_tile, **config.kwargs, num_warps=config.num_warps,
                            num_stages=config.num_stages)
                if kernel == "fwd":
                    args = (x, weight, x, rstd, n_cols, n_cols, 65536, n_cols, 64, 1e-5, x, x, n_cols, n_cols)
                    compiled = compile_for_gpu(rmsnorm.rmsnorm_fwd_kernel, args, {**meta, "ADD_RESIDUAL": residual})
                else:
                    args = (x, x, weight, rstd, x, partial, rstd, n_cols, n_cols, n_cols, 65536, n_cols, 128, x, n_cols)
                    prefetch = rmsnorm._prefetch(block_n, single_tile, x.element_size())
                    compiled = compile_for_gpu(rmsnorm.rmsnorm_bwd_kernel, args, {
                        **meta, "PREFETCH": prefetch, "COMPUTE_DX": True, "COMPUTE_DW": True, "ADD_DS": residual})
                assert resource_usage(compiled).spill_bytes == 0, (kernel, dtype, config)


@pytest.mark.compiled_kernels
@pytest.mark.parametrize("n_cols", [pytest.param(n, marks=() if n == 80 else pytest.mark.slow)
                                    for n in (1, 80, 768, 1600, 2560, 8192, 9000)])
def test_every_autotune_candidate_compiles_for_h100_without_spills(n_cols):
    """Ahead-of-time compile for sm_90 (see ``_flash_aot.py``) of the configurations the pruner lets the
    autotuner try, for each warp count the one with the most elements per thread (the most registers), and of
    the fixed configuration that the operators launch."""
    from cs336_systems.kernels import rmsnorm
    from cs336_systems.kernels.launch import interpreting
    from tests._flash_aot import compile_for_gpu, nvidia_toolchain_available, resource_usage

    if interpreting() or not nvidia_toolchain_available():
        pytest.skip("needs Triton's NVIDIA backend and ptxas, outside the interpreter")
    assert_candidates_compile_without_spills(n_cols, residual=False)
    partial, weight = torch.empty(4, n_cols), torch.empty(n_cols)
    compiled = compile_for_gpu(rmsnorm.rmsnorm_dw_reduce_kernel, (partial, weight, 528, n_cols),
                               dict(BLOCK_P=rmsnorm.REDUCE_BLOCK_P, BLOCK_C=rmsnorm.REDUCE_BLOCK_C,
                                    num_warps=rmsnorm.REDUCE_NUM_WARPS))
    assert resource_usage(compiled).spill_bytes == 0


# ---------------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------------


def test_forward_grid_is_one_program_per_tile_up_to_its_limit():
    from cs336_systems.kernels.rmsnorm import forward_programs

    assert forward_programs(1000, {"BLOCK_M": 4, "PROGRAMS_PER_SM": 0}, 132) == 250
    assert forward_programs(1001, {"BLOCK_M": 4, "PROGRAMS_PER_SM": 0}, 132) == 251
    assert forward_programs(65536, {"BLOCK_M": 2, "PROGRAMS_PER_SM": 4}, 132) == 528
    assert forward_programs(65536, {"BLOCK_M": 2, "PROGRAMS_PER_SM": 16}, 132) == 2112
    assert forward_programs(3, {"BLOCK_M": 1, "PROGRAMS_PER_SM": 16}, 132) == 3


@pytest.fixture
def fixed_launch():
    """One launch configuration per shape instead of autotuning (the grid compiles far less), and outputs poisoned."""
    from cs336_systems.kernels.launch import poisoned_outputs
    from cs336_systems.kernels.rmsnorm import RMSNORM_CONFIG

    with RMSNORM_CONFIG.use(autotune=False), poisoned_outputs():
        yield


# Inputs of the GPU checks: one column, odd widths, the models' widths, rows past the single-sweep limit.
GPU_SHAPES = [(3, 5, 1), (4, 77, 17), (300, 1000), (2, 129, 4099), (4, 512, 1600), (4096, 2560), (64, 12000)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_matches_float64_on_gpu(shape, dtype, fixed_launch):
    check_against_float64(*make_inputs(shape, dtype, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("autotune", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_over_many_rows_on_gpu(dtype, autotune):
    from cs336_systems.kernels.rmsnorm import RMSNORM_CONFIG

    with RMSNORM_CONFIG.use(autotune=autotune):
        for _ in range(2):  # the second time through the launch cache
            check_against_float64(*make_inputs((65536 + 5, 768), dtype, "cuda"))
            check_against_float64(*make_inputs((3000, 40), dtype, "cuda", weight_dtype=torch.float32))


@pytest.mark.gpu
def test_non_contiguous_inputs_and_expanded_gradient_on_gpu(fixed_launch):
    x = 3 * torch.randn(40, 8, 1024, device="cuda").transpose(0, 1)
    weight = 1 + 0.5 * torch.randn(1024, device="cuda")
    check_against_float64(x, weight, None)
    wide = 1 + 0.5 * torch.randn(2048, device="cuda")
    check_against_float64(3 * torch.randn(2, 300, 2048, device="cuda")[..., :1600], wide[:1600].clone(), None)


@pytest.mark.gpu
def test_zero_rows_on_gpu(fixed_launch):
    from cs336_systems.kernels.rmsnorm import fused_rms_norm

    x = torch.randn(0, 64, device="cuda", requires_grad=True)
    weight = torch.ones(64, device="cuda", requires_grad=True)
    fused_rms_norm(x, weight).sum().backward()
    assert x.grad.shape == (0, 64) and (weight.grad == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("autocast_output", [False, True])
@pytest.mark.parametrize("compile_model", [False, True])
def test_transformer_lm_with_fused_rmsnorm_matches_plain_on_gpu(compile_model, autocast_output):
    """Logits and gradients of a small LM under bfloat16 autocast, plain vs fused norms (and compiled)."""
    from cs336_basics.model import BasicsTransformerLM
    from cs336_systems.kernels.rmsnorm import use_fused_rmsnorm

    model = BasicsTransformerLM(vocab_size=500, context_length=64, d_model=256, num_layers=2, num_heads=4,
                                d_ff=512, device="cuda")
    token_ids = torch.randint(0, 500, (4, 64), device="cuda")

    def logits_and_grads(runner):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = runner(token_ids)
        logits.float().square().mean().backward()
        return logits.detach().float(), {name: p.grad.clone() for name, p in model.named_parameters()}

    plain_logits, plain_grads = logits_and_grads(model)
    use_fused_rmsnorm(model, autocast_output=autocast_output)
    runner = torch.compile(model, fullgraph=True) if compile_model else model
    logits, grads = logits_and_grads(runner)
    # bf16 matmuls dominate the error, in both runs alike.
    torch.testing.assert_close(logits, plain_logits, rtol=2e-2, atol=2e-2)
    for name, grad in plain_grads.items():
        assert relative_error(grads[name], grad) < 2e-2, name
