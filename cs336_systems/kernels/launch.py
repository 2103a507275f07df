"""What every operator of ours needs to launch its kernels (attention, RMSNorm, cross-entropy, AdamW): the
interpreter flag, the dtypes the kernels take, output allocation (poisoned on request), stride helpers, and
:class:`Launcher`, which launches a compiled kernel with the least host work.

Why a launcher of our own. ``kernel[grid](*args)`` makes Triton bind every argument to the signature, compute
its specialisation (dtype, 16-byte divisibility, equality to 1), hash that into a cache key and look the
compiled kernel up, on every call: tens of microseconds for a kernel of forty arguments, several times what a
cuDNN call costs the host. The callers here know what determines the compilation (the dtype, the constexprs,
the strides, the pointers' alignment) and have usually computed it already to choose the launch; a
:class:`Launcher` keeps the compiled kernel under that key and, from the second call on, hands the arguments
straight to the compiled kernel's C launcher.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, Generic, NamedTuple, TypeVar

import torch
import triton
from torch import Tensor
from triton.knobs import HookChain

RUNNING_IN_INTERPRETER: bool = triton.knobs.runtime.interpret
"""Whether ``@triton.jit`` built interpreter functions (``TRITON_INTERPRET=1`` when Triton was imported): kernels
then run on CPU tensors, as NumPy, one program at a time."""

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes every kernel here takes."""

Config = TypeVar("Config")


class CurrentConfig(Generic[Config]):
    """The configuration an operator's kernels run with (a frozen dataclass): set explicitly, never read from the
    environment by the library (command-line tools may build one from it and set it).

        with RMSNORM_CONFIG.use(autotune=False):   # tests, benchmarks
            ...
    """

    def __init__(self, default: Config):
        self._value = default

    def get(self) -> Config:
        return self._value

    def set(self, value: Config) -> None:
        self._value = value

    @contextlib.contextmanager
    def use(self, value: Config | None = None, **changes) -> Iterator[Config]:
        """Run the block with ``value`` (or the current configuration with ``changes``)."""
        previous = self._value
        self._value = dataclasses.replace(value if value is not None else previous, **changes)
        try:
            yield self._value
        finally:
            self._value = previous


_poison_outputs = False


@contextlib.contextmanager
def poisoned_outputs(enabled: bool = True) -> Iterator[None]:
    """Within this block, outputs start as NaN instead of uninitialised memory, so that an element a kernel fails
    to write shows (tests)."""
    global _poison_outputs
    previous, _poison_outputs = _poison_outputs, enabled
    try:
        yield
    finally:
        _poison_outputs = previous


def new_output(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised output (NaN inside :func:`poisoned_outputs`)."""
    if _poison_outputs:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def unit_last_stride(x: Tensor) -> Tensor:
    """``x`` itself when its last dimension has stride 1 (the kernels address it so), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def aligned(*tensors: Tensor) -> bool:
    """Whether every tensor's data starts on 16 bytes, which Triton specialises pointers on."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def check_device(x: Tensor, what: str, module: str) -> None:
    """Raise a clear error for tensors the kernels cannot run on: not CUDA, and not the CPU interpreter."""
    if x.device.type != "cuda" and not RUNNING_IN_INTERPRETER:
        raise ValueError(
            f"{what} need CUDA tensors, got tensors on {x.device}; to run them on the CPU through the Triton "
            f"interpreter, set TRITON_INTERPRET=1 before {module} is imported"
        )


class DescriptorArg(NamedTuple):
    """What a compiled kernel's launcher reads of a host tensor descriptor (base, shape, strides, padding): the
    descriptor's layout and block shape are part of the compiled kernel, so a call needs only these, not a new
    ``TensorDescriptor`` (whose construction validates and derives its layout: microseconds each)."""

    base: Tensor
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    padding: str = "zero"


class Launcher:
    """Launches the jit kernel ``fn`` (Triton or Gluon) under a key that the caller computes from everything that
    determines its compilation for these arguments: the dtypes, the constexprs and launch options, and the
    arguments Triton specialises on (integers not in ``do_not_specialize`` by value; pointers by alignment).

    The first call of a key compiles (or finds in Triton's caches) through ``fn[grid](...)``; later calls pass the
    arguments straight to the compiled kernel. A key that leaves out something the compilation depends on would
    launch a kernel compiled for other arguments: put in the key whatever the kernel specialises on.
    Under the interpreter every call runs ``fn[grid](...)``.
    """

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict[Any, tuple[Any, tuple]] = {}

    def compiled(self, key) -> bool:
        """Whether ``key`` has a compiled kernel on the current device (its calls take the short path)."""
        return not RUNNING_IN_INTERPRETER and (torch._C._cuda_getDevice(), key) in self._compiled

    def __call__(self, key, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any], **options) -> None:
        """``fn[grid](*args, **constexprs, **options)``; ``args`` are the leading parameters in order, ``constexprs``
        the trailing ones (the kernel's last parameters), ``options`` launch options such as ``num_warps``."""
        if RUNNING_IN_INTERPRETER:
            self.fn[grid](*args, **constexprs, **options)
            return
        device = torch._C._cuda_getDevice()  # a compiled kernel is loaded on one device
        entry = self._compiled.get((device, key))
        if entry is None:
            kernel = self.fn[grid](*args, **constexprs, **options)
            names = self.fn.arg_names
            if set(names[len(args):]) != set(constexprs):
                raise TypeError(f"{self.fn.__name__}: the keyword arguments must be its trailing parameters")
            self._compiled[(device, key)] = (kernel, tuple(constexprs[name] for name in names[len(args):]))
            return
        kernel, tail = entry
        stream = torch._C._cuda_getCurrentRawStream(device)
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        hooks = triton.knobs.runtime
        enter = hooks.launch_enter_hook  # a chain of hooks, usually empty (a profiler adds one)
        listened = enter.calls if isinstance(enter, HookChain) else enter is not None
        metadata = kernel.launch_metadata(grid, stream, *args, *tail) if listened else None
        kernel.run(grid[0], grid_y, grid_z, stream, kernel.function, kernel.packed_metadata, metadata,
                   enter, hooks.launch_exit_hook, *args, *tail)
