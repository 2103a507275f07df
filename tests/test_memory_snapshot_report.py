"""``scripts/memory_snapshot_report.py`` on made-up snapshots in the allocator's format (no GPU)."""

from __future__ import annotations

import inspect
import pickle
import runpy
import subprocess
import sys
from pathlib import Path

from cs336_basics.model import Linear

SCRIPT = Path(__file__).parents[1] / "scripts" / "memory_snapshot_report.py"
report = runpy.run_path(str(SCRIPT))

MODEL = [{"filename": "/x/cs336_basics/model.py", "line": 44, "name": "forward"},
         {"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}]
OPTIM = [{"filename": "/x/site-packages/torch/optim/adamw.py", "line": 9, "name": "_multi_tensor_adamw"}]


def snapshot(trace: list[dict], active_at_dump: list[int]) -> dict:
    blocks = [{"size": size, "state": "active_allocated"} for size in active_at_dump]
    return {"segments": [{"device": 0, "blocks": blocks + [{"size": 7, "state": "inactive"}]}],
            "device_traces": [trace]}


def alloc(addr: int, size: int, frames=MODEL) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def free(addr: int, size: int) -> dict:
    return {"action": "free_completed", "addr": addr, "size": size}


def test_the_peak_and_what_is_live_then_by_allocation_site():
    # 100 bytes allocated before recording and alive throughout; the peak (100 + 30 + 20 + 50 = 200) comes when the
    # optimizer's temporary joins two activations; one activation is freed before it, one after.
    trace = [alloc(1, 30), alloc(2, 20), alloc(3, 5), free(3, 5), alloc(4, 50, OPTIM), free(4, 50), free(1, 30),
             free(2, 20)]
    peak, blocks = report["live_at_peak"](snapshot(trace, [100]))
    assert peak == 200
    assert sorted(blocks) == sorted([(30, "cs336_basics/model.py:44 forward"), (20, "cs336_basics/model.py:44 forward"),
                                     (50, "torch/optim/adamw.py:9 _multi_tensor_adamw"),
                                     (100, "(allocated before recording)")])


def test_blocks_freed_during_the_recording_count_as_allocated_before_it():
    """A block allocated before recording and freed during it has only its free event: the total at the start of
    the recording includes it."""
    trace = [free(9, 40), alloc(1, 50)]  # 100 before recording, 60 after the free, 110 at the peak
    peak, blocks = report["live_at_peak"](snapshot(trace, [60, 50]))
    assert peak == 110 and sorted(blocks) == [(50, "cs336_basics/model.py:44 forward"),
                                              (60, "(allocated before recording)")]


def test_command_line_prints_the_groups(tmp_path):
    path = tmp_path / "snapshot.pickle"
    with open(path, "wb") as f:
        pickle.dump(snapshot([alloc(1, 2_000_000_000), alloc(2, 1_000_000_000, OPTIM)], [2_000_000_000, 1_000_000_000]),
                    f)
    out = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, check=True).stdout
    assert "peak of the recorded step 3.00 GB in 2 blocks" in out
    lines = out.splitlines()[2:]
    assert lines[0].split()[:2] == ["2.000", "1"] and lines[0].endswith("cs336_basics/model.py:44 forward")


def test_grouped_by_what_the_memory_holds(tmp_path):
    """The same replay grouped by category: a block made in a model ``__init__`` holds weights, the backward's
    frameless blocks of a weight's size are gradients, other frameless ones temporaries, torch's own code other."""
    _, first = inspect.getsourcelines(Linear.__init__)
    weight = [{"filename": "/x/cs336_basics/model.py", "line": first + 3, "name": "__init__"}]
    trace = [alloc(1, 64, weight), alloc(2, 64, []), alloc(3, 16, []), alloc(4, 8, OPTIM)]
    peak, blocks = report["live_at_peak"](snapshot(trace, [64, 64, 16, 8]), by="category")
    assert peak == 152
    assert sorted(blocks) == [(8, "other"), (16, "backward: activation gradients, temporaries"),
                              (64, "gradients (parameters')"), (64, "weights")]
    path = tmp_path / "snapshot.pickle"
    with open(path, "wb") as f:
        pickle.dump(snapshot(trace, [64, 64, 16, 8]), f)
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), "--by", "category"], capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines()[1].split() == ["GB", "blocks", "holds"]
    assert out.splitlines()[2].split()[1:] in (["1", "weights"], ["1", "gradients", "(parameters')"])
