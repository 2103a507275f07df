"""Our FlashAttention-2 operator (``cs336_systems.attention.op``) and its portable Triton backend: correctness
against a float64 reference, the grader's contract, input errors, and that the kernels compile for an H100.

How the tests are split:

* CPU: input errors, and (``compiled_kernels``, see ``tests/_pytest_plugin.py``) an ahead-of-time compile for sm_90
  with Triton's own ptxas (catches what only the compiler sees: non-constexpr globals, shared memory,
  register spills), no GPU needed.
* CPU, through the Triton interpreter (``tests/interpreter/test_attention.py``), float32 and float16 (and bfloat16,
  which the operator computes in float32 there).
* GPU (marker ``gpu``): the error grid of ``tests/_flash_error_grid.py`` (58 shapes x dtypes against float64
  with NaN-poisoned outputs, gradients included, each case within its bound); the grader's shapes; autotuning;
  the leaderboard shape against PyTorch's fused attention; ``torch.compile``; the language model. The tests
  write no results: ``scripts/flash_error_grid.py`` measures the same grid for the writeup.
"""

from __future__ import annotations

import collections
import subprocess
import sys

import pytest
import torch

from cs336_systems.attention import get_attention
from cs336_systems.attention.backends import triton as triton_backend
from cs336_systems.attention.backends import triton_kernels
from cs336_systems.attention.config import FLASH_CONFIG, FlashConfig
from cs336_systems.attention.op import FlashAttention2Triton, flash_attention
from cs336_systems.kernels import launch
from cs336_systems.kernels.launch import Kernel, poisoned_outputs
from tests import adapters
from tests._flash_aot import (
    SHARED_MEMORY_PER_BLOCK,
    compiled_and_short_launches,
    portable_launches,
    spill_ceiling,
)
from tests._flash_checks import (
    QUANTITIES,
    assert_lm_matches_naive,
    hopper_gpu,
    make_qkv,
    relative_error,
    run_function,
    run_reference,
)
from tests._flash_error_grid import (
    CHECK_KEYS,
    Case,
    ERROR_FLOOR,
    awkward_grid,
    failures,
    grid,
    measure,
    measure_autotuned,
    measure_leaderboard_shape,
    sixteen_bit_grid,
    summarize,
)

# ---------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------


def test_flash_attention_is_causal_by_default():
    """``flash_attention`` (``get_attention("triton")``) follows the model's protocol: causal unless told otherwise;
    the grader's ``FlashAttention2Triton.apply`` keeps its default of False."""
    import inspect

    assert get_attention("triton") is flash_attention
    assert inspect.signature(flash_attention).parameters["is_causal"].default is True
    assert inspect.signature(FlashAttention2Triton.forward).parameters["is_causal"].default is False


def _valid(**overrides):
    shapes = dict(q=(2, 3, 20, 32), k=(2, 3, 24, 32), v=(2, 3, 24, 32))
    shapes.update(overrides)
    dtype = shapes.pop("dtype", torch.float32)
    return [torch.randn(shapes[name], dtype=dtype) for name in ("q", "k", "v")]


@pytest.mark.parametrize(
    "inputs, error, match",
    [
        (_valid(dtype=torch.float64), TypeError, "unsupported dtype"),
        (_valid(q=(2, 3, 20, 20), k=(2, 3, 24, 20), v=(2, 3, 24, 20)), ValueError, r"16, 32, 48, 64, 80, 96, 128"),
        (_valid(q=(2, 3, 20, 136), k=(2, 3, 24, 136), v=(2, 3, 24, 136)), ValueError, r"multiples of 8 up to 128"),
        (_valid(q=(2, 3, 20, 0), k=(2, 3, 24, 0), v=(2, 3, 24, 0)), ValueError, "head dimension d must be positive"),
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


def test_rejects_meta_tensors():
    with pytest.raises(ValueError, match="meta tensors, which hold no data"):
        FlashAttention2Triton.apply(*(x.to("meta") for x in _valid()), False)


@pytest.mark.compiled_kernels
def test_rejects_cpu_tensors_without_interpreter():
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        FlashAttention2Triton.apply(*_valid(), True)


@pytest.mark.slow
def test_float32_dot_precision_follows_pytorch():
    """TF32 exactly when PyTorch's matmuls may use it, through either precision API, else the configured float32
    products (tf32x3 by default); run in a fresh process, since mixing the two APIs leaves PyTorch's legacy flag
    unreadable."""
    script = """
import torch
from cs336_systems.attention.backends.triton import _dot_precision
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
    assert result.stdout.split() == ["tf32x3", "tf32", "tf32", "tf32x3", "tf32", "tf32"]


def test_float32_products_follow_the_configuration_where_pytorch_does_not_allow_tf32(monkeypatch):
    monkeypatch.setattr(triton_backend, "_pytorch_allows_tf32", lambda: False)
    with FLASH_CONFIG.use(FlashConfig(fp32_products="tf32x3")):
        assert triton_backend._dot_precision(torch.float32) == "tf32x3"
        assert triton_backend._dot_precision(torch.bfloat16) == "tf32"  # 16-bit inputs: the dot's default
    with FLASH_CONFIG.use(FlashConfig(fp32_products="ieee")):
        assert triton_backend._dot_precision(torch.float32) == "ieee"
    assert triton_backend._dot_precision(torch.float32) == "tf32x3"  # the default configuration
    monkeypatch.setattr(triton_backend, "_pytorch_allows_tf32", lambda: True)
    with FLASH_CONFIG.use(FlashConfig(fp32_products="tf32x3")):
        assert triton_backend._dot_precision(torch.float32) == "tf32"  # PyTorch allows TF32: so do we


def test_float32_products_configuration_is_checked_and_read_from_the_environment():
    with pytest.raises(ValueError, match="fp32_products must be one of ieee, tf32x3"):
        FlashConfig(fp32_products="tf32x2")
    assert FlashConfig.from_environment({"CS336_FLASH_FP32": "tf32x3"}).fp32_products == "tf32x3"
    assert FlashConfig.from_environment({"CS336_FLASH_FP32": "ieee"}).fp32_products == "ieee"
    assert FlashConfig.from_environment({}).fp32_products == "tf32x3"


def test_tf32x3_products_take_their_own_fixed_tiles(monkeypatch):
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)
    for name in ("fwd", "bwd"):
        for head_dim in (64, 128):
            ieee = triton_backend.fixed_config(name, torch.float32, head_dim)
            tf32x3 = triton_backend.fixed_config(name, torch.float32, head_dim, "tf32x3")
            assert ieee == triton_backend.fixed_config(name, torch.float32, head_dim, "ieee")
            assert tf32x3.all_kwargs() != ieee.all_kwargs() or head_dim > 64
        assert triton_backend.fixed_config(name, torch.bfloat16, 64, "tf32x3") == triton_backend.fixed_config(
            name, torch.bfloat16, 64)  # the precision concerns float32 inputs only


@pytest.mark.compiled_kernels
@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128, 48, 80])
def test_tf32x3_kernels_run_their_products_on_the_tensor_cores_for_h100(head_dim):
    """Float32 with tf32x3: the forward's and backward's products compile for sm_90 to TF32 tensor-core
    instructions (wgmma or mma.sync on .tf32 operands) at the table's tiles, within their spill ceilings."""
    from tests._flash_aot import compile_for_gpu, nvidia_toolchain_available, resource_usage

    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    with FLASH_CONFIG.use(FlashConfig(fp32_products="tf32x3")):
        launches = portable_launches(torch.float32, head_dim, True)
    for name in ("fwd", "bwd"):
        launch_ = launches[name]
        assert launch_.kwargs["DOT_PRECISION"] == "tf32x3"
        compiled = compile_for_gpu(launch_.kernel, launch_.args, launch_.kwargs)
        usage, ptx = resource_usage(compiled), compiled.asm["ptx"]
        assert ".tf32" in ptx and ("wgmma" in ptx or "mma.sync" in ptx), name
        assert usage.spill_bytes <= spill_ceiling(name, "tf32x3", head_dim), f"{name}: {usage}"
        assert usage.shared_bytes <= SHARED_MEMORY_PER_BLOCK[90], f"{name}: {usage}"


def test_forward_launches_the_tables_tiles_once_per_signature(monkeypatch):
    """The forward takes the fixed tiles of its dtype and head dim from the table, compiles once per signature
    (dtype, shapes, strides, alignment, causal) and launches later calls on the short path."""
    monkeypatch.setattr(launch, "_INTERPRETING", False)  # as on a GPU, with the launches recorded
    monkeypatch.setattr(triton_backend.KERNELS["fwd"], "entries", collections.OrderedDict())
    q, k, v = (torch.randn(2, 3, 200, 64, dtype=torch.bfloat16) for _ in range(3))
    with compiled_and_short_launches() as (compiled, short):
        for _ in range(3):
            triton_backend.forward(q, k, v, True, 0.125)
        triton_backend.forward(*(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)), True, 0.125)
    (_, grid, _, entry), (_, _, _, other) = compiled
    tiles = triton_backend.FIXED_TILES[(16, "any", 64)].forward
    assert entry.config is other.config is tiles  # the table's entry, whatever the strides
    assert grid == (-(-200 // tiles.kwargs["BLOCK_M"]), 6) and [launched[1] for launched in short] == [grid] * 2
    assert entry.kwargs["HEAD_DIM"] == 64 and entry.kwargs["IS_CAUSAL"] and entry.kwargs["DOT_PRECISION"] == "tf32"
    assert entry.kwargs["stride_qm"] == 64 and other.kwargs["stride_qm"] == 3 * 64


def test_fixed_tiles_cover_every_head_dim_and_precision(monkeypatch):
    """Every head dim the kernels run has a row of tiles per dtype size and float32 products, each with its reason,
    which ``fixed_config`` returns (TF32 takes the IEEE row); off Hopper only the listed forwards differ."""
    monkeypatch.setattr(launch, "_INTERPRETING", False)
    rows = triton_backend.FIXED_TILES
    for head_dim in triton_backend.HEAD_DIMS:
        for dtype, precision, row in [(torch.bfloat16, "tf32", rows[(16, "any", head_dim)]),
                                      (torch.float16, "tf32", rows[(16, "any", head_dim)]),
                                      (torch.float32, "ieee", rows[(32, "ieee", head_dim)]),
                                      (torch.float32, "tf32", rows[(32, "ieee", head_dim)]),
                                      (torch.float32, "tf32x3", rows[(32, "tf32x3", head_dim)])]:
            assert "(log: " in row.why
            assert triton_backend.fixed_config("fwd", dtype, head_dim, precision) is row.forward
            assert triton_backend.fixed_config("bwd", dtype, head_dim, precision) is row.backward
            off_hopper = triton_backend.OTHER_GPU_FORWARD.get((16 if dtype != torch.float32 else 32,
                                                               "any" if dtype != torch.float32 else precision,
                                                               head_dim), row.forward)
            assert triton_backend.fixed_config("fwd", dtype, head_dim, precision, capability=100) is off_hopper


H100_SHARED_MEMORY = SHARED_MEMORY_PER_BLOCK[90]


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
     pytest.param(torch.float16, 128, False, marks=pytest.mark.slow), (torch.float32, 32, True),
     (torch.bfloat16, 80, True),  # two column parts, 64 + 16 (the 2.7B model's head dim)
     pytest.param(torch.float16, 96, False, marks=pytest.mark.slow),
     pytest.param(torch.float32, 48, True, marks=pytest.mark.slow)],
)
def test_fixed_configs_compile_for_h100_within_their_spill_ceilings(dtype, head_dim, is_causal):
    from tests._flash_aot import (
        compile_for_gpu,
        nvidia_toolchain_available,
        resource_usage,
        serialized_wgmma,
    )

    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    # float32 with IEEE products; the tf32x3 tiles (the default) have their own test, spills included
    with FLASH_CONFIG.use(FlashConfig(fp32_products="ieee")):
        launches = portable_launches(dtype, head_dim, is_causal)
    for name, launch_ in launches.items():
        compiled = compile_for_gpu(launch_.kernel, launch_.args, launch_.kwargs)
        usage = resource_usage(compiled)
        products = "ieee" if dtype == torch.float32 else "any"
        assert usage.spill_bytes <= spill_ceiling(name, products, head_dim), f"{name}: {usage}"
        assert usage.shared_bytes <= H100_SHARED_MEMORY, f"{name}: {usage}"
        if name == "fwd":
            assert serialized_wgmma(compiled) is None, name


@pytest.mark.slow
@pytest.mark.compiled_kernels
@pytest.mark.xfail(strict=True, reason="ptxas serialises the Triton backward's wgmma on sm_90 (C7514): its consecutive "
                   "sweeps carry the dK/dV and dQ accumulators from loop to loop. One masked sweep each fixes it, but "
                   "lost its measurement (H100, d = 64 backward 4-10 % slower); on Hopper the Gluon "
                   "kernels run 16-bit attention instead")
def test_backward_wgmma_are_not_serialized_on_h100():
    from tests._flash_aot import compile_for_gpu, nvidia_toolchain_available, serialized_wgmma

    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    backward = portable_launches(torch.bfloat16, 64, True)["bwd"]
    assert serialized_wgmma(compile_for_gpu(backward.kernel, backward.args, backward.kwargs)) is None


@pytest.mark.compiled_kernels
@pytest.mark.slow
def test_autotune_configs_compile_for_h100():
    """Every configuration the autotuner may try on the leaderboard's dtype and head dim compiles and
    fits in shared memory (spilling ones are allowed: the autotuner just finds them slow)."""
    from tests._flash_aot import (
        compile_for_gpu,
        nvidia_toolchain_available,
        resource_usage,
    )

    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    autotuners = {name: kernel.autotuner for name, kernel in triton_backend.KERNELS.items()}
    for name, launch_ in portable_launches(torch.bfloat16, 64, True).items():
        if name == "delta":
            continue
        autotuner = autotuners[name]
        meta = {key: value for key, value in launch_.kwargs.items() if key in launch_.kernel.arg_names}
        for config in autotuner.early_config_prune(autotuner.configs, {"Q": launch_.args[0]}, **meta):
            compiled = compile_for_gpu(launch_.kernel, launch_.args, {**meta, **config.all_kwargs()})
            assert resource_usage(compiled).shared_bytes <= H100_SHARED_MEMORY, f"{name} {config}"


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def fixed_tiles_poisoned_outputs():
    """The default configuration (fixed tiles: far fewer compilations than autotuning), and outputs allocated full
    of NaN so that an element no kernel writes shows up."""
    with FLASH_CONFIG.use(FlashConfig()), poisoned_outputs():
        yield


@pytest.mark.gpu
@pytest.mark.parametrize("case", grid(), ids=str)
def test_matches_float64_reference_gpu(case):
    assert not failures(measure(case))


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_gpu(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("case", sixteen_bit_grid(), ids=str)
def test_hopper_kernels_match_float64_reference_gpu(case):
    """The 16-bit cases of the grid with the Hopper (Gluon) forward and backward forced, whatever the size
    ("auto" leaves the small ones to the Triton kernels)."""
    assert not failures(measure(case, kernels="hopper"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", awkward_grid(), ids=str)
def test_triton_kernels_match_float64_reference_gpu(case):
    """Awkward cases with the portable Triton kernels forced (on a Hopper GPU "auto" runs the large 16-bit ones on
    the Gluon kernels)."""
    assert not failures(measure(case, kernels="triton"))


SPLIT_HEAD_DIM_CASES = [Case("bf16", 2, 4, 2048, 2048, 80, True), Case("fp16", 1, 3, 1000, 1000, 80, False),
                        Case("fp32", 2, 3, 100, 129, 80, True), Case("tf32", 1, 2, 1000, 1000, 80, True),
                        Case("bf16", 3, None, 129, 100, 96, True), Case("fp16", 2, 3, 17, 4096, 48, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SPLIT_HEAD_DIM_CASES, ids=str)
def test_split_head_dims_match_float64_reference_gpu(case):
    """Head dims the portable kernels hold in two column parts (80 = 64 + 16), with those kernels forced."""
    assert not failures(measure(case, kernels="triton"))


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_gpu(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("case", [case for case in SPLIT_HEAD_DIM_CASES if case.precision in ("bf16", "fp16")]
                         + [Case("bf16", 1, 4, 1000, 1000, 80, False), Case("fp16", 2, 2, 777, 1500, 96, True),
                            Case("bf16", 2, 3, 300, 200, 48, True)], ids=str)
def test_hopper_split_head_dims_match_float64_reference_gpu(case):
    """Head dims the Hopper kernels hold in two column parts (80 = 64 + 16), with the Hopper kernels forced."""
    assert not failures(measure(case, kernels="hopper"))


SPLIT_KEY_CASES = [Case("fp32", 1, None, 4096, 4096, 128, True), Case("fp32", 1, 2, 2048, 2048, 64, False),
                   Case("fp32", 1, 1, 1031, 1031, 32, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SPLIT_KEY_CASES, ids=str)
def test_forward_split_over_keys_matches_float64_reference_gpu(case):
    """Float32 calls of one or two heads, whose forward and backward split their sweeps on a GPU (checked), through
    the operator, gradients included (the backward reads the combined logsumexp)."""
    Q = torch.empty(case.batch, *([case.heads] if case.heads else []), case.n_queries, case.d, device="cuda")
    assert triton_backend.forward_key_splits(Q, Q, case.is_causal) > 1 and triton_backend.backward_splits(Q, Q) > 1
    assert not failures(measure(case, kernels="triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tf32x3_products_keep_float32_accuracy_gpu(fixed_tiles_poisoned_outputs, head_dim):
    """Float32 inputs with three TF32 products: every output and gradient within twice the IEEE products' relative
    error against float64 (plus a floor of 1e-6 where both are at float32's rounding)."""
    Q, K, V = make_qkv(2, 4, 1000, 1000, head_dim, torch.float32, "cuda")
    dO = torch.randn_like(Q)
    reference = run_reference(Q, K, V, True, dO)
    errors = {}
    for products in ("ieee", "tf32x3"):
        with FLASH_CONFIG.use(FlashConfig(kernels="triton", fp32_products=products)):
            result = run_function(FlashAttention2Triton, Q, K, V, True, dO)
        errors[products] = {name: relative_error(result[name], reference[name]) for name in result}
    for name, ieee in errors["ieee"].items():
        assert errors["tf32x3"][name] <= 2 * ieee + 1e-6, (name, errors)


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
    record = measure_autotuned(head_dim)
    for name in QUANTITIES:
        assert record["non_finite"][name] == 0, name
        assert record["errors"][name] <= ERROR_FLOOR["bf16"], name
    assert record["chosen_configs"]


@pytest.mark.gpu
def test_leaderboard_shape_against_pytorch_fused_attention_gpu():
    """16 x 16384 x 64, bf16, causal: too large for a materialised float64 reference, so the reference
    is PyTorch's fused attention in float32."""
    record = measure_leaderboard_shape(timed=False)
    for name, error in record["errors"].items():
        assert record["non_finite"][name] == 0, name
        assert error <= ERROR_FLOOR["bf16"], f"{name}: {error:.2e}"


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
# The error grid's bookkeeping, on made-up records (CPU)
# ---------------------------------------------------------------------------------------------------


def _record(precision="bf16", errors=1e-3, torch_errors=1e-3, **changes):
    record = dict(precision=precision, batch=2, heads=3, n_queries=17, n_keys=17, d=64, is_causal=True,
                  errors={name: errors for name in QUANTITIES},
                  torch_errors={name: torch_errors for name in QUANTITIES},
                  max_abs_errors={name: errors for name in QUANTITIES},
                  dtypes={name: "torch.float32" if name == "L" else "torch.bfloat16" for name in QUANTITIES},
                  non_finite={name: 0 for name in QUANTITIES}, grader_close={name: True for name in QUANTITIES})
    record.update(changes)
    assert set(CHECK_KEYS) <= set(record)
    return record


def test_error_grid_summary():
    errors = {name: 1e-3 for name in QUANTITIES}
    records = [
        _record(torch_errors=0.0),
        _record(batch=1, heads=None, n_queries=1, n_keys=1, d=16, is_causal=False, errors=1e-3,
                torch_errors=1e-3) | {"errors": dict(errors, dQ=5e-3)},
        dict(precision="bf16", note="autotuned", errors=errors),
    ]
    summary = summarize(records)
    assert summary["bf16"]["cases"] == 2
    assert summary["bf16"]["worst"]["dQ"]["relative_error"] == 5e-3
    assert summary["bf16"]["worst"]["dQ"]["case"] == "1xNonex1x1 d=16 causal=False"
    assert summary["bf16"]["worst"]["dQ"]["max_ratio_to_torch"] == pytest.approx(5.0)


def test_error_grid_bounds():
    assert failures(_record()) == []
    assert failures(_record(errors=0.05, torch_errors=0.02)) == []  # within 3x PyTorch's own error
    assert len(failures(_record(errors=0.05, torch_errors=0.01))) == len(QUANTITIES)
    assert failures(_record(non_finite=dict.fromkeys(QUANTITIES, 0) | {"dV": 3})) == ["dV: 3 non-finite elements"]
    not_close = dict.fromkeys(QUANTITIES, True) | {"O": False}
    assert failures(_record(grader_close=not_close)) == []  # bf16: the floor only
    fp16 = _record("fp16", dtypes={name: "torch.float32" if name == "L" else "torch.float16" for name in QUANTITIES},
                   grader_close=not_close)
    assert failures(fp16) == ["O: not within the grader's rtol = atol = 1e-2 of float64"]


@pytest.mark.compiled_kernels
@pytest.mark.parametrize("capability", [90, 100])
def test_split_kernels_compile_at_the_plain_kernels_tiles(monkeypatch, capability):
    """The forward split over keys and its combination, the backward split and its sums, float32 at head dim 128
    with tf32x3 products and the table's tiles, as the backend launches them: they compile for an H100 and a B200
    within their spill ceilings (the combination and the sums spill nothing)."""
    from tests._flash_aot import compile_for_gpu, nvidia_toolchain_available, recorded_launches, resource_usage

    if not nvidia_toolchain_available():
        pytest.skip("this Triton has no NVIDIA backend or ptxas")
    monkeypatch.setattr(triton_backend, "_capability", lambda device: capability)
    q = torch.randn(1, 1, 4096, 128)
    with FLASH_CONFIG.use(FlashConfig(fp32_products="tf32x3")), recorded_launches() as launches:
        O, L = triton_backend.split_forward(q, q, q, True, 128 ** -0.5, 2)
        triton_backend.split_backward(q, q, q, O, L, q, True, 128 ** -0.5, 2)
    names = ["fwd_split", "combine", "delta", "bwd_split", "sum", "sum", "sum"]
    assert [launch_.kernel.__name__ for launch_ in launches] == [
        "attn_fwd_split_kernel", "attn_fwd_combine_kernel", "attn_bwd_delta_kernel", "attn_bwd_split_kernel",
        *["attn_bwd_sum_parts_kernel"] * 3]
    tiles = triton_backend.FIXED_TILES[(32, "tf32x3", 128)]
    assert launches[0].kwargs["BLOCK_M"] == tiles.forward.kwargs["BLOCK_M"]  # the plain kernels' tiles
    assert launches[3].kwargs["TILE"] == tiles.backward.kwargs["TILE"]
    compiled = dict(zip(names, launches))  # one of the three sums
    del compiled["delta"]
    for name, launch_ in compiled.items():
        usage = resource_usage(compile_for_gpu(launch_.kernel, launch_.args, launch_.kwargs, capability=capability))
        assert usage.spill_bytes <= spill_ceiling(name, "tf32x3", 128, capability), f"{name}: {usage}"
