"""The naive PyTorch attention at scale (problem ``pytorch_attention``).

Batch 8, no heads, head dim d in {16, 32, 64, 128} x sequence length in {256, 1024, 4096, 8192,
16384}, float32, causal: after warm-up, time ``--passes`` forwards and ``--passes`` backwards (each
followed by a synchronisation), and read the memory in use just before the backward (what the
forward saved for it). An out-of-memory case is a row. ``torch_compile`` reuses this with the
attention compiled.

Examples::

    python -m cs336_systems.bench.pytorch_attention
    python -m cs336_systems.bench.pytorch_attention --head-dims 64 --seq-lens 4096 --passes 20
"""

from __future__ import annotations

from cs336_systems.bench.common import attention_grid as grid
from cs336_systems.bench.common import cli

PROBLEM = "pytorch_attention"


def parser():
    return grid.add_arguments(cli.base_parser(__doc__))








def main(argv: list[str] | None = None) -> None:
    args, device, _ = cli.start(parser(), argv)
    grid.resolve_defaults(args, device)
    rows = grid.run_grid(PROBLEM, ["naive"], args, device)
    cli.print_table(rows, ["d", "seq_len", "forward_mean_ms", "backward_mean_ms", "memory_before_backward_gb", "oom"])


if __name__ == "__main__":
    main()
