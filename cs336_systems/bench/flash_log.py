"""The FlashAttention optimisation log (``writeup/results/flash_optimisation_log.jsonl``): one row per step.

Each step of the kernel work is measured the same way, by this command, at the checked-out code::

    python -m cs336_systems.bench.flash_log --step tiles-per-kernel --hypothesis "dK/dV wants BLOCK_N=128 ..."

It times, in one run,

* the leaderboard shape (``leaderboard``'s protocol and checks: ``torch.compile`` of ours, q, k, v of shape
  ``(16, 16384, 64)`` bf16 causal, ``o.sum().backward()``), ours and SDPA cuDNN, at a shorter ``do_bench``
  (``--rep 2000 --warmup 200`` by default; the official 10000/1000 is ``leaderboard``'s job);
* a few points of the ``flash_benchmarking`` sweep (batch 1, causal, bf16; default 4096x64, 16384x64,
  16384x128, 65536x64, 65536x128): ours forward, backward and forward+backward, SDPA cuDNN and SDPA flash
  (FlashAttention-2 CUDA) forward+backward,

and appends a row ``{"step", "hypothesis", "decision", "note", "commit", "dirty", "leaderboard": {...},
"points": [...]}`` with the times and the ratios ours / cuDNN and ours / FA2. A step is measured before its
outcome is known: its decision starts as given by ``--decision`` (default ``pending``) and can be set later
with ``--set-decision --step NAME --decision kept`` (a small row; the latest decision wins). ``--show`` prints
the log as a markdown table (one line per step).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import torch

from cs336_systems.bench.common import attention_providers as fp
from cs336_systems.bench.common import cli, result_store, timing

PROBLEM = "flash_optimisation_log"
POINTS = [(4096, 64), (16384, 64), (16384, 128), (65536, 64), (65536, 128)]
DECISIONS = ["pending", "baseline", "kept", "dropped"]
LEADERBOARD_PROVIDERS = ["ours", "sdpa_cudnn"]
POINT_PROVIDERS = ["ours", "sdpa_cudnn", "sdpa_flash"]
POINT_PHASES = {"ours": fp.PHASES, "sdpa_cudnn": ("fwd_bwd",), "sdpa_flash": ("fwd_bwd",)}


def point(text: str) -> tuple[int, int]:
    """``"16384x64"`` -> ``(16384, 64)`` (sequence length x head dim)."""
    return cli.positive_pair(text, "x", "a point LENGTHxHEAD_DIM", "16384x64")


def parser():
    p = cli.base_parser(__doc__, resumes=False)
    p.add_argument("--step", help="the step's name (short, unique)")
    p.add_argument("--hypothesis", default="", help="the idea and the predicted effect")
    p.add_argument("--decision", choices=DECISIONS, default="pending")
    p.add_argument("--note", default="", help="anything else: what the profile showed, why it was dropped")
    p.add_argument("--set-decision", action="store_true", help="only record --decision (and --note) for --step")
    p.add_argument("--show", action="store_true", help=f"print the log as a markdown table and exit (the committed "
                   f"{result_store.RESULTS_DIR.name}/{PROBLEM}.jsonl unless --results-dir names another folder)")
    p.add_argument("--rep", type=cli.positive_float, default=2000,
                   help="do_bench repetition time at the leaderboard shape, ms")
    p.add_argument("--warmup", type=cli.positive_float, default=200,
                   help="do_bench warm-up time at the leaderboard shape, ms")
    p.add_argument("--points", nargs="*", type=point, default=POINTS, help="sweep points, e.g. 16384x64")
    p.add_argument("--point-rep", type=cli.positive_float, default=100,
                   help="do_bench repetition time at each point, ms")
    p.add_argument("--point-warmup", type=cli.positive_float, default=25)
    return p


def git_dirty() -> bool | None:
    """Whether tracked files differ from the commit (None outside a git checkout): a dirty step's numbers
    belong to code that no commit holds."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=result_store.REPO_ROOT,
                             capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return bool(out.stdout.strip())


def leaderboard_summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The log's view of ``attention_providers.measure_leaderboard``: ms, ratio to cuDNN, and the checks of ours."""
    ours, cudnn = results.get("ours", {}), results.get("sdpa_cudnn", {})
    summary = {
        "ours_fwd_bwd_ms": ours.get("fwd_bwd_ms"),
        "ours_fwd_ms": ours.get("fwd_ms"),
        "sdpa_cudnn_fwd_bwd_ms": cudnn.get("fwd_bwd_ms"),
        "sdpa_cudnn_fwd_ms": cudnn.get("fwd_ms"),
        "ratio_vs_cudnn": fp.ratio(ours.get("fwd_bwd_ms"), cudnn.get("fwd_bwd_ms")),
    }
    for key in ("verified", "graph_breaks", "graph_breaks_after_first_call", "graph_break_reasons", "our_kernels",
                "foreign_attention_kernels", "matches_sdpa", "max_rel_err", "sdpa_max_rel_err", "error"):
        if key in ours:
            summary[f"ours_{key}" if key == "error" else key] = ours[key]
    return summary


def point_summary(seq_len: int, d_head: int, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One sweep point: ours per phase, the competitors' fwd+bwd, and ours / each of them."""
    ours, cudnn, fa2 = (results.get(name, {}) for name in POINT_PROVIDERS)
    summary: dict[str, Any] = {"seq_len": seq_len, "d_head": d_head}
    summary.update({f"ours_{phase}_ms": ours.get(f"{phase}_ms") for phase in fp.PHASES})
    summary["sdpa_cudnn_fwd_bwd_ms"] = cudnn.get("fwd_bwd_ms")
    summary["sdpa_flash_fwd_bwd_ms"] = fa2.get("fwd_bwd_ms")
    summary["ratio_vs_cudnn"] = fp.ratio(ours.get("fwd_bwd_ms"), cudnn.get("fwd_bwd_ms"))
    summary["ratio_vs_fa2"] = fp.ratio(ours.get("fwd_bwd_ms"), fa2.get("fwd_bwd_ms"))
    for name, result in results.items():
        if result.get("oom") or result.get("error"):
            summary[f"{name}_error"] = "out of memory" if result.get("oom") else result["error"]
    return summary


def measure_step(args, device: torch.device) -> dict[str, Any]:
    """The leaderboard shape and every point, summarised as the row's measurements."""
    board = fp.measure_leaderboard(LEADERBOARD_PROVIDERS, fp.LEADERBOARD_HEADS, fp.LEADERBOARD_SEQ_LEN,
                                   fp.LEADERBOARD_D_HEAD, fp.LEADERBOARD_DTYPE, device, args.rep, args.warmup)
    points = []
    for seq_len, d_head in cli.progress(args.points, "sweep points"):
        results = fp.measure_shape(POINT_PROVIDERS, seq_len, d_head, "bf16", device, args.point_rep,
                                                   args.point_warmup, POINT_PHASES)
        points.append(point_summary(seq_len, d_head, results))
    return {"leaderboard": leaderboard_summary(board), "points": points,
            "leaderboard_rep_ms": args.rep, "point_rep_ms": args.point_rep}


def latest_decisions(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Each step's decision: the latest row that names the step wins (measurement or ``--set-decision``)."""
    return {row["step"]: row["decision"]
            for row in result_store.latest((row for row in rows if "decision" in row), key=lambda row: row["step"])}


def markdown(rows: list[dict[str, Any]]) -> str:
    """The log as a markdown table, one line per measured step in order, with its latest decision."""
    decisions = latest_decisions(rows)
    measured = [row for row in rows if "leaderboard" in row]
    point_names = list(dict.fromkeys(f"{p['seq_len']}x{p['d_head']}" for row in measured for p in row["points"]))
    header = ["step", "decision", "commit", "hypothesis", "leaderboard ms", "cuDNN ms", "ours/cuDNN",
              *[f"{name} ours/cuDNN, ours/FA2" for name in point_names]]

    def number(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in measured:
        board = row["leaderboard"]
        by_point = {f"{p['seq_len']}x{p['d_head']}": p for p in row["points"]}
        cells = [
            row["step"], decisions.get(row["step"], "pending"), row["commit"] + ("+dirty" if row.get("dirty") else ""),
            row.get("hypothesis", "").replace("|", "/"), number(board["ours_fwd_bwd_ms"]),
            number(board["sdpa_cudnn_fwd_bwd_ms"]), number(board["ratio_vs_cudnn"], 2),
        ]
        for name in point_names:
            p = by_point.get(name, {})
            cells.append(f"{number(p.get('ratio_vs_cudnn'), 2)}, {number(p.get('ratio_vs_fa2'), 2)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    options = parser()
    args = options.parse_args(argv)
    if args.show or not args.step:  # with no step to measure, the log so far: the committed one unless told
        shown = result_store.ResultStore(PROBLEM, args.results_dir if options.results_dir_given else None,
                                         quiet=True)
        print(f"# the optimisation log in {shown.path} ({len(shown.rows())} rows); --step NAME measures a step",
              file=sys.stderr)
        print(markdown(shown.rows()))
        return
    store = result_store.ResultStore(PROBLEM, args.results_dir, force=True)  # a log: every call appends
    if args.set_decision:
        store.add({"step": args.step}, {"decision": args.decision, "note": args.note})
        print(f"# {args.step}: {args.decision}")
        return
    device = timing.default_device()
    if device.type != "cuda":
        print("# flash_log measures our Triton kernels: it needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    cli.announce(device, args.quick)
    if args.quick:
        args.rep, args.warmup, args.points = min(args.rep, 200), min(args.warmup, 50), args.points[:2]
    measurements = measure_step(args, device)
    row = store.add({"step": args.step}, {"hypothesis": args.hypothesis, "decision": args.decision,
                                          "note": args.note, "commit": store.env["commit"], "dirty": git_dirty(),
                                          **measurements})
    board = row["leaderboard"]
    print(f"# leaderboard shape: ours {board['ours_fwd_bwd_ms']} ms, cuDNN {board['sdpa_cudnn_fwd_bwd_ms']} ms, "
          f"ours/cuDNN {board['ratio_vs_cudnn']}; verified {board.get('verified')}")
    cli.print_table(row["points"], ["seq_len", "d_head", "ours_fwd_ms", "ours_bwd_ms", "ours_fwd_bwd_ms",
                                        "sdpa_cudnn_fwd_bwd_ms", "sdpa_flash_fwd_bwd_ms", "ratio_vs_cudnn",
                                        "ratio_vs_fa2"], digits=3)
    if board.get("verified") is False:
        checks = {k: board.get(k) for k in ("graph_breaks", "graph_break_reasons", "our_kernels",
                                             "foreign_attention_kernels", "max_rel_err", "sdpa_max_rel_err")}
        print(f"# VERIFICATION FAILED at the leaderboard shape: {checks}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
