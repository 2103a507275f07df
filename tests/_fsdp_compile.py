"""Our sharded stack with compiled blocks against the same stack uncompiled, on a one-rank process group: shared
by the interpreter test (``tests/interpreter/test_leaderboard_2026.py``, CPU) and the GPU test (``test_leaderboard_2026.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from cs336_basics.model import BasicsTransformerLM
from cs336_systems.train import SHARDED_STACKS, build_training_step

LAYERS = 2


@dataclass
class Trained:
    losses: list[float]
    params: dict[str, torch.Tensor]  # full fp32 parameters after the steps, by name
    graphs_after_first_step: int  # Dynamo graphs compiled by the first step
    graphs: int  # ... by every step


def train(compile_mode: str, device: torch.device, dtype: torch.dtype | None, steps: int = 3) -> Trained:
    """``steps`` steps of ``SHARDED_STACKS["ours"]`` (compile part ``compile_mode``) on a fresh model of ``LAYERS``
    blocks; after the first step a recompilation raises (``error_on_recompile``)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = dict(vocab_size=100, context_length=32, d_model=64, num_layers=LAYERS, num_heads=4, d_ff=128)
    model = BasicsTransformerLM(**config, device=device)
    step = build_training_step(model, SHARDED_STACKS["ours"].with_(compile=compile_mode), autocast_dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    losses, graphs_after_first_step = [], 0
    for index in range(steps):
        tokens = torch.randint(0, config["vocab_size"], (1, config["context_length"] + 1), generator=generator).to(device)
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            losses.append(step(tokens[:, :-1], tokens[:, 1:]).item())
        if index == 0:
            graphs_after_first_step = counters["stats"]["unique_graphs"]
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    params = {name: p.float().cpu() for name, p in step.net.gather_full_params().items()}
    return Trained(losses, params, graphs_after_first_step, counters["stats"]["unique_graphs"])


def check_compiled_blocks(device: torch.device, dtype: torch.dtype | None, rtol: float, atol: float) -> None:
    """One graph for every block, compiled by the first step and never again; the same losses and parameters as
    the uncompiled stack."""
    eager = train("none", device, dtype)
    compiled = train("blocks", device, dtype)
    assert eager.graphs == 0
    assert compiled.graphs_after_first_step == compiled.graphs == 1  # the blocks share one graph
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=rtol, atol=atol)
    for name, param in eager.params.items():
        torch.testing.assert_close(compiled.params[name], param, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
