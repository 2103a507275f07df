"""The benchmark tools' command lines: the course edition's size names, checked arguments, clear errors."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cs336_systems.bench.common import cli, model_sizes, result_store
from cs336_systems.bench.common.lm import LMConfig, build_model

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "cs336_systems" / "bench"
TOOLS = sorted(path.stem for path in BENCH.glob("*.py") if path.stem != "__init__")


def tool_parser(name: str):
    return importlib.import_module(f"cs336_systems.bench.{name}").parser()


def size_option(parser) -> str | None:
    """``--sizes`` or ``--size`` where the tool takes model sizes, else None."""
    options = parser._option_string_actions
    return next((option for option in ("--sizes", "--size") if option in options), None)


SIZED_TOOLS = [name for name in TOOLS if name != "demo" and size_option(tool_parser(name))]


def exit_message(capsys, call) -> str:
    """What a command line that must exit with status 2 (argparse's usage error) printed on stderr."""
    with pytest.raises(SystemExit) as exited:
        call()
    assert exited.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# Editions and sizes
# ---------------------------------------------------------------------------------------------------


def test_edition_names_map_to_canonical_keys_and_back():
    assert model_sizes.canonical_size("xl", "2026") == "2.7B"
    assert model_sizes.canonical_size("xl", "2025") == "xl"
    assert model_sizes.canonical_size("10B", "2026") == "10B"
    assert model_sizes.size_label("2.7B", "2026") == "xl"
    assert model_sizes.size_label("2.7B", "2025") == "2.7B"
    assert model_sizes.size_label("xl", "2026") is None  # 2025's xl (1600 wide) is no 2026 size
    assert model_sizes.size_label("10B", "2025") is None
    for edition, names in model_sizes.EDITIONS.items():
        for name in names:
            assert model_sizes.size_label(model_sizes.canonical_size(name, edition), edition) == name
    assert model_sizes.edition_sizes("2026") == ["small", "medium", "large", "2.7B", "10B"]
    assert model_sizes.edition_sizes("2025") == ["small", "medium", "large", "xl", "2.7B"]
    with pytest.raises(ValueError, match="'10B' is no model size of the 2025 edition"):
        model_sizes.canonical_size("10B", "2025")


def test_the_shape_defines_the_key():
    shapes = [tuple(shape.values()) for shape in model_sizes.SHAPES.values()]
    assert len(set(shapes)) == len(shapes)
    assert model_sizes.SHAPES["2.7B"] == dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32)
    assert model_sizes.SHAPES["10B"] == dict(d_model=4608, d_ff=12288, num_layers=50, num_heads=36)


@pytest.mark.parametrize("size", ["10B", "2.7B", "tiny"])
def test_parameter_count_matches_a_model_built_on_the_meta_device(size):
    model = build_model(LMConfig(size, 16), torch.device("meta"))
    assert model_sizes.size_parameters(size) == sum(p.numel() for p in model.parameters())
    if size == "10B":
        assert model_sizes.size_parameters(size) == pytest.approx(12.83e9, rel=1e-3)


def test_the_estimate_refuses_only_what_cannot_fit(monkeypatch):
    monkeypatch.setattr(model_sizes, "device_memory_bytes", lambda device: 141e9)
    row = model_sizes.estimated_oom("10B", "train_step", torch.device("cpu"))
    assert row["oom"] is True
    assert row["oom_estimate_gb"] == pytest.approx(16 * 12.8328e9 / 1e9, rel=1e-4)  # ~205 GB
    assert row["device_memory_gb"] == pytest.approx(141)
    assert "205 GB > 141 GB" in row["oom_reason"]
    assert model_sizes.estimated_oom("10B", "forward_backward", torch.device("cpu")) is None  # 103 GB: try it
    assert model_sizes.estimated_oom("xl", "train_step", torch.device("cpu")) is None


def test_a_10b_case_that_cannot_fit_is_an_oom_row_made_without_building_the_model(monkeypatch, tmp_path):
    from cs336_systems.bench import benchmarking_script

    monkeypatch.setattr(model_sizes, "device_memory_bytes", lambda device: 40e9)  # under the 51 GB of weights

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(benchmarking_script, "build_model", no_model)
    benchmarking_script.main(["--sizes", "10B", "--modes", "forward", "train_step", "--dtypes", "fp32",
                              "--results-dir", str(tmp_path)])
    rows = result_store.read_rows(tmp_path / "benchmarking_script.jsonl")
    assert [(row["mode"], row["oom"]) for row in rows] == [("forward", True), ("train_step", True)]
    by_mode = {row["mode"]: row for row in rows}
    assert by_mode["forward"]["oom_estimate_gb"] == pytest.approx(4 * 12.8328e9 / 1e9, rel=1e-4)
    assert by_mode["train_step"]["oom_estimate_gb"] == pytest.approx(16 * 12.8328e9 / 1e9, rel=1e-4)
    assert "AdamW moments" in by_mode["train_step"]["oom_reason"]
    assert all((row["size"], row["edition"], row["size_label"]) == ("10B", "2026", "10B") for row in rows)


def test_rows_keep_the_canonical_size_and_resume_across_editions(tmp_path):
    config = dict(size="2.7B", context_length=16, mode="forward")
    first = result_store.ResultStore("p", tmp_path, edition="2025", quiet=True)
    row = first.add(config, {"mean_ms": 1.0})
    assert (row["size"], row["edition"], row["size_label"]) == ("2.7B", "2025", "2.7B")
    assert "edition" not in row["config_keys"] and "size_label" not in row["config_keys"]
    again = result_store.ResultStore("p", tmp_path, edition="2026", quiet=True)
    assert again.done(config)
    assert again.pending([config, {**config, "size": "10B"}]) == [{**config, "size": "10B"}]
    assert again.add({**config, "context_length": 32}, {})["size_label"] == "xl"


# ---------------------------------------------------------------------------------------------------
# Every tool that takes model sizes takes --edition
# ---------------------------------------------------------------------------------------------------


def test_the_tools_with_model_sizes_are_found():
    assert {"benchmarking_script", "train_step", "ddp_benchmarking", "fsdp_accounting", "memory_profiling",
            "gradient_checkpointing", "rmsnorm", "op_overhead"} <= set(SIZED_TOOLS)


@pytest.mark.parametrize("tool", SIZED_TOOLS)
def test_each_tool_parses_the_editions_size_names(tool, capsys):
    parser = tool_parser(tool)
    option = size_option(parser)
    dest = option.removeprefix("--")

    def parsed(*argv):
        return getattr(parser.parse_args(list(argv)), dest)

    one = (lambda value: [value]) if dest == "sizes" else (lambda value: value)
    assert parser.parse_args([]).edition == "2026"
    assert parsed(option, "xl") == one("2.7B")
    assert parsed("--edition", "2025", option, "xl") == one("xl")
    assert parsed(option, "10B") == one("10B")
    assert parsed(option, "tiny") == one("tiny")
    assert "is no model size of the 2025 edition" in exit_message(
        capsys, lambda: parser.parse_args(["--edition", "2025", option, "10B"]))
    assert "invalid choice: '2024'" in exit_message(capsys, lambda: parser.parse_args(["--edition", "2024"]))
    assert "default 2026" in " ".join(parser.format_help().split())


def test_mixed_precision_passes_its_edition_on(monkeypatch, tmp_path):
    from cs336_systems.bench import benchmarking_mixed_precision

    commands, run = [], subprocess.run

    def record_benchmarks(command, **options):  # other commands (git, asking for the commit) run
        if "cs336_systems.bench.benchmarking_script" in command:
            return commands.append(command)
        return run(command, **options)

    monkeypatch.setattr(subprocess, "run", record_benchmarks)
    benchmarking_mixed_precision.main(["--edition", "2025", "--timings", "--sizes", "xl",
                                       "--results-dir", str(tmp_path)])
    (command,) = commands
    assert command[command.index("--edition") + 1] == "2025" and command[command.index("--sizes") + 1] == "xl"


# ---------------------------------------------------------------------------------------------------
# Checked arguments
# ---------------------------------------------------------------------------------------------------


def test_count_types_refuse_what_cannot_be_counted():
    assert cli.positive_int("3") == 3 and cli.non_negative_int("0") == 0 and cli.positive_float("0.5") == 0.5
    for type_, text in ((cli.positive_int, "0"), (cli.positive_int, "-2"), (cli.positive_int, "2.5"),
                        (cli.non_negative_int, "-1"), (cli.positive_float, "0"), (cli.positive_float, "nan"),
                        (cli.positive_float, "x")):
        with pytest.raises(Exception) as error:
            type_(text)
        assert error.type.__name__ == "ArgumentTypeError", (type_, text)


@pytest.mark.parametrize(("argv", "message"), [
    (["--quick", "--steps", "0"], "argument --steps: 0 must be at least 1"),
    (["--context-length", "0"], "argument --context-length: 0 must be at least 1"),
    (["--batch-size", "0"], "argument --batch-size: 0 must be at least 1"),
    (["--warmup", "-1"], "argument --warmup: -1 must be at least 0"),
    (["--attention", "bogus"], "argument --attention: invalid choice: 'bogus'"),
])
def test_benchmarking_script_refuses_bad_arguments_before_measuring(argv, message, capsys, tmp_path):
    from cs336_systems.bench import benchmarking_script

    assert message in exit_message(capsys, lambda: benchmarking_script.main([*argv, "--results-dir", str(tmp_path)]))
    assert not (tmp_path / "benchmarking_script.jsonl").exists()


@pytest.mark.parametrize(("tool", "argv", "message"), [
    ("ddp_benchmarking", ["--variants", "bucketed_0mb"], "N of bucketed_<N>mb is the bucket cap in MiB and must be "
                                                         "above 0"),
    ("ddp_benchmarking", ["--world-size", "0"], "argument --world-size: 0 must be at least 1"),
    ("train_step", ["--shapes", "0:4"], "expected a shape context:batch of positive whole numbers"),
    ("train_step", ["--steps", "0"], "argument --steps: 0 must be at least 1"),
    ("pytorch_attention", ["--seq-lens", "0"], "argument --seq-lens: 0 must be at least 1"),
    ("leaderboard", ["--d-head", "0"], "argument --d-head: 0 must be at least 1"),
    ("distributed_communication_single_node", ["--sizes-mb", "0"], "argument --sizes-mb: 0 must be above 0"),
    ("flash_log", ["--points", "0x64"], "expected a point LENGTHxHEAD_DIM of positive whole numbers"),
    ("memory_profiling", ["--render", "/nonexistent.pickle"], "no such file: /nonexistent.pickle"),
    ("timeline", ["/nonexistent.json"], "no such file: /nonexistent.json"),
])
def test_tools_refuse_bad_arguments_with_a_message(tool, argv, message, capsys):
    module = importlib.import_module(f"cs336_systems.bench.{tool}")
    assert message in exit_message(capsys, lambda: module.main(argv))


def test_a_corrupt_results_line_names_its_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"a": 1}) + "\n\n" + '{"a": 2, "b": }\n')
    with pytest.raises(ValueError, match=rf"{path}, line 3: not a JSON row \(Expecting value at column 15\)"):
        result_store.ResultStore("p", tmp_path, quiet=True)


def test_no_progress_bar_when_nothing_is_left(capsys):
    bar = cli.progress([], "nothing")
    bar.update()
    bar.close()
    assert "0it" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# Tools on a machine without a GPU
# ---------------------------------------------------------------------------------------------------


def test_flash_log_show_reads_the_committed_log(capsys, tmp_path):
    from cs336_systems.bench import flash_log

    flash_log.main(["--show"])
    err = capsys.readouterr().err
    assert str(result_store.RESULTS_DIR / "flash_optimisation_log.jsonl") in err
    committed = result_store.read_rows(result_store.RESULTS_DIR / "flash_optimisation_log.jsonl")
    assert f"({len(committed)} rows)" in err and len(committed) > 0
    flash_log.main(["--show", "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert str(tmp_path / "flash_optimisation_log.jsonl") in err and "(0 rows)" in err


def test_cuda_only_sdpa_backends_are_skipped_on_a_cpu():
    from cs336_systems.bench.common import attention_providers as fp

    cpu = torch.device("cpu")
    assert "cuDNN backend has no CPU kernel" in fp.get_provider("sdpa_cudnn").unavailable_reason(cpu)
    assert "memory-efficient backend has no CPU kernel" in fp.get_provider("sdpa_efficient").unavailable_reason(cpu)
    assert fp.get_provider("sdpa_flash").unavailable_reason(cpu) is None
    assert fp.get_provider("sdpa_cudnn").unavailable_reason(torch.device("cuda")) is None


def test_allreduce_report_says_why_a_setting_has_no_fit_and_names_only_its_backends(capsys, tmp_path, monkeypatch):
    from cs336_systems.bench import distributed_communication_single_node as tool

    store = result_store.ResultStore(tool.PROBLEM, tmp_path, quiet=True)
    for nbytes, ms in ((1e4, 0.3), (1e5, 0.2)):  # faster at the larger size (noise): no bandwidth to fit
        store.add({"backend": "gloo", "world_size": 2, "bytes": nbytes},
                  {"size_mb": nbytes / 1e6, "mean_ms": ms, "busbw_gbps": nbytes / ms / 1e6})
    import matplotlib.figure

    titles = []
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle", lambda figure, title, **options: titles.append(title))
    args = tool.parser().parse_args(["--results-dir", str(tmp_path), "--figures-dir", str(tmp_path)])
    tool.report(args)
    assert "# gloo, 2 ranks: no fit" in capsys.readouterr().out
    (title,) = titles
    assert "gloo on CPU processes" in title and "NCCL" not in title


@pytest.mark.slow
def test_demo_runs_on_a_cpu_in_a_fresh_process(tmp_path):
    """The quick start: our interpreted attention and the toy DDP variants, each matching its reference."""
    done = subprocess.run([sys.executable, "-m", "cs336_systems.bench.demo", "--results-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = result_store.read_rows(tmp_path / "demo.jsonl")
    attention = next(row for row in rows if row["what"] == "attention")
    assert max(attention[f"max_err_{name}"] for name in ("O", "dQ", "dK", "dV")) < 1e-4
    toy = [row for row in rows if row["what"] == "toy DDP"]
    assert len(toy) == 5 and all(row["matches"] for row in toy)
    assert str(tmp_path / "demo.jsonl") in done.stderr
