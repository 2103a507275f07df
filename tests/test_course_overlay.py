"""The course's test files laid over ours, as a grader does (``tests/course_overlay/editions.toml`` lists them by
edition; its ``adapters.py`` is not laid over): the whole folder must still collect, with nothing of ours lost.

Fast checks read the tree: no test module of ours has a course file's name or imports one, and ``conftest.py``
(replaced by the course's) holds nothing. The overlay itself (one pytest run per edition, slow) copies the tree,
writes our stand-ins of the course's files into the copy's ``tests/``, and runs pytest over the whole folder: every
module must collect without error, our plugin must load (it sets ``TRITON_INTERPRET`` on a CPU: the stand-in
attention test runs the Triton kernels through the interpreter), and the stand-ins and a selection of our tests
must pass or skip.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
OVERLAY = TESTS / "course_overlay"
EDITIONS = tomllib.loads((OVERLAY / "editions.toml").read_text())
COURSE_NAMES = {name for edition in EDITIONS.values() for name in [*edition["files"], *edition["folders"]]}
REPLACED_BY_DESIGN = {"__init__.py", "conftest.py"}  # ours hold nothing the suite needs
# Ours that run under the overlay: an interpreter test (the interpreter switch) and a distributed one (spawned ranks).
OUR_SELECTION = ["tests/interpreter/test_weighted_sum.py",
                 "tests/test_distributed_helpers.py::test_spawn_runs_a_collective"]


def our_test_modules() -> list[Path]:
    return sorted(path for path in TESTS.rglob("test_*.py") if OVERLAY not in path.parents)


def imported_names(source: str, package: str) -> set[str]:
    """The modules directly in ``tests/`` that a module of ``package`` (``tests``, ``tests.interpreter``) imports, by
    name: ``common`` for ``import tests.common``, ``from tests.common import x``, ``from tests import common``, and
    their relative forms."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("tests."))
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            absolute = ".".join([*parts, *([node.module] if node.module else [])])
            if absolute == "tests":
                found.update(alias.name for alias in node.names)
            elif absolute.startswith("tests."):
                found.add(absolute.split(".")[1])
    return found


def test_no_module_of_ours_has_the_name_of_a_course_file():
    ours = {path.name for path in TESTS.iterdir()}
    assert ours & COURSE_NAMES == REPLACED_BY_DESIGN


def test_no_module_of_ours_imports_a_course_file():
    course_modules = {Path(name).stem for name in COURSE_NAMES} - {"__init__"}
    for path in TESTS.rglob("*.py"):
        if OVERLAY not in path.parents:
            package = ".".join(path.parent.relative_to(ROOT).parts)
            assert not imported_names(path.read_text(), package) & course_modules, path.relative_to(ROOT)


def test_conftest_holds_nothing_but_its_docstring():
    body = ast.parse((TESTS / "conftest.py").read_text()).body
    assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    assert (TESTS / "__init__.py").read_text().strip() == ""


def test_imported_names_sees_every_form_of_import():
    source = ("import tests.common\nfrom tests.fixtures import a\nfrom tests import conftest\n"
              "from .test_ddp import b\nfrom . import test_fsdp\nfrom tests._distributed import run_checks\n")
    expected = {"common", "fixtures", "conftest", "test_ddp", "test_fsdp", "_distributed"}
    assert imported_names(source, "tests") == expected
    nested = "from ..common import a\nfrom .. import test_attention\nfrom .conftest import b\n"
    assert imported_names(nested, "tests.interpreter") == {"common", "test_attention", "interpreter"}


def overlaid_copy(edition: str, destination: Path) -> Path:
    """The repository at ``destination`` (links to everything but ``tests/`` and ``pyproject.toml``, which are
    copied), with the edition's stand-ins written over the copy's ``tests/``."""
    destination.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("tests", "pyproject.toml"):
            (destination / entry.name).symlink_to(entry)
    shutil.copy(ROOT / "pyproject.toml", destination)
    shutil.copytree(TESTS, destination / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for name, standin in EDITIONS[edition]["files"].items():
        shutil.copy(OVERLAY / standin, destination / "tests" / name)
    for name, standin in EDITIONS[edition]["folders"].items():
        shutil.rmtree(destination / "tests" / name, ignore_errors=True)
        shutil.copytree(OVERLAY / standin, destination / "tests" / name)
    return destination


def run_pytest_over_the_folder(tree: Path, keep: list[str]) -> tuple[dict, subprocess.CompletedProcess]:
    """``pytest tests`` in ``tree``, running only the tests under ``keep``; the collection report and the run."""
    report = tree / "collection_report.json"
    env = {**os.environ, "COURSE_OVERLAY_REPORT": str(report), "COURSE_OVERLAY_KEEP": " ".join(keep)}
    if not torch.cuda.is_available():
        env.pop("TRITON_INTERPRET", None)  # our plugin must set it again in the run
    command = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider",
               "-p", "tests.course_overlay.collection_report"]
    run = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert report.exists(), run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads(report.read_text()), run


@pytest.mark.slow  # collects the whole folder and spawns ranks: 40-80 s on two cores
@pytest.mark.parametrize("edition", sorted(EDITIONS))
def test_the_folder_collects_and_runs_under_the_course_files(edition, tmp_path):
    tree = overlaid_copy(edition, tmp_path / "repository")
    course_tests = [f"tests/{name}" for name in EDITIONS[edition]["files"] if name.startswith("test_")]
    report, run = run_pytest_over_the_folder(tree, [*course_tests, *OUR_SELECTION])
    log = run.stdout[-6000:] + run.stderr[-2000:]
    assert report["errors"] == [], log
    assert report["suite_plugin_loaded"], log
    collected = {nodeid.split("::")[0] for nodeid in report["collected"]}
    assert {str(path.relative_to(ROOT)) for path in our_test_modules()} <= collected, "modules of ours were lost"
    assert set(course_tests) <= collected
    outcomes = report["outcomes"]
    for selected in [*course_tests, *OUR_SELECTION]:
        assert any(nodeid.startswith(selected) for nodeid in outcomes), f"{selected} did not run:\n{log}"
    assert {nodeid: outcome for nodeid, outcome in outcomes.items() if outcome == "failed"} == {}, log
    if not torch.cuda.is_available():  # the interpreter switch reached the run: its tests ran instead of skipping
        assert {o for nodeid, o in outcomes.items() if nodeid.startswith("tests/interpreter/")} == {"passed"}, log
    assert run.returncode == 0, log
