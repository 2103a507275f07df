"""The package's layout rules: every benchmark tool is a leaf (no tool imports another; what
tools share lives in ``cs336_systems/bench/common/``), and the model never imports parallelism or benchmarks."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "cs336_systems" / "bench"
TOOLS = sorted(path.stem for path in BENCH.glob("*.py") if path.stem != "__init__")


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (``from a.b import c`` counts ``a.b`` and ``a.b.c``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_there_are_tools_and_a_common_room():
    assert {"benchmarking_script", "leaderboard", "ddp_benchmarking"} <= set(TOOLS)
    assert (BENCH / "common" / "__init__.py").exists()


@pytest.mark.parametrize("tool", TOOLS)
def test_no_tool_imports_another_tool(tool):
    others = {f"cs336_systems.bench.{name}" for name in TOOLS if name != tool}
    assert not imported_modules(BENCH / f"{tool}.py") & others


def test_common_modules_import_no_tool():
    tools = {f"cs336_systems.bench.{name}" for name in TOOLS}
    for path in (BENCH / "common").glob("*.py"):
        assert not imported_modules(path) & tools, path.name


def test_library_never_imports_the_benchmarks_and_the_model_no_parallelism():
    for path in (ROOT / "cs336_systems").rglob("*.py"):
        if BENCH not in path.parents:
            assert not any(m.startswith("cs336_systems.bench") for m in imported_modules(path)), path
    for path in (ROOT / "cs336-basics" / "cs336_basics").rglob("*.py"):
        assert not any(m.startswith("cs336_systems") for m in imported_modules(path)), path


def test_smoke_and_cpu_runs_write_to_the_scratch_folder(monkeypatch, tmp_path):
    from cs336_systems.bench import benchmarking_script, flash_benchmarking
    from cs336_systems.bench.common.result_store import FIGURES_DIR, RESULTS_DIR, SCRATCH_DIR

    assert ".scratch/" in (ROOT / ".gitignore").read_text().split()
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert benchmarking_script.parser().parse_args([]).results_dir == SCRATCH_DIR / "results"
    cpu = flash_benchmarking.parser().parse_args([])
    assert (cpu.results_dir, cpu.figures_dir) == (SCRATCH_DIR / "results", SCRATCH_DIR / "figures")
    assert benchmarking_script.parser().parse_args(["--results-dir", str(tmp_path)]).results_dir == tmp_path
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert benchmarking_script.parser().parse_args(["--quick"]).results_dir == SCRATCH_DIR / "results"
    gpu = flash_benchmarking.parser().parse_args([])
    assert (gpu.results_dir, gpu.figures_dir) == (RESULTS_DIR, FIGURES_DIR)


@pytest.mark.skipif(shutil.which("zip") is None or shutil.which("unzip") is None, reason="needs zip and unzip")
@pytest.mark.parametrize("argv, edition, pdf", [([], "2026", "writeup/writeup_2026.pdf"),
                                                (["--edition", "2025"], "2025", "writeup/writeup.pdf")])
def test_submission_zip_holds_code_and_writeup_pdf_without_scratch_results_and_caches(tmp_path, argv, edition, pdf):
    """``test_and_make_submission.sh --skip-tests`` on a small tree: code in, the edition's writeup PDF as
    writeup.pdf at the top; smoke-run results, the writeup's staging directory, caches, .txt and .json files out."""
    shutil.copy(ROOT / "test_and_make_submission.sh", tmp_path)
    for name in ("cs336_systems/a.py", "writeup/results/x.jsonl", "writeup/writeup.pdf", "writeup/writeup_2026.pdf",
                 "writeup/build/x.typ", ".scratch/results/x.jsonl", "a/__pycache__/b.pyc", "writeup/results/x.txt",
                 "writeup/results/x.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"{name}\n")
    done = subprocess.run(["bash", "test_and_make_submission.sh", "--skip-tests", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Tests skipped" in done.stdout and "status" not in done.stdout
    archive = f"cs336-spring{edition}-assignment-2-submission.zip"
    listing = subprocess.run(["unzip", "-Z1", archive], cwd=tmp_path, capture_output=True, text=True,
                             check=True).stdout.split()
    files = sorted(name for name in listing if not name.endswith("/"))
    assert files == ["cs336_systems/a.py", "test_and_make_submission.sh", "writeup.pdf", "writeup/results/x.jsonl"]
    packed = subprocess.run(["unzip", "-p", archive, "writeup.pdf"], cwd=tmp_path, capture_output=True, text=True,
                            check=True).stdout
    assert packed == f"{pdf}\n"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("zip") is None or shutil.which("unzip") is None, reason="needs zip and unzip")
@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="packs the files git tracks: needs a git checkout")
def test_the_unzipped_submission_collects_and_checks_itself(tmp_path):
    """What a grader unpacks (no .git, no .json/.txt/.log files) still collects every test, and the tests that read
    the tree itself pass there."""
    tree, unpacked = tmp_path / "tree", tmp_path / "unpacked"
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in listed.splitlines():
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    subprocess.run(["bash", "test_and_make_submission.sh", "--skip-tests"], cwd=tree, capture_output=True,
                   check=True, timeout=300)
    (archive,) = tree.glob("*.zip")
    subprocess.run(["unzip", "-q", str(archive), "-d", str(unpacked)], check=True)
    pytest_in = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    collected = subprocess.run([*pytest_in, "--collect-only", "tests"], cwd=unpacked, capture_output=True, text=True,
                               timeout=300)
    summary = collected.stdout.strip().splitlines()[-1]
    assert collected.returncode == 0 and re.search(r"\d+ tests? collected", summary) and "error" not in summary, (
        collected.stdout[-2000:])
    checked = subprocess.run([*pytest_in, "tests/test_words.py", "tests/test_layout.py", "-m", "not slow"],
                             cwd=unpacked, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout[-2000:]


@pytest.mark.parametrize("argv, status", [(["--help"], 0), (["-h"], 0), (["--skip-test"], 2), (["tests"], 2),
                                          (["--edition", "2024"], 2), (["--edition"], 2)])
def test_submission_script_answers_help_and_refuses_unknown_arguments(tmp_path, argv, status):
    """Neither ``--help`` nor a mistyped option starts the test suite or writes a zip."""
    shutil.copy(ROOT / "test_and_make_submission.sh", tmp_path)
    done = subprocess.run(["bash", "test_and_make_submission.sh", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == status
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test_and_make_submission.sh"]
    assert "--skip-tests" in (done.stdout if status == 0 else done.stderr)  # the usage names the option


def test_readme_maps_every_assignment_problem_early_and_stays_short():
    """README <= 200 lines, and every problem of the assignment's writeup sections (and the 2026 ones) in its
    first 80, where the deliverable map is."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    head = "\n".join(lines[:80])
    typ = ROOT / "writeup" / "typ"
    problems = {"fsdp", "fsdp_accounting", "gradient_checkpointing", "rmsnorm", "leaderboard_2026"}
    for part in ("single_gpu", "flash", "ddp", "sharding"):
        problems |= set(re.findall(r'#problem\("([a-z_0-9]+)"', (typ / f"{part}.typ").read_text()))
    missing = sorted(p for p in problems if f"`{p}`" not in head)
    assert not missing, f"README's deliverable map lacks {missing}"
