"""The language model under benchmark: named sizes, random batches, and one training step in phases.

Shared by every tool that runs ``BasicsTransformerLM`` (end-to-end timing, profiling, memory,
``torch.compile``, the data-parallel benchmarks), so that all of them time the same step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from cs336_basics.model import BasicsTransformerLM
from cs336_basics.nn_utils import cross_entropy
from cs336_systems.attention import get_attention
from cs336_systems.bench.common import flops, timing
# The sizes' table lives in model_sizes; the tools import it from here too.
from cs336_systems.bench.common.model_sizes import SIZES, TINY, VOCAB_SIZE, estimated_oom  # noqa: F401
from cs336_systems.train import step as train_step
from cs336_systems.train.step import phase_timer

MODES = ("forward", "forward_backward", "train_step")
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class LMConfig:
    size: str
    context_length: int
    batch_size: int = 4

    @property
    def hparams(self) -> dict[str, int]:
        if self.size not in SIZES:
            raise ValueError(f"unknown model size {self.size!r}; choose one of {', '.join(SIZES)}")
        return SIZES[self.size]


def build_model(config: LMConfig, device: torch.device, attention: str = "naive") -> BasicsTransformerLM:
    """A randomly initialised float32 model of ``config.size`` on ``device``."""
    model = BasicsTransformerLM(
        vocab_size=VOCAB_SIZE,
        context_length=config.context_length,
        rope_theta=10_000.0,
        attention_fn=get_attention(attention),
        device=device,
        **config.hparams,
    )
    return model


def random_batch(config: LMConfig, device: torch.device, generator_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids ``(batch, seq)`` and targets of the same shape."""
    gen = torch.Generator(device="cpu").manual_seed(generator_seed)
    tokens = torch.randint(0, VOCAB_SIZE, (config.batch_size, config.context_length + 1), generator=gen)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Mixed-precision autocast to ``dtype``, or a ``nullcontext`` for full precision."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_step(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    mode: str,
    dtype: torch.dtype | None,
    optimizer: torch.optim.Optimizer | None = None,
    phase_range: Callable[[str], contextlib.AbstractContextManager] | None = None,
) -> Callable[[dict[str, float] | None], None]:
    """One step of ``mode`` as a function ``step(phase_seconds)``.

    ``forward``: the logits (with autograd recording, as in training). ``forward_backward``: forward,
    loss, backward.
    ``train_step``: forward, loss, backward, ``optimizer.step()``. When ``phase_seconds`` is a dict,
    the device is synchronised after each phase and its wall time added under ``forward``,
    ``backward`` and ``optimizer``. ``phase_range(name)`` (e.g. an NVTX range) wraps each phase.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "train_step" and optimizer is None:
        raise ValueError("train_step needs an optimizer")
    x, y = batch
    device = x.device

    def forward():
        with autocast(device, dtype):
            logits = model(x)
            return cross_entropy(logits, y) if mode != "forward" else logits

    def step(phase_seconds: dict[str, float] | None = None) -> None:
        timed = phase_timer(device, phase_seconds, phase_range)
        out = timed("forward", forward)
        if mode == "forward":
            return
        timed("backward", out.backward)
        if mode == "train_step":
            timed("optimizer", lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)))
        else:
            model.zero_grad(set_to_none=True)

    return step


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The ``cs336_basics`` AdamW with the training step's hyper-parameters."""
    return train_step.make_optimizer(model.parameters(), "basics")


def measure_case(
    config: LMConfig, mode: str, dtype: str, warmup: int, steps: int, device: torch.device,
    attention: str = "naive", compile_model: bool | str = False, model=None,
) -> dict[str, Any]:
    """Time one (size, mode, dtype) case: per-step and per-phase seconds, summarised in ms.

    ``compile_model``: False for eager, True (inductor) or a ``torch.compile`` backend name. A case whose weights
    and optimizer state alone exceed the device's memory is an out-of-memory row without trying.
    """
    too_large = estimated_oom(config.size, mode, device)
    if too_large:
        return too_large
    model = model if model is not None else build_model(config, device, attention)
    if compile_model:
        runner = torch.compile(model, backend="inductor" if compile_model is True else compile_model)
    else:
        runner = model
    optimizer = make_optimizer(model) if mode == "train_step" else None
    step = make_step(runner, random_batch(config, device), mode, DTYPES[dtype], optimizer)
    phases: list[dict[str, float]] = []
    step_seconds: list[float] = []

    def timed_step():
        phase_seconds: dict[str, float] = {}
        step(phase_seconds)
        phases.append(phase_seconds)
        step_seconds.append(sum(phase_seconds.values()))

    for _ in range(warmup):
        step(None)
    timing.synchronize(device)
    for _ in range(steps):
        timed_step()
    result: dict[str, Any] = {**timing.summarize_ms(step_seconds), "step_ms": [s * 1e3 for s in step_seconds]}
    for phase in ("forward", "backward", "optimizer"):
        if phase in phases[0]:
            result.update(timing.summarize_ms([p[phase] for p in phases], prefix=f"{phase}_"))
    del optimizer
    return result


def measure_stack(
    config: LMConfig, stack: str, dtype: str, warmup: int, steps: int, device: torch.device
) -> dict[str, Any]:
    """Time the training step of a named stack of :mod:`cs336_systems.train` (``ours`` or ``torch``) like
    :func:`measure_case` times a ``train_step``: per-step and per-phase seconds, summarised in ms."""
    from cs336_systems.train import build_training_step

    too_large = estimated_oom(config.size, "train_step", device)
    if too_large:
        return too_large

    step = build_training_step(build_model(config, device), stack, autocast_dtype=DTYPES[dtype])
    x, y = random_batch(config, device)
    for _ in range(warmup):
        step(x, y)
    timing.synchronize(device)
    phases: list[dict[str, float]] = []
    for _ in range(steps):
        phases.append({})
        step(x, y, phases[-1])
    result: dict[str, Any] = {**timing.summarize_ms([sum(p.values()) for p in phases])}
    result["step_ms"] = [sum(p.values()) * 1e3 for p in phases]
    for phase in ("forward", "backward", "optimizer"):
        result.update(timing.summarize_ms([p[phase] for p in phases], prefix=f"{phase}_"))
    return result


def add_flops(result: dict[str, Any], config: LMConfig, mode: str, peak_tflops: float | None) -> None:
    """Add the step's model FLOPs (``flops``), the matmul rate and the MFU to a measured row."""
    h = config.hparams
    total = flops.lm_forward_flops(
        VOCAB_SIZE, h["d_model"], h["d_ff"], h["num_layers"], config.batch_size, config.context_length
    ) * flops.FLOPS_MULTIPLIER[mode]
    result["flops"] = total
    result["peak_tflops"] = peak_tflops
    if peak_tflops and not result.get("oom"):
        result["mfu"] = total / (result["median_ms"] / 1e3) / (peak_tflops * 1e12)


class CastTo(nn.Module):
    """Parametrization: a weight read in forward is its fp32 master cast to ``dtype``."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(self.dtype)


def read_weights_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` (changed in place) computing with every ``weight`` (norm gains too) cast to ``dtype`` from its fp32
    master: the one-process reference of a mixed-precision sharded step. ``master_name`` maps the parameters'
    names back to the plain model's."""
    for module in list(model.modules()):
        if "weight" in module._parameters:
            parametrize.register_parametrization(module, "weight", CastTo(dtype), unsafe=True)
    return model


def master_name(name: str) -> str:
    """The plain model's name of a parameter of :func:`read_weights_in`'s model."""
    return name.replace(".parametrizations.weight.original", ".weight")

