"""The training step of our stack against PyTorch's best, in the same run (problem ``train_step``).

For every model size and (context length, batch size) in ``--shapes`` (default: 512 and 2048 at batch 4, 8192 at
batch 1), each stack of :data:`cs336_systems.train.STACKS` (``ours``: our attention operator, fused RMSNorm,
fused LM head + cross-entropy, fused AdamW; ``torch``: SDPA, plain RMSNorm and cross-entropy, AdamW(fused=True);
both with compiled blocks) trains a fresh model under bf16 autocast: ``--warmup`` untimed steps (compilation
included), ``--steps`` timed ones, each synchronised (median ``step_ms``), then ``--phase-steps`` steps timed per
phase (forward, backward, optimizer; synchronising between them). Each stack runs in each ``--variants``:
``default`` (eager launches from the compiled blocks) and ``cudagraphs`` (forward, loss and backward captured in one
CUDA graph and replayed; the ``cudagraphs`` step part). Rows: ``variant``, ``step_ms`` (median) with mean/std,
phase medians, ``mfu`` (model FLOPs of a step, causal attention counted half, over the bf16 matmul rate measured
in the same run), ``peak_gb`` (peak allocated during the timed steps), and in ours' rows ``ours_over_torch``: over
the faster of the torch stack's variants measured for the same size and shape (``torch_variant`` names it). Every
case runs in a fresh process (``--case``), so no compiled code, cache or allocation of one stack can help or
hinder the other.

``--residual-norm fused`` runs the stacks whose RMSNorm is ours with each residual add inside the norm that reads
its sum (the ``fused_residual_norm`` part), ``separate`` without (the stacks' default); given either way, the rows
of those stacks record it (``residual_norm``), so both choices' rows stand side by side (rows without the key are
``separate``). PyTorch's stack keeps its adds and norms as they are.

    python -m cs336_systems.bench.train_step                              # every size, three shapes, both stacks
    python -m cs336_systems.bench.train_step --sizes xl --shapes 512:4 --stacks ours torch
    python -m cs336_systems.bench.train_step --override attention=sdpa    # ours with one part swapped
    python -m cs336_systems.bench.train_step --variants default           # without CUDA graphs
    python -m cs336_systems.bench.train_step --sizes xl --shapes 512:4 --stacks ours --residual-norm fused
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import timeit
from typing import Any

import torch

from cs336_systems.bench.common import cli, flops, model_sizes, result_store, timing
from cs336_systems.bench.common.lm import VOCAB_SIZE, LMConfig, build_model, random_batch
from cs336_systems.train import STACKS, build_training_step
from cs336_systems.train.step import RESIDUAL_NORMS, Parts

PROBLEM = "train_step"
VARIANTS = {"default": [], "cudagraphs": ["cudagraphs=true"]}
"""Each variant's part changes on top of the stack's parts."""
DEFAULT_SHAPES = ["512:4", "2048:4", "8192:1"]


def shape(text: str) -> tuple[int, int]:
    """``context:batch`` (argparse type), both at least 1."""
    return cli.positive_pair(text, ":", "a shape context:batch", "512:4")


def parser():
    p = cli.base_parser(__doc__)
    cli.add_model_size(p, multiple=True, default="the edition's every size")
    p.add_argument("--shapes", nargs="+", type=shape, default=None,
                   help="context:batch pairs (default 512:4 2048:4 8192:1)")
    p.add_argument("--stacks", nargs="+", default=["torch", "ours"], choices=list(STACKS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="default: eager launches; cudagraphs: forward and backward replayed from a CUDA graph")
    p.add_argument("--override", nargs="*", default=[], help="part=value changes to every stack (e.g. compile=model)")
    p.add_argument("--residual-norm", choices=RESIDUAL_NORMS, default=None,
                   help="residual adds fused into our RMSNorm or separate (default: separate, rows without the key)")
    p.add_argument("--warmup", type=cli.non_negative_int, default=3)
    p.add_argument("--steps", type=cli.positive_int, default=8)
    p.add_argument("--phase-steps", type=cli.non_negative_int, default=3)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: measure one case (JSON), print its row
    return p


def case_parts(case: dict[str, Any], overrides: list[str]) -> Parts:
    """The parts a case measures: its stack's, its variant's and the command line's changes, its residual norm."""
    parts = STACKS[case["stack"]].with_overrides([*VARIANTS[case["variant"]], *overrides])
    return parts.with_residual_norm(case.get("residual_norm", "separate"))


def residual_norm_key(stack: str, args) -> dict[str, str]:
    """``{"residual_norm": choice}`` for a stack whose RMSNorm is ours when ``--residual-norm`` is given, else
    nothing (the rows measured before the option, and PyTorch's stack, have no such key)."""
    if args.residual_norm is None or STACKS[stack].with_overrides(args.override).rmsnorm != "fused":
        return {}
    return {"residual_norm": args.residual_norm}


def measure(case: dict[str, Any], args, device: torch.device) -> dict[str, Any]:
    config = LMConfig(case["size"], case["context_length"], case["batch_size"])
    parts = case_parts(case, args.override)
    model = build_model(config, device)
    step = build_training_step(model, parts)
    x, y = random_batch(config, device)
    cold = timeit.default_timer()
    step(x, y)
    timing.synchronize(device)
    first_step_s = timeit.default_timer() - cold
    for _ in range(args.warmup):
        step(x, y)
    with timing.peak_memory(device) as memory:  # the timed steps' peak
        seconds = timing.time_calls(lambda: step(x, y), 0, args.steps, device)
    peak_gb = memory.get("peak_gb")
    phases: list[dict[str, float]] = []
    for _ in range(args.phase_steps):
        phases.append({})
        step(x, y, phases[-1])
    result = {**timing.summarize_ms(seconds), "step_ms": statistics.median(seconds) * 1e3, "peak_gb": peak_gb,
              "first_step_s": first_step_s, "parts": dataclasses.asdict(parts)}
    for phase in ("forward", "backward", "optimizer"):
        result[f"{phase}_ms"] = statistics.median(p[phase] for p in phases) * 1e3 if phases else None
    del step, model
    return result


def measure_in_fresh_process(case: dict[str, Any], args) -> dict[str, Any]:
    """Run :func:`measure` for ``case`` in a new Python process; its result (or out-of-memory row)."""
    command = [sys.executable, "-m", "cs336_systems.bench.train_step", "--case", json.dumps(case),
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--phase-steps", str(args.phase_steps),
               "--override", *args.override]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"train_step: case {case} failed (exit {done.returncode}): {last}\n"
                         f"# re-run it alone to see the whole traceback: {' '.join(command)}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def measure_case(case: dict[str, Any], args, device: torch.device) -> None:
    """The ``--case`` child: measure one case and print its result as one JSON line."""
    result = result_store.measure_or_oom(lambda: measure(case, args, device))
    print("RESULT " + json.dumps(result))


def fastest_torch_row(store: result_store.ResultStore, case: dict[str, Any]) -> dict[str, Any] | None:
    """Of the newest ``torch`` row of each variant for ``case``'s size, shape and settings measured on this device
    (each case runs in its own process anyway, so a row of an earlier invocation compares like one of this), the
    fastest."""
    case = {key: value for key, value in case.items() if key != "residual_norm"}  # torch's adds are its own
    rows = [store.newest({**case, "stack": "torch", "variant": variant}) for variant in VARIANTS]
    return min((row for row in rows if row and not row.get("oom")), key=lambda row: row["step_ms"], default=None)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    device = timing.default_device()
    if args.case:
        measure_case(json.loads(args.case), args, device)
        return
    for stack in args.stacks:  # a bad part fails here, in one line, not in a child process
        try:
            STACKS[stack].with_overrides(args.override)
        except ValueError as error:
            raise SystemExit(f"train_step: --override: {error}") from None
    cli.announce(device, args.quick)
    tiny = args.quick or device.type == "cpu"
    if tiny and device.type == "cpu":
        print("# no GPU: the tiny model, eager, our kernels would need TRITON_INTERPRET=1: torch stack only",
              file=sys.stderr)
        args.stacks, args.override = ["torch"], [*args.override, "compile=none", "optimizer=basics"]
        args.variants = ["default"]
    args.sizes = args.sizes or (["tiny"] if tiny else model_sizes.edition_sizes(args.edition))
    args.shapes = args.shapes or ([(32, 2)] if tiny else [shape(s) for s in DEFAULT_SHAPES])
    if tiny:
        args.warmup, args.steps, args.phase_steps = min(args.warmup, 1), min(args.steps, 2), min(args.phase_steps, 1)
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force, edition=args.edition)
    # The torch stack first, so that ours' rows find its rows of this run.
    stacks = sorted(args.stacks, key=lambda stack: stack != "torch")
    cases = [dict(size=size, context_length=context, batch_size=batch, stack=stack, variant=variant,
                  overrides=sorted(args.override), dtype="bf16", warmup=args.warmup, steps=args.steps,
                  **residual_norm_key(stack, args))
             for size in args.sizes for context, batch in args.shapes for stack in stacks for variant in args.variants]
    pending = store.pending(cases)
    peak_tflops = timing.measure_matmul_tflops(device) if pending else None
    timing.free_memory()  # the children get the whole GPU
    for case in cli.progress(pending, PROBLEM):
        config = LMConfig(case["size"], case["context_length"], case["batch_size"])
        result = model_sizes.estimated_oom(case["size"], "train_step", device) or measure_in_fresh_process(case, args)
        h = config.hparams
        step_flops = 3 * flops.lm_forward_flops(VOCAB_SIZE, h["d_model"], h["d_ff"], h["num_layers"], config.batch_size,
                                                config.context_length, causal_attention=True)
        result.update(flops=step_flops, peak_tflops=peak_tflops)
        if peak_tflops and not result["oom"]:
            result["mfu"] = step_flops / (result["step_ms"] / 1e3) / (peak_tflops * 1e12)
        torch_row = fastest_torch_row(store, case)
        if case["stack"] == "ours" and torch_row and not result["oom"]:
            result["ours_over_torch"] = result["step_ms"] / torch_row["step_ms"]
            result["torch_variant"], result["torch_run"] = torch_row["variant"], torch_row["run"]
        store.add(case, result)
    cli.print_table(store.asked_rows(), ["size", "context_length", "batch_size", "stack", "variant", "residual_norm",
                                         "step_ms",
                                         "forward_ms", "backward_ms", "optimizer_ms", "mfu", "peak_gb",
                                         "ours_over_torch", "oom"], digits=3)


if __name__ == "__main__":
    main()
