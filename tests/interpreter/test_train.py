"""The training-step stacks under the Triton CPU interpreter (see ``conftest.py``): our stack (Triton attention,
fused RMSNorm, fused cross-entropy, fused AdamW) trains a tiny model exactly as PyTorch's stack does (eager; compiled
blocks against PyTorch's stack are checked on the GPU), and with compiled blocks the ``recompute_materialized`` part
saves less and trains alike."""

from __future__ import annotations

import pytest
import torch

from cs336_basics.model import BasicsTransformerLM
from cs336_systems.train import STACKS, build_training_step


def train(stack: str, compile_mode: str, steps: int = 2) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = BasicsTransformerLM(vocab_size=300, context_length=24, d_model=32, num_layers=2, num_heads=2, d_ff=64)
    # float32 throughout (the interpreter's bf16 dot is wrong): the bf16-weights part needs bf16 autocast.
    step = build_training_step(model, STACKS[stack].with_(compile=compile_mode, weights="fp32"), autocast_dtype=None)
    tokens = torch.randint(0, 300, (2, 25), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses = [step(x, y).item() for _ in range(steps)]
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_our_stack_trains_like_pytorchs_eager():
    ours, ours_params = train("ours", "none")
    theirs, their_params = train("torch", "none")
    assert ours == pytest.approx(theirs, rel=1e-5)
    for name, p in their_params.items():
        torch.testing.assert_close(ours_params[name], p, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_recomputing_materialized_values_saves_memory_and_trains_alike():
    """Our stack with compiled blocks (Inductor on the CPU, float32): with ``recompute_materialized`` the blocks save
    fewer bytes for backward (values that backward operators read whole may be recomputed instead of kept) and the
    step's loss and parameters are the same."""
    def run(recompute: bool) -> tuple[int, float, list[torch.Tensor]]:
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = BasicsTransformerLM(vocab_size=300, context_length=24, d_model=32, num_layers=1, num_heads=2, d_ff=64)
        parts = STACKS["ours"].with_(compile="blocks", weights="fp32", recompute_materialized=recompute)
        step = build_training_step(model, parts, autocast_dtype=None)
        tokens = torch.randint(0, 300, (2, 25), generator=torch.Generator().manual_seed(1))
        x, y = tokens[:, :-1], tokens[:, 1:]
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = step(x, y)
        return sum(saved.values()), loss.item(), [p.detach().clone() for p in model.parameters()]

    kept, loss_kept, params_kept = run(False)
    recomputed, loss_recomputed, params_recomputed = run(True)
    assert recomputed < kept
    assert loss_recomputed == loss_kept
    for a, b in zip(params_recomputed, params_kept):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
