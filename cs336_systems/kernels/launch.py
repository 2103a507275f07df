"""What every operator of ours needs to launch its Triton kernels (attention, RMSNorm, cross-entropy, AdamW, the
weighted sum), in one place:

* where kernels run: :func:`interpreting` (the one reading of whether Triton's CPU interpreter is on),
  :func:`unsupported_device`, :func:`check_device` and :func:`multiprocessors`;
* explicit configuration (:class:`CurrentConfig`), the dtypes the kernels take, output allocation (poisoned on
  request) and stride helpers;
* :class:`Kernel`: one bounded cache entry per launch signature (configuration, compiled kernel, trailing
  arguments), a launch eager (the compiled kernel straight through its C launcher) or traced (through
  ``wrap_triton``, inside an operator that ``torch.compile`` traces);
* :func:`define_operator`: the one way our kernels become ``torch.library`` operators.

Why launch a compiled kernel ourselves. ``kernel[grid](*args)`` makes Triton bind every argument to the signature,
compute its specialisation (dtype, 16-byte divisibility, equality to 1), hash that into a cache key and look the
compiled kernel up, on every call: tens of microseconds for a kernel of forty arguments, several times what a
cuDNN call costs the host. The callers here know what determines the compilation (the dtype, the constexprs,
the strides, the pointers' alignment) and have usually computed it already to choose the launch; a :class:`Kernel`
keeps the compiled kernel under that key and, from the second call on, hands the arguments straight to its C
launcher (``compat.CompiledLauncher``, which also keeps the kernel's tensor descriptors encoded per address).

Traced versus eager. An eager call (the autograd Function's own) looks its entry up by key, may autotune (once per
key), and launches the compiled kernel. While ``torch.compile`` traces, the same launch code runs inside a
``triton_op`` on fake tensors (no data, no addresses): it takes the fixed configuration and launches through
``wrap_triton``, so that Inductor emits the kernel launch into its own code. An autotuned kernel inside a compiled
graph would re-run its benchmarks on every call.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, NamedTuple, TypeVar

import torch
import triton
from torch import Tensor
from torch.library import wrap_triton

from cs336_systems.kernels import compat

# ---------------------------------------------------------------------------------------------------
# Where kernels run
# ---------------------------------------------------------------------------------------------------

_INTERPRETING: bool = triton.knobs.runtime.interpret


def interpreting() -> bool:
    """Whether our kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` when this module was imported
    (``@triton.jit`` reads the same setting when it decorates a kernel, and the kernel modules import this one
    first). Kernels then run on CPU tensors, as NumPy, one program at a time. Fixed for the process."""
    return _INTERPRETING


def unsupported_device(device: torch.device, what: str, module: str, *, reads_host_addresses: bool = False
                       ) -> str | None:
    """Why the kernels (``what``, defined in ``module``) cannot run on tensors on ``device``, or None when they can:
    on a GPU, any but CUDA tensors; under the interpreter, CUDA tensors too when the kernel reads addresses from a
    table (``reads_host_addresses``), which the interpreter takes as host memory."""
    if _INTERPRETING:
        if reads_host_addresses and device.type != "cpu":
            return (f"under TRITON_INTERPRET=1 {what} take CPU tensors only (their tables hold raw addresses, which "
                    f"the interpreter reads in host memory), got a tensor on {device}")
    elif device.type != "cuda":
        return (f"{what} need CUDA tensors, got tensors on {device}; to run them on the CPU through the Triton "
                f"interpreter, set TRITON_INTERPRET=1 before {module} is imported")
    return None


def check_device(x: Tensor, what: str, module: str, *, reads_host_addresses: bool = False) -> None:
    """Raise a ``ValueError`` saying why (:func:`unsupported_device`) where the kernels cannot run on ``x``."""
    reason = unsupported_device(x.device, what, module, reads_host_addresses=reads_host_addresses)
    if reason is not None:
        raise ValueError(reason)


@functools.lru_cache(maxsize=16)
def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA ``device``; under the interpreter (one program at a time) or for
    kernels compiled ahead of time on the CPU, 2, which keeps grids small and every path of a persistent kernel
    exercised."""
    if _INTERPRETING or device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------------------------------------------
# Configuration, dtypes, outputs, strides
# ---------------------------------------------------------------------------------------------------

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
    # PyTorch's argument parser takes a tuple of sizes faster than a torch.Size (about 0.7 us a call on a CPU).
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def new_output_like(x: Tensor) -> Tensor:
    """An uninitialised contiguous output of ``x``'s shape, dtype and device (NaN inside :func:`poisoned_outputs`):
    :func:`new_output` at about half its host cost."""
    if _poison_outputs:
        return torch.full_like(x, float("nan"), memory_format=torch.contiguous_format)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def unit_last_stride(x: Tensor) -> Tensor:
    """``x`` itself when its last dimension has stride 1 (the kernels address it so), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def aligned(*tensors: Tensor) -> bool:
    """Whether every tensor's data starts on 16 bytes, which Triton specialises pointers on."""
    address = 0
    for t in tensors:
        address |= t.data_ptr()
    return address % 16 == 0


# ---------------------------------------------------------------------------------------------------
# Launches: one bounded cache entry per launch signature
# ---------------------------------------------------------------------------------------------------


Grid = Callable[[dict[str, Any]], tuple[int, ...]]
"""The grid of a launch as a function of the configuration's tile sizes (``config.kwargs``; the autotuner passes
all keyword arguments, which include them)."""

LAUNCH_CACHE_SIZE = 64
"""Launch signatures a kernel keeps (the least recently used goes first): a training run uses a few, a benchmark
sweep a few dozen."""


class LaunchPlan(NamedTuple):
    """What a new launch signature fixes, computed once: the grid (of the tiles), the kernel's trailing parameters by
    name (everything after the call's own arguments: sizes, strides, scales and constexprs, without the tiles), the
    configuration when not autotuning, what else the call's arguments are built from (``extra``), and whether to
    keep the entry (not while a CUDA graph is captured, where ``extra`` lives in the graph's memory)."""

    grid: Grid
    named: dict[str, Any]
    fixed: triton.Config | None
    extra: Any = None
    keep: bool = True


class LaunchEntry(NamedTuple):
    """Everything the next call of a signature needs: its configuration, grid, trailing arguments (by name for
    compiling, in the kernel's order for launching), the compiled kernel's :class:`compat.CompiledLauncher` (None
    until the first launch has compiled it, and under the interpreter), and the plan's ``extra``."""

    config: triton.Config
    grid: tuple[int, ...]
    kwargs: dict[str, Any]
    tail: tuple
    kernel: Any
    extra: Any


def in_order(fn, named: dict[str, Any], first: int) -> tuple:
    """``named`` (parameters of the jit function ``fn`` from its ``first`` on) as the values in ``fn``'s order; a
    ``KeyError`` names a parameter missing from ``named``."""
    return tuple(named[name] for name in fn.arg_names[first:first + len(named)])


Build = Callable[[Any, tuple, bool], tuple]
"""``build(extra, args, compiled)``: the arguments before the trailing ones, from the call's and the entry's
``extra`` (``compiled``: the entry has a compiled kernel; else Triton compiles from these arguments)."""


class Kernel:
    """A jit kernel (Triton or Gluon) as our launch code sees it: one :class:`LaunchEntry` per launch signature in
    a bounded least-recently-used cache, and optionally an autotuner over ``autotune_configs``
    (``triton.autotune``'s ``key`` and ``prune``).

    ``kernel.launch(key, args, plan, *plan_args)`` launches ``fn`` on ``args`` (its leading parameters) and the entry
    of ``key`` on the current device; ``kernel(key, grid, args, constexprs, fixed)`` does the same where the grid and
    the arguments change between calls of one key. ``key`` is the launch signature: everything the configuration,
    the trailing arguments and the compilation depend on (the dtypes, the constexprs, the strides, the arguments Triton
    specialises on: integers by value unless ``do_not_specialize``, pointers by their 16-byte alignment). The first
    call of a key makes its entry from ``plan(*plan_args)`` (a :class:`LaunchPlan`); it compiles through
    ``fn[grid](...)`` (or finds the kernel in Triton's caches); later calls hand the arguments straight to the
    compiled kernel (:func:`compat.launch_compiled`). Under the interpreter every call runs ``fn[grid](...)``.
    """

    def __init__(self, fn, autotune_configs: list[triton.Config] | None = None, autotune_key: list[str] | None = None,
                 prune: Callable | None = None, cache_size: int = LAUNCH_CACHE_SIZE):
        self.fn = fn
        self.entries: collections.OrderedDict[Hashable, LaunchEntry] = collections.OrderedDict()
        """The launch entries by (device, key), least recently used first."""
        self.cache_size = cache_size
        self.autotuned = 0
        """Autotuner runs so far (tests)."""
        self.autotuner = None
        """``triton.autotune`` of ``fn`` over its candidates, or None (tools that compile every candidate read its
        ``configs`` and ``early_config_prune``)."""
        if autotune_configs:
            self.autotuner = triton.autotune(autotune_configs, key=autotune_key or [],
                                              prune_configs_by={"early_config_prune": prune} if prune else None)(fn)

    def launch(self, key: Hashable, args: tuple, plan: Callable[..., LaunchPlan], *plan_args,
               build: Build | None = None, autotune: bool = False) -> None:
        """Launch ``fn`` on ``args`` (or ``build(entry.extra, args, compiled)``) and the entry of ``key``, made at the
        key's first call from ``plan(*plan_args)``: with the autotuner's pick when ``autotune`` (it runs at that
        call, and launches), else the plan's fixed configuration."""
        tuned = autotune and self.autotuner is not None and not _INTERPRETING
        device = -1 if _INTERPRETING else compat.current_device()  # a compiled kernel is loaded on one device
        slot = (device, tuned, key)
        entry = self.entries.get(slot)
        if entry is not None and entry.kernel is not None:  # the common case
            self.entries.move_to_end(slot)
            compat.launch_compiled(entry.kernel, device, entry.grid,
                                   args if build is None else build(entry.extra, args, True), entry.tail)
            return
        if entry is None:
            new_plan = plan(*plan_args)
            launch_args = args if build is None else build(new_plan.extra, args, False)
            entry = self._new_entry(slot, launch_args, new_plan, tuned)
            if entry is None:
                return  # the autotuner launched
        else:
            launch_args = args if build is None else build(entry.extra, args, False)
        self._compile_and_launch(slot, entry, entry.grid, launch_args)

    def __call__(self, key: Hashable, grid: Grid, args: tuple, constexprs: dict[str, Any],
                 fixed: Callable[[], triton.Config], *, traced: bool = False, autotune: bool = False) -> None:
        """Launch ``fn[grid(tiles)](*args, **constexprs, **tiles)`` where the grid may change between calls of one
        ``key`` (``constexprs``: the trailing parameters; ``fixed()``: the configuration when not autotuning, asked
        at a key's first call). ``traced=True``: from an operator's body, which ``torch.compile`` traces on fake
        tensors (``key`` unused): the fixed configuration, through ``wrap_triton``, so that the graph holds the
        launch."""
        if traced:
            self._launch_traced(grid, args, constexprs, fixed())
            return
        tuned = autotune and self.autotuner is not None and not _INTERPRETING
        device = -1 if _INTERPRETING else compat.current_device()
        slot = (device, tuned, key)
        entry = self.entries.get(slot)
        if entry is not None and entry.kernel is not None:  # the common case
            self.entries.move_to_end(slot)
            compat.launch_compiled(entry.kernel, device, grid(entry.config.kwargs), args, entry.tail)
            return
        if entry is None:
            entry = self._new_entry(slot, args, LaunchPlan(grid, constexprs, None if tuned else fixed()), tuned)
            if entry is None:
                return  # the autotuner launched
        self._compile_and_launch(slot, entry, grid(entry.config.kwargs), args)

    def _new_entry(self, slot: tuple, args: tuple, plan: LaunchPlan, tuned: bool) -> LaunchEntry | None:
        """The entry of a new signature, kept unless the plan says not to; None when autotuning, which launched (the
        entry, kept, has no compiled kernel yet)."""
        if tuned:
            self.autotuner[plan.grid](*args, **plan.named)
            compat.trim_autotuner_cache(self.autotuner, self.cache_size)
            self.autotuned += 1
        config = self.autotuner.best_config if tuned else plan.fixed
        kwargs = {**plan.named, **config.kwargs}
        names = self.fn.arg_names[len(args):]
        if set(names) != set(kwargs):
            raise TypeError(f"{self.fn.__name__}: the named arguments must be its parameters after the first "
                            f"{len(args)}: missing {sorted(set(names) - set(kwargs))}, "
                            f"unknown {sorted(set(kwargs) - set(names))}")
        entry = LaunchEntry(config, plan.grid(config.kwargs), kwargs, tuple(kwargs[name] for name in names), None,
                            plan.extra)
        if plan.keep:
            self.entries[slot] = entry
            if len(self.entries) > self.cache_size:
                self.entries.popitem(last=False)
        return None if tuned else entry

    def _compile_and_launch(self, slot: tuple, entry: LaunchEntry, grid: tuple[int, ...], args: tuple) -> None:
        compiled = self.fn[grid](*args, **entry.kwargs, **compile_options(entry.config))
        if slot in self.entries and not _INTERPRETING:
            self.entries[slot] = entry._replace(kernel=compat.CompiledLauncher(compiled, args))

    def _launch_traced(self, grid: Grid, args: tuple, constexprs: dict[str, Any], config: triton.Config) -> None:
        # The interpreter's kernels are not jit functions, which wrap_triton refuses: their operators are opaque
        # (see define_operator) and launch them directly. Only the tiles, warps, stages and a register cap:
        # torch.compile refuses num_ctas passed as a launch argument.
        fn = self.fn if _INTERPRETING else wrap_triton(self.fn)
        fn[grid(config.kwargs)](*args, **constexprs, **config.kwargs, **compile_options(config))


def compile_options(config: triton.Config) -> dict[str, int]:
    """The compile options of ``config`` that a launch passes: warps, stages, and a register cap where it sets one."""
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    if config.maxnreg is not None:
        options["maxnreg"] = config.maxnreg
    return options


# ---------------------------------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------------------------------


def define_operator(name: str, body: Callable, *, traceable: bool, fake: Callable | None = None,
                    backward: Callable | None = None, setup_context: Callable | None = None,
                    schema: str | None = None):
    """Register ``body`` as the operator ``torch.ops.<name>`` (its schema from the annotations, or ``schema``; no
    input mutated).

    ``traceable``: ``torch.compile`` sees through it to the kernels: a ``torch.library.triton_op``, whose body
    launches through ``wrap_triton`` (a :class:`Kernel` called with ``traced=True``) and runs on fake tensors as
    its own shape function; Inductor then emits the launches in its generated code. Otherwise, and always under
    the interpreter (interpreted kernels cannot be wrapped), an opaque ``torch.library.custom_op`` with ``fake``
    as its shape function. ``backward`` and ``setup_context``: its autograd formula, when it has one.

    ``schema`` (opaque operators only), e.g. ``"(Tensor x, bool flag) -> Tensor"``: the operator is defined from it
    and ``body`` registered straight with the dispatcher as its CPU and CUDA kernel, without ``custom_op``'s Python
    wrapper, which costs about 12 microseconds a call against 2. For opaque operators that compiled code calls on
    every step, whose body Inductor must not trace (one that chooses between kernel families at run time, Gluon's
    among them, as attention's does); the body's annotations are then free (shaped tensor types, say).
    """
    if traceable and not _INTERPRETING and schema is None:
        op = torch.library.triton_op(name, body, mutates_args=())
    else:
        if fake is None:
            raise TypeError(f"{name}: an opaque operator needs a fake (shape) function")
        if schema is None:
            op = torch.library.custom_op(name, body, mutates_args=())
        elif traceable:
            raise TypeError(f"{name}: an operator defined from a schema is opaque (traceable=False)")
        else:
            op = _define_from_schema(name, body, schema)
        torch.library.register_fake(name, fake)
    if backward is not None:
        torch.library.register_autograd(name, backward, setup_context=setup_context)
    return op


_LIBRARIES: list[torch.library.Library] = []
"""The libraries of the operators defined from a schema: a library's registrations last as long as the object."""


def _define_from_schema(name: str, body: Callable, schema: str):
    namespace, op_name = name.split("::")
    library = torch.library.Library(namespace, "FRAGMENT")
    library.define(op_name + schema)
    for dispatch_key in ("CPU", "CUDA"):  # CPU: the interpreter's tensors (elsewhere the kernels refuse them)
        library.impl(op_name, body, dispatch_key)
    _LIBRARIES.append(library)
    return getattr(getattr(torch.ops, namespace), op_name)
