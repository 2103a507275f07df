"""Allocator snapshot reports read back from a run's log.

``scripts/memory_snapshot_report.py`` prints, for one CUDA memory snapshot, the peak of allocated memory over the
recorded step and what was live at that moment, grouped by allocation site::

    snapshots/fsdp_ours_torch.pickle: peak of the recorded step 30.79 GB in 1409 blocks
          GB  blocks  allocated at
      12.057       1  (allocated before recording)
       2.558      97  cs336_basics/model.py:44 forward

A log holds several such reports between the lines (``# ...``) of the commands that wrote them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

BEFORE_RECORDING = "(allocated before recording)"
MODEL_CODE = "cs336_basics/"

_HEADLINE = re.compile(
    r"^(?P<path>\S+\.pickle): peak of the recorded step (?P<gb>[\d.]+) GB in (?P<blocks>\d+) blocks$")
_GROUP = re.compile(r"^\s*(?P<gb>\d+\.\d+)\s+(?P<blocks>\d+)\s+(?P<site>\S.*?)\s*$")


@dataclass(frozen=True)
class AllocationGroup:
    """The blocks live at the peak that one site allocated: ``site`` is ``file:line function``, or
    ``(allocated before recording)`` (what was live when recording began, as one block) or ``(no stack)``."""

    gb: float
    blocks: int
    site: str

    @property
    def mib_per_block(self) -> float:
        return self.gb * 1e9 / self.blocks / 2**20


@dataclass(frozen=True)
class SnapshotReport:
    """One snapshot's peak (GB, blocks live) and its groups, largest first, as far as the report listed them."""

    name: str  # the snapshot file's stem, e.g. ``fsdp_ours_torch``
    peak_gb: float
    blocks: int
    groups: tuple[AllocationGroup, ...]

    def gb_at(self, marker: str) -> float:
        """GB live at the peak from the sites whose name contains ``marker``."""
        return sum(g.gb for g in self.groups if marker in g.site)

    @property
    def before_recording_gb(self) -> float:
        return self.gb_at(BEFORE_RECORDING)

    @property
    def model_code(self) -> list[AllocationGroup]:
        """The groups the model's own code allocated (its activations, in a training step)."""
        return [g for g in self.groups if g.site.startswith(MODEL_CODE)]

    @property
    def model_code_gb(self) -> float:
        return sum(g.gb for g in self.model_code)


def parse_snapshot_reports(text: str) -> dict[str, SnapshotReport]:
    """Every report in ``text`` by its snapshot's stem (a later report of the same snapshot replaces an earlier)."""
    found: dict[str, tuple[float, int, list[AllocationGroup]]] = {}
    groups: list[AllocationGroup] | None = None
    for line in text.splitlines():
        headline = _HEADLINE.match(line.strip())
        if headline:
            groups = []
            found[PurePosixPath(headline["path"]).stem] = (float(headline["gb"]), int(headline["blocks"]), groups)
        elif line.startswith("#"):
            groups = None  # the next command's output
        elif groups is not None and (group := _GROUP.match(line)):
            groups.append(AllocationGroup(float(group["gb"]), int(group["blocks"]), group["site"]))
    return {name: SnapshotReport(name, peak, blocks, tuple(sorted(groups, key=lambda g: -g.gb)))
            for name, (peak, blocks, groups) in found.items()}
