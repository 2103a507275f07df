"""Development probe for the FlashAttention speed work (not a results CLI): times our Triton kernels
(current tree, and optionally a baseline copy in ``_baseline/``) beside SDPA's cuDNN and flash
backends on the leaderboard shape and a few sweep points, and the host time per call at a tiny size.

    python scripts/flash_probe.py [--baseline] [--rep MS]
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention


def sdpa(backend):
    def f(q, k, v, causal):
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal)
    return f


def times(f, q, k, v, rep, four_d):
    if four_d:
        q, k, v = (x.view(1, *x.shape) if x.dim() == 3 else x for x in (q, k, v))
    o = f(q, k, v, True)
    do = torch.randn_like(o)
    fwd = triton.testing.do_bench(lambda: f(q, k, v, True), rep=rep, warmup=rep // 4)
    def step():
        o = f(q, k, v, True)
        o.backward(do)
    fb = triton.testing.do_bench(step, rep=rep, warmup=rep // 4, grad_to_none=[q, k, v])
    return fwd, fb - fwd, fb


def host_us(f, n=200):
    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for _ in range(20):
        f(q, k, v, True).sum().backward()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        f(q, k, v, True).sum().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--rep", type=int, default=300)
    args = p.parse_args()
    ours = importlib.import_module("cs336_systems.attention.flash_triton")
    providers = {"ours": ours.FlashAttention2Triton.apply}
    if args.baseline:
        providers["baseline"] = importlib.import_module("_baseline.flash_triton").FlashAttention2Triton.apply
    providers["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    providers["fa2"] = sdpa(SDPBackend.FLASH_ATTENTION)
    shapes = [(16, None, 16384, 64), (1, 1, 4096, 64), (1, 1, 16384, 64), (1, 1, 16384, 128), (1, 1, 65536, 64),
              (1, 1, 65536, 128)]
    for b, h, n, d in shapes:
        shape = (b, n, d) if h is None else (b, h, n, d)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        line = {}
        for name, f in providers.items():
            try:
                line[name] = times(f, q, k, v, args.rep, four_d=not name.startswith(("ours", "baseline")))
            except Exception as e:  # noqa: BLE001
                print(name, "failed", repr(e)[:200])
        ref = line.get("cudnn", (float("nan"),) * 3)
        print(f"{shape}: " + "  ".join(f"{k} fwd {t[0]:.3f} bwd {t[1]:.3f} fb {t[2]:.3f} ({t[2] / ref[2]:.2f}x)"
                                      for k, t in line.items()), flush=True)
    for name, f in providers.items():
        four_d = not name.startswith(("ours", "baseline"))
        g = f if four_d else (lambda q, k, v, c, f=f: f(q[0], k[0], v[0], c))
        print(f"host+gpu us per fwd+bwd call at 1x128x64: {name} {host_us(g):.1f}", flush=True)
    # the official protocol on the leaderboard shape
    for name in [n for n in providers if n in ("ours", "baseline")]:
        f = torch.compile(providers[name])
        q, k, v = (torch.randn(16, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        def step():
            o = f(q, k, v, True)
            o.sum().backward()
        print(f"leaderboard {name}: {triton.testing.do_bench(step, rep=2000, warmup=200):.3f} ms", flush=True)
    import cProfile, pstats
    f = providers["ours"]
    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        f(q, k, v, True).sum().backward()
    torch.cuda.synchronize()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
    for name, m in [("ours", ours)] + ([("baseline", importlib.import_module("_baseline.flash_triton"))] if args.baseline else []):
        for kname, tuner in m._autotuned.items():
            print(name, kname, {str(k): str(v) for k, v in tuner.cache.items()})


if __name__ == "__main__":
    main()
