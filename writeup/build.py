"""Build ``writeup/writeup.pdf`` from the benchmark results: ``uv run python writeup/build.py``.

1. Every section function (``pipeline/sections``) reads its rows from ``writeup/results/*.jsonl``, renders
   its figures into ``writeup/figures/`` and returns its tables and numbers.
2. All of it goes to ``<build-dir>/generated/data.json``, next to a copy of the Typst sources
   (``writeup.typ``, ``typ/``) and the figures; ``typ/lib.typ`` reads the JSON.
3. The ``typst`` Python package typesets ``<build-dir>/writeup.typ`` into the PDF, in-process.

A results file a section needs that does not exist stops the build, naming every missing file, before
anything is typeset. ``--allow-missing`` (development only) renders a "MISSING: <file>" box instead; the
committed PDF is never built with it.

Examples::

    uv run python writeup/build.py
    uv run python writeup/build.py --allow-missing --pages-png /tmp/pages      # draft, and pages as PNG
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # `pipeline` sits beside this script

import typst
from pipeline.results import Missing, Results, environment_line
from pipeline.sections import SECTIONS, Output

TYPST_SOURCES = ["writeup.typ", "typ"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=HERE / "results", help="where the rows are (default %(default)s)")
    p.add_argument("--figures-dir", type=Path, default=HERE / "figures", help="where figures go (default %(default)s)")
    p.add_argument("--build-dir", type=Path, default=HERE / "build",
                   help="staging directory for Typst: sources, generated data, figures (default %(default)s)")
    p.add_argument("--output", type=Path, default=HERE / "writeup.pdf", help="the PDF (default %(default)s)")
    p.add_argument("--allow-missing", action="store_true",
                   help="development only: render a MISSING box for sections whose results do not exist")
    p.add_argument("--pages-png", type=Path, default=None, help="also render every page as PNG into this directory")
    p.add_argument("--ppi", type=float, default=110, help="resolution of --pages-png (default %(default)s)")
    return p


def collect(results: Results, out: Output) -> tuple[dict[str, dict], dict[str, Missing]]:
    """Run every section; returns the data of each and the ``Missing`` of those that could not be built."""
    data: dict[str, dict] = {}
    missing: dict[str, Missing] = {}
    for name, section in SECTIONS.items():
        try:
            data[name] = section(results, out)
            env = environment_line(results.take_used())
            if env:
                data[name]["env"] = env
        except Missing as error:
            results.take_used()
            missing[name] = error
            data[name] = {"missing": str(error)}
        except KeyError as error:
            missing_column = results.missing_column(error.args[0] if error.args else None)
            results.take_used()
            if missing_column is None:
                raise _section_failed(name, results, error) from error
            missing[name] = missing_column
            data[name] = {"missing": str(missing_column)}
        except (TypeError, ValueError, ZeroDivisionError) as error:
            raise _section_failed(name, results, error) from error
    return data, missing


def _section_failed(name: str, results: Results, error: Exception) -> RuntimeError:
    """Most likely a results file whose keys changed: say which section (the traceback stays chained)."""
    return RuntimeError(f"section {name!r} failed on its results in {results.results_dir}: {error!r} "
                        f"(its loader is in pipeline/sections/)")


def stage_sources(build_dir: Path) -> None:
    for name in TYPST_SOURCES:
        source, target = HERE / name, build_dir / name
        if source.is_dir():
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(source, target)
        else:
            shutil.copyfile(source, target)


def build(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    build_dir = args.build_dir
    shutil.rmtree(build_dir / "figures", ignore_errors=True)
    (build_dir / "generated").mkdir(parents=True, exist_ok=True)
    data, missing = collect(Results(args.results_dir), Output(args.figures_dir, build_dir))
    if missing and not args.allow_missing:
        files = {}
        for name, error in missing.items():
            files.setdefault(str(error), []).append(name)
        lines = [f"  {what}  (needed by: {', '.join(names)})" for what, names in files.items()]
        print("build failed: missing results (a file, or a column its rows lack)\n" + "\n".join(lines), file=sys.stderr)
        print("Run the benchmarks that write them (README), or pass --allow-missing for a draft.", file=sys.stderr)
        return 1
    document = {"sections": data, "allow_missing": bool(missing)}
    (build_dir / "generated" / "data.json").write_text(json.dumps(document, indent=1, sort_keys=True))
    stage_sources(build_dir)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    # Only Typst's embedded fonts: the PDF looks the same on every machine.
    _, warnings = typst.compile_with_warnings(str(build_dir / "writeup.typ"), output=str(args.output),
                                              root=str(build_dir), ignore_system_fonts=True)
    for warning in warnings:
        print(f"typst warning: {warning}", file=sys.stderr)
    if args.pages_png:
        args.pages_png.mkdir(parents=True, exist_ok=True)
        for old in args.pages_png.glob("page-*.png"):
            old.unlink()
        typst.compile(str(build_dir / "writeup.typ"), output=str(args.pages_png / "page-{0p}.png"),
                      root=str(build_dir), ignore_system_fonts=True, ppi=args.ppi)
    for name, error in missing.items():
        print(f"warning: section {name}: MISSING {error}", file=sys.stderr)
    print(f"wrote {args.output} ({len(SECTIONS) - len(missing)} of {len(SECTIONS)} sections from results) "
          f"in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return build(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
