"""What is live at the peak of a CUDA memory snapshot (``torch.cuda.memory._dump_snapshot``), grouped by where it
was allocated.

The allocator's trace (``device_traces``) is replayed from the start of the recording; blocks already live when
recording began (``segments`` minus what the trace frees first) count as "before recording". At the moment the
allocated total peaks, the live blocks are grouped by their innermost frame in this project or in the model code
(``cs336_systems``, ``cs336_basics``), else in ``torch/distributed`` or ``torch/optim``, else their innermost frame.

    python scripts/memory_snapshot_report.py snapshots/fsdp_ours_torch.pickle [--top 15]
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict

OWN = ("cs336_systems", "cs336_basics")
TORCH_PARTS = ("torch/distributed", "torch/optim", "torch/utils/checkpoint", "torch/autograd")


def origin(frames: list[dict]) -> str:
    """``file:line function`` of the most telling frame of an allocation's stack."""
    def label(frame: dict) -> str:
        path = frame.get("filename", "?")
        for marker in OWN + ("torch/",):
            if marker in path:
                path = path[path.index(marker):]
                break
        return f"{path}:{frame.get('line', '?')} {frame.get('name', '?')}"

    for wanted in (OWN, TORCH_PARTS):
        for frame in frames:
            if any(part in frame.get("filename", "") for part in wanted):
                return label(frame)
    return label(frames[0]) if frames else "(no stack)"


def live_at_peak(snapshot: dict, device: int = 0) -> tuple[int, list[tuple[int, str]]]:
    """The peak of allocated bytes over the trace and the ``(size, origin)`` of every block live then.

    The total at the start of the recording is the total at the dump (the snapshot's active blocks) less what the
    trace allocated plus what it freed; blocks allocated before recording show as one group."""
    trace = [e for e in snapshot["device_traces"][device] if e["action"] in ("alloc", "free_completed")]
    at_dump = sum(block["size"] for segment in snapshot["segments"] if segment.get("device", device) == device
                  for block in segment["blocks"] if block["state"] == "active_allocated")
    total = at_dump - sum(e["size"] for e in trace if e["action"] == "alloc") + sum(
        e["size"] for e in trace if e["action"] == "free_completed")
    live: dict[int, tuple[int, str]] = {}
    peak, peak_live, peak_traced = total, {}, 0
    traced = 0
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], origin(event.get("frames", [])))
            total += event["size"]
            traced += event["size"]
            if total > peak:
                peak, peak_live, peak_traced = total, dict(live), traced
        else:
            total -= event["size"]
            if event["addr"] in live:
                traced -= live.pop(event["addr"])[0]
    blocks = list(peak_live.values())
    if peak - peak_traced:
        blocks.append((peak - peak_traced, "(allocated before recording)"))
    return peak, blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    peak, blocks = live_at_peak(snapshot, args.device)
    groups: dict[str, list[int]] = defaultdict(list)
    for size, where in blocks:
        groups[where].append(size)
    print(f"{args.snapshot}: peak of the recorded step {peak / 1e9:.2f} GB in {len(blocks)} blocks")
    print(f"{'GB':>8} {'blocks':>7}  allocated at")
    for where, sizes in sorted(groups.items(), key=lambda item: -sum(item[1]))[: args.top]:
        print(f"{sum(sizes) / 1e9:8.3f} {len(sizes):7d}  {where}")


if __name__ == "__main__":
    main()
