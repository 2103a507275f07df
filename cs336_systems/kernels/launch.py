"""What every operator of ours needs to launch its Triton kernels (attention, RMSNorm, cross-entropy, AdamW, the
weighted sum), in one place:

* where kernels run: :func:`interpreting` (the one reading of whether Triton's CPU interpreter is on),
  :func:`unsupported_device` and :func:`check_device`;
* explicit configuration (:class:`CurrentConfig`), the dtypes the kernels take, output allocation (poisoned on
  request) and stride helpers;
* :class:`Launcher`, which launches a compiled kernel with the least host work;
* :class:`ConfigCache` and :class:`Kernel`: a kernel's launch configuration chosen once per key (a fixed rule, or
  the autotuner's pick) and its launch, eager (through the :class:`Launcher`) or traced (through ``wrap_triton``,
  inside an operator that ``torch.compile`` traces);
* :func:`define_operator`: the one way our kernels become ``torch.library`` operators.

Why a launcher of our own. ``kernel[grid](*args)`` makes Triton bind every argument to the signature, compute
its specialisation (dtype, 16-byte divisibility, equality to 1), hash that into a cache key and look the
compiled kernel up, on every call: tens of microseconds for a kernel of forty arguments, several times what a
cuDNN call costs the host. The callers here know what determines the compilation (the dtype, the constexprs,
the strides, the pointers' alignment) and have usually computed it already to choose the launch; a
:class:`Launcher` keeps the compiled kernel under that key and, from the second call on, hands the arguments
straight to the compiled kernel's C launcher.

Traced versus eager. An eager call (the autograd Function's own) looks its configuration up by key, may autotune
(once per key), and launches through the :class:`Launcher`. While ``torch.compile`` traces, the same launch code
runs inside a ``triton_op`` on fake tensors (no data, no addresses): it takes the fixed configuration and launches
through ``wrap_triton``, so that Inductor emits the kernel launch into its own code. An autotuned kernel inside a
compiled graph would re-run its benchmarks on every call.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, NamedTuple, TypeVar

import torch
import triton
from torch import Tensor
from torch.library import wrap_triton
from triton.knobs import HookChain

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
    return torch.empty(shape, dtype=dtype, device=device)


def unit_last_stride(x: Tensor) -> Tensor:
    """``x`` itself when its last dimension has stride 1 (the kernels address it so), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def aligned(*tensors: Tensor) -> bool:
    """Whether every tensor's data starts on 16 bytes, which Triton specialises pointers on."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


# ---------------------------------------------------------------------------------------------------
# Launcher: a compiled kernel under a key, launched without Triton's argument binding
# ---------------------------------------------------------------------------------------------------


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
        return not _INTERPRETING and (torch._C._cuda_getDevice(), key) in self._compiled

    def __call__(self, key, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any], **options) -> None:
        """``fn[grid](*args, **constexprs, **options)``; ``args`` are the leading parameters in order, ``constexprs``
        the trailing ones (the kernel's last parameters), ``options`` launch options such as ``num_warps``."""
        if not self.launch_compiled(key, grid, args):
            self._compile_and_launch(key, grid, args, constexprs, options)

    def launch_compiled(self, key, grid: tuple[int, ...], args: tuple) -> bool:
        """Launch the kernel compiled for ``key`` on the current device, if there is one (True); else do nothing
        (False). The constexprs and options are the ones of the key's first call."""
        if _INTERPRETING:
            return False
        device = torch._C._cuda_getDevice()  # a compiled kernel is loaded on one device
        entry = self._compiled.get((device, key))
        if entry is None:
            return False
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
        return True

    def _compile_and_launch(self, key, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any],
                            options: dict[str, Any]) -> None:
        kernel = self.fn[grid](*args, **constexprs, **options)
        if _INTERPRETING:
            return
        names = self.fn.arg_names
        if set(names[len(args):]) != set(constexprs):
            raise TypeError(f"{self.fn.__name__}: the keyword arguments must be its trailing parameters")
        tail = tuple(constexprs[name] for name in names[len(args):])
        self._compiled[(torch._C._cuda_getDevice(), key)] = (kernel, tail)


# ---------------------------------------------------------------------------------------------------
# Launch configurations: chosen once per key, by a rule or by the autotuner
# ---------------------------------------------------------------------------------------------------

Grid = Callable[[dict[str, Any]], tuple[int, ...]]
"""The grid of a launch as a function of the configuration's tile sizes (``config.kwargs``; the autotuner passes
all keyword arguments, which include them)."""


class ConfigCache(dict[Hashable, triton.Config]):
    """Launch configurations by key, each chosen once and then reused: by a rule (the fixed configuration for the
    key) or by the autotuner (its pick at the key's first call). A key holds everything the choice depends on.
    A dict, so that the look-up of every launch is ``get``, in C."""

    def __init__(self):
        super().__init__()
        self.autotuned = 0
        """Autotuner runs so far (tests)."""

    def fixed(self, key: Hashable, rule: Callable[[], triton.Config]) -> triton.Config:
        """The configuration of ``key``, from ``rule()`` the first time."""
        config = self.get(key)
        if config is None:
            config = self[key] = rule()
        return config

    def autotune(self, key: Hashable, autotuner, grid: Grid, args: tuple, constexprs: dict[str, Any]) -> None:
        """Run ``autotuner`` (``triton.autotune`` of the kernel) on these arguments, which benchmarks its candidates
        and launches the fastest, and keep its pick for ``key``."""
        autotuner[grid](*args, **constexprs)
        self[key] = autotuner.best_config
        self.autotuned += 1


class Kernel:
    """A jit kernel as our launch code sees it: its configurations (:class:`ConfigCache`), its :class:`Launcher`,
    and optionally an autotuner over ``autotune_configs`` (``triton.autotune``'s ``key`` and ``prune``).

    ``kernel(key, grid, args, constexprs, fixed)`` launches ``fn[grid](*args, **constexprs, **config.kwargs)``
    with ``config`` the configuration chosen for ``key``. The key must determine everything the launch
    configuration and the compilation depend on: the constexprs, the dtypes, and the arguments Triton specialises
    on (see :class:`Launcher`). ``fixed()`` is the fixed configuration, read only when a key is first seen.
    """

    def __init__(self, fn, autotune_configs: list[triton.Config] | None = None, autotune_key: list[str] | None = None,
                 prune: Callable | None = None):
        self.fn = fn
        self.configs = ConfigCache()
        self._launcher = Launcher(fn)
        self.autotuner = None
        """``triton.autotune`` of ``fn`` over its candidates, or None (tools that compile every candidate read its
        ``configs`` and ``early_config_prune``)."""
        if autotune_configs:
            self.autotuner = triton.autotune(autotune_configs, key=autotune_key or [],
                                              prune_configs_by={"early_config_prune": prune} if prune else None)(fn)

    def __call__(self, key: Hashable, grid: Grid, args: tuple, constexprs: dict[str, Any],
                 fixed: Callable[[], triton.Config], *, traced: bool = False, autotune: bool = False) -> None:
        """Launch ``fn``. Eager (``traced=False``): with the autotuner's pick for ``key`` when ``autotune`` (it runs at
        the key's first call, and launches), else the fixed configuration, through the :class:`Launcher`.
        ``traced=True``: from an operator's body, which ``torch.compile`` traces on fake tensors (``key`` unused):
        the fixed configuration, launched through ``wrap_triton`` so that the graph holds the launch."""
        if traced:
            self._launch_traced(grid, args, constexprs, fixed())
            return
        tuned = autotune and self.autotuner is not None and not _INTERPRETING
        config_key = (tuned, key)
        config = self.configs.get(config_key)
        if config is None:
            if tuned:
                self.configs.autotune(config_key, self.autotuner, grid, args, constexprs)
                return
            config = self.configs.fixed(config_key, fixed)
        elif self._launcher.launch_compiled(config_key, grid(config.kwargs), args):
            return  # the common case: no keyword arguments to gather
        self._launcher(config_key, grid(config.kwargs), args, {**constexprs, **config.kwargs},
                       num_warps=config.num_warps, num_stages=config.num_stages)

    def _launch_traced(self, grid: Grid, args: tuple, constexprs: dict[str, Any], config: triton.Config) -> None:
        # The interpreter's kernels are not jit functions, which wrap_triton refuses: their operators are opaque
        # (see define_operator) and launch them directly. Only the tiles, warps and stages: torch.compile refuses
        # num_ctas passed as a launch argument.
        fn = self.fn if _INTERPRETING else wrap_triton(self.fn)
        fn[grid(config.kwargs)](*args, **constexprs, **config.kwargs, num_warps=config.num_warps,
                                num_stages=config.num_stages)


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
