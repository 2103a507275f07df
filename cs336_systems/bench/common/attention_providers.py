"""Attention implementations raced against each other, and how they are timed and checked: the code shared by
``leaderboard``, ``flash_benchmarking`` and ``flash_log``.

A provider is a function ``fn(q, k, v, is_causal) -> o`` on tensors of shape ``(batch_heads, seq, d)`` (heads
folded into the batch, as the leaderboard's ``(16, 16384, 64)``), found by name in :data:`PROVIDERS`. Where a
provider runs one of the library's attentions, :data:`LIBRARY_NAMES` gives its
:func:`cs336_systems.attention.get_attention`
name, which :func:`get_provider` and the tools' ``--providers`` also accept; rows keep the provider names
(committed results use them):

- ``ours``: library name ``triton``; ``FlashAttention2Triton.apply``, eager
- ``ours_compiled``: ``torch.compile(FlashAttention2Triton.apply)``: the leaderboard's protocol
- ``flash_pytorch``: library name ``flash_pytorch``; the tiled PyTorch FlashAttention-2 (a Python loop over tiles:
  slow)
- ``naive``: library name ``naive``; the model's plain attention (the full score matrix, masked softmax)
- ``naive_compiled``: library name ``compiled``; ``torch.compile`` of ``naive``
- ``sdpa_cudnn``, ``sdpa_flash``, ``sdpa_efficient``: PyTorch's ``scaled_dot_product_attention``
  restricted to one backend with ``torch.nn.attention.sdpa_kernel`` (cuDNN, FlashAttention-2 CUDA,
  memory-efficient), on the inputs viewed as ``(1, batch_heads, seq, d)``

Timing is ``triton.testing.do_bench`` on a GPU (CUDA events, L2 flushed before each call; we read every
sample and report the mean, do_bench's default, and the median and 20th/80th percentiles); on a CPU a
timer loop with the same warm-up/repetition budget stands in.

Phases: ``fwd`` is one forward on inputs that require gradients (so it saves what backward needs); ``bwd`` is
``torch.autograd.grad(o, (q, k, v), dO)`` of one retained forward with a random ``dO``; ``fwd_bwd`` is the two
together. With ``sum_backward`` (the leaderboard's protocol) ``fwd_bwd`` is ``f(q, k, v, True).sum().backward()``
instead, gradients accumulating into ``.grad`` as the official timing does.
"""

from __future__ import annotations

import dataclasses
import contextlib
import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from cs336_systems.bench.common import cli, result_store, timing

AttentionFn = Callable[[Tensor, Tensor, Tensor, bool], Tensor]
PHASES = ("fwd", "bwd", "fwd_bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# ---------------------------------------------------------------------------------------------------
# Providers
# ---------------------------------------------------------------------------------------------------


# SDPA backends with CUDA kernels only (its flash backend has a CPU kernel too), by their readable names.
SDPA_CUDA_ONLY = {"CUDNN_ATTENTION": "cuDNN", "EFFICIENT_ATTENTION": "memory-efficient"}


@dataclass(frozen=True)
class Provider:
    """One attention implementation: how to build it, and which ``sdpa_kernel`` backend (if any) it pins."""

    name: str
    description: str
    build: Callable[[], AttentionFn]
    sdpa_backend: str | None = None  # a member of torch.nn.attention.SDPBackend
    triton: bool = False  # runs our Triton kernels: needs a GPU (the CPU interpreter is far too slow to time)

    def context(self) -> contextlib.AbstractContextManager:
        """Entered around every call: pins the SDPA backend (a no-op for our own implementations)."""
        if self.sdpa_backend is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, self.sdpa_backend))

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why this provider cannot run on ``device`` at all (None when it can)."""
        if self.triton and device.type != "cuda":
            return "our Triton kernels need a CUDA GPU to be timed (the Triton CPU interpreter is far too slow)"
        if self.sdpa_backend in SDPA_CUDA_ONLY and device.type != "cuda":
            return f"SDPA's {SDPA_CUDA_ONLY[self.sdpa_backend]} backend has no CPU kernel: skipped"
        return None


def _ours() -> AttentionFn:
    from cs336_systems.attention.op import FlashAttention2Triton

    return FlashAttention2Triton.apply


@functools.cache
def _ours_compiled() -> AttentionFn:
    # Exactly the leaderboard's wrapper; one per process so that every caller shares its compiled graphs.
    from cs336_systems.attention.op import FlashAttention2Triton

    _keep_compiled_backward_reusable()
    return torch.compile(FlashAttention2Triton.apply)


def _flash_pytorch() -> AttentionFn:
    from cs336_systems.attention import get_attention

    _keep_compiled_backward_reusable()  # its backward is compiled too
    return get_attention(LIBRARY_NAMES["flash_pytorch"])


def _naive() -> AttentionFn:
    from cs336_systems.attention import get_attention

    return get_attention(LIBRARY_NAMES["naive"])


def _keep_compiled_backward_reusable() -> None:
    """The backward phase is timed by re-running one graph's backward (``retain_graph=True``), which
    compiled backwards refuse while they donate their saved buffers; donation only saves memory."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False


def _naive_compiled() -> AttentionFn:
    from cs336_systems.attention import get_attention

    _keep_compiled_backward_reusable()
    return get_attention(LIBRARY_NAMES["naive_compiled"])


def _sdpa(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True) -> Tensor:
    """SDPA on ``(batch_heads, seq, d)`` inputs viewed as one batch of ``batch_heads`` heads."""
    if q.dim() == 3:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # (1, batch_heads, seq, d)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in [
        Provider("ours", "FlashAttention2Triton.apply (eager)", _ours, triton=True),
        Provider("ours_compiled", "torch.compile(FlashAttention2Triton.apply)", _ours_compiled, triton=True),
        Provider("flash_pytorch", "tiled PyTorch FlashAttention-2", _flash_pytorch),
        Provider("naive", "plain PyTorch attention (eager)", _naive),
        Provider("naive_compiled", "plain PyTorch attention (torch.compile)", _naive_compiled),
        Provider("sdpa_cudnn", "SDPA, cuDNN backend", lambda: _sdpa, sdpa_backend="CUDNN_ATTENTION"),
        Provider("sdpa_flash", "SDPA, flash backend (FlashAttention-2 CUDA)", lambda: _sdpa,
                 sdpa_backend="FLASH_ATTENTION"),
        Provider("sdpa_efficient", "SDPA, memory-efficient backend", lambda: _sdpa,
                 sdpa_backend="EFFICIENT_ATTENTION"),
    ]
}


# Provider (row) name -> the library's name of the same implementation (cs336_systems.attention.get_attention).
LIBRARY_NAMES = {"ours": "triton", "flash_pytorch": "flash_pytorch", "naive": "naive", "naive_compiled": "compiled"}


def provider_name(name: str) -> str:
    """The provider called ``name``, or the provider of the library's attention called ``name`` (``triton`` is
    ``ours``)."""
    by_library_name = {library: provider for provider, library in LIBRARY_NAMES.items()}
    return name if name in PROVIDERS else by_library_name.get(name, name)


def get_provider(name: str) -> Provider:
    name = provider_name(name)
    if name not in PROVIDERS:
        raise ValueError(f"unknown provider {name!r}; choose one of {', '.join(PROVIDERS)} "
                         f"(or a library name: {', '.join(LIBRARY_NAMES.values())})")
    return PROVIDERS[name]


def choose_tiles(fixed_tiles: bool = False, autotune: bool = False, fp32_products: str | None = None) -> None:
    """Set our attention's configuration for a flash tool: ``CS336_FLASH_KERNELS``, ``CS336_FLASH_AUTOTUNE`` and
    ``CS336_FLASH_FP32`` (see :class:`cs336_systems.attention.config.FlashConfig`), then ``--fixed-tiles`` or
    ``--autotune`` and ``--fp32-products``, which win."""
    from cs336_systems.attention.config import FLASH_CONFIG, FlashConfig

    config = FlashConfig.from_environment()
    if fixed_tiles or autotune:
        config = dataclasses.replace(config, autotune=autotune and not fixed_tiles)
    if fp32_products is not None:
        config = dataclasses.replace(config, fp32_products=fp32_products)
    FLASH_CONFIG.set(config)


def autotuning() -> bool:
    """Whether our kernels' tiles are autotuned."""
    from cs336_systems.attention.config import FLASH_CONFIG

    return FLASH_CONFIG.get().autotune


# ---------------------------------------------------------------------------------------------------
# Inputs and timing
# ---------------------------------------------------------------------------------------------------


def make_inputs(
    batch_heads: int, seq_len: int, d_head: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[Float[Tensor, "bh seq d"], Float[Tensor, "bh seq d"], Float[Tensor, "bh seq d"]]:
    """Random ``q, k, v`` requiring gradients. As the official leaderboard timing does, they are the three
    slices of one ``(3, batch_heads, seq_len, d_head)`` leaf, so their gradients land in one tensor."""
    generator = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(3, batch_heads, seq_len, d_head, device=device, dtype=dtype, generator=generator)
    q, k, v = qkv.requires_grad_(True)
    return q, k, v


def head_inputs(batch: int, heads: int, n_queries: int, n_keys: int, head_dim: int, heads_in_columns: bool = False,
                seed: int = 0, with_output_grad: bool = False) -> tuple[Float[Tensor, "batch heads seq d"], ...]:
    """Random bf16 ``q, k, v`` (and ``dO`` of q's shape, ``with_output_grad``) of shape ``(batch, heads, seq, d)`` on
    the current CUDA device, drawn in that order from one generator seeded with ``seed``; ``heads_in_columns``: each
    a ``(batch, seq, heads, d)`` tensor transposed, as attention layers make them."""
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def randn(n: int) -> Tensor:
        shape = (batch, n, heads, head_dim) if heads_in_columns else (batch, heads, n, head_dim)
        x = torch.randn(*shape, device="cuda", generator=generator, dtype=torch.bfloat16)
        return x.transpose(1, 2) if heads_in_columns else x
    lengths = (n_queries, n_keys, n_keys, n_queries) if with_output_grad else (n_queries, n_keys, n_keys)
    return tuple(randn(n) for n in lengths)


def cudnn_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True) -> Tensor:
    """SDPA pinned to its cuDNN backend, on ``(batch, heads, seq, d)`` inputs."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def reset_grads(*tensors: Tensor) -> None:
    """Drop the gradients accumulated into these tensors, or into the leaves they are views of."""
    for x in tensors:
        leaf = x if x._base is None else x._base
        if leaf.is_leaf:
            leaf.grad = None


def phase_callable(
    phase: str, fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, sum_backward: bool = False
) -> Callable[[], Any]:
    """The zero-argument function timed for ``phase`` (see the module docstring)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; choose from {PHASES}")
    if phase == "fwd":
        return lambda: fn(q, k, v, causal)
    if phase == "fwd_bwd" and sum_backward:
        return lambda: fn(q, k, v, causal).sum().backward()
    o = fn(q, k, v, causal)
    grad_out = torch.randn_like(o)
    if phase == "bwd":
        return lambda: torch.autograd.grad(o, (q, k, v), grad_out, retain_graph=True)
    del o
    return lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), grad_out)


class Unsupported(Exception):
    """An SDPA backend refused the input (dtype, head dim, device): a row with an error, not a crash."""


@contextlib.contextmanager
def _sdpa_refusals_as_unsupported(provider: Provider) -> Any:
    """Turn an SDPA backend's refusal into :class:`Unsupported`, with the reasons PyTorch warned about."""
    if provider.sdpa_backend is None:
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except RuntimeError as error:
            if result_store.is_oom(error):
                raise
            reasons = [str(w.message).splitlines()[0] for w in caught]
            message = "; ".join([str(error).splitlines()[0], *dict.fromkeys(reasons)])
            raise Unsupported(message[:500]) from error


def time_phases(
    provider: Provider,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    device: torch.device,
    phases: Iterable[str] = PHASES,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    causal: bool = True,
    sum_backward: bool = False,
    fn: AttentionFn | None = None,
) -> dict[str, Any]:
    """``{phase}_ms`` (and median, quantiles, samples) for each phase of ``provider`` on ``q, k, v``.

    Out of memory in a phase ends the measurement with what was measured so far and ``"oom": true,
    "oom_phase": phase``; an SDPA backend that refuses the input gives ``{"error": ..., "unsupported": true}``.
    Other errors propagate. ``fn`` overrides the provider's function (already built by the caller).
    """
    fn = fn or provider.build()
    result: dict[str, Any] = {"oom": False}
    for phase in phases:
        def measure(phase=phase) -> dict[str, Any]:
            with provider.context():
                timed = phase_callable(phase, fn, q, k, v, causal, sum_backward)
                return timing.do_bench_ms(timed, device, warmup_ms, rep_ms, prefix=f"{phase}_")

        try:
            with _sdpa_refusals_as_unsupported(provider):
                measured = result_store.measure_or_oom(measure)
        except Unsupported as error:
            return {"error": str(error), "unsupported": True}
        reset_grads(q, k, v)
        if measured.pop("oom"):
            result.update(oom=True, oom_phase=phase, error=measured["error"])
            break
        result.update(measured)
    return result


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing (an error or out-of-memory row)."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


# ---------------------------------------------------------------------------------------------------
# Checks: right answers, our kernels, no graph breaks
# ---------------------------------------------------------------------------------------------------


def _forward_backward(fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype | None = None):
    """``o`` and ``dq, dk, dv`` of ``fn(q, k, v, True).sum()`` on fresh leaf copies (cast to ``dtype``), each
    of shape ``(batch_heads, seq, d)``."""
    leaves = [x.detach().to(dtype or x.dtype).clone().requires_grad_(True) for x in (q, k, v)]
    o = fn(*leaves, True)
    o.sum().backward()
    return [o.detach().reshape(q.shape)] + [x.grad for x in leaves]


def _sdpa_math(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True) -> Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return _sdpa(q, k, v, is_causal)


def relative_errors(outputs: list[Tensor], reference: list[Tensor]) -> dict[str, float]:
    """``max |x - ref| / max |ref|`` for ``o, dq, dk, dv``, computed in float32."""
    errors = {}
    for name, x, ref in zip(("o", "dq", "dk", "dv"), outputs, reference):
        ref = ref.float()
        errors[name] = ((x.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
    return errors


def errors_acceptable(ours: dict[str, float], sdpa: dict[str, float], factor: float = 3.0, floor: float = 1e-2) -> bool:
    """Ours is right when each of its errors is within ``factor`` times SDPA's own error at the same
    precision (against the same float32 reference), or below ``floor``: bf16 rounding alone is ~4e-3."""
    return all(ours[name] <= max(factor * sdpa[name], floor) for name in ours)


def check_against_sdpa(
    fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor, reference_bytes: float = 2e9
) -> dict[str, Any]:
    """Outputs and gradients of ``fn(q, k, v, True).sum()`` and of SDPA (its default backend choice), both at
    the inputs' precision, against SDPA's math backend in float32 (unfused, no TF32): ``{"max_rel_err",
    "sdpa_max_rel_err", "matches_sdpa", "checked_heads"}``.

    Heads are independent, so the float32 reference covers only as many leading heads as fit one
    ``reference_bytes`` score matrix (one head at the leaderboard's length); ``fn`` and SDPA run on all of them.
    """
    seq_len = q.shape[-2]
    heads = max(1, min(q.shape[0], int(reference_bytes // (4 * seq_len * k.shape[-2]))))
    reference = _forward_backward(_sdpa_math, q[:heads], k[:heads], v[:heads], torch.float32)
    ours = relative_errors([x[:heads] for x in _forward_backward(fn, q, k, v)], reference)
    sdpa = relative_errors([x[:heads] for x in _forward_backward(_sdpa, q, k, v)], reference)
    return {"max_rel_err": ours, "sdpa_max_rel_err": sdpa, "matches_sdpa": errors_acceptable(ours, sdpa),
            "checked_heads": heads}


def graph_break_count() -> dict[str, Any]:
    """Graph breaks (and their reasons, first lines) and graphs that dynamo counted since its counters were
    last cleared."""
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "graph_break_reasons": [reason.splitlines()[0][:200] for reason in counters["graph_break"]],
        "graphs": counters["stats"].get("unique_graphs", 0),
    }


def clear_graph_break_count() -> None:
    from torch._dynamo.utils import counters

    counters.clear()


def first_call_graph_breaks(compiled_fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor) -> dict[str, Any]:
    """:func:`graph_break_count` of the first call of ``compiled_fn(q, k, v, True).sum().backward()``, on the
    very tensors that are timed afterwards (their gradients are then reset).

    Dynamo counts graph breaks while it compiles, and it keeps what it compiled for a function's code across
    ``torch.compile`` wrappers, so its caches are reset first: everything compiled so far compiles again."""
    torch._dynamo.reset()
    clear_graph_break_count()
    compiled_fn(q, k, v, True).sum().backward()
    reset_grads(q, k, v)
    return graph_break_count()


def our_kernel_names() -> set[str]:
    """Names of the Triton and Gluon kernels in our attention modules (autotuner wrappers unwrapped)."""
    import triton

    from cs336_systems.attention.backends import hopper_kernels, triton_kernels

    names = set()
    for module in (triton_kernels, hopper_kernels):
        for obj in vars(module).values():
            while isinstance(obj, triton.runtime.KernelInterface) and not isinstance(obj, triton.runtime.JITFunction):
                obj = obj.fn
            if isinstance(obj, triton.runtime.JITFunction):
                names.add(obj.__name__)
    return names


def launched_kernels(call: Callable[[], Any]) -> list[str]:
    """Names of the GPU kernels that one ``call()`` launches, in order of first launch (empty on a CPU)."""
    if not torch.cuda.is_available():
        return []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return list(dict.fromkeys(kernels))


FOREIGN_ATTENTION_KERNELS = ("fmha", "flash_fwd", "flash_bwd", "cudnn", "sdpa", "attention")


def classify_kernels(kernels: list[str], ours: set[str]) -> dict[str, list[str]]:
    """Split launched kernel names into ours (a name containing one of our kernels' names) and other attention
    kernels (names that look like a library's fused attention: a fallback where ours should run)."""
    mine = [name for name in kernels if any(own in name for own in ours)]
    foreign = [name for name in kernels
               if name not in mine and any(t in name.lower() for t in FOREIGN_ATTENTION_KERNELS)]
    return {"our_kernels": mine, "foreign_attention_kernels": foreign}


def runs_our_kernels(fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor) -> dict[str, Any]:
    """Which kernels one ``fn(q, k, v, True).sum().backward()`` launches: ``our_kernels`` must hold at least a
    forward and a backward kernel of ours, and ``foreign_attention_kernels`` must be empty."""
    kernels = launched_kernels(lambda: _forward_backward(fn, q, k, v))
    found = classify_kernels(kernels, our_kernel_names())
    found["kernels_ok"] = len(found["our_kernels"]) >= 2 and not found["foreign_attention_kernels"]
    if not found["kernels_ok"]:
        found["launched_kernels"] = kernels[:40]  # to see what ran instead
    return found


# ---------------------------------------------------------------------------------------------------
# The leaderboard protocol (``leaderboard``, ``flash_log``)
# ---------------------------------------------------------------------------------------------------


# Row name -> provider: ours is timed through the compiled wrapper, as the protocol says.
LEADERBOARD_PROVIDERS = {
    "ours": "ours_compiled",
    "sdpa_cudnn": "sdpa_cudnn",
    "sdpa_flash": "sdpa_flash",
    "sdpa_efficient": "sdpa_efficient",
}
# The official shape: q, k, v of shape (16, 16384, 64), bf16, causal.
LEADERBOARD_HEADS, LEADERBOARD_SEQ_LEN, LEADERBOARD_D_HEAD, LEADERBOARD_DTYPE = 16, 16384, 64, "bf16"


def verify_ours(fn: AttentionFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """The checks of the compiled wrapper (module docstring), as row fields; ``verified`` sums them up.
    Must run before ``fn`` is first called, so that the graph-break count sees its compilation."""
    checks = first_call_graph_breaks(fn, q, k, v)
    clear_graph_break_count()  # from here on, any recompilation counts in graph_breaks_after_first_call
    checks.update(runs_our_kernels(fn, q, k, v))
    checks.update(check_against_sdpa(fn, q, k, v))
    # Our kernels are PyTorch operators: the compiled Function must be one graph.
    checks["verified"] = checks["graph_breaks"] == 0 and checks["kernels_ok"] and checks["matches_sdpa"]
    return checks


def measure_leaderboard_provider(
    name: str, q, k, v, device: torch.device, rep_ms: float, warmup_ms: float, phases=("fwd_bwd", "fwd"),
    verify: bool = True,
) -> dict[str, Any]:
    """The row fields of leaderboard provider ``name``: checks (ours), timings of ``phases`` (fwd+bwd is the
    protocol's ``o.sum().backward()``), or an error."""
    provider = get_provider(LEADERBOARD_PROVIDERS[name])
    reason = provider.unavailable_reason(device)
    if reason:
        return {"error": reason, "unsupported": True}
    fn = provider.build()
    result: dict[str, Any] = {"implementation": provider.description}
    if provider.triton:
        result["autotune"] = autotuning()
        if verify:
            result.update(verify_ours(fn, q, k, v))
    result.update(time_phases(provider, q, k, v, device, phases, warmup_ms, rep_ms, sum_backward=True, fn=fn))
    if provider.triton and verify:
        # Recompilations after the first call (in the checks or the timing) must not break the graph either.
        result["graph_breaks_after_first_call"] = graph_break_count()["graph_breaks"]
        result["verified"] = result["verified"] and result["graph_breaks_after_first_call"] == 0
    return result


def add_ratios(results: dict[str, dict[str, Any]]) -> None:
    """``ours_over_this_fwd_bwd`` (and ``_fwd``) in each SDPA row, and ``ratios`` (``{provider: ours / it}``,
    fwd+bwd) in ours."""
    ours = results.get("ours", {})
    for name, result in results.items():
        if name == "ours":
            continue
        for phase in ("fwd_bwd", "fwd"):
            result[f"ours_over_this_{phase}"] = ratio(ours.get(f"{phase}_ms"), result.get(f"{phase}_ms"))
    if ours:
        ours["ratios"] = {name: r["ours_over_this_fwd_bwd"] for name, r in results.items() if name != "ours"}


def measure_leaderboard(
    providers: list[str], heads: int, seq_len: int, d_head: int, dtype: str, device: torch.device, rep_ms: float,
    warmup_ms: float, phases=("fwd_bwd", "fwd"), verify: bool = True,
) -> dict[str, dict[str, Any]]:
    """:func:`measure_leaderboard_provider` of each provider on one set of inputs ``(heads, seq_len, d_head)``, with
    the ratios."""
    q, k, v = make_inputs(heads, seq_len, d_head, DTYPES[dtype], device)
    results = {}
    for name in cli.progress(providers, "leaderboard"):
        results[name] = measure_leaderboard_provider(name, q, k, v, device, rep_ms, warmup_ms, phases, verify)
        timing.free_memory()
    add_ratios(results)
    return results


# ---------------------------------------------------------------------------------------------------
# One provider, or several, at one shape (``flash_benchmarking``, ``flash_log``)
# ---------------------------------------------------------------------------------------------------


def measure_provider(
    provider_name: str, q, k, v, device: torch.device, rep_ms: float, warmup_ms: float, phases=PHASES
) -> dict[str, Any]:
    """One provider's phases on ``q, k, v`` (row fields: times, or ``oom``, or an ``error``)."""
    provider = get_provider(provider_name)
    reason = provider.unavailable_reason(device)
    if reason:
        return {"error": reason, "unsupported": True}
    result = time_phases(provider, q, k, v, device, phases, warmup_ms, rep_ms)
    if provider.triton:
        result["autotune"] = autotuning()
    return result


def measure_shape(
    providers: list[str], seq_len: int, d_head: int, dtype: str, device: torch.device, rep_ms: float,
    warmup_ms: float, phases: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, dict[str, Any]]:
    """:func:`measure_provider` of each provider on one batch-1 causal input (``phases[provider]`` narrows what
    is timed; default: every phase). Used by ``flash_log`` for its sweep points."""
    q, k, v = make_inputs(1, seq_len, d_head, DTYPES[dtype], device)
    results = {}
    for name in providers:
        results[name] = measure_provider(name, q, k, v, device, rep_ms, warmup_ms, (phases or {}).get(name, PHASES))
        timing.free_memory()
    return results
