"""FlashAttention-2 in Triton (SPEC section 3): correctness against a float64 reference, the grader's
contract, input errors, and that the kernels compile for an H100.

How the tests are split:

* CPU: input errors, and (``compiled_kernels``, see ``tests/conftest.py``) an ahead-of-time compile for sm_90 with
  Triton's own ptxas (catches what only the compiler sees: non-constexpr globals, shared memory,
  register spills), no GPU needed.
* CPU, through the Triton interpreter (``tests/interpreter/test_attention.py``), float32 and float16.
* GPU (marker ``gpu``): a grid of 58 shapes x dtypes against float64 with NaN-poisoned outputs,
  gradients included; the grader's shapes; autotuning; the leaderboard shape against PyTorch's fused
  attention; ``torch.compile``; the language model. Errors per dtype are printed at the end of the
  run and written to ``$CS336_RESULTS_DIR/flash_attention_triton_errors.json`` when that is set.

Error bound for the GPU grid: the relative error ||out - ref|| / ||ref|| against float64 must be
below a floor per precision, or below 3x the error of plain PyTorch attention computed at the same
precision on the same inputs (whichever is larger). For "tf32" the floor decides: cuBLAS need not pick
TF32 kernels for PyTorch's small matmuls, so PyTorch's own error there can be that of full float32.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from cs336_systems.attention import flash_triton
from cs336_systems.attention.config import FLASH_CONFIG, FlashConfig
from cs336_systems.attention.flash_triton import (
    SUPPORTED_HEAD_DIMS,
    FlashAttention2Triton,
)
from cs336_systems.kernels.launch import poisoned_outputs
from tests import adapters
from tests._flash_checks import (
    QUANTITIES,
    assert_lm_matches_naive,
    hopper_gpu,
    make_qkv,
    relative_error,
    run_function,
    run_reference,
)

# ---------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------


def _valid(**overrides):
    shapes = dict(q=(2, 3, 20, 32), k=(2, 3, 24, 32), v=(2, 3, 24, 32))
    shapes.update(overrides)
    dtype = shapes.pop("dtype", torch.float32)
    return [torch.randn(shapes[name], dtype=dtype) for name in ("q", "k", "v")]


@pytest.mark.parametrize(
    "inputs, error, match",
    [
        (_valid(dtype=torch.float64), TypeError, "unsupported dtype"),
        (_valid(q=(2, 3, 20, 20), k=(2, 3, 24, 20), v=(2, 3, 24, 20)), ValueError, r"16, 32, 64, 128"),
        (_valid(q=(2, 3, 20, 136), k=(2, 3, 24, 136), v=(2, 3, 24, 136)), ValueError, r"multiples of 8 up to 128"),
        (_valid(q=(3, 3, 20, 32)), ValueError, "batch"),
        (_valid(q=(2, 4, 20, 32)), ValueError, "batch"),
        (_valid(k=(2, 3, 24, 16)), ValueError, "head dimension"),
        (_valid(v=(2, 3, 25, 32)), ValueError, "same length"),
        (_valid(q=(2, 20, 32)), ValueError, "rank"),
        (_valid(q=(20, 32), k=(24, 32), v=(24, 32)), ValueError, "shape"),
    ],
)
def test_rejects_invalid_inputs(inputs, error, match):
    with pytest.raises(error, match=match):
        FlashAttention2Triton.apply(*inputs, False)


def test_is_causal_must_be_a_bool():
    with pytest.raises(TypeError, match="is_causal must be True or False"):
        FlashAttention2Triton.apply(*_valid(), "no")


def test_rejects_mixed_dtypes_and_devices():
    q, k, v = _valid()
    with pytest.raises(TypeError, match="one dtype"):
        FlashAttention2Triton.apply(q, k.half(), v, False)
    with pytest.raises(ValueError, match="one device"):
        FlashAttention2Triton.apply(q, k.to("meta"), v, False)


@pytest.mark.compiled_kernels
def test_rejects_cpu_tensors_without_interpreter():
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        FlashAttention2Triton.apply(*_valid(), True)


@pytest.mark.slow
def test_float32_dot_precision_follows_pytorch():
    """TF32 exactly when PyTorch's matmuls may use it, through either precision API; run in a fresh
    process, since mixing the two APIs leaves PyTorch's legacy flag unreadable."""
    script = """
import torch
from cs336_systems.attention.flash_triton import _dot_precision
seen = [_dot_precision(torch.float32), _dot_precision(torch.bfloat16)]
torch.backends.cuda.matmul.allow_tf32 = True
seen.append(_dot_precision(torch.float32))
torch.backends.cuda.matmul.allow_tf32 = False
seen.append(_dot_precision(torch.float32))
torch.set_float32_matmul_precision("high")
seen.append(_dot_precision(torch.float32))
torch.set_float32_matmul_precision("highest")
torch.backends.cuda.matmul.fp32_precision = "tf32"
seen.append(_dot_precision(torch.float32))
print(" ".join(seen))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ieee", "tf32", "tf32", "ieee", "tf32", "tf32"]


def _captured_launches(monkeypatch, dtype, head_dim, is_causal):
    """The (kernel function, args, meta) of every Triton launch of one forward and backward (on the portable path),
    without running them."""
    launches = []
    monkeypatch.setattr(flash_triton, "_launch", lambda kernel, n, bh, signature, args, meta, autotune_key:
                        launches.append((flash_triton._PLAIN[kernel], args, meta, kernel)))
    monkeypatch.setattr(flash_triton, "_DELTA", lambda key, grid, args, meta, **options:
                        launches.append((flash_triton.kernels.attn_bwd_delta_kernel, args, meta, "delta")))
    q, k, v = (torch.randn(2, 3, 200, head_dim).to(dtype) for _ in range(3))
    with FLASH_CONFIG.use(kernels="triton"):
        O, L = flash_triton.flash_attention_forward(q, k, v, is_causal)
        flash_triton.flash_attention_backward(q, k, v, O, L, torch.randn_like(O), is_causal)
    assert [launch[3] for launch in launches] == ["fwd", "delta", "bwd"]
    return launches


H100_SHARED_MEMORY = 227 * 1024


def test_flash_config_is_explicit_and_checked():
    """The configuration is a frozen value set in code (never read from the environment by the library), checked
    on construction; ``use`` restores the previous one."""
    assert FLASH_CONFIG.get() == FlashConfig()
    with FLASH_CONFIG.use(kernels="triton", autotune=True) as config:
        assert FLASH_CONFIG.get() is config and config.kernels == "triton" and config.autotune
    assert FLASH_CONFIG.get() == FlashConfig()
    with pytest.raises(ValueError, match="auto, hopper, triton"):
        FlashConfig(kernels="gluon")
    assert FlashConfig.from_environment({"CS336_FLASH_KERNELS": "triton", "CS336_FLASH_AUTOTUNE": "1"}) == \
        FlashConfig(kernels="triton", autotune=True)
    assert FlashConfig.from_environment({}) == FlashConfig()


@pytest.mark.compiled_kernels
@pytest.mark.parametrize(
    "dtype, head_dim, is_causal",
    [pytest.param(torch.bfloat16, 64, True, marks=pytest.mark.slow),
     pytest.param(torch.float16, 128, False, marks=pytest.mark.slow), (torch.float32, 32, True)],
)
def test_fixed_configs_compile_for_h100_without_spills(monkeypatch, dtype, head_dim, is_causal):
    from tests._flash_aot import (
        compile_for_gpu,
        nvidia_toolchain_available,
        resource_usage,
        serialized_wgmma,
    )

    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    for kernel, args, meta, name in _captured_launches(monkeypatch, dtype, head_dim, is_causal):
        config = flash_triton.DELTA_CONFIG if name == "delta" else flash_triton.fixed_config(name, dtype, head_dim)
        compiled = compile_for_gpu(kernel, args, {**meta, **config.all_kwargs()})
        usage = resource_usage(compiled)
        assert usage.spill_bytes == 0, f"{name} {config}: {usage}"
        assert usage.shared_bytes <= H100_SHARED_MEMORY, f"{name} {config}: {usage}"
        if name == "fwd":
            assert serialized_wgmma(compiled) is None, f"{name} {config}"


@pytest.mark.slow
@pytest.mark.compiled_kernels
@pytest.mark.xfail(strict=True, reason="ptxas serialises the Triton backward's wgmma on sm_90 (C7514): its consecutive "
                   "sweeps carry the dK/dV and dQ accumulators from loop to loop. One masked sweep each fixes it, but "
                   "lost its measurement (issue 28: H100, d = 64 backward 4-10 % slower); on Hopper the Gluon "
                   "kernels run 16-bit attention instead")
def test_backward_wgmma_are_not_serialized_on_h100(monkeypatch):
    from tests._flash_aot import compile_for_gpu, nvidia_toolchain_available, serialized_wgmma

    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    kernel, args, meta, name = _captured_launches(monkeypatch, torch.bfloat16, 64, True)[2]
    config = flash_triton.fixed_config(name, torch.bfloat16, 64)
    assert serialized_wgmma(compile_for_gpu(kernel, args, {**meta, **config.all_kwargs()})) is None


@pytest.mark.compiled_kernels
@pytest.mark.slow
def test_autotune_configs_compile_for_h100(monkeypatch):
    """Every configuration the autotuner may try on the leaderboard's dtype and head dim compiles and
    fits in shared memory (spilling ones are allowed: the autotuner just finds them slow)."""
    from tests._flash_aot import (
        compile_for_gpu,
        nvidia_toolchain_available,
        resource_usage,
    )

    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    for kernel, args, meta, name in _captured_launches(monkeypatch, torch.bfloat16, 64, True):
        if name == "delta":
            continue
        autotuner = flash_triton._AUTOTUNED[name]
        for config in autotuner.early_config_prune(autotuner.configs, {"Q": args[0]}, **meta):
            compiled = compile_for_gpu(kernel, args, {**meta, **config.all_kwargs()})
            assert resource_usage(compiled).shared_bytes <= H100_SHARED_MEMORY, f"{name} {config}"


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------

# Relative-error floors per precision; "tf32" is float32 inputs with torch.backends.cuda.matmul.allow_tf32.
ERROR_FLOOR = {"fp32": 1e-4, "tf32": 5e-3, "fp16": 5e-3, "bf16": 2e-2}
TORCH_ERROR_FACTOR = 3.0
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

_RECORDS: list[dict] = []  # one per GPU grid case, for the end-of-run summary


def _grid() -> list[tuple]:
    """(precision, batch, heads or None, n_queries, n_keys, d, is_causal): 18 length pairs per dtype,
    head dims and causality rotating so that every dtype sees every head dim, causal or not."""
    length_pairs = [
        (1, 1), (17, 17), (100, 100), (129, 129), (1000, 1000), (16, 16), (64, 64), (128, 128), (256, 256),
        (512, 512), (1024, 1024), (2048, 2048), (4096, 4096), (100, 129), (129, 100), (1, 1000), (1000, 17),
        (17, 4096),
    ]
    cases = []
    for p, precision in enumerate(("fp32", "fp16", "bf16")):
        for i, (n_queries, n_keys) in enumerate(length_pairs):
            d = SUPPORTED_HEAD_DIMS[i % 4]
            is_causal = (i + p) % 2 == 0
            long = max(n_queries, n_keys) >= 2048
            batch, heads = (1, 2) if long else ((3, None) if i % 3 == 0 else (2, 3))
            cases.append((precision, batch, heads, n_queries, n_keys, d, is_causal))
    cases += [
        ("tf32", 2, 3, 128, 128, 64, True),
        ("tf32", 1, 2, 1000, 1000, 128, False),
        ("tf32", 3, None, 100, 129, 32, True),
        ("tf32", 1, 2, 4096, 4096, 16, True),
    ]
    return cases


@pytest.fixture
def fixed_tiles_poisoned_outputs():
    """The default configuration (fixed tiles: far fewer compilations than autotuning), and outputs allocated full
    of NaN so that an element no kernel writes shows up."""
    with FLASH_CONFIG.use(FlashConfig()), poisoned_outputs():
        yield


@contextlib.contextmanager
def _matmul_tf32(enabled: bool):
    # Not monkeypatch: torch.backends.cuda.matmul is a module proxy whose attributes it cannot restore.
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.gpu
@pytest.mark.parametrize("precision, batch, heads, n_queries, n_keys, d, is_causal", _grid())
def test_matches_float64_reference_gpu(fixed_tiles_poisoned_outputs, precision, batch, heads, n_queries, n_keys, d, is_causal):
    with _matmul_tf32(precision == "tf32"):
        _check_against_float64(precision, batch, heads, n_queries, n_keys, d, is_causal)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_gpu(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("precision, batch, heads, n_queries, n_keys, d, is_causal",
                         [case for case in _grid() if case[0] in ("fp16", "bf16")])
def test_hopper_kernels_match_float64_reference_gpu(fixed_tiles_poisoned_outputs, precision, batch, heads, n_queries,
                                                    n_keys, d, is_causal):
    """The 16-bit cases of the grid with the Hopper (Gluon) forward and backward forced, whatever the size
    ("auto" leaves the small ones to the Triton kernels)."""
    with FLASH_CONFIG.use(kernels="hopper"):
        _check_against_float64(precision, batch, heads, n_queries, n_keys, d, is_causal)


def _check_against_float64(precision, batch, heads, n_queries, n_keys, d, is_causal):
    dtype = DTYPES[precision]
    Q, K, V = make_qkv(batch, heads, n_queries, n_keys, d, dtype, "cuda")
    dO = torch.randn(Q.shape, device="cuda").to(dtype)
    result = run_function(FlashAttention2Triton, Q, K, V, is_causal, dO)
    reference = run_reference(Q, K, V, is_causal, dO)
    torch_result = run_reference(Q, K, V, is_causal, dO, dtype=dtype)  # plain PyTorch at this precision

    record = dict(precision=precision, batch=batch, heads=heads, n_queries=n_queries, n_keys=n_keys, d=d,
                  is_causal=is_causal, errors={}, torch_errors={}, max_abs_errors={})
    _RECORDS.append(record)
    failures = []
    for name in QUANTITIES:
        value = result[name]
        assert value.dtype == (torch.float32 if name == "L" else dtype), name
        assert torch.isfinite(value).all(), f"{name}: {(~torch.isfinite(value)).sum().item()} non-finite elements"
        error, torch_error = relative_error(value, reference[name]), relative_error(torch_result[name], reference[name])
        record["errors"][name], record["torch_errors"][name] = error, torch_error
        record["max_abs_errors"][name] = (value.double() - reference[name]).abs().max().item()
        bound = max(ERROR_FLOOR[precision], TORCH_ERROR_FACTOR * torch_error)
        if error > bound:
            failures.append(f"{name}: relative error {error:.2e} > bound {bound:.2e} (PyTorch's own {torch_error:.2e})")
    assert not failures, "; ".join(failures)
    if precision != "bf16":  # the grader's criterion (bf16 rounding alone can reach it)
        for name in QUANTITIES:
            torch.testing.assert_close(result[name].double(), reference[name], rtol=1e-2, atol=1e-2, msg=lambda m: f"{name}: {m}")


def _awkward_grid() -> list[tuple]:
    """Awkward cases of the grid for every precision and head dim."""
    picks = {(precision, d): case for case in _grid() for precision, d in [(case[0], case[5])]
             if case[3] != case[4] or case[3] % 128 or case[3] >= 2048}
    return sorted(picks.values(), key=str)


@pytest.mark.gpu
@pytest.mark.parametrize("precision, batch, heads, n_queries, n_keys, d, is_causal", _awkward_grid())
def test_triton_kernels_match_float64_reference_gpu(fixed_tiles_poisoned_outputs, precision, batch, heads, n_queries,
                                                    n_keys, d, is_causal):
    """Awkward cases with the portable Triton kernels forced (on a Hopper GPU "auto" runs the large 16-bit ones on
    the Gluon kernels)."""
    with FLASH_CONFIG.use(kernels="triton"), _matmul_tf32(precision == "tf32"):
        _check_against_float64(precision, batch, heads, n_queries, n_keys, d, is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["triton", "auto"])
def test_cached_launches_stay_right_across_calls_gpu(fixed_tiles_poisoned_outputs, kernels):
    """The launch code keys its compiled kernels and plans by shapes, strides, dtype and alignment: repeated calls
    (the short path), a layout change (transposed views), a misaligned start and another length all stay right."""
    with FLASH_CONFIG.use(kernels=kernels):
        for layout in ("contiguous", "contiguous", "transposed", "offset", "contiguous"):
            n = 777 if layout == "offset" else 1024
            leaves = [torch.randn(2 * 4 * n * 64 + 1, device="cuda").to(torch.bfloat16).requires_grad_()
                      for _ in range(3)]
            if layout == "transposed":
                Q, K, V = (x[1:].view(2, n, 4, 64).transpose(1, 2) for x in leaves)
            elif layout == "offset":  # data starting 2 bytes into an allocation
                Q, K, V = (x[1:].view(2, 4, n, 64) for x in leaves)
            else:
                Q, K, V = (x[:-1].view(2, 4, n, 64) for x in leaves)
            dO = torch.randn(Q.shape, device="cuda").to(torch.bfloat16)
            O = FlashAttention2Triton.apply(Q, K, V, True)
            grads = torch.autograd.grad(O, (Q, K, V), dO)
            reference = run_reference(Q, K, V, True, dO)
            for name, value in zip(("O", "dQ", "dK", "dV"), (O, *grads)):
                assert relative_error(value, reference[name]) <= ERROR_FLOOR["bf16"], f"{layout}: {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_grader_contract_gpu(fixed_tiles_poisoned_outputs, is_causal):
    """The grader's shapes and check, through ``tests/adapters.py``."""
    function = adapters.get_flashattention_autograd_function_triton()
    Q, K, V = make_qkv(4, None, 128, 128, 64, torch.float32, "cuda")
    dO = torch.randn(Q.shape, device="cuda")
    result = run_function(function, Q, K, V, is_causal, dO)
    reference = run_reference(Q, K, V, is_causal, dO, dtype=torch.float32)  # the grader's is float32
    assert result["L"].shape == (4, 128)
    for name in QUANTITIES:
        torch.testing.assert_close(result[name], reference[name], rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_four_dimensional_logsumexp_shape_gpu(fixed_tiles_poisoned_outputs):
    Q, K, V = make_qkv(2, 3, 70, 90, 32, torch.float16, "cuda")
    O = FlashAttention2Triton.apply(Q, K, V, True)
    L = [t for t in O.grad_fn.saved_tensors if t.shape == (2, 3, 70)]
    assert O.shape == Q.shape and len(L) == 1 and L[0].dtype == torch.float32


@pytest.mark.gpu
def test_expanded_gradient_and_non_contiguous_inputs_gpu(fixed_tiles_poisoned_outputs):
    batch, seq, heads, d = 2, 300, 4, 64
    Q = torch.randn(batch, seq, heads, d, device="cuda").transpose(1, 2).requires_grad_()
    K = torch.randn(batch, heads, seq, 2 * d, device="cuda")[..., ::2].requires_grad_()
    V = torch.randn(batch, heads, d, seq, device="cuda").transpose(-1, -2).requires_grad_()
    FlashAttention2Triton.apply(Q, K, V, True).sum().backward()  # dO is expanded: every stride 0
    reference = run_reference(Q, K, V, True, torch.ones(Q.shape, device="cuda"))
    for name, grad in (("dQ", Q.grad), ("dK", K.grad), ("dV", V.grad)):
        assert grad.shape == reference[name].shape
        assert relative_error(grad, reference[name]) <= 1e-4, name


@pytest.mark.gpu
def test_rejects_tensors_on_different_devices_gpu():
    Q, K, V = make_qkv(1, 2, 32, 32, 32, torch.float16, "cuda")
    with pytest.raises(ValueError, match="one device"):
        FlashAttention2Triton.apply(Q, K.detach().cpu(), V, True)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_autotuned_kernels_match_reference_gpu(head_dim):
    Q, K, V = make_qkv(2, 4, 1024, 1024, head_dim, torch.bfloat16, "cuda")
    dO = torch.randn(Q.shape, device="cuda").to(torch.bfloat16)
    with FLASH_CONFIG.use(kernels="triton", autotune=True), poisoned_outputs():
        result = run_function(FlashAttention2Triton, Q, K, V, True, dO)
    reference = run_reference(Q, K, V, True, dO)
    for name in QUANTITIES:
        assert torch.isfinite(result[name]).all(), name
        assert relative_error(result[name], reference[name]) <= ERROR_FLOOR["bf16"], name
    chosen = {f"{name} d={head_dim}": str(autotuner.best_config) for name, autotuner in flash_triton._AUTOTUNED.items()
              if getattr(autotuner, "best_config", None) is not None}
    _RECORDS.append(dict(precision="bf16", note="autotuned", chosen_configs=chosen,
                         errors={name: relative_error(result[name], reference[name]) for name in QUANTITIES}))


@pytest.mark.gpu
def test_leaderboard_shape_against_pytorch_fused_attention_gpu(fixed_tiles_poisoned_outputs):
    """16 x 16384 x 64, bf16, causal: too large for a materialised float64 reference, so the reference
    is PyTorch's fused attention in float32. Also records rough timings (fixed tiles, not autotuned)."""
    import torch.nn.functional as F

    Q, K, V = make_qkv(16, None, 16384, 16384, 64, torch.bfloat16, "cuda")
    dO = torch.randn(Q.shape, device="cuda").to(torch.bfloat16)
    result = run_function(FlashAttention2Triton, Q, K, V, True, dO)
    # 4-D views (1, 16, seq, d): with 3-D inputs SDPA would fall back to its materialising math backend.
    q32, k32, v32 = (t.detach().float()[None].requires_grad_() for t in (Q, K, V))
    O32 = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    O32.backward(dO.float()[None])
    reference = {"O": O32.detach()[0], "dQ": q32.grad[0], "dK": k32.grad[0], "dV": v32.grad[0]}
    errors = {name: relative_error(result[name], reference[name]) for name in reference}
    for name, error in errors.items():
        assert torch.isfinite(result[name]).all(), name
        assert error <= ERROR_FLOOR["bf16"], f"{name}: {error:.2e}"

    def forward_backward(attention):
        q, k, v = (t.detach()[None].requires_grad_() for t in (Q, K, V))  # (1, 16, seq, d)
        return lambda: attention(q, k, v).backward(dO[None])

    ours_ms = triton.testing.do_bench(
        forward_backward(lambda q, k, v: FlashAttention2Triton.apply(q, k, v, True)), warmup=25, rep=200
    )
    sdpa_ms = triton.testing.do_bench(
        forward_backward(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), warmup=25, rep=200
    )
    _RECORDS.append(dict(precision="bf16", note="leaderboard shape (16, 16384, 64), causal, vs fp32 SDPA",
                         errors=errors, forward_backward_ms={"triton_fixed_tiles": ours_ms, "pytorch_sdpa": sdpa_ms}))


@pytest.mark.gpu
def test_torch_compile_of_apply_gpu(fixed_tiles_poisoned_outputs):
    """The leaderboard times torch.compile(FlashAttention2.apply)."""
    compiled = torch.compile(FlashAttention2Triton.apply)
    Q, K, V = make_qkv(4, None, 512, 512, 64, torch.bfloat16, "cuda")
    dO = torch.randn(Q.shape, device="cuda").to(torch.bfloat16)
    q, k, v = (t.detach().clone().requires_grad_() for t in (Q, K, V))
    compiled(q, k, v, True).backward(dO)
    eager = run_function(FlashAttention2Triton, Q, K, V, True, dO)
    torch.testing.assert_close(q.grad, eager["dQ"])
    torch.testing.assert_close(k.grad, eager["dK"])
    torch.testing.assert_close(v.grad, eager["dV"])


@pytest.mark.gpu
def test_compiled_lm_with_our_attention_has_no_graph_break_and_runs_in_cuda_graphs_gpu(fixed_tiles_poisoned_outputs):
    """Inductor traces the model with our operators in one graph (fullgraph), and ``reduce-overhead``
    (CUDA graphs) captures them; both give the eager model's loss and gradients."""
    from cs336_basics.model import BasicsTransformerLM
    from cs336_systems.attention import get_attention

    kwargs = dict(vocab_size=500, context_length=256, d_model=256, num_layers=2, num_heads=4, d_ff=512)
    eager = BasicsTransformerLM(**kwargs, attention_fn=get_attention("triton")).cuda()
    token_ids = torch.randint(0, 500, (2, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = eager(token_ids).float().square().mean()
    expected.backward()
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        model = BasicsTransformerLM(**kwargs, attention_fn=get_attention("triton")).cuda()
        model.load_state_dict(eager.state_dict())
        compiled = torch.compile(model, fullgraph=True, mode=mode)
        for _ in range(3):  # CUDA graphs record on a later call
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(token_ids).float().square().mean()
            loss.backward()
        torch.testing.assert_close(loss, expected, rtol=2e-2, atol=1e-3)
        for (name, ours), theirs in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=5e-2, atol=1e-3, msg=lambda m: f"{mode} {name}: {m}")


@pytest.mark.gpu
def test_transformer_lm_with_triton_attention_matches_naive_gpu(fixed_tiles_poisoned_outputs):
    from cs336_basics.model import BasicsTransformerLM

    model = BasicsTransformerLM(vocab_size=500, context_length=256, d_model=256, num_layers=2, num_heads=4, d_ff=512).cuda()
    token_ids = torch.randint(0, 500, (4, 200), device="cuda")
    assert_lm_matches_naive(model, token_ids, "triton", logits_tol=(1e-4, 1e-4))


# ---------------------------------------------------------------------------------------------------
# End-of-run summary of the GPU errors
# ---------------------------------------------------------------------------------------------------


def summarize(records: list[dict]) -> dict:
    """Per precision: the number of grid cases and, per quantity, the worst relative error, the case
    it came from, and the worst ratio to PyTorch's own error at that precision."""
    summary = {}
    for record in records:
        if "note" in record:
            continue
        entry = summary.setdefault(record["precision"], {"cases": 0, "worst": {}})
        entry["cases"] += 1
        case = "{batch}x{heads}x{n_queries}x{n_keys} d={d} causal={is_causal}".format(**record)
        for name, error in record["errors"].items():
            worst = entry["worst"].setdefault(name, {"relative_error": -1.0, "case": "", "max_ratio_to_torch": 0.0})
            if error > worst["relative_error"]:
                worst.update(relative_error=error, case=case, max_abs_error=record["max_abs_errors"][name])
            torch_error = record["torch_errors"][name]
            if torch_error > 0:
                worst["max_ratio_to_torch"] = max(worst["max_ratio_to_torch"], error / torch_error)
    return summary


class _ErrorReport:
    """A pytest plugin, registered by the fixture below, that prints the summary after the run."""

    def pytest_terminal_summary(self, terminalreporter):
        if not _RECORDS:
            return
        summary = summarize(_RECORDS)
        terminalreporter.section("FlashAttention-2 (Triton) on GPU: worst relative errors against float64")
        for precision, entry in summary.items():
            terminalreporter.write_line(f"{precision}: {entry['cases']} cases")
            for name, worst in entry["worst"].items():
                terminalreporter.write_line(
                    f"  {name:2s} {worst['relative_error']:.2e} (max abs {worst['max_abs_error']:.2e}; "
                    f"<= {worst['max_ratio_to_torch']:.2f}x PyTorch's own error) at {worst['case']}"
                )
        for record in _RECORDS:
            if "note" in record:
                terminalreporter.write_line(f"{record['note']}: {json.dumps({k: v for k, v in record.items() if k != 'note'})}")
        results_dir = os.environ.get("CS336_RESULTS_DIR")
        if results_dir:
            path = Path(results_dir) / "flash_attention_triton_errors.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__, "triton": triton.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "error_floor": ERROR_FLOOR, "torch_error_factor": TORCH_ERROR_FACTOR,
                "summary": summary, "records": _RECORDS,
            }, indent=1))
            terminalreporter.write_line(f"written to {path}")


def test_error_report_summarizes_and_writes_json(tmp_path, monkeypatch):
    """The end-of-run report (exercised here on made-up records, since it only runs after GPU tests)."""
    errors = {name: 1e-3 for name in QUANTITIES}
    records = [
        dict(precision="bf16", batch=2, heads=3, n_queries=17, n_keys=17, d=64, is_causal=True,
             errors=errors, torch_errors=dict(errors, L=0.0), max_abs_errors=errors),
        dict(precision="bf16", batch=1, heads=None, n_queries=1, n_keys=1, d=16, is_causal=False,
             errors=dict(errors, dQ=5e-3), torch_errors=errors, max_abs_errors=errors),
        dict(precision="bf16", note="autotuned", errors=errors),
    ]
    summary = summarize(records)
    assert summary["bf16"]["cases"] == 2
    assert summary["bf16"]["worst"]["dQ"]["relative_error"] == 5e-3
    assert summary["bf16"]["worst"]["dQ"]["case"] == "1xNonex1x1 d=16 causal=False"
    assert summary["bf16"]["worst"]["dQ"]["max_ratio_to_torch"] == pytest.approx(5.0)

    class Reporter:
        lines: list[str] = []

        def section(self, title):
            self.lines.append(title)

        def write_line(self, line):
            self.lines.append(line)

    monkeypatch.setattr(sys.modules[__name__], "_RECORDS", records)
    monkeypatch.setenv("CS336_RESULTS_DIR", str(tmp_path))
    reporter = Reporter()
    _ErrorReport().pytest_terminal_summary(reporter)
    assert any(line.startswith("bf16: 2 cases") for line in reporter.lines)
    written = json.loads((tmp_path / "flash_attention_triton_errors.json").read_text())
    assert written["summary"]["bf16"]["cases"] == 2 and len(written["records"]) == 3


@pytest.fixture(scope="module", autouse=True)
def _register_error_report(request):
    name = "flash-attention-triton-error-report"
    if request.config.pluginmanager.get_plugin(name) is None:
        request.config.pluginmanager.register(_ErrorReport(), name)
