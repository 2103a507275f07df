"""Stand-in for the course's ``tests/test_attention.py``: both FlashAttention-2 Functions against a plain
reference, the Triton one through Triton's CPU interpreter where there is no GPU."""

import math

import pytest
import torch

from .adapters import get_flashattention_autograd_function_pytorch, get_flashattention_autograd_function_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, k, v, is_causal):
    """``(O, L)`` of plain attention: ``O`` shaped like ``q``, ``L`` ``(batch, n_queries)``."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        keys_after_query = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(keys_after_query, -1e6)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def inputs(device):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(2, 32, 16, generator=generator).to(device).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_forward_pass_pytorch(is_causal):
    q, k, v = inputs("cpu")
    o = get_flashattention_autograd_function_pytorch().apply(q, k, v, is_causal)
    expected_o, expected_l = reference(q, k, v, is_causal)
    torch.testing.assert_close(o, expected_o, rtol=1e-2, atol=1e-2)
    saved_l = [t for t in o.grad_fn.saved_tensors if t.shape == (2, 32)]
    assert len(saved_l) == 1
    torch.testing.assert_close(saved_l[0], expected_l, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_forward_and_backward_triton(is_causal):
    q, k, v = inputs(DEVICE)
    o = get_flashattention_autograd_function_triton().apply(q, k, v, is_causal)
    o.sum().backward()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    expected_o, _ = reference(q, k, v, is_causal)
    expected_o.sum().backward()
    torch.testing.assert_close(o, expected_o, rtol=1e-2, atol=1e-2)
    for grad, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(grad, t.grad, rtol=1e-2, atol=1e-2)
