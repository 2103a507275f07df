"""What is live at the peak of a CUDA memory snapshot (``torch.cuda.memory._dump_snapshot``), grouped by where it
was allocated or by what it holds.

The allocator's trace (``device_traces``) is replayed from the start of the recording; blocks already live when
recording began (``segments`` minus what the trace frees first) count as "before recording". At the moment the
allocated total peaks, the live blocks are grouped (``--by``) by their innermost frame in this project or in the
model code (``cs336_systems``, ``cs336_basics``), else their innermost Python frame (``site``:
``cs336_systems.bench.common.memory.allocation_source``), or by what they hold (``category``: weights, gradients,
optimizer state, attention scores, ...: ``cs336_systems.bench.common.memory.allocation_category``).

    python scripts/memory_snapshot_report.py snapshots/fsdp_ours_torch.pickle [--top 15] [--by category]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from cs336_systems.bench.common.memory import (
    alloc_free_events,
    allocation_category,
    allocation_source,
    gradient_sizes,
    load_snapshot,
    preexisting_bytes,
)

BEFORE_RECORDING = "(allocated before recording)"


def live_at_peak(snapshot: dict, device: int = 0, by: str = "site") -> tuple[int, list[tuple[int, str]]]:
    """The peak of allocated bytes over the trace and the ``(size, origin)`` of every block live then; the origin
    is the allocation site (``by="site"``) or what the block holds (``by="category"``).

    The replay starts from what was live when recording began (:func:`~cs336_systems.bench.common.memory.
    preexisting_bytes`); that memory shows as one block, :data:`BEFORE_RECORDING`."""
    total = peak = preexisting_bytes(snapshot, device)
    live: dict[int, tuple[int, str]] = {}
    peak_live: dict[int, tuple[int, str]] = {}
    traced = peak_traced = 0
    sizes = gradient_sizes(snapshot, device) if by == "category" else frozenset()

    def origin(event: dict) -> str:
        frames = event.get("frames", [])
        return allocation_category(frames, event["size"], sizes) if by == "category" else allocation_source(frames)

    for event in alloc_free_events(snapshot, device):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], origin(event))
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
        blocks.append((peak - peak_traced, BEFORE_RECORDING))
    return peak, blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--by", choices=("site", "category"), default="site",
                   help="group by allocation site (innermost frame of our code) or by what the memory holds")
    args = p.parse_args()
    peak, blocks = live_at_peak(load_snapshot(args.snapshot), args.device, args.by)
    groups: dict[str, list[int]] = defaultdict(list)
    for size, where in blocks:
        groups[where].append(size)
    print(f"{args.snapshot}: peak of the recorded step {peak / 1e9:.2f} GB in {len(blocks)} blocks")
    print(f"{'GB':>8} {'blocks':>7}  {'allocated at' if args.by == 'site' else 'holds'}")
    for where, sizes in sorted(groups.items(), key=lambda item: -sum(item[1]))[: args.top]:
        print(f"{sum(sizes) / 1e9:8.3f} {len(sizes):7d}  {where}")


if __name__ == "__main__":
    main()
