"""Compile ``@triton.jit`` (and ``@gluon.jit``) kernels for a GPU on a machine without one (ahead of time, down
to a cubin through the ptxas that ships with Triton: ``ptxas`` for sm_90, ``ptxas-blackwell`` for sm_100), and read
their register, spill, shared- and tensor-memory use.

The CPU interpreter runs kernels as NumPy, so it cannot see what only the compiler checks (globals
that are not ``tl.constexpr``, layouts, shared-memory and register limits); this can. It uses
Triton 3.6 internals (the argument binder of ``JITFunction``), the pinned version.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple
from unittest import mock

import torch
import triton

SHARED_MEMORY_PER_BLOCK = {90: 227 * 1024, 100: 227 * 1024}
"""Bytes of shared memory one block may use (232448), by compute capability: H100/H200 (9.0), B200 (10.0)."""
SPILL_CEILINGS = {
    ("bwd", "tf32x3", 32, 90): 16, ("bwd", "tf32x3", 48, 90): 16, ("bwd", "tf32x3", 80, 90): 152,
    ("bwd", "tf32x3", 96, 90): 488, ("fwd", "tf32x3", 128, 90): 312, ("bwd", "tf32x3", 128, 90): 472,
    ("fwd_split", "tf32x3", 128, 90): 256, ("bwd_split", "tf32x3", 128, 90): 472,
    ("fwd_split", "tf32x3", 128, 100): 1136, ("bwd_split", "tf32x3", 128, 100): 416,
}
"""Bytes per thread ptxas may spill compiling a kernel ("fwd", "bwd", "delta", "fwd_split", "bwd_split", ...) at the
fixed tiles of (float32 products, head dim) for a compute capability: float32 with tf32x3 products keeps the tiles
that ran fastest or spill least, though they spill (optimisation log: fixed-tiles). Nothing else may spill."""
TENSOR_MEMORY_COLUMNS = {100: 512}
"""Columns of tensor memory per SM (128 lanes of 32 bits each), where Blackwell's ``tcgen05.mma`` accumulates."""


def spill_ceiling(kernel: str, products: str, head_dim: int, capability: int = 90) -> int:
    """The most bytes :data:`SPILL_CEILINGS` lets ``kernel`` spill (0 where it lists none)."""
    return SPILL_CEILINGS.get((kernel, products, head_dim, capability), 0)


def nvidia_toolchain_available() -> bool:
    """Whether this Triton has its NVIDIA backend and the ptxas/cuobjdump binaries next to it."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        return False
    return os.path.exists(_tool("ptxas")) and os.path.exists(_tool("cuobjdump"))


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


@dataclass
class ResourceUsage:
    registers: int  # per thread
    spill_bytes: int  # per-thread stack, which is where ptxas spills registers
    shared_bytes: int  # dynamic shared memory the kernel asks for
    tensor_memory_columns: int  # Blackwell's tensor memory the kernel allocates (0 before sm_100)


def compile_for_gpu(jit_function, args: tuple, kwargs: dict, capability: int = 90):
    """Compile ``jit_function`` as a launch ``jit_function[grid](*args, **kwargs)`` would on a CUDA GPU
    of compute capability ``capability`` (90: H100). ``args`` may hold CPU tensors: only their dtypes
    and the alignment of their pointers matter. Gluon kernels compile only for Hopper (capability 9.x): ours are
    written for it, and its ``warpgroup_mma`` compiled for another GPU aborts the whole process inside LLVM rather
    than raising, so this refuses it first."""
    if jit_function.is_gluon() and capability // 10 != 9:
        raise ValueError(f"{jit_function.__name__} is a Gluon kernel for Hopper (sm_90): "
                         f"not compiled for sm_{capability}")
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = CUDABackend(target)
    binder = create_function_from_signature(jit_function.signature, jit_function.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit_function._pack_args(backend, kwargs, bound_args, specialization, options)
    if jit_function.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    return triton.compile(ASTSource(jit_function, signature, constexprs, attrs), target=target, options=options.__dict__)


class Launch(NamedTuple):
    """A launch ``kernel[grid](*args, **kwargs)`` as a :class:`~cs336_systems.kernels.launch.Kernel` would compile
    it (``kwargs``: the trailing arguments by name, the tiles, warps and stages)."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Within the block, every launch of our kernels that would compile is recorded instead (nothing compiles or
    runs), so that calls on CPU tensors with the kernels compiled (``TRITON_INTERPRET=0``) show what a GPU would
    compile."""
    from cs336_systems.kernels import compat
    from cs336_systems.kernels.launch import Kernel, compile_options

    launches: list[Launch] = []

    def record(kernel, slot, entry, grid, args):
        options = compile_options(entry.config)
        launches.append(Launch(kernel.fn, tuple(grid), tuple(args), {**entry.kwargs, **options}))

    device = object()  # a device of its own: no entry made before (or after) the block is used
    with mock.patch.object(Kernel, "_compile_and_launch", record), \
            mock.patch.object(compat, "current_device", lambda: device):
        yield launches


@contextlib.contextmanager
def compiled_and_short_launches() -> Iterator[tuple[list, list]]:
    """Within the block, launches are recorded and none runs: a key's first launch "compiles" (recorded as
    ``(kernel function, grid, args, entry)``; the entry then holds the function as its compiled kernel), later ones
    take the short path (recorded as ``(kernel function, grid, args, tail)``)."""
    from cs336_systems.kernels import compat
    from cs336_systems.kernels.launch import Kernel

    compiled, short = [], []
    device = object()  # a device of its own: no entry made before (or after) the block is used

    def compile_and_launch(kernel, slot, entry, grid, args):
        compiled.append((kernel.fn, grid, args, entry))
        if slot in kernel.entries:
            kernel.entries[slot] = entry._replace(kernel=kernel.fn)

    def launch_compiled(kernel, device, grid, args, tail):
        short.append((kernel, grid, args, tail))

    with mock.patch.object(Kernel, "_compile_and_launch", compile_and_launch), \
            mock.patch.object(compat, "launch_compiled", launch_compiled), \
            mock.patch.object(compat, "current_device", lambda: device):
        yield compiled, short


def portable_launches(dtype: torch.dtype, head_dim: int, is_causal: bool) -> dict[str, Launch]:
    """The portable backend's launches of one forward and backward on ``(2, 3, 200, head_dim)`` inputs, by kernel:
    "fwd", "delta", "bwd"."""
    from cs336_systems.attention.backends import triton as triton_backend

    q, k, v = (torch.randn(2, 3, 200, head_dim).to(dtype) for _ in range(3))
    with recorded_launches() as launches:
        O, L = triton_backend.forward(q, k, v, is_causal, head_dim ** -0.5)
        triton_backend.backward(q, k, v, torch.randn_like(q), L, torch.randn_like(q), is_causal, head_dim ** -0.5)
    assert [launch.kernel.__name__ for launch in launches] == ["attn_fwd_kernel", "attn_bwd_delta_kernel",
                                                                 "attn_bwd_kernel"]
    return dict(zip(("fwd", "delta", "bwd"), launches))


def hopper_launches(dtype: torch.dtype, head_dim: int, is_causal: bool, forward: bool = True) -> dict[str, Launch]:
    """The Hopper backend's launches of one forward (unless ``forward`` is False) and backward, on ``(2, 3, 1000,
    head_dim)`` queries and 777 keys, by kernel: "fwd", "delta", "bwd", "dq_convert"."""
    from cs336_systems.attention.backends import hopper

    Q, dO, O = (torch.randn(2, 3, 1000, head_dim).to(dtype) for _ in range(3))
    K, V = (torch.randn(2, 3, 777, head_dim).to(dtype) for _ in range(2))
    names = []
    with recorded_launches() as launches:
        if forward:
            hopper.forward(Q, K, V, is_causal, head_dim ** -0.5)
            names.append("fwd")
        hopper.backward(Q, K, V, O, torch.randn(2, 3, 1000), dO, is_causal, head_dim ** -0.5)
    return dict(zip([*names, "delta", "bwd", "dq_convert"], launches, strict=True))


def cuobjdump(compiled, flag: str) -> str:
    """What ``cuobjdump <flag>`` prints of the compiled kernel's cubin (``-sass``, ``-res-usage``), without the lines
    naming the temporary file."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([_tool("cuobjdump"), flag, path], capture_output=True, text=True, check=True).stdout
    return "\n".join(line for line in text.splitlines() if "kernel.cubin" not in line)


def resource_usage(compiled) -> ResourceUsage:
    report = cuobjdump(compiled, "-res-usage")
    match = re.search(r"REG:(\d+) STACK:(\d+)", report)
    if match is None:
        raise RuntimeError(f"cannot read the resource usage from cuobjdump:\n{report}")
    metadata = compiled.metadata
    return ResourceUsage(int(match.group(1)), int(match.group(2)), metadata.shared,
                         getattr(metadata, "tmem_size", None) or 0)


def serialized_wgmma(compiled) -> str | None:
    """ptxas's note that it serialised the kernel's ``wgmma.mma_async`` instructions (each waited for before the
    next is issued: the tensor cores then idle between them), or None. ptxas writes it (info C7514) when a
    non-wgmma instruction may read the accumulator of a wgmma still in flight, e.g. a loop-carried accumulator
    whose matmul is waited for only in the next iteration."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "kernel.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        arch = f"sm_{compiled.metadata.target.arch}a" if compiled.metadata.target.arch >= 90 else None
        done = subprocess.run([_tool("ptxas"), f"-arch={arch}", "-v", path, "-o", os.path.join(directory, "k.o")],
                              capture_output=True, text=True, check=True)
    match = re.search(r"wgmma\.mma_async instructions are serialized due to ([^']*)", done.stdout + done.stderr)
    return match.group(1).strip() if match else None

