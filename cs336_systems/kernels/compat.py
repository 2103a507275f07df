"""Every private PyTorch (``torch._C``) and Triton symbol our launch code uses, in one module, so that an upgrade that
moves one breaks this module only (the Gluon kernels' own are in ``attention/backends/gluon_compat.py``).

* :func:`current_device`, :func:`launch_compiled` and :class:`CompiledLauncher`: a compiled Triton kernel launched
  on the current device and stream through its C launcher, without Triton's per-call argument binding (see
  ``launch.py``), its tensor descriptors encoded once per address;
* :func:`dispatch_mode_active`: whether a ``TorchDispatchMode`` is on (selective checkpointing sets one);
* :func:`trim_autotuner_cache`: the autotuner's picks bounded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.backends.nvidia.driver import make_tensordesc_arg
from triton.knobs import HookChain

__all__ = ["CompiledLauncher", "DescriptorArg", "current_device", "dispatch_mode_active", "launch_compiled",
           "launch_through_triton", "trim_autotuner_cache"]

current_device = torch._C._cuda_getDevice
"""The current CUDA device's index (a C call; ``torch.cuda.current_device()`` adds Python around it)."""


def launch_compiled(launcher: CompiledLauncher, device: int, grid: tuple[int, ...], args: tuple, tail: tuple) -> None:
    """Launch what a first launch compiled (its :class:`CompiledLauncher`) on ``device``'s current stream with the
    arguments ``(*args, *tail)``: every parameter of the jit function in order, constexprs included (its launcher
    skips them)."""
    launcher.launch(device, grid, args, tail)


def launch_through_triton(kernel, device: int, grid: tuple[int, ...], args: tuple, tail: tuple) -> None:
    """Launch a compiled kernel as :func:`launch_compiled` does, through Triton's launcher object, which expands
    tensor descriptors, allocates scratch memory and calls Triton's launch hooks (a profiler's) as Triton's own
    launch would."""
    stream = torch._C._cuda_getCurrentRawStream(device)
    hooks = triton.knobs.runtime
    enter = hooks.launch_enter_hook  # a chain of hooks, usually empty
    metadata = kernel.launch_metadata(grid, stream, *args, *tail) if _listened(enter) else None
    kernel.run(*_three_dimensions(grid), stream, kernel.function, kernel.packed_metadata, metadata,
               enter, hooks.launch_exit_hook, *args, *tail)


def _listened(hook) -> bool:
    return bool(hook.calls) if type(hook) is HookChain else hook is not None


def _three_dimensions(grid: tuple[int, ...]) -> tuple[int, ...]:
    return (*grid, 1, 1)[:3]


ENCODED_DESCRIPTORS = 512
"""Encoded tensor descriptors a :class:`CompiledLauncher` keeps (all are dropped when it would hold more): a
training step's layers each bring their activations' addresses, which recur from step to step."""


class DescriptorArg(NamedTuple):
    """What Triton's launcher reads of a host tensor descriptor to encode it (base, shape, strides, padding): the
    descriptor's layout and block shape are part of the compiled kernel."""

    base: torch.Tensor
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    padding: str = "zero"


class CompiledLauncher:
    """A compiled kernel of one launch signature (its tensors' shapes, strides and dtypes fixed), launched through
    Triton's C launcher with every tensor descriptor argument already encoded.

    Triton's launcher of a kernel that takes host tensor descriptors expands each, on every call, in Python: it
    encodes a CUDA tensor map (``cuTensorMapEncodeTiled``) from the descriptor's address, shape, strides, block,
    swizzle and dtype, then passes the map, shape and strides. Within a launch signature everything but the address
    is fixed: the shapes, strides and padding are read once, from the descriptors of the launch that compiled the
    kernel (``compile_args``), and a call passes, in a descriptor's place, only the tensor it addresses. The
    expansion is then a function of (argument position, address): kept here, a call whose tensors lie where they
    lay before (the caching allocator's usual case) encodes nothing. Triton's scratch allocations and launch hooks
    (a profiler's) fall back to :func:`launch_through_triton`, with full descriptors."""

    def __init__(self, kernel, compile_args: tuple = ()):
        self.kernel = kernel
        launcher = kernel.run  # loads the module on first use
        launch = launcher.launch
        # Triton wraps the C launcher of a kernel with descriptors in a Python function that expands them; that
        # of a kernel without is the C function itself.
        code, cells = getattr(launch, "__code__", None), getattr(launch, "__closure__", None) or ()
        captured = dict(zip(code.co_freevars, (cell.cell_contents for cell in cells))) if code else {}
        if "tensordesc_indices" in captured:
            self.raw = captured["launcher"]
            indices = sorted(captured["tensordesc_indices"])
            self.descriptors = tuple(zip(indices, captured["tensordesc_meta"]))
            self.layouts = {i: (tuple(compile_args[i].shape), tuple(compile_args[i].strides), compile_args[i].padding)
                            for i in indices}
        else:
            self.raw, self.descriptors, self.layouts = launch, (), {}
        self.function, self.packed_metadata = kernel.function, kernel.packed_metadata
        self.flags = (launcher.launch_cooperative_grid, launcher.launch_pdl)
        self.needs_scratch = bool(launcher.global_scratch_size or launcher.profile_scratch_size)
        self.encoded: dict[tuple[int, int], list] = {}

    def launch(self, device: int, grid: tuple[int, ...], args: tuple, tail: tuple) -> None:
        """Launch on ``device``'s current stream with ``(*args, *tail)``, in each descriptor's place the tensor it
        addresses."""
        hooks = triton.knobs.runtime
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
        if self.needs_scratch or _listened(enter):
            launch_through_triton(self.kernel, device, grid, self.descriptor_args(args), tail)
            return
        values = (*args, *tail)
        if self.descriptors:
            values = self._expand(values)
        # An empty chain of exit hooks is passed as None, which the C launcher skips instead of calling.
        self.raw(*_three_dimensions(grid), torch._C._cuda_getCurrentRawStream(device), self.function, *self.flags,
                 None, None, self.packed_metadata, None, None, leave if _listened(leave) else None, *values)

    def descriptor_args(self, args: tuple) -> tuple:
        """``args`` with a :class:`DescriptorArg` in each descriptor's place (what Triton's own launcher takes)."""
        args = list(args)
        for index, _ in self.descriptors:
            args[index] = DescriptorArg(args[index], *self.layouts[index])
        return tuple(args)

    def _expand(self, values: tuple) -> list:
        expanded, start = [], 0
        for index, meta in self.descriptors:
            expanded += values[start:index]
            base = values[index]
            key = (index, base.data_ptr())
            encoded = self.encoded.get(key)
            if encoded is None:
                if len(self.encoded) >= ENCODED_DESCRIPTORS:
                    self.encoded.clear()
                encoded = self.encoded[key] = make_tensordesc_arg(DescriptorArg(base, *self.layouts[index]), meta)
            expanded += encoded
            start = index + 1
        expanded += values[start:]
        return expanded


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` is on the stack (C; ``torch.utils._python_dispatch`` walks Python)."""
    return torch._C._len_torch_dispatch_stack() > 0


def trim_autotuner_cache(autotuner, size: int) -> None:
    """Drop the oldest of ``triton.autotune``'s picks (its ``cache``, one per autotune key) beyond ``size``."""
    picks = autotuner.cache
    while len(picks) > size:
        del picks[next(iter(picks))]
