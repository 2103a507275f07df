"""Reading the numbers back out of the writeup's generated phrases, so that tests check what a phrase says (its
numbers, from the rows) and not how it is worded."""

from __future__ import annotations

import re

# A number as the writeup prints it: thousands separated by commas, an optional decimal part and exponent, a minus
# sign (ASCII or U+2212) only where no word or number comes right before it (2026-11-22 is three positive numbers).
# Digits touching a letter belong to a name (fp32, H100, cs336_basics, 2x, 2.7B) and are not numbers.
_NUMBER = re.compile(r"(?:(?<![\w.,])[−-])?(?<![A-Za-z_\d.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[+-]?\d+)?"
                     r"(?![A-Za-z_\d]|\.\d)")


def numbers_in(text: str) -> list[float]:
    """Every number written in ``text``, in order: ``"at 16,384 × 1,600, 1.05×; −8.3 %"`` -> [16384, 1600, 1.05,
    -8.3]."""
    return [float(m.group(0).replace(",", "").replace("−", "-")) for m in _NUMBER.finditer(text)]


def printed_range(lo: float, hi: float, digits: int) -> list[float]:
    """The numbers a range from ``lo`` to ``hi`` prints at ``digits`` decimals: one where both ends print the same."""
    ends = [round(lo, digits), round(hi, digits)]
    return ends[:1] if ends[0] == ends[1] else ends


def item_about(items: list[str], *labels: str) -> str:
    """The one item of a generated list whose lead (before its first colon) is ``labels`` joined by spaces, e.g.
    ``item_about(items, "bf16", "forward")`` for the item on bf16's forward."""
    (found,) = [item for item in items if item.split(":")[0].split() == " ".join(labels).split()]
    return found
