"""The weighted-sum Triton kernels under the Triton CPU interpreter.

Not collected by a plain ``pytest`` run: ``tests/test_weighted_sum.py`` runs this file in a subprocess
with ``TRITON_INTERPRET=1`` (``@triton.jit`` reads it when the kernels are defined). By hand:
``TRITON_INTERPRET=1 python -m pytest tests/_flash_interpreter_weighted_sum.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 (see the module docstring)", allow_module_level=True)

from tests.test_weighted_sum import check_against_torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize(
    "shape, dtype",
    [((5, 7), torch.float32), ((3, 40, 33), torch.float32), ((64,), torch.float32), ((100, 300), torch.float16),
     ((70, 16), torch.bfloat16), ((33, 129), torch.float32)],
)
def test_matches_torch(shape, dtype):
    check_against_torch(shape, dtype, "cpu")


def test_non_contiguous_input_and_expanded_gradient():
    x = torch.randn(40, 20).t().requires_grad_()  # (20, 40), column-major
    check_against_torch(x.shape, torch.float32, "cpu", x=x, use_sum=True)
