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
