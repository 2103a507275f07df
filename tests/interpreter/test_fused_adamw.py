"""The fused AdamW Triton kernel under the Triton CPU interpreter, at small sizes (see ``conftest.py``).

Under the interpreter ``BLOCK`` is 256, so the larger test tensors span several blocks and end in a partial one.
"""

from __future__ import annotations

import pytest
import torch

from cs336_systems.kernels import adamw
from cs336_systems.kernels.adamw import FusedAdamW, fused_adamw_
from cs336_systems.kernels.launch import interpreting
from tests import test_fused_adamw
from tests.test_fused_adamw import (
    SHAPES,
    check_bfloat16_state_dict_keeps_float32_moments,
    check_float32_against_basics,
    check_low_precision_against_float64,
    check_master_weights_train_like_float32,
    check_state_dict_round_trip,
)

pytestmark = [
    # eps = 0: the interpreter computes masked-off lanes too, as 0 / 0, and never stores them.
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
]


def round_like_the_interpreter(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The interpreter casts float32 to bfloat16 by truncation (a GPU rounds to nearest), float16 to nearest."""
    x = x.float()
    if dtype == torch.bfloat16:
        x = (x.view(torch.int32) & -65536).view(torch.float32)
    return x.to(dtype).double()


@pytest.fixture(autouse=True)
def _interpreter_rounding(monkeypatch):
    monkeypatch.setattr(test_fused_adamw, "ROUND", round_like_the_interpreter)


def test_running_in_interpreter():
    assert interpreting() and adamw.BLOCK < 4097


def test_float32_matches_basics():
    check_float32_against_basics(SHAPES, "cpu")


@pytest.mark.parametrize("dtype, grad_dtype", [(torch.bfloat16, None), (torch.float16, None),
                                                (torch.bfloat16, torch.float32)])
def test_low_precision_matches_float64(dtype, grad_dtype):
    check_low_precision_against_float64(SHAPES[:5], dtype, "cpu", grad_dtype, steps=10)


def test_state_dict_round_trip_with_basics():
    check_state_dict_round_trip(SHAPES, "cpu")


def test_bfloat16_state_dict_keeps_float32_moments():
    check_bfloat16_state_dict_keeps_float32_moments("cpu")


def test_closure_and_table_cache():
    """``step(closure)`` returns the closure's loss; the tables are rebuilt only when addresses change."""
    p = torch.randn(300, requires_grad=True)
    optimizer = FusedAdamW([p])

    def closure():
        optimizer.zero_grad(set_to_none=False)
        loss = (p * p).sum()
        loss.backward()
        return loss

    losses = [optimizer.step(closure).item() for _ in range(3)]
    assert losses[2] < losses[0]
    assert optimizer._tables.misses == 1
    p.grad = p.grad.clone()  # a new address
    optimizer.step()
    assert optimizer._tables.misses == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_train_like_float32(dtype):
    check_master_weights_train_like_float32(SHAPES, dtype, "cpu")


def test_non_contiguous_param_raises():
    p = torch.randn(4, 6).t()
    p.grad = torch.randn(6, 4)
    optimizer = FusedAdamW([p])
    with pytest.raises(ValueError, match="not contiguous"):
        optimizer.step()
    assert optimizer.state[p]["step"] == 0


def test_non_contiguous_grad_is_copied():
    p = torch.randn(6, 4)
    q = p.clone()
    grad = torch.randn(4, 6)
    p.grad = grad.t()  # the same values, transposed layout
    q.grad = grad.t().contiguous()
    FusedAdamW([p]).step()
    FusedAdamW([q]).step()
    assert torch.equal(p, q)


def test_functional_checks():
    p, g, m, v = torch.zeros(5), torch.zeros(5), torch.zeros(5), torch.zeros(5)
    hyper = dict(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="float32"):
        fused_adamw_([p], [g], [m.double()], [v], **hyper)
    with pytest.raises(ValueError, match="shape"):
        fused_adamw_([p], [torch.zeros(6)], [m], [v], **hyper)
    with pytest.raises(TypeError, match="one parameter dtype"):
        fused_adamw_([p, p.bfloat16()], [g, g], [m, m], [v, v], **hyper)
    with pytest.raises(TypeError, match="unsupported parameter dtype"):
        fused_adamw_([p.double()], [g.double()], [m], [v], **hyper)
    with pytest.raises(ValueError, match="one gradient and two moments"):
        fused_adamw_([p], [], [m], [v], **hyper)
