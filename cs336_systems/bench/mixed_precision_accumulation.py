"""Summing 0.01 a thousand times at different precisions (problem ``mixed_precision_accumulation``).

The four variants of the assignment: a float32 accumulator of float32 values; a float16 accumulator of
float16 values; a float32 accumulator of float16 values (added without an explicit cast: PyTorch
promotes to float32); and the same with an explicit upcast. The exact answer is 10. Runs on the CPU.

Example::

    python -m cs336_systems.bench.mixed_precision_accumulation
"""

from __future__ import annotations

import torch

from cs336_systems.bench.common import cli, result_store

PROBLEM = "mixed_precision_accumulation"


def accumulate(accumulator: torch.dtype, value: torch.dtype, upcast: bool, n: int = 1000) -> float:
    total = torch.tensor(0.0, dtype=accumulator)
    for _ in range(n):
        x = torch.tensor(0.01, dtype=value)
        total += x.type(accumulator) if upcast else x
    return float(total)


VARIANTS = [
    ("float32 += float32", torch.float32, torch.float32, False),
    ("float16 += float16", torch.float16, torch.float16, False),
    ("float32 += float16", torch.float32, torch.float16, False),
    ("float32 += float16.type(float32)", torch.float32, torch.float16, True),
]


def parser() -> cli.BenchmarkParser:
    return cli.base_parser(__doc__, resumes=False)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    store = result_store.ResultStore(PROBLEM, args.results_dir, force=True)  # cheap and exact: always re-run
    rows = []
    for name, accumulator, value, upcast in VARIANTS:
        total = accumulate(accumulator, value, upcast)
        # The float16 value nearest 0.01 is not 0.01: part of the error is in the summand itself.
        rows.append(store.add(
            dict(variant=name, accumulator=str(accumulator).removeprefix("torch."),
                 value=str(value).removeprefix("torch."), upcast=upcast),
            dict(result=total, error=total - 10.0, summand=float(torch.tensor(0.01, dtype=value).double())),
        ))
    cli.print_table(rows, ["variant", "result", "error", "summand"], digits=6)


if __name__ == "__main__":
    main()
