"""One training step of ``BasicsTransformerLM`` composed from named parts (SPEC section 9).

A step is forward, loss, backward and the optimizer's update, under bf16 autocast by default. Each part is
chosen by name in :class:`Parts`, so that the two stacks the benchmarks race differ only where they say:

| part | choices |
|---|---|
| ``attention`` | any :func:`cs336_systems.attention.get_attention` name: ``triton`` (our operator), ``sdpa``, ``naive`` |
| ``rmsnorm`` | ``plain`` (``cs336_basics``) or ``fused`` (our Triton kernel, writing the autocast dtype) |
| ``loss`` | ``plain``: the LM head, then ``F.cross_entropy`` on the full logits; ``fused``: our LM head + cross-entropy, chunked over tokens, which never holds the logits |
| ``optimizer`` | ``basics`` (``cs336_basics`` AdamW, a Python loop), ``torch_fused`` / ``torch_foreach`` (``torch.optim.AdamW(fused=True)`` / ``foreach=True``) or ``fused`` (our Triton AdamW) |
| ``compile`` | ``none``, ``blocks`` (``torch.compile`` of each Transformer block and of the loss head: compiles one block's graph once, whatever the depth) or ``model`` (the whole forward and loss as one graph) |
| ``checkpointing`` | activation checkpointing group size (0: off; see ``BasicsTransformerLM.set_activation_checkpointing``) |

:data:`STACKS` names the two compared stacks: ``ours`` (our attention operator, fused RMSNorm, fused
cross-entropy, fused AdamW, compiled) and ``torch`` (PyTorch's best for the same model: SDPA, the plain RMSNorm
and cross-entropy compiled, ``torch.optim.AdamW(fused=True)``). Every stack trains the same function: the model's
input/output behaviour and the AdamW hyper-parameters are the same.

    step = build_training_step(model, STACKS["ours"])
    loss = step(token_ids, targets)                     # one full training step
    step(token_ids, targets, phase_seconds := {})       # the same, timed per phase (synchronising)
"""

from __future__ import annotations

import contextlib
import timeit
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor, nn

from cs336_basics.model import BasicsTransformerLM
from cs336_basics.optimizer import AdamW
from cs336_systems.attention import get_attention

ADAMW_HYPERPARAMETERS = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
COMPILE_MODES = ("none", "blocks", "model")
OPTIMIZERS = ("basics", "torch_fused", "torch_foreach", "fused")


@dataclass(frozen=True)
class Parts:
    """The named parts of a training step (module docstring)."""

    attention: str = "sdpa"
    rmsnorm: str = "plain"
    loss: str = "plain"
    optimizer: str = "torch_fused"
    compile: str = "blocks"
    checkpointing: int = 0

    def __post_init__(self):
        for name, value, allowed in (("rmsnorm", self.rmsnorm, ("plain", "fused")), ("loss", self.loss, ("plain", "fused")),
                                     ("optimizer", self.optimizer, OPTIMIZERS), ("compile", self.compile, COMPILE_MODES)):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")
        if self.checkpointing < 0:
            raise ValueError(f"checkpointing group size must be >= 0, got {self.checkpointing}")

    def with_(self, **changes) -> Parts:
        return replace(self, **changes)

    def with_overrides(self, items: list[str]) -> Parts:
        """These parts with ``part=value`` changes from a command line (e.g. ``["rmsnorm=plain", "checkpointing=2"]``)."""
        changes = {}
        for item in items:
            name, _, value = item.partition("=")
            changes[name] = int(value) if name == "checkpointing" else value
        return self.with_(**changes)


STACKS: dict[str, Parts] = {
    "ours": Parts(attention="triton", rmsnorm="fused", loss="fused", optimizer="fused", compile="blocks"),
    "torch": Parts(attention="sdpa", rmsnorm="plain", loss="plain", optimizer="torch_fused", compile="blocks"),
}


def make_optimizer(parameters, name: str) -> torch.optim.Optimizer:
    """AdamW with :data:`ADAMW_HYPERPARAMETERS`, implemented as ``name`` says."""
    params = [p for p in parameters if p.requires_grad]
    if name == "basics":
        return AdamW(params, **ADAMW_HYPERPARAMETERS)
    if name in ("torch_fused", "torch_foreach"):
        return torch.optim.AdamW(params, **{name.removeprefix("torch_"): True}, **ADAMW_HYPERPARAMETERS)
    if name == "fused":
        from cs336_systems.kernels.adamw import FusedAdamW

        return FusedAdamW(params, **ADAMW_HYPERPARAMETERS)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def plain_loss(hidden: Tensor, lm_head: nn.Module, targets: Int[Tensor, "..."]) -> Tensor:
    """Mean cross-entropy of the full logits ``lm_head(hidden)``."""
    logits = lm_head(hidden)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def fused_loss(hidden: Tensor, lm_head: nn.Module, targets: Int[Tensor, "..."]) -> Tensor:
    """The same loss through our fused LM head + cross-entropy (chunked; the logits are never held)."""
    from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy

    return fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), lm_head.weight, targets.reshape(-1))


def apply_parts(model: BasicsTransformerLM, parts: Parts) -> BasicsTransformerLM:
    """Set ``model``'s attention, norms, checkpointing and (for ``compile="blocks"``) compiled blocks, in place."""
    model.set_attention(get_attention(parts.attention))
    if parts.rmsnorm == "fused":
        from cs336_systems.kernels.rmsnorm import use_fused_rmsnorm

        use_fused_rmsnorm(model, autocast_output=True)
    model.set_activation_checkpointing(parts.checkpointing)
    if parts.compile == "blocks":
        for block in model.layers:
            block.compile()
    return model


class TrainingStep:
    """Forward, loss, backward and optimizer step of ``model`` with ``parts`` (see :func:`build_training_step`)."""

    def __init__(self, model: BasicsTransformerLM, parts: Parts, autocast_dtype: torch.dtype | None = torch.bfloat16):
        self.model, self.parts, self.autocast_dtype = model, parts, autocast_dtype
        self.optimizer = make_optimizer(model.parameters(), parts.optimizer)
        head = fused_loss if parts.loss == "fused" else plain_loss
        if parts.compile == "blocks":
            head = torch.compile(head)  # the blocks are compiled modules (apply_parts); the loss head is one more graph

        def forward_loss(token_ids: Tensor, targets: Tensor) -> Tensor:
            with self._autocast(token_ids.device):
                return head(model.hidden_states(token_ids), model.lm_head, targets)

        self.forward_loss = torch.compile(forward_loss) if parts.compile == "model" else forward_loss

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def __call__(self, token_ids: Tensor, targets: Tensor, phase_seconds: dict[str, float] | None = None) -> Tensor:
        """One step; with ``phase_seconds`` the device is synchronised after each phase and its seconds added
        under ``forward``, ``backward`` and ``optimizer``. Returns the loss (detached)."""
        timed = _phase_timer(token_ids.device, phase_seconds)
        loss = timed("forward", lambda: self.forward_loss(token_ids, targets))
        timed("backward", loss.backward)
        timed("optimizer", self._update)
        return loss.detach()

    def _update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _phase_timer(device: torch.device, phase_seconds: dict[str, float] | None) -> Callable:
    def timed(name: str, fn: Callable):
        if phase_seconds is None:
            return fn()
        start = timeit.default_timer()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        phase_seconds[name] = phase_seconds.get(name, 0.0) + timeit.default_timer() - start
        return out

    return timed


def build_training_step(
    model: BasicsTransformerLM, parts: Parts | str, autocast_dtype: torch.dtype | None = torch.bfloat16
) -> TrainingStep:
    """``model`` (changed in place: attention, norms, checkpointing, compiled blocks) and its training step.
    ``parts`` is a :class:`Parts` or a name in :data:`STACKS`."""
    if isinstance(parts, str):
        if parts not in STACKS:
            raise ValueError(f"unknown stack {parts!r}; choose one of {', '.join(STACKS)}")
        parts = STACKS[parts]
    return TrainingStep(apply_parts(model, parts), parts, autocast_dtype)
