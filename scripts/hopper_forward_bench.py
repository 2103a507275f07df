"""The attention forward on one Hopper GPU, in one process: the Hopper (Gluon) kernel, in variants of its keys per
step and K/V ring depth, against the portable Triton kernel, beside SDPA's cuDNN backend. First the outputs' errors
against float64 attention (every kernel, causal and not, ragged lengths, both TMA views, head dims of one and of two
column parts), then each provider's forward GPU time (a CUDA graph of the forward replayed), in alternating rounds
so that a drifting clock moves every column alike.

    python scripts/hopper_forward_bench.py                       # head dims of two column parts (48, 80, 96)
    python scripts/hopper_forward_bench.py --shapes 4,36,512,128 --variants 128x2 64x2 64x4 --no-portable

Providers: ``hopper`` (the backend's own keys per step and ring depth, ``hopper.forward_tiles``),
``hopper/KEYSxSTAGES`` (these at every length), ``triton``, ``cudnn``. Prints one JSON line per check and a line per
shape with the medians and ratios to cuDNN.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.nn.functional import scaled_dot_product_attention

from cs336_systems.attention.backends import hopper
from cs336_systems.attention.config import FLASH_CONFIG
from cs336_systems.attention.op import chosen_backends, flash_attention
from cs336_systems.bench.common.attention_providers import cudnn_attention, head_inputs
from cs336_systems.bench.common.timing import captured_graph, replay_mean_ms

SHAPES = ["4,32,512,80", "4,32,1024,80", "4,32,2048,80", "1,32,8192,80", "4,16,2048,48", "4,24,2048,96"]
CHECKS = [  # batch, heads, n_queries, n_keys, head_dim, causal, heads in the columns (a (b, s, h, d) transpose)
    (2, 3, 1000, 1000, 80, True, False), (2, 3, 1000, 777, 80, False, True), (1, 2, 300, 900, 80, True, False),
    (3, 5, 129, 129, 48, True, True), (1, 4, 1500, 1500, 96, True, False), (2, 4, 777, 1000, 96, False, True),
    (1, 2, 1, 1, 80, True, False), (4, 8, 512, 512, 48, False, False), (2, 3, 1000, 1000, 64, True, True),
    (1, 4, 1500, 777, 128, False, False), (2, 4, 700, 700, 128, True, True),
]
BOUND = 1e-2


DEFAULT_FORWARD_TILES = hopper.forward_tiles


def use(provider: str) -> str:
    """Set up ``provider``'s forward (the Hopper backend's keys per step and ring depth for the plans made from now
    on, plans made before dropped); its ``FlashConfig.kernels``."""
    kernels, _, variant = provider.partition("/")
    if variant:
        keys, stages = (int(x) for x in variant.split("x"))
        hopper.forward_tiles = lambda n_keys: (keys, stages)
    else:
        hopper.forward_tiles = DEFAULT_FORWARD_TILES
    hopper.FORWARD.entries.clear()
    return kernels


def error(case, provider: str) -> tuple[float, dict[str, str]]:
    """The relative error of the forward's output under ``provider`` against float64, and the backends that ran."""
    *shape, causal, columns = case
    q, k, v = head_inputs(*shape, heads_in_columns=columns, seed=sum(shape))
    with FLASH_CONFIG.use(kernels=use(provider)):
        out = flash_attention(q, k, v, causal)
        chosen = chosen_backends(q, k)
    ref = scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    return ((out.double() - ref).norm() / ref.norm()).item(), chosen


def ours(provider: str, causal: bool):
    kernels = use(provider)

    def attention(q, k, v):
        with FLASH_CONFIG.use(kernels=kernels):
            return flash_attention(q, k, v, causal)
    return attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--not-causal", dest="causal", action="store_false", help="time full attention")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="batch,heads,seq,d")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ms", type=float, default=200, help="GPU time per measurement, ms")
    parser.add_argument("--variants", nargs="+", default=[], metavar="KEYSxSTAGES",
                        help="Hopper forward variants beside the backend's own (e.g. 128x2: 128 keys a step, 2 stages)")
    parser.add_argument("--no-portable", dest="portable", action="store_false", help="leave the portable kernel out")
    args = parser.parse_args()
    if not torch.cuda.is_available() or hopper.supports(torch.device("cuda"), torch.bfloat16, 64):
        raise SystemExit("hopper_forward_bench: needs a Hopper GPU (H100/H200)")
    providers = ["hopper", *(f"hopper/{variant}" for variant in args.variants)] + (["triton"] if args.portable else [])
    failed = 0
    for provider in providers:
        for case in CHECKS:
            err, chosen = error(case, provider)
            bad = not err <= BOUND
            failed += bad
            print(json.dumps({"check": provider, "forward": chosen["forward"], "case": case,
                              "rel_err_o": round(err, 5), "ok": not bad}), flush=True)
    if failed:
        raise SystemExit(f"{failed} checks over {BOUND}")
    for text in args.shapes:
        batch, heads, seq, head_dim = (int(x) for x in text.split(","))
        q, k, v = head_inputs(batch, heads, seq, seq, head_dim)
        graphs = {}
        for provider in providers:
            attention = ours(provider, args.causal)
            graphs[provider] = captured_graph(lambda: attention(q, k, v), q.device)
        graphs["cudnn"] = captured_graph(lambda: cudnn_attention(q, k, v, args.causal), q.device)
        first = replay_mean_ms(graphs["cudnn"], 3)
        replays = max(3, min(5000, int(args.ms / max(first, 1e-3))))
        times = {name: [] for name in graphs}
        for r in range(args.rounds):
            for name in (graphs if r % 2 == 0 else reversed(graphs)):
                times[name].append(statistics.median(replay_mean_ms(graphs[name], replays) for _ in range(5)))
        forward = {name: statistics.median(t) for name, t in times.items()}
        print(json.dumps({"shape": [batch, heads, seq, head_dim],
                          "forward_ms": {n: round(m, 4) for n, m in forward.items()},
                          "rounds_ms": {n: [round(x, 4) for x in t] for n, t in times.items()},
                          "forward_over_cudnn": {n: round(m / forward["cudnn"], 4) for n, m in forward.items()},
                          "causal": args.causal, "device": torch.cuda.get_device_name()}), flush=True)
        del graphs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
