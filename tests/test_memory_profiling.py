"""The memory snapshot's readings (largest allocations and where they come from, the active-memory timeline and
its picture) on made-up snapshots in the format ``torch.cuda.memory._snapshot()`` returns, and
``memory_profiling --render`` on a pickled one."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from cs336_systems.bench import memory_profiling
from cs336_systems.bench.common import memory
from cs336_systems.bench.common.lm import LMConfig

MIB = 2**20
TORCH_LINEAR = {"filename": "/venv/lib/python3.11/site-packages/torch/functional.py", "line": 407, "name": "einsum"}
SCORES = {"filename": "/repo/cs336-basics/cs336_basics/model.py", "line": 122, "name": "scaled_dot_product_attention"}
ATTENTION = {"filename": "/repo/cs336-basics/cs336_basics/model.py", "line": 250, "name": "forward"}
FFN = {"filename": "/repo/cs336-basics/cs336_basics/model.py", "line": 99, "name": "silu"}
HARNESS = {"filename": "/repo/cs336_systems/bench/common/lm.py", "line": 99, "name": "forward"}
TORCH_ONLY = {"filename": "/venv/lib/python3.11/site-packages/torch/optim/adamw.py", "line": 12, "name": "step"}


def event(action: str, addr: int, size: int, time_us: int, frames: list[dict]) -> dict:
    return {"action": action, "addr": addr, "size": size, "time_us": time_us, "stream": 0, "frames": frames}


def snapshot_of(trace: list[dict], live_blocks: list[tuple[int, str]]) -> dict:
    """A snapshot whose one segment holds ``live_blocks`` (requested bytes, state) at the dump."""
    blocks = [{"address": 0, "size": size, "requested_size": size, "state": state, "frames": []}
              for size, state in live_blocks]
    return {"segments": [{"device": 0, "address": 0, "total_size": 2**34, "stream": 0, "segment_type": "large",
                          "allocated_size": 0, "active_size": 0, "blocks": blocks}],
            "device_traces": [trace]}


def forward_snapshot() -> dict:
    """Two attention-score matrices (128 MiB, made in model.py:122 under torch's einsum) and one FFN activation
    (80 MiB), over 1 GiB of weights allocated before the recording, of which 8 MiB are freed during it."""
    scores = [TORCH_LINEAR, SCORES, ATTENTION, HARNESS]
    trace = [
        event("alloc", 0x1000, 128 * MIB, 0, scores),
        event("alloc", 0x2000, 80 * MIB, 1_000, [FFN, HARNESS]),
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


def test_largest_allocations_give_size_count_innermost_model_frame_and_call_chain():
    largest = memory.largest_allocations(forward_snapshot())
    assert [(a["mb"], a["count"]) for a in largest] == [(128.0, 2), (80.0, 1), (1.0, 1)]
    scores = largest[0]
    # The innermost frame of the model, not torch's einsum inside it, nor the harness around it.
    assert scores["source"] == "cs336_basics/model.py:122 scaled_dot_product_attention"
    assert scores["stack"] == ["cs336_basics/model.py:122 scaled_dot_product_attention",
                               "cs336_basics/model.py:250 forward", "cs336_systems/bench/common/lm.py:99 forward"]
    # No frame of ours: the innermost Python frame, torch's, named from the package root.
    assert largest[2]["source"] == "torch/optim/adamw.py:12 step"
    assert memory.largest_allocations(forward_snapshot(), top=1) == largest[:1]


def test_an_allocation_without_python_frames_is_named_so():
    snapshot = snapshot_of([event("alloc", 0x1, 256 * MIB, 0, [])], [(256 * MIB, "active_allocated")])
    assert memory.largest_allocations(snapshot)[0]["source"] == memory.NO_PYTHON_FRAME


def test_same_size_from_two_places_are_two_entries():
    trace = [event("alloc", 0x1, 80 * MIB, 0, [FFN]), event("alloc", 0x2, 80 * MIB, 1, [SCORES]),
             event("alloc", 0x3, 80 * MIB, 2, [SCORES])]
    largest = memory.largest_allocations(snapshot_of(trace, []))
    assert [(a["source"].split(" ")[0], a["count"]) for a in largest] == [("cs336_basics/model.py:122", 2),
                                                                            ("cs336_basics/model.py:99", 1)]


def test_timeline_starts_from_the_memory_alive_before_the_recording():
    snapshot = forward_snapshot()
    # Alive at the dump (inactive blocks are cached, not alive): 1016 + 80 + 128 + 1 MiB; the trace added
    # 128 + 80 - 128 + 128 - 8 + 1 = 201 MiB, so 1024 MiB were alive before it.
    assert memory.preexisting_bytes(snapshot) == 1024 * MIB
    timeline = memory.active_memory_timeline(snapshot)
    gib = [round(gb * 1e9 / MIB) for gb in timeline.total_gb]
    assert gib == [1152, 1232, 1104, 1232, 1224, 1225]
    assert timeline.times_ms == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert timeline.peak_gb == pytest.approx(1232 * MIB / 1e9)
    bands = {name: [round(v * 1e9 / MIB) for v in values] for name, values in timeline.bands.items()}
    assert bands[memory.PREEXISTING] == [1024, 1024, 1024, 1024, 1016, 1016]
    assert bands["cs336_basics/model.py:122 scaled_dot_product_attention"] == [128, 128, 0, 128, 128, 128]
    assert bands["cs336_basics/model.py:99 silu"] == [0, 80, 80, 80, 80, 80]
    assert bands["other"] == [0, 0, 0, 0, 0, 1]  # alive only after the peak: not among the named bands
    # The bands add up to the total at every event.
    assert all(sum(b[i] for b in bands.values()) == gib[i] for i in range(len(gib)))


def test_a_snapshot_without_segments_starts_from_zero():
    trace = [event("alloc", 0x1, 2_000_000_000, 0, [SCORES]), event("alloc", 0x2, 1_000_000_000, 1000, []),
             event("free_completed", 0x1, 2_000_000_000, 2000, [SCORES])]
    timeline = memory.active_memory_timeline({"device_traces": [trace]})
    assert timeline.total_gb == [2.0, 3.0, 1.0] and timeline.times_ms == [0.0, 1.0, 2.0]


def test_render_draws_a_pickled_snapshot(tmp_path, capsys):
    path = tmp_path / "memory_test_inference_fp32_ctx16.pickle"
    with open(path, "wb") as file:
        pickle.dump(forward_snapshot(), file)
    memory_profiling.main(["--render", str(path), "--figures-dir", str(tmp_path / "figures")])
    figure = tmp_path / "figures" / "memory_test_inference_fp32_ctx16.png"
    assert figure.stat().st_size > 10_000
    printed = capsys.readouterr().err
    assert "128.0 MiB x   2  cs336_basics/model.py:122 scaled_dot_product_attention" in printed


def test_the_inference_step_runs_under_inference_mode_and_the_training_step_records_autograd():
    config = LMConfig("tiny", context_length=16, batch_size=2)
    seen = {}
    for mode in ("inference", "forward", "train_step"):
        state, step = memory_profiling.profiled_step(config, mode, "fp32", torch.device("cpu"))
        state["model"].register_forward_hook(lambda *_, mode=mode: seen.__setitem__(mode, torch.is_inference_mode_enabled()))
        step()
        assert (state["optimizer"] is not None) == (mode == "train_step")
    assert seen == {"inference": True, "forward": False, "train_step": False}


def test_timeline_case_writes_the_figure_and_the_row_of_a_recorded_snapshot(tmp_path, monkeypatch):
    """The recording itself needs CUDA: here it runs the steps and returns a made-up snapshot."""
    recorded = {}

    def record(fn, path, device):
        recorded["path"] = path
        fn()
        return forward_snapshot()

    monkeypatch.setattr(memory_profiling, "record_snapshot", record)
    config = LMConfig("tiny", context_length=16, batch_size=2)
    row = memory_profiling.timeline_case(config, "inference", "bf16", torch.device("cpu"), tmp_path / "snaps", tmp_path)
    assert recorded["path"] == tmp_path / "snaps" / "memory_tiny_inference_bf16_ctx16.pickle"
    assert row["snapshot"] == "memory_tiny_inference_bf16_ctx16.pickle"
    assert row["figure"].endswith("memory_tiny_inference_bf16_ctx16.png") and (tmp_path / Path(row["figure"]).name).exists()
    assert row["timeline_peak_gb"] == pytest.approx(1232 * MIB / 1e9)
    assert row["largest_allocations"][0]["source"] == "cs336_basics/model.py:122 scaled_dot_product_attention"
