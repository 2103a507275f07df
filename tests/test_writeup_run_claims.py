"""Comparisons the writeup presents as measured together: each comes from one run (or one commit), or the table
marks the rows of another and the text names their runs or commits. Small row sets built from the fixture."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from tests import test_writeup  # loads writeup/build.py, which puts writeup/ on sys.path (skips without typst)
from tests._writeup_fixture import row
from tests._writeup_text import numbers_in, printed_range

WRITEUP = test_writeup.WRITEUP
in_run, section_built = test_writeup.in_run, test_writeup.section_built


def commits_in(text: str) -> list[str]:
    """The short commit hashes ``text`` names, in order."""
    return re.findall(r"(?<![\w])[0-9a-f]{7}(?![\w])", text)


def typst(name: str) -> str:
    return (WRITEUP / "typ" / name).read_text()


def test_compile_pairs_of_two_runs_are_marked_and_excepted_from_the_same_run_claim(tmp_path):
    """The compiled training step from a later run than its eager baseline: its speed-up is marked, the caption
    names both rows' commits, and the text's 'same run' excepts that pair (it did not before)."""
    def edit(rows):
        return [in_run(r, "20261122T220041Z-5c1efc", "2026-11-22T22:00:41Z", "07d675fabcde")
                if r.get("part") == "model" and r.get("compile") and r["mode"] == "train_step" else r for r in rows]

    section = section_built(tmp_path, "torch_compile", torch_compile=edit)
    (small,) = section["tables"]["model"]["rows"]
    assert small[3].endswith("×") and small[6].endswith("× †")  # forward of one run, training step of two
    caption = section["tables"]["model"]["caption"]
    assert ("† eager and compiled from different runs: small training step (eager commit 0123456, 2026-11-22; "
            "compiled commit 07d675f, 2026-11-22)") in caption
    assert section["n"]["model_split"] == "small training step" and section["n"]["attention_split"] == ""
    assert "†" not in section["tables"]["attention"]["caption"]
    text = typst("single_gpu.typ")
    assert "#n.model_split" in text and "Eager and compiled were measured in the same run, and" not in text


def test_compile_pairs_of_one_run_say_same_run_without_marks(tmp_path):
    section = section_built(tmp_path, "torch_compile")
    assert section["n"]["model_split"] == "" and "†" not in section["tables"]["model"]["caption"]
    assert not any("†" in cell for r in section["tables"]["model"]["rows"] for cell in r)


def sharding_launch(optimizer: str, dtype: str, step_ms: float, commit: str, minute: int, peak: float = 50.0
                    ) -> dict[str, Any]:
    """One launch of the sharding benchmark on 2 H100s (its own run), at ``commit``, ``minute`` past 16:00."""
    config = {"optimizer": optimizer, "dtype": dtype, "size": "xl", "world_size": 2,
              "ddp": "local" if optimizer == "zero1_flat" else "bucketed_100mb", "context_length": 512,
              "batch_size": 4}
    state = 16.0 if optimizer == "adamw" else 8.0
    memory = {stage: {"params_gb": 8.0, "grads_gb": 8.0, "optimizer_state_gb": state, "peak_gb": peak}
              for stage in ("after_init", "before_step", "after_step")}
    r = row("optimizer_state_sharding_accounting", config,
            {"step_ms": step_ms, "steps": 5, "peak_gb": peak, "optimizer_state_gb": state, "memory": memory},
            gpus=2, gpu="NVIDIA H100 80GB HBM3")
    return in_run(r, f"20261125T16{minute:02d}00Z-{optimizer[:6]}", f"2026-11-25T16:{minute:02d}:00Z", commit)


def two_gpu_history() -> list[dict[str, Any]]:
    """A first launch at commit e615cb1 with all four optimizers in both dtypes; then the flat ZeRO-1 again in
    both at 4d6bc0b; then bf16 AdamW at f6153c0 and bf16 ours, ZeRO and flat at fdb6874."""
    first = [sharding_launch(o, d, step, "e615cb1abcde", minute) for minute, (o, d, step) in enumerate([
        ("adamw", "fp32", 839.5), ("sharded", "fp32", 844.5), ("zero_redundancy", "fp32", 840.7),
        ("zero1_flat", "fp32", 820.6), ("adamw", "bf16", 399.0), ("sharded", "bf16", 437.8),
        ("zero_redundancy", "bf16", 403.5), ("zero1_flat", "bf16", 353.9)])]
    flat_again = [sharding_launch("zero1_flat", "fp32", 820.2, "4d6bc0babcde", 20),
                  sharding_launch("zero1_flat", "bf16", 410.6, "4d6bc0babcde", 21)]
    later = [sharding_launch("adamw", "bf16", 350.8, "f6153c0abcde", 30),
             sharding_launch("zero_redundancy", "bf16", 389.4, "fdb6874abcde", 32),
             sharding_launch("zero1_flat", "bf16", 355.0, "fdb6874abcde", 33),
             sharding_launch("sharded", "bf16", 414.4, "fdb6874abcde", 34)]
    return first + flat_again + later


def test_sharding_ratios_come_from_one_commit_per_dtype_and_name_the_others(tmp_path):
    """bf16's newest rows mix two commits (AdamW f6153c0, the rest fdb6874): AdamW, ours and ZeRO are taken
    from the newest commit where all three ran (e615cb1), where the newest rows gave 414.4 / 350.8 = 1.18x; the
    flat ZeRO-1 keeps its newest row, marked, and its ratios divide by ZeRO's launch of its own commit (fdb6874) and
    by the AdamW launch nearest in time with as many timed steps (f6153c0), both named; fp32's flat row, whose
    commit ran nothing else, divides by the table's rows of as many steps and names both commits."""
    def edit(rows):
        four = [r for r in rows if r["world_size"] == 4]
        return two_gpu_history() + four

    section = section_built(tmp_path, "optimizer_state_sharding_accounting", optimizer_state_sharding_accounting=edit)
    n = section["n"]
    assert (n["bf16"]["step_plain"], n["bf16"]["step_sharded"], n["bf16"]["step_zero"]) == ("399.0", "437.8", "403.5")
    assert (n["bf16"]["slowdown"], n["bf16"]["vs_zero"], n["bf16"]["commits"]) == ("1.10×", "1.085×", "")
    assert (n["fp32"]["step_plain"], n["fp32"]["commits"]) == ("839.5", "")
    assert n["commits"] == "commit e615cb1, 2026-11-25"
    # The flat ZeRO-1 over ZeRO, with the commit of each (fp32: two commits, the flat one first; bf16: one).
    assert numbers_in(n["fp32"]["flat_vs_zero"]) == [round(820.2 / 840.7, 3)]
    assert commits_in(n["fp32"]["flat_vs_zero"]) == ["4d6bc0b", "e615cb1"]
    assert numbers_in(n["bf16"]["flat_vs_zero"]) == [round(355.0 / 389.4, 3)]
    assert commits_in(n["bf16"]["flat_vs_zero"]) == ["fdb6874"]
    assert n["bf16"]["flat_zero_ms"] == "389.4"
    table = section["tables"]["summary"]
    labels = {(r[0], r[1]): r for r in table["rows"]}
    flat_bf16 = labels[("ours, ZeRO-1 flat (FlatShardedOptimizer) †", "bf16")]
    assert flat_bf16[2:5] == ["355.0", f"{355.0 / 350.8:.3f}× ‡", f"{355.0 / 389.4:.3f}× ‡"]
    flat_fp32 = labels[("ours, ZeRO-1 flat (FlatShardedOptimizer) †", "fp32")]
    assert flat_fp32[2:5] == ["820.2", f"{820.2 / 839.5:.3f}×", f"{820.2 / 840.7:.3f}×"]  # the table's rows
    assert "flat ZeRO-1 bf16 against AdamW's launch at commit f6153c0, 2026-11-25 (350.8 ms" in table["caption"]
    assert "flat ZeRO-1 bf16 against ZeroRedundancyOptimizer's launch at commit fdb6874" in table["caption"]
    assert ("AdamW", "bf16") in labels and ("ours (ShardedOptimizer)", "bf16") in labels
    assert "Unmarked rows at commit e615cb1, 2026-11-25; † at another commit" in table["caption"]
    assert "fdb6874, 2026-11-25 (flat ZeRO-1 bf16)" in table["caption"]
    assert "#n.commits" in typst("sharding.typ")


def test_sharding_without_a_commit_of_all_three_names_each_commit_next_to_the_ratios(tmp_path):
    """With only the later bf16 launches (no commit ran AdamW, ours and ZeRO in bf16), the newest rows stay and
    the text names the commit of each."""
    def edit(rows):
        history = [r for r in two_gpu_history() if r["dtype"] == "fp32" or r["env"]["commit"][:7] in
                   ("f6153c0", "fdb6874")]
        return history + [r for r in rows if r["world_size"] == 4]

    section = section_built(tmp_path, "optimizer_state_sharding_accounting", optimizer_state_sharding_accounting=edit)
    bf16 = section["n"]["bf16"]
    assert (bf16["step_plain"], bf16["step_sharded"], bf16["slowdown"]) == ("350.8", "414.4", "1.18×")
    # Each commit with its date and the rows it measured.
    named = re.findall(r"([0-9a-f]{7}), (\d{4}-\d\d-\d\d) \(([^)]*)\)", bf16["commits"])
    assert named == [("f6153c0", "2026-11-25", "AdamW bf16"),
                     ("fdb6874", "2026-11-25", "ours bf16, ZeroRedundancyOptimizer bf16")]
    marked = [r[0] for r in section["tables"]["summary"]["rows"] if r[1] == "bf16" and r[0].endswith("†")]
    assert len(marked) == 3  # ours, ZeRO and the flat ZeRO-1: all at another commit than bf16's AdamW
    assert "#mixed(\"bf16\")" in typst("sharding.typ")


def test_ddp_traces_of_another_machine_and_commit_are_named_beside_the_table(tmp_path):
    """Part (b)'s fp32 traces from 2 ranks of a 4-GPU H100 host at another commit than table (a)'s 2 H200s: the
    text names both; traces of the table's machine and commit need no such sentence."""
    def edit(rows):
        out = []
        for r in rows:
            if r["world_size"] == 2 and r["dtype"] == "fp32" and r["variant"] in ("naive", "overlap"):
                traced = in_run(r, f"20261126T153406Z-{r['variant']}", "2026-11-26T15:34:06Z", "a0d588eabcde")
                out.append({**traced, "device": "4x NVIDIA H100 80GB HBM3"})
                r = {k: v for k, v in r.items() if not k.startswith("trace_")}
            out.append(r)
        return out

    section = section_built(tmp_path, "ddp_overlap_individual_parameters_benchmarking", ddp_benchmarking=edit)
    where = section["n"]["trace_where"]
    assert where == {"same": False, "trace": "2 ranks of 4x NVIDIA H100 80GB HBM3 at commit a0d588e (2026-11-26)",
                     "table": "2x NVIDIA H200 at commit 0123456 (2026-11-22)"}
    assert section["n"]["trace"]["naive"]["fp32"]["busy"] == "50.0"  # the 4-GPU host's trace is the one quoted
    assert "#w.trace" in typst("ddp.typ")
    same = section_built(tmp_path / "same", "ddp_overlap_individual_parameters_benchmarking")
    assert same["n"]["trace_where"]["same"] is True


def forward_grid_lines(run_of: Callable[[str], str | None]) -> list[dict[str, Any]]:
    """``scripts/rmsnorm_forward_grid.py``'s lines at two shapes: each grid size of ours, the tuned pick and
    Liger; ``run_of(provider name)`` gives a line's run (None: no run recorded, as the script writes)."""
    lines = []
    for rows, ours_4 in ((16384, 2758.8), (32768, 2900.0)):
        for provider, per_sm, gbps in (("liger", None, 2931.2), ("ours", 4, ours_4), ("ours", 16, 2887.1),
                                       ("ours", 0, 2925.0), ("ours", None, 2924.9)):
            line = {"dtype": "bf16", "rows": rows, "cols": 4096, "provider": provider, "programs_per_sm": per_sm,
                    "gbps": gbps, "device": "NVIDIA H100 80GB HBM3"}
            run = run_of(provider if per_sm is None else f"ours {per_sm}")
            lines.append(line if run is None else {**line, "run": run})
    return lines


@pytest.mark.parametrize("run_of, calls, same_call", [
    (lambda name: None, "one", True),  # the script's lines carry no run: one file, one call
    (lambda name: "earlier" if name == "ours 4" else "later", "2", False),
])
def test_rmsnorm_forward_grid_says_which_calls_measured_its_lines(tmp_path, run_of, calls, same_call):
    """The 4-programs-per-SM ratio to Liger is read from the same file as the table: one call unless the lines
    say otherwise (the text called it an earlier grid run)."""
    grid = tmp_path / "results" / "h100-rmsnorm-forward-grid" / "tuned_grid_1ee9e87.jsonl"

    def edit(rows):
        grid.parent.mkdir(parents=True, exist_ok=True)
        grid.write_text("".join(json.dumps(line) + "\n" for line in forward_grid_lines(run_of)))
        return rows

    forward = section_built(tmp_path, "rmsnorm", rmsnorm=edit)["n"]["forward"]
    lines = forward_grid_lines(run_of)
    before = [ours["gbps"] / liger["gbps"] for ours in lines for liger in lines
              if (ours["provider"], ours["programs_per_sm"], liger["provider"]) == ("ours", 4, "liger")
              and ours["rows"] == liger["rows"]]
    assert numbers_in(forward["before"]) == printed_range(min(before), max(before), 2) == [0.94, 0.99]
    assert (forward["calls"], forward["before_same_call"]) == (calls, same_call)
    text = typst("beyond.typ")
    assert "an earlier grid run" not in text and "not f.before_same_call" in text
