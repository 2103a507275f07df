"""What every benchmark command line shares: the common options, the device announcement, progress bars
and printed tables."""

from __future__ import annotations

import argparse
import logging
import math
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from cs336_systems.bench.common import model_sizes
from cs336_systems.bench.common.result_store import FIGURES_DIR, RESULTS_DIR, SCRATCH_DIR


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (counts of steps, tokens, sequences, ranks, sizes)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number of at least 0 (warm-up steps, say)."""
    return _int_at_least(text, 0)


def positive_pair(text: str, separator: str, form: str, example: str) -> tuple[int, int]:
    """Two whole numbers of at least 1 written ``A<separator>B`` (e.g. ``512:4``), for an argparse type; ``form``
    and ``example`` name them in the error (``"context:batch"``, ``"512:4"``)."""
    try:
        first, second = (int(part) for part in text.lower().split(separator))
    except ValueError:
        first = second = 0
    if first < 1 or second < 1:
        raise argparse.ArgumentTypeError(f"expected {form} of positive whole numbers, e.g. {example}, not {text!r}")
    return first, second


def positive_float(text: str) -> float:
    """An argparse type: a number above 0 (megabytes, milliseconds, seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text} must be above 0")
    return value


def existing_file(text: str) -> Path:
    """An argparse type: the path of a file that exists (a clear message, not a traceback, when it does not)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return path


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} must be at least {least}")
    return value


def add_edition(parser: argparse.ArgumentParser) -> None:
    """The ``--edition`` option: which course edition's size names ``--size``/``--sizes`` take (rows keep the
    canonical key in ``size`` and the edition's name in ``size_label``)."""
    names = "; ".join(f"{edition}: {' '.join(names)}" for edition, names in model_sizes.EDITIONS.items())
    parser.add_argument("--edition", choices=list(model_sizes.EDITIONS), default=model_sizes.DEFAULT_EDITION,
                        help=f"the course edition whose model sizes to use (default {model_sizes.DEFAULT_EDITION}; "
                             f"{names}; 2026's xl is 2025's 2.7B; tiny in both)")


def add_model_size(parser: argparse.ArgumentParser, multiple: bool, default: str) -> None:
    """``--edition`` and ``--sizes`` (``multiple``: one or more names) or ``--size`` (one name) in that edition's
    names; ``default`` says in the help what the tool measures without it."""
    add_edition(parser)
    if multiple:
        parser.add_argument("--sizes", nargs="+", default=None, metavar="SIZE",
                            help=f"model sizes, named as in --edition (default {default})")
    else:
        parser.add_argument("--size", default=None, metavar="SIZE",
                            help=f"model size, named as in --edition (default {default})")


class BenchmarkParser(argparse.ArgumentParser):
    """Parses a tool's options, then points ``results_dir`` (and ``figures_dir``, where the tool has one) at
    the git-ignored scratch folder when none was given and the run is a smoke run (``--quick``) or has no
    GPU: committed results come only from deliberate GPU runs. Where the tool takes ``--edition``, the size
    names of ``--size``/``--sizes`` become canonical keys (an unknown name exits with status 2).
    ``results_dir_given`` says afterwards whether the command line named ``--results-dir``."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        if hasattr(parsed, "edition"):
            self._resolve_sizes(parsed)
        scratch = getattr(parsed, "quick", False) or not torch.cuda.is_available()
        self.results_dir_given = getattr(parsed, "results_dir", None) is not None
        if getattr(parsed, "results_dir", "absent") is None:
            parsed.results_dir = SCRATCH_DIR / "results" if scratch else RESULTS_DIR
        if getattr(parsed, "figures_dir", "absent") is None:
            parsed.figures_dir = SCRATCH_DIR / "figures" if scratch else FIGURES_DIR
        return parsed, rest

    def _resolve_sizes(self, parsed: argparse.Namespace) -> None:
        for option in ("size", "sizes"):
            names = getattr(parsed, option, None)
            if names is None:
                continue
            try:
                if isinstance(names, list):
                    setattr(parsed, option, [model_sizes.canonical_size(n, parsed.edition) for n in names])
                else:
                    setattr(parsed, option, model_sizes.canonical_size(names, parsed.edition))
            except ValueError as error:
                self.error(f"argument --{option}: {error}")


def base_parser(description: str, resumes: bool = True) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes (``--force`` only where a re-run ``resumes``:
    skips what is already measured)."""
    parser = BenchmarkParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: the smallest configuration, few steps")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help=f"where rows go (default {RESULTS_DIR} on a GPU; {SCRATCH_DIR / 'results'} for --quick "
                             "runs and on machines without a GPU)")
    if resumes:
        parser.add_argument("--force", action="store_true", help="measure again configurations already in the results")
    return parser


def add_figures_dir(parser: argparse.ArgumentParser, what: str = "PNGs") -> None:
    """The ``--figures-dir`` option, resolved like ``--results-dir`` (see :class:`BenchmarkParser`)."""
    parser.add_argument("--figures-dir", type=Path, default=None,
                        help=f"where {what} go (default {FIGURES_DIR} on a GPU; {SCRATCH_DIR / 'figures'} for --quick "
                             "runs and on machines without a GPU)")


def start(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, torch.device, bool]:
    """A single-device tool's first lines: its options parsed, the device chosen and announced, and whether it runs
    the tiny configuration (``--quick``, or no GPU). Returns ``(args, device, tiny)``."""
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    announce(device, args.quick)
    return args, device, args.quick or device.type == "cpu"


def announce(device: torch.device, quick: bool) -> None:
    """Say on which machine the tool runs and whether it chose the tiny CPU configuration."""
    if device.type == "cuda":
        print(f"# device: {torch.cuda.get_device_name(device)} ({torch.cuda.device_count()} GPU(s))", file=sys.stderr)
    else:
        print("# device: CPU (no GPU found): running a tiny CPU configuration", file=sys.stderr)
        # torch.compile's CPU backend imports torch.utils.cpp_extension, which warns "No CUDA runtime is found"
        # wherever a CUDA toolkit is installed: true, said already, and no concern of a CPU run.
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    if quick:
        print("# --quick: smoke-test configuration", file=sys.stderr)


def progress(items: list, desc: str):
    """A tqdm progress bar over ``items`` (on stderr, so printed tables stay clean); ``.update()`` steps it."""
    from tqdm import tqdm

    # tqdm's default lock holds a multiprocessing semaphore, which a spawned rank never releases (Python warns of
    # "leaked semaphore objects" at exit); our bars live in one process each, so a thread lock does.
    tqdm.set_lock(threading.RLock())
    # Nothing to measure (all done, or nothing asked): no bar rather than an empty "0it" one.
    return tqdm(items, desc=desc, file=sys.stderr, dynamic_ncols=True, disable=not len(items))


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: numbers rounded, None and NaN as a dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(rows: list[dict[str, Any]], columns: list[str], digits: int = 2) -> None:
    """A plain fixed-width table of ``columns`` from ``rows`` on stdout."""
    cells = [[fmt(row.get(col), digits) for col in columns] for row in rows]
    widths = [max(len(col), *(len(c[i]) for c in cells)) if cells else len(col) for i, col in enumerate(columns)]
    print("  ".join(col.rjust(w) for col, w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))
