"""Numbers as the writeup prints them, and tables as data.

A table travels to Typst as a dict (``header`` rows, body ``rows`` of strings, ``align``, ``caption``), and
``typ/lib.typ``'s ``gtable`` typesets it: every cell is plain text, so nothing needs escaping, and no
table is ever typed by hand.
"""

from __future__ import annotations

import math
from typing import Any

DASH = "–"


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def num(x: Any, digits: int = 1) -> str:
    """``x`` rounded to ``digits`` decimals with thousands separators; a dash for None/NaN."""
    if not is_number(x):
        return DASH if x is None or isinstance(x, float) else str(x)
    return f"{x:,.{digits}f}"


def sig(x: Any, figures: int = 3) -> str:
    """``x`` to ``figures`` significant figures (no exponent for ordinary magnitudes)."""
    if not is_number(x):
        return DASH
    if x == 0:
        return "0"
    digits = max(0, figures - 1 - math.floor(math.log10(abs(x))))
    return num(x, digits)


def sci(x: Any, digits: int = 2) -> str:
    """``x`` as ``1.23e-04``."""
    return f"{x:.{digits}e}" if is_number(x) else DASH


def sci_parts(x: float, digits: int = 2) -> tuple[str, str]:
    """``x`` as mantissa and exponent strings, for ``m × 10^e`` in math: ``2.2e11 -> ('2.20', '11')``."""
    mantissa, exponent = f"{x:.{digits}e}".split("e")
    return mantissa, str(int(exponent))


def pm(mean: Any, std: Any, digits: int = 1) -> str:
    """``mean ± std``."""
    if not is_number(mean):
        return DASH
    return f"{num(mean, digits)} ± {num(std, digits)}" if is_number(std) else num(mean, digits)


def pct(x: Any, digits: int = 0) -> str:
    """A fraction as a percentage: ``0.718 -> '72 %'``."""
    return f"{num(100 * x, digits)} %" if is_number(x) else DASH


def times(x: Any, digits: int = 2) -> str:
    """A ratio: ``'1.45×'``."""
    return f"{num(x, digits)}×" if is_number(x) else DASH


def spread(lo: Any, hi: Any, fmt=times) -> str:
    """``'1.2× to 3.4×'``, or one value when both ends print the same."""
    a, b = fmt(lo), fmt(hi)
    return a if a == b else f"{a} to {b}"


def gb(x: Any, digits: int = 1) -> str:
    return f"{num(x, digits)} GB" if is_number(x) else DASH


def table(
    header: list[str] | list[list[Any]],
    rows: list[list[Any]],
    caption: str,
    align: list[str] | str | None = None,
    size: float | None = None,
) -> dict[str, Any]:
    """A table for ``gtable``: ``header`` is one row of labels, or several rows whose cells may be
    ``{"text": ..., "colspan": n}``; ``align`` per column (``"left"``/``"right"``/``"center"``), default:
    first column left, the others right; ``size`` a font size in points for wide tables."""
    header_rows = header if header and isinstance(header[0], list) else [header]
    n_columns = sum(cell.get("colspan", 1) if isinstance(cell, dict) else 1 for cell in header_rows[-1])
    if isinstance(align, str):
        align = [align] * n_columns
    align = align or ["left"] + ["right"] * (n_columns - 1)
    body = [[cell if isinstance(cell, str) else num(cell) for cell in row] for row in rows]
    for row in body:
        if len(row) != n_columns:
            raise ValueError(f"table {caption!r}: a row has {len(row)} cells, the header {n_columns}")
    return {"header": header_rows, "rows": body, "align": align, "caption": caption, "size": size}


def span(text: str, colspan: int) -> dict[str, Any]:
    """A header cell spanning ``colspan`` columns."""
    return {"text": text, "colspan": colspan}


def short_kernel(name: str, width: int = 60) -> str:
    """A CUDA kernel name shortened for a table: templates and argument lists dropped."""
    name = name.removeprefix("void ")
    for cut in ("<", "("):
        if cut in name and name.index(cut) > 8:
            name = name[: name.index(cut)]
    return name if len(name) <= width else name[: width - 1] + "…"


def join_words(words: list[str]) -> str:
    """``'a, b and c'``."""
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + " and " + words[-1]
