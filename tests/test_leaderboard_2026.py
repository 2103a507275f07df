"""The course's 2026 leaderboard step (``cs336_systems.bench.leaderboard_2026``): FLOP and memory accounting, the
sharded stacks' parts, the whole composition on gloo ranks under the Triton interpreter (``tests/interpreter/``), and
the reduced-size check against one process on 2 GPUs."""

from __future__ import annotations

import pytest
import torch

from cs336_systems.bench import leaderboard_2026
from cs336_systems.bench.common import distributed_launch as dl
from cs336_systems.bench.common import leaderboard_2026_model as step_model
from cs336_systems.train import SHARDED_STACKS, STACKS, Parts


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        leaderboard_2026.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--check" in out
    assert "--cold" not in out and "--warm" in out  # the help names only options that exist
    assert "--checkpoint-plan {auto,selective,full,stack}" in out
    assert "'auto' (default)" in " ".join(out.split())


def test_step_flops_of_the_official_step():
    # The accounting: ~2.95 PFLOP of weight matmuls and ~2.1 of causal attention.
    flops = step_model.step_flops(step_model.MODEL, step_model.BATCH)
    assert flops == pytest.approx(5.0e15, rel=0.03)


def test_memory_budget_fits_and_shards():
    one = step_model.memory_budget(step_model.MODEL, "ours", world_size=1)
    two = step_model.memory_budget(step_model.MODEL, "ours", world_size=2)
    assert two["params_gb"] == pytest.approx(one["params_gb"] / 2)
    assert two["optimizer_state_gb"] == pytest.approx(2 * two["params_gb"])
    assert 8.0e9 * 4 / 2 / 1e9 < two["params_gb"] < 8.3e9 * 4 / 2 / 1e9  # an 8B model: ~16 GB of fp32 per rank
    assert two["peak_gb"] < 130
    # The start of backward: masters, moments, every block's input and attention output, the larger transient.
    assert two["peak_gb"] == pytest.approx(two["params_gb"] + two["optimizer_state_gb"] + two["saved_activations_gb"]
                                           + max(two["loss_head_gb"], two["block_recompute_gb"]))
    torch_stack = step_model.memory_budget(step_model.MODEL, "torch", world_size=2)
    assert torch_stack["saved_activations_gb"] == pytest.approx(two["saved_activations_gb"] / 2)


def test_one_gpu_proxy_case():
    """``--world-size 1 --per-rank-batch 1``: one rank's work, a row case of its own, never the official one."""
    proxy = leaderboard_2026.parser().parse_args(["--world-size", "1", "--per-rank-batch", "1", "--num-layers", "4"])
    case = leaderboard_2026.case_of(proxy, "ours", leaderboard_2026.model_config(proxy, on_gpu=True), world_size=1)
    assert (case["world_size"], case["batch_size"], case["num_layers"], case["official"]) == (1, 1, 4, False)
    official = leaderboard_2026.parser().parse_args([])
    assert leaderboard_2026.case_of(official, "torch", leaderboard_2026.model_config(official, on_gpu=True), 2)["official"]
    with pytest.raises(SystemExit) as exited:
        leaderboard_2026.main(["--per-rank-batch", "0"])
    assert exited.value.code == 2  # argparse: "argument --per-rank-batch: 0 must be at least 1"


def test_sharded_parts_are_checked():
    with pytest.raises(ValueError, match="checkpointing is a mode"):
        Parts(checkpointing=())
    with pytest.raises(ValueError, match="sharding"):
        Parts(sharding="zero3")
    assert SHARDED_STACKS["ours"].compile == "blocks"  # our FSDP compiles each block's forward
    with pytest.raises(ValueError, match="sharded"):
        STACKS["torch"].with_(sharding="fsdp2", compile="model")
    assert Parts().with_overrides(["checkpointing=selective"]).checkpointing == "selective"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_reduced_step_matches_one_process_on_two_gpus(capsys):
    """2 layers, context 4096, the full vocabulary: both stacks against one process, bf16 tolerance."""
    leaderboard_2026.main(["--check"])
    assert "check passed" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_blocks_under_our_fsdp_compile_once_on_gpu():
    """Inductor, bf16, our kernels, one NCCL rank: one graph for every block, no recompilation over the steps."""
    from cs336_systems.parallel.distributed import one_rank_group
    from tests._fsdp_compile import check_compiled_blocks

    with one_rank_group("nccl"):
        check_compiled_blocks(torch.device("cuda"), torch.bfloat16, rtol=2e-2, atol=2e-2)


def test_checkpoint_plan_option_chooses_each_stacks_modes():
    """``stack``: each stack's checkpointing before the plans (rows without the key); ``selective``/``full``: the
    same in both stacks; ``auto`` (the default): the planner on the ranks' free memory (one gloo rank: the
    host's), a row case of its own."""
    from cs336_systems.parallel.distributed import one_rank_group

    config = dict(step_model.MODEL, num_layers=4)
    assert leaderboard_2026.parser().parse_args([]).checkpoint_plan == "auto"
    own = leaderboard_2026.parser().parse_args(["--checkpoint-plan", "stack"])
    assert "checkpoint_option" not in leaderboard_2026.case_of(own, "ours", config, 2)
    for stack, mode in (("ours", "selective"), ("torch", "full")):
        plan = leaderboard_2026.rank_plan(own, stack, config, 2, torch.device("cpu"))
        assert plan.modes == (mode,) * 4 and plan.budget_bytes is None
        assert plan.peak_bytes == pytest.approx(step_model.memory_budget(config, stack, 2)["peak_gb"] * 1e9)
    full = leaderboard_2026.parser().parse_args(["--checkpoint-plan", "full"])
    assert leaderboard_2026.rank_plan(full, "ours", config, 2, torch.device("cpu")).modes == ("full",) * 4
    assert leaderboard_2026.case_of(full, "ours", config, 2)["checkpoint_option"] == "full"
    auto = leaderboard_2026.parser().parse_args(["--checkpoint-plan", "auto", "--memory-margin-gib", "1"])
    with one_rank_group("gloo"):
        free = dl.least_free_bytes(torch.device("cpu"))
        plan = leaderboard_2026.rank_plan(auto, "ours", step_model.TINY, 1, torch.device("cpu"))
    assert free > 0 and plan.margin_bytes == 2**30 and plan.budget_bytes <= free - 2**30 + 1e8
    assert plan.modes == ("keep",) * step_model.TINY["num_layers"]  # a tiny model fits any host whole
    with pytest.raises(ValueError, match="needs the free memory"):
        step_model.plan_of_option("auto", config, "ours", 2, 1)


def test_memory_budget_by_block_modes():
    layers = step_model.MODEL["num_layers"]
    full, selective, keep = (step_model.memory_budget(step_model.MODEL, "ours", 2, modes=(mode,) * layers)
                             for mode in ("full", "selective", "keep"))
    assert selective["saved_activations_gb"] == pytest.approx(2 * full["saved_activations_gb"])
    assert full["peak_gb"] < selective["peak_gb"] < keep["peak_gb"]
    # keep: 8 d_model + 3 d_ff bf16 values a token per block in ours, one d_model-wide more in PyTorch's
    per_block = 2 * (8 * 4096 + 3 * 11_008) * step_model.MODEL["context_length"]
    assert keep["saved_activations_gb"] == pytest.approx(layers * per_block / 1e9)
    torch_keep = step_model.memory_budget(step_model.MODEL, "torch", 2, modes=("keep",) * layers)
    assert torch_keep["saved_activations_gb"] - keep["saved_activations_gb"] == \
        pytest.approx(layers * 2 * 4096 * step_model.MODEL["context_length"] / 1e9)
    with pytest.raises(ValueError, match="3 checkpoint modes for 34 blocks"):
        step_model.memory_budget(step_model.MODEL, "ours", 2, modes=("full",) * 3)


def test_plan_flops_count_what_each_mode_recomputes():
    config = {"vocab_size": 10, "context_length": 8, "d_model": 4, "d_ff": 6, "num_layers": 3, "num_heads": 2}
    block_weights = 2 * 2 * 8 * (4 * 16 + 3 * 4 * 6)  # 2 sequences of 8 tokens through one block's matrices
    block_attention = 4 * 2 * 8**2 * 4 / 2
    parts = step_model.plan_flop_parts(config, 2, ("keep", "selective", "full"))
    assert parts["recompute_weights"] == 2 * block_weights  # selective and full recompute the block's matmuls
    assert parts["recompute_attention"] == block_attention  # only full runs attention again
    assert {k: parts[k] for k in ("weights", "attention")} == step_model.step_flop_parts(config, 2)
    kept = step_model.plan_flop_parts(config, 2, ("keep",) * 3)
    assert kept["recompute_weights"] == kept["recompute_attention"] == 0
    with pytest.raises(ValueError, match="2 checkpoint modes for 3 blocks"):
        step_model.plan_flop_parts(config, 2, ("keep", "full"))


def test_predicted_step_time_scales_each_part_by_its_peak_ratio():
    flop_parts = {"weights": 8e12, "recompute_weights": 2e12, "attention": 3e12, "recompute_attention": 1e12}
    rates = {"matmul_tflops": 500.0, "attention_tflops": 400.0, "memory_bound_ms": 30.0, "communication_ms": 9.0}
    same = step_model.predict_step_ms(flop_parts, rates, "H200", "H200")
    assert same["matmul_ms"] == pytest.approx(20.0)  # 10 TFLOP at 500 TFLOP/s
    assert same["attention_ms"] == pytest.approx(10.0)
    assert (same["memory_bound_ms"], same["communication_ms"]) == (30.0, 9.0)
    assert same["step_ms"] == pytest.approx(69.0)
    b200 = step_model.predict_step_ms(flop_parts, rates, "H200", "B200")
    assert b200["matmul_ms"] == pytest.approx(20.0 * 989 / 2250)
    assert b200["attention_ms"] == pytest.approx(10.0 * 989 / 2250)
    assert b200["memory_bound_ms"] == pytest.approx(30.0 * 4.8 / 8.0)
    assert b200["communication_ms"] == pytest.approx(9.0 * 0.9 / 1.8)
    assert b200["step_ms"] == pytest.approx(sum(v for k, v in b200.items() if k != "step_ms"))
