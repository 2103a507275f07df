"""The checkpoint planner (``cs336_systems.train.checkpoint_plan``): its choices on made-up budgets and on the
2026 leaderboard step's memory model for 80, 141 and 180 GB cards, and each block's mode applied in both sharded
stacks (one gloo rank on CPU, which blocks run again in backward and whether their attention does)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cs336_basics.model import BasicsTransformerLM
from cs336_systems.bench.common import leaderboard_2026_model as step_model
from cs336_systems.train import SHARDED_STACKS, Parts, build_training_step
from cs336_systems.train.checkpoint_plan import (
    CHECKPOINT_MODES, GB, CheckpointPlan, chain_modes, mode_runs, plan_checkpointing,
)
from cs336_systems.train.step import attention_operations

RANK = {mode: rank for rank, mode in enumerate(reversed(CHECKPOINT_MODES))}  # full 0 < selective 1 < keep 2
COST = {"full": 1.0, "selective": 2.0, "keep": 10.0}  # made-up bytes a block holds, by mode


def made_up_peak(modes: tuple[str, ...]) -> float:
    return 100.0 + sum(COST[mode] for mode in modes)


def test_huge_budget_keeps_every_block_and_tiny_recomputes_every_block():
    assert plan_checkpointing(6, made_up_peak, free_bytes=1e6, margin_bytes=0).modes == ("keep",) * 6
    tiny = plan_checkpointing(6, made_up_peak, free_bytes=50.0, margin_bytes=0)
    assert tiny.modes == ("full",) * 6 and not tiny.fits and tiny.peak_bytes == made_up_peak(tiny.modes)


def test_between_budgets_selective_first_then_the_last_blocks_kept():
    # all full: 106; all selective: 112; each kept block 8 more
    assert plan_checkpointing(6, made_up_peak, free_bytes=109.0, margin_bytes=0).modes == (
        "full", "full", "full", "selective", "selective", "selective")
    plan = plan_checkpointing(6, made_up_peak, free_bytes=130.0, margin_bytes=2.0)  # budget 128: two blocks kept
    assert plan.modes == ("selective",) * 4 + ("keep",) * 2
    assert plan.budget_bytes == 128.0 and plan.peak_bytes == 128.0 and plan.fits


def test_plans_are_monotone_in_the_budget():
    previous = None
    for free in range(100, 175):
        plan = plan_checkpointing(6, made_up_peak, free_bytes=float(free), margin_bytes=0)
        assert plan.fits == (free >= 106)
        if previous is not None:  # no block recomputes more with more memory
            assert all(RANK[new] >= RANK[old] for new, old in zip(plan.modes, previous.modes))
            assert plan.peak_bytes >= previous.peak_bytes
        previous = plan
    assert previous.modes == ("keep",) * 6


def test_chain_upgrades_the_last_blocks_first():
    assert chain_modes(3, 0) == ("full",) * 3
    assert chain_modes(3, 2) == ("full", "selective", "selective")
    assert chain_modes(3, 4) == ("selective", "selective", "keep")
    assert chain_modes(3, 5) == ("selective", "keep", "keep")
    assert chain_modes(3, 6) == ("keep",) * 3
    with pytest.raises(ValueError, match="upgrades"):
        chain_modes(3, 7)
    assert mode_runs(("full", "selective", "selective", "keep")) == [
        ("full", 0, 0), ("selective", 1, 2), ("keep", 3, 3)]


def test_describe_is_one_line_with_counts_and_budget():
    plan = CheckpointPlan(("selective", "keep", "keep"), peak_bytes=70e9, budget_bytes=75e9, margin_bytes=4 * 2**30)
    line = plan.describe()
    assert "\n" not in line and "2 keep, 1 selective" in line and "selective:0 keep:1-2" in line
    assert "70.0 GB fits a budget of 75.0 GB" in line and "4.0 GiB" in line
    assert "DOES NOT FIT" in CheckpointPlan(("full",), 2e9, 1e9).describe()
    assert "budget" not in CheckpointPlan(("full",), 2e9).describe()


@pytest.mark.parametrize("stack", ["ours", "torch"])
def test_plan_for_an_80_gb_card_fits_80_gb(stack):
    plan = step_model.plan_for_card(80, stack)
    assert plan.fits and plan.peak_bytes <= 80 * GB - step_model.DEFAULT_MARGIN_BYTES
    assert len(plan.modes) == step_model.MODEL["num_layers"]
    assert plan.peak_bytes == pytest.approx(
        step_model.memory_budget(step_model.MODEL, stack, 2, modes=plan.modes)["peak_gb"] * GB)


def test_the_default_margin_grows_with_the_memory():
    assert step_model.default_margin_bytes(80 * GB) == step_model.DEFAULT_MARGIN_BYTES  # 4 GiB > 5 % of 80 GB
    assert step_model.default_margin_bytes(180 * GB) == pytest.approx(0.05 * 180 * GB)
    plan = step_model.plan_for_card(180)
    assert plan.margin_bytes == pytest.approx(9 * GB) and plan.budget_bytes == pytest.approx(171 * GB)
    assert step_model.plan_for_card(180, margin_bytes=0).budget_bytes == pytest.approx(180 * GB)


@pytest.mark.parametrize("card_gb", [80, 141, 180])
def test_card_plans_fill_the_card(card_gb):
    """Each card's plan fits, and one step further up the chain would not (the most that fits)."""
    plan = step_model.plan_for_card(card_gb)
    layers = step_model.MODEL["num_layers"]
    upgrades = sum(RANK[mode] for mode in plan.modes)
    assert plan.modes == chain_modes(layers, upgrades) and plan.fits
    if upgrades < 2 * layers:
        further = step_model.memory_budget(step_model.MODEL, "ours", 2, modes=chain_modes(layers, upgrades + 1))
        assert further["peak_gb"] * GB > plan.budget_bytes


def test_b200_keeps_more_blocks_whole_than_h200_and_h200_than_h100():
    """On paper, 180 GB (B200) against 141 GB (H200) and 80 GB (H100): every block at least selective, and more
    blocks kept whole with more memory; the 141 GB plan is no longer today's (selective everywhere)."""
    h100, h200, b200 = (step_model.plan_for_card(gb) for gb in (80, 141, 180))
    assert all(mode != "full" for plan in (h100, h200, b200) for mode in plan.modes)
    assert h100.modes.count("keep") < h200.modes.count("keep") < b200.modes.count("keep") < len(b200.modes)
    assert h200.modes != step_model.stack_modes(step_model.MODEL, "ours")


def test_default_modes_are_todays_checkpointing():
    for stack, parts in SHARDED_STACKS.items():
        modes = step_model.stack_modes(step_model.MODEL, stack)
        assert parts.with_(checkpointing=modes) == parts  # ours selective, torch full: unchanged parts
    assert step_model.memory_budget(step_model.MODEL, "ours", 2) == step_model.memory_budget(
        step_model.MODEL, "ours", 2, modes=("selective",) * step_model.MODEL["num_layers"])


def test_parts_take_block_modes():
    mixed = Parts().with_(checkpointing=("full", "keep"))
    assert mixed.checkpointing == ("full", "keep") and mixed.block_modes(2) == ("full", "keep")
    assert Parts().with_(checkpointing=("keep", "keep")).checkpointing == "keep"
    assert Parts(checkpointing="selective").block_modes(3) == ("selective",) * 3
    assert Parts().with_overrides(["checkpointing=full,selective"]).checkpointing == ("full", "selective")
    with pytest.raises(ValueError, match="unknown checkpoint mode 'some'"):
        Parts(checkpointing=("some",))
    with pytest.raises(ValueError, match="3 checkpoint modes for a model of 2 blocks"):
        Parts(checkpointing=("full", "keep", "full")).block_modes(2)


class BlockEvents(TorchDispatchMode):
    """Records each block call (a forward pre-hook) and each attention operation that runs, in order."""

    def __init__(self, blocks):
        super().__init__()
        self.events: list[str] = []
        self.kept_operations = attention_operations()
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda module, args, index=index: self.events.append(f"block{index}"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.kept_operations:
            self.events.append("attention")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stack", ["ours", "torch"])
def test_plan_applied_per_block_in_both_stacks(stack):
    """Block 0 full (recomputed with its attention), block 1 selective (recomputed, attention kept), block 2 kept
    (not recomputed), under each stack's sharding on one gloo rank (SDPA and the plain parts: the CPU runs them)."""
    from cs336_systems.parallel.distributed import one_rank_group

    modes = ("full", "selective", "keep")
    parts = SHARDED_STACKS[stack].with_(attention="sdpa", rmsnorm="plain", loss="plain", optimizer="torch_fused",
                                        compile="none", checkpointing=modes)
    with one_rank_group("gloo"):
        torch.manual_seed(0)
        model = BasicsTransformerLM(vocab_size=50, context_length=8, d_model=16, num_layers=3, num_heads=2, d_ff=32)
        step = build_training_step(model, parts, autocast_dtype=torch.float32)
        tokens = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(0))
        recorder = BlockEvents(model.layers)
        with recorder:
            step.forward_loss(tokens[:, :-1], tokens[:, 1:]).backward()
    forward = ["block0", "attention", "block1", "attention", "block2", "attention"]
    assert recorder.events == forward + ["block1", "block0", "attention"]


@pytest.mark.parametrize("stack", ["ours", "torch"])
def test_a_mixed_plan_trains_as_the_stacks_own_checkpointing(stack):
    """Two steps of each sharded stack (one gloo rank, the plain parts) with a mixed plan and with the stack's own
    checkpointing: the same losses, so the same gradients and updates."""
    from cs336_systems.parallel.distributed import one_rank_group

    plain = SHARDED_STACKS[stack].with_(attention="sdpa", rmsnorm="plain", loss="plain", optimizer="torch_fused",
                                        compile="none")
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    losses = []
    with one_rank_group("gloo"):
        for parts in (plain, plain.with_(checkpointing=("keep", "full", "selective"))):
            torch.manual_seed(0)
            model = BasicsTransformerLM(vocab_size=50, context_length=8, d_model=16, num_layers=3, num_heads=2,
                                        d_ff=32)
            step = build_training_step(model, parts, autocast_dtype=torch.float32)
            losses.append([step(tokens[:, :-1], tokens[:, 1:]).item() for _ in range(2)])
    assert losses[0][0] != losses[0][1]  # the first step trained
    assert losses[1] == losses[0]
