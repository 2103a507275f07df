"""The ``fused_residual_norm`` part of the training step (``cs336_systems.train.residual_stream``): the part and its
command-line choice, the benchmark rows that record it, and on a GPU the fused step against the separate one (the
interpreter's checks are ``tests/interpreter/test_residual_stream.py``)."""

from __future__ import annotations

import argparse

import pytest
import torch

from cs336_systems.bench import leaderboard_2026, train_step
from cs336_systems.bench.common.lm import LMConfig, build_model, random_batch
from cs336_systems.bench.common.result_store import ResultStore
from cs336_systems.train import SHARDED_STACKS, STACKS, Parts, build_training_step
from tests._flash_checks import relative_error


def test_fused_residual_norm_part_is_checked():
    with pytest.raises(ValueError, match="needs rmsnorm='fused'"):
        Parts(rmsnorm="plain", fused_residual_norm=True)
    assert STACKS["ours"].with_overrides(["fused_residual_norm=true"]).fused_residual_norm
    assert not STACKS["ours"].fused_residual_norm and not SHARDED_STACKS["ours"].fused_residual_norm
    assert STACKS["ours"].with_residual_norm("fused").fused_residual_norm
    assert not STACKS["ours"].with_residual_norm("fused").with_residual_norm("separate").fused_residual_norm
    assert not STACKS["torch"].with_residual_norm("fused").fused_residual_norm  # PyTorch's norm takes no residual
    with pytest.raises(ValueError, match="unknown residual norm 'both'"):
        STACKS["ours"].with_residual_norm("both")


def train_step_args(*argv: str) -> argparse.Namespace:
    return train_step.parser().parse_args(list(argv))


def test_train_step_rows_carry_the_residual_norm_of_our_stack():
    for choice in ("separate", "fused"):
        args = train_step_args("--residual-norm", choice)
        assert train_step.residual_norm_key("ours", args) == {"residual_norm": choice}
        assert train_step.residual_norm_key("torch", args) == {}
        case = dict(stack="ours", variant="default", residual_norm=choice)
        assert train_step.case_parts(case, []).fused_residual_norm == (choice == "fused")
    assert train_step.residual_norm_key("ours", train_step_args()) == {}  # as the rows before the option
    assert not train_step.case_parts(dict(stack="ours", variant="cudagraphs"), []).fused_residual_norm
    # Our RMSNorm swapped out by an override: no residual to fuse, no key.
    assert train_step.residual_norm_key("ours", train_step_args("--residual-norm", "fused", "--override",
                                                                "rmsnorm=plain")) == {}


def test_train_step_compares_fused_rows_with_the_torch_rows(tmp_path):
    store = ResultStore("train_step", tmp_path, quiet=True)
    case = dict(size="xl", context_length=512, batch_size=4, overrides=[], dtype="bf16", warmup=3, steps=8)
    store.add({**case, "stack": "torch", "variant": "default"}, {"step_ms": 100.0, "oom": False})
    fused = {**case, "stack": "ours", "variant": "default", "residual_norm": "fused"}
    assert train_step.fastest_torch_row(store, fused)["step_ms"] == 100.0
    store.add(fused, {"step_ms": 90.0, "oom": False})
    separate = {**fused, "residual_norm": "separate"}
    assert store.done(fused) and not store.done(separate)  # both choices' rows stand side by side


def test_leaderboard_rows_carry_the_residual_norm_of_our_stack():
    args = leaderboard_2026.parser().parse_args(["--residual-norm", "fused"])
    config = leaderboard_2026.model_config(args, on_gpu=True)
    assert leaderboard_2026.case_of(args, "ours", config, 2)["residual_norm"] == "fused"
    assert "residual_norm" not in leaderboard_2026.case_of(args, "torch", config, 2)
    default = leaderboard_2026.parser().parse_args([])
    assert "residual_norm" not in leaderboard_2026.case_of(default, "ours", config, 2)


# ---------------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------------


def gpu_loss_and_gradients(parts: Parts) -> tuple[float, dict[str, torch.Tensor]]:
    config = LMConfig("small", 256, 2)
    torch.manual_seed(0)
    model = build_model(config, torch.device("cuda"))
    step = build_training_step(model, parts)
    x, y = random_batch(config, torch.device("cuda"))
    loss = step.forward_loss(x, y)
    loss.backward()
    return loss.item(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.gpu
@pytest.mark.parametrize("compile_mode, checkpointing", [
    ("none", {}),
    ("blocks", {}),
    ("blocks", {"checkpointing": "selective"}),
    ("none", {"checkpointing": ("full",) * 6 + ("selective",) * 6}),
], ids=["eager", "compiled", "compiled_selective", "eager_per_block"])
def test_fused_residual_norm_matches_separate_on_gpu(compile_mode, checkpointing):
    """Our stack (bf16 autocast, bf16 linear weights) with and without the part: the same loss and gradients up to
    bf16 rounding (the values are the same; the order of floating-point operations may differ under compile)."""
    parts = STACKS["ours"].with_(compile=compile_mode, **checkpointing)
    loss, grads = gpu_loss_and_gradients(parts.with_(fused_residual_norm=True))
    expected_loss, expected_grads = gpu_loss_and_gradients(parts)
    assert loss == pytest.approx(expected_loss, rel=1e-3)
    for name, grad in grads.items():
        assert relative_error(grad, expected_grads[name]) <= 2e-2, name
