"""What one Transformer block saves for backward, by the operation that made each saved tensor, and how the
allocated memory changes over each block's forward and backward.

The 2026 handout reads this from Nsight Systems' memory view with PyTorch's NVTX ranges. Nsight Systems does not run
on our GPU machines; PyTorch itself gives the same information:

* ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd saves for backward while a block runs
  forward (its "residuals"; a storage counted once; parameters and buffers left out: they are not activations), and
  a ``TorchDispatchMode`` remembers which ATen operation, called from which model function, made each storage;
* tensor hooks on each block's input read the caching allocator's counter (``torch.cuda.memory_allocated``) where
  each block's backward ends. Over one block's backward the allocated memory grows by the gradients it produces
  (its parameters' ``.grad``, allocated at their first backward) and shrinks by the residuals it frees, so the
  gradients are the change plus the residuals. Expected: the block's parameter bytes (fp32 gradients of fp32
  parameters, autocast too), give or take the gradient flowing from block to block (a residual-stream tensor).

The blocks run inside the model's forward: the model runs once without autograd to give the hidden state that enters
a window of consecutive blocks in its middle; the window then runs forward and backward with autograd, holding only
its own blocks' residuals (the whole model's do not fit at long contexts).
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cs336_systems.bench.common.lm import autocast

MODEL_DIR = f"{os.sep}cs336_basics{os.sep}"  # frames of the model's code
BLOCK_INPUT = "block input"  # a saved storage that the block did not make: its input (the residual stream)
TOP = 5


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def model_callers(depth: int = 2) -> str:
    """The ``depth`` innermost model functions on the Python stack, innermost first (``Linear.forward in
    SwiGLU.forward``)."""
    names = []
    frame = sys._getframe(1)
    while frame is not None and len(names) < depth:
        if MODEL_DIR in frame.f_code.co_filename:
            names.append(frame.f_code.co_qualname)
        frame = frame.f_back
    return " in ".join(names) or "outside the model"


class ProducerLog(TorchDispatchMode):
    """Remembers, for every storage that an ATen operation makes while ``block`` is set, the operation
    (``aten.mm``), the model functions that called it and the block. Views and in-place results share an input's
    storage: they make none."""

    def __init__(self):
        super().__init__()
        self.block: int | None = None
        self.made_by: dict[int, tuple[str, str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.block is not None:
            inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and _storage(t) not in inputs:
                    self.made_by[_storage(t)] = (str(func.overloadpacket), model_callers(), self.block)
        return out


@dataclass(frozen=True)
class SavedStorage:
    """One storage autograd saved for backward: the operation and model functions that made it, its bytes, and the
    shape and dtype of the first tensor saved from it."""

    op: str
    caller: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclass
class SavedLog:
    """The pack hook of ``saved_tensors_hooks``: records, per block, every storage saved while ``block`` is set,
    except the ``excluded`` ones (parameters, buffers)."""

    producers: ProducerLog
    excluded: set[int]
    block: int | None = None
    saved: dict[int, dict[int, SavedStorage]] = field(default_factory=dict)  # block -> storage -> what

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage(tensor)
        if self.block is not None and key not in self.excluded:
            op, caller, block = self.producers.made_by.get(key, (BLOCK_INPUT, "", None))
            if block != self.block:
                op, caller = BLOCK_INPUT, ""
            dtype = str(tensor.dtype).removeprefix("torch.")
            what = SavedStorage(op, caller, tensor.untyped_storage().nbytes(), tuple(tensor.shape), dtype)
            self.saved.setdefault(self.block, {}).setdefault(key, what)
        return tensor


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass
class WindowMemory:
    """A window of consecutive blocks run forward and backward: what each block saved, and the allocated bytes
    before the forward and after each block's forward (block order), before the backward and after each block's
    backward (backward order: last block first)."""

    saved: list[dict[int, SavedStorage]]
    forward_bytes: list[int]
    backward_bytes: list[int]


def run_window(blocks: Sequence[nn.Module], x: torch.Tensor, dtype: torch.dtype | None, allocated: Callable[[], int],
               excluded: set[int]) -> WindowMemory:
    """Run ``blocks`` on ``x`` (its input, as a leaf that requires grad) forward under autocast to ``dtype``
    (None: full precision), then backward from a gradient of ones, reading ``allocated()`` at every block boundary."""
    leaf = x.detach().requires_grad_()
    producers = ProducerLog()
    log = SavedLog(producers, excluded)
    forward_bytes, backward_bytes = [allocated()], []

    def block_backward_ended(grad: torch.Tensor) -> None:
        backward_bytes.append(allocated())

    with producers, torch.autograd.graph.saved_tensors_hooks(log.pack, _unpack), autocast(x.device, dtype):
        # A view of the leaf, so that the first block's input is not a leaf either: a leaf's hook would run before
        # the gradients of weights that reach their AccumulateGrad through another node (Linear's transpose).
        h = leaf.view_as(leaf)
        for index, block in enumerate(blocks):
            h.register_hook(block_backward_ended)  # the block's input: its gradient ends the block's backward
            producers.block = log.block = index
            h = block(h)
            producers.block = log.block = None
            forward_bytes.append(allocated())
    grad = torch.ones_like(h)
    backward_bytes.append(allocated())
    h.backward(grad)
    return WindowMemory([log.saved.get(i, {}) for i in range(len(blocks))], forward_bytes, backward_bytes)


def changes(marks: list[int]) -> list[int]:
    """The change from each reading to the next."""
    return [after - before for before, after in zip(marks, marks[1:])]


def saved_by_operation(saved: dict[int, SavedStorage]) -> list[dict[str, Any]]:
    """The saved storages grouped by (operation, calling model functions), largest first: ``op``, ``caller``,
    ``bytes``, ``mib``, ``share`` (of the block's total), ``tensors`` and up to three distinct ``shapes``."""
    total = sum(s.nbytes for s in saved.values())
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for s in saved.values():
        group = groups.setdefault((s.op, s.caller), {"op": s.op, "caller": s.caller, "bytes": 0, "tensors": 0,
                                                     "dtypes": [], "shapes": []})
        group["bytes"] += s.nbytes
        group["tensors"] += 1
        if list(s.shape) not in group["shapes"] and len(group["shapes"]) < 3:
            group["shapes"].append(list(s.shape))
        if s.dtype not in group["dtypes"]:
            group["dtypes"].append(s.dtype)
    for group in groups.values():
        group["mib"] = group["bytes"] / 2**20
        group["share"] = group["bytes"] / total if total else 0.0
    return sorted(groups.values(), key=lambda g: -g["bytes"])


def summarize(memory: WindowMemory, parameter_bytes: list[int]) -> dict[str, Any]:
    """The row of a window: the residuals of its first block by operation, and per block (in block order) the
    residual bytes, the changes of allocated memory over its forward and its backward, and the gradient bytes that
    the backward's change implies (change + residuals), against the expected ``parameter_bytes``.

    ``gradient_bytes_measured`` is the median of the implied gradients over the blocks after the window's first,
    whose input (the window's input) stays alive after its backward."""
    residuals = [sum(s.nbytes for s in saved.values()) for saved in memory.saved]
    backward = list(reversed(changes(memory.backward_bytes)))
    implied = [change + saved for change, saved in zip(backward, residuals)]
    measured = statistics.median(implied[1:] or implied)
    operations = saved_by_operation(memory.saved[0])
    return {
        "residual_bytes": residuals[0],
        "residual_mib": residuals[0] / 2**20,
        "residual_tensors": len(memory.saved[0]),
        "top_operations": operations[:TOP],
        "saved_by_operation": operations,
        "residual_bytes_by_block": residuals,
        "forward_change_bytes": changes(memory.forward_bytes),
        "backward_change_bytes": backward,
        "gradient_bytes_implied": implied,
        "gradient_bytes_measured": measured,
        "gradient_bytes_expected": parameter_bytes[0],
        "gradient_ratio": measured / parameter_bytes[0] if parameter_bytes[0] else None,
    }


def hidden_state_entering(model: nn.Module, tokens: torch.Tensor, index: int,
                          dtype: torch.dtype | None) -> torch.Tensor:
    """The hidden state ``(batch, seq, d_model)`` that enters ``model.layers[index]`` in the model's forward (run
    without autograd)."""
    captured: dict[str, torch.Tensor] = {}

    def grab(module: nn.Module, args: tuple) -> None:
        captured["x"] = args[0].detach()

    handle = model.layers[index].register_forward_pre_hook(grab)
    try:
        with torch.no_grad(), autocast(tokens.device, dtype):
            model(tokens)
    finally:
        handle.remove()
    return captured["x"]


def measure_blocks(model: nn.Module, tokens: torch.Tensor, dtype: torch.dtype | None, allocated: Callable[[], int],
                   window: int = 4) -> dict[str, Any]:
    """:func:`summarize` of ``window`` consecutive blocks in the middle of ``model`` on its hidden state for
    ``tokens`` ``(batch, seq)``, with ``blocks`` (their indices), ``block_parameters`` (of one block) and
    ``residual_stream_bytes`` (one ``(batch, seq, d_model)`` hidden state)."""
    n_blocks = len(model.layers)
    window = min(window, n_blocks)
    first = (n_blocks - window) // 2
    blocks = list(model.layers[first:first + window])
    x = hidden_state_entering(model, tokens, first, dtype)
    excluded = {_storage(t) for t in (*model.parameters(), *model.buffers())}
    model.zero_grad(set_to_none=True)
    memory = run_window(blocks, x, dtype, allocated, excluded)
    parameter_bytes = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks]
    row = {"blocks": list(range(first, first + window)),
           "block_parameters": sum(p.numel() for p in blocks[0].parameters()),
           "residual_stream_bytes": x.numel() * x.element_size()}
    model.zero_grad(set_to_none=True)
    return {**row, **summarize(memory, parameter_bytes)}
