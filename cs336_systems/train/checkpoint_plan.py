"""What each Transformer block's backward recomputes, chosen to fill the memory a rank has.

A block's backward needs its forward activations. Per block, the step may

* ``keep``: hold them all from forward to backward (nothing recomputed; the most memory);
* ``selective``: hold the block's input and its attention output (and log-sum-exp), recompute the rest: backward
  never runs attention again, whose forward is the costly part of a block at long context;
* ``full``: hold the block's input only and recompute the whole block.

:func:`plan_checkpointing` walks one chain of plans, each a step up from the last, and returns the last whose
predicted peak fits the budget: from every block ``full``, blocks become ``selective`` one at a time, then
``keep`` one at a time. Selective comes first because it buys the attention forward for one activation per
token, where keeping a block whole buys the rest of its forward for about twenty; along the chain no block ever
gets a cheaper mode, so a larger budget never recomputes more. The last blocks go first: their backward runs
first, so what they hold is freed before the gradients have built up."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

CheckpointMode = Literal["keep", "selective", "full"]
CHECKPOINT_MODES = get_args(CheckpointMode)  # from least recomputation (most memory) to most
GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class CheckpointPlan:
    """Per-block modes (``CHECKPOINT_MODES``, in block order) and the predicted peak bytes of a rank; the budget
    the peak must fit (the free memory less ``margin_bytes``; None for a plan fixed without one)."""

    modes: tuple[str, ...]
    peak_bytes: float
    budget_bytes: float | None = None
    margin_bytes: float = 0.0

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.peak_bytes <= self.budget_bytes

    def describe(self) -> str:
        """One line: how many blocks of each mode, which ones, the predicted peak and the budget."""
        counts = ", ".join(f"{self.modes.count(mode)} {mode}" for mode in CHECKPOINT_MODES if mode in self.modes)
        runs = " ".join(f"{mode}:{first}" + (f"-{last}" if last > first else "")
                        for mode, first, last in mode_runs(self.modes))
        line = f"{len(self.modes)} blocks: {counts} [{runs}]; predicted peak {self.peak_bytes / GB:.1f} GB"
        if self.budget_bytes is None:
            return line
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return (f"{line} {verdict} a budget of {self.budget_bytes / GB:.1f} GB "
                f"(free memory less a margin of {self.margin_bytes / GiB:.1f} GiB)")


def mode_runs(modes: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """``(mode, first block, last block)`` of each run of equal modes, in block order."""
    runs: list[tuple[str, int, int]] = []
    for index, mode in enumerate(modes):
        if runs and runs[-1][0] == mode:
            runs[-1] = (mode, runs[-1][1], index)
        else:
            runs.append((mode, index, index))
    return runs


def check_modes(modes: tuple[str, ...]) -> None:
    unknown = sorted(set(modes) - set(CHECKPOINT_MODES))
    if unknown:
        raise ValueError(f"unknown checkpoint mode {unknown[0]!r}; choose among {', '.join(CHECKPOINT_MODES)}")


def uniform_modes(mode: str, num_blocks: int) -> tuple[str, ...]:
    check_modes((mode,))
    return (mode,) * num_blocks


def chain_modes(num_blocks: int, upgrades: int) -> tuple[str, ...]:
    """The plan ``upgrades`` steps up the chain (module docstring): 0 is every block ``full``, ``num_blocks``
    every block ``selective``, ``2 * num_blocks`` every block ``keep``; the last blocks are upgraded first."""
    if not 0 <= upgrades <= 2 * num_blocks:
        raise ValueError(f"upgrades must lie in [0, {2 * num_blocks}], got {upgrades}")
    kept = max(0, upgrades - num_blocks)
    selective = min(upgrades, num_blocks) - kept
    return ("full",) * (num_blocks - kept - selective) + ("selective",) * selective + ("keep",) * kept


def plan_checkpointing(num_blocks: int, peak_bytes: Callable[[tuple[str, ...]], float], free_bytes: float,
                       margin_bytes: float = 4 * GiB) -> CheckpointPlan:
    """The plan furthest up the chain whose ``peak_bytes(modes)`` fits ``free_bytes - margin_bytes``; every block
    ``full`` (reported as not fitting) when even that does not. ``peak_bytes`` must grow along the chain (it
    does for any memory model where a mode that recomputes less holds more)."""
    budget = free_bytes - margin_bytes
    low, high = 0, 2 * num_blocks  # binary search for the last fitting step: the peak grows along the chain
    if peak_bytes(chain_modes(num_blocks, 0)) > budget:
        high = 0
    while low < high:
        middle = (low + high + 1) // 2
        if peak_bytes(chain_modes(num_blocks, middle)) <= budget:
            low = middle
        else:
            high = middle - 1
    modes = chain_modes(num_blocks, low)
    return CheckpointPlan(modes, peak_bytes(modes), budget, margin_bytes)
