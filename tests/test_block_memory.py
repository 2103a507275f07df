"""What a Transformer block saves for backward, by the operation that made it, and the memory changes over each
block's forward and backward (``cs336_systems.bench.common.block_memory``), on a CPU: the allocator's counter is
replaced by readers whose answers are known."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from cs336_systems.bench.common import block_memory
from cs336_systems.bench.common.block_memory import SavedStorage, WindowMemory
from cs336_systems.bench.common.lm import LMConfig, build_model, random_batch
from cs336_systems.bench.gradient_checkpointing import saved_activation_bytes

CPU = torch.device("cpu")


class ExpOfProjection(nn.Module):
    """``exp(x W)``: the product saves ``x`` (the block's input) and ``W`` (a parameter); ``exp`` saves its result."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x @ self.weight)


def saved_of(block: nn.Module, x: torch.Tensor) -> dict[int, SavedStorage]:
    excluded = {p.untyped_storage().data_ptr() for p in block.parameters()}
    return block_memory.run_window([block], x, None, lambda: 0, excluded).saved[0]


def test_saved_storages_are_attributed_to_the_operation_that_made_them_parameters_left_out():
    x = torch.randn(4, 8)
    saved = sorted(saved_of(ExpOfProjection(8, 16), x).values(), key=lambda s: s.op)
    assert [(s.op, s.nbytes, s.shape, s.dtype) for s in saved] == [
        ("aten.exp", 4 * 16 * 4, (4, 16), "float32"), (block_memory.BLOCK_INPUT, 4 * 8 * 4, (4, 8), "float32")]


def test_a_storage_saved_by_two_operations_counts_once():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            h = x @ self.weight  # saves x
            return h * x.sin() + x.T.sum()  # sin saves x again, and the product saves h and sin(x)

    saved = saved_of(Twice(), torch.randn(8, 8))
    assert sorted(s.op for s in saved.values()) == ["aten.mm", "aten.sin", block_memory.BLOCK_INPUT]
    assert sum(s.nbytes for s in saved.values()) == 3 * 8 * 8 * 4


def test_one_transformer_block_saves_what_the_saved_tensor_count_says_and_names_model_functions():
    config = LMConfig("tiny", context_length=16, batch_size=2)
    model = build_model(config, CPU)
    tokens, _ = random_batch(config, CPU)
    row = block_memory.measure_blocks(model, tokens, None, lambda: 0, window=2)
    x = block_memory.hidden_state_entering(model, tokens, 0, None).requires_grad_()
    assert row["residual_bytes"] == saved_activation_bytes(model.layers[0], x, None)  # counted independently
    assert row["residual_bytes_by_block"] == [row["residual_bytes"]] * 2  # identical blocks
    operations = row["saved_by_operation"]
    assert sum(g["bytes"] for g in operations) == row["residual_bytes"]
    assert sum(g["share"] for g in operations) == pytest.approx(1.0)
    assert [g["bytes"] for g in operations] == sorted((g["bytes"] for g in operations), reverse=True)
    assert row["top_operations"] == operations[:5]
    assert all(g["op"].startswith("aten.") or g["op"] == block_memory.BLOCK_INPUT for g in operations)
    callers = {g["caller"] for g in operations}
    assert "softmax in scaled_dot_product_attention" in callers and "Linear.forward in SwiGLU.forward" in callers
    # The block input is the residual stream: one (batch, seq, d_model) tensor.
    assert next(g for g in operations if g["op"] == block_memory.BLOCK_INPUT)["bytes"] == row["residual_stream_bytes"]
    assert row["residual_stream_bytes"] == 2 * 16 * 64 * 4
    assert row["blocks"] == [0, 1] and row["block_parameters"] == sum(p.numel() for p in model.layers[0].parameters())
    assert all(p.grad is None for p in model.parameters())  # the measurement leaves no gradients behind


def test_under_autocast_the_projections_save_bf16():
    config = LMConfig("tiny", context_length=16, batch_size=2)
    model = build_model(config, CPU)
    tokens, _ = random_batch(config, CPU)
    fp32 = block_memory.measure_blocks(model, tokens, None, lambda: 0, window=1)
    bf16 = block_memory.measure_blocks(model, tokens, torch.bfloat16, lambda: 0, window=1)
    ffn = next(g for g in bf16["saved_by_operation"] if g["caller"] == "Linear.forward in SwiGLU.forward")
    assert "bfloat16" in ffn["dtypes"]
    assert bf16["residual_bytes"] != fp32["residual_bytes"]


def test_block_boundaries_of_the_backward_come_in_block_order_after_each_blocks_gradients():
    """Read the bytes of the parameters' gradients: over each block's backward they grow by exactly that block's
    parameters (different in every block, so the order shows), and not at all over the forward."""
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8)),
              nn.Sequential(nn.Linear(8, 8, bias=False))]

    def gradient_bytes() -> int:
        return sum(p.grad.nbytes for block in blocks for p in block.parameters() if p.grad is not None)

    memory = block_memory.run_window(blocks, torch.randn(4, 8), None, gradient_bytes, set())
    parameter_bytes = [sum(p.nbytes for p in block.parameters()) for block in blocks]
    assert block_memory.changes(memory.forward_bytes) == [0, 0, 0]
    assert list(reversed(block_memory.changes(memory.backward_bytes))) == parameter_bytes
    assert len(memory.saved) == 3


def test_readings_are_taken_once_per_block_boundary():
    config = LMConfig("tiny", context_length=16, batch_size=2)
    model = build_model(config, CPU)
    x = torch.randn(2, 16, 64)
    counter = itertools.count()
    memory = block_memory.run_window(list(model.layers), x, None, lambda: next(counter), set())
    assert memory.forward_bytes == [0, 1, 2] and memory.backward_bytes == [3, 4, 5]


def test_summary_infers_gradients_from_the_backward_change_plus_the_residuals():
    saved = [{1: SavedStorage("aten.exp", "softmax", 600, (1,), "float32"),
              2: SavedStorage("aten.mm", "Linear.forward", 400, (1,), "float32")}] + [
        {1: SavedStorage("aten.exp", "softmax", 1000, (1,), "float32")}] * 2
    # Backward order: last block first. Changes over blocks 2, 1, 0: +100, -500, -600.
    memory = WindowMemory(saved, forward_bytes=[0, 1000, 2000, 3000], backward_bytes=[5000, 5100, 4600, 4000])
    row = block_memory.summarize(memory, parameter_bytes=[1100, 1100, 1100])
    assert row["residual_bytes"] == 1000 and row["residual_tensors"] == 2
    assert [(g["op"], g["share"]) for g in row["top_operations"]] == [("aten.exp", 0.6), ("aten.mm", 0.4)]
    assert row["forward_change_bytes"] == [1000, 1000, 1000]
    assert row["backward_change_bytes"] == [-600, -500, 100]
    assert row["gradient_bytes_implied"] == [400, 500, 1100]
    assert row["gradient_bytes_measured"] == 800  # median of the blocks after the window's first
    assert row["gradient_bytes_expected"] == 1100 and row["gradient_ratio"] == pytest.approx(800 / 1100)


def test_the_hidden_state_entering_a_block_is_the_models_own():
    config = LMConfig("tiny", context_length=16, batch_size=2)
    model = build_model(config, CPU)
    tokens, _ = random_batch(config, CPU)
    with torch.no_grad():
        expected = model.layers[0](model.token_embeddings(tokens))
    torch.testing.assert_close(block_memory.hidden_state_entering(model, tokens, 1, None), expected)
