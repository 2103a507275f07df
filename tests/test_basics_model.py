"""The cs336_basics model modules against independent references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cs336_basics.model import (
    MODEL_SIZES,
    BasicsTransformerLM,
    CausalMultiHeadSelfAttention,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    causal_attention,
    scaled_dot_product_attention,
    silu,
)


def test_linear_shape_and_init():
    layer = Linear(300, 200)
    assert layer.weight.shape == (200, 300)
    std = math.sqrt(2 / 500)
    assert layer.weight.abs().max() <= 3 * std + 1e-6
    assert abs(layer.weight.std().item() - std) / std < 0.2  # truncation at 3 sigma shrinks std by ~1%
    x = torch.randn(4, 7, 300)
    torch.testing.assert_close(layer(x), x @ layer.weight.T)


def test_embedding_lookup():
    emb = Embedding(50, 16)
    ids = torch.randint(0, 50, (3, 9))
    assert emb(ids).shape == (3, 9, 16)
    torch.testing.assert_close(emb(ids)[1, 4], emb.weight[ids[1, 4]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_float64_formula(dtype):
    norm = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = (torch.randn(5, 11, 64) * 3).to(dtype)
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    out = norm(x)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_rope_scores_depend_only_on_relative_position():
    d, seq = 32, 40
    rope = RotaryEmbedding(context_length=128, dim=d, theta=10000.0)
    q, k = torch.randn(d), torch.randn(d)

    def score(i: int, j: int) -> torch.Tensor:
        qi = rope(q.expand(1, d), torch.tensor([i]))
        kj = rope(k.expand(1, d), torch.tensor([j]))
        return (qi * kj).sum()

    for offset in (0, 3, 17):
        reference = score(offset, 0)
        for shift in (1, 20, 60):
            torch.testing.assert_close(score(offset + shift, shift), reference, rtol=1e-4, atol=1e-4)
    # Rotation preserves norms and position 0 is the identity.
    x = torch.randn(2, seq, d)
    positions = torch.arange(seq)
    torch.testing.assert_close(rope(x, positions).norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope(x, positions)[:, 0], x[:, 0])


def test_rope_rotates_adjacent_pairs():
    rope = RotaryEmbedding(context_length=8, dim=4, theta=10000.0)
    x = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    out = rope(x, torch.tensor([1]))
    angle0, angle1 = 1.0, 1.0 * 10000 ** (-2 / 4)
    expected = torch.tensor([[math.cos(angle0), math.sin(angle0), math.cos(angle1), math.sin(angle1)]])
    torch.testing.assert_close(out, expected)


def test_swiglu_and_silu():
    x = torch.randn(6, 32)
    torch.testing.assert_close(silu(x), F.silu(x))
    ffn = SwiGLU(32, 80)
    expected = (F.silu(x @ ffn.w1.weight.T) * (x @ ffn.w3.weight.T)) @ ffn.w2.weight.T
    torch.testing.assert_close(ffn(x), expected)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_torch_sdpa(causal):
    q, k, v = (torch.randn(2, 3, 17, 16, dtype=torch.float64) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(causal_attention(q, k, v, is_causal=causal), expected)
    mask = torch.rand(17, 17) > 0.3
    mask[:, 0] = True  # every query sees at least one key
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_multihead_attention_matches_reference():
    torch.manual_seed(1)
    attn = CausalMultiHeadSelfAttention(d_model=48, num_heads=4)
    x = torch.randn(2, 10, 48)
    heads = lambda t: t.view(2, 10, 4, 12).transpose(1, 2)  # noqa: E731
    q, k, v = heads(x @ attn.q_proj.weight.T), heads(x @ attn.k_proj.weight.T), heads(x @ attn.v_proj.weight.T)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 10, 48)
    torch.testing.assert_close(attn(x), o @ attn.output_proj.weight.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="divisible"):
        CausalMultiHeadSelfAttention(d_model=50, num_heads=4)


def _tiny_lm(**kwargs) -> BasicsTransformerLM:
    return BasicsTransformerLM(vocab_size=97, context_length=32, d_model=64, num_layers=2, num_heads=4, d_ff=128, **kwargs)


def test_lm_output_shape_and_causality():
    model = _tiny_lm()
    ids = torch.randint(0, 97, (3, 20))
    logits = model(ids)
    assert logits.shape == (3, 20, 97)
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 5) % 97
    logits_changed = model(changed)
    torch.testing.assert_close(logits_changed[:, :12], logits[:, :12])
    assert not torch.allclose(logits_changed[:, 12:], logits[:, 12:])
    with pytest.raises(ValueError, match="context_length"):
        model(torch.randint(0, 97, (1, 33)))


def test_lm_attention_is_swappable():
    calls = []

    def recording_attention(Q, K, V, is_causal):
        calls.append(Q.shape)
        return F.scaled_dot_product_attention(Q, K, V, is_causal=is_causal)

    model = _tiny_lm()
    ids = torch.randint(0, 97, (2, 9))
    reference = model(ids)
    model.set_attention(recording_attention)
    torch.testing.assert_close(model(ids), reference, rtol=1e-5, atol=1e-5)
    assert calls == [(2, 4, 9, 16)] * 2
    built_with = _tiny_lm(attention_fn=recording_attention)
    assert all(layer.attn.attention_fn is recording_attention for layer in built_with.layers)


# Parameter counts (embedding included; vocabulary 10,000): 2*V*d + L*(4*d^2 + 3*d*d_ff + 2*d) + d.
EXPECTED_PARAMS = {
    "small": 128_625_408,
    "medium": 423_183_360,
    "large": 969_411_840,
    "xl": 1_998_235_200,
    "2.7B": 3_406_809_600,
}


@pytest.mark.parametrize("size", list(MODEL_SIZES))
def test_model_size_parameter_counts(size):
    cfg = MODEL_SIZES[size]
    with torch.device("meta"):
        model = BasicsTransformerLM(vocab_size=10_000, context_length=1024, rope_theta=10000.0, **cfg)
    d, d_ff, n_layers, vocab = cfg["d_model"], cfg["d_ff"], cfg["num_layers"], 10_000
    formula = 2 * vocab * d + n_layers * (4 * d * d + 3 * d * d_ff + 2 * d) + d
    assert model.get_num_params(non_embedding=False) == formula == EXPECTED_PARAMS[size]


@pytest.mark.gpu
def test_lm_on_gpu_matches_cpu_and_runs_under_bf16_autocast():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _tiny_lm()
    ids = torch.randint(0, 97, (2, 24))
    expected = model(ids)
    gpu_model = model.cuda()
    torch.testing.assert_close(gpu_model(ids.cuda()).cpu(), expected, rtol=1e-4, atol=1e-4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = gpu_model(ids.cuda())
    assert logits.dtype == torch.bfloat16
    rel = (logits.float().cpu() - expected).norm() / expected.norm()
    assert rel < 3e-2, rel
    logits.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gpu_model.parameters())
