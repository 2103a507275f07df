"""Forward, backward and forward + backward of our attention operator or of SDPA's cuDNN or FlashAttention-2
backend at a few shapes that matter beyond the batch-1, one-head sweep: the 8B leaderboard step's attention
(batch 1, 32 heads, 32,768 x 128), one head of 65,536, 16 heads of 16,384, and the sweep's one head of 16,384
(bf16, causal, ``triton.testing.do_bench``).

Run each provider in its own process (our kernels' configuration comes from ``CS336_FLASH_KERNELS``, see
``FlashConfig.from_environment``)::

    python scripts/flash_shapes_bench.py sdpa                             # cuDNN
    python scripts/flash_shapes_bench.py fa2                              # SDPA's FlashAttention-2 backend
    python scripts/flash_shapes_bench.py ours                             # the Hopper kernels on an H100/H200
    CS336_FLASH_KERNELS=triton python scripts/flash_shapes_bench.py ours  # the portable Triton kernels
    python scripts/flash_shapes_bench.py sdpa --shapes models --head-dim 80  # the 2.7B model's attention

Prints one JSON line per shape: provider, kernels, backends (ours: the backend of each part and the head dim its
kernels run), shape, fwd_ms, bwd_ms (fwd+bwd minus fwd), fwd_bwd_ms.
"""

import argparse
import json

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(1, 32, 32768, 128), (1, 1, 65536, 128), (1, 16, 16384, 128), (1, 1, 65536, 64), (16, 1, 16384, 64),
          (1, 1, 16384, 128), (1, 1, 16384, 64)]
# The model sizes' own attention (batch, heads, context, d): small and xl at 512, xl at 2048 and 8192, 2.7B (d = 80,
# which our kernels run as 64 + 16 columns) at 512, 2048 and 8192.
MODEL_SHAPES = [(4, 12, 512, 64), (4, 25, 512, 64), (4, 25, 2048, 64), (1, 25, 8192, 64), (4, 32, 512, 80),
                (4, 32, 2048, 80), (1, 32, 8192, 80)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("provider", choices=["ours", "sdpa", "fa2"])
    parser.add_argument("--shapes", choices=["sweep", "models"], default="sweep",
                        help="the long-context shapes above (default) or the model sizes' own shapes")
    parser.add_argument("--head-dim", type=int, choices=[64, 80, 128], help="only the shapes of this head dim")
    args = parser.parse_args()
    from cs336_systems.attention.config import FLASH_CONFIG, FlashConfig
    from cs336_systems.attention.op import chosen_backends, flash_attention

    FLASH_CONFIG.set(FlashConfig.from_environment())

    shapes = SHAPES if args.shapes == "sweep" else MODEL_SHAPES
    for shape in [s for s in shapes if args.head_dim in (None, s[-1])]:
        q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        if args.provider in ("sdpa", "fa2"):
            backend = SDPBackend.CUDNN_ATTENTION if args.provider == "sdpa" else SDPBackend.FLASH_ATTENTION

            def forward():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            def forward():
                return flash_attention(q, k, v, True)

        def forward_backward():
            forward().backward(grad)

        forward_backward()
        torch.cuda.synchronize()
        fwd = triton.testing.do_bench(forward, warmup=100, rep=300)
        both = triton.testing.do_bench(forward_backward, warmup=100, rep=600, grad_to_none=[q, k, v])
        backends = chosen_backends(q, k) if args.provider == "ours" else None
        print(json.dumps({"provider": args.provider, "kernels": FLASH_CONFIG.get().kernels, "backends": backends,
                          "shape": shape, "fwd_ms": round(fwd, 4), "bwd_ms": round(both - fwd, 4),
                          "fwd_bwd_ms": round(both, 4), "device": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
