"""The writeup pipeline: it builds the PDF from a small fixture of results (CPU, seconds), fails naming a
missing results file, and its derivations give the numbers worked out by hand."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import statistics
import sys
from pathlib import Path

import pytest

from tests._writeup_fixture import flash_probe, leaderboard_2026_planned_pair, write_fixture
from tests._writeup_fixture import leaderboard as fixture_leaderboard
from tests._writeup_text import item_about, numbers_in, printed_range

WRITEUP = Path(__file__).resolve().parents[1] / "writeup"


def _load_build():
    spec = importlib.util.spec_from_file_location("writeup_build", WRITEUP / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts writeup/ on sys.path, so `pipeline` imports too
    return module


# uv sync installs typst; the GPU machines run the suite on their own Python, which may lack it.
pytest.importorskip("typst", reason="the writeup is typeset by the typst package (installed by uv sync)")
build = _load_build()
from pipeline import accounting
from pipeline.results import Missing, Results, environment_line, latest_per_config
from pipeline.sections import SECTIONS, Output
from pipeline.snapshot_reports import parse_snapshot_reports


def run_build(tmp_path: Path, results: Path, *extra: str) -> int:
    """The build of the 2025 edition (``--edition 2026`` in ``extra``: the 2026 one; tests/test_writeup_editions.py
    builds both)."""
    edition = [] if "--edition" in extra else ["--edition", "2025"]
    return build.main(["--results-dir", str(results), "--figures-dir", str(tmp_path / "figures"),
                       "--build-dir", str(tmp_path / "build"), "--output", str(tmp_path / "writeup.pdf"),
                       *edition, *extra])


@pytest.fixture(scope="module")
def fixture_results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fixture")
    write_fixture(root / "results", root / "row-figures")
    return root / "results"


SIZES = ("small", "medium", "large", "xl", "2.7B")


def sizes_in(text: str) -> list[str]:
    """The model sizes ``text`` names, in order."""
    return re.findall(r"(?<![\w.])(?:small|medium|large|xl|2\.7B)(?![\w.])", text)


def train_step_ratios(results: Path) -> dict[tuple[str, int, int], float]:
    """Per case (size, context, batch) of the current protocol (rows with a variant; the residual-norm launches
    left out) where both stacks ran: ours' best step over torch's best."""
    best: dict[tuple[str, int, int], dict[str, float]] = {}
    for r in fixture_rows(results, "train_step"):
        if r.get("variant") and "residual_norm" not in r:
            stacks = best.setdefault((r["size"], r["context_length"], r["batch_size"]), {})
            stacks[r["stack"]] = min(stacks.get(r["stack"], math.inf), r["step_ms"])
    return {case: s["ours"] / s["torch"] for case, s in best.items() if len(s) == 2}


def check_cases(text: str, cases: dict[tuple[str, int, int], float]) -> None:
    """A list of cases as ``"<size> at <context> × <batch> (<ratio>×)"``, in the order of the sizes."""
    ordered = sorted(cases.items(), key=lambda item: (SIZES.index(item[0][0]), item[0][1:]))
    assert sizes_in(text) == [size for (size, _, _), _ in ordered]
    assert numbers_in(text) == [x for (_, context, batch), ratio in ordered for x in (context, batch, round(ratio, 3))]


OP_REFERENCE = {"attention": "sdpa_cudnn", "rmsnorm": "torch_compiled", "cross_entropy": "torch_compiled",
                "adamw": "torch_fused"}  # each operator's like-for-like PyTorch counterpart


def test_builds_every_section_from_the_fixture(tmp_path, fixture_results):
    assert run_build(tmp_path, fixture_results) == 0
    pdf = tmp_path / "writeup.pdf"
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 50_000
    data = json.loads((tmp_path / "build" / "generated" / "data.json").read_text())["sections"]
    assert set(data) == set(SECTIONS)
    assert not [name for name, section in data.items() if "missing" in section]
    # Numbers come from the rows: the leaderboard's fastest SDPA backend is cuDNN at 8 ms against our 10 ms.
    assert data["leaderboard"]["n"]["best_ms"] == "8.00" and data["leaderboard"]["n"]["ours"] == "10.00"
    hopper = data["flash_benchmarking"]["n"]["hopper"]
    assert (hopper["n_points"], hopper["vs_cudnn"], hopper["faster_than_cudnn"]) == ("2", "1.05× to 1.20×", "0")
    assert hopper["fa2_all"] and "NVIDIA H200" in hopper["device"]
    assert "NVIDIA H100 80GB HBM3" in data["flash_benchmarking"]["env"]  # the main sweep stays on the H100
    # Every measured section states where and when its rows were measured.
    assert "NVIDIA H100 80GB HBM3" in data["benchmarking_script"]["env"]
    assert "2026-11-22" in data["benchmarking_script"]["env"]
    for figure in ("warmup_study.png", "pytorch_attention.png", "all_reduce.png", "ddp_bucketed.png",
                   "train_step_ratio.png", "leaderboard_2026_profile.png", "leaderboard_2026_proxy_profile.png",
                   "leaderboard_2026_split.png"):
        assert (tmp_path / "figures" / figure).exists()
    # The fast training step: only the current protocol's rows (with a variant; the earlier H200 rows stay out of
    # the comparison and of the environment line), ours' best over torch's best: 0.90x at xl 512 x 4, 1.02x elsewhere;
    # the small model's torch rows from an earlier run.
    ts = data["train_step"]
    step = ts["n"]
    assert "NVIDIA H200" not in ts["env"] and step["n_older"] == "8" and step["older_devices"] == "1x NVIDIA H200"
    ratios = train_step_ratios(fixture_results)
    assert ratios[("xl", 512, 4)] == pytest.approx(0.9)
    check_cases(step["faster"], {case: r for case, r in ratios.items() if r < 1})
    check_cases(step["slower"], {case: r for case, r in ratios.items() if r > 1})
    assert (step["focus_ours_mfu"], step["focus_torch_ms"]) == ("46.3 %", "80.0")
    # Per size measured, its shapes (small at 8,192 × 1: torch's default variant only); then the sizes and the shapes
    # of the table never measured.
    measured = dict(part.split(" at ", 1) for part in step["measured"].split("; "))
    assert list(measured) == ["small", "xl"] and all(numbers_in(m) == [512, 4, 8192, 1] for m in measured.values())
    only = re.search(r"8,192 × 1 \(([^)]*)\)", measured["small"]).group(1).split()
    assert {"torch", "default"} <= set(only) and not {"ours", "both"} & set(only)
    assert sizes_in(step["unmeasured"]) == ["medium", "large", "2.7B", "small", "xl"]
    assert numbers_in(step["unmeasured"]) == [2048, 4, 2048, 4]
    assert step["has_earlier"] and ts["tables"]["main"]["rows"][0][6] == "1.020×†"
    assert ts["tables"]["main"]["rows"][2][2:] == ["100.0", "80.0", "110.0", "72.0", "0.900×", "41.7 %", "46.3 %"]
    # The phases are the default variant's (the CUDA-graph rows record the replay under forward).
    assert ts["tables"]["phases"]["rows"][1][1:4] == ["55.0", "60.5", "+5.5"]
    assert step["profile"]["ours_gpu"] == "110.0" and step["profile"]["ours_idle"] == "45 %"
    assert [a["host"] for a in step["profile"]["attention"]] == ["8.0", "12.0"]
    stacks = {r[0]: r[1:] for r in ts["tables"]["stacks"]["rows"]}
    assert stacks["weights"][0].startswith("fp32") and stacks["weights"][1].startswith("linear layers bf16")
    graphs = dict(part.split(": ", 1) for part in stacks["cudagraphs"][0].split("; "))  # per variant
    assert list(graphs) == ["default", "CUDA graphs"] and graphs["default"] == "no"
    # Host cost per call: both runs read (the earlier one is not replaced by the later), the comparisons from the rows.
    ov = data["op_overhead"]
    assert "commits 1111111, 2222222" in ov["env"]
    assert ov["tables"]["main"]["rows"][0] == ["attention", "4 × 25 × 512 × 64", "forward", "250.0", "50.0",
                                               "SDPA cuDNN", "60.0", "4.17×", "0.83×"]
    # Ours against the PyTorch counterpart in the newest run: attention at the training step's shape only.
    compared = [r for r in fixture_rows(fixture_results, "op_overhead") if r["run"].endswith("-now")
                and r["provider"] == OP_REFERENCE[r["op"]] and r["shape"] not in ([1, 1, 128, 64],)]
    dearer = [r for r in compared if r["ours_over_this"] > 1]
    assert ov["n"]["n_cheaper"] == str(len(compared) - len(dearer)) == "4"
    assert re.findall(r"attention|rmsnorm|cross_entropy|adamw", ov["n"]["dearer"]) == [r["op"] for r in dearer]
    assert numbers_in(ov["n"]["dearer"]) == [x for r in dearer for x in (
        *(r["shape"] if r["op"] == "attention" else []), round(r["ours_over_this"], 2))]
    assert ov["n"]["attention"]["forward_backward"]["before"] == "8.00×" and ov["n"]["ce_forward_dearer"]
    # AdamW GB/s from the bytes each provider moves: PyTorch's bf16 moments are bf16 (14 bytes), ours fp32 (22).
    adamw = data["fused_adamw"]["n"]["bf16"]
    assert (adamw["ours_bytes"], adamw["torch_bytes"]) == ("22", "14")
    assert adamw["torch_gbps"] == f"{1_998_235_200 * 14 / 10.5e-3 / 1e9:,.0f}"
    assert data["fused_cross_entropy"]["n"]["big"]["mem_eager"] == f"{6.0 / 51.0:.3f}×"
    # The cold-start rows name only their GPU; the 12,345-token call is the first of the one-pass backward.
    assert data["flash_cold_start"]["env"] == "NVIDIA H200"
    assert data["flash_cold_start"]["n"]["switch"] == "12,345"
    # DDP: per dtype, against PyTorch's DDP of the same dtype; the overhead model at the rows' numbers of calls.
    bucketed = data["ddp_bucketed_benchmarking"]["n"]
    assert (bucketed["fp32"]["best_mb"], bucketed["fp32"]["best_vs_torch"]) == ("100", f"{630 / 640:.3f}×")
    assert bucketed["small_calls"] == "435" and bucketed["bf16"]["fit_o_us"] != "–"
    # Optimizer-state sharding: fp32 and bf16, each against AdamW and ZeRO of its own dtype.
    sharding = data["optimizer_state_sharding_accounting"]["n"]
    assert sharding["fp32"]["measured_saving"] == "8.0" and sharding["bf16"]["vs_zero"] == "1.000×"
    # FSDP: only the rows with a `checkpointing` key (the earlier per-Linear FSDP's row stays out, and out of the
    # environment line), ratios to FSDP2 on the same GPUs, checkpointed alike, with the same AdamW; at each world
    # size the machine with the most timed steps is the reference (2 ranks: the H200s' 10 steps, not the H100s' 5).
    fsdp = data["fsdp_accounting"]
    two, four = fsdp["n"]["ranks"]
    assert (two["gpus"], two["plain"]["ratio"], two["ckpt"]["ratio"]) == ("2 × H200", "0.80×", f"{363 / 660:.2f}×")
    assert (four["gpus"], four["plain"]["ratio"], four["ckpt"]["ratio"]) == ("4 × H100", f"{425 / 620:.2f}×",
                                                                             f"{720 / 792:.2f}×")
    # The other settings: 2 H100s without checkpointing, 5 timed steps, with cs336_basics' AdamW then PyTorch's.
    others = fsdp["n"]["others"].split("; ")
    assert [numbers_in(o) for o in others] == [[round(456 / 575, 2), 2, 5], [round(517 / 668, 2), 2, 5]]
    assert ["cs336_basics" in o.split("'")[0] for o in others] == [True, False] and "torch.optim.AdamW" in others[1]
    assert not any("999.0" in cell for r in fsdp["tables"]["main"]["rows"] for cell in r)
    assert "2026-11-21" not in fsdp["env"] and fsdp["n"]["has_check"]
    # The 2026 leaderboard step: the official rows only (the 4-layer trial stays out), ours 7.5 s against 6.0 s;
    # the memory budget from memory_budget of the rows' configuration; the profile's three variants.
    lb = data["leaderboard_2026"]
    assert (lb["n"]["ratio"], lb["n"]["ours_s"]) == ("1.25×", "7.50") and not lb["n"]["ours_faster"]
    assert lb["n"]["pflop"] == "5.04"
    assert (lb["n"]["weights_pflop"], lb["n"]["attention_pflop"]) == ("2.95", "2.09")
    assert [r[:3] for r in lb["tables"]["main"]["rows"]] == [["2x NVIDIA H200", "2026-11-22 16:00 (headline)",
                                                              "34 selective"]]
    assert not lb["n"]["planned"] and not lb["n"]["has_earlier"]
    memory = {r[0]: r[1:] for r in lb["tables"]["memory"]["rows"]}
    assert memory["predicted peak"] == ["75.4", "97.7"] and memory["measured peak"] == ["81.0", "93.0"]
    assert memory["loss head (transient)"] == ["5.0", "39.8"] and lb["n"]["ours_error"] == "+5.6"
    assert lb["tables"]["profile"]["header"][0] == ["GPU ms", "ours", "pytorch", "ours with SDPA attention"]
    # Each official row's plan (none recorded: the stack's default from the parts), its predicted and measured peak.
    plans = {r[2]: r[3:] for r in lb["tables"]["plans"]["rows"]}
    assert plans["ours"] == ["34 selective (stack default)", "75.4", "–", "81.0", f"+{100 * (81.0 / 75.367 - 1):.1f} %"]
    assert plans["pytorch"][0] == "34 full (stack default)" and plans["pytorch"][4].startswith("−")
    assert memory["checkpoint plan (blocks)"] == ["34 selective (stack default)", "34 full (stack default)"]
    assert (lb["n"]["claim"]["claim_rows"], lb["n"]["claim"]["claim_holds"]) == ("2", False)
    # The full step's split, and the B200 on paper from its rates: 25 blocks kept, 9 selective at 180 GB (a margin
    # of 5 % of the card).
    assert lb["n"]["has_split"] and lb["n"]["split"]["exposed"] == "50.0"
    assert [r[0] for r in lb["tables"]["split"]["rows"]][-2:] == ["step (wall)", "allocator retries in the step"]
    paper = lb["n"]["paper"]
    assert (paper["profile_split"], paper["kept"], paper["selective"], paper["full"]) == (True, "25", "9", "0")
    assert [r[0] for r in lb["tables"]["paper"]["rows"]][0].startswith("H200, 34 selective")
    assert (lb["n"]["p_bwd_ratio"], lb["n"]["sdpa_ratio"]) == (f"{360 / 190:.2f}×", f"{860 / 880:.2f}×")
    assert (lb["n"]["ours_bwd_kernel"], lb["n"]["cudnn_bwd_kernel"]) == ("355", "188")
    assert lb["n"]["bwd_gap_covers_wall_gap"] and lb["n"]["sdpa_faster"]
    assert "2x NVIDIA H200" in lb["env"] and "1x NVIDIA H100 80GB HBM3" in lb["env"] and "commit 0123456" in lb["env"]
    assert "2026-11-22 to 2026-11-25" in lb["env"]  # the step's rows (fixture env), the profiles' (their own dates)
    # The one-GPU proxy (world_size 1 rows, kept out of the two-GPU tables): ours 840 / 890 ms; its own profile,
    # where the compiled blocks' other kernels are below PyTorch's.
    proxy = lb["n"]["proxy"]
    assert (proxy["ratio"], proxy["ours_faster"], proxy["other_no_more"]) == (f"{840 / 890:.3f}×", True, True)
    assert (proxy["eager_other"], proxy["has_whole"]) == ("160.0", False)
    assert [r[0] for r in lb["tables"]["proxy"]["rows"]] == ["pytorch", "ours"]
    assert lb["tables"]["proxy_profile"]["header"][0] == ["GPU ms", "ours", "pytorch", "ours with uncompiled blocks"]
    # The FlashAttention optimisation log: measured steps in file order, the --set-decision row's decision and
    # note merged into its step (and left out of the environment line), then the earlier probe history.
    flash = data["flash_optimisation_log"]
    log = flash["tables"]["log"]
    assert log["header"][1][5:] == ["16384×64", "65536×128", "65536×128"]
    assert log["rows"] == [["triton-baseline", "baseline", "6.00", "4.50", "1.33×", "1.60×", "1.67×", "9.00"],
                           ["gluon-backward", "kept", "5.40", "4.50", "1.20×", "1.60×", "1.25×", "6.75"]]
    steps = flash["n"]["log_steps"]
    assert [(st["step"], st["decision"]) for st in steps] == [("triton-baseline", "baseline"), ("gluon-backward", "kept")]
    assert steps[1]["note"] == "the d=128 backward won a third." and steps[0]["where"] == "measured at 0123456"
    summary = flash["n"]["log_summary"]
    # The number of steps, then ours / cuDNN and both times on the leaderboard shape at the first and the last step,
    # then our backward alone at 65536×128 at both: all from the log's measured rows, on their one GPU.
    measured = [r for r in fixture_rows(fixture_results, "flash_optimisation_log") if "leaderboard" in r]
    board = [(r["leaderboard"]["ratio_vs_cudnn"], r["leaderboard"]["ours_fwd_bwd_ms"],
              r["leaderboard"]["sdpa_cudnn_fwd_bwd_ms"]) for r in (measured[0], measured[-1])]
    backward = [p["ours_bwd_ms"] for r in (measured[0], measured[-1]) for p in r["points"] if p["d_head"] == 128]
    assert numbers_in(summary) == [len(measured), *[round(x, 2) for b in board for x in b], 65536, 128,
                                   *[round(ms, 2) for ms in backward]]
    assert "NVIDIA H200" in summary and {r["env"]["gpu_name"] for r in measured} == {"NVIDIA H200"}
    assert "NVIDIA H200" in flash["env"] and "H100" in flash["env"] and "cpu" not in flash["env"]
    assert flash["n"]["has_history"] and "NVIDIA H100 80GB HBM3" in flash["n"]["history_intro"]
    assert [r[1] for r in flash["tables"]["history"]["rows"]] == ["step1 fused backward", "step2 autotune cache"]
    assert "listings" not in flash  # the probes' raw output stays in writeup/results/flash_probe/
    assert "flash_probe" in flash["n"]["history_summary"]


def _strings(value):
    """Every string inside generated data (dicts, lists)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


@pytest.fixture(scope="module")
def fixture_data(tmp_path_factory, fixture_results) -> dict:
    root = tmp_path_factory.mktemp("consistency")
    assert run_build(root, fixture_results) == 0
    return json.loads((root / "build" / "generated" / "data.json").read_text())["sections"]


def _cell_number(cell: str) -> float:
    return float(cell.split("±")[0].replace(",", "").rstrip("%× †"))


def test_no_range_prints_the_same_value_at_both_ends(fixture_data):
    same_ends = re.compile(r"(?<![\w.,])([\d.,]+ ?(?:×|%|ms|GB|GB/s|MiB|s)?) to \1(?![\d.,])")
    found = [text for text in _strings(fixture_data) if same_ends.search(text)]
    assert not found, f"ranges whose two ends print the same: {found[:5]}"
    # The Typst sources print ranges of two generated numbers through `rng`, which collapses equal ends.
    typst = {path.name: path.read_text() for path in (WRITEUP / "typ").glob("*.typ")}
    typed = [(name, m.group(0)) for name, text in typst.items()
             for m in re.finditer(r"#[\w.]+_lo to #[\w.]+_hi", text)]
    assert not typed, f"ranges typed as 'lo to hi' instead of rng(lo, hi): {typed}"


def test_backward_over_forward_is_the_tables_columns(fixture_data):
    section = fixture_data["benchmarking_script"]
    rows = [r for r in section["tables"]["main"]["rows"] if "OOM" not in r[1:3]]
    ratios = [_cell_number(r[2]) / _cell_number(r[1]) for r in rows]
    lo, hi = section["n"]["bwd_ratio_lo"], section["n"]["bwd_ratio_hi"]
    assert min(ratios) == pytest.approx(lo, rel=0.02) and max(ratios) == pytest.approx(hi, rel=0.02)
    assert section["n"]["bwd_ratio"] in (f"{lo:.2f}×", f"{lo:.2f}× to {hi:.2f}×")


def test_warmup_rows_measured_after_another_size_are_marked(fixture_data):
    rows = fixture_data["benchmarking_script"]["tables"]["study"]["rows"]
    zero_warmup = [row[1] for row in rows]
    assert not zero_warmup[0].endswith("†") and all(cell.endswith("†") for cell in zero_warmup[1:])


def test_shares_in_prose_are_the_tables(fixture_data):
    """The DDP prose quotes the exposed share of the table's row, never another share of the same step."""
    for name in ("naive_ddp_benchmarking", "minimal_ddp_flat_benchmarking"):
        section = fixture_data[name]
        table = {(r[0], r[1]): r for r in section["tables"]["main"]["rows"]}
        numbers = section["n"] if name == "naive_ddp_benchmarking" else section["n"]["naive"]
        for dtype in ("fp32", "bf16"):
            row = table[("naive (per parameter)", dtype)]
            assert (numbers[dtype]["step"], numbers[dtype]["exposed"], numbers[dtype]["share"]) == (row[2], row[5], row[6])
    typst = "".join(path.read_text() for path in (WRITEUP / "typ").glob("*.typ"))
    assert "comm_share" not in typst


def test_softmax_flop_ratio_in_prose_is_the_tables(fixture_data):
    """nsys (e) quotes the FLOP column of its own table (its range, which depends on the head dimension), not a
    summary of it that no row shows."""
    section = fixture_data["nsys_profile"]
    column = [_cell_number(r[5]) for r in section["tables"]["attention"]["rows"] if r[5] != "–"]
    assert column
    expected = f"{min(column):.3f}×" if min(column) == max(column) else f"{min(column):.3f}× to {max(column):.3f}×"
    assert section["n"]["softmax_flops"] == expected
    for cell in {r[5] for r in section["tables"]["attention"]["rows"]}:
        assert cell in section["n"]["softmax_flops_by_head_dim"]


def test_the_overhead_models_fit_is_a_row_of_the_fits_table(fixture_data):
    """The DDP overhead model's w and o are the NCCL fit of the DDP rows' machine and world size, shown (with that
    machine) in the all-reduce fits table."""
    bucketed = fixture_data["ddp_bucketed_benchmarking"]["n"]
    fits = fixture_data["distributed_communication_single_node"]["tables"]["fits"]["rows"]
    assert ["nccl", bucketed["world"], bucketed["fit_where"], bucketed["o_us"], bucketed["w_gbs"]] in [
        r[:3] + [r[3], r[4]] for r in fits]


def test_nccl_against_gloo_compares_one_host(tmp_path):
    """A later host's faster NCCL rows at 2 processes join the table beside the first host's; NCCL over gloo
    divides rows of the host that ran both (the gloo rows' host), never one host's NCCL by another's gloo."""
    def edit(rows):
        later = [{**in_run(r, "20261126T120000Z-abcdef", "2026-11-26T12:00:00Z", "8f2ed70abcde"),
                  "device": "4x NVIDIA H100 80GB HBM3", "time_ms": r["time_ms"] / 2}
                 for r in rows if r["backend"] == "nccl" and r["world_size"] == 2]
        return rows + later

    section = section_built(tmp_path, "distributed_communication_single_node",
                            distributed_communication_single_node=edit)
    gloo_ms, nccl_ms = 1e3 * (1e-3 + 1e9 / 2e9), 1e3 * (2e-5 + 1e9 / 200e9)  # the fixture's 1,000 MB times
    assert section["n"]["compare_where"] == "H200 host of 2"
    assert section["n"]["nccl_over_gloo"] == f"{gloo_ms / nccl_ms:.0f}×"  # not gloo_ms / (nccl_ms / 2)
    shown = {(r[0], r[1], r[2]) for r in section["tables"]["main"]["rows"] if r[3] == "1,000"}
    assert {("gloo", "2", "CPU, H200 host of 2"), ("nccl", "2", "H200 host of 2"), ("nccl", "2", "H100 host of 4")} <= shown
    where = {(r[0], r[1], r[2]) for r in section["tables"]["fits"]["rows"]}
    assert {("nccl", "2", "H200 host of 2"), ("nccl", "2", "H100 host of 4")} <= where


def test_memory_answer_names_the_largest_allocations_and_their_tensor(fixture_data):
    """(e) reads the latest inference snapshots (the H200's, context 2048), not the H100's earlier ones."""
    section = fixture_data["memory_profiling"]
    e = section["n"]["e"]
    assert (e["fp32"]["mib"], e["fp32"]["count"], e["fp32"]["ctx"]) == ("2,048", "96", "2048")  # 64 + 32 of 2 GiB
    assert e["fp32"]["scores_mib"] == e["fp32"]["mib"]  # B·h·T²·4 bytes at the snapshot's context
    assert e["fp32"]["what"] == e["bf16"]["what"] == "fp32 attention scores (B·h·T²)"  # the softmax is fp32 in bf16
    assert e["fp32"]["sources"] == ("cs336_basics/model.py:126 scaled_dot_product_attention and "
                                    "cs336_basics/nn_utils.py:15 softmax")
    first = section["tables"]["allocations_fp32"]["rows"][0]
    assert first == ["2,048.0", "64", "cs336_basics/model.py:126 scaled_dot_product_attention",
                     "cs336_basics/model.py:138 causal_attention", "attention: scores, mask",
                     "fp32 attention scores (B·h·T²)"]
    assert section["tables"]["allocations_bf16"]["rows"][1][5] == "bf16 attention scores (B·h·T²)"


def test_memory_section_without_the_inference_snapshots_says_pending(tmp_path, fixture_results):
    results = tmp_path / "results"
    shutil.copytree(fixture_results, results)
    path = results / "memory_profiling.jsonl"
    kept = [line for line in path.read_text().splitlines() if '"inference"' not in line or '"peak"' in line]
    path.write_text("\n".join(kept) + "\n")
    section = SECTIONS["memory_profiling"](Results(results), Output(tmp_path / "figures", tmp_path / "build"))
    assert section["figures"]["inference"] is None and section["figures"]["train_step"] is not None
    assert section["n"]["e"]["fp32"] == {"pending": True} and section["tables"]["allocations_fp32"] is None


def test_ddp_traces_set_naive_against_the_per_parameter_overlap(fixture_data):
    section = fixture_data["ddp_overlap_individual_parameters_benchmarking"]
    figures = section["figures"]
    assert figures["naive_fp32"]["path"].endswith("ddp_overlap_naive_fp32.png")
    assert figures["overlapped_fp32"]["path"].endswith("ddp_overlap_overlap_fp32.png")  # not the bucketed trace
    trace = section["n"]["trace"]
    assert (trace["naive"]["fp32"]["overlap"], trace["naive"]["fp32"]["exposed"]) == ("0 %", "50.0")
    assert (trace["overlapped"]["fp32"]["overlap"], trace["overlapped"]["fp32"]["exposed"]) == ("80 %", "10.0")


def test_ddp_section_without_the_overlap_trace_says_pending(tmp_path, fixture_results):
    results = tmp_path / "results"
    shutil.copytree(fixture_results, results)
    path = results / "ddp_benchmarking.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        if row["variant"] == "overlap":
            row.pop("trace_figure", None)
            row.pop("trace_comm_busy_ms", None)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    section = SECTIONS["ddp_overlap_individual_parameters_benchmarking"](
        Results(results), Output(tmp_path / "figures", tmp_path / "build"))
    assert section["figures"]["overlapped_fp32"] is None and section["figures"]["naive_fp32"] is not None
    assert section["n"]["trace"]["overlapped"]["fp32"] == {"pending": True}


def test_the_compile_comparison_names_its_eager_baseline(fixture_data):
    section = fixture_data["torch_compile"]
    first = section["tables"]["model"]["rows"][0]
    assert first[0] == section["n"]["baseline_size"]
    assert first[1].split(" ±")[0] == section["n"]["eager_here"] and section["n"]["eager_sweep"] != "–"


def test_profiler_answer_compares_forward_with_forward_and_backward(fixture_data):
    header = fixture_data["nsys_profile"]["tables"]["kernels"]["header"][0]
    assert "top in forward + backward" in header and "top in training step" not in header


def test_flash_tables_are_readable_and_not_repeated(fixture_data):
    section = fixture_data["flash_benchmarking"]
    for dtype in section["n"]["dtypes"]:
        assert len(section["tables"][dtype]["align"]) == 8  # length, d, ours and PyTorch: fwd, bwd, both
        extra = section["tables"].get(f"extra_{dtype}")  # the other providers, when the sweep timed any
        assert extra is None or len(extra["align"]) <= 8
    assert "hopper" not in section["tables"]


def test_sharding_names_the_machine_of_the_quoted_variation(fixture_data):
    n = fixture_data["optimizer_state_sharding_accounting"]["n"]
    assert n["where"] != "–" and n["ddp_where"] != "–"
    typst = (WRITEUP / "typ" / "sharding.typ").read_text()
    assert "within noise" not in typst and "#n.ddp_where" in typst


def test_fsdp_table_names_the_ranks_and_device_of_every_row(fixture_data, fixture_results):
    section = fixture_data["fsdp_accounting"]
    table = section["tables"]["main"]
    rows = {(r[0], r[1], r[2]): r for r in table["rows"]}
    assert set(rows) == {("2 × H100", "none", "cs336_basics"), ("2 × H100", "none", "torch (foreach)"),
                         ("2 × H200", "none", "cs336_basics"), ("2 × H200", "every block", "cs336_basics"),
                         ("4 × H100", "none", "cs336_basics"), ("4 × H100", "every block", "cs336_basics")}
    # steps, DDP / FSDP2 / ours (ms), ratio, DDP / FSDP2 / ours peaks, FSDP2 / ours reserved
    assert rows[("2 × H100", "none", "torch (foreach)")][3:] == ["5", "–", "668.0", "517.0", f"{517 / 668:.2f}×",
                                                               "–", "31.09", "30.85", "36.68", "40.35"]
    assert rows[("2 × H200", "none", "cs336_basics")][4] == "300.0"  # DDP measured on the H200s only
    for device in ("2x NVIDIA H200", "2x NVIDIA H100 80GB HBM3", "4x NVIDIA H100 80GB HBM3"):
        assert device in table["caption"] and device in section["env"]
    # The caption gives each protocol (timed and warm-up steps) with the machines of its rows.
    protocols: dict[tuple[int, int], set[int]] = {}
    for r in fixture_rows(fixture_results, "fsdp_accounting"):
        if r["measure"] == "step" and "checkpointing" in r:
            protocols.setdefault((r["steps"], r["warmup"]), set()).add((r["world_size"], r["env"]["gpu_name"]))
    assert protocols == {(5, 2): {(2, H100)}, (10, 3): {(2, H200), (4, H100)}}
    said = [part for part in re.split(r"[;()]", table["caption"]) if "timed" in part and "warm-up" in part]
    assert [numbers_in(part) for part in said] == [[5, 2, 2], [10, 3, 2, 4]]
    assert [re.findall(r"H100|H200", part) for part in said] == [["H100"], ["H200", "H100"]]


def test_fsdp_memory_reads_the_snapshot_reports_and_the_reserved_peaks(fixture_data, fixture_results):
    m = fixture_data["fsdp_accounting"]["n"]["memory"]
    assert (m["gpus"], m["ours_state"], m["fsdp2_state"], m["own"]) == ("2 × H100", "12.06", "12.26", "0.03")
    assert m["at_end_of_forward"] and m["same_activations"] and m["own_is_root"] and m["shard_larger"]
    assert (m["activations"], m["largest_mib"], m["shard_mib"], m["fsdp2_shard_mib"]) == ("5.04", "50", "78", "31")
    # The reports print the peaks to 0.01 GB: 5.383 GB besides the state and our FSDP's buffer, 17.65 against 17.47.
    assert (m["state_gap"], m["peak_gap"]) == (f"{12.264 - 12.057:.2f}", f"{17.65 - 17.47:.2f}")
    assert (m["reserved_gap"], m["basics_gap"]) == (f"{40.35 - 36.68:.1f}", f"{36.92 - 36.68:.2f}")
    # Elsewhere, only 4 H100s with every block checkpointed reserve a gigabyte or more apart: ours more than FSDP2.
    reserved = {(r["world_size"], r["checkpointing"], r["impl"]): r["reserved_gb"]
                for r in fixture_rows(fixture_results, "fsdp_accounting") if "reserved_gb" in r}
    assert abs(reserved[(4, 0, "ours")] - reserved[(4, 0, "fsdp2")]) < 1
    ours, fsdp2 = reserved[(4, 1, "ours")], reserved[(4, 1, "fsdp2")]
    assert numbers_in(m["elsewhere"]) == [4, round(ours - fsdp2, 2), ours, fsdp2] and "more" in m["elsewhere"].split()
    sites = fixture_data["fsdp_accounting"]["tables"]["sites"]["rows"]
    assert sites[0] == ["cs336_basics/nn_utils.py:15 softmax", "48", "50.0", "2.517", "2.517"]
    assert ["cs336_systems/parallel/fsdp/transport.py:126 _allocate", "1", "30.5", "0.032", "–"] in sites


SNAPSHOT_LOG = """# 10:00:00 python3 -m cs336_systems.bench.fsdp_accounting --memory-snapshot snapshots
 impl  checkpointing  step_ms  peak_gb
 ours              0   517.11    30.85
# 10:00:05 python3 scripts/memory_snapshot_report.py snapshots/fsdp_ours_torch.pickle --top 3
snapshots/fsdp_ours_torch.pickle: peak of the recorded step 3.50 GB in 4 blocks
      GB  blocks  allocated at
   0.500       2  cs336_basics/model.py:101 silu
   2.000       1  (allocated before recording)
   1.000       1  cs336_systems/parallel/fsdp/transport.py:126 _allocate
# 10:00:06 python3 scripts/memory_snapshot_report.py other/fsdp_fsdp2_basics.pickle
other/fsdp_fsdp2_basics.pickle: peak of the recorded step 1.25 GB in 1 blocks
      GB  blocks  allocated at
   1.250       1  cs336_basics/nn_utils.py:15 softmax
   0.100  not a group
# 10:00:07 echo done
   9.999       9  printed by another command
"""


def test_snapshot_reports_are_read_back_from_a_log():
    reports = parse_snapshot_reports(SNAPSHOT_LOG)
    assert sorted(reports) == ["fsdp_fsdp2_basics", "fsdp_ours_torch"]
    ours, fsdp2 = reports["fsdp_ours_torch"], reports["fsdp_fsdp2_basics"]
    assert (ours.peak_gb, ours.blocks, ours.before_recording_gb, ours.model_code_gb) == (3.5, 4, 2.0, 0.5)
    assert [g.site for g in ours.groups] == ["(allocated before recording)",
                                            "cs336_systems/parallel/fsdp/transport.py:126 _allocate",
                                            "cs336_basics/model.py:101 silu"]
    assert ours.gb_at("cs336_systems/parallel/fsdp") == 1.0 and ours.groups[2].mib_per_block == 0.25e9 / 2**20
    assert [(g.gb, g.blocks) for g in fsdp2.groups] == [(1.25, 1)] and fsdp2.before_recording_gb == 0.0


# What a reader of the repository cannot know: the task tracker's numbers, the project's internal spec and the
# targets set for the work. Lines that translate the old names found in measured rows are the one exception.
TRACKER_WORDS = re.compile(r"\bissue ?\d+|\bSPEC\b|\bgoals?\b|\bmilestone", re.IGNORECASE)
TRANSLATING_OLD_NAMES = ("RENAMED_FOLDERS = ",)
# Words of the work behind the results that a reader of the writeup does not have: stretches of work, throwaway
# scripts, the tools that lent the GPUs, a commit with a name for uncommitted changes, raw log lines.
READER_UNKNOWN_WORDS = re.compile(r"\bsessions?\d*\b|\bscratch\b|not measured yet|device tool|device time left"
                                  r"|\b[0-9a-f]{7}\+\w|fast_launch (True|False)", re.IGNORECASE)


def _writeup_sources() -> list[Path]:
    files = [WRITEUP / "writeup.typ", WRITEUP / "README.md", WRITEUP / "build.py",
             *(WRITEUP / "typ").glob("*.typ"), *(WRITEUP / "pipeline").rglob("*.py"),
             *(WRITEUP / "results").rglob("*.md")]
    return sorted(files)


def test_the_writeup_speaks_only_of_the_subject():
    found = []
    for path in _writeup_sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if TRACKER_WORDS.search(line) and not any(ok in line for ok in TRANSLATING_OLD_NAMES):
                found.append(f"{path.relative_to(WRITEUP.parent)}:{number}: {line.strip()}")
            if path.suffix == ".typ" and READER_UNKNOWN_WORDS.search(line):
                found.append(f"{path.relative_to(WRITEUP.parent)}:{number}: {line.strip()}")
    folders = [str(p.relative_to(WRITEUP.parent)) for p in (WRITEUP / "results").rglob("*")
               if p.is_dir() and TRACKER_WORDS.search(p.name.replace("-", " "))]
    assert not found and not folders, "\n".join(found + folders)


@pytest.mark.slow
def test_a_missing_results_file_fails_naming_it(tmp_path, fixture_results, capsys):
    results = tmp_path / "results"
    write_fixture(results, tmp_path / "row-figures")
    (results / "leaderboard.jsonl").unlink()
    (results / "ddp_benchmarking.jsonl").unlink()
    assert run_build(tmp_path, results) == 1
    err = capsys.readouterr().err
    # the optimisation log (from the probe outputs) also reads the leaderboard
    assert "leaderboard.jsonl" in err and re.search(r"\(needed by: [^)]*\bleaderboard\b", err)
    assert "ddp_benchmarking.jsonl" in err and "ddp_bucketed_benchmarking" in err
    assert not (tmp_path / "writeup.pdf").exists()

    # --allow-missing (drafts only) renders a MISSING box instead, and says so.
    assert run_build(tmp_path, results, "--allow-missing") == 0
    data = json.loads((tmp_path / "build" / "generated" / "data.json").read_text())
    assert data["allow_missing"] is True
    assert "leaderboard.jsonl" in data["sections"]["leaderboard"]["missing"]
    assert "missing" not in data["sections"]["benchmarking_script"]


H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


def planned_pairs() -> list[dict]:
    """Three invocations with the planner on 2 H200s and one on 2 H100s, as the official rows of one day: the first
    H200 pair ran one plan in both stacks (planned by an earlier model, whose prediction the rows record), the
    later ones kept more blocks whole and met allocator retries; a PyTorch row whose ours never came in between."""
    return [*leaderboard_2026_planned_pair(H200, "20261126T1713", {"pytorch": 5566.0, "ours": 4902.0},
                                           {"pytorch": 13, "ours": 13}, {"pytorch": 129.5, "ours": 127.0},
                                           predicted_gb=137.3),
            *leaderboard_2026_planned_pair(H200, "20261126T1720", {"pytorch": 5437.0, "ours": 5116.0},
                                           {"pytorch": 16, "ours": 17}, {"pytorch": 141.7, "ours": 143.1},
                                           retries=24),
            leaderboard_2026_planned_pair(H200, "20261126T1726", {"pytorch": 5000.0, "ours": 1.0},
                                          {"pytorch": 16, "ours": 17}, {"pytorch": 141.7, "ours": 143.1})[0],
            *leaderboard_2026_planned_pair(H100, "20261126T1735", {"pytorch": 5832.0, "ours": 5541.0},
                                           {"pytorch": 1, "ours": 1}, {"pytorch": 81.0, "ours": 78.5}, retries=48)]


def test_official_rows_pair_by_invocation_and_the_headline_is_the_newest_planned_h200_pair(tmp_path):
    from pipeline.sections.leaderboard_2026 import device_numbers, headline_pair, official_pairs, pair_numbers

    results = tmp_path / "results"
    write_fixture(results, tmp_path / "row-figures")
    with (results / "leaderboard_2026.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in planned_pairs())
    pairs = official_pairs(Results(results))
    # The fixture's pair from before the planner (ours first), then three: the lone PyTorch row is in none.
    assert [(p["ours"]["device"], p["ours"]["run"][:13]) for p in pairs] == [
        ("2x " + H200, "20261122T1600"), ("2x " + H200, "20261126T1714"), ("2x " + H200, "20261126T1721"),
        ("2x " + H100, "20261126T1736")]
    assert all(p["pytorch"]["run"] < p["ours"]["run"] for p in pairs[1:])
    # The H200s (the largest peaks) lead though the H100 pair is newer; of theirs the newest planned pair, whether
    # or not both stacks' planners chose the same plan.
    assert headline_pair(pairs) is pairs[2]
    assert headline_pair(pairs[:2]) is pairs[1]
    assert headline_pair([pairs[0], pairs[3]]) is pairs[3]
    assert headline_pair(pairs[:1]) is pairs[0]  # before the planner: the pair there is
    later = pair_numbers(pairs[2])
    assert (later["ours_plan"], later["torch_plan"], later["same_plan"]) == (
        "17 keep, 17 selective", "16 keep, 18 selective", False)
    assert (later["ratio"], later["margin"], later["ours_retries"], later["torch_retries"]) == (
        f"{5116 / 5437:.3f}×", "6.9", 24, 24)
    assert pair_numbers(pairs[1])["ours_retries"] is None and pair_numbers(pairs[1])["ours_predicted"] == "137.3"
    h200 = device_numbers(pairs[1:3], pairs[1])
    assert (h200["ratio_low"], h200["ratio_high"], h200["headline_fastest"]) == (
        f"{4902 / 5566:.3f}×", f"{5116 / 5437:.3f}×", True)
    # The other H200 pair: its ratio, its time (17:20) and each stack's blocks kept whole, PyTorch's first.
    assert numbers_in(h200["others"]) == [round(5116 / 5437, 3), 17, 20, 16, 17]
    assert re.findall(r"PyTorch|ours", h200["others"]) == ["PyTorch", "ours"]
    assert h200["others_keep_more"] and h200["others_all_retry"] and h200["others_retries"] == "24"
    assert not h200["headline_retries_recorded"] and h200["tflops_list"] == "700, 701, 700 and 701"


def split_row(stack: str, run: str, kept: int, wall_ms: float, **extra) -> dict:
    """A full-step split of ``stack`` (34 layers, 2 H200s) under a plan of ``kept`` blocks kept whole."""
    from tests._writeup_fixture import row

    split = {"matmul": 2100.0, "attention_forward": 510.0, "attention_backward": 1580.0, "recompute": 420.0,
             "elementwise": 190.0, "norms": 27.0, "loss": 8.0, "optimizer": 27.0, "exposed_communication": 22.0}
    modes = ["selective"] * (34 - kept) + ["keep"] * kept
    config = {"stack": stack, "parts": [], "layers": 34, "world_size": 2, "context_length": 32768,
              "batch_per_rank": 1, "checkpoint_option": "auto", "warmup_steps": 1, "profiled_steps": 1}
    measured = {"wall_ms": wall_ms, "split_ms": split, "communication_ms": 180.0, "idle_ms": 160.0,
                "gpu_ms": {"matmul": 2520.0}, "top_kernels": {}, "peak_gb": 127.0,
                "checkpoint_plan": {"describe": "...", "predicted_peak_gb": 137.3, "modes": modes}, **extra}
    r = row("leaderboard_2026_profile", config, measured, gpus=2, gpu=H200)
    return {**r, "run": run, "env": {**r["env"], "commit": "c0ffee0", "date": f"2026-11-26T{run[9:11]}:{run[11:13]}"}}


@pytest.mark.slow
def test_the_section_leads_with_the_newest_h200_pair_and_labels_every_plan(tmp_path):
    """The planned pairs over the fixture's rows from before the planner: the table shows every planned pair, the
    text leads with the newest planned H200 pair (each stack its own plan) and states the others; the split is ours
    under the headline's plan, with its idle stretches, and PyTorch's under another (its column says which)."""
    results = tmp_path / "results"
    write_fixture(results, tmp_path / "row-figures")
    with (results / "leaderboard_2026.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in planned_pairs())
    gaps = {"span_ms": 5000.0, "gaps_ms": 240.0, "gap_count": 1800,
            "largest": [{"ms": 111.5, "at_ms": 2009.0, "after": "copy", "before": "reduce_scatter"},
                        {"ms": 90.2, "at_ms": 1179.0, "after": "gemm", "before": "swiglu"},
                        {"ms": 17.9, "at_ms": 1354.0, "after": "fill", "before": "fill"}]}
    splits = [split_row("ours", "20261126T171559Z-b27d33", 13, 5033.0),
              split_row("pytorch", "20261126T171616Z-d2f7b1", 3, 5252.0),
              split_row("ours", "20261126T172315Z-d0c89a", 17, 5103.0, idle_gaps=gaps, allocator_events={
                  "num_alloc_retries": 2, "num_sync_all_streams": 2, "num_device_alloc": 115, "num_device_free": 25})]
    with (results / "leaderboard_2026_profile.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in splits)

    assert run_build(tmp_path, results) == 0
    lb = json.loads((tmp_path / "build" / "generated" / "data.json").read_text())["sections"]["leaderboard_2026"]
    n, main = lb["n"], lb["tables"]["main"]["rows"]
    assert (n["device"], n["ratio"], n["planned"], n["pairs"]["count_word"]) == ("2x " + H200, "0.94×", True, "Two")
    assert n["pairs"]["headline"]["time"] == "2026-11-26 17:20" and not n["pairs"]["headline"]["same_plan"]
    assert [(r[0], r[1], r[2], r[3]) for r in main] == [
        ("2x " + H200, "2026-11-26 17:13", "13 keep, 21 selective", "13 keep, 21 selective"),
        ("2x " + H200, "2026-11-26 17:20 (headline)", "17 keep, 17 selective", "16 keep, 18 selective"),
        ("2x " + H100, "2026-11-26 17:35", "1 keep, 33 selective", "1 keep, 33 selective")]
    assert main[0][10] == "– / –" and main[1][10] == "24 / 24"
    assert [(x["device"], x["ratio"]) for x in n["other_devices"]] == [("2x " + H100, f"{5541 / 5832:.3f}×")]
    assert (n["has_earlier"], [r[5] for r in lb["tables"]["earlier"]["rows"]]) == (True, ["1.250×"])
    stacks = {r[0]: r[1:] for r in lb["tables"]["stacks"]["rows"]}
    assert stacks["block_checkpointing"] == ["17 selective (0–16), 17 keep (17–33)",
                                            "18 selective (0–17), 16 keep (18–33)"]
    assert "keep_attention" not in stacks and "checkpointing" not in stacks
    # The first pair's prediction came from an earlier model; today's predicts the later rows' peaks (the lone
    # PyTorch row among them: every official row is in the plans table).
    claim = n["claim"]
    assert (claim["has_earlier_model"], claim["earlier_predicted"], claim["planned_rows"]) == (True, "137.3", "5")
    assert numbers_in(claim["earlier_measured"]) == [129.5, 127.0]  # the first pair's peaks
    assert re.findall(r"PyTorch|ours", claim["earlier_measured"]) == ["PyTorch", "ours"]
    memory = {r[0]: r[1:] for r in lb["tables"]["memory"]["rows"]}
    assert "predicted when planned (earlier model)" not in memory  # the headline's plans are today's model's
    # The split: ours under the headline's plan (the split that records idle stretches), PyTorch's under another.
    assert lb["tables"]["split"]["header"][0] == [
        "ms, rank 0", "ours: 17 keep, 17 selective (17:23)", "pytorch: 3 keep, 31 selective (17:16)"]
    split = n["split"]
    assert (split["plan"], split["all_match"]) == ("17 keep, 17 selective", False)
    assert numbers_in(split["mismatched"]) == [3, 31]  # PyTorch's split ran another plan: 3 blocks kept whole
    assert re.findall(r"PyTorch|ours", split["mismatched"]) == ["PyTorch"]
    assert (split["gap_1"], split["gap_2"], split["retries"], split["gaps_match_retries"]) == ("111.5", "90.2", "2", True)
    # The B200 on paper: the rates of ours under the headline's plan, against the headline's measured step.
    paper = n["paper"]
    assert (paper["measured_time"], paper["h200_plan"], paper["h200_measured"]) == (
        "2026-11-26 17:21", "17 keep, 17 selective", "5,116")


def test_the_section_builds_on_the_recorded_results(tmp_path):
    """The rows in writeup/results: the section builds, leads with a pair of its largest card, and its table holds
    that pair."""
    section, out = SECTIONS["leaderboard_2026"], Output(tmp_path / "figures", tmp_path / "build")
    lb = section(Results(WRITEUP / "results"), out)
    n = lb["n"]
    assert n["pairs"]["device"] == n["device"]
    assert any(r[1].endswith("(headline)") and r[0] == n["device"] for r in lb["tables"]["main"]["rows"])
    assert n["pairs"]["ratio_low"] <= n["pairs"]["headline"]["ratio"] <= n["pairs"]["ratio_high"]
    # Our step profiled with the gradient shards on each stream: the reduction stream's row first.
    rows = lb["tables"]["gradient_memory"]["rows"]
    assert [r[0] for r in rows] == ["reduction stream", "compute stream"]
    assert n["gradient_memory"]["has_gradient_memory"] and float(n["gradient_memory"]["gm_saved"]) > 0


def test_full_step_rates_from_a_split_and_from_kernels_by_name():
    from cs336_systems.bench.common.leaderboard_2026_model import MODEL, plan_flop_parts
    from pipeline.sections.leaderboard_2026_plans import full_step_rates

    selective = ("selective",) * 34
    split = {"matmul": 2000.0, "recompute": 500.0, "attention_forward": 400.0, "attention_backward": 1600.0,
             "elementwise": 300.0, "norms": 50.0, "loss": 10.0, "optimizer": 20.0, "exposed_communication": 40.0}
    rates = full_step_rates({"layers": 34, "split_ms": split}, selective)
    flop = plan_flop_parts(MODEL, 1, selective)
    assert rates["matmul_tflops"] == pytest.approx((flop["weights"] + flop["recompute_weights"]) / 2.5 / 1e12)
    assert rates["attention_tflops"] == pytest.approx(flop["attention"] / 2.0 / 1e12)
    assert (rates["memory_bound_ms"], rates["communication_ms"]) == (380.0, 40.0)  # the full step: nothing scaled
    # Four profiled blocks: the per-block kernels times 34 / 4, the optimizer and collectives by the parameters.
    gpu_ms = {"matmul": 250.0, "attention_forward": 50.0, "attention_backward": 200.0, "other": 40.0,
              "rmsnorm": 0.0, "cross_entropy": 10.0, "optimizer": 8.0, "collectives": 30.0}
    four = full_step_rates({"layers": 4, "gpu_ms": gpu_ms}, ("selective",) * 4)
    d, d_ff, vocab = MODEL["d_model"], MODEL["d_ff"], MODEL["vocab_size"]
    ratio = (34 * (4 * d * d + 3 * d * d_ff) + 2 * vocab * d) / (4 * (4 * d * d + 3 * d * d_ff) + 2 * vocab * d)
    assert four["memory_bound_ms"] == pytest.approx(40.0 * 34 / 4 + 10.0 + 8.0 * ratio)
    assert four["communication_ms"] == pytest.approx(30.0 * ratio)
    flop4 = plan_flop_parts({**MODEL, "num_layers": 4}, 1, ("selective",) * 4)
    assert four["matmul_tflops"] == pytest.approx((flop4["weights"] + flop4["recompute_weights"]) / 0.25 / 1e12)


def test_a_row_with_a_recorded_plan_shows_its_modes_and_its_prediction():
    from pipeline.sections.leaderboard_2026_plans import row_modes, row_plan

    modes = ["selective"] * 13 + ["keep"] * 21
    r = {"stack": "ours", "num_layers": 34, "context_length": 32768, "batch_size": 2, "world_size": 2,
         "parts": {"checkpointing": 0, "keep_attention": False, "block_checkpointing": modes},
         "checkpoint_plan": {"describe": "34 blocks: ...", "predicted_peak_gb": 170.0}, "peak_gb_ranks": [178.5, 170.0]}
    plan = row_plan(r)
    assert plan["modes"] == tuple(modes) and plan["recorded"]
    assert plan["label"] == "13 selective (0–12), 21 keep (13–33)"
    assert (plan["predicted_gb"], plan["measured_gb"]) == (170.0, 178.5) and plan["error"] == pytest.approx(0.05)
    # Before the plans: every block as the parts say (checkpointing 1; the attention output kept or not).
    old = {**r, "parts": {"checkpointing": 1, "keep_attention": False}, "checkpoint_plan": None}
    assert row_modes(old) == ("full",) * 34 and row_plan(old)["label"] == "34 full (from parts)"


def test_the_optimisation_log_and_the_probe_history_each_build_alone(tmp_path):
    results = tmp_path / "results"
    write_fixture(results, tmp_path / "row-figures")
    section, out = SECTIONS["flash_optimisation_log"], Output(tmp_path / "figures", tmp_path / "build")
    log = results / "flash_optimisation_log.jsonl"
    rows = log.read_text()
    shutil.rmtree(results / "flash_probe")
    (results / "leaderboard.jsonl").unlink()  # only the history reads it
    alone = section(Results(results), out)
    assert alone["n"]["has_log"] and not alone["n"]["has_history"] and list(alone["tables"]) == ["log"]
    log.unlink()
    with pytest.raises(Missing, match="flash_optimisation_log.jsonl"):
        section(Results(results), out)
    flash_probe(results)
    (results / "leaderboard.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fixture_leaderboard()))
    alone = section(Results(results), out)
    assert alone["n"]["has_history"] and not alone["n"]["has_log"] and list(alone["tables"]) == ["history"]
    # Without the log the history is not called earlier than it; it names the GPU of the leaderboard run.
    intro, gpu = alone["n"]["history_intro"], fixture_leaderboard()[0]["env"]["gpu_name"]
    assert alone["n"]["history_device"] == gpu and gpu in intro and not re.search(r"\blog\b", intro)
    log.write_text(rows.splitlines()[-1] + "\n")  # only a --set-decision row
    with pytest.raises(Missing, match="no measured step"):
        section(Results(results), out)


def test_the_optimisation_log_puts_its_working_words_as_what_they_measured():
    from pipeline.sections.beyond import plain_words, step_name
    from pipeline.sections.flash import commit_words

    note = plain_words("The final state of this session: the Hopper forward also at 128 programs (it beat the "
                       "Triton forward in a scratch bench: 0.195 vs 0.209 ms); 50.2 ms (scratch bench same session), "
                       "unlike the scratch bench; measured but lost to the device tool's file limit.")
    assert note == ("The Hopper forward also at 128 programs (it beat the Triton forward in a separate benchmark: "
                    "0.195 vs 0.209 ms); 50.2 ms (a separate benchmark on the same machine), unlike that separate "
                    "benchmark; measured but its output file was not kept.")
    assert not READER_UNKNOWN_WORDS.search(note)
    assert step_name("session6-triton-baseline") == "triton-baseline" and step_name("gluon-dq") == "gluon-dq"
    assert commit_words({"env": {"commit": "7df1472+fa3-order"}}) == "7df1472 with uncommitted changes"
    assert commit_words({"env": {"commit": "740b0f0abcdef"}}) == "740b0f0"


@pytest.mark.slow
def test_a_figure_named_by_a_row_must_exist(tmp_path, capsys):
    results = tmp_path / "results"
    write_fixture(results, tmp_path / "row-figures")
    (tmp_path / "row-figures" / "memory_2.7B_inference_fp32_ctx2048.png").unlink()
    _, missing = build.collect(Results(results), Output(tmp_path / "figures", tmp_path / "build"))
    assert [Path(error.path).name for error in missing.values()] == ["memory_2.7B_inference_fp32_ctx2048.png"]
    assert run_build(tmp_path, results) == 1
    assert "memory_2.7B_inference_fp32_ctx2048.png" in capsys.readouterr().err  # the message names it too


@pytest.mark.slow
def test_rows_without_a_measurement_name_the_file_the_column_and_the_section(tmp_path, capsys):
    """The rows a tool writes where it could not measure (e.g. the leaderboard on a CPU: an error, no times)."""
    results = tmp_path / "results"
    write_fixture(results, tmp_path / "row-figures")
    rows = [json.loads(line) for line in (results / "leaderboard.jsonl").read_text().splitlines()]
    for r in rows[1:]:
        del r["fwd_bwd_ms"]
        r["error"] = "RuntimeError: No viable backend for scaled_dot_product_attention was found."
    (results / "leaderboard.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, missing = build.collect(Results(results), Output(tmp_path / "figures", tmp_path / "build"))
    assert list(missing) == ["leaderboard"]
    assert missing["leaderboard"].path.endswith("leaderboard.jsonl")
    why = missing["leaderboard"].why
    assert "'fwd_bwd_ms'" in why and numbers_in(why)[:2] == [len(rows) - 1, len(rows)]  # rows without it, of all
    assert "No viable backend" in missing["leaderboard"].why
    assert run_build(tmp_path, results) == 1
    err = capsys.readouterr().err  # what the user reads
    assert "'fwd_bwd_ms'" in err and re.search(r"leaderboard\.jsonl.*\(needed by: leaderboard\)", err)


def test_a_section_failing_on_other_keys_names_the_section(tmp_path):
    results = tmp_path / "results"
    write_fixture(results, tmp_path / "row-figures")
    rows = [json.loads(line) for line in (results / "leaderboard.jsonl").read_text().splitlines()]
    for r in rows:
        r["fwd_bwd_ms"] = "fast"  # a measurement of another type
    (results / "leaderboard.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RuntimeError, match="section 'leaderboard'"):
        run_build(tmp_path, results)


def newest_kernel_rows(rows: list[dict]) -> dict[tuple, dict]:
    """The rmsnorm kernel rows of the current tool (with ``copy_share``), keyed (provider, pass, M, N, dtype), a
    later row of a case replacing an earlier one."""
    return {(r["provider"], r["pass"], r["rows"], r["cols"], r["dtype"]): r for r in rows if "copy_share" in r}


def ours_against_rivals(grid: dict[tuple, dict], dtype: str, pass_: str) -> dict[tuple[int, int], float]:
    """Per shape (M, N) of at least 16M elements: ours' GB/s over the fastest of compile and liger."""
    return {(m, n): r["gbps"] / max(grid[(p, pass_, m, n, dtype)]["gbps"] for p in ("compile", "liger"))
            for (provider, q, m, n, d), r in grid.items()
            if (provider, q, d) == ("ours", pass_, dtype) and m * n >= 1 << 24}


def check_against_item(item: str, ratios: dict[tuple[int, int], float]) -> None:
    """A dtype and pass's item: at how many shapes ours is at least as fast, of how many, then (none within 5 % in
    these rows) the shapes further behind, each with its ratio."""
    behind = sorted((shape, ratio) for shape, ratio in ratios.items() if ratio < 0.95)
    assert not [ratio for ratio in ratios.values() if 0.95 <= ratio < 1]
    expected = [sum(ratio >= 1 for ratio in ratios.values()), len(ratios)]
    for (m, n), ratio in behind:
        expected += [m, n, round(ratio, 2)]
    assert numbers_in(item) == expected


def test_rmsnorm_reads_only_the_newest_kernel_run_at_its_largest_row_count(fixture_data, fixture_results):
    """The fixture's earlier run (no copy_share, 9,999 GB/s) stays out; the table is bf16 at M = 65,536 with each
    provider's GB/s and share of the same run's copy; quack, never measured, is named as such."""
    section = fixture_data["rmsnorm"]
    n, rows = section["n"], section["tables"]["main"]["rows"]
    assert not n["pending"] and (n["m"], n["dtype"], n["dtypes"]) == ("65,536", "bf16", "bf16, fp32")
    assert n["providers"] == "ours, eager, compile, liger" and n["not_measured"] == "quack"
    assert section["tables"]["main"]["header"][0] == ["pass", "N", "copy", "ours", "eager", "compile", "liger"]
    assert [r[:4] for r in rows[:2]] == [["forward", "768", "2,500", "2,000 (80 %)"],
                                          ["forward", "8,192", "2,500", "2,200 (88 %)"]]
    assert rows[2][:4] == ["forward + backward", "768", "2,500", "1,600 (64 %)"]
    assert not any("9,999" in cell for r in rows for cell in r)
    grid = newest_kernel_rows(fixture_rows(fixture_results, "rmsnorm"))
    versus_eager = [grid[("ours", "fwd", 65536, c, "bf16")]["gbps"] / grid[("eager", "fwd", 65536, c, "bf16")]["gbps"]
                    for c in (768, 8192)]
    assert numbers_in(n["versus_eager_fwd"]) == printed_range(min(versus_eager), max(versus_eager), 2)
    assert "eager" in n["versus_eager_fwd"].split()
    # Ours is ahead of compile and liger everywhere; 65,536 × 8,192 is the one shape of at least 64M elements.
    assert (n["at_least"], n["cases"]) == (12, 12)
    items = n["against"]["items"]
    assert len(items) == len(n["copy_share"]) == 4
    for dtype in ("bf16", "fp32"):
        for pass_, name in (("fwd", "forward"), ("fwd_bwd", "forward + backward")):
            check_against_item(item_about(items, dtype, name), ours_against_rivals(grid, dtype, pass_))
            (share,) = [r["copy_share"] for (p, q, m, c, d), r in grid.items()
                        if (p, q, d) == ("ours", pass_, dtype) and m * c >= 1 << 26]
            assert numbers_in(item_about(n["copy_share"], dtype, name)) == [round(100 * share)]
    assert n["rival_share_fwd"] == {"range": "79 %", "median": "79 %"}  # liger: 1,800 × 1.1 of 2,500
    assert section["figures"]["main"]["path"] == "figures/rmsnorm_grid.png"


def section_built(tmp_path: Path, name: str, **edits) -> dict:
    """Section ``name`` built from the fixture, each ``problem=edit`` replacing ``problem``'s rows by
    ``edit(rows)``."""
    results = tmp_path / "results"
    write_fixture(results, tmp_path / "row-figures")
    for problem, edit in edits.items():
        path = results / f"{problem}.jsonl"
        rows = edit([json.loads(line) for line in path.read_text().splitlines()])
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return SECTIONS[name](Results(results), Output(tmp_path / "figures", tmp_path / "build"))


def in_run(row: dict, run: str, date: str, commit: str) -> dict:
    """``row`` as measured by another invocation of its tool, on ``date`` at ``commit``."""
    return {**row, "run": run, "env": {**row["env"], "date": date, "commit": commit}}


def _rmsnorm_with(tmp_path: Path, edit) -> dict:
    return section_built(tmp_path, "rmsnorm", rmsnorm=edit)


def _kernel_row(rows: list[dict], provider: str, pass_: str, m: int, n: int, dtype: str) -> dict:
    (found,) = [r for r in rows if "copy_share" in r and (r["provider"], r["pass"], r["rows"], r["cols"], r["dtype"])
                == (provider, pass_, m, n, dtype)]
    return found


def test_rmsnorm_against_the_faster_rival_takes_the_newest_row_of_a_case_in_the_run(tmp_path):
    """A case measured again later in the same run (a second launch continuing it): the newer row counts, whether
    it is newer by date or, at the same date, by its place in the file. Compile measured again at 2,600 GB/s at
    65,536 × 8,192 fp32 forward puts ours (2,200) behind it there: 0.85, named with its shape."""

    def edit(rows):
        first = _kernel_row(rows, "compile", "fwd", 65536, 8192, "fp32")
        later = {**first, "gbps": 2600.0, "env": {**first["env"], "date": "2026-11-26T16:30:00Z"}}
        same_date = {**_kernel_row(rows, "liger", "fwd_bwd", 65536, 768, "bf16"), "gbps": 1900.0}
        return rows + [later, same_date]

    section = _rmsnorm_with(tmp_path, edit)
    n, against = section["n"], section["tables"]["against"]
    assert (n["at_least"], n["cases"]) == (10, 12)
    fp32_forward = [r for r in against["rows"] if r[:3] == ["fp32", "forward", "65,536"]]
    assert fp32_forward == [["fp32", "forward", "65,536", "1.11", "0.85"]]
    grid = newest_kernel_rows(fixture_rows(tmp_path / "results", "rmsnorm"))  # as edited
    forward = ours_against_rivals(grid, "fp32", "fwd")
    assert forward[(65536, 8192)] == pytest.approx(2200 / 2600)
    check_against_item(item_about(n["against"]["items"], "fp32", "forward"), forward)
    # ours 1,600 GB/s against liger's 1,900 measured again: 0.84.
    both = ours_against_rivals(grid, "bf16", "fwd_bwd")
    assert both[(65536, 768)] == pytest.approx(1600 / 1900)
    check_against_item(item_about(n["against"]["items"], "bf16", "forward + backward"), both)
    assert (n["against"]["far"], n["against"]["far_unsteady"]) == (2, 0)
    # The grid at the largest M shows the newer compile row too.
    main = {(r[0], r[1]): r for r in section["tables"]["main"]["rows"]}
    assert main[("forward", "8,192")][5] == "1,650 (66 %)"  # bf16, untouched


def test_rmsnorm_copy_share_quotes_the_unsteady_shapes_apart(tmp_path):
    """At 64M elements and more, where the lowest shares of the copy bandwidth all come with unsteady times (20th
    to 80th percentile over 5 % of the median), they are named apart from the steady ones."""

    def edit(rows):
        extra = []
        for cols, share, p20, p80 in ((2048, 0.95, 0.99, 1.01), (4096, 0.5, 0.8, 1.2)):
            for r in (_kernel_row(rows, "copy", "copy", 65536, 8192, "bf16"),
                      _kernel_row(rows, "ours", "fwd_bwd", 65536, 8192, "bf16")):
                extra.append({**r, "cols": cols, "ms": 1.0, "ms_p20": p20, "ms_p80": p80,
                              **({"gbps": 2500.0 * share, "copy_share": share} if r["provider"] == "ours" else {})})
        return rows + extra

    n = _rmsnorm_with(tmp_path, edit)["n"]
    # The steady shares (the fixture's 65,536 × 8,192 at 1,760 of 2,500 GB/s, 2,048's 0.95) at 2 of 3 shapes, the
    # unsteady one (4,096's 0.5) apart, with its shape and its time's 20th to 80th percentile over the median (0.4).
    share = item_about(n["copy_share"], "bf16", "forward", "+", "backward")
    assert numbers_in(share) == [round(100 * 1760 / 2500), 95, 2, 3, 50, 1, 65536, 4096, 40]


def fixture_rows(results: Path, problem: str) -> list[dict]:
    """The rows the fixture wrote to ``problem``'s results file, in file order."""
    return [json.loads(line) for line in (results / f"{problem}.jsonl").read_text().splitlines()]


def residual_launches(results: Path) -> dict[str, list[dict]]:
    """The training step's launches with the residual adds separate and fused, each choice in file order."""
    rows = [r for r in fixture_rows(results, "train_step") if "residual_norm" in r]
    return {choice: [r for r in rows if r["residual_norm"] == choice] for choice in ("separate", "fused")}


def residual_noise(launches: list[dict]) -> float:
    """A choice's noise: its launches' spread (largest over smallest median), or with one launch its step-to-step
    standard deviation over the median."""
    medians = [r["median_ms"] for r in launches]
    return max(medians) / min(medians) - 1 if len(medians) > 1 else launches[0]["std_ms"] / medians[0]


def check_residual_step(step: dict, launches: dict[str, list[dict]], noise_from: str, outcome: str) -> None:
    """``step`` quotes each choice's medians and deviations from its rows, the change of the median step from
    separate to fused, the larger of the two choices' noise, and judges the change against that noise."""
    for choice, rows in launches.items():
        assert numbers_in(step[choice]) == [r["median_ms"] for r in rows]
        assert numbers_in(step[f"{choice}_std"]) == pytest.approx([r["std_ms"] for r in rows], abs=0.05)
    median = {choice: statistics.median(r["median_ms"] for r in rows) for choice, rows in launches.items()}
    change = median["fused"] / median["separate"] - 1
    noise = max(residual_noise(rows) for rows in launches.values())
    assert numbers_in(step["change"]) == pytest.approx([100 * abs(change)], abs=0.05)
    assert step["change"].endswith("slower" if change > 0 else "faster")
    assert numbers_in(step["noise"])[:1] == pytest.approx([100 * noise], abs=0.05)
    assert (step["noise_from"], step["outcome"]) == (noise_from, outcome)


def test_residual_norm_table_and_step_come_from_the_rows(fixture_data, fixture_results):
    """The fused add + norm against the add then the norm, per shape and stream, from residual_norm_timing rows;
    the training step's launches from train_step rows with residual_norm (two alternating launches each)."""
    section = fixture_data["rmsnorm"]
    rows = section["tables"]["residual"]["rows"]
    assert [r[:2] for r in rows] == [["16,384 × 1,600", "bf16"], ["16,384 × 1,600", "fp32"],
                                     ["65,536 × 1,280", "bf16"], ["65,536 × 1,280", "fp32"],
                                     ["32,768 × 4,096", "bf16"], ["32,768 × 4,096", "fp32"]]
    assert rows[0][2:] == ["0.210", "0.200", "1.05", "0.525", "0.500", "1.05"]
    assert rows[3][2:] == ["0.140", "0.200", "0.70", "0.350", "0.500", "0.70"]
    r = section["n"]["residual"]
    kernel = fixture_rows(fixture_results, "residual_norm_timing")
    # At the shapes of at least 64M elements: fused over separate, and the saving that is.
    large = [k["fused_over_separate"] for k in kernel if k["n_rows"] * k["d_model"] >= 1 << 26]
    assert numbers_in(r["large_ratio"]) == pytest.approx([min(large), max(large)])
    assert numbers_in(r["large_saving"]) == pytest.approx([100 * (1 - max(large)), 100 * (1 - min(large))])
    # The smaller shape (16,384 × 1,600): each stream's ratio per pass, bf16 first, and where fused is slower.
    small = [k for k in kernel if k["n_rows"] * k["d_model"] < 1 << 26]
    assert {(k["n_rows"], k["d_model"]) for k in small} == {(16384, 1600)}
    by_stream = sorted(small, key=lambda k: (k["stream_dtype"] != "bf16", k["pass"] != "forward"))
    assert numbers_in(r["small"]) == [16384, 1600, *[k["fused_over_separate"] for k in by_stream]]
    assert re.findall(r"bf16|fp32", r["small"]) == ["bf16", "fp32"]
    slower = {k["stream_dtype"] for k in small if k["fused_over_separate"] > 1}
    assert slower == {"bf16"}
    assert numbers_in(r["small_slower"]) == [16384, 1600] and set(re.findall(r"bf16|fp32", r["small_slower"])) == slower
    # The training step: one configuration, as its rows give it.
    launches = residual_launches(fixture_results)
    (step,) = r["steps"]
    first = launches["separate"][0]
    assert numbers_in(step["setup"]) == [first["context_length"], first["batch_size"]]
    assert not first["parts"].get("cudagraphs")  # said as "without" CUDA graphs
    assert {first["size"], first["dtype"], "without"} <= set(re.findall(r"[\w.]+", step["setup"]))
    # medians 111.0 and 113.5: 2.3 % slower; the fused launches differ by 8.3 %, more than the change
    check_residual_step(step, launches, noise_from="launches", outcome="tie")


def test_residual_step_with_one_launch_a_choice_judges_by_the_step_noise(tmp_path):
    """With one launch of each choice (separate 112, fused 118 ms; step-to-step deviation 2 % of the median) the
    noise is that deviation, and a 5.4 % difference is a loss."""
    results = tmp_path / "results"
    write_fixture(results, tmp_path / "row-figures")
    path = results / "train_step.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("median_ms") not in (110.0, 109.0)
                            or "residual_norm" not in r))
    section = SECTIONS["rmsnorm"](Results(results), Output(tmp_path / "figures", tmp_path / "build"))
    (step,) = section["n"]["residual"]["steps"]
    launches = residual_launches(results)
    assert [len(launches[c]) for c in ("separate", "fused")] == [1, 1]
    check_residual_step(step, launches, noise_from="steps", outcome="loss")


def test_residual_step_with_one_choice_launched_once_takes_the_larger_noise(tmp_path):
    """Separate launched twice (112, 110 ms: 1.8 % apart), fused once (118 ms, deviation 2 % of the median): the
    noise is the larger, 2.0 %, and the 6.3 % difference a loss."""
    results = tmp_path / "results"
    write_fixture(results, tmp_path / "row-figures")
    path = results / "train_step.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("median_ms") != 109.0
                            or "residual_norm" not in r))
    section = SECTIONS["rmsnorm"](Results(results), Output(tmp_path / "figures", tmp_path / "build"))
    (step,) = section["n"]["residual"]["steps"]
    launches = residual_launches(results)
    assert [len(launches[c]) for c in ("separate", "fused")] == [2, 1]
    assert residual_noise(launches["fused"]) > residual_noise(launches["separate"])  # the larger noise is the step's
    check_residual_step(step, launches, noise_from="launches_and_steps", outcome="loss")


def test_rmsnorm_grid_is_pending_without_a_run_of_the_current_tool(tmp_path):
    """Rows of earlier versions of the tool only (no copy_share): the section builds, says pending, draws nothing
    (the residual add fused in, from rows of its own, still has its table)."""
    results = tmp_path / "results"
    write_fixture(results, tmp_path / "row-figures")
    path = results / "rmsnorm.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if "copy_share" not in r))
    section = SECTIONS["rmsnorm"](Results(results), Output(tmp_path / "figures", tmp_path / "build"))
    assert section["n"]["pending"] and list(section["tables"]) == ["residual"] and section["figures"] == {}
    (model,) = [r for r in rows if r.get("part") == "model"]  # one norm only: its row is described
    assert numbers_in(section["n"]["model"]) == [model["context_length"], model["mean_ms"]]
    assert {model["norm"], model["size"], model["dtype"]} <= set(re.findall(r"[\w.]+", section["n"]["model"]))
    assert not (tmp_path / "figures" / "rmsnorm_grid.png").exists()


def test_every_section_has_a_typst_body_and_the_reverse():
    typst = "".join(path.read_text() for path in (WRITEUP / "typ").glob("*.typ") if path.name != "lib.typ")
    in_typst = re.findall(r'#problem\("([^"]+)"', typst)
    assert sorted(in_typst) == sorted(SECTIONS)
    assert len(in_typst) == len(set(in_typst))


@pytest.mark.slow
def test_the_committed_results_build(tmp_path):
    """The sections whose results are committed build from them (others may still be missing)."""
    assert run_build(tmp_path, WRITEUP / "results", "--allow-missing") == 0
    data = json.loads((tmp_path / "build" / "generated" / "data.json").read_text())["sections"]
    tracker = [text for text in _strings(data) if TRACKER_WORDS.search(text)]
    assert not tracker, f"tracker words in the generated text: {tracker[:3]}"
    unknown = [match.group(0) for text in _strings(data) for match in READER_UNKNOWN_WORDS.finditer(text)]
    assert not unknown, f"words the reader does not have in the generated text: {unknown}"
    for name, section in data.items():
        if "missing" not in section:
            continue
        file = re.match(r"\S+", section["missing"]).group(0)
        assert not (WRITEUP.parent / file).exists(), f"{name}: {file} exists but the section failed: {section}"


# -----------------------------------------------------------------------------------------------
# Reading results
# -----------------------------------------------------------------------------------------------


def test_latest_row_per_configuration_wins():
    def r(value, date):
        return {"run": date, "x": 1, "v": value, "config_keys": ["x"], "device": "d", "env": {"date": date}}

    rows = latest_per_config([r(1, "2026-01-02"), r(2, "2026-01-03"), r(3, "2026-01-01")])
    assert [row["v"] for row in rows] == [2]


def test_environment_line_names_device_versions_date_and_commit():
    rows = [{"env": {"device": "1x H100", "torch": "2.11", "triton": "3.6", "cuda": "13.0",
                     "date": "2026-11-22T10:00:00Z", "commit": "abcdef123456"}},
            {"env": {"device": "1x H100", "torch": "2.11", "triton": "3.6", "cuda": "13.0",
                     "date": "2026-11-23T10:00:00Z", "commit": "abcdef123456"}}]
    line = environment_line(rows)
    assert line == "1x H100 · torch 2.11 · Triton 3.6 · CUDA 13.0 · 2026-11-22 to 2026-11-23 · commit abcdef1"


# -----------------------------------------------------------------------------------------------
# Derivations
# -----------------------------------------------------------------------------------------------


def test_communication_accounting_numbers():
    a = accounting.communication_accounting()
    assert a["params"] == 126 * 2 * 16384 * 53248 == 219_848_638_464
    assert a["state_bytes"] == 16 * a["params"]
    assert math.ceil(a["state_h100"]) == 44  # 3.52 TB / 80 GB
    assert a["n_min"] == 38  # 3.52 TB / 95 GB = 37.03
    assert a["alpha"] == pytest.approx(4.6e14 / 1.8e11)
    assert a["per_device_batch"] == pytest.approx(4.6e14 / 1.8e11 / 2 / 4)  # alpha / (M_X Y) = 319.4
    assert a["global_batch"] == pytest.approx(a["per_device_batch"] * 64)
    assert a["act_per_token"] == 126 * (16384 + 53248) * 2


def test_optimal_bucket_minimises_the_overhead_model():
    s, w, o = 8e9, 100e9, 50e-6
    best = accounting.optimal_bucket(s, w, o)
    brute = min((accounting.ddp_overhead(s, w, o, n), n) for n in [x / 10 for x in range(10, 20000)])
    assert best["n_buckets"] == pytest.approx(brute[1], rel=1e-2)
    assert best["overhead"] == pytest.approx(brute[0], rel=1e-4)
    assert best["bucket_bytes"] == pytest.approx(math.sqrt(s * w * o))


def test_latency_and_bandwidth_fit_recovers_a_known_line():
    sizes = [1e6, 1e7, 1e8, 1e9]
    o, w = 30e-6, 150e9
    assert accounting.fit_latency_bandwidth(sizes, [o + s / w for s in sizes]) == pytest.approx((o, w), rel=1e-6)


def test_parameter_counts_match_the_readme():
    from cs336_basics.model import MODEL_SIZES

    assert accounting.parameter_count(vocab_size=10_000, **MODEL_SIZES["xl"]) == pytest.approx(1_998.2e6, rel=1e-4)
    assert accounting.parameter_count(vocab_size=10_000, **MODEL_SIZES["2.7B"]) == pytest.approx(3_406.8e6, rel=1e-4)


def test_naive_attention_accounting_and_first_failure():
    need = accounting.naive_attention_memory(8, 16384, 64, 3.0)
    assert need["score_matrix_bytes"] == 8 * 16384**2 * 4
    assert need["saved_bytes"] > 3 * need["score_matrix_bytes"]
    # 3 saved + 2 backward score-sized matrices of 8.6 GB fit in 80 GB at 16K, not at 32K.
    assert accounting.first_oom_length(16384, 8, 3.0, 80.0) == 32768
    assert accounting.device_memory_gb([{"error": "GPU 0 has a total capacity of 79.18 GiB of which"}]) == \
        pytest.approx(79.18 * 2**30 / 1e9)


def test_adamw_bytes_per_parameter():
    assert accounting.adamw_bytes_per_param(4, 4, 4) == 28
    assert accounting.adamw_bytes_per_param(2, 2, 4) == 22  # ours on bf16 parameters: float32 moments
    assert accounting.adamw_bytes_per_param(2, 2, 2) == 14  # PyTorch's: moments in the parameters' dtype


def test_checkpointing_peak_model():
    assert accounting.checkpoint_activation_bytes(48, 0, 0.1, 1.0) == 48
    assert accounting.checkpoint_activation_bytes(48, 4, 0.1, 1.0) == pytest.approx(12 * 0.1 + 4)
    assert accounting.checkpoint_activation_bytes(48, 5, 0.1, 1.0) == pytest.approx(10 * 0.1 + 5)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_sharding_rows_keep_their_optimizer_kind():
    from pipeline.sections.sharding import optimizer_kind

    names = ["adamw", "sharded", "zero_redundancy", "zero1_flat"]
    assert [optimizer_kind(name) for name in names] == names  # zero1_flat is not ZeroRedundancyOptimizer


def test_flash_shapes_rows_are_labelled_by_the_backends_that_ran():
    from pipeline.sections.flash import backends_label

    assert backends_label({"provider": "sdpa", "kernels": "auto"}) == "SDPA (cuDNN)"
    same = {"forward": "triton, d 80", "backward": "triton, d 80"}
    assert backends_label({"provider": "ours", "kernels": "auto", "backends": same}) == \
        "ours, portable kernels at d 80"
    mixed = {"forward": "triton, d 80", "backward": "hopper, d 128"}
    assert backends_label({"provider": "ours", "kernels": "auto", "backends": mixed}) == \
        "ours, forward portable kernels at d 80, backward Hopper kernels at d 128"
    assert backends_label({"provider": "ours", "kernels": "triton"}) == "ours (triton)"  # rows that do not say


def test_model_shapes_table_takes_each_familys_newest_row_over_cudnn_of_its_commit(tmp_path):
    """The models' attention table at one head dim: the newest date's rows, each kernel family's newest row per shape,
    each part over cuDNN timed at the same commit; the long-context shapes of the same file left out."""
    from pipeline.sections.flash import _model_shapes

    def bench(provider, shape, fwd, bwd, commit, date="2026-11-27"):
        backends = {"forward": "hopper, d 64", "backward": "hopper, d 64"} if provider == "ours" else None
        return {"provider": provider, "kernels": "auto", "backends": backends, "shape": shape, "fwd_ms": fwd,
                "bwd_ms": bwd, "fwd_bwd_ms": fwd + bwd, "device": "GPU", "date": date, "commit": commit}

    rows = [bench("ours", [4, 25, 2048, 64], 9.0, 9.0, "old", date="2026-11-26"),  # an older date: left out
            bench("sdpa", [4, 25, 2048, 64], 0.15, 0.45, "a"), bench("ours", [4, 25, 2048, 64], 0.18, 0.45, "a"),
            bench("sdpa", [4, 25, 2048, 64], 0.10, 0.40, "b"), bench("ours", [4, 25, 2048, 64], 0.15, 0.42, "b"),
            bench("sdpa", [4, 25, 512, 64], 0.02, 0.18, "b"), bench("ours", [4, 25, 512, 64], 0.03, 0.45, "b"),
            bench("sdpa", [16, 1, 16384, 64], 1.3, 3.3, "b"), bench("ours", [16, 1, 16384, 64], 1.2, 3.4, "b")]
    (tmp_path / "flash_shapes_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    found, n = _model_shapes(Results(tmp_path), 64)
    shapes = [line[1] for line in found["rows"]]
    assert "16 × 1 × 16384 × 64" not in shapes and len(shapes) == 4  # cuDNN and ours at 512 and 2048, commit b
    assert n["long_fwd_ms"] == "1.50×" and n["long_bwd_ms"] == "1.05×"  # over commit b's cuDNN, not a's
    assert n["short_fwd_bwd_ms"] == "2.40×"
    assert _model_shapes(Results(tmp_path), 80) is None


def test_fsdp_settings_list_every_launch_of_a_repeated_setting():
    from pipeline.sections.sharding import fsdp_settings

    def step(impl, ms, steps=20, date="2026-11-26T22:00"):
        return {"measure": "step", "impl": impl, "world_size": 4, "device": "4x GPU", "checkpointing": 1,
                "step_ms": ms, "peak_gb": 9.0, "steps": steps, "env": {"date": date}}

    history = [step("fsdp2", 800.0), step("ours", 560.0), step("ours", 600.0, steps=10),  # another protocol
               step("ours", 540.0), step("fsdp2", 600.0)]
    newest = [history[3], history[4]]
    (setting,) = fsdp_settings(newest, history)
    assert setting["step_ratio"] == pytest.approx(0.9)
    assert setting["launch_ratios"] == pytest.approx([0.7, 0.9])  # paired in file order, the 10-step row left out
    assert fsdp_settings(newest)[0]["launch_ratios"] == []  # no history: only the newest launch is known


def test_bucketed_trace_reads_each_ranks_phases():
    from pipeline.sections.ddp import rank_phases

    ranks = [{"span_ms": 503.0, "forward_ms": 131.9, "backward_ms": 286.9, "compute_busy_ms": 263.0,
              "comm_busy_ms": 315.6},
             {"span_ms": 520.9, "forward_ms": 175.6, "backward_ms": 276.5, "compute_busy_ms": 234.8,
              "comm_busy_ms": 31.6}]
    row = {"trace_ranks": ranks, "bucket_mb": 100.0, "step_ms": 324.4, "exposed_ms": 15.2, "exposed_share": 0.047,
           "device": "4x NVIDIA H200"}
    phases = rank_phases(row)
    assert phases["forward"] == ["131.9", "175.6"] and phases["comm"] == ["315.6", "31.6"]
    assert (phases["bucket_mb"], phases["device"], phases["share"]) == ("100", "H200 host of 4", "5 %")
    assert rank_phases(dict(row, trace_ranks=ranks[:1])) == {"has": False} and rank_phases(None) == {"has": False}


def test_train_step_cases_take_the_newest_row_whether_or_not_it_names_the_residual_norm(tmp_path):
    """A row that says residual_norm='separate' and a newer one from before that key existed describe the same
    stack: the case takes the newer one."""
    from pipeline.sections.train_step import load_train_step
    from tests._writeup_fixture import row

    def step_row(ms: float, date: str, **extra) -> dict:
        config = {"size": "xl", "context_length": 2048, "batch_size": 4, "stack": "ours", "variant": "cudagraphs",
                  "overrides": [], **extra}
        r = row("train_step", config, {"step_ms": ms, "oom": False})
        r["env"]["date"], r["run"] = date, f"{date}-run"
        return r

    # File order as it happened: an older row without the key first, so the newest one takes its place in the list
    rows = [step_row(247.3, "2026-11-25T13:41:10Z"), step_row(244.2, "2026-11-26T15:58:12Z", residual_norm="separate"),
            step_row(247.2, "2026-11-26T21:05:38Z")]
    (tmp_path / "train_step.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (case,) = load_train_step(Results(tmp_path)).values()
    assert case[("ours", "cudagraphs")]["step_ms"] == 247.2


def test_fsdp_check_text_groups_ranks_and_judges_old_rows_by_the_present_bound():
    from cs336_systems.bench.fsdp_accounting import CHECK_LR, weight_tolerance
    from pipeline.sections.sharding import fsdp_check_and_timeline

    def check(world, dtype, diff, grad, exact, passed, tolerance):
        return {"measure": "check", "world_size": world, "dtype": dtype, "device": "4x NVIDIA H200", "backend": "nccl",
                "size": "tiny", "context_length": 64, "steps": 3, "max_abs_diff": diff, "grad_max_abs_diff": grad,
                "bit_exact": exact, "passed": passed, "tolerance": tolerance}

    checks = [check(4, "fp32", 1.58e-6, 9.3e-10, False, False, 1e-6), check(2, "fp32", 0.0, 0.0, True, True, 1e-6),
              check(4, "bf16", 3e-3, 1e-5, False, False, 1e-4)]
    n = fsdp_check_and_timeline(checks, [])
    # Grouped by ranks, fewest first: 2 ranks bit-exact; at 4, fp32 over its run's bound but within the present one,
    # bf16 over both.
    assert [(o["world"], o["dtype"], o["outcome"]) for o in n["check_outcomes"]] == [
        (2, "fp32", "bit_exact"), (4, "fp32", "within_present_bound"), (4, "bf16", "failed")]
    on_two, on_four = n["check"].split("; ")
    assert numbers_in(on_two) == [2] and "fp32" in on_two  # bit-exact: no difference to quote
    present = weight_tolerance("fp32", 4, CHECK_LR)
    assert f"{present:.0e}" == "2e-05"
    fp32, bf16 = checks[0], checks[2]

    def printed(x: float) -> float:  # a difference as the text prints it, to two significant figures
        return float(f"{x:.1e}")

    assert numbers_in(on_four) == [4, printed(fp32["max_abs_diff"]), fp32["steps"], printed(fp32["grad_max_abs_diff"]),
                                   fp32["tolerance"], 4, present, printed(bf16["max_abs_diff"]), bf16["steps"],
                                   printed(bf16["grad_max_abs_diff"])]
    assert on_four.index("fp32") < on_four.index("bf16")
    assert n["check_rounding"]  # the fp32 row at 4 ranks: within the present bound, not bit-exact
    # A failure alone is not put down to the summation order
    assert not fsdp_check_and_timeline([checks[2], checks[1]], [])["check_rounding"]
    # Two ranks keep the tight fp32 bound: the same difference there fails
    (alone,) = fsdp_check_and_timeline([check(2, "fp32", 1.58e-6, 9.3e-10, False, False, 1e-6)], [])["check_outcomes"]
    assert alone["outcome"] == "failed"


def test_fsdp_settings_keep_the_longest_launch_over_a_later_shorter_one():
    from pipeline.sections.sharding import fsdp_settings

    def step(impl, ms, steps, date):
        return {"measure": "step", "impl": impl, "world_size": 4, "device": "4x GPU", "checkpointing": 0,
                "step_ms": ms, "peak_gb": 25.0, "steps": steps, "env": {"date": date}}

    history = [step("fsdp2", 510.0, 20, "22:03"), step("ours", 378.0, 20, "22:04"),
               step("fsdp2", 555.0, 5, "22:39"), step("ours", 331.0, 5, "22:40")]  # a memory snapshot's run
    (setting,) = fsdp_settings(history[2:], history)  # the newest row of each configuration, as the file gives
    assert (setting["steps"], setting["step_ratio"]) == (20, pytest.approx(378.0 / 510.0))
    other_model = [dict(r, context_length=1024, steps=40) for r in history[:2]]  # longer, but another model
    (setting,) = fsdp_settings(history[2:], other_model + history)
    assert (setting["steps"], setting["step_ratio"]) == (20, pytest.approx(378.0 / 510.0))


def test_no_semicolon_is_swallowed_after_an_embedded_expression():
    """In Typst markup a ``;`` right after ``#name`` or ``#name.field`` (or after a ``#if [...]`` block) ends the
    expression and is not printed: it must be written ``\\;``."""
    pattern = re.compile(r"(?<!\\)#[A-Za-z_][\w.]*;|\];")
    found = [f"{path.name}:{number}: {line.strip()}" for path in sorted((WRITEUP / "typ").glob("*.typ"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line) and not line.lstrip().startswith(("#let", "//"))]
    assert not found, found
