"""Development probe for the FlashAttention speed work (not a results CLI): times our Triton kernels
with each kernel family (``--modes``: ``FlashConfig.kernels`` values), and optionally a baseline
copy of the kernels in a git-ignored ``_baseline/``, beside SDPA's cuDNN and flash backends on the
leaderboard shape and a few sweep points; checks each mode against a float64 reference first; then the
host time per call at a tiny size, the official leaderboard protocol and the autotuner's timings.

    python scripts/flash_probe.py [--modes auto hopper triton] [--baseline] [--rep MS] [--shapes lb 65536x64 ...]
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from cs336_systems.attention import op
from cs336_systems.attention.backends import triton as triton_backend
from cs336_systems.attention.config import FLASH_CONFIG, FlashConfig

SHAPES = {"lb": (16, None, 16384, 64), "4096x64": (1, 1, 4096, 64), "16384x64": (1, 1, 16384, 64),
          "16384x128": (1, 1, 16384, 128), "65536x64": (1, 1, 65536, 64), "65536x128": (1, 1, 65536, 128)}


def sdpa(backend):
    def f(q, k, v, causal):
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal)
    return f


def ours(mode):
    def f(q, k, v, causal):
        FLASH_CONFIG.set(FlashConfig(kernels=mode))  # read again by the backward of this call
        return op.FlashAttention2Triton.apply(q, k, v, causal)
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


def errors(f, dtype, shape, causal):
    """Relative errors of O, dQ, dK, dV against float64 attention on the same inputs."""
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=dtype)
    out = f(q, k, v, causal)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    return [((a.double() - r).norm() / r.norm()).item() for a, r in zip((out, *grads), (ref, *ref_grads))]


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["auto"], choices=["auto", "hopper", "triton"],
                   help="FlashConfig.kernels values to time (one: the provider is called 'ours')")
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--rep", type=int, default=300)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--leaderboard-rep", type=int, default=2000, help="ms of the official protocol per mode (0: skip)")
    p.add_argument("--autotune-tables", action="store_true", help="print the autotuners' timings per shape")
    p.add_argument("--profile-host", action="store_true", help="cProfile tiny calls of the first mode")
    args = p.parse_args()
    providers = {("ours" if len(args.modes) == 1 else f"ours-{mode}"): ours(mode) for mode in args.modes}
    if args.baseline:
        providers["baseline"] = importlib.import_module("_baseline.op").FlashAttention2Triton.apply
    providers["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    providers["fa2"] = sdpa(SDPBackend.FLASH_ATTENTION)
    is_ours = lambda name: name.startswith(("ours", "baseline"))  # noqa: E731

    for name, f in providers.items():
        if not is_ours(name):
            continue
        for dtype, shape, causal in [(torch.bfloat16, (2, 3, 1000, 64), True), (torch.bfloat16, (1, 2, 777, 128), False),
                                     (torch.float32, (2, 1, 300, 32), True)]:
            errs = errors(f, dtype, shape, causal)
            print(f"errors {name} {dtype} {shape} causal={causal}: " + " ".join(f"{e:.1e}" for e in errs), flush=True)

    for shape_name in args.shapes:
        b, h, n, d = SHAPES[shape_name]
        shape = (b, n, d) if h is None else (b, h, n, d)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        line = {}
        for name, f in providers.items():
            try:
                line[name] = times(f, q, k, v, args.rep, four_d=not is_ours(name))
            except Exception as e:  # noqa: BLE001
                print(name, "failed", repr(e)[:300], flush=True)
        ref = line.get("cudnn", (float("nan"),) * 3)
        print(f"{shape}: " + "  ".join(f"{k} fwd {t[0]:.3f} bwd {t[1]:.3f} fb {t[2]:.3f} ({t[2] / ref[2]:.2f}x)"
                                      for k, t in line.items()), flush=True)
        if args.autotune_tables:
            print_autotune_timings(shape_name)
    for name, f in providers.items():
        g = f if not is_ours(name) else (lambda q, k, v, c, f=f: f(q[0], k[0], v[0], c))
        print(f"host+gpu us per fwd+bwd call at 1x128x64: {name} {host_us(g):.1f}", flush=True)
    if args.leaderboard_rep:  # the official protocol on the leaderboard shape
        for name in [n for n in providers if is_ours(n)]:
            f = torch.compile(providers[name])
            q, k, v = (torch.randn(16, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            def step():
                o = f(q, k, v, True)
                o.sum().backward()
            ms = triton.testing.do_bench(step, rep=args.leaderboard_rep, warmup=args.leaderboard_rep // 10)
            print(f"leaderboard {name}: {ms:.3f} ms", flush=True)
    if args.profile_host:
        profile_host(next(f for name, f in providers.items() if name.startswith("ours")))


_printed: set = set()


def print_autotune_timings(label: str) -> None:
    """Each of our autotuners' timings (median ms per configuration) for the keys first tuned since the last call."""
    for kname, kernel in triton_backend.KERNELS.items():
        tuner = kernel.autotuner
        for key, config in tuner.cache.items():
            if (kname, key) in _printed:
                continue
            _printed.add((kname, key))
            print(f"  autotune {label} {kname} n={key[:2]} d={key[2]}: chose {config}")
            for c, ms in sorted(getattr(tuner, "configs_timings", {}).items(), key=lambda item: item[1]):
                print(f"      {c.kwargs} w{c.num_warps} s{c.num_stages}: {ms[0]:.3f} ms")


def profile_host(f) -> None:
    """cProfile of tiny forward+backward calls: where the host time goes."""
    import cProfile
    import pstats

    q, k, v = (torch.randn(1, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for _ in range(20):
        f(q, k, v, True).sum().backward()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        f(q, k, v, True).sum().backward()
    torch.cuda.synchronize()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
