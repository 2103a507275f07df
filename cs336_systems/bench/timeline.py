"""Draw per-rank ``torch.profiler`` Chrome traces as compute / communication / phase lanes, with overlap
statistics (the lanes of :mod:`cs336_systems.bench.common.timeline`)::

    python -m cs336_systems.bench.timeline rank0.json rank1.json -o timeline.png --title "bucketed DDP"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cs336_systems.bench.common import cli
from cs336_systems.bench.common.timeline import (
    LANE_PHASES,
    load_trace,
    overlap_summary,
    render_lanes,
    timeline_from_trace,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="*", type=cli.existing_file,
                   help="Chrome traces, one per rank, in rank order (ddp_benchmarking --trace writes them)")
    p.add_argument("-o", "--output", type=Path, default=None, help="the PNG to write (default: timeline.png beside "
                   "the first trace)")
    p.add_argument("--title", default="")
    p.add_argument("--phases", nargs="*", default=list(LANE_PHASES), help="record_function ranges drawn as phases")
    p.add_argument("--quick", action="store_true", help="accepted as by every tool; drawing is quick already")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not args.traces:
        print("# no traces given: nothing to draw. Record some with\n"
              "#   python -m cs336_systems.bench.ddp_benchmarking --quick --trace\n"
              "# (it draws them itself), or pass per-rank Chrome traces: timeline rank0.json rank1.json -o t.png",
              file=sys.stderr)
        return
    output = args.output or args.traces[0].parent / "timeline.png"
    timelines = [timeline_from_trace(load_trace(path), tuple(args.phases)) for path in args.traces]
    for path, timeline in zip(args.traces, timelines):
        summary = overlap_summary(timeline)
        print(f"{path}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items() if v is not None))
    render_lanes(timelines, output, args.title)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
