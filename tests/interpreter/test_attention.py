"""FlashAttention-2 Triton kernels under the Triton CPU interpreter, at small sizes (see ``conftest.py``).

float32 and float16 only: the interpreter's ``tl.dot`` multiplies the raw bits of bfloat16 values.
The interpreter uses one small configuration with unequal tiles (see ``INTERPRETER_CONFIGS``), so
these sizes cover full, ragged, diagonal and skipped tiles in every kernel.
"""

from __future__ import annotations

import pytest
import torch

from cs336_systems.attention.backends.common import batch_head_strides
from cs336_systems.attention.op import FlashAttention2Triton
from cs336_systems.kernels.launch import interpreting, poisoned_outputs
from tests._flash_checks import (
    QUANTITIES,
    assert_lm_matches_naive,
    make_qkv,
    relative_error,
    run_function,
    run_reference,
)

# float32 through the interpreter is NumPy float32, so its error is rounding only.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3}


@pytest.fixture(autouse=True)
def _poison_outputs():
    with poisoned_outputs():
        yield


def test_running_in_interpreter():
    assert interpreting()


# (batch, heads or None for 3-D, n_queries, n_keys, d, is_causal, dtype)
CASES = [
    (2, None, 1, 1, 16, True, torch.float32),
    (2, None, 17, 17, 16, False, torch.float32),
    (1, 2, 100, 100, 32, True, torch.float32),
    (1, 2, 129, 129, 16, False, torch.float16),
    (2, None, 64, 64, 64, True, torch.float16),
    (1, 2, 33, 70, 16, True, torch.float32),
    (1, 2, 70, 33, 32, True, torch.float32),
    (2, None, 48, 100, 16, False, torch.float16),
    (1, None, 47, 47, 128, True, torch.float32),
    (1, 1, 16, 32, 16, True, torch.float16),
    (1, None, 1, 40, 16, True, torch.float32),
    (3, 3, 21, 1, 32, False, torch.float32),
    (2, None, 90, 20, 64, False, torch.float16),
    (1, 2, 31, 31, 128, False, torch.float16),
]


@pytest.mark.parametrize("batch, heads, n_queries, n_keys, d, is_causal, dtype", CASES)
def test_matches_float64_reference(batch, heads, n_queries, n_keys, d, is_causal, dtype):
    check_matches_float64_reference(batch, heads, n_queries, n_keys, d, is_causal, dtype)


def check_matches_float64_reference(batch: int, heads: int | None, n_queries: int, n_keys: int, d: int,
                                    is_causal: bool, dtype: torch.dtype) -> None:
    """O, L and the gradients of our operator on fresh inputs of this shape against float64: every element
    written, relative error within :data:`TOLERANCE`, and the grader's criterion."""
    Q, K, V = make_qkv(batch, heads, n_queries, n_keys, d, dtype, "cpu")
    dO = torch.randn(Q.shape).to(dtype)
    result = run_function(FlashAttention2Triton, Q, K, V, is_causal, dO)
    reference = run_reference(Q, K, V, is_causal, dO)
    for name in QUANTITIES:
        assert result[name].dtype == (torch.float32 if name == "L" else dtype)
        assert torch.isfinite(result[name]).all(), f"{name} has elements that were never written"
        error = relative_error(result[name], reference[name])
        assert error <= TOLERANCE[dtype], f"{name}: relative error {error:.2e}"
        # The grader's criterion.
        torch.testing.assert_close(result[name].double(), reference[name], rtol=1e-2, atol=1e-2)


def test_expanded_output_gradient_from_sum():
    """``o.sum().backward()`` sends an all-stride-0 dO."""
    Q, K, V = make_qkv(2, 2, 40, 40, 16, torch.float32, "cpu")
    FlashAttention2Triton.apply(Q, K, V, True).sum().backward()
    reference = run_reference(Q, K, V, True, torch.ones(Q.shape))
    for name, grad in (("dQ", Q.grad), ("dK", K.grad), ("dV", V.grad)):
        assert relative_error(grad, reference[name]) <= 1e-5, name


def test_non_contiguous_inputs():
    """Heads-from-features layout (as the model's rearrange gives) and a strided head dimension."""
    batch, seq, heads, d = 2, 37, 2, 16
    Q = torch.randn(batch, seq, heads, d).transpose(1, 2).requires_grad_()  # (batch, heads, seq, d), strided
    K = torch.randn(batch, heads, seq, 2 * d)[..., ::2].requires_grad_()  # unit stride broken along d
    V = torch.randn(batch, heads, d, seq).transpose(-1, -2).requires_grad_()
    assert not (Q.is_contiguous() or K.is_contiguous() or V.is_contiguous())
    dO = torch.randn(batch, heads, seq, d)
    result = run_function(FlashAttention2Triton, Q, K, V, True, dO)
    reference = run_reference(Q, K, V, True, dO)
    for name in QUANTITIES:
        assert relative_error(result[name], reference[name]) <= 1e-5, name


def test_three_and_four_dimensional_inputs_agree():
    Q, K, V = make_qkv(3, None, 50, 50, 32, torch.float32, "cpu")
    O3 = FlashAttention2Triton.apply(Q, K, V, True)
    O4 = FlashAttention2Triton.apply(Q[None], K[None], V[None], True)
    assert O4.shape == (1, 3, 50, 32)
    torch.testing.assert_close(O4[0], O3, rtol=0, atol=0)


def test_transformer_lm_with_triton_attention_matches_naive():
    from cs336_basics.model import BasicsTransformerLM

    model = BasicsTransformerLM(vocab_size=50, context_length=32, d_model=64, num_layers=2, num_heads=2, d_ff=128)
    token_ids = torch.randint(0, 50, (2, 24))
    assert_lm_matches_naive(model, token_ids, "triton", logits_tol=(1e-4, 1e-5))


@pytest.mark.slow
def test_torch_compile_of_apply():
    """The leaderboard times torch.compile(FlashAttention2.apply): our kernels are operators, so the whole
    Function traces into one graph (``fullgraph=True`` raises on any graph break)."""
    Q, K, V = make_qkv(2, None, 40, 40, 16, torch.float32, "cpu")
    torch._dynamo.reset()
    compiled = torch.compile(FlashAttention2Triton.apply, backend="aot_eager", fullgraph=True)
    q, k, v = (t.detach().clone().requires_grad_() for t in (Q, K, V))
    compiled(q, k, v, True).sum().backward()
    FlashAttention2Triton.apply(Q, K, V, True).sum().backward()
    for ours, eager in ((q, Q), (k, K), (v, V)):
        torch.testing.assert_close(ours.grad, eager.grad, rtol=0, atol=0)


def test_operators_pass_opcheck():
    """Schema and fake (meta) implementations of both operators (their autograd is FlashAttention2Triton's)."""
    Q, K, V = make_qkv(2, 2, 40, 24, 16, torch.float32, "cpu")
    forward_args = (Q.detach(), K.detach(), V.detach(), True)
    torch.library.opcheck(torch.ops.cs336_systems.flash_attention_forward.default, forward_args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    O, L = torch.ops.cs336_systems.flash_attention_forward(*forward_args)
    dO = torch.randn_like(O)
    torch.library.opcheck(torch.ops.cs336_systems.flash_attention_backward.default,
                          (Q.detach(), K.detach(), V.detach(), O, L, dO, True), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["triton", "triton_function"])
def test_fullgraph_compiled_lm_with_our_attention_matches_naive(attention):
    """A whole model with our attention traces into one graph, and gives the naive model's logits and
    gradients; both the operator route (``get_attention("triton")``) and the grader's Function."""
    from cs336_basics.model import BasicsTransformerLM
    from cs336_systems.attention import get_attention

    torch._dynamo.reset()
    kwargs = dict(vocab_size=50, context_length=32, d_model=32, num_layers=2, num_heads=2, d_ff=64)
    reference = BasicsTransformerLM(**kwargs)
    model = BasicsTransformerLM(**kwargs)
    model.load_state_dict(reference.state_dict())
    if attention == "triton":
        model.set_attention(get_attention("triton"))
    else:
        model.set_attention(lambda q, k, v, is_causal: FlashAttention2Triton.apply(q, k, v, is_causal))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    token_ids = torch.randint(0, 50, (2, 24))
    logits, expected = compiled(token_ids), reference(token_ids)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    logits.square().mean().backward()
    expected.square().mean().backward()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("d, is_causal", [(24, True), (40, False)])
def test_head_dims_between_the_kernels_runs_padded(d, is_causal):
    """d = 24 and 40 run zero-padded to 32 and 48 with the scale of the true d."""
    Q, K, V = make_qkv(2, 2, 33, 40, d, torch.float32, "cpu")
    dO = torch.randn(Q.shape)
    ref, ours = run_reference(Q, K, V, is_causal, dO), run_function(FlashAttention2Triton, Q, K, V, is_causal, dO)
    for name in QUANTITIES:
        assert relative_error(ours[name], ref[name]) < TOLERANCE[torch.float32], name


@pytest.mark.parametrize("d", [32, 80])
def test_hopper_backward_helpers_zero_and_convert(d):
    """The two small kernels around the Hopper backward, which the interpreter cannot run itself: the delta kernel
    also zeroes the float32 dQ buffer, and the conversion scales and casts it into dQ (strided, 4-D); at a power of
    two and at a head dim of two column parts (80 = 64 + 16)."""
    from cs336_systems.attention.backends import triton_kernels as kernels
    from cs336_systems.attention.backends.common import head_dim_parts

    batch, heads, n = 2, 3, 70
    O, dO = torch.randn(batch, heads, n, d), torch.randn(batch, heads, n, d)
    Delta = torch.full((batch * heads, n), float("nan"))
    DQ_acc = torch.full((batch * heads, n, d), float("nan"))
    grid = (3, batch * heads)
    part_b = head_dim_parts(d)[1]
    kernels.attn_bwd_delta_kernel[grid](O, dO, Delta, *batch_head_strides(O), *batch_head_strides(dO), heads, n,
                                        DQ_acc, HEAD_DIM=d, HEAD_DIM_B=part_b, ZERO_DQ_ACC=True, BLOCK_M=32)
    torch.testing.assert_close(Delta, (O * dO).sum(-1).reshape(batch * heads, n))
    assert torch.equal(DQ_acc, torch.zeros_like(DQ_acc))
    DQ_acc = torch.randn(batch * heads, n, d)
    dQ = torch.full((batch, n, heads, d), float("nan"), dtype=torch.float16).transpose(1, 2)
    kernels.attn_bwd_dq_convert_kernel[grid](DQ_acc, dQ, *batch_head_strides(dQ), heads, n, 0.25, HEAD_DIM=d,
                                             HEAD_DIM_B=part_b, BLOCK_M=32)
    torch.testing.assert_close(dQ, (DQ_acc * 0.25).to(torch.float16).view(batch, heads, n, d))


# The interpreter's tl.dot multiplies the raw bits of bfloat16 values: the Triton backend runs bfloat16 inputs
# there in float32 and rounds the results back, so the operator is right.
@pytest.mark.parametrize("batch, heads, n_queries, n_keys, is_causal", [(1, None, 64, 64, True), (1, 2, 33, 70, False)])
def test_bfloat16_runs_in_float32_and_matches_sdpa_and_float64(batch, heads, n_queries, n_keys, is_causal):
    torch.manual_seed(0)
    Q, K, V = make_qkv(batch, heads, n_queries, n_keys, 32, torch.bfloat16, "cpu")
    with poisoned_outputs():
        output = FlashAttention2Triton.apply(Q, K, V, is_causal)
    assert output.dtype == torch.bfloat16
    sdpa = torch.nn.functional.scaled_dot_product_attention(Q.float(), K.float(), V.float(), is_causal=is_causal)
    assert (output.float() - sdpa).abs().max().item() < 2e-2
    dO = torch.randn(Q.shape).to(torch.bfloat16)
    with poisoned_outputs():
        result = run_function(FlashAttention2Triton, Q, K, V, is_causal, dO)
    reference = run_reference(Q, K, V, is_causal, dO)
    for name in QUANTITIES:
        expected_dtype = torch.float32 if name == "L" else torch.bfloat16
        assert result[name].dtype == expected_dtype, name
        assert relative_error(result[name], reference[name]) < 1e-2, name
