"""A small, synthetic results directory with a row set for every section of the writeup.

The rows have the keys the benchmark tools write (``cs336_systems.bench.common.result_store.ResultStore`` rows: configuration, measurements,
``config_keys``, ``device``, ``env``), with made-up but plausible numbers, so that ``tests/test_writeup.py``
can build the whole writeup on a CPU in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

GPU = "NVIDIA H100 80GB HBM3"


def env(gpus: int = 1, gpu: str = GPU) -> dict[str, Any]:
    return {"device": f"{gpus}x {gpu}", "gpu_name": gpu, "gpu_count": gpus, "torch": "2.11.0+cu130",
            "triton": "3.6.0", "cuda": "13.0", "python": "3.12.3", "date": "2026-11-22T16:00:00Z",
            "commit": "0123456789ab"}


def row(problem: str, config: dict[str, Any], measured: dict[str, Any], gpus: int = 1, gpu: str = GPU) -> dict:
    e = env(gpus, gpu)
    return {"run": "20261122T160000Z-abcdef", "problem": problem, **config, **measured,
            "config_keys": sorted(config), "device": e["device"], "env": e}


def timing(mean: float, prefix: str = "") -> dict[str, float]:
    return {f"{prefix}mean_ms": mean, f"{prefix}std_ms": mean * 0.02, f"{prefix}median_ms": mean,
            f"{prefix}min_ms": mean * 0.98, f"{prefix}max_ms": mean * 1.05}


def png(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    plt.imsave(path, [[0.0, 1.0], [1.0, 0.0]])
    return str(path)


def benchmarking_script() -> list[dict]:
    rows = []
    for i, size in enumerate(["small", "medium"]):
        for dtype, speed in (("fp32", 1.0), ("bf16", 0.6)):
            fwd = 20.0 * (i + 1) * speed
            for mode in ("forward", "forward_backward", "train_step"):
                phases = {**timing(fwd, "forward_")}
                total = fwd
                if mode != "forward":
                    phases.update(timing(2 * fwd, "backward_"))
                    total += 2 * fwd
                if mode == "train_step":
                    phases.update(timing(5.0, "optimizer_"))
                    total += 5.0
                config = {"size": size, "context_length": 512, "batch_size": 4, "mode": mode, "dtype": dtype, "attention": "naive",
                              "compile": False, "warmup": 5, "steps": 10, "tag": "sweep"}
                rows.append(row("benchmarking_script", config, {"oom": False, **timing(total), **phases,
                                                                "step_ms": [total] * 10, "mfu": 0.05}))
    for warmup in (0, 1, 2, 5):
        for i, size in enumerate(["small", "medium"]):
            steps = [60.0 * (i + 1)] * 10
            if warmup == 0 and i == 0:
                steps[0] = 400.0
            config = {"size": size, "context_length": 512, "batch_size": 4, "mode": "forward_backward", "dtype": "fp32",
                          "attention": "naive", "compile": False, "warmup": warmup, "steps": 10, "tag": "warmup_study"}
            rows.append(row("benchmarking_script", config, {"oom": False, **timing(sum(steps) / 10),
                                                            **timing(20.0, "forward_"), **timing(40.0, "backward_"),
                                                            "step_ms": steps}))
    # The 2026 handout's 10B model, not tried where the estimate exceeds the GPU (the 2025 edition leaves it out).
    for mode in ("forward", "forward_backward", "train_step"):
        config = {"size": "10B", "context_length": 512, "batch_size": 4, "mode": mode, "dtype": "fp32",
                  "attention": "naive", "compile": False, "warmup": 5, "steps": 10, "tag": "sweep"}
        rows.append(row("benchmarking_script", config, {
            "oom": True, "oom_estimate_gb": 205.0, "oom_reason": "16 bytes per parameter x 12.8e9 parameters > 80 GB"}))
    return rows


def kernel(name: str, ms: float, calls: int, share: float, matmul: bool) -> dict[str, Any]:
    return {"name": name, "ms": ms, "calls": calls, "share": share, "matmul": matmul}


GEMM = "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x64x8_stage3_warpsize1x4x1_ffma_aligna4_execute_kernel"
MUL = "void at::native::elementwise_kernel<128, 2, at::native::BinaryFunctor<float, float, float, MulFunctor"


def phase(gpu_ms: float, matmul_share: float) -> dict[str, Any]:
    return {"gpu_ms": gpu_ms, "kernel_launches": 100.0, "matmul_share": matmul_share,
            "top_kernels": [kernel(GEMM, gpu_ms * 0.6, 48, 0.6, True), kernel(MUL, gpu_ms * 0.1, 24, 0.1, False)],
            "top_non_matmul": [kernel(MUL, gpu_ms * 0.1, 24, 0.1, False)]}


def nsys_profile() -> list[dict]:
    rows = []
    for ctx in (128, 256):
        config = {"size": "small", "context_length": ctx, "batch_size": 4, "dtype": "fp32", "steps": 2}
        attention = {name: {"gpu_ms": 0.2, "flops": flops} for name, flops in
                     (("computing attention scores", 1e9), ("computing softmax", 4e7), ("final matmul", 1e9))}
        rows.append(row("nsys_profile", config, {"oom": False, "forward_python_ms": 10.0 + ctx / 64,
                                                 "forward": phase(8.0, 0.7), "backward": phase(16.0, 0.8),
                                                 "optimizer": phase(5.0, 0.0), "train_step": phase(29.0, 0.6),
                                                 "attention_forward": attention}))
    rows.append(row("nsys_profile", {"size": "medium", "context_length": 1024, "batch_size": 4, "dtype": "fp32", "steps": 2},
                    {"oom": True, "error": "CUDA out of memory. Tried to allocate 100.00 MiB."}))
    return rows


def pytorch_attention(problem: str = "pytorch_attention", extra: dict | None = None) -> list[dict]:
    rows = []
    attentions = ["naive", "compiled"] if extra else ["naive"]
    for attention in attentions:
        for d in (16, 32):
            for seq in (256, 1024):
                config = dict(attention=attention, batch_size=8, d=d, seq_len=seq, passes=100, dtype="fp32", **(extra or {}))
                saved = 3 * 4 * 8 * seq * seq / 1e9 + seq * seq / 1e9
                rows.append(row(problem, config, {"oom": False, **timing(0.1 * seq / 256, "forward_"),
                                                  **timing(0.3 * seq / 256, "backward_"),
                                                  "memory_before_backward_gb": saved + 0.001, "saved_for_backward_gb": saved}))
    if not extra:
        rows.append(row(problem, {"attention": "naive", "batch_size": 8, "d": 32, "seq_len": 4096, "passes": 100, "dtype": "fp32"},
                        {"oom": True, "error": "CUDA out of memory. GPU 0 has a total capacity of 79.18 GiB of which"}))
    return rows


def torch_compile() -> list[dict]:
    rows = pytorch_attention("torch_compile", {"part": "attention"})
    for compiled in (False, "inductor"):
        for mode in ("forward", "train_step"):
            config = {"part": "model", "size": "small", "context_length": 512, "batch_size": 4, "mode": mode, "dtype": "fp32",
                          "compile": compiled, "warmup": 5, "steps": 10}
            rows.append(row("torch_compile", config, {"oom": False, **timing(20.0 if compiled else 25.0)}))
    return rows


H200 = "NVIDIA H200"
H200_DAY = "2026-11-29T00:35:00Z"  # the 2.7B memory rows on one H200 come a week after the H100's


def on_h200(r: dict) -> dict:
    """``row`` as measured by a later run on one H200."""
    return {**r, "run": "20261129T003500Z-fedcba", "env": {**r["env"], "date": H200_DAY}}


def block_operation(op: str, caller: str, mib: float, total_mib: float, shape: list[int]) -> dict[str, Any]:
    return {"op": op, "caller": caller, "bytes": int(mib * 2**20), "mib": mib, "share": mib / total_mib,
            "tensors": 1, "dtypes": ["float32"], "shapes": [shape]}


def block_residuals(ctx: int, dtype: str) -> dict[str, Any]:
    """What one block of the 2.7B model saves at ``ctx`` (batch 4): at 128 the feed-forward's matmul leads, at 2048
    the three score-sized matrices of the naive attention; the gradients per block are its 104,862,720 parameters x
    4 B, the first block of the window one residual-stream tensor more (its input's gradient stays alive)."""
    scores, ffn, stream = 4 * 32 * ctx * ctx * 4 / 2**20, 4 * ctx * 10240 * 4 / 2**20, 4 * ctx * 2560 * 4 / 2**20
    ops = [("aten.masked_fill", "scaled_dot_product_attention in causal_attention", scores, [4, 32, ctx, ctx]),
           ("aten.exp", "softmax in scaled_dot_product_attention", scores, [4, 32, ctx, ctx]),
           ("aten.div", "softmax in scaled_dot_product_attention", scores, [128, ctx, ctx]),
           ("aten.mm", "Linear.forward in SwiGLU.forward", 2 * ffn, [4, ctx, 10240]),
           ("aten.sigmoid", "silu in SwiGLU.forward", ffn, [4, ctx, 10240]),
           ("aten.mul", "RMSNorm.forward in TransformerBlock.forward", 4 * stream, [4, ctx, 2560]),
           ("block input", "", stream, [4, ctx, 2560])]
    total = sum(mib for _, _, mib, _ in ops) * (1.5 if dtype == "bf16" else 1.0)  # autocast saves bf16 weight copies
    by_op = sorted((block_operation(op, caller, mib, total, shape) for op, caller, mib, shape in ops),
                   key=lambda o: -o["bytes"])
    residual, parameters = int(total * 2**20), 104_862_720
    gradients = [4 * parameters + int(stream * 2**20)] + [4 * parameters] * 3
    config = {"size": "2.7B", "context_length": ctx, "batch_size": 4, "dtype": dtype, "kind": "block_residuals"}
    return on_h200(row("memory_profiling", config, {
        "oom": False, "blocks": [14, 15, 16, 17], "block_parameters": parameters,
        "residual_stream_bytes": int(stream * 2**20), "residual_bytes": residual, "residual_mib": total,
        "residual_tensors": 27, "top_operations": by_op[:5], "saved_by_operation": by_op,
        "residual_bytes_by_block": [residual] * 4, "forward_change_bytes": [residual] * 4,
        "backward_change_bytes": [g - residual for g in gradients], "gradient_bytes_implied": gradients,
        "gradient_bytes_measured": 4 * parameters, "gradient_bytes_expected": 4 * parameters,
        "gradient_ratio": 1.0}, gpu=H200))


def memory_profiling(figures: Path) -> list[dict]:
    rows = []
    # The 2025 edition's peaks: contexts 128 and 256 on an H100.
    for ctx in (128, 256):
        for dtype in ("fp32", "bf16"):
            for mode in ("inference", "forward", "train_step"):
                config = {"size": "2.7B", "context_length": ctx, "batch_size": 4, "mode": mode, "dtype": dtype, "kind": "peak"}
                rows.append(row("memory_profiling", config, {"oom": False, "peak_gb": 20.0 + ctx / 64 + len(mode),
                                                             "params_gb": 13.6}))
    # An earlier recording of the H100 (snapshots named by their source line): the sections show the latest one.
    scores = ["cs336_basics/model.py:122 scaled_dot_product_attention", "cs336_basics/model.py:250 forward"]
    for mode, dtype in (("inference", "fp32"), ("train_step", "fp32")):
        config = {"size": "2.7B", "context_length": 256, "batch_size": 4, "mode": mode, "dtype": dtype, "kind": "timeline"}
        allocations = [{"mb": 32.0, "count": 96, "source": scores[0], "stack": scores}]
        rows.append(row("memory_profiling", config, {"oom": False, "figure": png(figures / f"memory_{mode}_{dtype}.png"),
                                                     "timeline_peak_gb": 40.0, "largest_allocations": allocations,
                                                     "snapshot": f"memory_2.7B_{mode}_{dtype}_ctx256.pickle"}))
    # The 2026 handout's contexts, 128 and 2048, on an H200: the forward with autograd and the step out of memory at
    # 2048.
    for ctx in (128, 2048):
        for dtype in ("fp32", "bf16"):
            for mode in ("inference", "forward", "train_step"):
                config = {"size": "2.7B", "context_length": ctx, "batch_size": 4, "mode": mode, "dtype": dtype,
                          "kind": "peak"}
                oom = ctx == 2048 and mode != "inference"
                measured = ({"oom": True, "error": "CUDA out of memory. Tried to allocate 80.00 MiB. GPU 0 has a total "
                             "capacity of 139.80 GiB of which 35.12 MiB is free."} if oom else
                            {"oom": False, "peak_gb": 14.0 + ctx / 256 + len(mode) + (dtype == "bf16"),
                             "params_gb": 13.6})
                rows.append(on_h200(row("memory_profiling", config, measured, gpu=H200)))
    rows += [block_residuals(ctx, dtype) for ctx in (128, 2048) for dtype in ("fp32", "bf16")]
    # The timelines at the longest context that fits each case, coloured by what each allocation holds. At 2048 the
    # scores are 4 * 32 * 2048^2 * 4 bytes = 2,048 MiB in fp32 (the softmax's under autocast too), 1,024 MiB in bf16.
    softmax = ["cs336_basics/nn_utils.py:15 softmax", "cs336_basics/model.py:127 scaled_dot_product_attention"]
    masked = ["cs336_basics/model.py:126 scaled_dot_product_attention", "cs336_basics/model.py:138 causal_attention"]
    def allocation(mib: float, count: int, stack: list[str], category: str) -> dict[str, Any]:
        return {"mb": mib, "count": count, "source": stack[0], "stack": stack, "category": category}

    allocations = {
        "fp32": [allocation(2048.0, 64, masked, "attention: scores, mask"),
                 allocation(2048.0, 32, softmax, "attention: softmax"),
                 allocation(320.0, 64, ["cs336_basics/model.py:101 silu"], "feed-forward (SwiGLU)")],
        "bf16": [allocation(2048.0, 64, softmax, "attention: softmax"),
                 allocation(1024.0, 64, masked, "attention: scores, mask")],
    }
    at_peak = {  # (mode, dtype): what is alive at the timeline's peak, GB
        ("inference", "fp32"): {"allocated before the recording": 13.6, "attention: scores, mask": 2.1,
                                "attention: softmax": 6.4, "attention: RoPE": 0.2},
        ("inference", "bf16"): {"allocated before the recording": 13.6, "attention: scores, mask": 1.1,
                                "attention: softmax": 5.4},
        ("forward", "fp32"): {"allocated before the recording": 13.7, "feed-forward (SwiGLU)": 3.4, "RMSNorm": 0.7,
                              "attention: softmax": 0.5},
        ("train_step", "fp32"): {"allocated before the recording": 0.03, "weights": 13.6,
                                 "optimizer state (AdamW)": 27.2, "gradients (parameters')": 13.6},
    }
    for (mode, dtype), alive in at_peak.items():
        ctx = 2048 if mode == "inference" else 128
        stem = f"memory_2.7B_{mode}_{dtype}_ctx{ctx}"
        config = {"size": "2.7B", "context_length": ctx, "batch_size": 4, "mode": mode, "dtype": dtype,
                  "kind": "timeline"}
        html = figures / f"{stem}.html"
        html.parent.mkdir(parents=True, exist_ok=True)
        html.write_text("<html></html>")
        rows.append(on_h200(row("memory_profiling", config, {
            "oom": False, "snapshot": f"{stem}.pickle", "steps_recorded": 2 if mode == "train_step" else 1,
            "figure": png(figures / f"{stem}.png"), "html": str(html), "html_bytes": 13,
            "timeline_peak_gb": sum(alive.values()), "before_recording_gb": alive["allocated before the recording"],
            "peak_by_category_gb": alive,
            "largest_allocations": allocations.get(dtype if mode == "inference" else "", [])}, gpu=H200)))
    return rows


def gradient_checkpointing() -> list[dict]:
    rows = []
    # The 2025 xl (48 blocks, shown by the 2025 edition; k* = sqrt(48 a / b) = 1.55, best integer 2) and the 2026 xl
    # (canonical 2.7B, 32 blocks; k* = 0.53, below one block, so 1).
    cases = (("xl", 48, 0.05, 1.0, 2), ("2.7B", 32, 0.08, 9.0, 1))
    for (size, n_blocks, a, b, best), k in ((case, k) for case in cases for k in (1, 2, 4, 0)):
        config = {"size": size, "context_length": 2048, "batch_size": 4, "dtype": "fp32", "attention": "naive", "group_size": k}
        act = n_blocks * b if k == 0 else -(-n_blocks // k) * a + k * b
        rows.append(row("gradient_checkpointing", config, {
            "oom": k == 0, **({} if k == 0 else {**timing(900.0 + 100 * k), "peak_gb": 32.0 + act}),
            "n_blocks": n_blocks, "saved_per_block_gb": b, "group_input_gb": a, "model_state_gb": 32.0,
            "predicted_optimum": best, "predicted_activation_gb": act, "predicted_peak_gb": 32.0 + act}))
    return rows


def flash_benchmarking() -> list[dict]:
    rows = []
    for provider, factor in (("triton", 1.0), ("pytorch", 3.0)):
        for dtype in ("bf16", "fp32"):
            for seq in (128, 256, 512):
                for d in (16, 32):
                    config = {"provider": provider, "seq_len": seq, "d_head": d, "dtype": dtype}
                    if provider == "pytorch" and seq == 512:
                        rows.append(row("flash_benchmarking", config, {"oom": True}))
                        continue
                    ms = factor * 0.01 * seq / 128
                    rows.append(row("flash_benchmarking", config, {"oom": False, "fwd_ms": ms, "bwd_ms": 2 * ms,
                                                                   "fwd_bwd_ms": 3 * ms}))
    # The bf16 re-run on an H200 after the Hopper kernels (fewer rows: the H100 stays the main device): ours
    # within 1.10x cuDNN at 16384 x 64 only, and faster than FA2 everywhere.
    for (seq, d), ours in {(16384, 64): 1.05, (16384, 128): 1.2, (8192, 64): 2.0}.items():
        for provider, ms in (("ours", ours), ("sdpa_cudnn", 1.0), ("sdpa_flash", 1.5)):
            config = {"provider": provider, "seq_len": seq, "d_head": d, "dtype": "bf16"}
            rows.append(row("flash_benchmarking", config, {"oom": False, "fwd_ms": ms / 4, "bwd_ms": ms * 3 / 4,
                                                           "fwd_bwd_ms": ms}, gpu="NVIDIA H200"))
    return rows


def leaderboard() -> list[dict]:
    extra = {"ours": {"verified": True, "graph_breaks": 2, "graph_breaks_after_first_call": 0,
                      "heads": 16, "seq_len": 16384, "d_head": 64, "dtype": "bf16"}}
    return [row("leaderboard", {"provider": p}, {"fwd_bwd_ms": ms, "fwd_ms": ms / 3, **extra.get(p, {})})
            for p, ms in (("ours", 10.0), ("sdpa_cudnn", 8.0), ("sdpa_flash", 9.0), ("sdpa_efficient", 14.0))]


PROBE = ("(16, 16384, 64): ours fwd 1.5 bwd 4.6 fb 6.1 (1.35x)  baseline fwd 1.5 bwd 4.8 fb 6.4 (1.40x)\n"
         "leaderboard ours: {ours} ms\nleaderboard baseline: {base} ms\n")


def flash_probe(results: Path) -> None:
    """Plain-text outputs of scripts/flash_probe.py, one per step of the earlier history (before the log)."""
    (results / "flash_probe").mkdir(parents=True, exist_ok=True)
    for name, ours, base in (("step1_fused_backward", 6.5, 6.2), ("step2_autotune_cache", 6.25, 6.29)):
        (results / "flash_probe" / f"{name}.txt").write_text(PROBE.format(ours=ours, base=base))


def flash_log_point(seq_len: int, d_head: int, ours: float, cudnn: float, fa2: float) -> dict[str, Any]:
    return {"seq_len": seq_len, "d_head": d_head, "ours_fwd_ms": ours / 4, "ours_bwd_ms": ours * 3 / 4,
            "ours_fwd_bwd_ms": ours, "sdpa_cudnn_fwd_bwd_ms": cudnn, "sdpa_flash_fwd_bwd_ms": fa2,
            "ratio_vs_cudnn": ours / cudnn, "ratio_vs_fa2": ours / fa2}


def flash_log_step(step: str, hypothesis: str, decision: str, ours: float, bwd_scale: float) -> dict:
    """A measured step as ``python -m cs336_systems.bench.flash_log`` writes it (H200, the leaderboard shape
    and two sweep points)."""
    board = {"ours_fwd_bwd_ms": ours, "ours_fwd_ms": ours / 4, "sdpa_cudnn_fwd_bwd_ms": 4.5, "sdpa_cudnn_fwd_ms": 1.3,
             "ratio_vs_cudnn": ours / 4.5, "verified": True, "graph_breaks": 0, "graph_breaks_after_first_call": 0,
             "graph_break_reasons": [], "our_kernels": ["attn_fwd_kernel", "attn_bwd_kernel"],
             "foreign_attention_kernels": [], "matches_sdpa": True}
    points = [flash_log_point(16384, 64, 0.8, 0.5, 0.9), flash_log_point(65536, 128, 12.0 * bwd_scale, 7.2, 12.5)]
    logged = row("flash_optimisation_log", {"step": step},
                 {"hypothesis": hypothesis, "decision": decision, "note": "", "commit": "0123456", "dirty": False,
                  "leaderboard": board, "points": points, "leaderboard_rep_ms": 2000, "point_rep_ms": 100},
                 gpu="NVIDIA H200")
    return {**logged, "run": "20261123T050000Z-abcdef"}  # after the leaderboard run that closed the history


def flash_optimisation_log() -> list[dict]:
    """Two measured steps and a later ``--set-decision`` row (run on a machine without a GPU) for the second."""
    decided = {"run": "20261123T060000Z-fedcba", "problem": "flash_optimisation_log", "step": "gluon-backward",
               "decision": "kept", "note": "the d=128 backward won a third", "config_keys": ["step"],
               "device": "cpu (x86_64)", "env": {**env(), "device": "cpu (x86_64)", "gpu_name": None, "gpu_count": 0,
                                                  "date": "2026-11-23T06:00:00Z"}}
    return [flash_log_step("triton-baseline", "The Triton backward as it stood", "baseline", 6.0, 1.0),
            flash_log_step("gluon-backward", "A Gluon backward on Hopper should cut the d=128 backward", "pending",
                           5.4, 0.75),
            decided]


def all_reduce() -> list[dict]:
    rows = []
    for backend, bandwidth, latency in (("gloo", 2e9, 1e-3), ("nccl", 200e9, 2e-5)):
        for ws in (2, 4):
            for size_mb in (1, 10, 100, 1000):
                seconds = latency + size_mb * 1e6 / bandwidth
                algbw = size_mb * 1e6 / seconds / 1e9
                rows.append(row("distributed_communication_single_node",
                                {"backend": backend, "world_size": ws, "size_mb": size_mb},
                                {"time_ms": seconds * 1e3, "algbw": algbw, "busbw": algbw * 2 * (ws - 1) / ws},
                                gpus=ws, gpu="NVIDIA H200"))
    return rows


GRAD_BYTES = 7_992_940_800  # the xl model's fp32 gradients


def ddp_benchmarking(figures: Path) -> list[dict]:
    """Every variant in fp32 and bf16, each with the local step of its own launch (``compute_ms``); bf16 local
    steps differ between launches, as on the GPUs."""
    rows = []
    calls = {"local": 0, "naive": 435, "flat": 1, "overlap": 435, "torch_ddp": None,
             "bucketed_1mb": 435, "bucketed_10mb": 339, "bucketed_100mb": 98, "bucketed_1000mb": 8}
    for dtype, local, scale in (("fp32", 600.0, 1.0), ("bf16", 250.0, 0.5)):
        cases = [("local", None, 0.0, 0.0), ("naive", None, 300.0, 300.0), ("flat", None, 200.0, 200.0),
                 ("overlap", None, 60.0, 60.0), ("torch_ddp", None, None, 40.0)]
        cases += [(f"bucketed_{mb}mb", mb, 20.0, 30.0 + abs(mb - 100) / 10) for mb in (1, 10, 100, 1000)]
        for i, (variant, mb, comm, exposed) in enumerate(cases):
            compute = local + (i % 3) * 10.0 * (dtype == "bf16")  # bf16: the local step varies between launches
            config = {"variant": variant, "dtype": dtype, "size": "xl", "world_size": 2}
            measured = {"bucket_mb": None if mb is None else float(mb), "step_ms": compute + exposed * scale,
                        "comm_ms": None if comm is None else comm * scale, "exposed_ms": exposed * scale,
                        "compute_ms": compute, "n_buckets": calls[variant], "grad_bytes": GRAD_BYTES}
            if variant in ("naive", "overlap", "bucketed_100mb"):
                measured["trace_figure"] = png(figures / f"ddp_overlap_{variant}_{dtype}.png")
                measured["trace_overlap_share"] = {"naive": 0.0, "overlap": 0.8, "bucketed_100mb": 0.9}[variant]
                measured["trace_comm_busy_ms"] = 50.0
                measured["trace_comm_exposed_ms"] = 50.0 * (1 - measured["trace_overlap_share"])
            rows.append(row("ddp_benchmarking", config, measured, gpus=2, gpu="NVIDIA H200"))
    return rows + ddp_on_four_gpus()


def ddp_ratio_check() -> list[dict]:
    """scripts/ddp_ratio_check.py on the DDP rows' 2 GPUs in both dtypes, and once on the later host of 4."""
    rows = [row("ddp_ratio_check", {"size": "xl", "context_length": 512, "batch_size": 4, "dtype": dtype,
                                    "bucket_mb": 100.0, "world_size": 2, "backend": "nccl"},
                {"torch_ddp_ms": 300.0, "bucketed_ms": 300.0 * ratio, "ratio": ratio}, gpus=2, gpu="NVIDIA H200")
            for dtype, ratio in (("fp32", 0.99), ("bf16", 1.01))]
    rows.append(row("ddp_ratio_check", {"size": "large", "context_length": 512, "batch_size": 4, "dtype": "bf16",
                                        "bucket_mb": 100.0, "world_size": 4, "backend": "nccl"},
                    {"torch_ddp_ms": 240.0, "bucketed_ms": 230.0, "ratio": 230.0 / 240.0}, gpus=4,
                    gpu="NVIDIA H100 80GB HBM3"))
    return rows


def ddp_on_four_gpus() -> list[dict]:
    """A later host of 4 GPUs: every variant at 4 ranks once, then PyTorch's DDP and our 1000 MiB bucketed DDP in
    alternating launches (three each) at 2 and 4 ranks, bf16."""
    rows = []
    gpu = "NVIDIA H100 80GB HBM3"
    for dtype, local in (("fp32", 800.0), ("bf16", 320.0)):
        for variant in ("local", "naive", "flat", "overlap", "bucketed_100mb", "bucketed_1000mb", "torch_ddp"):
            mb = {"bucketed_100mb": 100.0, "bucketed_1000mb": 1000.0}.get(variant)
            exposed = {"local": 0.0, "naive": 80.0, "flat": 70.0, "overlap": 60.0}.get(variant, 30.0)
            config = {"variant": variant, "dtype": dtype, "size": "xl", "world_size": 4}
            measured = {"bucket_mb": mb, "step_ms": local + exposed, "comm_ms": None if variant == "torch_ddp" else 20.0,
                        "exposed_ms": exposed, "compute_ms": local, "n_buckets": 8, "grad_bytes": GRAD_BYTES}
            rows.append(row("ddp_benchmarking", config, measured, gpus=4, gpu=gpu))
    for ws in (2, 4):
        for launch in range(3):
            for variant, exposed in (("torch_ddp", 40.0 + launch), ("bucketed_1000mb", 30.0 + 2 * launch)):
                config = {"variant": variant, "dtype": "bf16", "size": "xl", "world_size": ws}
                measured = {"bucket_mb": 1000.0 if variant != "torch_ddp" else None, "step_ms": 320.0 + exposed,
                            "comm_ms": 20.0, "exposed_ms": exposed, "compute_ms": 320.0, "n_buckets": 8,
                            "grad_bytes": GRAD_BYTES}
                rows.append(row("ddp_benchmarking", config, measured, gpus=4, gpu=gpu))
    return rows


def optimizer_state_sharding_accounting() -> list[dict]:
    """Three optimizers on 2 GPUs, and the four (flat ZeRO-1 too) on a host of 4."""
    return sharding_rows(2, "NVIDIA H200", ("adamw", "sharded", "zero_redundancy")) + sharding_rows(
        4, "NVIDIA H100 80GB HBM3", ("adamw", "sharded", "zero_redundancy", "zero1_flat"))


def sharding_rows(world: int, gpu: str, optimizers: tuple[str, ...]) -> list[dict]:
    rows = []
    for dtype, activations in (("fp32", 34.0), ("bf16", 26.0)):
        for optimizer in optimizers:
            state = 16.0 if optimizer == "adamw" else 16.0 / world
            memory = {stage: {"params_gb": 8.0, "grads_gb": 8.0 if stage != "after_init" else 0.0,
                              "optimizer_state_gb": state if stage != "after_init" else 0.0,
                              "peak_gb": 16.0 + state + (activations if stage == "before_step" else 0.0)}
                      for stage in ("after_init", "before_step", "after_step")}
            rows.append(row("optimizer_state_sharding_accounting",
                            {"optimizer": optimizer, "dtype": dtype, "size": "xl", "world_size": world,
                             "ddp": "bucketed_100mb", "context_length": 512, "batch_size": 4},
                            {"step_ms": (700.0 if dtype == "fp32" else 300.0) + state, "steps": 5,
                             "peak_gb": 16.0 + state + activations, "peak_at": "before_step",
                             "optimizer_state_gb": state, "memory": memory}, gpus=world, gpu=gpu))
    return rows


def fsdp_accounting(figures: Path) -> list[dict]:
    h200 = {"gpus": 2, "gpu": "NVIDIA H200"}
    rows = [row("fsdp_accounting", {"measure": "check", "impl": "ours", "size": "tiny", "context_length": 64,
                                    "world_size": 2, "dtype": dtype, "backend": "nccl"},
                {"max_abs_diff": 0.0, "bit_exact": True, "passed": True, "steps": 3}, **h200)
            for dtype in ("fp32", "bf16")]
    # A row of the earlier FSDP (per Linear layer, before the `checkpointing` key): the writeup leaves it out.
    old = row("fsdp_accounting", {"measure": "step", "impl": "ours", "size": "xl", "context_length": 512,
                                  "world_size": 2, "dtype": "bf16", "batch_per_rank": 4},
              {"step_ms": 999.0, "peak_gb": 99.0, "state_gb": 20.4, "local_params": 999_117_600}, **h200)
    old["env"] = {**old["env"], "date": "2026-11-21T16:00:00Z"}
    rows.append(old)
    cases = [(0, "ddp", 300.0, 50.8, 24.5, 1_998_235_200), (0, "fsdp2", 400.0, 31.1, 12.3, 999_117_600),
             (0, "ours", 320.0, 30.8, 12.1, 999_117_600), (1, "fsdp2", 660.0, 17.1, 12.3, 999_117_600),
             (1, "ours", 363.0, 16.9, 12.1, 999_117_600)]
    for checkpointing, impl, step, peak, state, local in cases:
        rows.append(row("fsdp_accounting", {"measure": "step", "impl": impl, "size": "xl", "context_length": 512,
                                            "world_size": 2, "dtype": "bf16", "batch_per_rank": 4,
                                            "checkpointing": checkpointing},
                        {"step_ms": step, "mean_ms": step * 1.02, "std_ms": step * 0.1, "peak_gb": peak,
                         "state_gb": state, "params": 1_998_235_200, "local_params": local, "warmup": 3, "steps": 10,
                         "expected_state_gb": 16 * local / 1e9}, **h200))
    # Today's rows: 2 H100s with both AdamWs (5 timed steps, reserved peaks), 4 H100s with and without checkpointing.
    for world, optimizer, checkpointing, impl, step, peak, reserved, steps in (
            (2, None, 0, "fsdp2", 575.0, 31.1, 36.68, 5), (2, None, 0, "ours", 456.0, 30.85, 36.92, 5),
            (2, "torch", 0, "fsdp2", 668.0, 31.09, 36.68, 5), (2, "torch", 0, "ours", 517.0, 30.85, 40.35, 5),
            (4, None, 0, "fsdp2", 620.0, 24.94, 28.41, 10), (4, None, 0, "ours", 425.0, 24.98, 28.52, 10),
            (4, None, 1, "fsdp2", 792.0, 9.11, 11.36, 10), (4, None, 1, "ours", 720.0, 9.14, 13.59, 10)):
        config = {"measure": "step", "impl": impl, "size": "xl", "context_length": 512, "world_size": world,
                  "dtype": "bf16", "batch_per_rank": 4, "checkpointing": checkpointing,
                  **({"optimizer": optimizer} if optimizer else {})}
        rows.append(row("fsdp_accounting", config,
                        {"step_ms": step, "mean_ms": step * 1.02, "std_ms": step * 0.1, "peak_gb": peak,
                         "reserved_gb": reserved, "first_step_peak_gb": peak - 8.0, "state_gb": 24.0 / world,
                         "params": 1_998_235_200, "local_params": 1_998_235_200 // world,
                         "warmup": 2 if steps < 10 else 3, "steps": steps}, gpus=world))
    rows.append(row("fsdp_accounting", {"measure": "timeline", "impl": "ours", "size": "xl", "world_size": 2,
                                        "dtype": "bf16", "context_length": 512, "batch_per_rank": 4},
                    {"span_ms": 480.0, "compute_ms": 225.0, "comm_ms": 440.0, "comm_hidden_ms": 200.0,
                     "comm_exposed_ms": 240.0, "reduce_scatters": 50, "forward_gathers": 50,
                     "forward_gathers_exposed": 40, "forward_stall_ms": 160.0, "backward_gathers": 48,
                     "backward_gathers_exposed": 48, "backward_stall_ms": 207.0,
                     "figure": png(figures / "fsdp_timeline.png")}, **h200))
    return rows


FSDP_SNAPSHOT_REPORT = """# 15:26:52 python3 scripts/memory_snapshot_report.py snapshots/fsdp_{impl}_{optimizer}.pickle
snapshots/fsdp_{impl}_{optimizer}.pickle: peak of the recorded step {peak:.2f} GB in 1409 blocks
      GB  blocks  allocated at
  {state:.3f}       1  (allocated before recording)
   2.517      48  cs336_basics/nn_utils.py:15 softmax
   2.517      96  cs336_basics/model.py:101 silu
   0.266       5  (no stack)
   0.082       1  cs336_systems/bench/fsdp_accounting.py:168 step
{own}   0.001      97  cs336_basics/model.py:77 forward
   0.000       1  cs336_basics/nn_utils.py:28 cross_entropy
"""


def fsdp_memory_log(results: Path) -> None:
    """What scripts/memory_snapshot_report.py printed for the 2-H100 snapshots of ours and FSDP2, with the
    benchmark's own output around it (a table of rows that is not a report)."""
    folder = results / "h100x2-fsdp-memory"  # fsdp_accounting's FSDP_MEMORY_LOG
    folder.mkdir(parents=True, exist_ok=True)
    bench = ("# 15:25:21 (at most 200s) python3 -m cs336_systems.bench.fsdp_accounting --optimizer torch\n"
             " impl  checkpointing  step_ms  peak_gb\nfsdp2              0   667.99    31.09\n")
    gather = "   {:.3f}       1  cs336_systems/parallel/fsdp/transport.py:126 _allocate\n"
    reports = [FSDP_SNAPSHOT_REPORT.format(impl=impl, optimizer=optimizer, peak=5.383 + state + own, state=state,
                                           own=gather.format(own) if own else "")
               for impl, state, own in (("fsdp2", 12.264, 0.0), ("ours", 12.057, 0.032))
               for optimizer in ("basics", "torch")]
    (folder / "part_fsdp_memory.log").write_text(bench + "".join(reports))


def rmsnorm() -> list[dict]:
    """Kernel rows of two runs: an earlier one without ``copy_share`` (an older version of the tool, left out
    of the writeup) and the newest, bf16 and fp32 at two row counts and two hidden sizes, each shape's copy
    first; and one model row with the plain norm only."""
    stale = [row("rmsnorm", {"part": "kernel", "rows": 8192, "cols": 768, "dtype": "bf16", "provider": p, "pass": q},
                 {"ms": 0.01, "gbps": 9999.0}) for p, q in (("copy", "copy"), ("ours", "fwd"))]
    rows = []
    for dtype in ("bf16", "fp32"):
        for n_rows in (4096, 65536):
            for cols in (768, 8192):
                shape = {"part": "kernel", "rows": n_rows, "cols": cols, "dtype": dtype}
                rows.append(row("rmsnorm", {**shape, "provider": "copy", "pass": "copy"},
                                {"ms": 0.01, "gbps": 2500.0, "copy_gbps": 2500.0, "copy_share": 1.0}))
                for provider, speed in (("ours", 2000.0), ("eager", 250.0), ("compile", 1500.0), ("liger", 1800.0)):
                    for pass_, factor in (("fwd", 1.0), ("fwd_bwd", 0.8)):
                        gbps = speed * factor * (1.1 if cols == 8192 else 1.0)
                        rows.append(row("rmsnorm", {**shape, "provider": provider, "pass": pass_},
                                        {"ms": 0.01, "gbps": gbps, "copy_gbps": 2500.0, "copy_share": gbps / 2500.0}))
    for r in rows:
        r["run"], r["env"] = "20261126T160000Z-newest", {**r["env"], "date": "2026-11-26T16:00:00Z"}
    rows.append(row("rmsnorm", {"part": "model", "size": "xl", "norm": "plain", "mode": "train_step",
                                "dtype": "bf16", "context_length": 512}, {"oom": False, **timing(160.0)}))
    return stale + rows


def residual_norm_timing() -> list[dict]:
    """The residual add fused into the RMSNorm against the add then the norm: three shapes, two streams, two
    passes. Fused over separate is 0.70 to 0.80 at the two shapes of at least 64M elements; at (16384, 1600) it is
    1.05 with the bf16 stream and 0.90 with the float32 one."""
    ratios = {(16384, 1600): {"bf16": 1.05, "fp32": 0.9}, (65536, 1280): {"bf16": 0.8, "fp32": 0.7},
              (32768, 4096): {"bf16": 0.75, "fp32": 0.7}}
    rows = []
    for (n_rows, d_model), by_stream in ratios.items():
        for stream, ratio in by_stream.items():
            for pass_, separate in (("forward", 0.2), ("forward_backward", 0.5)):
                config = {"n_rows": n_rows, "d_model": d_model, "stream_dtype": stream, "pass": pass_,
                          "branch_dtype": "bf16"}
                rows.append(row("residual_norm_timing", config, {"fused_ms": separate * ratio, "separate_ms": separate,
                                                                  "fused_over_separate": ratio}))
    return rows


def train_step_residual_norm(rows: list[dict]) -> list[dict]:
    """Two alternating launches each of ours' default variant of xl at 512 x 4 with the residual adds separate and
    fused into the norms: copies of that row, the separate launches last at its step time (so that the section of
    the stacks shows the same numbers). Medians 112 and 110 ms separate, 118 and 109 ms fused."""
    (base,) = [r for r in rows if (r["size"], r["context_length"], r["stack"], r.get("variant")) == ("xl", 512, "ours",
                                                                                                   "default")]
    launches = []
    for i, (choice, ms) in enumerate((("separate", 112.0), ("fused", 118.0), ("separate", 110.0), ("fused", 109.0))):
        r = {**base, **timing(ms), "step_ms": ms, "residual_norm": choice, "run": f"20261126T15400{i}Z-resid{i}",
             "config_keys": sorted([*base["config_keys"], "residual_norm"]),
             "parts": {**base["parts"], "fused_residual_norm": choice == "fused"}}
        launches.append(r)
    return rows + launches


PARTS = {"torch": {"attention": "sdpa", "rmsnorm": "plain", "loss": "plain", "optimizer": "torch_fused",
                   "compile": "blocks", "checkpointing": 0},
         "ours": {"attention": "triton", "rmsnorm": "fused", "loss": "fused", "optimizer": "fused",
                  "compile": "blocks", "checkpointing": 0}}


def train_step_old_protocol() -> list[dict]:
    """The earlier protocol's rows (no ``variant``, on an H200): kept in the file, left out of the section."""
    rows = []
    for size, base in (("small", 20.0), ("xl", 100.0)):
        for context, batch in ((512, 4), (8192, 1)):
            scale = 1.0 if context == 512 else 3.0
            steps = {}
            for stack, slower in (("torch", 1.0), ("ours", 1.2)):
                step = base * scale * slower
                steps[stack] = step
                config = {"size": size, "context_length": context, "batch_size": batch, "stack": stack,
                          "overrides": [], "dtype": "bf16", "warmup": 2, "steps": 6}
                measured = {"oom": False, **timing(step), "step_ms": step, "peak_gb": 5.0 * scale,
                            "first_step_s": 8.0, "parts": PARTS[stack], "forward_ms": 0.3 * step,
                            "backward_ms": 0.55 * step, "optimizer_ms": 0.15 * step, "flops": 1e13 * scale,
                            "peak_tflops": 750.0, "mfu": 1e13 * scale / (step / 1e3) / 750e12}
                earlier = stack == "torch" and size == "small"
                run = "20261122T150000Z-torch0" if earlier else "20261122T160000Z-abcdef"
                if stack == "ours":
                    measured.update(ours_over_torch=step / steps["torch"],
                                    torch_run="20261122T150000Z-torch0" if size == "small" else run)
                r = row("train_step", config, measured, gpu="NVIDIA H200")
                r["run"] = run
                rows.append(r)
    return rows


VARIANT_PARTS = {"default": {"cudagraphs": False}, "cudagraphs": {"cudagraphs": True}}
STACK_WEIGHTS = {"torch": {}, "ours": {"weights": "bf16"}}  # torch's rows leave out the default (fp32)


def train_step() -> list[dict]:
    """The current protocol (H100): both stacks in both variants on small and xl at 512 x 4 and xl at 8,192 x 1,
    and a lone torch default row of small at 8,192 x 1. Ours' best over torch's best: 0.90x at xl 512 x 4 (46 % MFU),
    1.02x elsewhere. The small model's torch rows come from an earlier invocation; the earlier protocol's H200 rows
    stay in the file."""
    rows = train_step_old_protocol()
    now, earlier = "20261124T160000Z-abcdef", "20261124T150000Z-torch0"
    for size, base in (("small", 20.0), ("xl", 100.0)):
        for context, batch in ((512, 4), (8192, 1)):
            scale = 1.0 if context == 512 else 3.0
            flops = (1e12 if size == "small" else 2.5e13) * scale
            torch_default = base * scale
            torch_graphs = torch_default * (0.8 if context == 512 else 0.98)
            ours_graphs = torch_graphs * (0.9 if (size, context) == ("xl", 512) else 1.02)
            steps = {("torch", "default"): torch_default, ("torch", "cudagraphs"): torch_graphs,
                     ("ours", "default"): torch_default * 1.1, ("ours", "cudagraphs"): ours_graphs}
            if (size, context) == ("small", 8192):
                steps = {("torch", "default"): torch_default}
            for (stack, variant), step in steps.items():
                config = {"size": size, "context_length": context, "batch_size": batch, "stack": stack,
                          "variant": variant, "overrides": [], "dtype": "bf16", "warmup": 3, "steps": 8}
                graphs = variant == "cudagraphs"
                measured = {"oom": False, **timing(step), "step_ms": step, "peak_gb": 5.0 * scale,
                            "first_step_s": 8.0, "parts": {**PARTS[stack], "keep_attention": False,
                                                           "sharding": "none", **VARIANT_PARTS[variant],
                                                           **STACK_WEIGHTS[stack]},
                            "forward_ms": (0.85 if graphs else 0.3) * step,
                            "backward_ms": 0.05 if graphs else 0.55 * step, "optimizer_ms": 0.15 * step,
                            "flops": flops, "peak_tflops": 750.0, "mfu": flops / (step / 1e3) / 750e12}
                run = earlier if stack == "torch" and size == "small" else now
                if stack == "ours":
                    torch_variant = min(("default", "cudagraphs"), key=lambda v: steps[("torch", v)])
                    measured.update(ours_over_torch=step / steps[("torch", torch_variant)],
                                    torch_variant=torch_variant, torch_run=earlier if size == "small" else now)
                r = row("train_step", config, measured)
                r["run"] = run
                rows.append(r)
    return rows


def train_step_profiles(results: Path) -> None:
    """What scripts/train_step_profile.py prints for each stack (xl, context 512, batch 4, without CUDA graphs)."""
    folder = results / "h100-train-step-profile"
    folder.mkdir(parents=True, exist_ok=True)
    for stack, wall, gpu, attention in (("ours", 200.0, 110.0, True), ("torch", 150.0, 105.0, False)):
        lines = [{"stack": stack, "parts": {**PARTS[stack], "cudagraphs": False}, "size": "xl", "context": 512,
                  "batch": 4, "wall_ms": wall, "gpu_kernel_ms": gpu, "host_bound_share": 1 - gpu / wall},
                 {"kernel": "nvjet_sm90_tst_128x256", "ms_per_step": 10.0, "calls_per_step": 289.0}]
        if attention:
            lines += [{"kernel": "attn_fwd_hopper_kernel", "ms_per_step": 1.25, "calls_per_step": 48.0},
                      {"kernel": "attn_bwd_hopper_kernel", "ms_per_step": 2.5, "calls_per_step": 48.0},
                      {"host_op": "cs336_systems::flash_attention_forward", "self_cpu_ms_per_step": 8.0,
                       "calls_per_step": 48.0},
                      {"host_op": "cs336_systems::flash_attention_backward", "self_cpu_ms_per_step": 12.0,
                       "calls_per_step": 48.0}]
        (folder / f"profile_step_{stack}_abcdef1.txt").write_text(
            "a warning line the profiler prints\n" + "".join(json.dumps(x) + "\n" for x in lines))


def op_overhead() -> list[dict]:
    """Two runs of python -m cs336_systems.bench.op_overhead: before (commit 1111111) and now (2222222). Now: ours'
    attention forward at (4, 25, 512, 64) 0.83x cuDNN's, forward+backward 1.20x; rmsnorm and AdamW cost the host
    no more than PyTorch's counterparts, cross-entropy more."""
    cases = {  # (op, shape, pass): {provider: (issue µs before, now)}
        ("attention", (4, 25, 512, 64), "forward"): {"ours": (250.0, 50.0), "sdpa_cudnn": (60.0, 60.0),
                                                     "sdpa_flash": (40.0, 40.0)},
        ("attention", (4, 25, 512, 64), "forward_backward"): {"ours": (2000.0, 300.0), "sdpa_cudnn": (250.0, 250.0),
                                                              "sdpa_flash": (280.0, 280.0)},
        ("attention", (1, 1, 128, 64), "forward"): {"ours": (140.0, 70.0), "sdpa_cudnn": (70.0, 70.0),
                                                    "sdpa_flash": (50.0, 50.0)},
        ("rmsnorm", (2048, 1600), "forward"): {"ours": (100.0, 90.0), "torch_compiled": (100.0, 100.0)},
        ("rmsnorm", (2048, 1600), "forward_backward"): {"ours": (800.0, 400.0), "torch_compiled": (400.0, 400.0)},
        ("cross_entropy", (2048, 1600, 10000), "forward"): {"ours": (400.0, 300.0), "torch_compiled": (100.0, 100.0)},
        ("cross_entropy", (2048, 1600, 10000), "forward_backward"): {"ours": (1400.0, 1200.0),
                                                                     "torch_compiled": (800.0, 800.0)},
        ("adamw", ("xl",), "step"): {"ours": (4000.0, 2500.0), "torch_fused": (20000.0, 20000.0)},
    }
    rows = []
    for i, (run, commit, date) in enumerate((("20261124T120000Z-before", "1111111", "2026-11-24T12:00:00Z"),
                                             ("20261124T130000Z-now", "2222222", "2026-11-24T13:00:00Z"))):
        for (op, shape, pass_), providers in cases.items():
            ours = providers["ours"][i]
            for provider, issue in providers.items():
                issue = issue[i]
                config = {"op": op, "provider": provider, "shape": list(shape), "pass": pass_}
                r = row("op_overhead", config, {"oom": False, "issue_us": issue, "wall_us": issue * 1.01,
                                                "issue_us_min": issue * 0.9, "calls": 100, "repeats": 7,
                                                "ours_over_this": ours / issue, "ours_wall_over_this": ours / issue})
                r["run"] = run
                r["env"] = {**r["env"], "date": date, "commit": commit}
                rows.append(r)
    return rows


def fused_adamw() -> list[dict]:
    rows = []
    params = 1_998_235_200
    for dtype, times_ms in (("fp32", {"ours": 13.6, "torch_fused": 15.9, "torch_foreach": 43.5, "basics": 40.3}),
                            ("bf16", {"ours": 12.4, "torch_fused": 10.5, "torch_foreach": 26.2, "basics": 22.4})):
        for provider, ms in times_ms.items():
            rows.append(row("fused_adamw", {"size": "xl", "dtype": dtype, "provider": provider},
                            {"oom": False, "median_ms": ms, "params": params, "tensors": 435,
                             "gb_per_s": params * 28 / (ms / 1e3) / 1e9, "copy_gb_per_s": 4200.0,
                             "ours_over_this": times_ms["ours"] / ms}, gpu="NVIDIA H200"))
    return rows


def fused_cross_entropy() -> list[dict]:
    rows = []
    for (tokens, vocab, d), measured in (((32768, 151936, 4096), {"ours": (195.0, 6.0), "eager": (220.0, 51.0),
                                                                    "compiled": (192.0, 12.7)}),
                                         ((8192, 10000, 1600), {"ours": (2.0, 0.23), "eager": (1.9, 0.88),
                                                                "compiled": (1.5, 0.25)})):
        ours_ms, ours_gb = measured["ours"]
        for provider, (ms, extra) in measured.items():
            config = {"tokens": tokens, "vocab": vocab, "d": d, "provider": provider, "autocast": "bf16"}
            rows.append(row("fused_cross_entropy", config,
                            {"oom": False, "loss": 12.4, "peak_extra_gb": extra, "median_ms": ms,
                             "ours_over_this": ours_ms / ms, "ours_memory_over_this": ours_gb / extra},
                            gpus=2, gpu="NVIDIA H200"))
    return rows


def flash_cold_start() -> list[dict]:
    """The JSON scripts/flash_cold_start.py prints, one line per head dimension: no env, the GPU's name only."""
    lengths = (1000, 3000, 5000, 7777, 12345, 20000)
    return [{"d_head": d, "dtype": "bf16", "import_s": 0.3, "first_call_s": first,
             "unseen_length_call_s": {str(n): 2.5 if n == 12345 else 0.002 for n in lengths}, "gpu": "NVIDIA H200"}
            for d, first in ((64, 7.3), (128, 6.2))]


LB_PARTS = {"ours": {"attention": "triton", "rmsnorm": "fused", "loss": "fused", "optimizer": "fused",
                     "compile": "none", "checkpointing": 1, "keep_attention": True, "sharding": "ours"},
            "pytorch": {"attention": "sdpa", "rmsnorm": "plain", "loss": "plain", "optimizer": "torch_fused",
                        "compile": "blocks", "checkpointing": 1, "keep_attention": False, "sharding": "fsdp2"}}


def leaderboard_2026() -> list[dict]:
    """The official step of both stacks (ours 1.25x pytorch), and a shorter unofficial trial of ours that the
    section leaves out."""
    from cs336_systems.bench.common.leaderboard_2026_model import MODEL, step_flops

    flops = step_flops(MODEL, 2)
    rows = []
    for stack, step_ms, peak, mfu in (("ours", 7500.0, 81.0, 0.45), ("pytorch", 6000.0, 93.0, 0.58),
                                      ("ours", 900.0, 30.0, 0.40)):
        official = step_ms != 900.0
        config = {"stack": stack, "num_layers": 34 if official else 4, "context_length": 32768, "batch_size": 2,
                  "world_size": 2, "rep_ms": 30000 if official else 3000, "warmup_ms": 10000 if official else 1000,
                  "official": official}
        measured = {"step_ms": step_ms, "step_ms_per_rank": [step_ms, step_ms - 0.1], "peak_gb_per_rank": peak,
                    "peak_gb_ranks": [peak, peak], "first_step_s": 17.0, "cold_total_s": 110.0 if stack == "ours"
                    else 100.0, "cold_caches": True, "mfu": mfu, "flops": flops if official else flops / 8,
                    "matmul_tflops": 740.0, "param_dtype": "fp32 (master)", "compute_dtype": "bfloat16",
                    "checkpointing": "every block", "parts": LB_PARTS[stack],
                    "timer": "do_bench_on_ranks (triton do_bench, mean)",
                    "predicted_memory": {"total_gb": 1.0}}  # an older prediction: the section ignores it
        rows.append(row("leaderboard_2026", config, measured, gpus=2, gpu="NVIDIA H200"))
    for stack, step_ms in (("pytorch", 890.0), ("ours", 840.0)):  # the one-GPU proxy (world_size 1)
        config = {"stack": stack, "num_layers": 4, "context_length": 32768, "batch_size": 1, "world_size": 1,
                  "rep_ms": 3000, "warmup_ms": 1000, "official": False}
        measured = {"step_ms": step_ms, "step_ms_per_rank": [step_ms], "peak_gb_per_rank": 40.0, "peak_gb_ranks": [40.0],
                    "first_step_s": 15.0, "cold_total_s": 40.0, "cold_caches": True, "mfu": 0.65,
                    "flops": step_flops({**MODEL, "num_layers": 4}, 1), "matmul_tflops": 740.0,
                    "parts": {**LB_PARTS[stack], "compile": "blocks"}}
        rows.append(row("leaderboard_2026", config, measured, gpus=1, gpu="NVIDIA H100 80GB HBM3"))
    return rows


def leaderboard_2026_planned_pair(gpu: str, start: str, step_ms: dict[str, float], kept: dict[str, int],
                                  peak: dict[str, float], retries: int | None = None,
                                  predicted_gb: float | None = None) -> list[dict]:
    """One invocation of the official step with --checkpoint-plan auto, as it writes its rows: PyTorch's first,
    then ours (each in its own ranks: run ids one minute apart from ``start``, e.g. ``20261126T1713``); ``kept``:
    each stack's blocks kept whole (the last ones), the rest selective; the predicted peak today's memory model's
    for the plan, or ``predicted_gb`` (an earlier model's); ``retries``: the allocator's retries per rank during
    timing (None: not recorded)."""
    from cs336_systems.bench.common.leaderboard_2026_model import MODEL, STACK_OF_ROW, memory_budget, step_flops

    rows = []
    for minute, stack in enumerate(("pytorch", "ours")):
        modes = ["selective"] * (34 - kept[stack]) + ["keep"] * kept[stack]
        predicted = predicted_gb or memory_budget(MODEL, STACK_OF_ROW[stack], 2, 1, loss=LB_PARTS[stack]["loss"],
                                                  modes=tuple(modes))["peak_gb"]
        config = {"stack": stack, "num_layers": 34, "context_length": 32768, "batch_size": 2, "world_size": 2,
                  "rep_ms": 30000, "warmup_ms": 10000, "official": True, "checkpoint_option": "auto"}
        measured = {"step_ms": step_ms[stack], "step_ms_per_rank": [step_ms[stack]] * 2,
                    "peak_gb_per_rank": peak[stack], "peak_gb_ranks": [peak[stack]] * 2, "first_step_s": 20.0,
                    "cold_total_s": 100.0, "cold_caches": True, "mfu": 0.6, "flops": step_flops(MODEL, 2),
                    "matmul_tflops": 700.0 + minute, "parts": {**LB_PARTS[stack], "compile": "blocks",
                                                               "checkpointing": 0, "keep_attention": False,
                                                               "block_checkpointing": modes},
                    "checkpoint_plan": {"describe": f"34 blocks: {kept[stack]} keep, {34 - kept[stack]} selective; "
                                                    f"predicted peak {predicted:.1f} GB fits a budget of 141.6 GB "
                                                    "(free memory less a margin of 6.9 GiB)",
                                        "predicted_peak_gb": predicted}}
        if retries is not None:
            events = {"num_alloc_retries": retries, "num_sync_all_streams": retries, "num_device_alloc": 100,
                      "num_device_free": 10}
            measured["allocator_events_ranks"] = [events, events]
        r = row("leaderboard_2026", config, measured, gpus=2, gpu=gpu)
        date = f"{start[:4]}-{start[4:6]}-{start[6:8]}T{start[9:11]}:{int(start[11:13]) + minute:02d}:00Z"
        rows.append({**r, "run": f"{start[:11]}{int(start[11:13]) + minute:02d}00Z-{stack}",
                     "env": {**r["env"], "date": date, "commit": "c0ffee0"}})
    return rows


def leaderboard_2026_profile() -> list[dict]:
    """What scripts/leaderboard_2026_profile.py prints: device, date and commit at the top level, no env."""
    base = {"problem": "leaderboard_2026_profile", "device": "2x NVIDIA H200", "date": "2026-11-23",
            "commit": "0123456", "context_length": 32768, "batch_per_rank": 1,
            "tool": "scripts/leaderboard_2026_profile.py", "layers": 4}
    cases = (("ours", [], 1000.0, {"matmul": 450.0, "attention_backward": 360.0, "attention_forward": 80.0,
                                   "other": 110.0, "collectives": 30.0, "cross_entropy": 8.0, "optimizer": 7.0},
              {"attn_bwd_kernel": 355.0, "attn_fwd_kernel": 79.0}),
             ("pytorch", [], 880.0, {"matmul": 480.0, "attention_backward": 190.0, "attention_forward": 120.0,
                                     "other": 50.0, "collectives": 32.0, "cross_entropy": 19.0, "optimizer": 9.0},
              {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": 188.0}),
             ("ours", ["attention=sdpa"], 860.0, {"matmul": 465.0, "attention_backward": 185.0,
                                                  "attention_forward": 60.0, "other": 115.0, "collectives": 33.0,
                                                  "cross_entropy": 8.0, "optimizer": 7.0, "rmsnorm": 0.1}, {}))
    rows = [{**base, "stack": stack, "parts": parts, "wall_ms": wall, "gpu_ms": gpu_ms, "top_kernels": kernels}
            for stack, parts, wall, gpu_ms, kernels in cases]
    proxy = {**base, "device": "1x NVIDIA H100 80GB HBM3", "date": "2026-11-25", "world_size": 1}
    for stack, parts, wall, other in (("ours", [], 840.0, 63.0), ("pytorch", [], 890.0, 68.0),
                                      ("ours", ["compile=none"], 910.0, 160.0)):
        gpu_ms = {"matmul": 465.0, "attention_backward": 220.0 if stack == "ours" else 180.0,
                  "attention_forward": 60.0 if stack == "ours" else 120.0, "other": other, "optimizer": 19.0,
                  "cross_entropy": 10.0}
        rows.append({**proxy, "stack": stack, "parts": parts, "wall_ms": wall, "peak_gb": 39.0, "gpu_ms": gpu_ms,
                     "top_kernels": {}})
    # The full step split by category (the script's row through the result store: run, env), ours on two H200s:
    # 7,640 ms of kernels and idle time.
    split = {"matmul": 2600.0, "attention_forward": 600.0, "attention_backward": 2700.0, "recompute": 900.0,
             "elementwise": 500.0, "norms": 60.0, "loss": 10.0, "optimizer": 20.0, "exposed_communication": 50.0}
    measured = {"wall_ms": 7640.0, "split_ms": split, "communication_ms": 300.0, "idle_ms": 200.0,
                "gpu_ms": {"matmul": 3300.0}, "top_kernels": {}, "peak_gb": 78.0, "tool": base["tool"]}
    config = {"stack": "ours", "parts": [], "layers": 34, "world_size": 2, "context_length": 32768,
              "batch_per_rank": 1, "checkpoint_option": None, "warmup_steps": 1, "profiled_steps": 1}
    rows.append({**row("leaderboard_2026_profile", config, measured, gpus=2, gpu="NVIDIA H200"),
                 "run": "20261126T120000Z-0a0b0c"})
    return rows


def flash_errors() -> dict[str, Any]:
    worst = {t: {"relative_error": 1e-6, "case": "1x2x17x4096 d=32 causal=False", "max_ratio_to_torch": 1.2,
                 "max_abs_error": 2e-7} for t in ("O", "L", "dQ", "dK", "dV")}
    return {"device": GPU, "torch": "2.11.0+cu130", "triton": "3.6.0", "date": "2026-11-22T05:48:03+00:00",
            "error_floor": {"fp32": 1e-4, "bf16": 0.02}, "torch_error_factor": 3.0,
            "summary": {"fp32": {"cases": 18, "worst": worst}, "bf16": {"cases": 18, "worst": worst}}, "records": []}


def write_fixture(results: Path, figures: Path) -> None:
    """Write a results file for every section into ``results`` (figures the rows name go to ``figures``)."""
    files = {
        "benchmarking_script": benchmarking_script(),
        "benchmarking_mixed_precision": [row("benchmarking_mixed_precision", {"autocast": cast, "device_type": "cuda"},
                                             {"dtypes": {"parameters": "torch.float32", "fc1 output": f"torch.{cast}",
                                                         "LayerNorm output": "torch.float32"}})
                                         for cast in ("float16", "bfloat16")],
        "mixed_precision_accumulation": [row("mixed_precision_accumulation",
                                             {"variant": v, "accumulator": acc, "value": val, "upcast": up},
                                             {"result": 10 + err, "error": err, "summand": 0.01})
                                         for v, acc, val, up, err in (("float32 += float32", "float32", "float32", False, 1e-4),
                                                                      ("float16 += float16", "float16", "float16", False, -0.05),
                                                                      ("float32 += float16", "float32", "float16", False, 2e-3))],
        "nsys_profile": nsys_profile(),
        "memory_profiling": memory_profiling(figures),
        "pytorch_attention": pytorch_attention(),
        "torch_compile": torch_compile(),
        "gradient_checkpointing": gradient_checkpointing(),
        "flash_benchmarking": flash_benchmarking(),
        "leaderboard": leaderboard(),
        "flash_optimisation_log": flash_optimisation_log(),
        "distributed_communication_single_node": all_reduce(),
        "ddp_benchmarking": ddp_benchmarking(figures),
        "ddp_ratio_check": ddp_ratio_check(),
        "optimizer_state_sharding_accounting": optimizer_state_sharding_accounting(),
        "fsdp_accounting": fsdp_accounting(figures),
        "rmsnorm": rmsnorm(),
        "train_step": train_step_residual_norm(train_step()),
        "residual_norm_timing": residual_norm_timing(),
        "op_overhead": op_overhead(),
        "fused_adamw": fused_adamw(),
        "fused_cross_entropy": fused_cross_entropy(),
        "flash_cold_start": flash_cold_start(),
        "leaderboard_2026": leaderboard_2026(),
        "leaderboard_2026_profile": leaderboard_2026_profile(),
    }
    results.mkdir(parents=True, exist_ok=True)
    for problem, rows in files.items():
        with (results / f"{problem}.jsonl").open("w") as file:
            file.writelines(json.dumps(r) + "\n" for r in rows)
    flash_probe(results)
    train_step_profiles(results)
    fsdp_memory_log(results)
    errors = results / "h100-hopper-backward" / "tests" / "flash_attention_triton_errors.json"  # flash.ERRORS_FILE
    errors.parent.mkdir(parents=True, exist_ok=True)
    errors.write_text(json.dumps(flash_errors()))
    (results / "h200x2-tests").mkdir(exist_ok=True)
    (results / "h200x2-tests" / "toy_training.log").write_text(
        "backend: nccl (2 GPUs, one per rank); world size 2; batch 32\n"
        "     naive: max |w - w_single| = 5.96e-08 after 10 steps: matches\n")
    (results / "h200x2-tests" / "environment.txt").write_text(
        "2026-11-22T06:27:15Z\nNVIDIA H200, 143771 MiB, 580\nNVIDIA H200, 143771 MiB, 580\n"
        "python 3.12.3 torch 2.11.0+cu130 triton 3.6.0 cuda 13.0 gpus 2\n")
