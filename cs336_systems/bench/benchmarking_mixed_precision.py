"""Mixed precision (problem ``benchmarking_mixed_precision``).

1. The dtypes inside a toy model under autocast (float16 as the assignment asks, and bfloat16):
   ``Linear(in, 10, bias=False) -> ReLU -> LayerNorm(10) -> Linear(10, out, bias=False)``; the script
   prints (and records) the dtype of the parameters, the first layer's output, the LayerNorm output,
   the logits, the loss and the gradients, read off the tensors themselves.
2. ``--timings``: fp32 against bf16 autocast for every model size, forward, forward+backward and
   a full training step. These are ``benchmarking_script`` rows (its ``dtype`` column): this runs
   that sweep for both precisions, and what is already measured is skipped.

Examples::

    python -m cs336_systems.bench.benchmarking_mixed_precision
    python -m cs336_systems.bench.benchmarking_mixed_precision --timings
"""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from cs336_systems.bench.common import cli, result_store, timing
from cs336_systems.bench.common.lm import autocast

PROBLEM = "benchmarking_mixed_precision"


class ToyModel(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        self.seen["fc1 output"] = h.dtype
        h = self.relu(h)
        self.seen["ReLU output"] = h.dtype
        h = self.ln(h)
        self.seen["LayerNorm output"] = h.dtype
        logits = self.fc2(h)
        self.seen["logits"] = logits.dtype
        return logits


def toy_model_dtypes(dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    """The dtype of every quantity of one autocast training step of the toy model."""
    model = ToyModel(16, 5).to(device)
    x = torch.randn(8, 16, device=device)
    y = torch.randint(0, 5, (8,), device=device)
    with autocast(device, dtype):
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
    loss.backward()
    seen = {"parameters": {str(p.dtype) for p in model.parameters()}, **model.seen, "loss": loss.dtype}
    seen["gradients"] = {str(p.grad.dtype) for p in model.parameters()}
    return {k: ", ".join(sorted(v)) if isinstance(v, set) else str(v) for k, v in seen.items()}


def parser() -> cli.BenchmarkParser:
    p = cli.base_parser(__doc__)
    p.add_argument("--timings", action="store_true", help="also the fp32 vs bf16 sweep of benchmarking_script "
                   "(other options go to it)")
    cli.add_edition(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args, rest = parser().parse_known_args(argv)
    device = timing.default_device()
    cli.announce(device, args.quick)
    store = result_store.ResultStore(PROBLEM, args.results_dir, force=True)  # takes milliseconds: always re-run
    for dtype in (torch.float16, torch.bfloat16):
        dtypes = toy_model_dtypes(dtype, device)
        store.add({"autocast": str(dtype).removeprefix("torch."), "device_type": device.type}, {"dtypes": dtypes})
        print(f"autocast to {dtype} on {device.type}:")
        for name, value in dtypes.items():
            print(f"  {name:18s} {value}")
    if args.timings:
        forwarded = ["--edition", args.edition, "--dtypes", "fp32", "bf16", *rest]
        if args.quick:
            forwarded.append("--quick")
        if args.results_dir:
            forwarded += ["--results-dir", str(args.results_dir)]
        # A tool never imports another: the timings run as their own command.
        subprocess.run([sys.executable, "-m", "cs336_systems.bench.benchmarking_script", *forwarded], check=True)


if __name__ == "__main__":
    main()
