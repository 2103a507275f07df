"""scripts/ab_trees.py: the runs' order, trees and variables, the rows kept, the summary, and its refusals."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "ab_trees", os.path.join(os.path.dirname(__file__), "..", "scripts", "ab_trees.py"))
ab_trees = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ab_trees)

# Prints a check row, two timing rows whose value comes from the tree's SPEED file and the variable SCALE, and a
# line of text; records the working directory and PYTHONPATH.
TIMER = """
import json, os
speed = float(open("SPEED").read()) * float(os.environ.get("SCALE", "1"))
print(json.dumps({"check": "x", "ok": True}))
for shape in ([1, 2], [3, 4]):
    print(json.dumps({"shape": shape, "backward_ms": {"rule/rule": speed * shape[0], "cudnn": 1.0}}))
print("done", os.getcwd(), os.environ["PYTHONPATH"])
"""


def _tree(path, speed: float) -> str:
    path.mkdir()
    (path / "SPEED").write_text(str(speed))
    return str(path)


def test_runs_each_tree_in_order_and_summarises(tmp_path, capsys):
    before = _tree(tmp_path / "before", 2.0)
    after = _tree(tmp_path / "after", 1.0)
    out = tmp_path / "out"
    status = ab_trees.main(["--tree", f"before={before}", "--tree", f"after={after}", "--tree",
                            f"scaled={after}:SCALE=3,UNUSED=", "--order", "before", "after", "scaled", "before",
                            "--out", str(out), "--", "python3", "-c", TIMER])
    assert status == 0
    files = sorted(os.listdir(out))
    assert files == ["1_before.jsonl", "2_after.jsonl", "3_scaled.jsonl", "4_before.jsonl", "runs.log"]
    rows = [json.loads(line) for line in (out / "3_scaled.jsonl").read_text().splitlines()]
    assert [row["backward_ms"]["rule/rule"] for row in rows] == [3.0, 9.0]  # the check row dropped
    log = (out / "runs.log").read_text()
    assert log.count("# run ") == 4
    assert f"done {after} {after}{os.pathsep}{os.path.join(after, 'cs336-basics')}" in log
    printed = capsys.readouterr().out
    assert "[1, 2]: before 2, 2 | after 1 (0.500x) | scaled 3 (1.500x)" in printed
    assert "[3, 4]: before 6, 6 | after 3 (0.500x) | scaled 9 (1.500x)" in printed


def test_default_order_is_abba_and_a_failing_run_fails(tmp_path, capsys):
    a = _tree(tmp_path / "a", 1.0)
    b = _tree(tmp_path / "b", 1.0)
    status = ab_trees.main(["--tree", f"a={a}", "--tree", f"b={b}", "--out", str(tmp_path / "out"), "--",
                            "python3", "-c", "import os, sys; sys.exit(os.path.basename(os.getcwd()) == 'b')"])
    assert status == 1
    printed = capsys.readouterr().out
    runs = [line.split()[3].rstrip(":") for line in printed.splitlines() if line.startswith("# run")]
    assert runs == ["a", "b", "b", "a"]
    assert "b: exit 1" in printed


@pytest.mark.parametrize("text", ["before", "=dir", "label=", "a=dir:NOVALUE", "a=dir:=3"])
def test_bad_tree_is_refused(text):
    with pytest.raises(ValueError, match="tree"):
        ab_trees.parse_tree(text)


@pytest.mark.parametrize("argv, message", [
    (["--tree", "a=.", "--", "true"], "with one tree"),
    (["--tree", "a=.", "--tree", "a=.", "--", "true"], "must differ"),
    (["--tree", "a=.", "--tree", "b=.", "--order", "a", "c", "--", "true"], "'c'"),
    (["--tree", "a=.", "--tree", "b=."], "timing command"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        ab_trees.main(argv)
    assert message in capsys.readouterr().err
