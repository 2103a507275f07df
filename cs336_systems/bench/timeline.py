"""Draw per-rank ``torch.profiler`` Chrome traces as compute / communication / phase lanes, with overlap
statistics (the lanes of :mod:`cs336_systems.bench.common.timeline`)::

    python -m cs336_systems.bench.timeline rank0.json rank1.json -o timeline.png --title "bucketed DDP"
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cs336_systems.bench.common.timeline import (
    LANE_PHASES,
    load_trace,
    overlap_summary,
    render_lanes,
    timeline_from_trace,
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path, help="Chrome traces, one per rank, in rank order")
    p.add_argument("-o", "--output", type=Path, required=True, help="the PNG to write")
    p.add_argument("--title", default="")
    p.add_argument("--phases", nargs="*", default=list(LANE_PHASES), help="record_function ranges drawn as phases")
    args = p.parse_args(argv)
    timelines = [timeline_from_trace(load_trace(path), tuple(args.phases)) for path in args.traces]
    for path, timeline in zip(args.traces, timelines):
        summary = overlap_summary(timeline)
        print(f"{path}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items() if v is not None))
    render_lanes(timelines, args.output, args.title)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
