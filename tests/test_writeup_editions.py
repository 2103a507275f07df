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
