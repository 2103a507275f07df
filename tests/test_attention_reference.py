"""The reference and annotated attentions, and ``get_attention`` (the implementations by name)."""

from __future__ import annotations

import pytest
import torch

from cs336_basics.model import BasicsTransformerLM, causal_attention
from cs336_systems.attention import ATTENTION_NAMES, get_attention
from cs336_systems.attention.reference import (
    CAUSAL_MASK_VALUE,
    annotated_attention,
    causal_mask,
    reference_attention,
)
from tests._flash_checks import assert_lm_matches_naive


def test_causal_mask_uses_absolute_indices():
    assert causal_mask(2, 3).tolist() == [[True, False, False], [True, True, False]]
    assert causal_mask(3, 2).tolist() == [[True, False], [True, True], [True, True]]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("n_queries, n_keys", [(7, 7), (5, 9), (9, 5)])
def test_reference_matches_the_model_attention(is_causal, n_queries, n_keys):
    Q, K, V = torch.randn(2, 3, n_queries, 16), torch.randn(2, 3, n_keys, 16), torch.randn(2, 3, n_keys, 16)
    O, L = reference_attention(Q, K, V, is_causal)
    torch.testing.assert_close(O, causal_attention(Q, K, V, is_causal))
    scores = Q @ K.transpose(-2, -1) / 4.0
    if is_causal:
        scores = scores.masked_fill(~causal_mask(n_queries, n_keys), CAUSAL_MASK_VALUE)
    torch.testing.assert_close(L, torch.logsumexp(scores, dim=-1))


@pytest.mark.filterwarnings("ignore:.*Profiler clears events:UserWarning")
@pytest.mark.parametrize("is_causal", [False, True])
def test_annotated_attention_runs_on_cpu_and_matches(is_causal):
    Q, K, V = (torch.randn(2, 3, 10, 8, requires_grad=True) for _ in range(3))
    with torch.profiler.profile() as profile:
        O = annotated_attention(Q, K, V, is_causal)
    torch.testing.assert_close(O, causal_attention(Q, K, V, is_causal))
    ranges = {event.name for event in profile.events()}
    assert {"computing attention scores", "computing softmax", "final matmul"} <= ranges
    O.sum().backward()
    assert Q.grad is not None


def test_get_attention_names():
    assert set(ATTENTION_NAMES) == {"naive", "compiled", "annotated", "flash_pytorch", "triton", "sdpa"}
    with pytest.raises(ValueError, match="naive, compiled, annotated, flash_pytorch, triton, sdpa"):
        get_attention("flash")


@pytest.mark.parametrize("name", ["naive", "annotated", "flash_pytorch", "sdpa"])
def test_attention_implementations_agree_on_cpu(name):
    Q, K, V = (torch.randn(2, 4, 33, 16) for _ in range(3))
    torch.testing.assert_close(get_attention(name)(Q, K, V, True), causal_attention(Q, K, V, True), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_attention_on_cpu():
    Q, K, V = (torch.randn(2, 4, 33, 16) for _ in range(3))
    compiled = get_attention("compiled")
    assert compiled is get_attention("compiled")  # one compiled function per process
    torch.testing.assert_close(compiled(Q, K, V, True), causal_attention(Q, K, V, True), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_transformer_lm_with_flash_pytorch_attention_matches_naive():
    model = BasicsTransformerLM(vocab_size=50, context_length=32, d_model=64, num_layers=2, num_heads=2, d_ff=128)
    token_ids = torch.randint(0, 50, (2, 24))
    assert_lm_matches_naive(model, token_ids, "flash_pytorch", logits_tol=(1e-4, 1e-5))


@pytest.mark.parametrize("name", ["naive", "annotated", "flash_pytorch", "sdpa"])
def test_attention_implementations_are_causal_by_default(name):
    """Every ``get_attention`` function defaults to ``is_causal=True``, the model's protocol."""
    Q, K, V = (torch.randn(1, 2, 9, 16) for _ in range(3))
    attention = get_attention(name)
    torch.testing.assert_close(attention(Q, K, V), attention(Q, K, V, True), rtol=0, atol=0)
    assert not torch.allclose(attention(Q, K, V), attention(Q, K, V, False))


@pytest.mark.parametrize("name", ATTENTION_NAMES)
def test_every_attention_signature_defaults_to_causal(name):
    import inspect

    attention = get_attention(name)
    attention = getattr(attention, "_torchdynamo_orig_callable", attention)  # "compiled": the function it wraps
    assert inspect.signature(attention).parameters["is_causal"].default is True
