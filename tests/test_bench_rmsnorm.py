"""The RMSNorm benchmark (``python -m cs336_systems.bench.rmsnorm``): byte counts and cases, the share of the copy
bandwidth of the same run, the choice of the newest kernel-part run, and the command line on a CPU."""

from __future__ import annotations

import json

import pytest
import torch

from cs336_systems.bench import rmsnorm as bench


def kernel_row(run: str, date: str, provider: str, gbps: float, share: float | None = None, **shape) -> dict:
    shape = {"part": "kernel", "rows": 4096, "cols": 768, "dtype": "bf16", **shape}
    pass_ = "copy" if provider == "copy" else "fwd"
    row = {"run": run, **shape, "provider": provider, "pass": pass_, "gbps": gbps,
           "config_keys": sorted([*shape, "provider", "pass"]), "env": {"date": date}}
    if share is not None:
        row["copy_share"] = share
    return row


def test_byte_count_and_cases():
    assert bench.moved_bytes("fwd", 10, 8, 2, 4) == 2 * 10 * 8 * 2 + 8 * 4
    assert bench.moved_bytes("fwd_bwd", 10, 8, 2, 4) == 5 * 10 * 8 * 2 + 3 * 8 * 4
    assert bench.moved_bytes("copy", 10, 8, 2, 0) == 2 * 10 * 8 * 2
    for edition, xl in (("2025", "xl"), ("2026", "2.7B")):  # the edition's xl gets the attention cases
        args = bench.parser().parse_args(["--edition", edition, "--sizes", "small", "xl"])
        cases = bench.model_cases(args)
        keys = [(c["size"], c["norm"], c["attention"], c["compile"]) for c in cases]
        assert len(keys) == len(set(keys)) == 2 * 2 * 3 + 3
        assert {(xl, "fused", "triton", True), (xl, "fused_autocast", "triton", True), (xl, "plain", "sdpa", True)} \
            <= set(keys)
    assert all(c["dtype"] == "bf16" and c["mode"] == "train_step" and c["batch_size"] == 4 for c in cases)
    args = bench.parser().parse_args(["--rows", "8", "--cols", "16", "32", "--dtypes", "bf16"])
    kernel = bench.kernel_cases(args)
    assert len(kernel) == 2 * (1 + len(bench.PROVIDERS) * len(bench.PASSES))
    assert [c["provider"] for c in kernel[:2]] == ["copy", "ours"]  # each shape's copy before its providers


def test_the_default_grid_is_the_reviewers():
    assert bench.ROWS == [4096, 16384, 32768, 65536]
    assert bench.COLS == [768, 1024, 1280, 1600, 2560, 4096, 8192]
    assert bench.PROVIDERS == ("ours", "eager", "compile", "liger", "quack")


def test_copy_share_is_against_the_copy_of_the_same_shape_dtype_and_run():
    rows = [kernel_row("old", "2026-11-22", "copy", 1000.0),
            kernel_row("new", "2026-11-26", "copy", 2000.0),
            kernel_row("new", "2026-11-26", "copy", 4000.0, dtype="fp32"),
            kernel_row("new", "2026-11-26", "copy", 3000.0, rows=65536),
            kernel_row("new", "2026-11-26", "ours", 1500.0)]
    copy = bench.copy_reference(rows, "new")
    assert copy == {(4096, 768, "bf16"): 2000.0, (4096, 768, "fp32"): 4000.0, (65536, 768, "bf16"): 3000.0}
    shared = bench.with_copy_share({"ms": 1.0, "gbps": 1500.0}, copy[(4096, 768, "bf16")])
    assert shared == {"ms": 1.0, "gbps": 1500.0, "copy_gbps": 2000.0, "copy_share": 0.75}
    assert bench.with_copy_share({"gbps": 1500.0}, None)["copy_share"] is None  # no copy in this run


def test_the_newest_kernel_run_is_read_alone_and_old_rows_without_a_share_never():
    rows = [kernel_row("20261122T1", "2026-11-22T10:00:00Z", "ours", 900.0),  # an older tool: no copy_share
            kernel_row("20261125T1", "2026-11-25T10:00:00Z", "copy", 2000.0, 1.0),
            kernel_row("20261125T1", "2026-11-25T10:00:00Z", "ours", 1000.0, 0.5),
            kernel_row("20261126T1", "2026-11-26T10:00:00Z", "copy", 2000.0, 1.0),
            {"run": "20261127T1", "part": "model", "size": "xl", "env": {"date": "2026-11-27T10:00:00Z"}},
            kernel_row("20261126T1", "2026-11-26T11:00:00Z", "ours", 1800.0, 0.9, cols=1024),  # the run continued
            kernel_row("20261126T1", "2026-11-26T10:00:00Z", "ours", 1700.0, 0.85)]
    newest = bench.newest_kernel_run(rows)
    assert [(r["provider"], r["cols"], r["gbps"]) for r in newest] == [("copy", 768, 2000.0), ("ours", 1024, 1800.0),
                                                                     ("ours", 768, 1700.0)]
    assert bench.newest_kernel_run(rows[:1]) == []  # only rows of the older tool: nothing to show


def test_pending_cases_are_those_the_run_lacks(tmp_path):
    from cs336_systems.bench.common.result_store import ResultStore

    store = ResultStore(bench.PROBLEM, tmp_path, quiet=True)
    cases = bench.kernel_cases(bench.parser().parse_args(["--rows", "8", "--cols", "16", "--dtypes", "bf16"]))
    store.add(cases[0], {"gbps": 1.0})
    assert bench.pending_in_run(store, cases) == cases[1:]
    later = ResultStore(bench.PROBLEM, tmp_path, quiet=True)  # a new run measures everything again
    assert bench.pending_in_run(later, cases) == cases
    later.run = store.run  # --run-id: continue the first run
    assert bench.pending_in_run(later, cases) == cases[1:]


@pytest.mark.compiled_kernels
def test_quick_on_cpu(tmp_path, capsys):
    """The CLI runs on a CPU, writes rows with the problem's keys and copy shares, skips what needs a GPU saying
    why, measures the kernel part again in a new run, continues a run given its id, and resumes the model part."""
    argv = ["--quick", "--results-dir", str(tmp_path), "--cols", "48", "--rows", "64", "--providers", "eager", "ours",
            "liger", "quack", "--sizes", "tiny", "--compile", "off", "--context-length", "16"]
    path = tmp_path / "rmsnorm.jsonl"
    bench.main(argv)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    kernel = [r for r in rows if r["part"] == "kernel"]
    assert {(r["provider"], r["pass"]) for r in kernel} == {("copy", "copy"), ("eager", "fwd"), ("eager", "fwd_bwd")}
    copy = next(r for r in kernel if r["provider"] == "copy")
    for r in kernel:
        assert {"run", "provider", "pass", "rows", "cols", "dtype", "ms", "gbps", "bytes", "copy_share"} <= set(r)
        assert r["rows"] == 64 and r["cols"] == 48 and r["gbps"] > 0 and r["run"] == copy["run"]
        assert r["copy_share"] == pytest.approx(r["gbps"] / copy["gbps"])
        assert r["provider"] == "copy" or r["max_abs_error_vs_eager"] == 0
    model = [r for r in rows if r["part"] == "model"]
    assert [(r["size"], r["norm"], r["compile"]) for r in model] == [("tiny", "plain", False)]
    assert model[0]["median_ms"] > 0
    err = capsys.readouterr().err
    assert "skipped here: ours (" in err and "skipped here: liger (no GPU)" in err
    assert "skipped here: quack (no GPU)" in err and "only the plain RMSNorm" in err
    bench.main([*argv, "--run-id", copy["run"]])  # the run is complete, the model case measured: nothing added
    assert len(path.read_text().splitlines()) == len(rows)
    bench.main(argv)  # a new run of the kernel part; the model part still resumes
    again = [json.loads(line) for line in path.read_text().splitlines()][len(rows):]
    assert len(again) == len(kernel) and {r["run"] for r in again} != {copy["run"]}
    assert bench.newest_kernel_run(rows + again) == again


def test_answers_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    assert "GB/s" in capsys.readouterr().out


def test_the_timer_option_parses_and_graph_cases_differ_from_do_bench_ones(tmp_path):
    from cs336_systems.bench.common.result_store import ResultStore

    grid = ["--rows", "8", "--cols", "16", "--dtypes", "bf16"]
    assert bench.parser().parse_args(grid).timer == "do_bench"
    assert bench.parser().parse_args([*grid, "--timer", "graph"]).timer == "graph"
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["--timer", "events"])
    plain = bench.kernel_cases(bench.parser().parse_args(grid))
    graph = bench.kernel_cases(bench.parser().parse_args([*grid, "--timer", "graph"]))
    assert all("timer" not in c for c in plain)  # do_bench cases are those of rows written before the option
    assert all(c["timer"] == "graph" for c in graph) and [{**c, "timer": "graph"} for c in plain] == graph
    store = ResultStore(bench.PROBLEM, tmp_path, quiet=True)
    store.add(plain[0], {"gbps": 1.0})
    assert bench.pending_in_run(store, graph) == graph  # a do_bench row does not stand for the graph case
    store.add(graph[1], {"gbps": 1.0})
    assert bench.pending_in_run(store, graph) == [graph[0], *graph[2:]]
    assert bench.pending_in_run(store, plain) == plain[1:]


def test_each_timer_reads_its_own_rows_and_copy():
    graph = {"timer": "graph"}
    rows = [kernel_row("20261126T1", "2026-11-26T10:00:00Z", "copy", 2000.0, 1.0),
            kernel_row("20261126T1", "2026-11-26T10:00:00Z", "ours", 1000.0, 0.5),
            kernel_row("20261126T1", "2026-11-26T10:00:00Z", "copy", 2800.0, 1.0, **graph),  # --run-id, --timer graph
            kernel_row("20261126T1", "2026-11-26T10:00:00Z", "ours", 2100.0, 0.75, **graph),
            kernel_row("20261127T1", "2026-11-27T10:00:00Z", "copy", 2900.0, 1.0, **graph),  # a newer graph run
            {**kernel_row("20261127T1", "2026-11-27T10:00:00Z", "copy", 1900.0, 1.0, cols=1024, **graph),
             "timed_with": "do_bench", "timer_note": "CUDA graph capture failed"}]
    assert "timer" in rows[2]["config_keys"] and "timer" not in rows[0]["config_keys"]
    assert bench.copy_reference(rows, "20261126T1") == {(4096, 768, "bf16"): 2000.0}
    assert bench.copy_reference(rows, "20261126T1", "graph") == {(4096, 768, "bf16"): 2800.0}
    assert bench.copy_reference(rows, "20261127T1", "graph") == {(4096, 768, "bf16"): 2900.0}  # not the fallback's
    assert [r["gbps"] for r in bench.newest_kernel_run(rows)] == [2000.0, 1000.0]  # the writeup's reading
    assert [r["gbps"] for r in bench.newest_kernel_run(rows, "graph")] == [2900.0, 1900.0]
    assert bench.measured_by(rows[5]) == "do_bench" and bench.measured_by(rows[4]) == "graph"
    assert bench.measured_by(rows[0]) == bench.case_timer(rows[0]) == "do_bench"


def test_input_sets_of_a_case():
    case = {"part": "kernel", "rows": 4096, "cols": 768, "dtype": "bf16", "provider": "ours", "pass": "fwd_bwd"}
    assert bench.input_set_bytes(case) == 2 * 4096 * 768 * 2
    assert bench.input_set_bytes({**case, "pass": "fwd", "dtype": "fp32"}) == 4096 * 768 * 4
    small = {**case, "rows": 8, "cols": 16}
    sets = bench.kernel_inputs(small, torch.device("cpu"), 3)
    assert len(sets) == 3 and all(len(s) == 2 and s[0].requires_grad and s[0].shape == (8, 16) for s in sets)
    assert not torch.equal(sets[0][0], sets[1][0])  # independent sets, not one tensor three times
    copy = bench.kernel_inputs({**small, "provider": "copy", "pass": "copy"}, torch.device("cpu"), 2)
    assert all(len(s) == 1 and not s[0].requires_grad for s in copy)


def test_graph_timer_on_cpu_falls_back_to_do_bench_saying_why(tmp_path, capsys):
    """Without a GPU no graph is captured: every graph case is timed the fallback's way, says so, and divides by a
    copy timed the same way; a do_bench run of the same grid stays apart."""
    argv = ["--results-dir", str(tmp_path), "--part", "kernel", "--cols", "48", "--rows", "64", "--dtypes", "fp32",
            "--providers", "eager", "--passes", "fwd_bwd"]
    bench.main(argv)
    bench.main([*argv, "--timer", "graph"])
    rows = [json.loads(line) for line in (tmp_path / "rmsnorm.jsonl").read_text().splitlines()]
    plain, graph = rows[:2], rows[2:]
    assert [(r["provider"], r.get("timer")) for r in rows] == [("copy", None), ("eager", None), ("copy", "graph"),
                                                                ("eager", "graph")]
    for r in graph:
        assert "timer" in r["config_keys"] and r["timed_with"] == "do_bench" and "CUDA device" in r["timer_note"]
        assert r["gbps"] > 0 and r["copy_share"] == pytest.approx(r["gbps"] / r["copy_gbps"])
    assert bench.newest_kernel_run(rows) == plain and bench.newest_kernel_run(rows, "graph") == graph
    assert "timer graph" in capsys.readouterr().out


def test_help_names_the_timer(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert "--timer {do_bench,graph}" in out and "timer: graph" in out
