"""The attention implementations the FlashAttention benchmarks time, and how they time them.

Each provider is a function ``(q, k, v, is_causal) -> o`` on ``(batch, heads, seq, d)`` inputs (or
``(batch, seq, d)`` for ours and the PyTorch ones). PyTorch's fused attention is timed per backend
(``torch.nn.attention.sdpa_kernel``): cuDNN, the FlashAttention-2 CUDA kernels ("flash") and the
memory-efficient kernels. Backward time is ``fwd+bwd - fwd``, both measured with
``triton.testing.do_bench`` on a GPU (median of its repetitions) and with a host timer on a CPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch import Tensor

from cs336_systems.bench import harness

Provider = Callable[[Tensor, Tensor, Tensor, bool], Tensor]


def _sdpa(backend_name: str) -> Provider:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def sdpa(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return sdpa


def _ours() -> Provider:
    from cs336_systems.attention.flash_triton import FlashAttention2Triton

    return FlashAttention2Triton.apply


def _named(name: str) -> Callable[[], Provider]:
    def factory() -> Provider:
        from cs336_systems.attention import get_attention

        return get_attention(name)

    return factory


PROVIDERS: dict[str, Callable[[], Provider]] = {
    "ours": _ours,
    "pytorch_tiled": _named("flash_pytorch"),
    "pytorch_naive": _named("naive"),
    "pytorch_compiled": _named("compiled"),
    "sdpa_cudnn": lambda: _sdpa("CUDNN_ATTENTION"),
    "sdpa_flash": lambda: _sdpa("FLASH_ATTENTION"),
    "sdpa_efficient": lambda: _sdpa("EFFICIENT_ATTENTION"),
}
FOUR_D = {"sdpa_cudnn", "sdpa_flash", "sdpa_efficient"}  # these take (batch, heads, seq, d)


def get_provider(name: str) -> Provider:
    if name not in PROVIDERS:
        raise ValueError(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS)}")
    return PROVIDERS[name]()


def bench_ms(fn: Callable[[], object], device: torch.device, rep_ms: int, warmup_ms: int,
             grad_to_none: list[Tensor] | None = None) -> float:
    """Median milliseconds per call of ``fn``."""
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, rep=rep_ms, warmup=warmup_ms, grad_to_none=grad_to_none)
    return statistics.median(harness.time_calls(fn, warmup=1, steps=3, device=device)) * 1e3


def time_provider(name: str, q: Tensor, k: Tensor, v: Tensor, rep_ms: int = 100, warmup_ms: int = 25,
                  is_causal: bool = True) -> dict[str, float]:
    """``fwd_ms``, ``bwd_ms`` and ``fwd_bwd_ms`` of provider ``name`` on leaf tensors q, k, v (3-D)."""
    fn = get_provider(name)
    if name in FOUR_D:
        q, k, v = (x.detach().unsqueeze(0).requires_grad_() if x.dim() == 3 else x for x in (q, k, v))
    grad_out = torch.randn_like(q)

    def forward_backward():
        fn(q, k, v, is_causal).backward(grad_out)

    forward_backward()  # compile / autotune before timing
    fwd = bench_ms(lambda: fn(q, k, v, is_causal), q.device, rep_ms, warmup_ms)
    fwd_bwd = bench_ms(forward_backward, q.device, rep_ms, warmup_ms, grad_to_none=[q, k, v])
    return {"fwd_ms": fwd, "bwd_ms": fwd_bwd - fwd, "fwd_bwd_ms": fwd_bwd}


def unavailable(error: BaseException) -> bool:
    """Whether ``error`` says a provider does not support the input (no kernel for this dtype or shape)."""
    text = str(error).lower()
    return isinstance(error, (NotImplementedError, TypeError, ValueError)) or "no available kernel" in text
