"""``torch.compile`` against eager (problem ``torch_compile``).

Two parts, eager and compiled measured in the same run:

* ``attention``: the ``pytorch_attention`` grid (batch 8, d x sequence length, forward and backward
  times) with the naive attention eager (``naive``) and compiled (``compiled``).
* ``model``: the whole ``BasicsTransformerLM`` of every size, eager and ``torch.compile``-d, for a
  forward pass and for a full training step (forward, loss, backward, AdamW), fp32 (``--dtypes fp32
  bf16`` adds bf16 autocast), context 512, batch 4, 5 warm-up (compilation happens there) and 10 timed steps.

Examples::

    python -m cs336_systems.bench.torch_compile
    python -m cs336_systems.bench.torch_compile --part model --sizes small --dtypes bf16
"""

from __future__ import annotations

import torch

from cs336_systems.bench.common import attention_grid as grid
from cs336_systems.bench.common import cli, model_sizes, result_store, timing
from cs336_systems.bench.common.lm import LMConfig, add_flops, build_model, measure_case

PROBLEM = "torch_compile"


def parser():
    p = grid.add_arguments(cli.base_parser(__doc__))
    p.add_argument("--part", choices=["attention", "model", "both"], default="both")
    cli.add_model_size(p, multiple=True, default="the edition's every size")
    p.add_argument("--dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    p.add_argument("--context-length", type=cli.positive_int, default=None, help="model part (default 512)")
    p.add_argument("--steps", type=cli.positive_int, default=10, help="model part: timed steps")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend for the model part")
    return p


def run_models(args, device: torch.device) -> list[dict]:
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force, edition=args.edition)
    cases = [
        dict(part="model", size=size, context_length=args.context_length, batch_size=4, mode=mode, dtype=dtype,
             compile=compiled and args.compile_backend, warmup=5, steps=args.steps)
        for size in args.sizes for dtype in args.dtypes for compiled in (False, True)
        for mode in ("forward", "train_step")
    ]
    pending = store.pending(cases)
    peak = timing.measure_matmul_tflops(device) if pending else None
    for case in cli.progress(pending, f"{PROBLEM} (model)"):
        config = LMConfig(case["size"], case["context_length"], case["batch_size"])

        def measure():
            model = build_model(config, device)
            return measure_case(config, case["mode"], case["dtype"], 5, args.steps, device,
                                compile_model=case["compile"], model=model)

        result = result_store.measure_or_oom(measure)
        add_flops(result, config, case["mode"], peak)
        store.add(case, result)
        torch._dynamo.reset()
        timing.free_memory()
    return store.asked_rows()


def main(argv: list[str] | None = None) -> None:
    args, device, _ = cli.start(parser(), argv)
    grid.resolve_defaults(args, device)
    tiny = args.quick or device.type == "cpu"
    args.sizes = args.sizes or (["tiny"] if tiny else model_sizes.edition_sizes(args.edition))
    args.context_length = args.context_length or (32 if tiny else 512)
    if tiny:
        args.steps = min(args.steps, 2)
    if args.part in ("attention", "both"):
        rows = grid.run_grid(PROBLEM, ["naive", "compiled"], args, device, {"part": "attention"})
        cli.print_table(rows, ["attention", "d", "seq_len", "forward_mean_ms", "backward_mean_ms", "oom"])
    if args.part in ("model", "both"):
        rows = run_models(args, device)
        cli.print_table(rows, ["size", "mode", "dtype", "compile", "mean_ms", "std_ms", "mfu", "oom"])


if __name__ == "__main__":
    main()
