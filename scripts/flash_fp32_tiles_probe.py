"""Development probe (not a results CLI): our portable kernels on float32 inputs with tf32x3 products at one head
dim, each candidate tile configuration forced in turn (forward and backward apart), timed with ``do_bench`` at a few
lengths, after a check against a float64 reference at a short length (the error printed beside the IEEE path's).

    python scripts/flash_fp32_tiles_probe.py [--head-dim 128] [--seq-lens 4096 16384]
"""

from __future__ import annotations

import argparse
import math

import torch
import triton

from cs336_systems.attention import op
from cs336_systems.attention.backends import triton as portable
from cs336_systems.attention.config import FLASH_CONFIG, FlashConfig

FORWARD = [(32, 16, 8, 2), (64, 16, 4, 2), (64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2),
           (128, 64, 8, 2)]
BACKWARD = [(32, 16, 8, 1), (32, 32, 4, 1), (32, 32, 8, 1), (64, 16, 8, 1), (64, 32, 8, 1), (64, 64, 8, 1)]


def reset() -> None:
    portable._plans.clear()
    for kernel in portable.KERNELS.values():
        kernel.configs.clear()
        kernel._launcher._compiled.clear()


def force(kernel: str, tiles: tuple[int, int, int, int]):
    original = portable.fixed_config

    def fixed(name, dtype, head_dim, precision="ieee"):
        if name == kernel and dtype == torch.float32:
            return (portable._config if name == "fwd" else portable._bwd_config)(*tiles)
        return original(name, dtype, head_dim, precision)

    return fixed


def error_vs_float64(head_dim: int) -> tuple[float, float]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 1000, head_dim, device="cuda", requires_grad=True) for _ in range(3))
    do = torch.randn(1, 1, 1000, head_dim, device="cuda")
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    s = qd @ kd.transpose(-1, -2) / math.sqrt(head_dim)
    s = s.masked_fill(torch.ones(1000, 1000, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    od = torch.softmax(s, -1) @ vd
    od.backward(do.double())
    o = op.flash_attention(q, k, v, True)
    o.backward(do)
    return (o.double() - od).abs().max().item(), (q.grad.double() - qd.grad).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args()
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    d = args.head_dim
    print(f"# {torch.cuda.get_device_name()}, float32, head dim {d}, causal, batch 1, one head")
    for precision in ("ieee", "tf32x3"):
        with FLASH_CONFIG.use(FlashConfig(fp32_products=precision)):
            reset()
            error_o, error_dq = error_vs_float64(d)
            print(f"{precision} at the fixed tiles: max error O {error_o:.2e}, dQ {error_dq:.2e}")
    original = portable.fixed_config
    with FLASH_CONFIG.use(FlashConfig(fp32_products="tf32x3")):
        for kernel, candidates in (("fwd", FORWARD), ("bwd", BACKWARD)):
            for tiles in candidates:
                reset()
                portable.fixed_config = force(kernel, tiles)
                try:
                    err = error_vs_float64(d)
                    times = []
                    for n in args.seq_lens:
                        q, k, v = (torch.randn(1, 1, n, d, device="cuda", requires_grad=True) for _ in range(3))
                        do = torch.randn(1, 1, n, d, device="cuda")
                        if kernel == "fwd":
                            ms = triton.testing.do_bench(lambda: op.flash_attention(q, k, v, True), rep=100)
                        else:
                            o = op.flash_attention(q, k, v, True)
                            ms = triton.testing.do_bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                                                         rep=100)
                        times.append(f"n={n}: {ms:.3f} ms")
                    print(f"{kernel} {tiles}: err O {err[0]:.2e} dQ {err[1]:.2e}; " + ", ".join(times), flush=True)
                except Exception as error:  # a probe: a configuration that does not compile is a line, not the end
                    print(f"{kernel} {tiles}: failed {type(error).__name__}: {str(error)[:200]}", flush=True)
                finally:
                    portable.fixed_config = original


if __name__ == "__main__":
    main()
