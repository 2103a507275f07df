"""The weighted-sum Triton kernels under the Triton CPU interpreter (see ``conftest.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.test_weighted_sum import check_against_torch


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
