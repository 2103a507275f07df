"""The training-step section compares rows of one invocation of the tool, or says where it does not."""

from __future__ import annotations

import pytest

pytest.importorskip("typst", reason="the writeup is typeset by the typst package (installed by uv sync)")
from tests.test_writeup import section_built


def _section(tmp_path, edit):
    return section_built(tmp_path, "train_step", train_step=edit)


def _rerun(rows, size, context, stack, variant, **changes):
    """``rows`` with that case's row moved to a later invocation (and ``changes`` applied)."""
    for r in rows:
        if (r["size"], r["context_length"], r["stack"], r.get("variant")) == (size, context, stack, variant):
            r.update(run="20261125T100000Z-rerun0", **changes)
    return rows


def test_phase_pairs_of_two_invocations_are_marked(tmp_path):
    """At 8,192 x 1 both stacks' default rows share an invocation (unmarked) until ours' is rerun."""
    same = _section(tmp_path / "a", lambda rows: rows)["tables"]["phases"]
    assert same["header"][0][2]["text"] == "context 8,192, batch 1"
    apart = _section(tmp_path / "b", lambda rows: _rerun(rows, "xl", 8192, "ours", "default"))["tables"]["phases"]
    assert apart["header"][0][2]["text"] == "context 8,192, batch 1 †"
    assert apart["caption"].endswith("not broken down here. † the two stacks' rows come from different invocations "
                                     "of the tool.".replace("† ", "†: "))


def test_peak_and_graph_gain_ratios_use_pairs_of_one_invocation(tmp_path):
    """A rerun of ours' default variant at xl 8,192 x 1 with twice the peak memory and step time changes neither
    the peak ratio nor the CUDA-graph gain: its pairs span two invocations."""
    before = _section(tmp_path / "a", lambda rows: rows)["n"]
    after = _section(tmp_path / "b", lambda rows: _rerun(rows, "xl", 8192, "ours", "default", peak_gb=30.0,
                                                         step_ms=900.0))["n"]
    # Before: the xl 8,192 x 1 default pair is the fixture's one pair of one invocation (peak 1.00x), and ours'
    # gains are 1.10x (that case) to 1.35x. After: no pair of one invocation is left for the peak (not 2.00x), and
    # the rerun's 900 ms does not enter the gains.
    assert (before["peak_ratio"], before["cg_gain_ours"]) == ("1.00×", "1.10× to 1.35×")
    assert (after["peak_ratio"], after["cg_gain_ours"]) == ("–", "1.35×")
