"""One training step of ``BasicsTransformerLM`` composed from named parts.

A step is forward, loss, backward and the optimizer's update, under bf16 autocast by default. Each part is
chosen by name in :class:`Parts`, so that the two stacks the benchmarks race differ only where they say:

| part | choices |
|---|---|
| ``attention`` | any :func:`cs336_systems.attention.get_attention` name: ``triton`` (our operator), ``sdpa``, ``naive`` |
| ``rmsnorm`` | ``plain`` (``cs336_basics``) or ``fused`` (our Triton kernel, writing the autocast dtype) |
| ``loss`` | ``plain``: the LM head, then ``F.cross_entropy`` on the full logits; ``chunked``: the same PyTorch operations over chunks of tokens, each recomputed in backward (``torch.utils.checkpoint``), so one chunk's logits exist at a time; ``fused``: our LM head + cross-entropy, chunked over tokens, which never holds the logits |
| ``optimizer`` | ``basics`` (``cs336_basics`` AdamW, a Python loop), ``torch_fused`` / ``torch_foreach`` (``torch.optim.AdamW(fused=True)`` / ``foreach=True``) or ``fused`` (our Triton AdamW) |
| ``compile`` | ``none``, ``blocks`` (``torch.compile`` of each Transformer block and, unsharded, of the loss head: compiles one block's graph once, whatever the depth; see :func:`compile_block`) or ``model`` (the whole forward and loss as one graph) |
| ``checkpointing`` | activation checkpointing group size (0: off; see ``BasicsTransformerLM.set_activation_checkpointing``) |
| ``keep_attention`` | checkpointed groups keep each attention call's output (and log-sum-exp): selective checkpointing, so backward recomputes the rest of a block but never the attention itself |
| ``block_checkpointing`` | per block, what its backward recomputes (in place of ``checkpointing`` and ``keep_attention``): ``keep`` (nothing), ``selective`` (all but the attention output, as ``keep_attention``) or ``full`` (the whole block), each block through ``torch.utils.checkpoint``; empty: off. Chosen from the memory a rank has by :mod:`cs336_systems.train.checkpoint_plan` |
| ``sharding`` | ``none`` (one process, or any data-parallel wrapper around the step), ``ours`` (our FSDP by blocks) or ``fsdp2`` (``fully_shard`` per block and root); sharded stacks hold fp32 master weights and compute in the step's bf16 dtype (no autocast), gradients reduced in fp32 |
| ``cudagraphs`` | capture the forward, loss and backward in one CUDA graph on the first call (after two warm-up passes on a side stream, which do not train) and replay it with the batch copied into static inputs: a step then costs the host one replay and the optimizer's launches (the optimizer runs outside the graph: the update's bias corrections are host scalars). One GPU, unsharded |
| ``fused_residual_norm`` | each residual add runs inside the norm that reads its sum (``ln2``, the next block's ``ln1``, ``ln_final``): one Triton kernel writes the sum and its norm, one computes both gradients (:mod:`cs336_systems.train.residual_stream`); needs ``rmsnorm='fused'``. Off: the add and the norm are separate operations (fused with each other only as far as ``torch.compile`` does) |
| ``recompute_materialized`` | torch.compile's partitioner may recompute, in backward, values that a backward operator reads whole (by default Inductor saves those): our fused RMSNorm's input, the float32 residual sum after attention, is then recomputed from the block's input and the bf16 attention output (as Inductor does for its own RMSNorm) instead of saved. Off: Inductor's default. Compiled code is reused across the steps of one process, whatever their parts: build steps that differ here in fresh processes, or after ``torch._dynamo.reset()`` |
| ``weights`` | ``fp32`` (every parameter float32, cast by autocast at each use) or ``bf16``: the linear layers' weights held in bf16, trained through float32 master weights that our fused AdamW keeps and rounds back after each update (the matmuls then read them with no cast, in forward and backward, and their gradients are bf16); needs the fused optimizer, bf16 autocast and one GPU |

:data:`STACKS` names the two compared stacks: ``ours`` (our attention operator, fused RMSNorm, fused
cross-entropy, fused AdamW with bf16 linear weights over float32 masters, compiled) and ``torch`` (PyTorch's best for the same model: SDPA, the plain RMSNorm
and cross-entropy compiled, ``torch.optim.AdamW(fused=True)``). Every stack trains the same function: the model's
input/output behaviour and the AdamW hyper-parameters are the same. :data:`SHARDED_STACKS` names the two stacks
of the 2026 leaderboard step (one sequence per GPU, every block checkpointed): ``ours`` (our FSDP, compiled
blocks, attention operator with its outputs kept, fused RMSNorm, fused cross-entropy, fused AdamW on the shards) and ``torch``
(FSDP2, SDPA, compiled blocks, ``F.cross_entropy`` over checkpointed chunks of tokens, ``torch.optim.AdamW(fused=True)``).

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
from cs336_systems.train.checkpoint_plan import check_modes
from cs336_systems.train.residual_stream import (
    block_groups,
    hidden_states_with_fused_residual_norm,
    use_fused_residual_norm,
)

ADAMW_HYPERPARAMETERS = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
COMPILE_MODES = ("none", "blocks", "model")
LOSSES = ("plain", "chunked", "fused")
LOSS_CHUNK_TOKENS = 4096  # the ``chunked`` loss: 4,096 tokens of a 151,936-word head are 1.2 GB of bf16 logits
OPTIMIZERS = ("basics", "torch_fused", "torch_foreach", "fused")
RESIDUAL_NORMS = ("separate", "fused")
"""The benchmarks' ``--residual-norm`` choices: the ``fused_residual_norm`` part off or on."""
SHARDINGS = ("none", "ours", "fsdp2")
WEIGHTS = ("fp32", "bf16")


@dataclass(frozen=True)
class Parts:
    """The named parts of a training step (module docstring)."""

    attention: str = "sdpa"
    rmsnorm: str = "plain"
    loss: str = "plain"
    optimizer: str = "torch_fused"
    compile: str = "blocks"
    checkpointing: int = 0
    keep_attention: bool = False
    sharding: str = "none"
    cudagraphs: bool = False
    weights: str = "fp32"
    block_checkpointing: tuple[str, ...] = ()
    fused_residual_norm: bool = False
    gradient_memory: str = DEFAULT_GRADIENT_MEMORY
    recompute_materialized: bool = False

    def __post_init__(self):
        for name, value, allowed in (("attention", self.attention, ATTENTION_NAMES),
                                     ("rmsnorm", self.rmsnorm, ("plain", "fused")), ("loss", self.loss, LOSSES),
                                     ("optimizer", self.optimizer, OPTIMIZERS), ("compile", self.compile, COMPILE_MODES),
                                     ("sharding", self.sharding, SHARDINGS),
                                     ("gradient_memory", self.gradient_memory, GRADIENT_MEMORY)):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")
        if self.checkpointing < 0:
            raise ValueError(f"checkpointing group size must be >= 0, got {self.checkpointing}")
        if self.keep_attention and not self.checkpointing:
            raise ValueError("keep_attention selects what checkpointed blocks keep: it needs checkpointing >= 1")
        check_modes(self.block_checkpointing)
        if self.block_checkpointing and self.checkpointing:
            raise ValueError("block_checkpointing chooses per block: use it with checkpointing=0")
        if self.sharding != "none" and self.compile == "model":
            raise ValueError("a sharded step compiles blocks at most (compile='none' or 'blocks')")
        if self.weights not in WEIGHTS:
            raise ValueError(f"unknown weights {self.weights!r}; choose one of {', '.join(WEIGHTS)}")
        if self.weights == "bf16" and (self.optimizer != "fused" or self.sharding != "none"):
            raise ValueError("weights='bf16' trains float32 master weights in our fused AdamW: it needs "
                             "optimizer='fused' and sharding='none'")
        if self.cudagraphs and self.sharding != "none":
            raise ValueError("cudagraphs captures a one-GPU step: use it with sharding='none'")
        if self.gradient_memory != DEFAULT_GRADIENT_MEMORY and self.sharding != "ours":
            raise ValueError("gradient_memory places our FSDP's gradient shards: it needs sharding='ours'")
        if self.fused_residual_norm and self.rmsnorm != "fused":
            raise ValueError("fused_residual_norm adds the residual inside our RMSNorm kernel: it needs rmsnorm='fused'")
        if self.recompute_materialized and self.compile == "none":
            raise ValueError("recompute_materialized tells torch.compile's partitioner what to save: it needs compile "
                             "'blocks' or 'model'")

    def with_(self, **changes) -> Parts:
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ValueError(f"unknown part {unknown[0]!r}; choose among {', '.join(f.name for f in fields(self))}")
        return replace(self, **changes)

    def with_block_checkpointing(self, modes: tuple[str, ...]) -> Parts:
        """These parts with ``modes`` per block (:data:`CHECKPOINT_MODES`); one mode for every block is written
        as the group checkpointing it equals (``selective``: ``checkpointing=1, keep_attention=True``)."""
        check_modes(modes)
        if len(set(modes)) > 1:
            return self.with_(checkpointing=0, keep_attention=False, block_checkpointing=tuple(modes))
        uniform = modes[0] if modes else "keep"
        return self.with_(checkpointing=int(uniform != "keep"), keep_attention=uniform == "selective",
                          block_checkpointing=())

    def with_overrides(self, items: list[str]) -> Parts:
        """These parts with ``part=value`` changes from a command line (e.g. ``["rmsnorm=plain", "checkpointing=2"]``)."""
        changes = {}
        for item in items:
            name, equals, value = item.partition("=")
            if not equals:
                raise ValueError(f"an override is part=value (e.g. rmsnorm=plain), not {item!r}")
            if name == "checkpointing":
                if not value.isdigit():
                    raise ValueError(f"checkpointing is a group size (0, 1, 2, ...), not {value!r}")
                changes[name] = int(value)
            elif name in ("keep_attention", "cudagraphs", "fused_residual_norm", "recompute_materialized"):
                if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
                    raise ValueError(f"{name} is true or false, not {value!r}")
                changes[name] = value.lower() in ("1", "true", "yes")
            elif name == "block_checkpointing":
                changes[name] = tuple(value.split(",")) if value else ()
            else:
                changes[name] = value
        return self.with_(**changes)

    def with_residual_norm(self, choice: str) -> Parts:
        """These parts with the residual adds ``separate`` from the norms or ``fused`` into them
        (:data:`RESIDUAL_NORMS`); parts whose RMSNorm is PyTorch's keep theirs separate, as they must."""
        if choice not in RESIDUAL_NORMS:
            raise ValueError(f"unknown residual norm {choice!r}; choose one of {', '.join(RESIDUAL_NORMS)}")
        return self.with_(fused_residual_norm=choice == "fused" and self.rmsnorm == "fused")


STACKS: dict[str, Parts] = {
    "ours": Parts(attention="triton", rmsnorm="fused", loss="fused", optimizer="fused", compile="blocks",
                  weights="bf16"),
    "torch": Parts(attention="sdpa", rmsnorm="plain", loss="plain", optimizer="torch_fused", compile="blocks"),
}


SHARDED_STACKS: dict[str, Parts] = {
    "ours": Parts(attention="triton", rmsnorm="fused", loss="fused", optimizer="fused", compile="blocks",
                  checkpointing=1, keep_attention=True, sharding="ours"),
    "torch": Parts(attention="sdpa", rmsnorm="plain", loss="chunked", optimizer="torch_fused", compile="blocks",
                     checkpointing=1, sharding="fsdp2"),
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
    """The operators whose outputs ``keep_attention`` keeps: our attention forward and SDPA's fused kernels."""
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


def apply_parts(model: BasicsTransformerLM, parts: Parts) -> BasicsTransformerLM:
    """Set ``model``'s attention, norms and checkpointing in place (blocks are compiled by the step, after
    any sharding)."""
    model.set_attention(get_attention(parts.attention))
    if parts.rmsnorm == "fused":
        from cs336_systems.kernels.rmsnorm import use_fused_rmsnorm

        use_fused_rmsnorm(model, autocast_output=True)
    if parts.fused_residual_norm:
        use_fused_residual_norm(model, autocast_output=True)
    model.set_activation_checkpointing(parts.checkpointing, keep_attention_context if parts.keep_attention else None)
    return model


def checkpoint_options(mode: str) -> dict | None:
    """The ``torch.utils.checkpoint`` options of a block whose backward recomputes what ``mode`` says (``keep``:
    None, not checkpointed)."""
    if mode == "keep":
        return None
    return {"context_fn": keep_attention_context} if mode == "selective" else {}


def checkpointed_block(block: nn.Module, x: Float[Tensor, "batch seq d_model"], mode: str) -> Tensor:
    """``block(x)``, its backward recomputing what ``mode`` says (``keep``, ``selective``, ``full``). The block is
    called as a module inside the checkpoint, so a sharding wrapper's hooks run again in the recomputation."""
    options = checkpoint_options(mode)
    if options is None or not torch.is_grad_enabled():
        return block(x)
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, **options)


def hidden_states_by_block(model: BasicsTransformerLM, token_ids: Int[Tensor, "batch seq"],
                           modes: tuple[str, ...]) -> Float[Tensor, "batch seq d_model"]:
    """``model.hidden_states(token_ids)`` with block ``i`` checkpointed as ``modes[i]`` says."""
    x = model.token_embeddings(token_ids)
    for block, mode in zip(model.layers, modes, strict=True):
        x = checkpointed_block(block, x, mode)
    return model.ln_final(x)


class LanguageModelLoss(nn.Module):
    """``model``'s mean next-token loss: its final hidden states, then ``head(hidden, model.lm_head, targets)``.
    One module, so that a sharding wrapper sees the whole step's forward (the fused head reads the LM head's
    weight without calling the module). ``block_modes``: what each block's backward recomputes (empty: as the
    model's own checkpointing says). ``fused_residual_norm``: the model's blocks pass the residual stream and the
    pending branch output (:mod:`cs336_systems.train.residual_stream`)."""

    def __init__(self, model: BasicsTransformerLM, head: Callable, block_modes: tuple[str, ...] = (),
                 fused_residual_norm: bool = False):
        super().__init__()
        if block_modes and len(block_modes) != len(model.layers):
            raise ValueError(f"{len(block_modes)} checkpoint modes for a model of {len(model.layers)} blocks")
        self.model, self.head, self.block_modes = model, head, block_modes
        self.fused_residual_norm = fused_residual_norm

    def forward(self, token_ids: Int[Tensor, "batch seq"], targets: Int[Tensor, "batch seq"]) -> Tensor:
        if self.fused_residual_norm:
            groups = block_groups(self.model, self.block_modes, checkpoint_options)
            hidden = hidden_states_with_fused_residual_norm(self.model, token_ids, groups)
        elif self.block_modes:
            hidden = hidden_states_by_block(self.model, token_ids, self.block_modes)
        else:
            hidden = self.model.hidden_states(token_ids)
        return self.head(hidden, self.model.lm_head, targets)


def shard(net: LanguageModelLoss, sharding: str, compute_dtype: torch.dtype | None,
          gradient_memory: str = DEFAULT_GRADIENT_MEMORY) -> nn.Module:
    """``net`` sharded over the default process group: our FSDP by blocks (its gradient shards in
    ``gradient_memory``'s stream), or FSDP2 per block and root (bf16 parameters in compute, fp32 gradient
    reductions, fp32 master weights)."""
    model = net.model
    if sharding == "ours":
        from cs336_systems.parallel.fsdp import FSDP, default_units

        return FSDP(net, compute_dtype=compute_dtype, units=default_units(model), gradient_memory=gradient_memory)
    if sharding == "fsdp2":
        return fully_shard_blocks(net, model.layers, compute_dtype)
    return net


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


def hold_linear_weights_in_bf16(model: nn.Module, autocast_dtype: torch.dtype | None) -> None:
    """The ``weights='bf16'`` part: every linear layer's weight becomes bf16 in place (the optimizer keeps float32
    masters). Embeddings and norms stay float32, so the residual stream stays float32 as with float32 weights."""
    if autocast_dtype != torch.bfloat16:
        raise ValueError(f"weights='bf16' computes under bf16 autocast, not {autocast_dtype}")
    for module in model.modules():
        if isinstance(module, Linear):
            module.weight.data = module.weight.data.to(torch.bfloat16)


class TrainingStep:
    """Forward, loss, backward and optimizer step of ``model`` with ``parts`` (see :func:`build_training_step`)."""

    def __init__(self, model: BasicsTransformerLM, parts: Parts, autocast_dtype: torch.dtype | None = torch.bfloat16):
        self.model, self.parts = model, parts
        sharded = parts.sharding != "none"
        # Sharded stacks compute in this dtype from fp32 masters (their gathered weights): no autocast.
        self.autocast_dtype = None if sharded else autocast_dtype
        if parts.weights == "bf16":
            hold_linear_weights_in_bf16(model, self.autocast_dtype)
        head = LOSS_HEADS[parts.loss]
        if parts.compile == "blocks" and not sharded:
            head = torch.compile(head)  # the blocks are compiled modules (below); the loss head is one more graph
        net = LanguageModelLoss(model, head, parts.block_checkpointing, parts.fused_residual_norm)
        self.net = shard(net, parts.sharding, autocast_dtype, parts.gradient_memory)
        if parts.compile == "blocks":
            for block in model.layers:
                compile_block(block, parts.sharding)
        self.optimizer = make_optimizer(self.net.parameters(), parts.optimizer, master_weights=parts.weights == "bf16")

        def forward_loss(token_ids: Tensor, targets: Tensor) -> Tensor:
            with self._autocast(token_ids.device):
                return self.net(token_ids, targets)

        self.forward_loss = torch.compile(forward_loss) if parts.compile == "model" else forward_loss

        self._graph: torch.cuda.CUDAGraph | None = None

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        # A captured graph replays the casts: autocast's cache of cast weights would outlive the capture.
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype, cache_enabled=not self.parts.cudagraphs)

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
    """``model`` (changed in place: attention, norms, checkpointing, compiled blocks) and its training step.
    ``parts`` is a :class:`Parts` or a name in :data:`STACKS`. A sharded ``parts`` needs an initialised default
    process group, and ``model`` on this rank's device with the same weights on every rank."""
    if isinstance(parts, str):
        if parts not in STACKS:
            raise ValueError(f"unknown stack {parts!r}; choose one of {', '.join(STACKS)}")
        parts = STACKS[parts]
    return TrainingStep(apply_parts(model, parts), parts, autocast_dtype)
