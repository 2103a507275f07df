"""The GPU error grid of our attention operator: the cases, one measurement per case (relative errors of O, L and
the gradients against float64, beside plain PyTorch's at the same precision), the bound a case must meet, and the
summary per precision. ``tests/test_flash_attention_triton.py`` asserts the bounds case by case;
``scripts/flash_error_grid.py`` measures the same cases and writes the file the writeup reads.

Error bound: the relative error ||out - ref|| / ||ref|| against float64 must be below a floor per precision, or
below 3x the error of plain PyTorch attention computed at the same precision on the same inputs (whichever is
larger). For "tf32" the floor decides: cuBLAS need not pick TF32 kernels for PyTorch's small matmuls, so PyTorch's
own error there can be that of full float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

from cs336_systems.attention.config import FLASH_CONFIG, FlashConfig
from cs336_systems.attention.backends.common import POWER_OF_TWO_HEAD_DIMS
from cs336_systems.attention.op import FlashAttention2Triton
from cs336_systems.kernels.launch import poisoned_outputs
from tests._flash_checks import QUANTITIES, make_qkv, relative_error, run_function, run_reference

# Relative-error floors per precision; "tf32" is float32 inputs with torch.backends.cuda.matmul.allow_tf32.
ERROR_FLOOR = {"fp32": 1e-4, "tf32": 5e-3, "fp16": 5e-3, "bf16": 2e-2}
TORCH_ERROR_FACTOR = 3.0
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ERRORS_FILE_NAME = "flash_attention_triton_errors.json"


class Case(NamedTuple):
    precision: str
    batch: int
    heads: int | None
    n_queries: int
    n_keys: int
    d: int
    is_causal: bool


def grid() -> list[Case]:
    """18 length pairs per dtype, head dims and causality rotating so that every dtype sees every head dim, causal or
    not, and four TF32 cases."""
    length_pairs = [
        (1, 1), (17, 17), (100, 100), (129, 129), (1000, 1000), (16, 16), (64, 64), (128, 128), (256, 256),
        (512, 512), (1024, 1024), (2048, 2048), (4096, 4096), (100, 129), (129, 100), (1, 1000), (1000, 17),
        (17, 4096),
    ]
    cases = []
    for p, precision in enumerate(("fp32", "fp16", "bf16")):
        for i, (n_queries, n_keys) in enumerate(length_pairs):
            d = POWER_OF_TWO_HEAD_DIMS[i % 4]
            is_causal = (i + p) % 2 == 0
            long = max(n_queries, n_keys) >= 2048
            batch, heads = (1, 2) if long else ((3, None) if i % 3 == 0 else (2, 3))
            cases.append(Case(precision, batch, heads, n_queries, n_keys, d, is_causal))
    cases += [
        Case("tf32", 2, 3, 128, 128, 64, True),
        Case("tf32", 1, 2, 1000, 1000, 128, False),
        Case("tf32", 3, None, 100, 129, 32, True),
        Case("tf32", 1, 2, 4096, 4096, 16, True),
    ]
    return cases


def sixteen_bit_grid() -> list[Case]:
    """The 16-bit cases, which the Hopper kernels can run."""
    return [case for case in grid() if case.precision in ("fp16", "bf16")]


def awkward_grid() -> list[Case]:
    """One awkward case (unequal or ragged lengths, or long) per precision and head dim."""
    picks = {(case.precision, case.d): case for case in grid()
             if case.n_queries != case.n_keys or case.n_queries % 128 or case.n_queries >= 2048}
    return sorted(picks.values(), key=str)


# The grid's groups: the kernels each runs with, and its cases.
GROUPS = {"auto": grid, "hopper": sixteen_bit_grid, "triton": awkward_grid}


@contextlib.contextmanager
def matmul_tf32(enabled: bool) -> Iterator[None]:
    # Not monkeypatch: torch.backends.cuda.matmul is a module proxy whose attributes it cannot restore.
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def measure(case: Case, kernels: str = "auto") -> dict:
    """The record of one case run with ``FlashConfig(kernels=kernels)`` (fixed tiles) on NaN-poisoned outputs: the
    relative errors per quantity, PyTorch's own at this precision, the maximum absolute errors, and the dtypes and
    finiteness the checks need."""
    dtype = DTYPES[case.precision]
    with FLASH_CONFIG.use(FlashConfig(kernels=kernels)), poisoned_outputs(), matmul_tf32(case.precision == "tf32"):
        Q, K, V = make_qkv(case.batch, case.heads, case.n_queries, case.n_keys, case.d, dtype, "cuda")
        dO = torch.randn(Q.shape, device="cuda").to(dtype)
        result = run_function(FlashAttention2Triton, Q, K, V, case.is_causal, dO)
        reference = run_reference(Q, K, V, case.is_causal, dO)
        torch_result = run_reference(Q, K, V, case.is_causal, dO, dtype=dtype)  # plain PyTorch at this precision
    record = dict(case._asdict(), errors={}, torch_errors={}, max_abs_errors={}, dtypes={}, non_finite={},
                  grader_close={})
    for name in QUANTITIES:
        value = result[name]
        record["dtypes"][name] = str(value.dtype)
        record["non_finite"][name] = int((~torch.isfinite(value)).sum().item())
        record["errors"][name] = relative_error(value, reference[name])
        record["torch_errors"][name] = relative_error(torch_result[name], reference[name])
        record["max_abs_errors"][name] = (value.double() - reference[name]).abs().max().item()
        record["grader_close"][name] = torch.allclose(value.double(), reference[name], rtol=1e-2, atol=1e-2)
    return record


def failures(record: dict) -> list[str]:
    """What in ``record`` breaks its bounds (empty when nothing does)."""
    found = []
    dtype = DTYPES[record["precision"]]
    for name in QUANTITIES:
        expected_dtype = torch.float32 if name == "L" else dtype
        if record["dtypes"][name] != str(expected_dtype):
            found.append(f"{name}: dtype {record['dtypes'][name]}, expected {expected_dtype}")
        if record["non_finite"][name]:
            found.append(f"{name}: {record['non_finite'][name]} non-finite elements")
        error, torch_error = record["errors"][name], record["torch_errors"][name]
        bound = max(ERROR_FLOOR[record["precision"]], TORCH_ERROR_FACTOR * torch_error)
        if error > bound:
            found.append(f"{name}: relative error {error:.2e} > bound {bound:.2e} (PyTorch's own {torch_error:.2e})")
        # The grader's criterion (bf16 rounding alone can reach it).
        if record["precision"] != "bf16" and not record["grader_close"][name]:
            found.append(f"{name}: not within the grader's rtol = atol = 1e-2 of float64")
    return found


CHECK_KEYS = ("dtypes", "non_finite", "grader_close")
"""What a record holds for :func:`failures` only (not written to the errors file)."""


def measure_autotuned(head_dim: int) -> dict:
    """A note record: the autotuned Triton kernels (bf16, causal, 2 x 4 x 1024) against float64, and the
    configurations the autotuners chose."""
    from cs336_systems.attention.backends import triton as triton_backend

    Q, K, V = make_qkv(2, 4, 1024, 1024, head_dim, torch.bfloat16, "cuda")
    dO = torch.randn(Q.shape, device="cuda").to(torch.bfloat16)
    with FLASH_CONFIG.use(kernels="triton", autotune=True), poisoned_outputs():
        result = run_function(FlashAttention2Triton, Q, K, V, True, dO)
    reference = run_reference(Q, K, V, True, dO)
    chosen = {f"{name} d={head_dim}": str(kernel.autotuner.best_config)
              for name, kernel in triton_backend.KERNELS.items()
              if getattr(kernel.autotuner, "best_config", None) is not None}
    return dict(precision="bf16", note="autotuned", chosen_configs=chosen,
                errors={name: relative_error(result[name], reference[name]) for name in QUANTITIES},
                non_finite={name: int((~torch.isfinite(result[name])).sum().item()) for name in QUANTITIES})


def measure_leaderboard_shape(timed: bool) -> dict:
    """A note record: 16 x 16384 x 64, bf16, causal, against PyTorch's fused attention in float32 (too large for a
    materialised float64 reference); with ``timed``, also forward + backward times of ours and of SDPA (ms)."""
    import torch.nn.functional as F
    import triton

    Q, K, V = make_qkv(16, None, 16384, 16384, 64, torch.bfloat16, "cuda")
    dO = torch.randn(Q.shape, device="cuda").to(torch.bfloat16)
    with FLASH_CONFIG.use(FlashConfig()), poisoned_outputs():
        result = run_function(FlashAttention2Triton, Q, K, V, True, dO)
    # 4-D views (1, 16, seq, d): with 3-D inputs SDPA would fall back to its materialising math backend.
    q32, k32, v32 = (t.detach().float()[None].requires_grad_() for t in (Q, K, V))
    O32 = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    O32.backward(dO.float()[None])
    reference = {"O": O32.detach()[0], "dQ": q32.grad[0], "dK": k32.grad[0], "dV": v32.grad[0]}
    record = dict(precision="bf16", note="leaderboard shape (16, 16384, 64), causal, vs fp32 SDPA",
                  errors={name: relative_error(result[name], reference[name]) for name in reference},
                  non_finite={name: int((~torch.isfinite(result[name])).sum().item()) for name in reference})
    if timed:

        def forward_backward(attention):
            q, k, v = (t.detach()[None].requires_grad_() for t in (Q, K, V))  # (1, 16, seq, d)
            return lambda: attention(q, k, v).backward(dO[None])

        ours = forward_backward(lambda q, k, v: FlashAttention2Triton.apply(q, k, v, True))
        sdpa = forward_backward(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        record["forward_backward_ms"] = {"triton_fixed_tiles": triton.testing.do_bench(ours, warmup=25, rep=200),
                                         "pytorch_sdpa": triton.testing.do_bench(sdpa, warmup=25, rep=200)}
    return record


def summarize(records: list[dict]) -> dict:
    """Per precision: the number of grid cases and, per quantity, the worst relative error, the case
    it came from, and the worst ratio to PyTorch's own error at that precision."""
    summary = {}
    for record in records:
        if "note" in record:
            continue
        entry = summary.setdefault(record["precision"], {"cases": 0, "worst": {}})
        entry["cases"] += 1
        case = "{batch}x{heads}x{n_queries}x{n_keys} d={d} causal={is_causal}".format(**record)
        for name, error in record["errors"].items():
            worst = entry["worst"].setdefault(name, {"relative_error": -1.0, "case": "", "max_ratio_to_torch": 0.0})
            if error > worst["relative_error"]:
                worst.update(relative_error=error, case=case, max_abs_error=record["max_abs_errors"][name])
            torch_error = record["torch_errors"][name]
            if torch_error > 0:
                worst["max_ratio_to_torch"] = max(worst["max_ratio_to_torch"], error / torch_error)
    return summary
