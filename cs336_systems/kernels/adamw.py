"""Fused AdamW in Triton: one multi-tensor kernel launch updates every parameter of a launch group, and
:class:`FusedAdamW`, a drop-in replacement for ``cs336_basics.optimizer.AdamW``.

Per element, at step ``t`` (counted per parameter from 1) with the gradient ``g``::

    p  = p * (1 - lr * wd)                                   decoupled weight decay
    m  = lerp(m, g, 1 - b1)                                  first moment  (state "exp_avg")
    v  = b2 * v + (1 - b2) * g * g                           second moment (state "exp_avg_sq")
    step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)             bias corrections folded into two scalars,
    eps_hat   = eps * sqrt(1 - b2^t)                         computed on the host in float64
    p  = p - step_size * m / (sqrt(v) + eps_hat)

the same update, operation for operation, as ``cs336_basics.optimizer.AdamW``. Everything is float32 in
registers: the parameter and gradient are loaded in their dtype (float32, bfloat16 or float16) and upcast,
the moments are always float32 (also for 16-bit parameters, unlike the plain AdamW's ``zeros_like(p)``), and
the parameter is rounded to its dtype once, at the store. ``sqrt`` and the division are the correctly
rounded ones (``tl.sqrt_rn``, ``tl.div_rn``): the kernel is memory-bound, so they cost nothing.

Bytes per parameter element: read p, g, m, v and write p, m, v. With float32 parameters and gradients
that is 7 x 4 = 28 bytes; with bfloat16 parameters and gradients 2 + 2 + 8 read, 2 + 8 written = 22 bytes.
At ~4 TB/s (an H200) a step over 10^9 float32 parameters is therefore at least ~7 ms. The tables below
add 4 bytes (the map) and one 48-byte row, mostly from L2, per ``BLOCK`` elements: noise.

Design (multi-tensor launch):

* The parameters of a step are grouped by (device, parameter dtype, gradient dtype, step count,
  hyper-parameters); each group is one launch. Usually that is one launch per parameter group.
* A launch gets a small int64 device table, shape ``(n_tensors, 6)``: per tensor the addresses of the
  parameter, gradient, ``exp_avg`` and ``exp_avg_sq``, its element count and its first block; and a
  block -> tensor map, int32 of shape ``(n_blocks,)``, with ``cdiv(numel, BLOCK)`` blocks per tensor. Program
  ``i`` reads its tensor's row, casts the addresses to pointers (``int64 -> tl.pointer_type``, which works
  on GPUs and in the interpreter) and updates elements ``[(i - first_block) * BLOCK, ...)`` of it.
* Both tables depend only on the addresses, element counts and ``BLOCK``; they are cached (a few
  entries, least recently used first out) under the key of those, so a step whose gradients land where
  they did last time does no per-element host work and copies nothing to the device: only the
  ``data_ptr()`` of every tensor is read (work proportional to the number of tensors).
* Hyper-parameters and bias corrections are float32 scalar arguments, which Triton does not specialise
  on, so a learning-rate schedule never recompiles; the dtypes and ``ALIGNED`` are compile-time constants.
* Full blocks load and store unmasked; only a tensor's last, partial block is masked. When every address
  of a launch is 16-byte aligned (``ALIGNED``, checked when the table is built) the kernel tells the
  compiler so, which gives 16-byte vector accesses; otherwise (e.g. FSDP shards that are views at odd
  offsets) it runs with element-wise accesses, correct but slower.

Launch parameters: ``BLOCK`` elements per program and ``NUM_WARPS`` on a GPU (fixed: the kernel has no
reuse to tune for); a small ``BLOCK`` under ``TRITON_INTERPRET=1`` (CPU), so that tests run in seconds
and tensors span several blocks. Set the variable before this module is imported: ``@triton.jit`` reads
it when the kernel is defined.

State dicts: ``state["step"]`` (int), ``state["exp_avg"]`` and ``state["exp_avg_sq"]`` (float32, the
parameter's shape), as the plain AdamW, so state dicts load both ways. ``torch.optim.Optimizer`` casts
loaded moments to the parameter's dtype; :meth:`FusedAdamW.load_state_dict` takes them from the state dict
again in float32, so nothing is lost for 16-bit parameters.

Limits: parameters must be contiguous (raises otherwise; a non-contiguous gradient is copied); dense
gradients only; CUDA tensors, or CPU tensors under the interpreter only (the table holds raw
addresses, which the interpreter reads in host memory). No ``amsgrad``/``maximize`` options. Not
CUDA-graph capturable: hyper-parameters and bias corrections are host scalars, and a table-cache miss copies
to the device.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from cs336_basics.optimizer import AdamW
from cs336_systems.kernels.launch import FLOAT_DTYPES, Kernel, check_device, interpreting

SUPPORTED_DTYPES = FLOAT_DTYPES

BLOCK: int = 256 if interpreting() else 2048
"""Elements per program. On a GPU, with :data:`NUM_WARPS` 8: 8 elements a thread, two 16-byte vectors per
float32 stream. Chosen from ptxas's register counts for sm_90a, not yet from timings: 64 registers a thread
in float32 (about 100 with bfloat16 parameters) and no spills, so 2 to 4 programs (16 to 32 warps) share an
SM, 50 to 130 KB of reads in flight per SM, and one program's table look-ups overlap the others'
streaming. 16 elements a thread (4096 with 8 warps) took 162 registers: one program per SM."""

NUM_WARPS: int = 8

TABLE_CACHE_SIZE = 8
"""The fewest tables an optimizer keeps (it keeps at least two per launch of a step): one per launch is used
each step; the others absorb gradients that move between two addresses."""

_ROW = tl.constexpr(7)
"""int64 columns per tensor in the table: p, g, exp_avg, exp_avg_sq addresses; numel; first block; the float32 master
weights' address (0 without)."""


# ---------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _adamw_elements(
    P, G, M, V,  # pointers to this tensor's parameter, gradient, exp_avg, exp_avg_sq (elements offs)
    W,  # its float32 master weights (HAS_MASTER), which the update reads and writes; P gets their rounding
    offs, numel,  # int64 (BLOCK,) element offsets; the tensor's element count
    decay, lerp_weight, beta2, beta2_complement, step_size, eps_hat,
    MASKED: tl.constexpr,  # the tensor's last block: some offsets are past numel
    HAS_MASTER: tl.constexpr,
):
    if MASKED:
        mask = offs < numel
    else:
        mask = None
    if HAS_MASTER:
        p = tl.load(W + offs, mask=mask)
    else:
        p = tl.load(P + offs, mask=mask).to(tl.float32)
    g = tl.load(G + offs, mask=mask).to(tl.float32)
    m = tl.load(M + offs, mask=mask)
    v = tl.load(V + offs, mask=mask)
    p = p * decay
    # torch's lerp: start + w * (end - start) for w < 0.5, end - (end - start) * (1 - w) otherwise.
    diff = g - m
    m = tl.where(lerp_weight < 0.5, m + lerp_weight * diff, g - diff * (1.0 - lerp_weight))
    v = v * beta2 + beta2_complement * g * g
    p = p - step_size * tl.div_rn(m, tl.sqrt_rn(v) + eps_hat)
    tl.store(P + offs, p.to(P.dtype.element_ty), mask=mask)
    if HAS_MASTER:
        tl.store(W + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)


@triton.jit
def fused_adamw_kernel(
    Table,  # int64 (n_tensors, 7): addresses of p, g, exp_avg, exp_avg_sq; numel; first block; master weights
    BlockTensor,  # int32 (n_blocks,): the Table row of each program's tensor
    decay,  # 1 - lr * weight_decay
    lerp_weight,  # 1 - beta1
    beta2, beta2_complement,  # beta2, 1 - beta2
    step_size,  # lr * sqrt(1 - beta2^t) / (1 - beta1^t)
    eps_hat,  # eps * sqrt(1 - beta2^t)
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address is a multiple of 16 bytes
    HAS_MASTER: tl.constexpr,  # float32 master weights for every tensor (16-bit parameters)
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = Table + tl.load(BlockTensor + pid).to(tl.int64) * _ROW
    P = tl.load(row + 0).to(tl.pointer_type(PARAM_DTYPE))
    G = tl.load(row + 1).to(tl.pointer_type(GRAD_DTYPE))
    M = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    V = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    numel = tl.load(row + 4)
    W = tl.load(row + 6).to(tl.pointer_type(tl.float32))
    start = (pid - tl.load(row + 5)) * BLOCK  # int64: tensors may exceed 2^31 elements
    if ALIGNED:
        # Addresses read from memory carry no alignment facts: without these, accesses are 4 bytes wide.
        P = tl.multiple_of(P, 16)
        G = tl.multiple_of(G, 16)
        M = tl.multiple_of(M, 16)
        V = tl.multiple_of(V, 16)
        W = tl.multiple_of(W, 16)
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        _adamw_elements(P, G, M, V, W, offs, numel, decay, lerp_weight, beta2, beta2_complement, step_size, eps_hat,
                        MASKED=False, HAS_MASTER=HAS_MASTER)
    else:
        _adamw_elements(P, G, M, V, W, offs, numel, decay, lerp_weight, beta2, beta2_complement, step_size, eps_hat,
                        MASKED=True, HAS_MASTER=HAS_MASTER)


# ---------------------------------------------------------------------------------------------------
# Launch: tables, checks, the functional entry point
# ---------------------------------------------------------------------------------------------------

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


_KERNEL = Kernel(fused_adamw_kernel)


def _launch_config() -> triton.Config:
    return triton.Config({}, num_warps=NUM_WARPS)


class _Tables:
    """The device tables of a launch: ``table`` int64 (n_tensors, 7), ``block_tensor`` int32 (n_blocks,). Built
    without synchronising the host: the rows go over from pinned memory, the block map is expanded on the device."""

    def __init__(self, key: tuple[int, ...], device: torch.device):
        # (p, g, exp_avg, exp_avg_sq addresses, numel, master address)
        rows = [key[i:i + 6] for i in range(0, len(key), 6)]
        counts = [triton.cdiv(row[4], BLOCK) for row in rows]
        firsts = itertools.accumulate(counts, initial=0)
        self.n_blocks = sum(counts)
        self.aligned = all(address % 16 == 0 for row in rows for address in (*row[:4], row[5]))
        pinned = device.type == "cuda"
        host = torch.tensor([(*row[:5], first, row[5]) for row, first in zip(rows, firsts)], dtype=torch.int64)
        self.table = (host.pin_memory() if pinned else host).to(device, non_blocking=pinned)
        counts_host = torch.tensor(counts, dtype=torch.int64)
        counts_device = (counts_host.pin_memory() if pinned else counts_host).to(device, non_blocking=pinned)
        self.block_tensor = torch.repeat_interleave(
            torch.arange(len(rows), dtype=torch.int32, device=device), counts_device, output_size=self.n_blocks)


class TableCache:
    """Launch tables under their (device, BLOCK, addresses and element counts) key, least recently used out."""

    def __init__(self, size: int = TABLE_CACHE_SIZE):
        self.size = size
        self._entries: dict[tuple, _Tables] = {}
        self.misses = 0  # tables built, for tests

    def get(self, device: torch.device, key: tuple[int, ...]) -> _Tables:
        full_key = (device, BLOCK, key)
        tables = self._entries.pop(full_key, None)
        if tables is None:
            self.misses += 1
            tables = _Tables(key, device)
            if len(self._entries) >= self.size:
                del self._entries[next(iter(self._entries))]
        self._entries[full_key] = tables  # (re)inserted last: the most recently used
        return tables

    def clear(self) -> None:
        self._entries.clear()


def _name(tensor_name: str, index: int) -> str:
    return f"{tensor_name}[{index}]"


def _table_key(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
               exp_avg_sqs: Sequence[Tensor], masters: Sequence[Tensor] | None) -> tuple[tuple[int, ...], list[Tensor]]:
    """Check every tensor of a launch against the first parameter and its gradient (dtype, device, shape, layout);
    return the tables' key (per tensor: the addresses of p, g, exp_avg, exp_avg_sq, its element count, the master
    weights' address or 0) and the gradients copied to a contiguous layout, which must live until the kernel has
    run."""
    device, param_dtype, grad_dtype = params[0].device, params[0].dtype, grads[0].dtype
    key, kept = [], []
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if not p.is_contiguous():
            raise ValueError(f"{_name('params', i)} (shape {tuple(p.shape)}, strides {p.stride()}) is not contiguous: "
                             "the fused AdamW updates parameters as flat memory")
        if g.is_sparse:
            raise ValueError(f"{_name('grads', i)} is sparse: the fused AdamW takes dense gradients only")
        if not g.is_contiguous():
            g = g.contiguous()
            kept.append(g)
        if p.dtype != param_dtype or g.dtype != grad_dtype:
            raise TypeError(f"one launch takes one parameter dtype and one gradient dtype: {_name('params', i)} is "
                            f"{p.dtype} with a {g.dtype} gradient, {_name('params', 0)} {param_dtype} with "
                            f"{grad_dtype}")
        for name, t in (("grads", g), ("exp_avgs", m), ("exp_avg_sqs", v)):
            if t.shape != p.shape:
                raise ValueError(f"{_name(name, i)} has shape {tuple(t.shape)}, its parameter {tuple(p.shape)}")
            if t.device != device or p.device != device:
                raise ValueError(f"all tensors of a launch must be on one device: {_name(name, i)} is on {t.device}, "
                                 f"{_name('params', i)} on {p.device}, {_name('params', 0)} on {device}")
        w = masters[i] if masters is not None else None
        for name, t in (("exp_avgs", m), ("exp_avg_sqs", v), ("masters", w)):
            if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.shape != p.shape):
                raise ValueError(f"{_name(name, i)} must be a contiguous float32 tensor of its parameter's shape "
                                 f"{tuple(p.shape)}, got {t.dtype} {tuple(t.shape)} with strides {t.stride()}")
        key += (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), 0 if w is None else w.data_ptr())
    return tuple(key), kept


def fused_adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    masters: Sequence[Tensor] | None = None,
    cache: TableCache | None = None,
) -> None:
    """One AdamW step, in place, for every ``params[i]`` (any shape, contiguous) with gradient ``grads[i]``
    (``params[i]``'s shape, any contiguous layout) and moments ``exp_avgs[i]``, ``exp_avg_sqs[i]`` (float32,
    ``params[i]``'s shape, contiguous), in one kernel launch. ``step`` is the step count after this step
    (1 for the first), the same for all tensors.

    All tensors on one device; the parameters of one dtype (float32, bfloat16 or float16), the gradients
    of one such dtype. ``masters`` (float32, contiguous, ``params[i]``'s shape), when given, are the weights the
    update reads and writes, ``params[i]`` receiving their rounding (16-bit parameters that train as float32).
    ``cache`` keeps the launch tables between calls (a new one each call without it).
    """
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError(f"expected one gradient and two moments per parameter, got {n} parameters, {len(grads)} "
                         f"gradients, {len(exp_avgs)} and {len(exp_avg_sqs)} moments")
    if n == 0:
        return
    device, param_dtype, grad_dtype = params[0].device, params[0].dtype, grads[0].dtype
    check_device(params[0], "the kernels of FusedAdamW", "cs336_systems.kernels.adamw", reads_host_addresses=True)
    for dtype, what in ((param_dtype, "parameter"), (grad_dtype, "gradient")):
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"unsupported {what} dtype {dtype}: the fused AdamW takes float32, bfloat16 or float16")
    addresses, copied_grads = _table_key(params, grads, exp_avgs, exp_avg_sqs, masters)  # copies live to the launch
    tables = (cache or TableCache(1)).get(device, addresses)
    if tables.n_blocks == 0:
        return
    beta1, beta2 = betas
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    has_master = masters is not None
    # The table and the block map are fresh allocations, aligned: the dtypes, the alignment of the addresses in the
    # table, the master weights and BLOCK determine the compilation.
    key = (param_dtype, grad_dtype, tables.aligned, has_master, BLOCK)
    args = (tables.table, tables.block_tensor, float(1 - lr * weight_decay), float(1 - beta1), float(beta2),
            float(1 - beta2), float(lr * bias_correction2_sqrt / (1 - beta1**step)), float(eps * bias_correction2_sqrt))
    constexprs = dict(PARAM_DTYPE=_TL_DTYPES[param_dtype], GRAD_DTYPE=_TL_DTYPES[grad_dtype], ALIGNED=tables.aligned,
                      HAS_MASTER=has_master, BLOCK=BLOCK)
    # Triton launches on the current device, which need not be the tensors'.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _KERNEL(key, lambda tiles: (tables.n_blocks,), args, constexprs, _launch_config)
    del copied_grads


# ---------------------------------------------------------------------------------------------------
# The optimizer
# ---------------------------------------------------------------------------------------------------


class FusedAdamW(AdamW):
    """``cs336_basics.optimizer.AdamW`` with every step done by :func:`fused_adamw_`: one kernel launch per
    (device, parameter dtype, gradient dtype, step count, hyper-parameters) group, usually one per param group.

    Same constructor, validation, param groups and update; parameters without a gradient are skipped.
    State per parameter: ``step`` (int), ``exp_avg`` and ``exp_avg_sq`` (float32, the parameter's shape, for
    every parameter dtype). Parameters: float32, bfloat16 or float16, contiguous, on a CUDA device (or the CPU
    under ``TRITON_INTERPRET=1``); gradients of any of those dtypes.

    ``master_weights=True``: each 16-bit parameter also has ``master``, a float32 copy (made from it at the first
    step) that the update reads and writes, the parameter receiving its rounding: the model computes with 16-bit
    weights (no casts under autocast, 16-bit gradients) and trains float32 ones, for the same 28 bytes a parameter
    per step as a float32 parameter.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 master_weights: bool = False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)  # the plain one's checks
        self.master_weights = master_weights
        self._tables = TableCache()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._tables = TableCache()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        launches: dict[tuple, tuple[list[Tensor], list[Tensor], list[dict]]] = {}
        for group in self.param_groups:
            hyper = (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"])
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                           memory_format=torch.contiguous_format)
                    if self.master_weights and p.dtype != torch.float32:
                        state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format)
                key = (p.device, p.dtype, g.dtype, state["step"] + 1, hyper, "master" in state)
                members = launches.get(key)
                if members is None:
                    members = launches[key] = ([], [], [])
                members[0].append(p)
                members[1].append(g)
                members[2].append(state)
        # Room for every launch's tables (per-layer param groups, say) and for gradients moving between two places.
        self._tables.size = max(TABLE_CACHE_SIZE, 2 * len(launches))
        for (_, _, _, step, (lr, betas, eps, weight_decay), master), (params, grads, states) in launches.items():
            fused_adamw_(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                         step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         masters=[s["master"] for s in states] if master else None, cache=self._tables)
            for state in states:
                state["step"] = step
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, then the moments again from ``state_dict`` in float32
        (the base class has rounded them to the parameter's dtype) and ``step`` as an int (``torch.optim.AdamW``
        saves a tensor)."""
        super().load_state_dict(state_dict)
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for param_id, p in zip(saved_group["params"], group["params"]):
                saved = state_dict["state"].get(param_id)
                if saved is None:
                    continue
                state = self.state[p]
                state["step"] = int(saved["step"])
                for name in ("exp_avg", "exp_avg_sq", "master"):
                    if name in saved:
                        state[name] = torch.empty(p.shape, dtype=torch.float32, device=p.device).copy_(saved[name])

