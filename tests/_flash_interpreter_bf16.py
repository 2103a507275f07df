"""bfloat16 attention under the Triton CPU interpreter, whose ``tl.dot`` multiplies the raw bits of bfloat16
values: the Triton backend runs bfloat16 inputs there in float32 and rounds the results back, so the operator is
right (run by ``tests/test_flash_attention_triton.py::test_bfloat16_under_interpreter`` in a subprocess with
``TRITON_INTERPRET=1``; by hand: ``TRITON_INTERPRET=1 python -m pytest tests/_flash_interpreter_bf16.py``)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs under TRITON_INTERPRET=1 (see the module docstring)", allow_module_level=True)

from cs336_systems.attention.op import FlashAttention2Triton
from cs336_systems.kernels.launch import poisoned_outputs
from tests._flash_checks import QUANTITIES, make_qkv, relative_error, run_function, run_reference

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("batch, heads, n_queries, n_keys, is_causal", [(1, None, 64, 64, True), (1, 2, 33, 70, False)])
def test_bfloat16_matches_sdpa_and_float64(batch, heads, n_queries, n_keys, is_causal):
    torch.manual_seed(0)
    Q, K, V = make_qkv(batch, heads, n_queries, n_keys, 32, torch.bfloat16, "cpu")
    with poisoned_outputs():
        output = FlashAttention2Triton.apply(Q, K, V, is_causal)
    assert output.dtype == torch.bfloat16
    sdpa = torch.nn.functional.scaled_dot_product_attention(Q.float(), K.float(), V.float(), is_causal=is_causal)
    assert (output.float() - sdpa).abs().max().item() < 2e-2
    dO = torch.randn(Q.shape).to(torch.bfloat16)
    with poisoned_outputs():
        result = run_function(FlashAttention2Triton, Q, K, V, is_causal, dO)
    reference = run_reference(Q, K, V, is_causal, dO)
    for name in QUANTITIES:
        expected_dtype = torch.float32 if name == "L" else torch.bfloat16
        assert result[name].dtype == expected_dtype, name
        assert relative_error(result[name], reference[name]) < 1e-2, name
