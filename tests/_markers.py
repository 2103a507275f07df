"""pytest markers shared by several test files."""

from __future__ import annotations

import numpy
import pytest

# Triton 3.6's CPU interpreter fails on range() over runtime values with numpy >= 2.4. Our lock pins
# numpy < 2.4; GPU machines that run their own Python (numpy 2.5) test the kernels on the GPU instead.
needs_interpreter_numpy = pytest.mark.skipif(
    tuple(int(part) for part in numpy.__version__.split(".")[:2]) >= (2, 4),
    reason=f"Triton 3.6's interpreter is broken with numpy {numpy.__version__} (>= 2.4); the lock pins numpy < 2.4",
)
