"""The benchmark harness (result store, resume, out-of-memory rows, environment, timing, FLOPs) and every
benchmark CLI's ``--quick`` run on the CPU."""

from __future__ import annotations

import importlib
import json
import re

import pytest
import torch

from cs336_systems.bench import (
    benchmarking_mixed_precision,
    benchmarking_script,
    gradient_checkpointing,
    memory_profiling,
    mixed_precision_accumulation,
    nsys_profile,
    pytorch_attention,
    torch_compile,
)
from cs336_systems.bench.common import flops, result_store, timing
from cs336_systems.bench.common.lm import LMConfig, build_model
from cs336_systems.bench.common.result_store import REPO_ROOT

def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_environment_record_has_device_versions_date_and_commit(monkeypatch):
    monkeypatch.setenv("CS336_GIT_COMMIT", "abc123")
    env = result_store.environment()
    assert {"device", "gpu_name", "gpu_count", "torch", "triton", "cuda", "date", "commit"} <= set(env)
    assert env["commit"] == "abc123"
    assert env["torch"] == torch.__version__
    assert env["date"].endswith("Z")
    if not torch.cuda.is_available():
        assert env["device"].startswith("cpu") and env["gpu_count"] == 0


def test_result_store_resumes_per_device_and_configuration(tmp_path):
    store = result_store.ResultStore("demo", tmp_path)
    config = {"size": "small", "seq": 128}
    assert not store.done(config)
    row = store.add(config, {"mean_ms": 1.5})
    assert row["size"] == "small" and row["mean_ms"] == 1.5 and row["run"] == store.run
    assert row["config_keys"] == ["seq", "size"] and row["device"] == store.env["device"]
    again = result_store.ResultStore("demo", tmp_path)
    assert again.run != store.run
    assert again.done(config)
    assert not again.done({"size": "small", "seq": 256})
    assert not again.done({"size": "small"})  # a subset of a measured configuration is another case
    assert again.pending([config, {"size": "small", "seq": 256}]) == [{"size": "small", "seq": 256}]
    assert again.asked_rows() == [row]  # what a re-run prints: the stored row of each configuration asked for
    longer = again.add({"size": "small", "seq": 256}, {"mean_ms": 3.0})
    assert again.asked_rows() == [row, longer]
    again.add(config, {"mean_ms": 1.0})
    assert again.asked_rows()[0]["mean_ms"] == 1.0
    assert again.newest({"size": "small"})["mean_ms"] == 1.0 and again.newest({"size": "large"}) is None
    assert not result_store.ResultStore("demo", tmp_path, force=True).done(config)
    # Rows measured on another device do not count.
    lines = (tmp_path / "demo.jsonl").read_text().replace(store.env["device"], "8x Some GPU")
    (tmp_path / "demo.jsonl").write_text(lines)
    assert not result_store.ResultStore("demo", tmp_path).done(config)
    with pytest.raises(ValueError, match="clash"):
        store.add({"mean_ms": 1}, {"mean_ms": 2})


def test_out_of_memory_is_a_row_and_other_errors_propagate():
    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    result = result_store.measure_or_oom(oom)
    assert result["oom"] is True and "out of memory" in result["error"]
    assert result_store.measure_or_oom(lambda: {"x": 1}) == {"oom": False, "x": 1}
    with pytest.raises(RuntimeError, match="shape mismatch"):
        result_store.measure_or_oom(lambda: (_ for _ in ()).throw(RuntimeError("shape mismatch")))


def test_timing_and_statistics():
    calls = []
    seconds = timing.time_calls(lambda: calls.append(1), warmup=3, steps=5)
    assert len(calls) == 8 and len(seconds) == 5 and all(s >= 0 for s in seconds)
    stats = timing.summarize_ms([0.001, 0.002, 0.003])
    assert stats["mean_ms"] == pytest.approx(2.0) and stats["median_ms"] == pytest.approx(2.0)
    assert stats["std_ms"] == pytest.approx(1.0) and stats["min_ms"] == pytest.approx(1.0)


def test_lm_flops_count_every_weight_matmul_and_attention():
    config = LMConfig("tiny", context_length=8, batch_size=2)
    model = build_model(config, torch.device("cpu"))
    matmul_params = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embedding" not in name)
    h = config.hparams
    total = flops.lm_forward_flops(10_000, h["d_model"], h["d_ff"], h["num_layers"], 2, 8)
    attention = h["num_layers"] * 2 * (2 * 2 * 8 * 8 * h["d_model"])  # Q K^T and P V, all heads
    assert total == 2 * 16 * matmul_params + attention
    causal = flops.lm_forward_flops(10_000, h["d_model"], h["d_ff"], h["num_layers"], 2, 8, causal_attention=True)
    assert total - causal == attention / 2


def test_kernel_table_and_matmul_classification():
    kernels = [("nvjet_tst_128x256_h_bz_TNT", 30.0), ("sm90_xmma_gemm_bf16", 10.0), ("softmax_kernel", 40.0),
               ("softmax_kernel", 20.0)]
    table = nsys_profile.kernel_table(kernels, steps=2)
    assert table["gpu_ms"] == pytest.approx(0.05) and table["kernel_launches"] == 2
    assert table["matmul_share"] == pytest.approx(40 / 100)
    assert table["top_kernels"][0] == {"name": "softmax_kernel", "ms": 0.03, "calls": 1.0, "share": 0.6, "matmul": False}
    assert [k["name"] for k in table["top_non_matmul"]] == ["softmax_kernel"]


TOOLS = sorted(path.stem for path in (REPO_ROOT / "cs336_systems" / "bench").glob("*.py") if path.stem != "__init__")


@pytest.mark.parametrize("name", TOOLS)
def test_every_tool_takes_quick_answers_help_and_is_documented(name, capsys):
    """The promise of docs/benchmarks.md: every tool takes ``--quick`` and documents its options under ``--help``;
    and every tool is there (a table row or its command line)."""
    tool = importlib.import_module(f"cs336_systems.bench.{name}")
    assert tool.parser().parse_args(["--quick"]).quick is True  # parse only
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out  # the help is the output here
    docs = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    documented = rf"\| `{name}\b|python -m cs336_systems\.bench\.{name}\b"
    assert re.search(documented, docs), f"docs/benchmarks.md lacks {name}"


def test_tools_that_only_read_run_with_no_arguments(tmp_path, capsys, monkeypatch):
    """``timeline`` with no traces says where traces come from; ``flash_log`` with no step shows its log;
    ``ddp_overhead_model`` names the files it reads."""
    from cs336_systems.bench import ddp_overhead_model, flash_log, timeline

    timeline.main([])
    assert "ddp_benchmarking --quick --trace" in capsys.readouterr().err
    committed = result_store.RESULTS_DIR / "flash_optimisation_log.jsonl"
    (tmp_path / committed.name).write_text(committed.read_text())
    measured = [row for row in read_rows(committed) if "leaderboard" in row]
    flash_log.main(["--results-dir", str(tmp_path)])
    table = capsys.readouterr().out.splitlines()  # the log is what this prints
    assert len(table) == 2 + len(measured) and table[2].startswith(f"| {measured[0]['step']} |")
    results = ddp_overhead_model.compare_files(result_store.RESULTS_DIR)
    assert {r["dtype"] for r in results} <= {"fp32", "bf16"} and results
    err = capsys.readouterr().err
    for problem in ("distributed_communication_single_node", "ddp_benchmarking"):
        assert f"# reading {result_store.RESULTS_DIR / problem}.jsonl" in err


def test_benchmarking_script_quick_writes_rows_and_resumes(tmp_path, capsys):
    argv = ["--quick", "--results-dir", str(tmp_path), "--modes", "forward", "train_step", "--dtypes", "fp32"]
    benchmarking_script.main(argv)
    path = tmp_path / "benchmarking_script.jsonl"
    assert f"# rows go to {path}" in capsys.readouterr().err
    rows = read_rows(tmp_path / "benchmarking_script.jsonl")
    assert [(r["mode"], r["dtype"]) for r in rows] == [("forward", "fp32"), ("train_step", "fp32")]
    train = rows[1]
    assert not train["oom"] and len(train["step_ms"]) == train["steps"]
    assert train["forward_mean_ms"] > 0 and train["backward_mean_ms"] > 0 and train["optimizer_mean_ms"] > 0
    assert train["mean_ms"] == pytest.approx(sum(train["step_ms"]) / len(train["step_ms"]))
    assert train["flops"] == 3 * rows[0]["flops"]
    capsys.readouterr()
    benchmarking_script.main(argv)  # everything measured already: no new rows, and it says so
    assert len(read_rows(path)) == 2
    out, err = capsys.readouterr()
    assert f"# every case is already in {path}: nothing to measure (--force measures again)" in err
    assert "rows go to" not in err
    table = out.splitlines()[-2:]  # the stored rows, not an empty table
    assert [line.split()[:3] for line in table] == [["tiny", "forward", "fp32"], ["tiny", "train_step", "fp32"]]


@pytest.mark.slow
def test_warmup_study_runs_each_warmup_count_in_its_own_process(tmp_path):
    benchmarking_script.main(["--quick", "--results-dir", str(tmp_path), "--modes", "forward", "--dtypes", "fp32",
                              "--warmup-study"])
    rows = read_rows(tmp_path / "benchmarking_script.jsonl")
    assert sorted(r["warmup"] for r in rows) == list(benchmarking_script.WARMUP_STUDY)
    assert {r["tag"] for r in rows} == {"warmup_study"} and len({r["run"] for r in rows}) == 4


def test_single_gpu_clis_quick_on_cpu(tmp_path):
    args = ["--quick", "--results-dir", str(tmp_path)]
    nsys_profile.main(args)
    mixed_precision_accumulation.main(args)
    benchmarking_mixed_precision.main(args)
    memory_profiling.main(args)
    pytorch_attention.main(args)
    accumulation = {r["variant"]: r["result"] for r in read_rows(tmp_path / "mixed_precision_accumulation.jsonl")}
    assert accumulation["float32 += float32"] == pytest.approx(10.0, abs=1e-3)
    assert abs(accumulation["float16 += float16"] - 10.0) > 1e-2  # float16 accumulation drifts
    profile = read_rows(tmp_path / "nsys_profile.jsonl")[0]
    assert profile["forward_python_ms"] > 0 and set(profile["attention_forward"]) == set(nsys_profile.ATTENTION_RANGES)
    dtypes = {r["autocast"]: r["dtypes"] for r in read_rows(tmp_path / "benchmarking_mixed_precision.jsonl")}
    assert dtypes["float16"]["parameters"] == "torch.float32" and dtypes["float16"]["fc1 output"] == "torch.float16"
    assert dtypes["float16"]["gradients"] == "torch.float32"
    for autocast, seen in dtypes.items():  # float32 under CUDA's autocast; CPU autocast runs LayerNorm low
        assert seen["LayerNorm output"] in ("torch.float32", f"torch.{autocast}")
    assert not (tmp_path / "memory_profiling.jsonl").exists()  # no CUDA memory to record on a CPU
    attention = read_rows(tmp_path / "pytorch_attention.jsonl")
    assert all(r["forward_median_ms"] > 0 and r["backward_median_ms"] > 0 for r in attention)


@pytest.mark.slow
def test_torch_compile_quick_model_part(tmp_path):
    torch_compile.main(["--quick", "--results-dir", str(tmp_path), "--part", "model", "--dtypes", "fp32",
                        "--compile-backend", "aot_eager"])
    rows = read_rows(tmp_path / "torch_compile.jsonl")
    assert {(r["mode"], r["compile"]) for r in rows} == {
        ("forward", False), ("train_step", False), ("forward", "aot_eager"), ("train_step", "aot_eager")}


def test_activation_checkpointing_keeps_logits_and_gradients_and_saves_less():
    config = LMConfig("tiny", context_length=16, batch_size=2)
    model = build_model(config, torch.device("cpu"))
    tokens = torch.randint(0, 10_000, (2, 16))
    logits = model(tokens)
    logits.square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=">= 0"):
        model.set_activation_checkpointing(-1)
    for group in (1, 2):
        model.zero_grad()
        model.set_activation_checkpointing(group)
        checkpointed = model(tokens)
        torch.testing.assert_close(checkpointed, logits, rtol=0, atol=0)
        checkpointed.square().mean().backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-6, atol=1e-7)
    x = torch.randn(2, 16, 64, requires_grad=True)
    per_block = gradient_checkpointing.saved_activation_bytes(model.layers[0], x, None)
    model.set_activation_checkpointing(0)
    whole = gradient_checkpointing.saved_activation_bytes(model, tokens, None)
    model.set_activation_checkpointing(1)
    assert gradient_checkpointing.saved_activation_bytes(model, tokens, None) < whole
    assert per_block > 10 * x.numel() * 4  # a block saves many times its input
    assert gradient_checkpointing.predicted_peak_activations(48, 4, 1, 10) == 12 * 1 + 4 * 10
    assert gradient_checkpointing.predicted_peak_activations(48, 0, 1, 10) == 480


def test_gradient_checkpointing_quick_on_cpu(tmp_path):
    gradient_checkpointing.main(["--quick", "--results-dir", str(tmp_path), "--group-sizes", "1", "2", "0"])
    rows = read_rows(tmp_path / "gradient_checkpointing.jsonl")
    assert [r["group_size"] for r in rows] == [1, 2, 0]
    assert all(r["saved_per_block_gb"] > 0 and r["predicted_optimum"] >= 1 and r["mean_ms"] > 0 for r in rows)



def test_op_overhead_rows_on_cpu(tmp_path):
    """``op_overhead`` on a CPU: PyTorch's providers only, tiny shapes, one row per (op, provider, shape, pass) with
    the issue and wall times."""
    from cs336_systems.bench import op_overhead

    op_overhead.main(["--quick", "--results-dir", str(tmp_path), "--ops", "attention", "adamw", "--calls", "2"])
    rows = [json.loads(line) for line in (tmp_path / "op_overhead.jsonl").read_text().splitlines()]
    assert {(r["op"], r["provider"], r["pass"]) for r in rows} == {
        ("attention", "sdpa_math", "forward"), ("attention", "sdpa_math", "forward_backward"),
        ("adamw", "torch_fused", "step")}
    assert all(r["issue_us"] > 0 and r["wall_us"] >= r["issue_us"] * 0.5 and r["device"].startswith("cpu") for r in rows)


def test_train_step_compares_with_the_fastest_torch_variant(tmp_path):
    from cs336_systems.bench import train_step
    from cs336_systems.bench.common.result_store import ResultStore

    store = ResultStore("train_step", tmp_path)
    case = dict(size="xl", context_length=512, batch_size=4, overrides=[], dtype="bf16", warmup=3, steps=8)
    assert train_step.fastest_torch_row(store, {**case, "stack": "ours", "variant": "default"}) is None
    store.add({**case, "stack": "torch", "variant": "default"}, {"step_ms": 120.0, "oom": False})
    store.add({**case, "stack": "torch", "variant": "cudagraphs"}, {"step_ms": 110.0, "oom": False})
    store.add({**case, "stack": "torch", "variant": "default"}, {"step_ms": 100.0, "oom": False})  # newer
    store.add({**case, "size": "large", "stack": "torch", "variant": "default"}, {"step_ms": 50.0, "oom": False})
    fastest = train_step.fastest_torch_row(store, {**case, "stack": "ours", "variant": "cudagraphs"})
    assert fastest["step_ms"] == 100.0 and fastest["variant"] == "default"


def test_cpu_runs_stay_small_and_quiet(capsys):
    """A CPU run silences torch's "No CUDA runtime is found" (torch.compile's C++ backend asks for CUDA_HOME); progress
    bars hold a thread lock, not a multiprocessing semaphore that spawned ranks would leak; the flash sweep's CPU
    smoke run is one length in fp32; --figures-dir says where CPU runs write."""
    import logging

    from tqdm import tqdm

    from cs336_systems.bench import flash_benchmarking
    from cs336_systems.bench.common import cli

    cli.announce(torch.device("cpu"), quick=True)
    assert logging.getLogger("torch.utils.cpp_extension").getEffectiveLevel() >= logging.ERROR
    with cli.progress([1, 2], "test") as bar:
        bar.update()
    assert not hasattr(tqdm.get_lock(), "mp_lock")
    args = flash_benchmarking.parser().parse_args(["--quick"])
    flash_benchmarking.resolve_defaults(args, torch.device("cpu"))
    assert (args.seq_lens, args.dtypes, args.head_dims) == ([64], ["fp32"], [16])
    figures = next(a for a in flash_benchmarking.parser()._actions if "--figures-dir" in a.option_strings)
    assert str(result_store.SCRATCH_DIR / "figures") in figures.help


def test_rows_name_the_commit_they_ran(monkeypatch):
    """The checkout's commit, marked when tracked files differ from it; an explicit one wins (a copied tree)."""
    monkeypatch.delenv("CS336_GIT_COMMIT", raising=False)
    assert re.fullmatch(r"([0-9a-f]{12}(\+modified)?|unknown)", result_store.git_commit())
    monkeypatch.setenv("CS336_GIT_COMMIT", "0123456789ab")
    assert result_store.git_commit() == "0123456789ab"


def test_latest_row_is_the_last_measured_then_the_furthest_down_the_file():
    def row(name, value, date):
        return {"name": name, "value": value, "env": {"date": date}}

    rows = [row("b", 1, "2026-01-02T00:00:00Z"), row("a", 2, "2026-01-03T00:00:00Z"),
            row("b", 3, "2026-01-01T00:00:00Z"),  # appended later, measured earlier: not the latest
            row("a", 4, "2026-01-03T00:00:00Z")]  # the same second: the later line wins
    latest = result_store.latest(rows, key=lambda r: r["name"])
    assert [(r["name"], r["value"]) for r in latest] == [("b", 1), ("a", 4)]  # keys in order of first appearance
    assert result_store.latest(rows) == [rows[3]] and result_store.latest([]) == []
    assert result_store.latest([{"value": 5}, {"value": 6}]) == [{"value": 6}]  # no dates: file order


def test_kernel_times_sum_each_kernels_gpu_time_per_call_and_skip_host_annotations():
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, us, device=cuda, annotation=False):
        return SimpleNamespace(name=name, device_time=us, device_type=device, is_user_annotation=annotation)

    events = [event("gemm", 300.0), event("gemm", 500.0), event("softmax", 40.0), event("optimizer.step", 900.0,
              annotation=True), event("aten::mm", 70.0, device=cpu)]
    ms, launches = timing.kernel_times_ms(events, per=2)
    assert ms == pytest.approx({"gemm": 0.4, "softmax": 0.02})
    assert launches == pytest.approx({"gemm": 1.0, "softmax": 0.5})
