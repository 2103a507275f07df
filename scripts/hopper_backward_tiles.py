"""The Hopper backward's program shapes and grid orders compared on one GPU, in one process: for each choice of keys
per program and consumer warps (``hopper.backward_tiles``) and of grid order (``hopper.backward_heads_first``), the
gradients' errors against float64 attention, then the backward's GPU time (CUDA graphs of the forward and of the
forward + backward replayed; the backward, Delta, the main kernel and the dQ conversion, is their difference) beside
SDPA's cuDNN backend, in alternating rounds so that a drifting clock moves every column alike.

    python scripts/hopper_backward_tiles.py                       # 128x8 (two warpgroups) vs 64x4 (one)
    python scripts/hopper_backward_tiles.py --shapes 1,16,16384,64 --rounds 3
    python scripts/hopper_backward_tiles.py --tiles rule --orders keys heads   # the grid's order, tiles as chosen

Prints one JSON line per check and a line per shape with the medians and ratios to cuDNN; providers are named
``TILES/ORDER`` ("rule": the backend's own choice).

With ``--kernel-times`` the same rounds time each kernel instead (``torch.profiler`` over eager forward + backward
calls, each kernel's GPU time per call): the main backward kernel alone and the backward's kernels together (Delta,
the main kernel, the dQ conversion; cuDNN's own three and its memset), beside cuDNN's. Graph replays include the
gaps between kernels; kernel times do not.

    python scripts/hopper_backward_tiles.py --tiles rule --shapes 1,16,16384,64 --rounds 4 --kernel-times
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.nn.functional import scaled_dot_product_attention
from torch.profiler import ProfilerActivity, profile

from cs336_systems.attention.backends import hopper
from cs336_systems.attention.op import flash_attention
from cs336_systems.bench.common.attention_providers import cudnn_attention, head_inputs
from cs336_systems.bench.common.timing import captured_graph, kernel_times_ms, replay_mean_ms

TILES = {
    "128x8": (hopper.BLOCK_N, hopper.BACKWARD_CONFIG),
    "64x4": (hopper.SMALL_BACKWARD_KEYS, hopper.SMALL_BACKWARD_CONFIG),
    "rule": None,
}
ORDERS = ("rule", "keys", "heads")  # the backend's choice, key tiles first, heads first
SHAPES = ["4,25,512,64", "4,25,2048,64", "1,25,8192,64", "1,16,16384,64", "1,1,16384,64", "4,12,512,64",
          "1,16,16384,32"]
CHECKS = [  # batch, heads, n_queries, n_keys, head_dim, causal, heads in the columns (a (b, s, h, d) transpose)
    (2, 3, 1000, 1000, 64, True, False), (2, 3, 1000, 777, 64, False, False), (1, 2, 300, 100, 64, True, False),
    (3, 5, 129, 129, 16, True, True), (1, 4, 1500, 1500, 32, True, False), (200, 1, 256, 256, 64, True, False),
    (1, 2, 1, 1, 64, True, False), (2, 4, 4096, 4096, 64, True, True),
]
BOUND = 1e-2


DEFAULT_TILES = hopper.backward_tiles
DEFAULT_ORDER = hopper.backward_heads_first


def use(provider: str) -> None:
    """Every later backward plan takes ``provider``'s program shape (at head dims up to 64; larger ones keep the
    default) and grid order (plans made before are dropped)."""
    tiles, order = provider.split("/")

    def chosen_tiles(head_dim, *shape):
        return TILES[tiles] if tiles != "rule" and head_dim <= 64 else DEFAULT_TILES(head_dim, *shape)
    hopper.backward_tiles = chosen_tiles
    hopper.backward_heads_first = DEFAULT_ORDER if order == "rule" else lambda *sizes: order == "heads"
    hopper.BACKWARD.entries.clear()


def errors(case) -> list[float]:
    *shape, causal, columns = case
    q, k, v, do = head_inputs(*shape, heads_in_columns=columns, seed=sum(shape), with_output_grad=True)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    grads = torch.autograd.grad(flash_attention(q, k, v, causal), (q, k, v), do)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_grads = torch.autograd.grad(scaled_dot_product_attention(*ref, is_causal=causal), ref, do.double())
    # Relative where the reference is nonzero (one query and one key: dQ = dK = 0, the error is absolute).
    return [((g.double() - r).norm() / max(r.norm(), 1.0)).item() for g, r in zip(grads, ref_grads)]


def graphs_of(attention, shape):
    """CUDA graphs of the forward and of the forward + backward of ``attention`` at ``shape``, the inputs they read
    (kept alive with them)."""
    q, k, v, do = head_inputs(*shape, with_output_grad=True)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def forward():
        return attention(q, k, v)

    def forward_backward():
        return torch.autograd.grad(attention(q, k, v), (q, k, v), do)

    return [captured_graph(work, q.device) for work in (forward, forward_backward)], (q, k, v, do)


MAIN_BACKWARD_KERNELS = ("attn_bwd_hopper", "flash_bprop")  # ours, cuDNN's
FORWARD_KERNELS = ("attn_fwd", "flash_fprop")


def profiled_kernels_ms(attention, shape, calls: int) -> dict[str, float]:
    """GPU time per forward + backward call of each kernel ``attention`` launches at ``shape`` (name: ms), over
    ``calls`` eager calls after three unprofiled ones."""
    q, k, v, do = head_inputs(*shape, with_output_grad=True)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def forward_backward():
        return torch.autograd.grad(attention(q, k, v), (q, k, v), do)

    for _ in range(3):
        forward_backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            forward_backward()
        torch.cuda.synchronize()
    return dict(kernel_times_ms(prof.events(), calls)[0])


def backward_split(kernels: dict[str, float]) -> tuple[float, float]:
    """The main backward kernel's time and the backward's kernels' time (all but the forward's), ms."""
    main = [t for name, t in kernels.items() if any(m in name for m in MAIN_BACKWARD_KERNELS)]
    if len(main) != 1:
        raise SystemExit(f"hopper_backward_tiles: expected one main backward kernel among {sorted(kernels)}")
    return main[0], sum(t for name, t in kernels.items() if not any(f in name for f in FORWARD_KERNELS))


def time_kernels(providers, attention, cudnn, shape, rounds: int) -> dict:
    """:func:`profiled_kernels_ms` of every provider and cuDNN in alternating rounds: the medians of the main
    backward kernel and of the backward's kernels, each over cuDNN's, and every round's kernels."""
    names = [*providers, "cudnn"]
    runs = {name: [] for name in names}
    first = profiled_kernels_ms(cudnn, shape, 3)
    calls = max(5, min(200, int(100 / max(sum(first.values()), 1e-3))))
    for r in range(rounds):
        for name in (names if r % 2 == 0 else reversed(names)):
            if name != "cudnn":
                use(name)
            runs[name].append(profiled_kernels_ms(cudnn if name == "cudnn" else attention, shape, calls))
    splits = {n: [backward_split(k) for k in runs[n]] for n in names}
    main = {n: statistics.median(m for m, _ in splits[n]) for n in names}
    backward = {n: statistics.median(b for _, b in splits[n]) for n in names}
    return {"main_backward_kernel_ms": {n: round(t, 4) for n, t in main.items()},
            "backward_kernels_ms": {n: round(t, 4) for n, t in backward.items()},
            "main_over_cudnn": {n: round(t / main["cudnn"], 4) for n, t in main.items()},
            "backward_kernels_over_cudnn": {n: round(t / backward["cudnn"], 4) for n, t in backward.items()},
            "calls_per_round": calls,
            "rounds_kernels_ms": {n: [{k: round(t, 4) for k, t in sorted(ks.items())} for ks in runs[n]]
                                  for n in names}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", nargs="+", choices=list(TILES), default=["128x8", "64x4"])
    parser.add_argument("--orders", nargs="+", choices=ORDERS, default=["rule"])
    parser.add_argument("--not-causal", dest="causal", action="store_false", help="time full attention")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="batch,heads,seq,d")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ms", type=float, default=300, help="GPU time per measurement, ms")
    parser.add_argument("--kernel-times", action="store_true",
                        help="time each kernel (torch.profiler, eager calls) instead of replaying graphs")
    args = parser.parse_args()
    if not torch.cuda.is_available() or hopper.supports(torch.device("cuda"), torch.bfloat16, 64):
        raise SystemExit("hopper_backward_tiles: needs a Hopper GPU (H100/H200)")
    providers = [f"{tiles}/{order}" for tiles in args.tiles for order in args.orders]
    failed = 0
    for name in providers:
        use(name)
        for case in CHECKS:
            errs = errors(case)
            bad = not max(errs) <= BOUND
            failed += bad
            print(json.dumps({"check": name, "case": case, "rel_err_dq_dk_dv": [round(e, 5) for e in errs],
                              "ok": not bad}), flush=True)
    if failed:
        raise SystemExit(f"{failed} checks over {BOUND}")
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split(","))
        batch, heads, seq, head_dim = shape
        if args.kernel_times:
            row = time_kernels(providers, lambda q, k, v: flash_attention(q, k, v, args.causal),
                               lambda q, k, v: cudnn_attention(q, k, v, args.causal),
                               (batch, heads, seq, seq, head_dim), args.rounds)
            print(json.dumps({"shape": shape, **row, "causal": args.causal,
                              "device": torch.cuda.get_device_name()}), flush=True)
            continue
        graphs = {}
        for name in providers:
            use(name)
            graphs[name] = graphs_of(lambda q, k, v: flash_attention(q, k, v, args.causal),
                                     (batch, heads, seq, seq, head_dim))
        graphs["cudnn"] = graphs_of(lambda q, k, v: cudnn_attention(q, k, v, args.causal),
                                    (batch, heads, seq, seq, head_dim))
        first = replay_mean_ms(graphs["cudnn"][0][1], 3)
        replays = max(3, min(2000, int(args.ms / max(first, 1e-3))))
        times = {name: ([], []) for name in graphs}  # forward, forward + backward
        for r in range(args.rounds):
            for name in (graphs if r % 2 == 0 else reversed(graphs)):
                for graph, column in zip(graphs[name][0], times[name]):
                    column.append(statistics.median(replay_mean_ms(graph, replays) for _ in range(5)))
        fwd_bwd = {name: statistics.median(t[1]) for name, t in times.items()}
        bwd = {name: fwd_bwd[name] - statistics.median(t[0]) for name, t in times.items()}
        print(json.dumps({"shape": shape, "backward_ms": {n: round(m, 4) for n, m in bwd.items()},
                          "fwd_bwd_ms": {n: round(m, 4) for n, m in fwd_bwd.items()},
                          "rounds_fwd_bwd": {n: [round(x, 4) for x in t[1]] for n, t in times.items()},
                          "backward_over_cudnn": {n: round(m / bwd["cudnn"], 4) for n, m in bwd.items()},
                          "causal": args.causal,
                          "device": torch.cuda.get_device_name()}), flush=True)
        del graphs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
