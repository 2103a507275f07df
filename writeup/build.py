"""Build the writeup from the benchmark results, in two editions: ``uv run python writeup/build.py``.

``writeup/writeup.pdf`` answers the 2025 handout, ``writeup/writeup_2026.pdf`` the 2026 one (its problems, parts
and model-size names); what both ask is measured once and shown in both. For each edition:

1. Every section function (``pipeline/sections``) runs inside ``pipeline.editions.edition(...)``: it reads the rows
   that edition's answers need from ``writeup/results/*.jsonl``, renders its figures and returns its tables and
   numbers.
2. All of it goes to ``<build-dir>/generated/data.json`` (the 2026 edition: ``<build-dir>/2026/``), next to a copy
   of the Typst sources (``writeup*.typ``, ``typ/``) and the figures; ``typ/lib.typ`` reads the JSON.
3. The ``typst`` Python package typesets ``writeup.typ`` or ``writeup_2026.typ`` into the PDF, in-process.

A results file a section needs that does not exist (or lacks the rows an edition needs, or a part's rows) stops the
build, naming every missing file, before anything is typeset. ``--allow-missing`` (development only) renders a
"MISSING: <file>" box instead; the committed PDFs are never built with it.

Examples::

    uv run python writeup/build.py                       # both editions
    uv run python writeup/build.py --edition 2026        # writeup/writeup_2026.pdf only
    uv run python writeup/build.py --allow-missing --pages-png /tmp/pages      # drafts, and pages as PNG
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
from pipeline import editions
from pipeline.results import Missing, Results, environment_line
from pipeline.sections import SECTIONS, Output

TYPST_SOURCES = ["writeup.typ", "writeup_2026.typ", "typ"]
DOCUMENTS = {"2025": "writeup.typ", "2026": "writeup_2026.typ"}
# Typst files an edition includes only where they exist (written by another part of the project): while one is
# absent, that edition's build says so like a missing results file.
OPTIONAL_INCLUDES = {"2026": {"parallelism": ("typ/parallelism.typ", "the parallelism calculations (section 8)")}}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--edition", choices=editions.EDITIONS, default=None,
                   help="build only this edition's PDF (default: both)")
    p.add_argument("--results-dir", type=Path, default=HERE / "results", help="where the rows are (default %(default)s)")
    p.add_argument("--figures-dir", type=Path, default=HERE / "figures", help="where figures go (default %(default)s)")
    p.add_argument("--build-dir", type=Path, default=HERE / "build",
                   help="staging directory for Typst: sources, generated data, figures (default %(default)s; the "
                        "2026 edition in its 2026/ subdirectory)")
    p.add_argument("--output", type=Path, default=HERE / "writeup.pdf",
                   help="the 2025 edition's PDF (default %(default)s); the 2026 edition's goes beside it, its name "
                        "ending in _2026 (writeup_2026.pdf), unless --output-2026 is given")
    p.add_argument("--output-2026", type=Path, default=None, help="the 2026 edition's PDF")
    p.add_argument("--allow-missing", action="store_true",
                   help="development only: render a MISSING box for sections whose results do not exist")
    p.add_argument("--pages-png", type=Path, default=None,
                   help="also render every page as PNG into DIR/<edition>/ (page-01.png, ...)")
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
            # A part whose rows do not exist yet: the rest of the section stands, the part shows MISSING.
            for part, why in data[name].get("missing_parts", {}).items():
                missing[f"{name} ({part})"] = why
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


class Edition:
    """One edition's build: its directory, its PDF, its generated data and what it misses."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name = name
        self.build_dir = args.build_dir if name == "2025" else args.build_dir / name
        default_output = args.output.with_name(f"{args.output.stem}_{name}{args.output.suffix}")
        self.output = args.output if name == "2025" else (args.output_2026 or default_output)
        self.data: dict[str, dict] = {}
        self.missing: dict[str, Missing | str] = {}
        self.includes: dict[str, bool] = {}

    def collect(self, args: argparse.Namespace) -> None:
        shutil.rmtree(self.build_dir / "figures", ignore_errors=True)
        (self.build_dir / "generated").mkdir(parents=True, exist_ok=True)
        # The committed figures are the 2025 edition's; another edition renders its own into its build directory.
        render_dir = None if self.name == "2025" else self.build_dir / "figures"
        with editions.edition(self.name):
            self.data, self.missing = collect(Results(args.results_dir), Output(args.figures_dir, self.build_dir,
                                                                                render_dir))
        for key, (path, what) in OPTIONAL_INCLUDES.get(self.name, {}).items():
            self.includes[key] = (HERE / path).exists()
            if not self.includes[key]:
                self.missing[key] = f"writeup/{path} ({what}, included by {DOCUMENTS[self.name]})"

    def typeset(self, args: argparse.Namespace) -> None:
        with editions.edition(self.name):
            size_names = editions.size_names()
        document = {"edition": self.name, "size_names": size_names, "sections": self.data,
                    "allow_missing": bool(self.missing), "includes": self.includes}
        (self.build_dir / "generated" / "data.json").write_text(json.dumps(document, indent=1, sort_keys=True))
        stage_sources(self.build_dir)
        source = str(self.build_dir / DOCUMENTS[self.name])
        self.output.parent.mkdir(parents=True, exist_ok=True)
        # Only Typst's embedded fonts: the PDF looks the same on every machine.
        _, warnings = typst.compile_with_warnings(source, output=str(self.output), root=str(self.build_dir),
                                                  ignore_system_fonts=True)
        for warning in warnings:
            print(f"typst warning ({self.name}): {warning}", file=sys.stderr)
        if args.pages_png:
            pages = args.pages_png / self.name
            pages.mkdir(parents=True, exist_ok=True)
            for old in pages.glob("page-*.png"):
                old.unlink()
            typst.compile(source, output=str(pages / "page-{0p}.png"), root=str(self.build_dir),
                          ignore_system_fonts=True, ppi=args.ppi)


def build(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    built = [Edition(name, args) for name in ([args.edition] if args.edition else editions.EDITIONS)]
    for edition in built:
        edition.collect(args)
    if any(edition.missing for edition in built) and not args.allow_missing:
        lines = []
        for edition in built:
            files: dict[str, list[str]] = {}
            for name, error in edition.missing.items():
                files.setdefault(str(error), []).append(name)
            lines += [f"  [{edition.name}] {what}  (needed by: {', '.join(names)})" for what, names in files.items()]
        print("build failed: missing results (a file, or a column its rows lack)\n" + "\n".join(lines), file=sys.stderr)
        print("Run the benchmarks that write them (README), or pass --allow-missing for a draft.", file=sys.stderr)
        return 1
    for edition in built:
        edition.typeset(args)
        for name, error in edition.missing.items():
            print(f"warning: {edition.name} edition, section {name}: MISSING {error}", file=sys.stderr)
        whole = sum("missing" not in section for section in edition.data.values())
        print(f"wrote {edition.output} ({whole} of {len(SECTIONS)} sections from results)", file=sys.stderr)
    print(f"built in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return build(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
