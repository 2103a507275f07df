"""End-to-end benchmark of ``BasicsTransformerLM`` (problem ``benchmarking_script``).

For every model size, mode (``forward``, ``forward_backward``, ``train_step`` with AdamW) and
precision (fp32, bf16 autocast): ``--warmup`` untimed steps, then ``--steps`` timed ones, each
followed by ``torch.cuda.synchronize()`` and timed with ``timeit.default_timer()``. Each row gives
the whole step and its phases (forward, backward, optimizer): mean, std and median in ms, every
step's time, the model FLOPs and the MFU against the device's measured bf16 matmul rate.

``--warmup-study`` measures the same steps after 0, 1, 2 and 5 warm-up steps, each warm-up count in a
fresh process, so that the first steps' extra cost (CUDA context and kernel loading, cuBLAS handles
and heuristics, allocator growth) shows in the per-step times.

Examples::

    python -m cs336_systems.bench.benchmarking_script                 # every size, context 512
    python -m cs336_systems.bench.benchmarking_script --sizes small --modes forward --dtypes bf16
    python -m cs336_systems.bench.benchmarking_script --warmup-study
    python -m cs336_systems.bench.benchmarking_script --sizes xl --memory-snapshot xl.pickle --trace xl.json
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import torch

from cs336_systems.attention import ATTENTION_NAMES
from cs336_systems.bench.common import cli, model_sizes, result_store, timing
from cs336_systems.bench.common.lm import (
    DTYPES,
    MODES,
    LMConfig,
    add_flops,
    build_model,
    make_optimizer,
    make_step,
    measure_case,
    measure_stack,
    random_batch,
)
from cs336_systems.bench.common.memory import record_snapshot

PROBLEM = "benchmarking_script"
WARMUP_STUDY = (0, 1, 2, 5)


def parser():
    p = cli.base_parser(__doc__)
    cli.add_model_size(p, multiple=True, default="the edition's every size")
    p.add_argument("--context-length", type=cli.positive_int, default=None, help="tokens per sequence (default 512)")
    p.add_argument("--batch-size", type=cli.positive_int, default=4)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--warmup", type=cli.non_negative_int, default=5, help="untimed steps before timing")
    p.add_argument("--steps", type=cli.positive_int, default=10, help="timed steps")
    p.add_argument("--attention", default="naive", choices=ATTENTION_NAMES, help="attention implementation")
    p.add_argument("--compile", action="store_true", help="torch.compile the whole model")
    p.add_argument("--stack", choices=["ours", "torch"], default=None,
                   help="time the training step of a stack of cs336_systems.train instead (implies --modes train_step; "
                        "its own attention, norms, loss, optimizer and compilation)")
    p.add_argument("--warmup-study", action="store_true", help="0, 1, 2 and 5 warm-up steps, each in a fresh process")
    p.add_argument("--tag", default="sweep", help="labels the rows (the warm-up study's are 'warmup_study')")
    p.add_argument("--memory-snapshot", default=None, help="also record a CUDA memory snapshot of the first case here")
    p.add_argument("--trace", default=None, help="also write a torch.profiler Chrome trace of the first case here")
    return p


def run_sweep(args, device: torch.device) -> list[dict[str, Any]]:
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force, edition=args.edition)
    cases = [
        dict(size=size, context_length=args.context_length, batch_size=args.batch_size, mode=mode, dtype=dtype,
             attention=args.attention, compile=args.compile, warmup=args.warmup, steps=args.steps, tag=args.tag,
             **({"stack": args.stack} if args.stack else {}))
        for size in args.sizes for mode in args.modes for dtype in args.dtypes
    ]
    pending = store.pending(cases)
    # The warm-up study must meet a cold GPU: no matmul-rate measurement (it would warm cuBLAS) first.
    peak = timing.measure_matmul_tflops(device) if pending and args.tag != "warmup_study" else None
    by_size: dict[str, list[dict[str, Any]]] = {}
    for case in pending:
        by_size.setdefault(case["size"], []).append(case)
    bar = cli.progress(pending, PROBLEM)
    for size, size_cases in by_size.items():
        config = LMConfig(size, args.context_length, args.batch_size)
        too_large = None if args.stack else model_sizes.estimated_oom(size, "forward", device)
        built = too_large or result_store.measure_or_oom(
            lambda: {} if args.stack else {"model": build_model(config, device, args.attention)})
        model = built.pop("model", None)
        for case in size_cases:
            if built["oom"]:  # each mode's own estimate where there is one: it says what that mode needs
                result = model_sizes.estimated_oom(size, case["mode"], device) or dict(built)
            elif args.stack:
                result = result_store.measure_or_oom(lambda: measure_stack(
                    config, args.stack, case["dtype"], args.warmup, args.steps, device))
            else:
                result = result_store.measure_or_oom(lambda: measure_case(
                    config, case["mode"], case["dtype"], args.warmup, args.steps, device, args.attention,
                    args.compile, model))
            add_flops(result, config, case["mode"], peak)
            store.add(case, result)
            bar.update()
            model.zero_grad(set_to_none=True) if model is not None else None
            timing.free_memory()
        del model
        timing.free_memory()
    bar.close()
    return store.asked_rows()


def run_warmup_study(args) -> None:
    """One fresh process per warm-up count, so the 0-warm-up steps include every first-call cost."""
    for warmup in WARMUP_STUDY:
        command = [
            sys.executable, "-m", "cs336_systems.bench.benchmarking_script", "--edition", args.edition,
            "--sizes", *(model_sizes.size_label(size, args.edition) for size in args.sizes),
            "--modes", *args.modes, "--dtypes", *args.dtypes, "--warmup", str(warmup), "--steps", str(args.steps),
            "--context-length", str(args.context_length), "--batch-size", str(args.batch_size),
            "--tag", "warmup_study",
        ]
        if args.results_dir:
            command += ["--results-dir", str(args.results_dir)]
        if args.force:
            command.append("--force")
        print(f"# warm-up study: {warmup} warm-up steps in a fresh process", file=sys.stderr)
        subprocess.run(command, check=True)


def record_extras(args, device: torch.device) -> None:
    """The optional memory snapshot and profiler trace, of the first size/mode/dtype."""
    config = LMConfig(args.sizes[0], args.context_length, args.batch_size)
    mode, dtype = args.modes[0], args.dtypes[0]
    model = build_model(config, device, args.attention)
    optimizer = make_optimizer(model) if mode == "train_step" else None
    step = make_step(model, random_batch(config, device), mode, DTYPES[dtype], optimizer)
    step(None)
    if args.memory_snapshot:
        record_snapshot(lambda: [step(None) for _ in range(2)], args.memory_snapshot, device)
        print(f"# memory snapshot: {args.memory_snapshot}", file=sys.stderr)
    if args.trace:
        with torch.profiler.profile(activities=profiler_activities(device)) as prof:
            for _ in range(2):
                step(None)
            timing.synchronize(device)
        prof.export_chrome_trace(args.trace)
        print(f"# profiler trace: {args.trace}", file=sys.stderr)


def profiler_activities(device: torch.device) -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def main(argv: list[str] | None = None) -> None:
    args, device, tiny = cli.start(parser(), argv)
    if args.sizes is None:
        args.sizes = ["tiny"] if tiny else model_sizes.edition_sizes(args.edition)
    if args.context_length is None:
        args.context_length = 32 if tiny else 512
    if tiny:
        args.batch_size = min(args.batch_size, 2)
        args.steps = min(args.steps, 2)
    if args.stack:
        args.modes = ["train_step"]
    if args.warmup_study:
        run_warmup_study(args)
        return
    rows = run_sweep(args, device)
    if args.memory_snapshot or args.trace:
        record_extras(args, device)
    cli.print_table(rows, ["size", "mode", "dtype", "warmup", "mean_ms", "std_ms", "forward_mean_ms",
                               "backward_mean_ms", "optimizer_mean_ms", "mfu", "oom"])


if __name__ == "__main__":
    main()
