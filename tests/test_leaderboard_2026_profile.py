"""The split of a profiled step (``cs336_systems.bench.common.step_split``) on made-up kernels and traces, and the
profile script's defaults (the full step)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cs336_systems.bench.common.step_split import (
    SPLIT, StepKernel, exposed_us, idle_gaps, kernels_of_trace, name_category, split_step,
)


@pytest.mark.parametrize("name, category", [
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("rmsnorm_fwd_kernel", "norms"),  # its "_fwd_" is not attention's
    ("rmsnorm_bwd_kernel", "norms"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norms"),
    ("cross_entropy_rows_kernel", "loss"),
    ("fused_adamw_kernel", "optimizer"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("attn_bwd_kernel", "attention_backward"),
    ("attn_bwd_dq_convert_kernel", "attention_backward"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3", "attention_backward"),
    ("attn_fwd_hopper_kernel", "attention_forward"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention_forward"),
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("triton_tem_fused_mm_3", "matmul"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::BinaryFunctor<c10::BFloat16>>", "elementwise"),
    ("triton_poi_fused_mul_silu_1", "elementwise"),
])
def test_kernel_names_fall_in_their_category(name, category):
    assert name_category(name) == category


def test_forward_kernels_in_the_backward_are_recompute():
    # An attention forward, a norm forward and a matmul launched inside a compiled forward, all during the
    # backward: recompute; the backward's own matmul and attention backward keep their category.
    assert StepKernel("attn_fwd_kernel", 0, 1, in_backward=True).category == "recompute"
    assert StepKernel("rmsnorm_fwd_kernel", 0, 1, in_backward=True).category == "recompute"
    assert StepKernel("nvjet_sm90_tst_x", 0, 1, in_backward=True, in_forward_range=True).category == "recompute"
    assert StepKernel("nvjet_sm90_tst_x", 0, 1, in_backward=True).category == "matmul"
    assert StepKernel("attn_bwd_kernel", 0, 1, in_backward=True).category == "attention_backward"
    assert StepKernel("attn_fwd_kernel", 0, 1).category == "attention_forward"  # in the forward
    assert StepKernel("ncclDevKernel_AllGather", 0, 1, in_backward=True, in_forward_range=True).category == \
        "communication"


def test_exposed_communication_is_what_no_compute_covers():
    # Communication [0, 10) and [20, 30); compute [2, 5), [4, 8) (overlapping each other) and [25, 40):
    # covered 6 + 5, exposed 20 - 11 = 9.
    assert exposed_us([(0, 10), (20, 30)], [(2, 5), (4, 8), (25, 40)]) == pytest.approx(9.0)
    assert exposed_us([(0, 10)], []) == pytest.approx(10.0)
    assert exposed_us([(0, 10), (5, 12)], [(0, 12)]) == pytest.approx(0.0)  # overlapping collectives, all hidden
    assert exposed_us([], [(0, 5)]) == 0.0


def test_split_of_a_made_up_step():
    kernels = [
        StepKernel("nvjet_sm90_a", 0, 4000),  # 4 ms matmul in the forward
        StepKernel("attn_fwd_kernel", 4000, 5000),  # 1 ms attention forward
        StepKernel("ncclDevKernel_AllGather", 3000, 7000),  # 4 ms, covered 3000..5000 and 5500..6000: 1.5 exposed
        StepKernel("attn_fwd_kernel", 5500, 6000, in_backward=True),  # 0.5 ms recomputed
        StepKernel("attn_bwd_kernel", 8000, 10_000, in_backward=True),  # 2 ms
        StepKernel("fused_adamw_kernel", 10_000, 10_500),  # 0.5 ms
    ]
    split = split_step(kernels, wall_ms=11.0)
    ms = split["split_ms"]
    assert list(ms) == list(SPLIT)
    assert (ms["matmul"], ms["attention_forward"], ms["recompute"], ms["attention_backward"], ms["optimizer"]) == \
        pytest.approx((4.0, 1.0, 0.5, 2.0, 0.5))
    assert ms["exposed_communication"] == pytest.approx(1.5)
    assert split["communication_ms"] == pytest.approx(4.0)
    # Busy: [0, 7000) and [8000, 10500): 9.5 ms of the 11.
    assert split["idle_ms"] == pytest.approx(1.5)
    assert sum(ms.values()) + split["idle_ms"] == pytest.approx(11.0)
    # The one gap between kernels: 7000..8000, after the all-gather, before the attention backward.
    gaps = idle_gaps(kernels, top=3)
    assert (gaps["span_ms"], gaps["gaps_ms"], gaps["gap_count"]) == pytest.approx((10.5, 1.0, 1))
    assert gaps["largest"] == [{"ms": 1.0, "at_ms": 7.0, "after": "ncclDevKernel_AllGather",
                                "before": "attn_bwd_kernel"}]
    assert idle_gaps([]) == {"span_ms": 0.0, "gaps_ms": 0.0, "gap_count": 0, "largest": []}


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "args": args}


def test_kernels_of_a_made_up_trace_know_where_they_were_launched():
    trace = {"traceEvents": [
        _x("CompiledFunction", "cpu_op", 0, 50),  # the forward of a compiled block, on the main thread
        _x("cudaLaunchKernel", "cuda_runtime", 10, 1, correlation=1),
        _x("nvjet_sm90_fwd_mm", "kernel", 100, 40, tid=7, correlation=1),
        _x("autograd::engine::evaluate_function: CheckpointFunctionBackward", "cpu_op", 200, 100, tid=2),
        _x("CompiledFunction", "cpu_op", 210, 20, tid=2),  # the recomputation inside the backward
        _x("cuLaunchKernel", "cuda_driver", 215, 1, tid=2, correlation=2),
        _x("nvjet_sm90_recompute_mm", "kernel", 300, 30, tid=7, correlation=2),
        _x("cudaLaunchKernel", "cuda_runtime", 250, 1, tid=2, correlation=3),
        _x("nvjet_sm90_bwd_mm", "kernel", 340, 60, tid=7, correlation=3),
        _x("cudaLaunchKernel", "cuda_runtime", 400, 1, correlation=4),  # after the backward: the optimizer
        _x("fused_adamw_kernel", "kernel", 420, 10, tid=7, correlation=4),
        _x("ncclDevKernel_ReduceScatter", "kernel", 330, 200, tid=8),  # no linked launch
    ]}
    kernels = {k.name: k for k in kernels_of_trace(trace)}
    assert [kernels[n].category for n in ("nvjet_sm90_fwd_mm", "nvjet_sm90_recompute_mm", "nvjet_sm90_bwd_mm",
                                          "fused_adamw_kernel", "ncclDevKernel_ReduceScatter")] == \
        ["matmul", "recompute", "matmul", "optimizer", "communication"]
    assert (kernels["nvjet_sm90_fwd_mm"].in_backward, kernels["nvjet_sm90_bwd_mm"].in_backward) == (False, True)
    assert kernels["nvjet_sm90_bwd_mm"].in_forward_range is False  # launched on thread 2 after its forward range
    # Communication 330..530 less compute 340..400 and 420..430 (the recompute ends at 330): 130 us exposed.
    assert split_step(list(kernels.values()), 1.0)["split_ms"]["exposed_communication"] == pytest.approx(0.13)


def test_a_second_steps_forward_is_not_recompute():
    """Two steps, each marked: the second step's forward lies between the two backwards, and stays forward."""
    def one_step(at, correlation):
        return [
            _x("training_step", "user_annotation", at, 400),
            _x("cudaLaunchKernel", "cuda_runtime", at + 10, 1, correlation=correlation),
            _x("nvjet_sm90_fwd_mm", "kernel", at + 20, 40, tid=7, correlation=correlation),
            _x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", at + 100, 100),
            _x("cudaLaunchKernel", "cuda_runtime", at + 150, 1, correlation=correlation + 1),
            _x("nvjet_sm90_bwd_mm", "kernel", at + 160, 40, tid=7, correlation=correlation + 1),
        ]

    trace = {"traceEvents": one_step(0, 1) + one_step(1000, 3)}
    kernels = kernels_of_trace(trace)
    assert [(k.name, k.in_backward) for k in sorted(kernels, key=lambda k: k.start)] == [
        ("nvjet_sm90_fwd_mm", False), ("nvjet_sm90_bwd_mm", True),
        ("nvjet_sm90_fwd_mm", False), ("nvjet_sm90_bwd_mm", True)]
    # Without the step marks the two backwards make one stretch, which takes in the second forward.
    unmarked = kernels_of_trace({"traceEvents": [e for e in trace["traceEvents"] if e["name"] != "training_step"]})
    assert [k.in_backward for k in sorted(unmarked, key=lambda k: k.start)] == [False, True, True, True]


def test_the_profile_script_profiles_the_full_step_by_default():
    path = Path(__file__).resolve().parents[1] / "scripts" / "leaderboard_2026_profile.py"
    spec = importlib.util.spec_from_file_location("leaderboard_2026_profile", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = script.parser().parse_args([])
    assert (args.layers, args.world_size, args.warmup_steps, args.steps) == (34, 2, 1, 1)
    assert args.stacks == ["ours", "torch"] and args.checkpoint_plan == "auto"
    auto = script.parser().parse_args(["--checkpoint-plan", "auto", "--memory-margin-gib", "6"])
    assert (auto.checkpoint_plan, auto.memory_margin_gib) == ("auto", 6.0)
    with pytest.raises(SystemExit):
        script.parser().parse_args(["--checkpoint-plan", "keep"])


def test_the_profile_row_names_the_recomputed_kernels():
    path = Path(__file__).resolve().parents[1] / "scripts" / "leaderboard_2026_profile.py"
    spec = importlib.util.spec_from_file_location("leaderboard_2026_profile", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    kernels = [StepKernel("nvjet_sm90_a", 0, 4000), StepKernel("attn_fwd_kernel", 4000, 5000),
               StepKernel("attn_fwd_kernel", 5000, 5500, in_backward=True),
               StepKernel("nvjet_sm90_fwd", 5500, 7500, in_backward=True, in_forward_range=True),
               StepKernel("attn_bwd_kernel", 7500, 9000, in_backward=True)]
    row = script.step_row(kernels, wall_ms=10.0, steps=1, top=5)
    assert row["top_recompute_kernels"] == {"nvjet_sm90_fwd": 2.0, "attn_fwd_kernel": 0.5}
    assert row["split_ms"]["recompute"] == pytest.approx(2.5) and row["idle_ms"] == pytest.approx(1.0)
    assert row["idle_gaps"]["gap_count"] == 0
