"""Every private PyTorch (``torch._C``) and Triton symbol our launch code uses, in one module, so that an upgrade that
moves one breaks this module only (the Gluon kernels' own are in ``attention/backends/gluon_compat.py``).

* :func:`current_device` and :func:`launch_compiled`: a compiled Triton kernel launched on the current device and
  stream through its C launcher, without Triton's per-call argument binding (see ``launch.py``);
* :func:`dispatch_mode_active`: whether a ``TorchDispatchMode`` is on (selective checkpointing sets one);
* :func:`trim_autotuner_cache`: the autotuner's picks bounded.
"""

from __future__ import annotations

import torch
import triton
from triton.knobs import HookChain

__all__ = ["current_device", "dispatch_mode_active", "launch_compiled", "trim_autotuner_cache"]

current_device = torch._C._cuda_getDevice
"""The current CUDA device's index (a C call; ``torch.cuda.current_device()`` adds Python around it)."""


def launch_compiled(kernel, device: int, grid: tuple[int, ...], args: tuple, tail: tuple) -> None:
    """Launch ``kernel`` (what ``fn[grid](...)`` compiled) on ``device``'s current stream with the arguments
    ``(*args, *tail)``: every parameter of the jit function in order, constexprs included (its launcher skips them).
    Triton's launch hooks (a profiler's) are called as Triton's own launch would."""
    stream = torch._C._cuda_getCurrentRawStream(device)
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    hooks = triton.knobs.runtime
    enter = hooks.launch_enter_hook  # a chain of hooks, usually empty
    listened = enter.calls if isinstance(enter, HookChain) else enter is not None
    metadata = kernel.launch_metadata(grid, stream, *args, *tail) if listened else None
    kernel.run(grid[0], grid_y, grid_z, stream, kernel.function, kernel.packed_metadata, metadata,
               enter, hooks.launch_exit_hook, *args, *tail)


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` is on the stack (C; ``torch.utils._python_dispatch`` walks Python)."""
    return torch._C._len_torch_dispatch_stack() > 0


def trim_autotuner_cache(autotuner, size: int) -> None:
    """Drop the oldest of ``triton.autotune``'s picks (its ``cache``, one per autotune key) beyond ``size``."""
    picks = autotuner.cache
    while len(picks) > size:
        del picks[next(iter(picks))]
