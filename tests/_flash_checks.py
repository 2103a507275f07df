"""Helpers shared by the FlashAttention tests: inputs, one forward+backward run that collects O, L
and the gradients the way the grader does, and a float64 reference."""

from __future__ import annotations

import torch
from torch import Tensor

from cs336_systems.attention.reference import reference_attention

QUANTITIES = ("O", "L", "dQ", "dK", "dV")


def make_qkv(batch: int, heads: int | None, n_queries: int, n_keys: int, d: int, dtype: torch.dtype, device) -> tuple[Tensor, Tensor, Tensor]:
    """Leaf tensors that require grad, of shape (batch, [heads,] seq, d)."""
    lead = (batch,) if heads is None else (batch, heads)
    q = torch.randn(*lead, n_queries, d, device=device).to(dtype).requires_grad_()
    k = torch.randn(*lead, n_keys, d, device=device).to(dtype).requires_grad_()
    v = torch.randn(*lead, n_keys, d, device=device).to(dtype).requires_grad_()
    return q, k, v


def saved_logsumexp(O: Tensor, Q: Tensor) -> Tensor:
    """The tensor the autograd Function saved with shape Q.shape[:-1] (there must be exactly one)."""
    candidates = [t for t in O.grad_fn.saved_tensors if t.shape == Q.shape[:-1]]
    assert len(candidates) == 1, f"expected one saved tensor of shape {tuple(Q.shape[:-1])}, found {len(candidates)}"
    return candidates[0]


def run_function(function, Q: Tensor, K: Tensor, V: Tensor, is_causal: bool, dO: Tensor) -> dict[str, Tensor]:
    """O, the saved L, and dQ, dK, dV for the upstream gradient dO, from ``function.apply``."""
    Q, K, V = (t.detach().clone().requires_grad_() for t in (Q, K, V))
    O = function.apply(Q, K, V, is_causal)
    L = saved_logsumexp(O, Q)
    O.backward(dO)
    return {"O": O.detach(), "L": L.detach(), "dQ": Q.grad, "dK": K.grad, "dV": V.grad}


def run_reference(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool, dO: Tensor, dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
    """The plain attention on the same (already rounded) inputs, computed in ``dtype``."""
    Q, K, V = (t.detach().to(dtype).requires_grad_() for t in (Q, K, V))
    O, L = reference_attention(Q, K, V, is_causal)
    O.backward(dO.to(dtype))
    return {"O": O.detach(), "L": L.detach(), "dQ": Q.grad, "dK": K.grad, "dV": V.grad}


def hopper_gpu() -> bool:
    """Whether a Hopper GPU (compute capability 9.x), where the Gluon kernels run, is here."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def relative_error(value: Tensor, reference: Tensor) -> float:
    """||value - reference|| / ||reference|| in float64; the absolute error where the reference is 0."""
    difference = (value.double() - reference.double()).norm().item()
    scale = reference.double().norm().item()
    return difference / scale if scale > 0 else difference


def lm_logits_and_grads(model, token_ids: Tensor, attention_name: str) -> tuple[Tensor, dict[str, Tensor]]:
    """Logits and parameter gradients of ``model`` with every block using ``get_attention(attention_name)``."""
    from cs336_systems.attention import get_attention

    model.set_attention(get_attention(attention_name))
    model.zero_grad()
    logits = model(token_ids)
    logits.square().mean().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_lm_matches_naive(model, token_ids: Tensor, attention_name: str, logits_tol: tuple[float, float]) -> None:
    """The LM with ``attention_name`` gives the naive attention's logits and gradients within tolerance."""
    naive_logits, naive_grads = lm_logits_and_grads(model, token_ids, "naive")
    logits, grads = lm_logits_and_grads(model, token_ids, attention_name)
    rtol, atol = logits_tol
    torch.testing.assert_close(logits, naive_logits, rtol=rtol, atol=atol)
    for name, grad in naive_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


def check_sum_backward(function) -> None:
    """``function.apply(Q, K, V, True).sum().backward()``, which sends an all-stride-0 dO, against the reference."""
    Q, K, V = make_qkv(2, 2, 40, 40, 16, torch.float32, "cpu")
    function.apply(Q, K, V, True).sum().backward()
    reference = run_reference(Q, K, V, True, torch.ones(Q.shape))
    for name, grad in (("dQ", Q.grad), ("dK", K.grad), ("dV", V.grad)):
        assert relative_error(grad, reference[name]) <= 1e-5, name
