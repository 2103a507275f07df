"""The section registry and what a section function gets to work with.

A section is a function ``fn(res, out) -> dict`` registered under the problem's name with
:func:`problem`. It reads rows through ``res`` (:class:`~pipeline.results.Results`, which raises
:class:`~pipeline.results.Missing` naming an absent file), renders figures through ``out``
(:class:`Output`), and returns what its Typst section reads: ``tables``, ``figures`` and formatted
numbers and phrases (by convention under ``n``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline import figures
from pipeline.results import REPO_ROOT, Missing

MAX_HEIGHT_OVER_TEXT_WIDTH = 0.6  # a figure as wide as the text is at most 0.6 text widths tall

SectionFn = Callable[["Any", "Output"], dict[str, Any]]
SECTIONS: dict[str, SectionFn] = {}


def problem(name: str) -> Callable[[SectionFn], SectionFn]:
    """Register the decorated function as the section titled ``name``."""

    def register(fn: SectionFn) -> SectionFn:
        if name in SECTIONS:
            raise ValueError(f"section {name!r} registered twice")
        SECTIONS[name] = fn
        return fn

    return register


class Output:
    """Where a section's figures go: rendered into ``figures_dir`` and staged for Typst under ``build_dir``.

    ``render_dir`` replaces ``figures_dir`` for the figures the build renders (not those a benchmark rendered): an
    edition other than the committed figures' renders its own (its size names) into its build directory.
    """

    def __init__(self, figures_dir: Path, build_dir: Path, render_dir: Path | None = None):
        self.figures_dir = Path(figures_dir)
        self.build_dir = Path(build_dir)
        self.render_dir = Path(render_dir) if render_dir is not None else self.figures_dir

    @staticmethod
    def _width(source: Path) -> str:
        """The figure's width as a share of the text width, so that tall pictures stay under ~40 % of the page."""
        from PIL import Image

        with Image.open(source) as image:
            width, height = image.size
        return f"{min(100, round(100 * MAX_HEIGHT_OVER_TEXT_WIDTH * width / height))}%"

    def _stage(self, source: Path) -> str:
        target = self.build_dir / "figures" / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.resolve() != target.resolve():
            shutil.copyfile(source, target)
        return f"figures/{source.name}"

    def save(self, fig, name: str, caption: str) -> dict[str, str]:
        """Save a matplotlib figure as ``<render_dir>/<name>.png``; returns its entry for ``figures``."""
        path = figures.save(fig, self.render_dir / f"{name}.png")
        return {"path": self._stage(path), "caption": caption, "width": self._width(path)}

    def existing(self, path: str | Path, caption: str, why: str = "") -> dict[str, str]:
        """A figure a benchmark rendered itself (a path relative to the repository, or absolute)."""
        source = Path(path)
        if not source.is_absolute():
            source = REPO_ROOT / source
        if not source.exists():  # a path on the GPU machine: the same file name under the figures directory
            local = self.figures_dir / source.name
            if local.exists():
                source = local
        if not source.exists():
            raise Missing(path, why or "a figure named by a results row")
        return {"path": self._stage(source), "caption": caption, "width": self._width(source)}
