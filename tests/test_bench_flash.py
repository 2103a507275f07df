"""The FlashAttention benchmarks: the provider registry and timing (``flash_providers``), the leaderboard CLI, the
sweep (``flash_benchmarking``) and the optimisation log (``flash_log``). CPU runs use the PyTorch providers; the
GPU tests (marker ``gpu``) run ours and the SDPA backends at small sizes."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch

from cs336_systems.attention.reference import reference_attention
from cs336_systems.bench import flash_benchmarking, flash_log, leaderboard
from cs336_systems.bench.common import attention_providers as fp
from cs336_systems.bench.common import timing

CPU = torch.device("cpu")
HAS_CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="checks the CPU defaults (on a GPU the defaults are the full runs)")


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def wrong_attention(q, k, v, is_causal=True):
    """Right output, a value gradient 10% too large: a bug only the gradient check sees."""
    v = 1.1 * v - 0.1 * v.detach()
    return fp.get_provider("naive").build()(q, k, v, is_causal)


# ---------------------------------------------------------------------------------------------------
# Providers, timing, checks
# ---------------------------------------------------------------------------------------------------


def test_registry_names_the_competitors_and_rejects_unknown_names():
    assert set(fp.LEADERBOARD_PROVIDERS.values()) <= set(fp.PROVIDERS)
    assert set(flash_benchmarking.GPU_PROVIDERS) <= set(fp.PROVIDERS)
    assert {name: fp.PROVIDERS[name].sdpa_backend for name in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient")} == {
        "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}
    assert fp.get_provider("ours").triton and fp.get_provider("ours_compiled").triton
    assert "CUDA GPU" in fp.get_provider("ours").unavailable_reason(CPU)
    assert fp.get_provider("naive").unavailable_reason(CPU) is None
    with pytest.raises(ValueError, match="unknown provider"):
        fp.get_provider("cudnn")


@pytest.mark.parametrize("name", ["naive", "flash_pytorch", "sdpa_flash"])
def test_cpu_providers_compute_causal_attention_on_folded_heads(name):
    q, k, v = fp.make_inputs(3, 48, 16, torch.float32, CPU)
    assert q.shape == (3, 48, 16) and q._base is k._base is v._base and q._base.requires_grad
    expected, _ = reference_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    provider = fp.get_provider(name)
    with provider.context():
        out = provider.build()(q, k, v, True)
    torch.testing.assert_close(out.reshape(expected.shape), expected, rtol=1e-4, atol=1e-5)


def test_summary_statistics_and_cpu_timer_budget():
    stats = timing.summarize_samples_ms([4.0, 1.0, 3.0, 2.0, 5.0], prefix="fwd_")
    assert stats == {"fwd_ms": 3.0, "fwd_median_ms": 3.0, "fwd_p20_ms": 2.0, "fwd_p80_ms": 5.0, "fwd_min_ms": 1.0,
                     "fwd_samples": 5}
    calls = []
    timed = timing.do_bench_ms(lambda: calls.append(1), CPU, warmup_ms=1, rep_ms=5)
    assert timed["samples"] >= 1 and timed["min_ms"] <= timed["median_ms"] <= timed["ms"] * timed["samples"]
    assert len(calls) >= 4 + timed["samples"]  # first call, estimate, warm-up, timed


def test_phases_time_forward_backward_and_the_leaderboard_protocol():
    q, k, v = fp.make_inputs(2, 32, 16, torch.float32, CPU)
    naive = fp.get_provider("naive").build()
    dq, _, dv = fp.phase_callable("bwd", naive, q, k, v)()
    assert dq.shape == q.shape and dv.abs().sum() > 0 and q._base.grad is None  # autograd.grad: nothing accumulates
    fp.phase_callable("fwd_bwd", naive, q, k, v, sum_backward=True)()
    expected = torch.autograd.grad(naive(q, k, v, True).sum(), (q, k, v))
    torch.testing.assert_close(q._base.grad, torch.stack(expected))  # o.sum().backward() into the (3, ...) leaf
    fp.reset_grads(q, k, v)
    assert q._base.grad is None
    with pytest.raises(ValueError, match="unknown phase"):
        fp.phase_callable("step", naive, q, k, v)


def test_time_phases_records_out_of_memory_and_backend_refusals_as_rows():
    q, k, v = fp.make_inputs(1, 32, 16, torch.float32, CPU)

    def forward_fits_backward_does_not(q, k, v, is_causal):
        return OutOfMemoryInBackward.apply(q + k + v)

    class OutOfMemoryInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    flaky = dataclasses.replace(fp.get_provider("naive"), build=lambda: forward_fits_backward_does_not)
    result = fp.time_phases(flaky, q, k, v, CPU, warmup_ms=1, rep_ms=2)
    assert result["oom"] and result["oom_phase"] == "bwd" and result["fwd_ms"] > 0 and "fwd_bwd_ms" not in result
    assert "out of memory" in result["error"]

    # cuDNN has no CPU kernel, and no float32 kernel on a GPU: either way SDPA refuses.
    device = torch.device("cuda") if HAS_CUDA else CPU
    refused = fp.time_phases(fp.get_provider("sdpa_cudnn"), *fp.make_inputs(1, 32, 16, torch.float32, device), device,
                             warmup_ms=1, rep_ms=2)
    assert refused["unsupported"] and "No viable backend" in refused["error"] and "fwd_ms" not in refused

    def broken(q, k, v, is_causal):
        raise RuntimeError("a bug in our kernel")

    with pytest.raises(RuntimeError, match="a bug"):  # only SDPA's refusals become rows
        fp.time_phases(dataclasses.replace(flaky, build=lambda: broken), q, k, v, CPU, warmup_ms=1, rep_ms=2)


def test_check_against_sdpa_passes_right_attention_and_catches_a_wrong_gradient():
    q, k, v = fp.make_inputs(2, 64, 16, torch.bfloat16, CPU)
    right = fp.check_against_sdpa(fp.get_provider("naive").build(), q, k, v)
    assert right["matches_sdpa"] and right["checked_heads"] == 2
    assert set(right["max_rel_err"]) == {"o", "dq", "dk", "dv"} and 0 < right["sdpa_max_rel_err"]["o"] < 1e-2
    wrong = fp.check_against_sdpa(wrong_attention, q, k, v)
    assert not wrong["matches_sdpa"] and wrong["max_rel_err"]["dv"] > 0.05 and wrong["max_rel_err"]["o"] < 1e-2
    # The float32 reference covers as many heads as fit the byte budget, at least one.
    assert fp.check_against_sdpa(fp.get_provider("naive").build(), q, k, v, reference_bytes=1)["checked_heads"] == 1
    assert fp.errors_acceptable({"o": 0.011}, {"o": 0.004}) and not fp.errors_acceptable({"o": 0.02}, {"o": 0.004})


def test_graph_breaks_are_counted_on_the_first_compiled_call():
    @torch.compiler.disable
    def launch(x):
        return x * 2

    def with_break(q, k, v, is_causal):
        return launch(q) + k + v

    q, k, v = fp.make_inputs(1, 8, 16, torch.float32, CPU)
    broken = fp.first_call_graph_breaks(torch.compile(with_break, backend="eager"), q, k, v)
    assert broken["graph_breaks"] == 1 and "disable" in broken["graph_break_reasons"][0]
    assert q._base.grad is None  # the check leaves the timed tensors clean
    # A second wrapper of the same function reuses dynamo's cache; the count must not fall to zero.
    assert fp.first_call_graph_breaks(torch.compile(with_break, backend="eager"), q, k, v)["graph_breaks"] == 1
    clean = fp.first_call_graph_breaks(torch.compile(lambda q, k, v, c: q * k + v, backend="eager"), q, k, v)
    assert clean["graph_breaks"] == 0 and clean["graphs"] == 1


@pytest.mark.compiled_kernels  # our kernels' names are those of compiled (not interpreted) Triton functions
def test_kernel_classification_finds_ours_and_library_attention():
    launched = ["attn_fwd_kernel", "triton_red_fused_sum_0", "attn_bwd_dkdv_kernel_0d1d",
                "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "fmha_cutlassB_f16_aligned_64x64",
                "void at::native::vectorized_elementwise_kernel"]
    found = fp.classify_kernels(launched, {"attn_fwd_kernel", "attn_bwd_dkdv_kernel", "_attn_fwd_sweep"})
    assert found == {"our_kernels": ["attn_fwd_kernel", "attn_bwd_dkdv_kernel_0d1d"],
                     "foreign_attention_kernels": ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
                                                   "fmha_cutlassB_f16_aligned_64x64"]}
    assert {"attn_fwd_kernel", "attn_bwd_kernel"} <= fp.our_kernel_names()


# ---------------------------------------------------------------------------------------------------
# The command lines
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cli", [leaderboard, flash_benchmarking, flash_log], ids=lambda m: m.__name__.rsplit(".")[-1])
def test_clis_answer_help(cli, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--quick" in out
    # leaderboard and flash_log never resume (every call appends): no --force to offer
    assert ("--force" in out) == (cli is flash_benchmarking)


def test_leaderboard_defaults_follow_the_official_protocol():
    args = leaderboard.parser().parse_args([])
    leaderboard.resolve_defaults(args, torch.device("cuda"))
    assert (args.heads, args.seq_len, args.d_head, args.dtype, args.rep, args.warmup) == (16, 16384, 64, "bf16",
                                                                                           10_000, 1_000)
    assert args.providers == ["ours", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"]
    quick = leaderboard.parser().parse_args(["--quick"])
    leaderboard.resolve_defaults(quick, torch.device("cuda"))
    assert (quick.rep, quick.warmup, quick.seq_len) == (500, 100, 16384)
    chosen = leaderboard.parser().parse_args(["--quick", "--rep", "2000"])
    leaderboard.resolve_defaults(chosen, torch.device("cuda"))
    assert chosen.rep == 2000


def test_leaderboard_ratios():
    results = {"ours": {"fwd_bwd_ms": 4.0, "fwd_ms": 1.0}, "sdpa_cudnn": {"fwd_bwd_ms": 5.0, "fwd_ms": 2.0},
               "sdpa_efficient": {"error": "No viable backend", "unsupported": True}}
    fp.add_ratios(results)
    assert results["sdpa_cudnn"]["ours_over_this_fwd_bwd"] == 0.8 and results["sdpa_cudnn"]["ours_over_this_fwd"] == 0.5
    assert results["sdpa_efficient"]["ours_over_this_fwd_bwd"] is None
    assert results["ours"]["ratios"] == {"sdpa_cudnn": 0.8, "sdpa_efficient": None}


@cpu_only
def test_leaderboard_on_cpu_writes_a_row_per_provider_and_never_resumes(tmp_path, capsys):
    argv = ["--results-dir", str(tmp_path), "--seq-len", "64", "--rep", "5", "--warmup", "1"]
    leaderboard.main(argv)
    rows = {r["provider"]: r for r in read_rows(tmp_path / "leaderboard.jsonl")}
    assert list(rows) == ["ours", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"]
    assert "CUDA GPU" in rows["ours"]["error"] and rows["sdpa_cudnn"]["unsupported"]
    flash = rows["sdpa_flash"]
    assert flash["fwd_bwd_ms"] > 0 and flash["fwd_ms"] > 0 and (flash["heads"], flash["seq_len"]) == (2, 64)
    assert flash["dtype"] == "bf16" and flash["device"].startswith("cpu") and flash["rep_ms"] == 5
    out = capsys.readouterr().out
    assert "cuDNN backend has no CPU kernel" in out and "memory-efficient backend has no CPU kernel" in out
    assert "No viable backend" not in out  # not tried: PyTorch's warning stays away
    leaderboard.main(argv + ["--providers", "sdpa_flash", "--no-fwd"])
    again = read_rows(tmp_path / "leaderboard.jsonl")
    assert len(again) == 5 and again[-1]["run"] != flash["run"] and "fwd_ms" not in again[-1]


def test_sweep_grid_defaults_and_length_caps():
    args = flash_benchmarking.parser().parse_args([])
    flash_benchmarking.resolve_defaults(args, torch.device("cuda"))
    assert args.seq_lens == [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
    assert args.head_dims == [16, 32, 64, 128] and args.dtypes == ["bf16", "fp32"]
    assert args.providers == flash_benchmarking.GPU_PROVIDERS and (args.rep, args.warmup) == (100, 25)
    cases = flash_benchmarking.make_cases(args)
    assert max(c["seq_len"] for c in cases if c["provider"] == "flash_pytorch") == 1024
    assert max(c["seq_len"] for c in cases if c["provider"] == "naive") == 65536  # out of memory is a row
    assert len(cases) == 2 * 4 * (10 * 5 + 4)
    assert cases[0] == dict(provider="ours", seq_len=128, d_head=16, dtype="bf16", batch=1, causal=True, rep_ms=100,
                            warmup_ms=25)
    capped = flash_benchmarking.parser().parse_args(["--naive-max-seq", "4096", "--providers", "naive"])
    flash_benchmarking.resolve_defaults(capped, torch.device("cuda"))
    assert max(c["seq_len"] for c in flash_benchmarking.make_cases(capped)) == 4096


def test_sweep_cases_of_ours_in_float32_carry_the_products():
    args = flash_benchmarking.parser().parse_args(["--fp32-products", "tf32x3", "--providers", "ours", "naive",
                                                   "--seq-lens", "128", "--head-dims", "64"])
    flash_benchmarking.resolve_defaults(args, torch.device("cuda"))
    keyed = {(c["provider"], c["dtype"]): c.get("fp32_products") for c in flash_benchmarking.make_cases(args)}
    assert keyed == {("ours", "bf16"): None, ("naive", "bf16"): None, ("ours", "fp32"): "tf32x3",
                     ("naive", "fp32"): None}
    ieee = flash_benchmarking.parser().parse_args(["--fp32-products", "ieee", "--providers", "ours",
                                                   "--seq-lens", "128", "--head-dims", "64", "--dtypes", "fp32"])
    flash_benchmarking.resolve_defaults(ieee, torch.device("cuda"))
    assert [c.get("fp32_products") for c in flash_benchmarking.make_cases(ieee)] == ["ieee"]


def test_sweep_table_shows_out_of_memory_and_refusals():
    rows = [dict(provider="naive", seq_len=128, d_head=16, dtype="fp32", fwd_bwd_ms=1.5),
            dict(provider="naive", seq_len=256, d_head=16, dtype="fp32", fwd_ms=3.0, oom=True, error="out of memory"),
            dict(provider="sdpa_flash", seq_len=128, d_head=16, dtype="fp32", error="No viable backend")]
    frame = flash_benchmarking.table(rows)
    assert frame.loc[("fp32", 16, 128), "naive"] == 1.5
    assert frame.loc[("fp32", 16, 256), "naive"] == "OOM" and frame.loc[("fp32", 16, 128), "sdpa_flash"] == "n/a"


@cpu_only
def test_sweep_quick_on_cpu_writes_rows_resumes_and_plots(tmp_path, capsys, monkeypatch):
    from cs336_systems.attention import flash_pytorch

    # The tiled PyTorch backward uncompiled: inductor's CPU compile takes most of a minute on a busy machine, and
    # test_flash_attention_pytorch tests the compiled one.
    monkeypatch.setattr(flash_pytorch, "_compiled_backward", flash_pytorch.flash_attention_backward)
    argv = ["--quick", "--results-dir", str(tmp_path), "--figures-dir", str(tmp_path), "--dtypes", "fp32",
            "--seq-lens", "64", "128", "--providers", "ours", "naive", "flash_pytorch", "sdpa_cudnn",
            "--flash-pytorch-max-seq", "64"]
    flash_benchmarking.main(argv + ["--time-limit-s", "0"])
    assert "time limit reached" in capsys.readouterr().err
    assert not (tmp_path / "flash_benchmarking.jsonl").exists()
    flash_benchmarking.main(argv)
    rows = read_rows(tmp_path / "flash_benchmarking.jsonl")
    assert [(r["provider"], r["seq_len"]) for r in rows] == [("naive", 64), ("flash_pytorch", 64), ("naive", 128)]
    for row in rows:
        assert (row["d_head"], row["dtype"], row["batch"], row["causal"]) == (16, "fp32", 1, True)
        assert not row["oom"] and row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and row["fwd_bwd_ms"] > 0
    captured = capsys.readouterr()
    assert "skipping ours" in captured.err and "skipping sdpa_cudnn" in captured.err
    assert (tmp_path / "flash_benchmarking_fp32.png").stat().st_size > 1000
    flash_benchmarking.main(argv + ["--no-plot"])  # everything measured: nothing new
    assert len(read_rows(tmp_path / "flash_benchmarking.jsonl")) == 3


def test_flash_log_points_summaries_and_markdown(tmp_path):
    assert flash_log.point("16384x64") == (16384, 64)
    with pytest.raises(Exception, match="LENGTHxHEAD_DIM"):
        flash_log.point("16384")
    board = flash_log.leaderboard_summary({
        "ours": {"fwd_bwd_ms": 4.5, "fwd_ms": 1.5, "verified": True, "graph_breaks": 0, "max_rel_err": {"o": 0.003}},
        "sdpa_cudnn": {"fwd_bwd_ms": 5.0, "fwd_ms": 1.6}})
    assert board["ratio_vs_cudnn"] == pytest.approx(0.9) and board["verified"] and board["graph_breaks"] == 0
    summary = flash_log.point_summary(65536, 128, {
        "ours": {"fwd_ms": 2.0, "bwd_ms": 6.0, "fwd_bwd_ms": 8.0}, "sdpa_cudnn": {"fwd_bwd_ms": 7.0},
        "sdpa_flash": {"oom": True, "error": "CUDA out of memory"}})
    assert summary["ratio_vs_cudnn"] == pytest.approx(8 / 7) and summary["ratio_vs_fa2"] is None
    assert summary["sdpa_flash_error"] == "out of memory" and summary["ours_bwd_ms"] == 6.0

    rows = [{"step": "baseline", "decision": "baseline", "commit": "abc", "dirty": False, "hypothesis": "as is",
             "leaderboard": board, "points": [summary]},
            {"step": "tiles", "decision": "pending", "commit": "def", "dirty": True, "hypothesis": "a | b",
             "leaderboard": {**board, "ours_fwd_bwd_ms": None, "ratio_vs_cudnn": None}, "points": []},
            {"step": "tiles", "decision": "dropped", "note": "slower"}]
    table = flash_log.markdown(rows).splitlines()
    assert table[0].startswith("| step | decision | commit") and "65536x128 ours/cuDNN, ours/FA2" in table[0]
    assert table[2] == "| baseline | baseline | abc | as is | 4.500 | 5.000 | 0.90 | 1.14, - |"
    assert table[3] == "| tiles | dropped | def+dirty | a / b | - | 5.000 | - | -, - |"


def test_flash_log_decisions_show_and_cpu_refusal(tmp_path, capsys, monkeypatch):
    base = ["--results-dir", str(tmp_path)]
    flash_log.main(base)  # no --step: the log so far, empty
    assert capsys.readouterr().out.splitlines()[0].startswith("| step | decision |")
    flash_log.main(base + ["--step", "tiles", "--set-decision", "--decision", "kept", "--note", "won 3%"])
    (row,) = read_rows(tmp_path / "flash_optimisation_log.jsonl")
    assert (row["step"], row["decision"], row["note"]) == ("tiles", "kept", "won 3%") and "leaderboard" not in row
    flash_log.main(base + ["--show"])
    assert "| step | decision |" in capsys.readouterr().out
    monkeypatch.setattr(flash_log.timing, "default_device", lambda: CPU)
    with pytest.raises(SystemExit) as exit_info:
        flash_log.main(base + ["--step", "x"])
    assert exit_info.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_flash_log_measures_a_step_with_cpu_stand_ins(tmp_path, monkeypatch):
    """The whole measurement on the CPU: the naive attention stands in for ours, tiny shapes."""
    for name in ("ours", "ours_compiled"):
        monkeypatch.setitem(fp.PROVIDERS, name, dataclasses.replace(fp.PROVIDERS["naive"], name=name))
    monkeypatch.setattr(fp, "LEADERBOARD_HEADS", 2)
    monkeypatch.setattr(fp, "LEADERBOARD_SEQ_LEN", 64)
    monkeypatch.setattr(fp, "LEADERBOARD_D_HEAD", 16)
    args = flash_log.parser().parse_args(["--step", "s", "--rep", "3", "--warmup", "1", "--points", "64x16",
                                          "--point-rep", "3", "--point-warmup", "1"])
    measured = flash_log.measure_step(args, CPU)
    board, (point,) = measured["leaderboard"], measured["points"]
    assert board["ours_fwd_bwd_ms"] > 0 and board["ours_fwd_ms"] > 0
    if not HAS_CUDA:  # cuDNN refuses CPU tensors; the flash backend has a CPU kernel
        assert board["ratio_vs_cudnn"] is None and "sdpa_cudnn_error" in point
        assert point["ratio_vs_fa2"] == pytest.approx(point["ours_fwd_bwd_ms"] / point["sdpa_flash_fwd_bwd_ms"])
    assert (point["seq_len"], point["d_head"]) == (64, 16)
    assert all(point[f"ours_{phase}_ms"] > 0 for phase in fp.PHASES)


# ---------------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fixed_tiles_restored():
    """Let ``--fixed-tiles`` switch autotuning off, and switch it back afterwards."""
    from cs336_systems.attention.config import FLASH_CONFIG

    with FLASH_CONFIG.use():
        yield


@pytest.fixture(scope="module")
def gpu_leaderboard_rows(tmp_path_factory):
    results = tmp_path_factory.mktemp("leaderboard")
    with fixed_tiles_restored(), contextlib.suppress(SystemExit):  # a failed check exits 1 after writing the rows
        leaderboard.main(["--results-dir", str(results), "--heads", "2", "--seq-len", "1024", "--rep", "20",
                          "--warmup", "5", "--fixed-tiles"])
    return {r["provider"]: r for r in read_rows(results / "leaderboard.jsonl")}


@pytest.mark.gpu
def test_leaderboard_on_gpu_times_ours_and_every_sdpa_backend(gpu_leaderboard_rows):
    ours = gpu_leaderboard_rows["ours"]
    assert ours["fwd_bwd_ms"] > 0 and ours["fwd_ms"] > 0 and ours["implementation"].startswith("torch.compile")
    assert ours["matches_sdpa"], (ours["max_rel_err"], ours["sdpa_max_rel_err"])
    assert ours["kernels_ok"], (ours["our_kernels"], ours["foreign_attention_kernels"])
    for name in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient"):
        row = gpu_leaderboard_rows[name]
        assert row.get("fwd_bwd_ms", 0) > 0 or row.get("unsupported"), row
        assert ours["ratios"][name] == fp.ratio(ours["fwd_bwd_ms"], row.get("fwd_bwd_ms"))


@pytest.mark.gpu
def test_compiled_wrapper_has_no_graph_break(gpu_leaderboard_rows):
    ours = gpu_leaderboard_rows["ours"]
    assert ours["graph_breaks"] == 0, ours["graph_break_reasons"]
    assert ours["graph_breaks_after_first_call"] == 0 and ours["verified"]


@pytest.mark.gpu
def test_sweep_quick_on_gpu(tmp_path):
    with fixed_tiles_restored():
        flash_benchmarking.main(["--results-dir", str(tmp_path), "--figures-dir", str(tmp_path), "--providers",
                                 "ours", "sdpa_cudnn", "sdpa_flash", "--seq-lens", "128", "1000", "--head-dims", "64",
                                 "--dtypes", "bf16", "fp32", "--rep", "10", "--warmup", "2", "--fixed-tiles"])
    rows = {(r["provider"], r["seq_len"], r["dtype"]): r for r in read_rows(tmp_path / "flash_benchmarking.jsonl")}
    assert len(rows) == 12
    for seq_len in (128, 1000):
        assert rows[("ours", seq_len, "fp32")]["fwd_bwd_ms"] > 0 and rows[("ours", seq_len, "bf16")]["bwd_ms"] > 0
        assert rows[("ours", seq_len, "bf16")]["autotune"] is False
        assert rows[("sdpa_flash", seq_len, "fp32")]["unsupported"]
        assert rows[("sdpa_flash", seq_len, "bf16")]["fwd_bwd_ms"] > 0
    assert (tmp_path / "flash_benchmarking_bf16.png").exists()


def test_providers_answer_to_the_library_names_and_rows_keep_theirs():
    from cs336_systems.attention import ATTENTION_NAMES

    assert set(fp.LIBRARY_NAMES.values()) <= set(ATTENTION_NAMES)
    assert fp.get_provider("triton") is fp.PROVIDERS["ours"] and fp.get_provider("compiled").name == "naive_compiled"
    args = flash_benchmarking.parser().parse_args(["--providers", "triton", "compiled", "sdpa_cudnn"])
    assert args.providers == ["ours", "naive_compiled", "sdpa_cudnn"]
    with pytest.raises(ValueError, match="or a library name: triton"):
        fp.get_provider("cudnn")
