"""One training step of ``BasicsTransformerLM`` composed from named parts.

A step is forward, loss, backward and the optimizer's update, under bf16 autocast by default. Each part is
chosen by name in :class:`Parts`, so that the two stacks the benchmarks race differ only where they say:

* ``attention``: a :func:`cs336_systems.attention.get_attention` name (``triton``: our operator, ``sdpa``, ...).
* ``rmsnorm``: ``plain`` (``cs336_basics``) or ``fused`` (our Triton kernel, writing the autocast dtype);
  ``fused_residual_norm``: each residual add inside the norm that reads its sum (:mod:`.residual_stream`).
* ``weights``: ``fp32``, or ``bf16`` linear weights trained through float32 masters in our fused AdamW (one GPU).
* ``loss``: ``plain`` (LM head, then ``F.cross_entropy``), ``chunked`` (the same over chunks of tokens, each
  recomputed in backward) or ``fused`` (our LM head + cross-entropy, which never holds the logits).
* ``checkpointing``: what each block's backward recomputes: ``keep`` (nothing), ``selective`` (all but the attention
  output and log-sum-exp) or ``full``; one mode for every block, or one per block (:mod:`.checkpoint_plan`).
* ``sharding``: ``none``, ``ours`` (our FSDP by blocks; ``gradient_memory``: the stream holding its gradient shards)
  or ``fsdp2`` (``fully_shard`` per block and root): fp32 masters, compute in the step's dtype (no autocast).
* ``compile``: ``none``, ``blocks`` (each block, and the unsharded loss head: :func:`compile_block`) or ``model``;
  ``recompute_materialized`` lets the partitioner recompute what a backward operator reads whole (our RMSNorm's
  float32 input) instead of saving it. Compiled code is reused within a process (``torch._dynamo.reset()``).
* ``optimizer``: ``basics`` (``cs336_basics`` AdamW), ``torch_fused`` / ``torch_foreach`` or ``fused`` (ours).
* ``cudagraphs``: forward, loss and backward captured in one CUDA graph at the first call (after two warm-up passes
  that do not train) and replayed; the optimizer runs outside it. One GPU, unsharded.

:func:`build_training_step` applies them in that order, one ``apply_*`` function each.

:data:`STACKS` names the two compared stacks: ``ours`` (our attention operator, fused RMSNorm, fused cross-entropy,
fused AdamW with bf16 linear weights, compiled blocks) and ``torch`` (SDPA, the plain RMSNorm and cross-entropy
compiled, ``torch.optim.AdamW(fused=True)``). Both train the same function with the same AdamW hyper-parameters.
:data:`SHARDED_STACKS` names the stacks of the 2026 leaderboard step (one sequence per GPU): ``ours`` (our FSDP,
blocks recomputed but their attention kept) and ``torch`` (FSDP2, whole blocks recomputed, the chunked loss).

    step = build_training_step(model, STACKS["ours"])
    loss = step(token_ids, targets)                     # one full training step
    step(token_ids, targets, phase_seconds := {})       # the same, timed per phase (synchronising)
"""

from __future__ import annotations

import contextlib
import functools
import timeit
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from typing import Literal, get_args

import torch
import torch.nn.functional as F
import torch._functorch.config
import torch.utils.checkpoint
from jaxtyping import Float, Int
from torch import Tensor, nn

from cs336_basics.model import BasicsTransformerLM, Linear
from cs336_basics.optimizer import AdamW
from cs336_systems.attention import ATTENTION_NAMES, get_attention
from cs336_systems.parallel.fsdp.transport import DEFAULT_GRADIENT_MEMORY, GRADIENT_MEMORY
from cs336_systems.train.checkpoint_plan import CHECKPOINT_MODES, CheckpointMode, check_modes
from cs336_systems.train.residual_stream import (
    block_groups,
    hidden_states_with_fused_residual_norm,
    use_fused_residual_norm,
)

ADAMW_HYPERPARAMETERS = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
LOSS_CHUNK_TOKENS = 4096  # the ``chunked`` loss: 4,096 tokens of a 151,936-word head are 1.2 GB of bf16 logits

Norm = Literal["plain", "fused"]
Weights = Literal["fp32", "bf16"]
Loss = Literal["plain", "chunked", "fused"]
Sharding = Literal["none", "ours", "fsdp2"]
Compile = Literal["none", "blocks", "model"]
Optimizer = Literal["basics", "torch_fused", "torch_foreach", "fused"]
CHOICES = {"attention": ATTENTION_NAMES, "rmsnorm": get_args(Norm), "weights": get_args(Weights),
           "loss": get_args(Loss), "sharding": get_args(Sharding), "gradient_memory": GRADIENT_MEMORY,
           "compile": get_args(Compile), "optimizer": get_args(Optimizer)}
RESIDUAL_NORMS = ("separate", "fused")
"""The benchmarks' ``--residual-norm`` choices: the ``fused_residual_norm`` part off or on."""


@dataclass(frozen=True)
class Parts:
    """The named parts of a training step (module docstring), checked together when made. A ``checkpointing``
    tuple whose blocks all have one mode is stored as that mode."""

    attention: str = "sdpa"
    rmsnorm: Norm = "plain"
    fused_residual_norm: bool = False
    weights: Weights = "fp32"
    loss: Loss = "plain"
    checkpointing: CheckpointMode | tuple[CheckpointMode, ...] = "keep"
    sharding: Sharding = "none"
    gradient_memory: str = DEFAULT_GRADIENT_MEMORY
    compile: Compile = "blocks"
    recompute_materialized: bool = False
    optimizer: Optimizer = "torch_fused"
    cudagraphs: bool = False

    def __post_init__(self):
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        modes = (self.checkpointing,) if isinstance(self.checkpointing, str) else tuple(self.checkpointing)
        check_modes(modes)
        if not modes:
            raise ValueError(f"checkpointing is a mode ({', '.join(CHECKPOINT_MODES)}) or one per block, not ()")
        object.__setattr__(self, "checkpointing", modes[0] if len(set(modes)) == 1 else modes)
        sharded = self.sharding != "none"
        needs = {
            "fused_residual_norm adds the residual inside our RMSNorm kernel: it needs rmsnorm='fused'":
                self.fused_residual_norm and self.rmsnorm != "fused",
            "weights='bf16' trains float32 master weights in our fused AdamW: it needs optimizer='fused' and "
            "sharding='none'": self.weights == "bf16" and (self.optimizer != "fused" or sharded),
            "gradient_memory places our FSDP's gradient shards: it needs sharding='ours'":
                self.gradient_memory != DEFAULT_GRADIENT_MEMORY and self.sharding != "ours",
            "a sharded step compiles blocks at most (compile='none' or 'blocks')": sharded and self.compile == "model",
            "recompute_materialized tells torch.compile's partitioner what to save: it needs compile 'blocks' or "
            "'model'": self.recompute_materialized and self.compile == "none",
            "cudagraphs captures a one-GPU step: use it with sharding='none'": self.cudagraphs and sharded,
        }
        for message, broken in needs.items():
            if broken:
                raise ValueError(message)

    def with_(self, **changes) -> Parts:
        """These parts with ``changes``. Turning compilation off (``compile="none"``) also turns off
        ``recompute_materialized``, which only says what compiled code saves, unless the changes set it too."""
        names = [f.name for f in fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise ValueError(f"unknown part {unknown[0]!r}; choose among {', '.join(names)}")
        if changes.get("compile") == "none" and "recompute_materialized" not in changes:
            changes["recompute_materialized"] = False
        return replace(self, **changes)

    def with_overrides(self, items: list[str]) -> Parts:
        """These parts with ``part=value`` changes from a command line (e.g. ``["rmsnorm=plain",
        "checkpointing=full"]``; per-block checkpointing as ``checkpointing=full,selective,keep``)."""
        changes = {}
        for item in items:
            name, equals, value = item.partition("=")
            if not equals:
                raise ValueError(f"an override is part=value (e.g. rmsnorm=plain), not {item!r}")
            if isinstance(getattr(self, name, None), bool):
                if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
                    raise ValueError(f"{name} is true or false, not {value!r}")
                changes[name] = value.lower() in ("1", "true", "yes")
            else:
                changes[name] = tuple(value.split(",")) if name == "checkpointing" else value
        return self.with_(**changes)

    def with_residual_norm(self, choice: str) -> Parts:
        """These parts with the residual adds ``separate`` from the norms or ``fused`` into them
        (:data:`RESIDUAL_NORMS`); parts whose RMSNorm is PyTorch's keep theirs separate, as they must."""
        if choice not in RESIDUAL_NORMS:
            raise ValueError(f"unknown residual norm {choice!r}; choose one of {', '.join(RESIDUAL_NORMS)}")
        return self.with_(fused_residual_norm=choice == "fused" and self.rmsnorm == "fused")

    def block_modes(self, num_blocks: int) -> tuple[CheckpointMode, ...]:
        """What each of ``num_blocks`` blocks recomputes in backward."""
        if isinstance(self.checkpointing, str):
            return (self.checkpointing,) * num_blocks
        if len(self.checkpointing) != num_blocks:
            raise ValueError(f"{len(self.checkpointing)} checkpoint modes for a model of {num_blocks} blocks")
        return self.checkpointing


STACKS: dict[str, Parts] = {
    "ours": Parts(attention="triton", rmsnorm="fused", loss="fused", optimizer="fused", compile="blocks",
                  weights="bf16", recompute_materialized=True),
    "torch": Parts(attention="sdpa", rmsnorm="plain", loss="plain", optimizer="torch_fused", compile="blocks"),
}


SHARDED_STACKS: dict[str, Parts] = {
    "ours": Parts(attention="triton", rmsnorm="fused", loss="fused", optimizer="fused", compile="blocks",
                  checkpointing="selective", sharding="ours"),
    "torch": Parts(attention="sdpa", rmsnorm="plain", loss="chunked", optimizer="torch_fused", compile="blocks",
                   checkpointing="full", sharding="fsdp2"),
}


def make_optimizer(parameters, name: str, master_weights: bool = False) -> torch.optim.Optimizer:
    """AdamW with :data:`ADAMW_HYPERPARAMETERS`, implemented as ``name`` says (``master_weights``: float32 master
    weights for 16-bit parameters, our fused AdamW only)."""
    params = [p for p in parameters if p.requires_grad]
    if name == "basics":
        return AdamW(params, **ADAMW_HYPERPARAMETERS)
    if name in ("torch_fused", "torch_foreach"):
        return torch.optim.AdamW(params, **{name.removeprefix("torch_"): True}, **ADAMW_HYPERPARAMETERS)
    if name == "fused":
        from cs336_systems.kernels.adamw import FusedAdamW

        return FusedAdamW(params, **ADAMW_HYPERPARAMETERS, master_weights=master_weights)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def plain_loss(hidden: Tensor, lm_head: nn.Module, targets: Int[Tensor, "..."]) -> Tensor:
    """Mean cross-entropy of the full logits ``lm_head(hidden)``."""
    logits = lm_head(hidden)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def chunked_loss(hidden: Float[Tensor, "... d_model"], lm_head: nn.Module, targets: Int[Tensor, "..."],
                 chunk_tokens: int = LOSS_CHUNK_TOKENS) -> Tensor:
    """The mean cross-entropy of :func:`plain_loss` in PyTorch operations, summed over chunks of ``chunk_tokens``
    tokens, each chunk's head and loss recomputed in backward: one chunk's logits, softmax and gradients exist at
    a time instead of the whole batch's (40 GB at one sequence of 32,768 tokens and a 151,936-word head), for one
    more head matmul."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)

    def chunk_loss_sum(hidden_chunk: Tensor, target_chunk: Tensor) -> Tensor:
        return F.cross_entropy(lm_head(hidden_chunk), target_chunk, reduction="sum")

    total = sum(torch.utils.checkpoint.checkpoint(chunk_loss_sum, h, t, use_reentrant=False)
                for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens)))
    return total / (targets != -100).sum()  # F.cross_entropy's mean: over the targets it does not ignore


def fused_loss(hidden: Tensor, lm_head: nn.Module, targets: Int[Tensor, "..."]) -> Tensor:
    """The same loss through our fused LM head + cross-entropy (chunked; the logits are never held)."""
    from cs336_systems.kernels.cross_entropy import fused_linear_cross_entropy

    return fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), lm_head.weight, targets.reshape(-1))


LOSS_HEADS: dict[str, Callable] = {"plain": plain_loss, "chunked": chunked_loss, "fused": fused_loss}


@functools.cache
def attention_operations() -> frozenset:
    """The operators whose outputs ``selective`` checkpointing keeps: our attention forward and SDPA's kernels."""
    import cs336_systems.attention.op  # noqa: F401  (registers our operator)

    aten = torch.ops.aten
    return frozenset({
        torch.ops.cs336_systems.flash_attention_forward.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    })


def keep_attention_context():
    """``context_fn`` of a checkpoint that keeps attention outputs and recomputes everything else."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept = attention_operations()

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_options(mode: CheckpointMode) -> dict | None:
    """The ``torch.utils.checkpoint`` options of a block whose backward recomputes what ``mode`` says (``keep``:
    None, not checkpointed)."""
    if mode == "keep":
        return None
    return {"context_fn": keep_attention_context} if mode == "selective" else {}


def checkpointed_block(block: nn.Module, x: Float[Tensor, "batch seq d_model"], mode: CheckpointMode) -> Tensor:
    """``block(x)``, its backward recomputing what ``mode`` says (``keep``, ``selective``, ``full``). The block is
    called as a module inside the checkpoint, so a sharding wrapper's hooks run again in the recomputation."""
    options = checkpoint_options(mode)
    if options is None or not torch.is_grad_enabled():
        return block(x)
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, **options)


def hidden_states_by_block(model: BasicsTransformerLM, token_ids: Int[Tensor, "batch seq"],
                           modes: tuple[CheckpointMode, ...]) -> Float[Tensor, "batch seq d_model"]:
    """``model.hidden_states(token_ids)`` with block ``i`` checkpointed as ``modes[i]`` says."""
    if token_ids.shape[-1] > model.context_length:
        raise ValueError(f"sequence length {token_ids.shape[-1]} exceeds context_length {model.context_length}")
    x = model.token_embeddings(token_ids)
    for block, mode in zip(model.layers, modes, strict=True):
        x = checkpointed_block(block, x, mode)
    return model.ln_final(x)


class LanguageModelLoss(nn.Module):
    """``model``'s mean next-token loss: its final hidden states, then ``head(hidden, model.lm_head, targets)``.
    One module, so that a sharding wrapper sees the whole step's forward (the fused head reads the LM head's
    weight without calling the module). ``block_modes``: what each block's backward recomputes.
    ``fused_residual_norm``: the model's blocks pass the residual stream and the pending branch output
    (:mod:`cs336_systems.train.residual_stream`)."""

    def __init__(self, model: BasicsTransformerLM, head: Callable, block_modes: tuple[CheckpointMode, ...],
                 fused_residual_norm: bool = False):
        super().__init__()
        if len(block_modes) != len(model.layers):
            raise ValueError(f"{len(block_modes)} checkpoint modes for a model of {len(model.layers)} blocks")
        self.model, self.head, self.block_modes = model, head, block_modes
        self.fused_residual_norm = fused_residual_norm

    def forward(self, token_ids: Int[Tensor, "batch seq"], targets: Int[Tensor, "batch seq"]) -> Tensor:
        if self.fused_residual_norm:
            groups = block_groups(self.model, self.block_modes, checkpoint_options)
            hidden = hidden_states_with_fused_residual_norm(self.model, token_ids, groups)
        else:
            hidden = hidden_states_by_block(self.model, token_ids, self.block_modes)
        return self.head(hidden, self.model.lm_head, targets)


def fully_shard_blocks(root: nn.Module, blocks: Iterable[nn.Module], compute_dtype: torch.dtype | None) -> nn.Module:
    """FSDP2: ``fully_shard`` on each block, then on ``root``, over the default process group (parameters in
    ``compute_dtype`` for compute, fp32 gradient reductions)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(next(root.parameters()).device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(root, mesh=mesh, mp_policy=policy)


def compile_block(block: nn.Module, sharding: str) -> None:
    """``torch.compile`` one Transformer block: every block shares one graph (one compilation, whatever the depth).

    Under our FSDP only the block's ``forward`` is compiled: the FSDP hooks around it stay eager (they gather and
    free buffers and launch collectives), and the weights the compiled graph reads are the fresh views of the
    gathered buffer that the pre-hook installs at every call: graph inputs, guarded by shape, dtype and stride
    only, so new views do not recompile. Elsewhere the whole call (hooks included: FSDP2's are compile-aware) is
    compiled with ``nn.Module.compile``."""
    if sharding == "ours":
        block.forward = torch.compile(block.forward)
    else:
        block.compile()


# The parts, applied by build_training_step in this order.


def apply_attention(model: BasicsTransformerLM, parts: Parts) -> None:
    model.set_attention(get_attention(parts.attention))


def apply_norms(model: BasicsTransformerLM, parts: Parts) -> None:
    """Our fused RMSNorm (writing the autocast dtype), and the residual adds inside it if ``fused_residual_norm``."""
    if parts.rmsnorm == "fused":
        from cs336_systems.kernels.rmsnorm import use_fused_rmsnorm

        use_fused_rmsnorm(model, autocast_output=True)
    if parts.fused_residual_norm:
        use_fused_residual_norm(model, autocast_output=True)


def apply_parts(model: BasicsTransformerLM, parts: Parts) -> BasicsTransformerLM:
    """Set ``model``'s attention and norms in place (the parts that change the model's own modules)."""
    apply_attention(model, parts)
    apply_norms(model, parts)
    return model


def apply_weights(model: BasicsTransformerLM, parts: Parts, autocast_dtype: torch.dtype | None) -> None:
    """``weights='bf16'``: every linear layer's weight becomes bf16 in place (the optimizer keeps float32 masters).
    Embeddings and norms stay float32, so the residual stream stays float32 as with float32 weights."""
    if parts.weights == "fp32":
        return
    if autocast_dtype != torch.bfloat16:
        raise ValueError(f"weights='bf16' computes under bf16 autocast, not {autocast_dtype}")
    for module in model.modules():
        if isinstance(module, Linear):
            module.weight.data = module.weight.data.to(torch.bfloat16)


def apply_loss_and_checkpointing(model: BasicsTransformerLM, parts: Parts) -> LanguageModelLoss:
    """The model and its loss head as one module, each block checkpointed as ``parts.checkpointing`` says. The
    loss head of an unsharded step with compiled blocks is one more compiled graph."""
    head = LOSS_HEADS[parts.loss]
    if parts.compile == "blocks" and parts.sharding == "none":
        head = torch.compile(head)
    return LanguageModelLoss(model, head, parts.block_modes(len(model.layers)), parts.fused_residual_norm)


def apply_sharding(net: LanguageModelLoss, parts: Parts, compute_dtype: torch.dtype | None) -> nn.Module:
    """``net`` sharded over the default process group: our FSDP by blocks (its gradient shards in
    ``gradient_memory``'s stream), or FSDP2 per block and root (bf16 parameters in compute, fp32 gradient
    reductions, fp32 master weights)."""
    if parts.sharding == "ours":
        from cs336_systems.parallel.fsdp import FSDP, default_units

        return FSDP(net, compute_dtype=compute_dtype, units=default_units(net.model),
                    gradient_memory=parts.gradient_memory)
    if parts.sharding == "fsdp2":
        return fully_shard_blocks(net, net.model.layers, compute_dtype)
    return net


def apply_compile(model: BasicsTransformerLM, parts: Parts, forward_loss: Callable) -> Callable:
    """Compile each block (``blocks``, after any sharding), or return ``forward_loss`` compiled (``model``)."""
    if parts.compile == "blocks":
        for block in model.layers:
            compile_block(block, parts.sharding)
    return torch.compile(forward_loss) if parts.compile == "model" else forward_loss


class TrainingStep:
    """Forward, loss, backward and optimizer step of ``model`` with ``parts`` (see :func:`build_training_step`)."""

    def __init__(self, model: BasicsTransformerLM, parts: Parts, autocast_dtype: torch.dtype | None = torch.bfloat16):
        self.model, self.parts = model, parts
        # Sharded stacks compute in this dtype from fp32 masters (their gathered weights): no autocast.
        self.autocast_dtype = None if parts.sharding != "none" else autocast_dtype
        apply_weights(model, parts, self.autocast_dtype)
        self.net = apply_sharding(apply_loss_and_checkpointing(model, parts), parts, autocast_dtype)

        def forward_loss(token_ids: Tensor, targets: Tensor) -> Tensor:
            with self._autocast(token_ids.device):
                return self.net(token_ids, targets)

        self.forward_loss = apply_compile(model, parts, forward_loss)
        self.optimizer = make_optimizer(self.net.parameters(), parts.optimizer, master_weights=parts.weights == "bf16")
        self._graph: torch.cuda.CUDAGraph | None = None  # the ``cudagraphs`` part captures it at the first call

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        # A captured graph replays the casts: autocast's cache of cast weights would outlive the capture.
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype,
                              cache_enabled=not self.parts.cudagraphs)

    def _forward(self, token_ids: Tensor, targets: Tensor) -> Tensor:
        """The forward and loss, under the partitioner's options: a compiled graph is split into forward and backward
        at its first call, which happens here (``recompute_materialized``: values a backward operator reads whole may
        be recomputed; Inductor bans that by default, taking the recomputation for a cost, where for our opaque
        RMSNorm backward saving the float32 sum costs more memory than recomputing it from bf16 and the block's
        input). Outside the compiled function, so that the option never breaks its graph."""
        if not self.parts.recompute_materialized:
            return self.forward_loss(token_ids, targets)
        with torch._functorch.config.patch(ban_recompute_materialized_backward=False):
            return self.forward_loss(token_ids, targets)

    def __call__(self, token_ids: Tensor, targets: Tensor, phase_seconds: dict[str, float] | None = None) -> Tensor:
        """One step; with ``phase_seconds`` the device is synchronised after each phase and its seconds added
        under ``forward``, ``backward`` and ``optimizer`` (with ``cudagraphs``: the replayed forward and backward
        under ``forward``, and ``backward`` 0). Returns the loss (detached)."""
        timed = phase_timer(token_ids.device, phase_seconds)
        if self.parts.cudagraphs:
            return self._replay(token_ids, targets, timed)
        loss = timed("forward", lambda: self._forward(token_ids, targets))
        timed("backward", self._backward(loss))
        timed("optimizer", self._update)
        return loss.detach()

    def _replay(self, token_ids: Tensor, targets: Tensor, timed: Callable) -> Tensor:
        if self._graph is None:
            self._capture(token_ids, targets)
        self._static_ids.copy_(token_ids)
        self._static_targets.copy_(targets)
        timed("forward", self._graph.replay)
        timed("backward", lambda: None)
        # The gradients stay: the graph's backward writes them in place at every replay.
        timed("optimizer", self.optimizer.step)
        return self._static_loss.detach().clone()

    def _capture(self, token_ids: Tensor, targets: Tensor) -> None:
        """Warm up (compile, autotune, allocate) on a side stream, then capture forward, loss and backward."""
        if token_ids.device.type != "cuda":
            raise ValueError(f"cudagraphs needs a CUDA device, got inputs on {token_ids.device}")
        self._static_ids, self._static_targets = token_ids.clone(), targets.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(self._static_ids, self._static_targets).backward()
                self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._static_loss = self._forward(self._static_ids, self._static_targets)
            self._static_loss.backward()

    def _backward(self, loss: Tensor) -> Callable[[], None]:
        def backward() -> None:
            loss.backward()
            if self.parts.sharding == "ours":
                self.net.finish_gradient_synchronization()

        return backward

    def _update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def phase_timer(
    device: torch.device, phase_seconds: dict[str, float] | None,
    phase_range: Callable[[str], contextlib.AbstractContextManager] | None = None,
) -> Callable:
    """``timed(name, fn)`` runs ``fn()``; with ``phase_seconds`` it then synchronises the device and adds the
    seconds under ``name``. ``phase_range(name)`` (e.g. an NVTX range) wraps each phase, synchronisation included."""

    def timed(name: str, fn: Callable):
        start = timeit.default_timer()
        with phase_range(name) if phase_range else contextlib.nullcontext():
            out = fn()
            if phase_seconds is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
        if phase_seconds is not None:
            phase_seconds[name] = phase_seconds.get(name, 0.0) + timeit.default_timer() - start
        return out

    return timed


def build_training_step(
    model: BasicsTransformerLM, parts: Parts | str, autocast_dtype: torch.dtype | None = torch.bfloat16
) -> TrainingStep:
    """``model`` (changed in place: attention, norms, compiled blocks) and its training step, the parts applied in
    the order of the module docstring: attention, norms, weights, loss and checkpointing, sharding, compile,
    optimizer, CUDA graphs (at the first call).
    ``parts`` is a :class:`Parts` or a name in :data:`STACKS`. A sharded ``parts`` needs an initialised default
    process group, and ``model`` on this rank's device with the same weights on every rank."""
    if isinstance(parts, str):
        if parts not in STACKS:
            raise ValueError(f"unknown stack {parts!r}; choose one of {', '.join(STACKS)}")
        parts = STACKS[parts]
    return TrainingStep(apply_parts(model, parts), parts, autocast_dtype)
