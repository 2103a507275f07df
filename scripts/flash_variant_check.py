"""A quick screen of a FlashAttention kernel variant on a GPU: the relative errors of our operator's O,
dQ, dK and dV against float64 attention on the same inputs, with the Hopper kernels and with the portable Triton
kernels forced, at shapes that exercise each path (causal or not, ragged lengths, head dims 64 and 128). One line
per case; exits non-zero when an error passes the bf16 bound. The full correctness grid stays
``tests/test_flash_attention_triton.py``; ``scripts/device_flash_variants.sh`` runs this for each variant.

    python scripts/flash_variant_check.py
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.nn.functional import scaled_dot_product_attention

from cs336_systems.attention import op
from cs336_systems.attention.config import FLASH_CONFIG

BOUND = 2e-2  # bf16, as the GPU grid's floor
CASES = [  # (batch, heads, n_queries, n_keys, head_dim, is_causal)
    (1, 8, 4096, 4096, 64, True),
    (2, 4, 1000, 1000, 128, True),
    (1, 4, 2048, 2048, 128, False),
    (1, 2, 777, 1500, 64, False),
]


def errors(batch: int, heads: int, n_queries: int, n_keys: int, head_dim: int, is_causal: bool) -> list[float]:
    """Relative errors (Frobenius) of O, dQ, dK, dV in bf16 against float64 attention."""
    generator = torch.Generator(device="cuda").manual_seed(n_queries + head_dim)
    def randn(n):
        return torch.randn(batch, heads, n, head_dim, device="cuda", generator=generator).to(torch.bfloat16)
    q, k, v = (randn(n).requires_grad_() for n in (n_queries, n_keys, n_keys))
    do = randn(n_queries)
    out = op.FlashAttention2Triton.apply(q, k, v, is_causal)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = scaled_dot_product_attention(q64, k64, v64, is_causal=is_causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    return [((a.double() - r).norm() / r.norm()).item() for a, r in zip((out, *grads), (ref, *ref_grads))]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flash_variant_check: needs a CUDA GPU")
    failed = 0
    for kernels in ("hopper", "triton"):
        for case in CASES:
            with FLASH_CONFIG.use(kernels=kernels):
                errs = errors(*case)
            bad = max(errs) > BOUND or any(e != e for e in errs)
            failed += bad
            print(f"{'FAIL' if bad else 'ok'} {kernels} {case}: O dQ dK dV " + " ".join(f"{e:.1e}" for e in errs),
                  flush=True)
    print(f"{failed} of {2 * len(CASES)} cases over {BOUND:g}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
