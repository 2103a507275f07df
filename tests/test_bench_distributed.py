"""The distributed benchmarks on CPU (gloo, tiny sizes): every CLI's quick run, the timeline renderer on
synthetic traces, the all-reduce latency-bandwidth fit and the DDP overhead model on fixture rows.

Each CLI run spawns its ranks (seconds of imports each), so each is run once and checked thoroughly.
"""

from __future__ import annotations

import gzip
import json
import math

import pytest
import torch

from cs336_systems.bench import (
    ddp_benchmarking,
    ddp_overhead_model,
    distributed_communication_single_node,
    optimizer_state_sharding_accounting,
)
from cs336_systems.bench import timeline as timeline_cli
from cs336_systems.bench.common import ddp_step, timeline
from cs336_systems.bench.common.allreduce_fit import bus_bandwidth, fit_latency_bandwidth
from cs336_systems.bench.common.lm import LMConfig, build_model, make_optimizer, random_batch
from cs336_systems.bench.common.timeline import Span, Timeline
from cs336_systems.parallel.distributed import one_rank_group

CLIS = [distributed_communication_single_node, ddp_benchmarking, optimizer_state_sharding_accounting]


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("cli", CLIS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_distributed_cli_answers_help(cli, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_unknown_ddp_variant_is_refused(capsys):
    with pytest.raises(SystemExit):
        ddp_benchmarking.main(["--variants", "bucketed_fast"])
    assert "unknown DDP variant 'bucketed_fast'" in capsys.readouterr().err
    assert ddp_step.variant_name("bucketed_25mb") == "bucketed_25mb"


@pytest.mark.slow  # every variant on the tiny LM: about 10 s on two cores
def test_every_variant_wraps_and_steps_in_a_one_rank_group():
    """World size 1 (in this process, no spawn): every wrapper's gradients equal the unwrapped model's."""
    device = torch.device("cpu")
    config = LMConfig("tiny", context_length=8, batch_size=2)
    batch = random_batch(config, device)
    with one_rank_group("gloo"):
        grads, calls = {}, {}
        for variant in [ddp_step.LOCAL, *ddp_step.VARIANTS, "bucketed_0.5mb"]:
            torch.manual_seed(0)
            model = build_model(config, device)
            wrapped = ddp_step.wrap(variant, model)
            calls[variant] = ddp_step.communication_calls(variant, wrapped)
            optimizer = make_optimizer(model)
            marker = ddp_step.Marker(device)
            step = ddp_step.make_train_step(wrapped, optimizer, batch, None, marker)
            before = [p.detach().clone() for p in model.parameters()]
            after_backward, after_sync = step(update=False)
            assert marker.elapsed_ms(after_backward, after_sync) >= 0
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # no optimizer step
            grads[variant] = [p.grad.clone() for p in model.parameters()]
            step()
            assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        for variant, variant_grads in grads.items():
            for grad, reference in zip(variant_grads, grads["local"]):
                torch.testing.assert_close(grad, reference, rtol=1e-6, atol=1e-7, msg=variant)
        n_params = len(list(model.parameters()))
        assert calls["local"] == 0 and calls["flat"] == 1 and calls["bucketed_1000mb"] == 1
        assert calls["naive"] == calls["overlap"] == n_params and calls["torch_ddp"] is None
        assert 1 < calls["bucketed_1mb"] < calls["bucketed_0.5mb"] <= n_params


# ---------------------------------------------------------------------------------------------
# Quick runs on gloo
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # spawns ranks: about 10 s on two cores
def test_all_reduce_quick_on_gloo(tmp_path, capsys):
    argv = ["--quick", "--results-dir", str(tmp_path), "--figures-dir", str(tmp_path), "--backends", "gloo",
            "--sizes-mb", "0.01", "0.4"]
    distributed_communication_single_node.main(argv)
    rows = read_rows(tmp_path / "distributed_communication_single_node.jsonl")
    assert [(r["backend"], r["world_size"], r["size_mb"]) for r in rows] == [("gloo", 2, 0.01), ("gloo", 2, 0.4)]
    for row in rows:
        assert row["bytes"] == int(row["size_mb"] * 1e6) // 4 * 4
        assert len(row["rank_mean_ms"]) == 2 and len(row["call_ms"]) == row["iters"] >= 2
        assert row["mean_ms"] == pytest.approx(sum(row["call_ms"]) / row["iters"])
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / (row["mean_ms"] / 1e3) / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])  # 2 (n - 1) / n = 1 for two ranks
    assert (tmp_path / "distributed_communication_single_node.png").stat().st_size > 10_000
    capsys.readouterr()
    distributed_communication_single_node.main(argv)  # measured already: nothing new, table still printed
    assert len(read_rows(tmp_path / "distributed_communication_single_node.jsonl")) == 2
    assert "busbw_gbps" in capsys.readouterr().out


@pytest.mark.slow  # spawns ranks per variant: about 35 s on two cores
def test_ddp_benchmarking_quick_on_gloo_with_a_trace(tmp_path):
    argv = ["--quick", "--results-dir", str(tmp_path), "--figures-dir", str(tmp_path), "--dtypes", "fp32",
            "--variants", "bucketed_1mb", "torch_ddp", "--trace", "--trace-variants", "bucketed_1mb",
            "--trace-dir", str(tmp_path / "traces")]
    ddp_benchmarking.main(argv)
    rows = {r["variant"]: r for r in read_rows(tmp_path / "ddp_benchmarking.jsonl")}
    assert list(rows) == ["local", "bucketed_1mb", "torch_ddp"]
    local = rows["local"]
    assert local["exposed_ms"] == 0 and local["n_buckets"] == 0
    for row in rows.values():
        assert row["size"] == "tiny" and row["world_size"] == 2 and row["backend"] == "gloo"
        assert len(row["steps_ms"]) == row["steps"] == 2 and len(row["rank_step_ms"]) == 2
        # --quick: every variant in one launch, against one compute-only reference.
        assert row["compute_ms"] > 0 and row["exposed_ms"] == pytest.approx(row["step_ms"] - row["compute_ms"])
        assert row["grad_bytes"] == local["grad_bytes"] > 0
    assert local["compute_ms"] == local["step_ms"] and rows["bucketed_1mb"]["run"] == rows["torch_ddp"]["run"]
    assert rows["torch_ddp"]["comm_ms"] is None and rows["bucketed_1mb"]["comm_ms"] > 0
    assert rows["bucketed_1mb"]["bucket_mb"] == 1.0 and rows["torch_ddp"]["bucket_mb"] is None
    assert rows["bucketed_1mb"]["n_buckets"] >= 2  # the tiny model's 2.6 MB of float32 gradients
    traced = rows["bucketed_1mb"]
    assert traced["trace_comm_busy_ms"] > 0 and 0 <= traced["trace_overlap_share"] <= 1
    assert len(traced["trace_ranks"]) == 2  # each rank's phases: one rank waiting for the other shows there
    for rank in traced["trace_ranks"]:
        assert rank["forward_ms"] > 0 and rank["backward_ms"] > 0 and rank["span_ms"] >= rank["forward_ms"]
    assert (tmp_path / "ddp_overlap_bucketed_1mb_fp32.png").stat().st_size > 10_000
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "ddp_bucketed_1mb_fp32_rank0.json.gz", "ddp_bucketed_1mb_fp32_rank1.json.gz"]
    assert "trace_figure" not in rows["torch_ddp"]
    ddp_benchmarking.main(argv)  # everything measured: returns before spawning anything
    assert len(read_rows(tmp_path / "ddp_benchmarking.jsonl")) == 3


def test_ddp_benchmarking_measures_each_variant_on_fresh_ranks_and_quick_runs_a_few():
    """Without --quick every (variant, dtype) is its own launch; --quick runs a few variants in fp32."""
    args = ddp_benchmarking.parser().parse_args(["--variants", "naive", "flat", "--dtypes", "fp32", "bf16"])
    parts = ddp_benchmarking.one_variant_each(args)
    assert [(p.variants, p.dtypes) for p in parts] == [(["naive"], ["fp32"]), (["flat"], ["fp32"]),
                                                        (["naive"], ["bf16"]), (["flat"], ["bf16"])]
    assert ddp_benchmarking.parser().parse_args(["--quick"]).variants is None  # resolved in main
    assert len(ddp_benchmarking.QUICK["variants"]) <= 3 and ddp_benchmarking.QUICK["dtypes"] == ["fp32"]


@pytest.mark.slow  # spawns ranks per optimizer: about 90 s on two cores
def test_optimizer_state_sharding_accounting_quick_on_gloo(tmp_path):
    optimizer_state_sharding_accounting.main(["--quick", "--results-dir", str(tmp_path)])
    rows = {r["optimizer"]: r for r in read_rows(tmp_path / "optimizer_state_sharding_accounting.jsonl")}
    assert list(rows) == ["adamw", "sharded", "zero_redundancy", "zero1_flat"]
    plain = rows["adamw"]
    # AdamW keeps two tensors per parameter: twice the parameters' bytes on every rank.
    assert plain["rank_optimizer_state_gb"] == [pytest.approx(2 * plain["params_gb"])] * 2
    assert plain["rank_local_param_share"] == [1.0, 1.0]
    for name in ("sharded", "zero_redundancy", "zero1_flat"):
        row = rows[name]
        # zero1_flat's parameters and gradients are views of flat buffers padded to a multiple of the ranks
        # (a few bytes more), where some of plain AdamW's gradients live in autograd's larger storages.
        exact = {"rel": 1e-4} if name == "zero1_flat" else {"rel": 0, "abs": 0}
        assert row["params_gb"] == pytest.approx(plain["params_gb"], **exact)
        assert row["grads_gb"] == pytest.approx(plain["grads_gb"], **exact)
        assert sum(row["rank_local_param_share"]) == pytest.approx(1.0, **exact)
        assert row["ddp"] == ("local" if name == "zero1_flat" else plain["ddp"])
        for state in row["rank_optimizer_state_gb"]:
            assert state == pytest.approx(plain["params_gb"], rel=0.05)  # half of AdamW's, split evenly
        assert row["step_ms"] > 0 and len(row["steps_ms"]) == 2
    assert set(plain["memory"]) == {"after_init", "before_step", "after_step"}
    assert plain["memory"]["after_init"]["grads_gb"] == 0 and plain["memory"]["after_init"]["optimizer_state_gb"] == 0
    assert plain["peak_gb"] is None  # no device memory statistics on a CPU


# ---------------------------------------------------------------------------------------------
# Timeline renderer
# ---------------------------------------------------------------------------------------------


def kernel(name: str, start_ms: float, end_ms: float, stream: int, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": 1e6 + start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3,
            "pid": 0, "tid": stream, "args": {"stream": stream}}


def synthetic_gpu_trace() -> dict:
    """Compute busy 0-20 and 25-40 ms; NCCL busy 15-30 and 45-50 ms: 10 of its 20 ms overlapped."""
    return {"traceEvents": [
        kernel("ampere_sgemm_128x64_tn", 0, 10, 7),
        kernel("void at::native::vectorized_elementwise_kernel", 10, 20, 7),
        kernel("Memcpy DtoD (Device -> Device)", 25, 30, 7, cat="gpu_memcpy"),
        kernel("sm90_xmma_gemm_f32f32", 30, 40, 7),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 15, 30, 21),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 45, 50, 21),
        kernel("forward", 0, 10, 7, cat="gpu_user_annotation"),
        kernel("backward", 10, 40, 7, cat="gpu_user_annotation"),
        kernel("ProfilerStep#3", 0, 50, 7, cat="gpu_user_annotation"),  # not a phase
        kernel("aten::mm", -5, 60, 1, cat="cpu_op"),  # host side: ignored when there are kernels
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}},
    ]}


def test_timeline_from_a_synthetic_gpu_trace(tmp_path):
    path = tmp_path / "rank0.json.gz"
    with gzip.open(path, "wt") as file:
        json.dump(synthetic_gpu_trace(), file)
    result = timeline.timeline_from_trace(timeline.load_trace(path))
    assert result.source == "gpu"
    assert [s.name for s in result.phases] == ["forward", "backward"]
    assert len(result.compute) == 4 and len(result.communication) == 2
    assert result.compute[0].start_ms == pytest.approx(0.0)  # origin: the first span
    summary = timeline.overlap_summary(result)
    assert summary["compute_busy_ms"] == pytest.approx(35.0)
    assert summary["comm_busy_ms"] == pytest.approx(20.0)
    assert summary["comm_overlapped_ms"] == pytest.approx(10.0)
    assert summary["comm_exposed_ms"] == pytest.approx(10.0)
    assert summary["overlap_share"] == pytest.approx(0.5)
    assert summary["span_ms"] == pytest.approx(50.0)
    forward, backward = result.phases
    assert timeline.phase_lengths(result) == pytest.approx({"forward": forward.end_ms - forward.start_ms,
                                                            "backward": backward.end_ms - backward.start_ms})
    repeated = Timeline(phases=[Span(5, 7, "backward"), Span(0, 3, "forward"), Span(8, 9, "backward")])
    assert list(timeline.phase_lengths(repeated).items()) == [("forward", 3), ("backward", 3)]
    no_overlap = Timeline(compute=[Span(0, 10)], communication=[Span(10, 12)])
    assert timeline.overlap_summary(no_overlap)["overlap_share"] == 0.0
    assert timeline.overlap_summary(Timeline(compute=[Span(0, 1)]))["overlap_share"] is None
    out = tmp_path / "figure.png"
    timeline.render_lanes([result, no_overlap], out, "synthetic")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    # Drawn at the writeup's text width (6.7 in at 130 dpi), so the lane labels print at their size, >= 7 pt.
    width_px = int.from_bytes(out.read_bytes()[16:20], "big")
    assert abs(width_px / 130 - 6.7) < 0.05 and timeline.LANES_FONT_PT >= 7
    timeline_cli.main([str(path), str(path), "-o", str(tmp_path / "cli.png")])
    assert (tmp_path / "cli.png").exists()


def launched(name: str, start_ms: float, end_ms: float, launch_ms: float, correlation: int) -> list[dict]:
    """A kernel on stream 7 and the ``cudaLaunchKernel`` call (on the autograd thread, 300) that launched it."""
    gpu = kernel(name, start_ms, end_ms, 7)
    gpu["args"]["correlation"] = correlation
    cpu = kernel("cudaLaunchKernel", launch_ms, launch_ms + 0.01, 300, cat="cuda_runtime")
    cpu["args"] = {"correlation": correlation}
    return [gpu, cpu]


def test_a_phase_launched_from_another_thread_spans_the_kernels_it_launched():
    """The backward's kernels come from autograd's thread: the profiler draws no GPU annotation for the main
    thread's ``backward`` range, so the lane spans the compute kernels launched during it (not the NCCL ones)."""
    events = [kernel("forward", 0, 10, 7, cat="gpu_user_annotation"), kernel("sgemm", 0, 10, 7),
              kernel("backward", 9, 20, 100, cat="user_annotation"),  # CPU time of the main thread
              *launched("sgemm_backward", 12, 25, 9.5, 1), *launched("elementwise", 25, 31, 19, 2),
              *launched("ncclDevKernel_AllReduce", 20, 40, 19.5, 3),
              *launched("adam", 41, 42, 30, 4)]  # launched after the range: not backward's
    result = timeline.timeline_from_trace({"traceEvents": events})
    phases = {s.name: (round(s.start_ms, 3), round(s.end_ms, 3)) for s in result.phases}
    assert phases == {"forward": (0.0, 10.0), "backward": (12.0, 31.0)}


def test_a_phase_whose_gpu_annotation_is_shorter_than_its_launches_is_widened_to_them():
    """Real traces: the main thread launches a kernel or two of the backward (the loss's gradient), so the range has a
    short GPU annotation; the lane still spans what autograd's thread launched during the range."""
    events = [kernel("forward", 0, 10, 7, cat="gpu_user_annotation"), kernel("sgemm", 0, 10, 7),
              kernel("backward", 9, 20, 100, cat="user_annotation"),
              kernel("backward", 10, 11, 7, cat="gpu_user_annotation"),  # the loss's gradient kernel only
              *launched("sgemm_backward", 12, 25, 9.5, 1), *launched("elementwise", 25, 31, 19, 2)]
    phases = {s.name: (round(s.start_ms, 3), round(s.end_ms, 3))
              for s in timeline.timeline_from_trace({"traceEvents": events}).phases}
    assert phases == {"forward": (0.0, 10.0), "backward": (12.0, 31.0)}


def test_timeline_from_a_cpu_only_trace():
    """gloo: the collective runs on gloo's thread; compute is the busiest thread's operators."""
    events = [
        kernel("aten::mm", 0, 8, 100, cat="cpu_op"),
        kernel("aten::add", 8, 10, 100, cat="cpu_op"),
        kernel("c10d::allreduce_", 6, 6.5, 100, cat="cpu_op"),
        kernel("gloo:all_reduce", 6.5, 12, 200, cat="user_annotation"),
        kernel("aten::copy_", 0, 1, 300, cat="cpu_op"),  # another thread's operator: not compute
        kernel("backward", 0, 10, 100, cat="user_annotation"),
    ]
    result = timeline.timeline_from_trace(events)
    assert result.source == "cpu"
    assert [s.name for s in result.compute] == ["aten::mm", "aten::add"]
    assert sorted(s.name for s in result.communication) == ["c10d::allreduce_", "gloo:all_reduce"]
    assert [s.name for s in result.phases] == ["backward"]
    summary = timeline.overlap_summary(result)
    assert summary["comm_busy_ms"] == pytest.approx(6.0) and summary["comm_overlapped_ms"] == pytest.approx(4.0)


def test_interval_union_and_intersection():
    spans = [Span(5, 7), Span(0, 2), Span(1, 3), Span(3, 4)]
    assert timeline.merge(spans) == [(0, 4), (5, 7)]
    assert timeline.intersect([(0, 4), (5, 7)], [(3, 6), (6.5, 10)]) == [(3, 4), (5, 6), (6.5, 7)]
    assert timeline.intersect([(0, 1)], [(1, 2)]) == []


# ---------------------------------------------------------------------------------------------
# Latency-bandwidth fit and the DDP overhead model
# ---------------------------------------------------------------------------------------------

ALPHA, BETA = 40e-6, 150e9  # s, bytes/s
SIZES = [1e6, 1e7, 1e8, 1e9]


def test_latency_bandwidth_fit_recovers_its_parameters():
    fit = fit_latency_bandwidth(SIZES, [ALPHA + b / BETA for b in SIZES])
    assert fit.alpha_s == pytest.approx(ALPHA, rel=1e-6) and fit.beta_bytes_per_s == pytest.approx(BETA, rel=1e-6)
    assert fit.seconds(5e8) == pytest.approx(ALPHA + 5e8 / BETA)
    # Noisy small sizes that would give a negative intercept: clamped to zero, bandwidth refitted.
    clamped = fit_latency_bandwidth(SIZES, [b / BETA * (0.9 if b == 1e6 else 1.0) for b in SIZES])
    assert clamped.alpha_s == 0 and clamped.beta_bytes_per_s == pytest.approx(BETA, rel=0.1)
    with pytest.raises(ValueError, match="two different sizes"):
        fit_latency_bandwidth([1e6, 1e6], [1e-3, 1.1e-3])
    with pytest.raises(ValueError, match="do not grow"):
        fit_latency_bandwidth(SIZES, [1e-3, 0.5e-3, 0.2e-3, 0.1e-3])
    assert bus_bandwidth(100.0, 4) == pytest.approx(150.0)


def allreduce_rows(device: str = "2x Fake GPU", alpha: float = ALPHA, beta: float = BETA) -> list[dict]:
    rows = [{"backend": "nccl", "world_size": 2, "bytes": int(b), "mean_ms": (alpha + b / beta) * 1e3,
             "device": device} for b in SIZES]
    rows += [{"backend": "gloo", "world_size": 2, "bytes": int(b), "mean_ms": (1e-3 + b / 1e9) * 1e3,
              "device": device} for b in SIZES]
    return rows


GRAD_BYTES = 8e9
N_BUCKETS = {1: 400, 10: 300, 100: 80, 1000: 9}


def ddp_rows(o: float, w: float, dtype: str = "bf16", compute_ms: float = 400.0) -> list[dict]:
    model = ddp_overhead_model.OverheadModel(o, w)
    rows = [{"variant": "local", "dtype": dtype, "step_ms": compute_ms, "exposed_ms": 0.0, "n_buckets": 0}]
    for mb, n in N_BUCKETS.items():
        exposed = model.overhead_s(GRAD_BYTES, n) * 1e3
        rows.append({"variant": f"bucketed_{mb}mb", "bucket_mb": float(mb), "n_buckets": n, "dtype": dtype,
                     "step_ms": compute_ms + exposed, "exposed_ms": exposed})
    rows.append({"variant": "torch_ddp", "dtype": dtype, "step_ms": compute_ms + 3, "exposed_ms": 3.0, "n_buckets": None})
    for row in rows:
        row.update(device="2x Fake GPU", world_size=2, grad_bytes=GRAD_BYTES)
    return rows


def test_overhead_model_formula_and_optimum():
    model = ddp_overhead_model.OverheadModel(ALPHA, BETA)
    assert model.overhead_s(8e9, 10) == pytest.approx(10 * ALPHA + 8e9 / (10 * BETA))
    n_star = model.optimal_n_buckets(8e9)
    assert n_star == pytest.approx(math.sqrt(8e9 / (BETA * ALPHA)))
    assert model.optimal_bucket_bytes(8e9) == pytest.approx(8e9 / n_star)
    # It is the minimum: a little more or fewer buckets cost more.
    assert model.overhead_s(8e9, n_star) < min(model.overhead_s(8e9, 0.9 * n_star), model.overhead_s(8e9, 1.1 * n_star))
    assert model.overhead_s(8e9, n_star) == pytest.approx(2 * math.sqrt(8e9 * ALPHA / BETA))


def test_overhead_model_predicts_fixture_rows_made_by_it():
    # A stale row of an earlier run and rows of another device and dtype must not be used.
    stale = {**ddp_rows(ALPHA, BETA)[2], "exposed_ms": 999.0}
    other = [{**r, "device": "8x Other GPU"} for r in ddp_rows(1e-3, 1e9)] + ddp_rows(1e-3, 1e9, dtype="fp32")
    rows = [stale, *other, *ddp_rows(ALPHA, BETA)]
    result = ddp_overhead_model.compare(allreduce_rows(), rows, "bf16")
    assert result["per_call_us"] == pytest.approx(ALPHA * 1e6, rel=1e-6)
    assert result["bandwidth_gbps"] == pytest.approx(BETA / 1e9, rel=1e-6)
    assert [r["bucket_mb"] for r in result["rows"]] == [1, 10, 100, 1000]
    for row in result["rows"]:
        assert row["predicted_overhead_ms"] == pytest.approx(row["measured_exposed_ms"], rel=1e-6)
        assert row["fitted_overhead_ms"] == pytest.approx(row["measured_exposed_ms"], rel=1e-6)
    assert result["fitted_per_call_us"] == pytest.approx(ALPHA * 1e6, rel=1e-6)
    assert result["fitted_bandwidth_gbps"] == pytest.approx(BETA / 1e9, rel=1e-6)
    expected_bytes = math.sqrt(GRAD_BYTES * BETA * ALPHA)
    assert result["predicted_optimal_bucket_mb"] == pytest.approx(expected_bytes / 1024**2)
    assert result["fitted_optimal_bucket_mb"] == pytest.approx(expected_bytes / 1024**2, rel=1e-6)
    assert result["measured_best_bucket_mb"] == 100  # 80 buckets: nearest to the optimum of about 34
    # The all-reduce link of another device is used only when the DDP run's own device has none.
    fallback = ddp_overhead_model.compare(allreduce_rows(device="4x Fake GPU", alpha=2 * ALPHA), rows, "bf16")
    assert fallback["per_call_us"] == pytest.approx(2 * ALPHA * 1e6, rel=1e-6)
    mixed = allreduce_rows() + allreduce_rows(device="4x Fake GPU", alpha=2 * ALPHA)
    assert ddp_overhead_model.compare(mixed, rows, "bf16")["per_call_us"] == pytest.approx(ALPHA * 1e6, rel=1e-6)


def test_overhead_model_fit_and_errors(tmp_path, capsys):
    # Times that fall with bucket size faster than per-call overheads alone explain: the free fit wants a
    # negative bandwidth term, so the bandwidth term is dropped (infinite w) and o refitted on relative errors.
    n = [400, 300, 80, 9]
    exposed = [k * 1e-4 for k in n[:3]] + [0.5 * 9e-4]
    fitted = ddp_overhead_model.fit_overhead_model(n, [GRAD_BYTES] * 4, exposed)
    assert math.isinf(fitted.bandwidth_bytes_per_s)
    assert fitted.per_call_s == pytest.approx((3 + 2) / (3 + 4) * 1e-4)  # argmin of sum (n o / t - 1)^2
    with pytest.raises(ValueError, match="positive"):
        ddp_overhead_model.fit_overhead_model(n, [GRAD_BYTES] * 4, [1e-3, -1e-4, 1e-3, 1e-3])
    with pytest.raises(ValueError, match="no bucketed DDP rows"):
        ddp_overhead_model.compare(allreduce_rows(), ddp_rows(ALPHA, BETA), "fp32")
    with pytest.raises(ValueError, match="no all-reduce fit"):
        ddp_overhead_model.compare(allreduce_rows(), [{**r, "world_size": 4} for r in ddp_rows(ALPHA, BETA)], "bf16")
    # From the results files, as the writeup reads them.
    (tmp_path / "distributed_communication_single_node.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in allreduce_rows()))
    (tmp_path / "ddp_benchmarking.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ddp_rows(ALPHA, BETA)))
    results = ddp_overhead_model.compare_files(tmp_path)
    assert [r["dtype"] for r in results] == ["bf16"]
    ddp_overhead_model.main(["--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "fp32: no bucketed DDP rows" in out and "predicted optimum" in out and "bucketed_100mb" in out


@pytest.mark.slow  # a subprocess spawning ranks: about 40 s on two cores
def test_ddp_ratio_check_script_runs_on_gloo(tmp_path):
    """scripts/ddp_ratio_check.py: its own loop over PyTorch's DDP and our bucketed DDP (2 gloo ranks, tiny), one
    row with both median steps and their ratio."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "ddp_ratio_check.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--results-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = read_rows(tmp_path / "ddp_ratio_check.jsonl")
    assert row["world_size"] == 2 and row["backend"] == "gloo" and row["size"] == "tiny"
    assert row["torch_ddp_ms"] > 0 and row["bucketed_ms"] > 0
    assert row["ratio"] == pytest.approx(row["bucketed_ms"] / row["torch_ddp_ms"])
