"""The Triton kernels through the Triton CPU interpreter, at small sizes: one check per test.

``tests/_pytest_plugin.py`` switches the interpreter on (``TRITON_INTERPRET=1``) on a machine without a CUDA GPU,
before any kernel module is imported. Where the kernels are compiled instead (a GPU, or ``TRITON_INTERPRET=0``) these
tests are skipped: the ``gpu`` tests beside the kernel test files check the same kernels on the GPU at full sizes.

float32 and float16 where a kernel multiplies with ``tl.dot``: the interpreter's ``tl.dot`` on bfloat16 is wrong.
The interpreter casts float32 to bfloat16 by truncation (a GPU rounds to nearest): bfloat16 tolerances here allow
one ulp where the GPU tests allow half of one.
"""

from __future__ import annotations

import numpy
import pytest

from tests._compiled_lane import kernels_interpreted

# Triton 3.6's interpreter fails on range() over runtime values with numpy >= 2.4 (the lock pins numpy < 2.4).
_NUMPY = tuple(int(part) for part in numpy.__version__.split(".")[:2])


@pytest.fixture(autouse=True)
def _needs_the_interpreter():
    if not kernels_interpreted():
        pytest.skip("the kernels are compiled here (TRITON_INTERPRET is not 1): the gpu tests check them")
    if _NUMPY >= (2, 4):
        pytest.skip(f"Triton 3.6's interpreter is broken with numpy {numpy.__version__} (>= 2.4)")
