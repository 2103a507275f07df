"""The writeup's two editions: both build from the synthetic fixture, each index lists its handout's problems and
parts, every index row points at a label that exists, on the page the index prints, and each edition reads its own
rows and names the sizes as its handout does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests._writeup_fixture import write_fixture
from tests.test_writeup import WRITEUP, build

import typst  # noqa: E402  (test_writeup skips the module where typst is missing)
from pipeline import editions
from pipeline.results import Results
from pipeline.sections import SECTIONS, Output

HAS_PARALLELISM = (WRITEUP / "typ" / "parallelism.typ").exists()

# Every problem and part each handout asks, section by section.
PARTS_2025 = {
    "benchmarking_script": "abc", "nsys_profile": "abcde", "mixed_precision_accumulation": "",
    "benchmarking_mixed_precision": "abc", "memory_profiling": "abcde", "pytorch_attention": "", "torch_compile": "ab",
    "flash_forward": "a", "flash_backward": "", "flash_benchmarking": "", "leaderboard": "",
    "distributed_communication_single_node": "", "naive_ddp": "", "naive_ddp_benchmarking": "",
    "minimal_ddp_flat_benchmarking": "", "ddp_overlap_individual_parameters": "",
    "ddp_overlap_individual_parameters_benchmarking": "ab", "ddp_overlap_bucketed": "", "ddp_bucketed_benchmarking": "ab",
    "communication_accounting": "abcd", "optimizer_state_sharding": "", "optimizer_state_sharding_accounting": "abc",
}
CALCS_2026 = {"alternate_ring_all_reduce": "", "data_parallel_calcs": "abc", "fsdp_calcs": "abc", "tp_calcs": "abcd",
              "fsdp_tp_calcs": "abcd"}
PARTS_2026 = {
    "benchmarking_script": "abc", "nsys_profile": "abcde", "mixed_precision_accumulation": "",
    "benchmarking_mixed_precision": "abc", "memory_profiling": "abcdef", "gradient_checkpointing": "ab",
    "pytorch_attention": "", "torch_compile": "ab", "flash_forward": "abc", "flash_backward": "",
    "flash_benchmarking": "", "distributed_communication_single_node": "", "naive_ddp": "",
    "naive_ddp_benchmarking": "", "minimal_ddp_flat_benchmarking": "", "ddp_overlap_individual_parameters": "",
    "ddp_overlap_individual_parameters_benchmarking": "ab", "optimizer_state_sharding": "",
    "optimizer_state_sharding_accounting": "abc", "fsdp": "", "fsdp_accounting": "ab", **CALCS_2026,
    "leaderboard_2026": "",  # the 2026 problem `leaderboard`, answered from our leaderboard_2026 section
}


def labels(parts: dict[str, str]) -> set[str]:
    return {f"part-{name}-{p}" if p else f"part-{name}" for name, letters in parts.items() for p in (letters or [""])}


def build_args(root: Path, results: Path, *extra: str) -> list[str]:
    return ["--results-dir", str(results), "--figures-dir", str(root / "figures"), "--build-dir", str(root / "build"),
            "--output", str(root / "writeup.pdf"), *extra]


@pytest.fixture(scope="module")
def fixture_results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("editions-fixture")
    write_fixture(root / "results", root / "row-figures")
    return root / "results"


@pytest.fixture(scope="module")
def built(tmp_path_factory, fixture_results) -> Path:
    """Both editions built from the fixture in one run (a draft while the parallelism section is not in the tree)."""
    root = tmp_path_factory.mktemp("editions")
    extra = () if HAS_PARALLELISM else ("--allow-missing",)
    assert build.main(build_args(root, fixture_results, *extra)) == 0
    return root


def generated(root: Path, edition: str) -> dict:
    folder = root / "build" / ("" if edition == "2025" else edition)
    return json.loads((folder / "generated" / "data.json").read_text())


def index_rows(root: Path, edition: str) -> list[dict]:
    folder = root / "build" / ("" if edition == "2025" else edition)
    document = folder / ("writeup.typ" if edition == "2025" else "writeup_2026.typ")
    return json.loads(typst.query(str(document), "<index-row>", field="value", root=str(folder),
                                  ignore_system_fonts=True))


def test_both_editions_build_from_the_fixture(built):
    assert (built / "writeup.pdf").read_bytes()[:5] == b"%PDF-"
    assert (built / "writeup_2026.pdf").read_bytes()[:5] == b"%PDF-"
    old, new = generated(built, "2025"), generated(built, "2026")
    assert (old["edition"], new["edition"]) == ("2025", "2026")
    assert set(old["sections"]) == set(new["sections"]) == set(SECTIONS)
    assert not [name for name, s in new["sections"].items() if "missing" in s or s.get("missing_parts")]
    assert new["includes"] == {"parallelism": HAS_PARALLELISM}


@pytest.mark.parametrize("edition, parts", [("2025", PARTS_2025), ("2026", PARTS_2026)])
def test_every_index_row_points_at_the_page_of_its_part(built, edition, parts):
    rows = index_rows(built, edition)
    listed = [row["label"] for row in rows]
    assert len(listed) == len(set(listed)) and set(listed) == labels(parts)
    absent = labels(CALCS_2026) if edition == "2026" and not HAS_PARALLELISM else set()
    for row in rows:
        if row["label"] in absent:
            assert row["printed"] == "?"
            continue
        assert row["printed"] != "?", f"{row['label']} does not exist in the {edition} edition"
        assert row["printed"] == str(row["physical"]), row


def test_part_labels_open_their_part():
    """A part's label line comes right before the part's answer: `*(x)` on the next line, x its letter."""
    found = []
    for path in sorted((WRITEUP / "typ").glob("*.typ")):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            label = re.fullmatch(r'\s*#metadata\("part"\) <(part-[\w.-]+)>', line)
            if not label:
                continue
            found.append(label.group(1))
            letter = re.fullmatch(r"part-\w+?-([a-f])", label.group(1))
            following = lines[number + 1].strip()
            if letter:
                assert re.match(rf"(#if .*)?\*\({letter.group(1)}\)", following) or following.startswith(
                    f"#if part-missing(s, \"{letter.group(1)}\")"), f"{path.name}:{number + 1}: {following}"
    assert len(found) == len(set(found))
    assert labels(PARTS_2025) | labels(PARTS_2026) - labels(CALCS_2026) <= set(found)


def test_each_edition_reads_its_rows_and_names_its_sizes(built):
    old, new = generated(built, "2025")["sections"], generated(built, "2026")["sections"]
    sizes = lambda data: [r[0] for r in data["benchmarking_script"]["tables"]["main"]["rows"]]
    assert sizes(old) == ["small", "medium"] and sizes(new) == ["small", "medium", "10B"]
    ten = new["benchmarking_script"]["tables"]["main"]["rows"][2]
    assert ten[1] == "OOM (≈ 205 GB)" and "16 bytes per parameter" in new["benchmarking_script"]["tables"]["main"][
        "caption"]
    assert (old["memory_profiling"]["n"]["ctx"], new["memory_profiling"]["n"]["ctx"]) == ("256", "2048")
    assert (old["memory_profiling"]["n"]["size"], new["memory_profiling"]["n"]["size"]) == ("2.7B", "xl")
    checkpointing = old["gradient_checkpointing"]["n"], new["gradient_checkpointing"]["n"]
    assert [(n["size"], n["n_blocks"]) for n in checkpointing] == [("xl", "48"), ("xl", "32")]
    assert (old["fsdp_accounting"]["n"]["size"], new["fsdp_accounting"]["n"]["size"]) == ("xl", "xl (2025)")
    # The 2026 nsys answers read small and medium at contexts 256, 512 and 1024 only.
    assert [r[0] for r in new["nsys_profile"]["tables"]["timing"]["rows"]] == ["small", "medium"]
    assert new["nsys_profile"]["tables"]["timing"]["header"][0][1:] == ["context 256", "context 1024"]


def fixture_rows(results: Path, problem: str, **match) -> list[dict]:
    rows = [json.loads(line) for line in (results / f"{problem}.jsonl").read_text().splitlines()]
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def test_memory_reads_the_peaks_of_its_edition_and_the_latest_timelines(built, fixture_results):
    """The 2025 answers keep the H100's peak table and show the H200's timelines; the 2026 ones read the H200 alone.
    A caption quotes the peak table where the table has the same case on the same GPU, else the recording's peak,
    and names PyTorch's viewer page of the snapshot."""
    old, new = (generated(built, e)["sections"]["memory_profiling"] for e in ("2025", "2026"))
    assert (old["n"]["peaks_gpu"], old["n"]["timelines_gpu"]) == ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
    assert "NVIDIA H100" in old["env"] and "NVIDIA H200" in old["env"]
    assert (new["n"]["peaks_gpu"], new["n"]["timelines_gpu"]) == ("NVIDIA H200", "NVIDIA H200")
    assert "H100" not in new["env"]
    assert [r[0] for r in old["tables"]["peaks"]["rows"]] == ["128", "256"]
    inference = {r["dtype"]: f"{r['peak_gb']:.1f}" for r in fixture_rows(
        fixture_results, "memory_profiling", kind="peak", mode="inference", context_length=2048)}
    assert new["tables"]["peaks"]["rows"][1] == ["2048", inference["fp32"], "OOM", "OOM", inference["bf16"], "OOM",
                                                 "OOM"]
    column = {("inference", "fp32"): 1, ("forward", "fp32"): 2, ("train_step", "fp32"): 3}
    for name, mode in (("forward", "forward"), ("train_step", "train_step"), ("inference", "inference")):
        (row,) = fixture_rows(fixture_results, "memory_profiling", kind="timeline", mode=mode, dtype="fp32",
                              device="1x NVIDIA H200")
        table_row = next(r for r in new["tables"]["peaks"]["rows"] if r[0] == str(row["context_length"]))
        assert f"peak {table_row[column[mode, 'fp32']]} GB (the peak table)" in new["figures"][name]["caption"]
        assert f"peak of this recording {row['timeline_peak_gb']:.1f} GB" in old["figures"][name]["caption"]
        for section in (old, new):
            assert f"PyTorch's viewer page: {row['html']}." in section["figures"][name]["caption"]
            assert section["figures"][name]["path"].endswith(Path(row["figure"]).name)
    assert "xl model (2.7B in the plot's title)" in new["figures"]["forward"]["caption"]


def test_memory_2026_explains_the_out_of_memory_from_one_blocks_saved_bytes(built, fixture_results):
    n = generated(built, "2026")["sections"]["memory_profiling"]["n"]
    (block,) = fixture_rows(fixture_results, "memory_profiling", kind="block_residuals", context_length=2048,
                            dtype="fp32")
    assert n["cmax_oom"] and n["fit"]["oom"] and n["fit"]["capacity_gib"] == "139.8"  # from the OOM message
    assert n["fit"]["block_gb"] == f"{block['residual_bytes'] / 1e9:.2f} GB"
    assert n["fit"]["all_gb"] == f"{32 * block['residual_bytes'] / 1e9:.0f} GB"
    assert not generated(built, "2025")["sections"]["memory_profiling"]["n"]["fit"]["oom"]


def test_memory_part_f_quotes_the_rows_of_one_block(built, fixture_results):
    """(f): the table lists each context's five largest operations with their shares (which sum to at most 1), and
    the prose quotes each context's top operation, saved bytes and measured gradients from the rows."""
    section = generated(built, "2026")["sections"]["memory_profiling"]
    f, tab = section["n"]["f"], section["tables"]["block_operations"]
    rows = sorted(fixture_rows(fixture_results, "memory_profiling", kind="block_residuals", dtype="fp32"),
                  key=lambda r: r["context_length"])
    assert [c["ctx"] for c in f["by_ctx"]] == [str(r["context_length"]) for r in rows] == ["128", "2048"]
    listed = {(r[0], r[1]) for r in tab["rows"]}
    for i, (row, quoted) in enumerate(zip(rows, f["by_ctx"])):
        top = row["top_operations"][0]
        assert (quoted["top_op"], quoted["top_caller"]) == (top["op"].removeprefix("aten."), top["caller"])
        assert quoted["top_share"] == f"{100 * top['share']:.1f} %" and quoted["mib"] == f"{row['residual_mib']:,.1f}"
        assert quoted["measured_mib"] == f"{row['gradient_bytes_measured'] / 2**20:,.1f}"
        assert quoted["ratio"] == f"{row['gradient_ratio']:.3f}"
        assert {(o["op"].removeprefix("aten."), o["caller"] or "–") for o in row["top_operations"]} <= listed
        shares = [float(r[3 + 2 * i].split()[0]) / 100 for r in tab["rows"]]
        assert sum(shares) <= 1 + 1e-9
    (bf16,) = fixture_rows(fixture_results, "memory_profiling", kind="block_residuals", context_length=128,
                           dtype="bf16")
    assert section["n"]["saved_c0"] == {"fp32": f"{rows[0]['residual_mib']:,.1f}",
                                        "bf16": f"{bf16['residual_mib']:,.1f}"}


def test_checkpointing_compares_the_best_size_with_its_measured_neighbours(built, fixture_results):
    """(b): k* below one block gives k = 1 (2026 rows), otherwise the predicted optimum; the measured peaks quoted are
    those of the optimum and the next smaller and larger sizes measured, from the rows."""
    for edition, size, best, ks in (("2025", "xl", "2", ["1", "2", "4"]), ("2026", "2.7B", "1", ["1", "2", "4"])):
        n = generated(built, edition)["sections"]["gradient_checkpointing"]["n"]
        rows = {str(r["group_size"]): r for r in fixture_rows(fixture_results, "gradient_checkpointing", size=size)}
        assert n["k_opt"] == best and n["k_below_one"] == (best == "1") and n["has_smaller"] == (best != "1")
        assert [c["k"] for c in n["compared"]] == ks
        assert [c["peak"] for c in n["compared"]] == [f"{rows[k]['peak_gb']:.1f} GB" for k in ks]
        slope = (rows["4"]["peak_gb"] - rows["1"]["peak_gb"]) / 3
        assert n["per_block_slope"] == f"{slope:.2f} GB" and n["none_oom"]


def section_2026(results: Path, tmp_path: Path, name: str) -> dict:
    with editions.edition("2026"):
        return SECTIONS[name](Results(results), Output(tmp_path / "figures", tmp_path / "build", tmp_path / "render"))


def without(results: Path, tmp_path: Path, file: str, drop) -> Path:
    """A copy of the fixture's results whose ``file`` lacks the rows ``drop`` accepts."""
    copy = tmp_path / "results"
    write_fixture(copy, tmp_path / "row-figures")
    rows = [json.loads(line) for line in (copy / file).read_text().splitlines()]
    (copy / file).write_text("".join(json.dumps(r) + "\n" for r in rows if not drop(r)))
    return copy


def test_a_2026_part_without_its_rows_is_missing_and_the_rest_stands(tmp_path, fixture_results):
    results = without(fixture_results, tmp_path, "memory_profiling.jsonl", lambda r: r["kind"] == "block_residuals")
    memory = section_2026(results, tmp_path, "memory_profiling")
    assert "block_residuals" in memory["missing_parts"]["f"] and memory["n"]["ctx"] == "2048"
    results = without(fixture_results, tmp_path / "b", "benchmarking_script.jsonl", lambda r: r["size"] == "10B")
    assert "10B" in section_2026(results, tmp_path, "benchmarking_script")["missing_parts"]["b"]
    results = without(fixture_results, tmp_path / "c", "gradient_checkpointing.jsonl", lambda r: r["size"] == "2.7B")
    assert "b" in section_2026(results, tmp_path, "gradient_checkpointing")["missing_parts"]


def test_the_2026_build_fails_naming_the_rows_it_lacks(tmp_path, fixture_results, capsys):
    results = without(fixture_results, tmp_path, "memory_profiling.jsonl", lambda r: r["context_length"] == 2048)
    assert build.main(build_args(tmp_path, results, "--edition", "2026")) == 1
    err = capsys.readouterr().err
    assert re.search(r"\[2026\] \S*memory_profiling\.jsonl \(no peak rows of the 2\.7B model", err)
    assert "(needed by: memory_profiling)" in err and not (tmp_path / "writeup_2026.pdf").exists()


def test_size_names_per_edition():
    with editions.edition("2026"):
        assert [editions.size_name(k) for k in ("small", "xl", "2.7B", "10B")] == ["small", "xl (2025)", "xl", "10B"]
    assert editions.current() == "2025" and editions.size_name("2.7B") == "2.7B"
    with pytest.raises(ValueError, match="unknown edition"):
        with editions.edition("2024"):
            pass
