"""Figures: matplotlib (Agg, no display) in one style, saved as PNG where the build asks."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

plt.rcParams.update(
    {
        "figure.dpi": 150,
        "savefig.dpi": 150,
        "font.size": 9,
        "axes.grid": True,
        "grid.alpha": 0.3,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "legend.frameon": False,
    }
)


def new(width: float = 6.5, height: float = 2.8, ncols: int = 1, sharey: bool = False, nrows: int = 1):
    """A figure ``width x height`` inches with ``nrows x ncols`` axes, returned row by row in one list."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), sharey=sharey, squeeze=False)
    return fig, list(axes.flat)


def save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not fig.legends:  # legend_below has laid the figure out already
        fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})  # no version tag: the same data give the same bytes
    plt.close(fig)
    return path


def short_count(value: float) -> str:
    """``16384 -> '16K'``, ``1048576 -> '1M'`` (powers of two, as lengths and sizes are)."""
    for unit, factor in (("M", 2**20), ("K", 2**10)):
        if value >= factor and value % factor == 0:
            return f"{value // factor:g}{unit}"
    return f"{value:g}"


def log2_axis(ax, values: list[int]) -> None:
    """A base-2 log x axis labelled with ``values`` (``1K``, ``16K``, ...)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(values)
    ax.set_xticklabels([short_count(v) for v in values])
    ax.minorticks_off()


def legend_below(fig, ax, ncol: int = 4) -> None:
    """One legend for the whole figure, under the axes (it never hides data)."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=7, bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.1, 1, 1))
