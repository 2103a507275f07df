"""The ``fused_residual_norm`` part under the Triton CPU interpreter (see ``conftest.py``): a tiny model's loss and
every parameter's gradient with each residual add fused into its norm equal the plain blocks', with and without
checkpointing, with a float16 branch onto a float32 stream (CPU autocast), and through ``torch.compile``."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from cs336_basics.model import BasicsTransformerLM
from cs336_systems.kernels.residual_rmsnorm import FusedAddRMSNorm, fused_add_rmsnorm
from cs336_systems.kernels.rmsnorm import fused_rms_norm
from cs336_systems.train import STACKS, Parts, build_training_step
from cs336_systems.train.residual_stream import block_groups, hidden_states_with_fused_residual_norm
from cs336_systems.train.step import apply_parts, checkpoint_options

NUM_LAYERS = 3


def tiny_model() -> BasicsTransformerLM:
    torch.manual_seed(0)
    return BasicsTransformerLM(vocab_size=100, context_length=16, d_model=32, num_layers=NUM_LAYERS, num_heads=2,
                               d_ff=64)


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))
    return batch[:, :-1], batch[:, 1:]


def loss_and_gradients(parts: Parts, autocast_dtype: torch.dtype | None = None, sums: list | None = None):
    """The loss of one forward of a fresh tiny model with ``parts`` and every parameter's gradient; ``sums``
    collects the (branch, stream) dtypes of each fused add + norm call of the forward."""
    model = tiny_model()
    step = build_training_step(model, parts, autocast_dtype=autocast_dtype)
    hooks = [module.register_forward_pre_hook(
        lambda _, args: sums.append(tuple(a.dtype for a in args)) if len(args) == 2 else None)
        for module in model.modules() if isinstance(module, FusedAddRMSNorm) and sums is not None]
    loss = step.forward_loss(*tokens())
    for hook in hooks:
        hook.remove()  # recomputation in backward calls the norms again
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_same(fused, separate) -> None:
    (loss, grads), (expected_loss, expected_grads) = fused, separate
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        assert grad is not None, name
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


OURS = STACKS["ours"].with_(compile="none", weights="fp32")  # float32: the interpreter's bf16 dot is wrong


@pytest.mark.parametrize("checkpointing", [
    {},
    {"checkpointing": "selective"},
    {"checkpointing": "full"},
    {"checkpointing": ("full", "selective", "keep")},
], ids=["none", "selective", "full", "per_block"])
def test_fused_residual_norm_matches_separate(checkpointing):
    parts = OURS.with_(**checkpointing)
    sums = []
    fused = loss_and_gradients(parts.with_(fused_residual_norm=True), sums=sums)
    # Every add fused but the first (the first block's stream is the embedding alone), ln_final's included.
    assert len(sums) == 2 * NUM_LAYERS
    assert_same(fused, loss_and_gradients(parts))


def test_fused_residual_norm_under_autocast_adds_a_half_branch_to_a_float32_stream():
    parts = Parts(attention="triton", rmsnorm="fused", loss="fused", optimizer="torch_fused", compile="none")
    sums = []
    fused = loss_and_gradients(parts.with_(fused_residual_norm=True), torch.float16, sums)
    assert set(sums) == {(torch.float16, torch.float32)}
    assert_same(fused, loss_and_gradients(parts, torch.float16))


@pytest.mark.parametrize("branch_dtype", [torch.float16, torch.bfloat16])
def test_mixed_dtypes_match_the_add_then_our_norm(branch_dtype):
    """A 16-bit branch onto a float32 stream, the norm written in the branch's dtype: the sum exactly torch's
    float32 add, the norm and all three gradients as our RMSNorm of that sum."""
    x = (2 * torch.randn(3, 5, 40)).to(branch_dtype)
    stream, weight = 2 * torch.randn(3, 5, 40), 1 + 0.5 * torch.randn(40)
    ds, dy = torch.randn(3, 5, 40), torch.randn(3, 5, 40).to(branch_dtype)
    results = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, stream, weight)]
        if fused:
            s, y = fused_add_rmsnorm(*leaves, out_dtype=branch_dtype)
        else:
            s = leaves[0] + leaves[1]
            y = fused_rms_norm(s, leaves[2], out_dtype=branch_dtype)
        assert (s.dtype, y.dtype) == (torch.float32, branch_dtype)
        torch.autograd.backward((s, y), (ds, dy))
        results.append([s, y, *(leaf.grad for leaf in leaves)])
    assert [g.dtype for g in results[0][2:]] == [branch_dtype, torch.float32, torch.float32]
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_unused_sum_takes_the_plain_norms_backward():
    """ln_final's sum is never used: no gradient arrives for it, and none is made of zeros."""
    x, stream, weight = torch.randn(4, 24), torch.randn(4, 24), 1 + torch.rand(24)
    dy = torch.randn(4, 24)
    leaves = [t.clone().requires_grad_() for t in (x, stream, weight)]
    fused_add_rmsnorm(*leaves)[1].backward(dy)
    reference = [t.clone().requires_grad_() for t in (x + stream, weight)]
    fused_rms_norm(*reference).backward(dy)
    for leaf in leaves[:2]:
        torch.testing.assert_close(leaf.grad, reference[0].grad, rtol=0, atol=0)
    torch.testing.assert_close(leaves[2].grad, reference[1].grad, rtol=0, atol=0)


@pytest.mark.slow
def test_compiled_blocks_trace_in_one_graph_and_match_eager():
    """``fullgraph=True`` on every block (a graph break fails it) and on the whole hidden states: the same gradients
    as eager; the first block (no pending branch) compiles once, the others share one graph."""
    model = tiny_model()
    apply_parts(model, OURS.with_(fused_residual_norm=True))
    ids, _ = tokens()

    def hidden_sum(token_ids):
        return hidden_states_with_fused_residual_norm(model, token_ids, block_groups(model, ("keep",) * len(model.layers), checkpoint_options)).sum()

    def gradients(fn):
        model.zero_grad(set_to_none=True)
        fn(ids).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    eager = gradients(hidden_sum)
    whole = gradients(torch.compile(hidden_sum, backend="aot_eager", fullgraph=True))
    counter = CompileCounterWithBackend("aot_eager")
    for block in model.layers:
        block.compile(backend=counter, fullgraph=True)
    by_block = gradients(hidden_sum)
    assert counter.frame_count == 2
    for traced in (whole, by_block):
        assert set(traced) == set(eager)
        for name, grad in traced.items():
            torch.testing.assert_close(grad, eager[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_steps_with_inductor_compiled_blocks_train_alike():
    """Two training steps of our stack with blocks compiled by Inductor (the operators opaque here) and selective
    checkpointing, the part on: the same losses and parameters as the eager blocks with the part off (one compile
    instead of two keeps the test short)."""
    ids, targets = tokens()
    results = []
    for fused in (False, True):
        model = tiny_model()
        parts = OURS.with_(compile="blocks" if fused else "none", checkpointing="selective",
                           fused_residual_norm=fused)
        step = build_training_step(model, parts, autocast_dtype=None)
        losses = [step(ids, targets) for _ in range(2)]
        results.append((torch.stack(losses), {name: p.detach() for name, p in model.named_parameters()}))
    (losses, params), (expected_losses, expected_params) = results
    torch.testing.assert_close(losses, expected_losses, rtol=1e-6, atol=0)
    for name, param in params.items():
        torch.testing.assert_close(param, expected_params[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_leaderboard_row_records_the_fused_residual_norm(tmp_path):
    """Our sharded stack on 2 gloo ranks with the part on: its row records the choice."""
    import json

    from cs336_systems.bench import leaderboard_2026

    argv = ["--quick", "--results-dir", str(tmp_path), "--rep-ms", "1", "--warmup-ms", "1", "--stacks", "ours"]
    leaderboard_2026.main([*argv, "--residual-norm", "fused"])  # the plain blocks' rows: the CLI's own test
    rows = [json.loads(line) for line in (tmp_path / "leaderboard_2026.jsonl").read_text().splitlines()]
    assert [(row["residual_norm"], row["parts"]["fused_residual_norm"]) for row in rows] == [("fused", True)]
    assert all("residual_norm" in row["config_keys"] and row["step_ms"] > 0 for row in rows)
