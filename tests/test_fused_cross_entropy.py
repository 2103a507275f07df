"""The fused LM head + cross-entropy (``cs336_systems.kernels.cross_entropy``) against ``F.cross_entropy`` on
float64 logits: the Triton row kernel through the CPU interpreter (``tests/interpreter/test_fused_cross_entropy.py``);
here, on the CPU, the same chunked algorithm (with the Triton row step when the kernels are interpreted),
the custom op's registration and ``torch.compile``, input checks; and on a GPU, a large bf16 case and its peak
memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests._flash_checks import relative_error

QUANTITIES = ("loss", "dh", "dw")
# Our error may exceed the plain path's (F.cross_entropy on the logits of a matmul in the same dtype, whose
# gradients are rounded to 16 bits where ours are summed in float32) by this factor plus this floor.
ERROR_FACTOR = 2.0
ERROR_FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def make_inputs(n: int, d: int, vocab: int, dtype: torch.dtype, device="cpu", weight_dtype=None,
                lead: tuple[int, ...] = ()) -> tuple[Tensor, Tensor, Tensor]:
    """Hidden states (``lead + (n, d)``), a head weight with logits of a few units, and targets in [0, vocab)."""
    hidden = torch.randn(*lead, n, d, device=device).to(dtype)
    weight = (2 * torch.randn(vocab, d, device=device) / d**0.5).to(weight_dtype or dtype)
    targets = torch.randint(0, vocab, (*lead, n), device=device)
    return hidden, weight, targets


def run(loss_fn, hidden: Tensor, weight: Tensor, targets: Tensor, grad_scale: float) -> dict[str, Tensor]:
    """The loss, and the gradients of hidden and weight for ``(loss * grad_scale).backward()``."""
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = loss_fn(hidden, weight, targets)
    (loss if grad_scale == 1 else loss * grad_scale).backward()
    return {"loss": loss.detach(), "dh": hidden.grad, "dw": weight.grad}


def plain_loss(compute_dtype: torch.dtype, ignore_index: int = -100):
    """``F.cross_entropy(hidden @ weight.T)`` with both cast to ``compute_dtype``, as autocast would."""
    def loss_fn(hidden, weight, targets):
        logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).T
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least, as autocast
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=ignore_index)

    return loss_fn


def check_against_float64(hidden: Tensor, weight: Tensor, targets: Tensor, grad_scale: float = 1.0,
                          **kwargs) -> None:
    """Loss and both gradients of the fused op against float64, with an error at most about the plain path's at
    the same precision; the loss float32, the gradients in the dtypes of hidden and weight."""
    from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy

    compute_dtype = kwargs.get("compute_dtype") or hidden.dtype
    ignore_index = kwargs.get("ignore_index", -100)
    ours = run(lambda h, w, t: fused_linear_cross_entropy(h, w, t, **kwargs), hidden, weight, targets, grad_scale)
    plain = run(plain_loss(compute_dtype, ignore_index), hidden, weight, targets, grad_scale)
    reference = run(plain_loss(torch.float64, ignore_index), hidden.double(), weight.double(), targets, grad_scale)
    expected_dtypes = {"loss": torch.float32, "dh": hidden.dtype, "dw": weight.dtype}
    for name in QUANTITIES:
        value = ours[name]
        assert value.dtype == expected_dtypes[name], name
        assert value.shape == reference[name].shape, name
        assert torch.isfinite(value).all(), f"{name} is not finite"
        error, plain_error = relative_error(value, reference[name]), relative_error(plain[name], reference[name])
        floor = ERROR_FLOOR[compute_dtype]
        assert error <= ERROR_FACTOR * plain_error + floor, f"{name}: relative error {error:.2e}, plain {plain_error:.2e}"


# ---------------------------------------------------------------------------------------------------
# On the CPU: the chunked algorithm with the PyTorch row step
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, d, vocab, chunk", [(1, 48, 257, None), (37, 48, 1000, 16), (37, 16, 257, 5),
                                                (64, 48, 1000, None)])
def test_matches_float64(n, d, vocab, chunk, dtype):
    check_against_float64(*make_inputs(n, d, vocab, dtype), chunk_tokens=chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_gradient_scales_both_gradients(dtype):
    """``(loss * 3).backward()`` and ``(loss * -0.5)``: the saved gradients times the scalar."""
    check_against_float64(*make_inputs(37, 48, 1000, dtype), grad_scale=3.0, chunk_tokens=16)
    check_against_float64(*make_inputs(37, 48, 257, dtype), grad_scale=-0.5, chunk_tokens=16)


@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_ignore_index(ignore_index):
    """Ignored tokens add no loss and no gradient; the mean is over the others, in every chunk."""
    hidden, weight, targets = make_inputs(37, 48, 257, torch.float32)
    targets[::3] = ignore_index
    check_against_float64(hidden, weight, targets, chunk_tokens=16, ignore_index=ignore_index, grad_scale=2.0)


def test_every_token_ignored_gives_nan_like_pytorch():
    from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy

    hidden, weight, targets = make_inputs(5, 8, 11, torch.float32)
    targets[:] = -100
    hidden.requires_grad_()
    loss = fused_linear_cross_entropy(hidden, weight, targets)
    assert loss.isnan() and F.cross_entropy(hidden @ weight.T, targets).isnan()
    loss.backward()
    assert (hidden.grad == 0).all()


def test_leading_dimensions_are_flattened():
    """hidden (batch, seq, d) with targets (batch, seq), as the LM gives them."""
    check_against_float64(*make_inputs(9, 48, 257, torch.float32, lead=(3,)), chunk_tokens=8)


def test_mixed_dtypes_as_under_autocast():
    """bf16 hidden states and a float32 (master) weight: bf16 matmuls, dh in bf16, dw in float32."""
    check_against_float64(*make_inputs(37, 48, 1000, torch.bfloat16, weight_dtype=torch.float32), chunk_tokens=16)
    # float32 everything, bf16 matmuls asked for explicitly.
    check_against_float64(*make_inputs(37, 48, 1000, torch.float32), compute_dtype=torch.bfloat16, chunk_tokens=16)


def test_autocast_picks_the_compute_dtype():
    """Under bf16 autocast the matmuls run in bf16 (the op itself runs with autocast off); gradients in the leaves'
    float32; ``compute_dtype`` given explicitly overrides autocast."""
    from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy

    hidden, weight, targets = make_inputs(37, 48, 1000, torch.float32)
    plain = run(plain_loss(torch.bfloat16), hidden, weight, targets, 1.0)
    full = run(plain_loss(torch.float32), hidden, weight, targets, 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = run(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_tokens=16), hidden, weight, targets, 1.0)
        explicit = run(lambda h, w, t: fused_linear_cross_entropy(h, w, t, compute_dtype=torch.float32),
                       hidden, weight, targets, 1.0)
    for name in QUANTITIES:
        assert ours[name].dtype == torch.float32
        assert relative_error(ours[name], plain[name]) < 1e-2, name
        assert relative_error(explicit[name], full[name]) < 1e-5, name
    assert relative_error(ours["loss"], full["loss"]) > 1e-5  # bf16 logits, not float32 ones


def test_only_the_gradients_asked_for():
    """A frozen weight, hidden states without gradient, and no_grad (the loss alone, the row kernel skipping its
    gradient pass): each gives what is asked for, and the op gets empty tensors for the others."""
    from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy

    hidden, weight, targets = make_inputs(37, 48, 257, torch.float32)
    reference = run(plain_loss(torch.float64), hidden.double(), weight.double(), targets, 1.0)
    h = hidden.clone().requires_grad_()
    fused_linear_cross_entropy(h, weight, targets, chunk_tokens=16).backward()
    assert relative_error(h.grad, reference["dh"]) < 1e-5
    w = weight.clone().requires_grad_()
    fused_linear_cross_entropy(hidden, w, targets, chunk_tokens=16).backward()
    assert relative_error(w.grad, reference["dw"]) < 1e-5
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden.requires_grad_(), w, targets, chunk_tokens=16)
    assert not loss.requires_grad
    torch.testing.assert_close(loss.double(), reference["loss"], rtol=1e-6, atol=0)


def test_out_of_range_targets_give_nan():
    from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy

    for bad in (257, -1):
        hidden, weight, targets = make_inputs(6, 8, 257, torch.float32)
        targets[2] = bad
        hidden.requires_grad_()
        loss = fused_linear_cross_entropy(hidden, weight, targets)
        assert loss.isnan()
        loss.backward()
        assert hidden.grad[2].isnan().all() and not hidden.grad[[0, 1, 3, 4, 5]].isnan().any()


def test_default_chunk_rule():
    from cs336_systems.kernels.cross_entropy import CHUNK_LOGITS_BYTES, default_chunk_tokens

    # Qwen-size vocabulary: the 1 GiB budget binds at large d (3533 rows, rounded down to 3456) ...
    assert default_chunk_tokens(32768, 151936, 4096, torch.bfloat16) == 3456
    assert 3456 * 151936 * 2 <= CHUNK_LOGITS_BYTES
    # ... the float32 dW accumulator's size (4 d / 2 rows in bf16) at small d ...
    assert default_chunk_tokens(32768, 151936, 768, torch.bfloat16) == 1536
    assert default_chunk_tokens(32768, 151936, 768, torch.float32) == 768
    # ... and the number of tokens when fewer; never below one row.
    assert default_chunk_tokens(37, 1000, 48, torch.float32) == 37
    assert default_chunk_tokens(37, 1000, 48, torch.bfloat16) == 37
    assert default_chunk_tokens(0, 1000, 48, torch.float32) == 1
    assert default_chunk_tokens(10, 10**10, 4096, torch.float32) == 1


def test_zero_tokens():
    from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy

    hidden = torch.randn(0, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    loss = fused_linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.int64))
    assert loss.isnan()  # a mean over no token, as F.cross_entropy
    loss.backward()
    assert hidden.grad.shape == (0, 8) and (weight.grad == 0).all()


def test_rejects_unsupported_inputs():
    from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy as fused

    hidden, weight, targets = make_inputs(4, 8, 11, torch.float32)
    with pytest.raises(ValueError, match="vocab_size, d_model"):
        fused(hidden, weight[0], targets)
    with pytest.raises(ValueError, match="d_model"):
        fused(hidden[:, :7], weight, targets)
    with pytest.raises(ValueError, match="targets must have hidden's shape"):
        fused(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="vocabulary is empty"):
        fused(hidden, weight[:0], targets)
    with pytest.raises(TypeError, match="int64"):
        fused(hidden, weight, targets.int())
    with pytest.raises(TypeError, match="float64 for hidden"):
        fused(hidden.double(), weight, targets)
    with pytest.raises(TypeError, match="compute_dtype"):
        fused(hidden, weight, targets, compute_dtype=torch.float64)
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="one device"):
        fused(hidden, weight.to("meta"), targets)


def test_module_wraps_the_function():
    from cs336_systems.kernels.cross_entropy import FusedLinearCrossEntropy, fused_linear_cross_entropy

    hidden, weight, targets = make_inputs(37, 48, 257, torch.float32)
    targets[0] = 3
    module = FusedLinearCrossEntropy(chunk_tokens=16, ignore_index=3)
    assert list(module.parameters()) == [] and "chunk_tokens=16" in repr(module)
    torch.testing.assert_close(module(hidden, weight, targets),
                               fused_linear_cross_entropy(hidden, weight, targets, ignore_index=3), rtol=1e-6, atol=0)


def test_opcheck():
    """Schema, fake implementation, autograd registration and AOT dispatch of the custom op."""
    from cs336_systems.kernels import cross_entropy  # noqa: F401 (registers the op)

    op = torch.ops.cs336_systems.fused_linear_cross_entropy.default
    hidden, weight, targets = make_inputs(37, 16, 257, torch.float32)
    targets[5] = -100
    torch.library.opcheck(op, (hidden.requires_grad_(), weight.requires_grad_(), targets, 16, torch.float32, -100,
                               True, True))
    h16, w16, _ = make_inputs(37, 16, 257, torch.bfloat16)
    torch.library.opcheck(op, (h16.requires_grad_(), w16, targets, 8, torch.bfloat16, -100, True, False))


def test_torch_compile_traces_without_graph_breaks():
    """``fullgraph=True`` fails on any graph break; the compiled function's loss and gradients are the eager ones."""
    from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy

    hidden, weight, targets = make_inputs(37, 48, 257, torch.float32)

    def loss_of_head(h, w, t):
        loss = fused_linear_cross_entropy(torch.tanh(h) * 2, w, t, chunk_tokens=16)
        return 3 * loss + h.square().mean()

    compiled = torch.compile(loss_of_head, backend="aot_eager", fullgraph=True)
    results = [run(fn, hidden, weight, targets, 1.0) for fn in (loss_of_head, compiled)]
    for name in QUANTITIES:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=0, atol=0)


@pytest.mark.compiled_kernels
def test_row_kernel_compiles_for_h100_without_spills():
    """Ahead-of-time compile for sm_90 (see ``_flash_aot.py``): the interpreter does not check what only the
    compiler does (types of loop-carried values, layouts); no register spills at the default tile."""
    from cs336_systems.kernels import cross_entropy
    from cs336_systems.kernels.launch import interpreting
    from tests._flash_aot import compile_for_gpu, nvidia_toolchain_available, resource_usage

    if interpreting() or not nvidia_toolchain_available():
        pytest.skip("needs Triton's NVIDIA backend and ptxas, outside the interpreter")
    for dtype in (torch.bfloat16, torch.float32):
        for vocab in (151936, 1000):
            logits, targets = torch.empty(16, vocab, dtype=dtype), torch.empty(16, dtype=torch.int64)
            block_v, num_warps = cross_entropy._block_v(vocab)
            for write_grad in (True, False):
                compiled = compile_for_gpu(
                    cross_entropy.cross_entropy_rows_kernel,
                    (logits, targets, torch.empty(16), torch.empty(1), vocab, vocab, -100),
                    dict(BLOCK_V=block_v, WRITE_GRAD=write_grad, num_warps=num_warps),
                )
                assert resource_usage(compiled).spill_bytes == 0, (dtype, vocab, write_grad)


# ---------------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, d, vocab, chunk", [(1, 48, 257, None), (37, 48, 1000, 16), (300, 128, 50257, 128),
                                                (1000, 64, 151936, None)])
def test_matches_float64_on_gpu(n, d, vocab, chunk, dtype):
    check_against_float64(*make_inputs(n, d, vocab, dtype, "cuda"), chunk_tokens=chunk, grad_scale=3.0)


@pytest.mark.gpu
def test_mixed_dtypes_and_ignore_index_on_gpu():
    """bf16 matmuls on a float32 weight: the float32-output addmm that accumulates dW."""
    hidden, weight, targets = make_inputs(333, 64, 32000, torch.bfloat16, "cuda", weight_dtype=torch.float32)
    targets[::5] = -100
    check_against_float64(hidden, weight, targets, chunk_tokens=100)


@pytest.mark.gpu
def test_large_bf16_matches_and_never_holds_the_logits():
    """32768 tokens, d = 512, V = 151936 in bf16: the logits alone would be 10 GB (the unfused path holds about
    six times that). The fused forward + backward must allocate under a quarter of them beyond its inputs and
    match a float32 reference (computed a slice of tokens at a time)."""
    from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy

    n, d, vocab = 32768, 512, 151936
    hidden, weight, targets = make_inputs(n, d, vocab, torch.bfloat16, "cuda")
    targets[::7] = -100
    hidden.requires_grad_()
    weight.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    logits_bytes = n * vocab * 2
    assert peak < logits_bytes / 4, f"peak {peak / 2**30:.2f} GiB beyond the inputs, logits {logits_bytes / 2**30:.2f} GiB"

    # float32 reference, 2048 tokens at a time: loss sum and both gradients of the mean.
    h32, w32 = hidden.detach().float(), weight.detach().float().requires_grad_()
    n_counted = (targets != -100).sum()
    ref_loss, ref_dh = torch.zeros((), device="cuda"), torch.empty_like(h32)
    for start in range(0, n, 2048):
        h = h32[start:start + 2048].requires_grad_()
        part = F.cross_entropy(h @ w32.T, targets[start:start + 2048], reduction="sum") / n_counted
        part.backward()
        ref_loss += part.detach()
        ref_dh[start:start + 2048] = h.grad
    assert relative_error(loss, ref_loss) < 1e-3
    assert relative_error(hidden.grad, ref_dh) < 1e-2
    assert relative_error(weight.grad, w32.grad) < 1e-2
