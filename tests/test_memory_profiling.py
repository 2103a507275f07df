"""The memory snapshot's readings (largest allocations and where they come from, what each allocation holds, the
active-memory timeline, its picture and PyTorch's viewer page) on made-up snapshots in the format
``torch.cuda.memory._snapshot()`` returns, ``memory_profiling --render`` on a pickled one, and the tool's choice of
cases (which contexts get a timeline, out of memory as a row) with the measurements replaced."""

from __future__ import annotations

import base64
import inspect
import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from cs336_basics import model as basics
from cs336_basics import nn_utils, optimizer
from cs336_systems.bench import memory_profiling
from cs336_systems.bench.common import memory, result_store
from cs336_systems.bench.common.lm import LMConfig

MIB = 2**20


def frame_in(function, offset: int = 1) -> dict:
    """A stack frame on the ``offset``-th line of ``function``'s source, as the allocator records it."""
    function = inspect.unwrap(function)
    lines, first = inspect.getsourcelines(function)
    return {"filename": "/repo/cs336-basics/" + "/".join(Path(inspect.getsourcefile(function)).parts[-2:]),
            "line": first + offset, "name": function.__name__}


def text(frame: dict) -> str:
    return f"cs336_basics/{Path(frame['filename']).name}:{frame['line']} {frame['name']}"


TORCH_LINEAR = {"filename": "/venv/lib/python3.11/site-packages/torch/functional.py", "line": 407, "name": "einsum"}
MODULE_CALL = {"filename": "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", "line": 1775,
               "name": "_call_impl"}
SCORES = frame_in(basics.scaled_dot_product_attention, 6)
CAUSAL = frame_in(basics.causal_attention, 6)
ATTENTION = frame_in(basics.CausalMultiHeadSelfAttention.forward, 10)
SILU = frame_in(basics.silu)
LINEAR = frame_in(basics.Linear.forward)
SWIGLU = frame_in(basics.SwiGLU.forward)
WEIGHT_INIT = frame_in(basics.Linear.__init__, 4)
SOFTMAX = frame_in(nn_utils.softmax, 2)
ADAMW = frame_in(optimizer.AdamW.step, 12)
LOSS = frame_in(nn_utils.cross_entropy, 2)
HARNESS = {"filename": "/repo/cs336_systems/bench/common/lm.py", "line": 99, "name": "forward"}
TORCH_ONLY = {"filename": "/venv/lib/python3.11/site-packages/torch/optim/adamw.py", "line": 12, "name": "step"}


def event(action: str, addr: int, size: int, time_us: int, frames: list[dict]) -> dict:
    return {"action": action, "addr": addr, "size": size, "time_us": time_us, "stream": 0, "frames": frames}


def snapshot_of(trace: list[dict], live_blocks: list[tuple[int, str]], block_frames: list[dict] | None = None) -> dict:
    """A snapshot whose one segment holds ``live_blocks`` (requested bytes, state) at the dump."""
    blocks = [{"address": 0, "size": size, "requested_size": size, "state": state, "frames": block_frames or []}
              for size, state in live_blocks]
    return {"segments": [{"device": 0, "address": 0, "total_size": 2**34, "stream": 0, "segment_type": "large",
                          "allocated_size": 0, "active_size": 0, "blocks": blocks}],
            "device_traces": [trace]}


def forward_snapshot() -> dict:
    """Two attention-score matrices (128 MiB, made in scaled_dot_product_attention under torch's einsum) and one
    feed-forward activation (80 MiB), over 1 GiB of weights allocated before the recording, of which 8 MiB are freed
    during it."""
    scores = [TORCH_LINEAR, SCORES, CAUSAL, ATTENTION, HARNESS]
    trace = [
        event("alloc", 0x1000, 128 * MIB, 0, scores),
        event("alloc", 0x2000, 80 * MIB, 1_000, [SILU, SWIGLU, HARNESS]),
        event("free_requested", 0x1000, 128 * MIB, 1_500, scores),
        event("free_completed", 0x1000, 128 * MIB, 2_000, scores),
        event("alloc", 0x3000, 128 * MIB, 3_000, scores),
        event("free_completed", 0x9000, 8 * MIB, 4_000, []),  # a weight allocated before the recording
        event("alloc", 0x4000, 1 * MIB, 5_000, [TORCH_ONLY]),
        event("segment_alloc", 0x0, 2 * 1024 * MIB, 5_500, []),
    ]
    live = [(1016 * MIB, "active_allocated"), (80 * MIB, "active_allocated"), (128 * MIB, "active_pending_free"),
            (1 * MIB, "active_allocated"), (64 * MIB, "inactive")]
    return snapshot_of(trace, live)


def training_snapshot() -> dict:
    """A training step recorded from the model's construction: a 64 MiB weight, a forward activation, the backward's
    gradient of that weight (no Python frame, the weight's size) and an activation gradient, then AdamW's state."""
    trace = [
        event("alloc", 0x1, 64 * MIB, 0, [TORCH_LINEAR, WEIGHT_INIT, HARNESS]),
        event("alloc", 0x2, 32 * MIB, 1_000, [LINEAR, MODULE_CALL, SWIGLU, HARNESS]),
        event("alloc", 0x3, 64 * MIB, 2_000, []),
        event("alloc", 0x4, 16 * MIB, 2_500, []),
        event("free_completed", 0x4, 16 * MIB, 2_700, []),
        event("free_completed", 0x2, 32 * MIB, 3_000, []),
        event("alloc", 0x5, 64 * MIB, 4_000, [ADAMW, HARNESS]),
    ]
    return {"device_traces": [trace]}


def test_largest_allocations_give_size_count_category_innermost_model_frame_and_call_chain():
    largest = memory.largest_allocations(forward_snapshot())
    assert [(a["mb"], a["count"]) for a in largest] == [(128.0, 2), (80.0, 1), (1.0, 1)]
    scores = largest[0]
    # The innermost frame of the model, not torch's einsum inside it, nor the harness around it.
    assert scores["source"] == text(SCORES)
    harness = "cs336_systems/bench/common/lm.py:99 forward"
    assert scores["stack"] == [text(SCORES), text(CAUSAL), text(ATTENTION), harness]
    assert scores["category"] == "attention: scores, mask"
    assert largest[1]["category"] == "feed-forward (SwiGLU)"
    # No frame of ours: the innermost Python frame, torch's, named from the package root.
    assert largest[2]["source"] == "torch/optim/adamw.py:12 step" and largest[2]["category"] == memory.OTHER
    assert memory.largest_allocations(forward_snapshot(), top=1) == largest[:1]


def test_an_allocation_without_python_frames_is_named_so():
    snapshot = snapshot_of([event("alloc", 0x1, 256 * MIB, 0, [])], [(256 * MIB, "active_allocated")])
    assert memory.largest_allocations(snapshot)[0]["source"] == memory.NO_PYTHON_FRAME


def test_same_size_from_two_places_are_two_entries():
    trace = [event("alloc", 0x1, 80 * MIB, 0, [SILU]), event("alloc", 0x2, 80 * MIB, 1, [SCORES]),
             event("alloc", 0x3, 80 * MIB, 2, [SCORES])]
    largest = memory.largest_allocations(snapshot_of(trace, []))
    assert [(a["source"], a["count"]) for a in largest] == [(text(SCORES), 2), (text(SILU), 1)]


@pytest.mark.parametrize("frames, category", [
    ([TORCH_LINEAR, WEIGHT_INIT], memory.WEIGHTS),
    ([frame_in(basics.RotaryEmbedding.__init__, 5)], memory.WEIGHTS),
    # A projection counts for the module that calls Linear.forward.
    ([LINEAR, MODULE_CALL, SWIGLU], "feed-forward (SwiGLU)"),
    ([LINEAR, MODULE_CALL, ATTENTION], "attention: Q, K, V, output projections"),
    ([LINEAR, frame_in(basics.BasicsTransformerLM.forward)], "LM head: logits"),
    ([SOFTMAX, SCORES, ATTENTION], "attention: softmax"),
    ([frame_in(basics.RMSNorm.forward, 3)], "RMSNorm"),
    ([frame_in(basics.RotaryEmbedding.forward, 2), ATTENTION], "attention: RoPE"),
    ([frame_in(basics.TransformerBlock.forward)], "residual adds"),
    ([frame_in(nn_utils.log_softmax, 2), LOSS], "loss"),
    ([ADAMW, HARNESS], memory.OPTIMIZER_STATE),
    ([HARNESS], memory.OTHER),
    ([TORCH_ONLY], memory.OTHER),
])
def test_what_an_allocation_holds_comes_from_its_innermost_model_function_with_a_category(frames, category):
    assert memory.allocation_category(frames) == category


def test_in_the_backward_a_parameters_size_is_a_gradient_and_any_other_a_temporary():
    sizes = frozenset({64 * MIB})
    assert memory.allocation_category([], 64 * MIB, sizes) == memory.GRADIENTS
    assert memory.allocation_category([], 32 * MIB, sizes) == memory.BACKWARD
    # The weights' sizes: from the trace's allocations and from blocks alive at the dump (weights made before it).
    assert memory.gradient_sizes(training_snapshot()) == {64 * MIB}
    before = snapshot_of([], [(48 * MIB, "active_allocated")], block_frames=[WEIGHT_INIT])
    assert memory.gradient_sizes(before) == {48 * MIB}


def test_function_at_reads_the_qualified_name_from_the_source_and_falls_back_to_the_frame_name():
    assert memory.function_at("cs336_basics/model.py", SWIGLU["line"], "forward") == "SwiGLU.forward"
    assert memory.function_at("cs336_basics/model.py", 1, "<module>") == "<module>"
    assert memory.function_at("cs336_basics/not_there.py", 10, "forward") == "forward"


def test_timeline_starts_from_the_memory_alive_before_the_recording():
    snapshot = forward_snapshot()
    # Alive at the dump (inactive blocks are cached, not alive): 1016 + 80 + 128 + 1 MiB; the trace added
    # 128 + 80 - 128 + 128 - 8 + 1 = 201 MiB, so 1024 MiB were alive before it.
    assert memory.preexisting_bytes(snapshot) == 1024 * MIB
    timeline = memory.active_memory_timeline(snapshot)
    mib = [round(gb * 1e9 / MIB) for gb in timeline.total_gb]
    assert mib == [1152, 1232, 1104, 1232, 1224, 1225]
    assert timeline.times_ms == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert timeline.peak_gb == pytest.approx(1232 * MIB / 1e9) and timeline.before_gb == pytest.approx(1024 * MIB / 1e9)
    bands = {name: [round(v * 1e9 / MIB) for v in values] for name, values in timeline.bands.items()}
    assert list(bands) == [memory.PREEXISTING, "attention: scores, mask", "feed-forward (SwiGLU)", memory.OTHER]
    assert bands[memory.PREEXISTING] == [1024, 1024, 1024, 1024, 1016, 1016]
    assert bands["attention: scores, mask"] == [128, 128, 0, 128, 128, 128]
    assert bands["feed-forward (SwiGLU)"] == [0, 80, 80, 80, 80, 80]
    assert bands[memory.OTHER] == [0, 0, 0, 0, 0, 1]
    # The bands add up to the total at every event.
    assert all(sum(b[i] for b in bands.values()) == mib[i] for i in range(len(mib)))
    at_peak = {name: round(gb * 1e9 / MIB) for name, gb in timeline.at_peak().items()}
    assert at_peak == {memory.PREEXISTING: 1024, "attention: scores, mask": 128, "feed-forward (SwiGLU)": 80}


def test_timeline_of_a_training_step_separates_weights_gradients_backward_temporaries_and_optimizer_state():
    timeline = memory.active_memory_timeline(training_snapshot())
    bands = {name: [round(v * 1e9 / MIB) for v in values] for name, values in timeline.bands.items()}
    assert bands == {memory.WEIGHTS: [64] * 7, memory.OPTIMIZER_STATE: [0] * 6 + [64],
                     memory.GRADIENTS: [0, 0, 64, 64, 64, 64, 64], "feed-forward (SwiGLU)": [0, 32, 32, 32, 32, 0, 0],
                     memory.BACKWARD: [0, 0, 0, 16, 0, 0, 0]}
    assert list(bands) == [n for n in memory.CATEGORY_COLOURS if n in bands]  # drawn in the fixed order


def test_a_snapshot_without_segments_starts_from_zero():
    trace = [event("alloc", 0x1, 2_000_000_000, 0, [SCORES]), event("alloc", 0x2, 1_000_000_000, 1000, []),
             event("free_completed", 0x1, 2_000_000_000, 2000, [SCORES])]
    timeline = memory.active_memory_timeline({"device_traces": [trace]})
    assert timeline.total_gb == [2.0, 3.0, 1.0] and timeline.times_ms == [0.0, 1.0, 2.0]


def test_the_y_axis_starts_above_the_weights_only_where_they_are_most_of_the_peak():
    forward = memory.active_memory_timeline(forward_snapshot())
    bottom, top = memory.y_range(forward)
    # 1024 MiB alive before the recording, the peak 208 MiB above it: the axis starts a tenth of that below them.
    assert bottom == pytest.approx((1024 - 20.8) * MIB / 1e9) and top == pytest.approx((1232 + 20.8) * MIB / 1e9)
    training = memory.active_memory_timeline(training_snapshot())
    assert memory.y_range(training)[0] == 0.0


def test_compact_snapshot_keeps_the_events_and_shares_repeated_stacks():
    snapshot = forward_snapshot()
    compact = memory.compact_snapshot(snapshot, depth=2)
    before, after = snapshot["device_traces"][0], compact["device_traces"][0]
    assert [{k: v for k, v in e.items() if k != "frames"} for e in after] == \
           [{k: v for k, v in e.items() if k != "frames"} for e in before]
    assert after[0]["frames"] == [TORCH_LINEAR, SCORES]  # the innermost two
    assert after[0]["frames"] is after[2]["frames"]  # one object, written once by pickle
    # nn.Module's call wrappers are dropped.
    wrapped = memory.compact_snapshot({"device_traces": [[event("alloc", 1, 1, 0, [LINEAR, MODULE_CALL, SWIGLU])]]})
    assert wrapped["device_traces"][0][0]["frames"] == [LINEAR, SWIGLU]
    assert len(compact["segments"][0]["blocks"]) == 5 and compact["segments"][0]["device"] == 0


def embedded_snapshot(page: str) -> dict:
    """The snapshot inside a viewer page (base64 of its pickle, zero-padded to a multiple of three bytes)."""
    files = json.loads(re.search(r"const local_files = (\[.*\])", page).group(1))
    return pickle.loads(base64.b64decode(files[0]["base64"]).rstrip(b"\x00"))


def test_the_viewer_page_embeds_the_compacted_snapshot_and_is_written_up_to_the_limit(tmp_path):
    snapshot = forward_snapshot()
    page = memory.viewer_html(snapshot)
    assert "Active Memory Timeline" in page and "MemoryViz.js" in page
    assert embedded_snapshot(page) == memory.compact_snapshot(snapshot)
    size = memory.write_viewer_html(snapshot, tmp_path / "page.html")
    assert (tmp_path / "page.html").stat().st_size == size
    assert memory.write_viewer_html(snapshot, tmp_path / "small.html", limit=size - 1) == size
    assert not (tmp_path / "small.html").exists()


def test_render_draws_a_pickled_snapshot_and_its_viewer_page(tmp_path, capsys):
    path = tmp_path / "memory_test_inference_fp32_ctx16.pickle"
    with open(path, "wb") as file:
        pickle.dump(forward_snapshot(), file)
    memory_profiling.main(["--render", str(path), "--figures-dir", str(tmp_path / "figures")])
    figure = tmp_path / "figures" / "memory_test_inference_fp32_ctx16.png"
    assert figure.stat().st_size > 10_000
    assert (tmp_path / "figures" / "memory_test_inference_fp32_ctx16.html").exists()
    printed = capsys.readouterr().err
    assert f"128.0 MiB x   2  {text(SCORES)}" in printed


def test_the_inference_step_runs_under_inference_mode_and_the_training_step_records_autograd():
    config = LMConfig("tiny", context_length=16, batch_size=2)
    seen = {}
    for mode in ("inference", "forward", "train_step"):
        state, step = memory_profiling.profiled_step(config, mode, "fp32", torch.device("cpu"))
        state["model"].register_forward_hook(
            lambda *_, mode=mode: seen.__setitem__(mode, torch.is_inference_mode_enabled()))
        step()
        assert (state["optimizer"] is not None) == (mode == "train_step")
    assert seen == {"inference": True, "forward": False, "train_step": False}


def fake_recording(monkeypatch, snapshot: dict) -> dict:
    """Replace the CUDA recording (it needs a GPU) by running what it records and returning ``snapshot``; returns
    what was recorded: the pickle's path, the steps run and whether the model was built inside the recording."""
    recorded = {"steps": 0, "recording": False}
    build = memory_profiling.profiled_step

    def counted_build(*args):
        recorded["built_inside"] = recorded["recording"]
        state, step = build(*args)

        def counted_step():
            recorded["steps"] += recorded["recording"]
            step()

        return state, counted_step

    def record(fn, path, device):
        recorded.update(path=path, recording=True)
        fn()
        recorded["recording"] = False
        return snapshot

    monkeypatch.setattr(memory_profiling, "profiled_step", counted_build)
    monkeypatch.setattr(memory_profiling, "record_snapshot", record)
    return recorded


@pytest.mark.parametrize("mode, passes", [("inference", 1), ("train_step", 2)])
def test_timeline_case_records_few_passes_and_writes_the_figure_the_page_and_the_row(tmp_path, monkeypatch, mode,
                                                                                       passes):
    recorded = fake_recording(monkeypatch, forward_snapshot())
    config = LMConfig("tiny", context_length=16, batch_size=2)
    row = memory_profiling.timeline_case(config, mode, "bf16", torch.device("cpu"), tmp_path / "snaps", tmp_path)
    name = f"memory_tiny_{mode}_bf16_ctx16"
    assert recorded["path"] == tmp_path / "snaps" / f"{name}.pickle" and recorded["steps"] == passes
    assert recorded["built_inside"] == (mode == "train_step")  # a training step is recorded from construction on
    assert row["snapshot"] == f"{name}.pickle" and row["steps_recorded"] == passes
    assert row["figure"].endswith(f"{name}.png") and (tmp_path / f"{name}.png").exists()
    assert row["html"].endswith(f"{name}.html") and (tmp_path / f"{name}.html").stat().st_size == row["html_bytes"]
    assert row["timeline_peak_gb"] == pytest.approx(1232 * MIB / 1e9)
    assert row["peak_by_category_gb"]["attention: scores, mask"] == pytest.approx(128 * MIB / 1e9)
    assert row["largest_allocations"][0]["source"] == text(SCORES)
    assert "html_note" not in row


def test_a_viewer_page_over_the_limit_is_not_written_and_the_row_says_how_to_make_it(tmp_path, monkeypatch):
    fake_recording(monkeypatch, forward_snapshot())
    config = LMConfig("tiny", context_length=16, batch_size=2)
    row = memory_profiling.timeline_case(config, "inference", "fp32", torch.device("cpu"), tmp_path / "snaps",
                                         tmp_path, html_limit_bytes=100)
    assert row["html"] is None and row["html_bytes"] > 100 and not list(tmp_path.glob("*.html"))
    assert "--render" in row["html_note"] and "memory_tiny_inference_fp32_ctx16.pickle" in row["html_note"]


def run_args(tmp_path, *extra: str):
    return memory_profiling.parser().parse_args(["--results-dir", str(tmp_path), "--figures-dir", str(tmp_path),
                                                 "--contexts", "128", "2048", *extra])


def test_out_of_memory_is_a_peak_row_and_timelines_take_the_longest_context_that_fits_per_case(tmp_path, monkeypatch):
    def peak(config, mode, dtype, device):
        if config.context_length == 2048 and mode != "inference":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"peak_gb": 1.0, "params_gb": 0.5}

    timelines = []
    monkeypatch.setattr(memory_profiling, "measure_peak", peak)
    monkeypatch.setattr(memory_profiling, "timeline_case",
                        lambda config, mode, dtype, *rest: timelines.append((mode, dtype, config.context_length)) or {})
    args = run_args(tmp_path)
    store = result_store.ResultStore(memory_profiling.PROBLEM, tmp_path)
    memory_profiling.record_peaks(args, store, "2.7B", torch.device("cpu"))
    rows = [r for r in store.rows() if r["kind"] == "peak"]
    assert len(rows) == 12
    assert {(r["context_length"], r["mode"]) for r in rows if r["oom"]} == {(2048, "forward"), (2048, "train_step")}
    assert all("out of memory" in r["error"] for r in rows if r["oom"])
    memory_profiling.record_timelines(args, store, "2.7B", torch.device("cpu"), tmp_path)
    assert timelines == [("inference", "fp32", 2048), ("inference", "bf16", 2048), ("forward", "fp32", 128),
                         ("train_step", "fp32", 128)]


def test_residual_rows_carry_their_kind_and_an_out_of_memory_is_a_row(tmp_path, monkeypatch):
    def residuals(config, dtype, device):
        if config.context_length == 2048 and dtype == "fp32":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return {"residual_bytes": 10}

    monkeypatch.setattr(memory_profiling, "measure_residuals", residuals)
    store = result_store.ResultStore(memory_profiling.PROBLEM, tmp_path)
    memory_profiling.record_residuals(run_args(tmp_path), store, "2.7B", torch.device("cpu"))
    rows = store.rows()
    assert {(r["context_length"], r["dtype"], r["oom"]) for r in rows} == {
        (128, "fp32", False), (128, "bf16", False), (2048, "fp32", True), (2048, "bf16", False)}
    assert {r["kind"] for r in rows} == {"block_residuals"} and "mode" not in rows[0]["config_keys"]
