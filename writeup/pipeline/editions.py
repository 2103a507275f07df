"""The two editions of the handout the writeup answers, and what differs between them.

The rows keep canonical size keys (``small``, ``medium``, ``large``, ``xl`` = 1600-wide, ``2.7B`` = 2560-wide,
``10B`` = 4608-wide), so a configuration measured once serves both editions. An edition differs in

* the names of the sizes it prints (the 2026 handout calls the 2560-wide model "xl"; the 1600-wide one has no 2026
  name and is printed "xl (2025)"): :func:`size_name`;
* which rows of a results file its answers read (the 2026 handout profiles other sizes and contexts):
  :data:`ROWS`, applied by :class:`~pipeline.results.Results`, and :data:`REQUIRED`, the rows without which an
  answer cannot be written.

The build runs every section once per edition inside :func:`edition`; a section asks :func:`current` where it
prints something that differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from cs336_systems.bench.common import model_sizes

EDITIONS = ("2025", "2026")
DEFAULT = "2025"

# The sizes each handout's model table lists, as canonical keys, in its order (the tools' table of editions).
SIZES = {edition: tuple(model_sizes.edition_sizes(edition)) for edition in EDITIONS}

Row = dict[str, Any]

# Per edition and results file: which rows the edition's answers read (files not listed: every row).
ROWS: dict[str, dict[str, Callable[[Row], bool]]] = {
    "2025": {
        # The 2025 benchmark table has no 10B model.
        "benchmarking_script": lambda row: row.get("size") in SIZES["2025"],
        # The memory answers profile the 2.7B model up to context 512 (the 2026 handout's 2048 rows stay out), and
        # show the timelines of the latest recording, whose inference forward is at context 2048.
        "memory_profiling": lambda row: row.get("kind") == "timeline" or row.get("context_length", 0) <= 512,
    },
    "2026": {
        "benchmarking_script": lambda row: row.get("size") in SIZES["2026"],
        # Two sizes of one's choice at three power-of-two contexts above 128.
        "nsys_profile": lambda row: row.get("size") in ("small", "medium") and row.get("context_length") in (
            256, 512, 1024),
        # The 2026 xl (canonical 2.7B) at contexts 128 and 2048.
        "memory_profiling": lambda row: row.get("size") == "2.7B" and row.get("context_length") in (128, 2048),
    },
}

# Per edition and results file: (a test every answer needs some row to pass, what is missing otherwise).
REQUIRED: dict[str, dict[str, tuple[Callable[[Row], bool], str]]] = {
    "2026": {
        "memory_profiling": (lambda row: row.get("kind") == "peak" and row.get("context_length") == 2048,
                             "no peak rows of the 2.7B model (the 2026 xl) at context 2048"),
    },
}

_current: ContextVar[str] = ContextVar("edition", default=DEFAULT)


def current() -> str:
    """The edition being built ("2025" or "2026")."""
    return _current.get()


@contextlib.contextmanager
def edition(name: str) -> Iterator[str]:
    """Build inside this block as edition ``name``."""
    if name not in EDITIONS:
        raise ValueError(f"unknown edition {name!r}: expected one of {', '.join(EDITIONS)}")
    token = _current.set(name)
    try:
        yield name
    finally:
        _current.reset(token)


def size_name(key: str) -> str:
    """A canonical size key as the current edition names it; a size only the other edition names, by that name, with
    the edition where this one gives the name to another size ("xl (2025)" in 2026); unknown keys unchanged."""
    label = model_sizes.size_label(key, current())
    if label is not None:
        return label
    other = next(edition for edition in EDITIONS if edition != current())
    other_label = model_sizes.size_label(key, other)
    if other_label is None:
        return key
    return f"{other_label} ({other})" if other_label in model_sizes.EDITIONS[current()] else other_label


def size_names() -> dict[str, str]:
    """Every canonical key of either edition's table -> its name in the current edition (:func:`size_name`)."""
    keys = dict.fromkeys(key for edition in EDITIONS for key in model_sizes.EDITIONS[edition].values())
    return {key: size_name(key) for key in keys}


def keeps(problem: str, row: Row) -> bool:
    """Whether the current edition's answers read ``row`` of ``<problem>.jsonl``."""
    keep = ROWS.get(current(), {}).get(problem)
    return keep is None or keep(row)


def lacking(problem: str, rows: list[Row]) -> str | None:
    """What the current edition needs from ``<problem>.jsonl`` that ``rows`` lack, or None."""
    need = REQUIRED.get(current(), {}).get(problem)
    if need is None or any(need[0](row) for row in rows):
        return None
    return need[1]
