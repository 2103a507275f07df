"""FSDP by blocks against single-process training (gloo on CPU at world sizes 2 and 3; NCCL with 2+ GPUs), the
2026 DDP entry points, and the ``fsdp_accounting`` CLI on the CPU.

Every spawn costs seconds of imports, so each world size is one spawn (a module-scoped fixture) that runs all the
checks (the harness of ``tests/_distributed.py``), through the grader's adapters where they exist; each check is then
its own test. The reference is one process training on the full batch.

Tolerances, and why they are not zero. Each rank's gradient sums its own tokens, then the reduction sums the
ranks' partial sums and divides by W; one process sums all tokens in one matmul. Floating-point addition is
not associative, so fp32 gradients differ by about 1e-7 relative: every step, the gathered gradients are
compared (``GRAD_TOL``) with one process's gradient at FSDP's own weights, which measures that error alone.
The weights of the two trainings are compared after every step: after SGD they differ by lr times the
gradients' difference (``SGD_TOL``). AdamW divides the gradient by ``sqrt(v) + eps``, and the update's
derivative is up to ``lr / eps`` where the gradient is tiny (rows of rare tokens in an LM head): there a 1e-9
gradient difference becomes a visible update difference, so AdamW runs with eps 1e-6 and its weights are
compared to ``ADAMW_TOL``, 2% of one step (seen: up to 0.9e-4 on the tiny LM at 3 ranks). Mixed precision
rounds each rank's low-precision gradient separately, so there the one process accumulates the ranks' slices
one by one (one backward over the whole batch would round the sum once, a 1e-3 relative difference in fp16);
what remains is the fp32 summation order again (``MIXED_TOL``).
Warnings are errors, in the workers and here.
"""

from __future__ import annotations

import json
import runpy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from cs336_basics.model import BasicsTransformerLM, Embedding, Linear, RMSNorm
from cs336_basics.nn_utils import cross_entropy
from cs336_basics.optimizer import AdamW
from cs336_systems.bench import fsdp_accounting
from cs336_systems.bench.common import timeline
from cs336_systems.bench.common.lm import TINY, VOCAB_SIZE, LMConfig, master_name, read_weights_in
from cs336_systems.parallel import fsdp as fsdp_module
from cs336_systems.parallel.fsdp import FSDP
from tests import adapters
from tests._distributed import assert_all_passed, assert_passed, gpu_world_size, run_checks

pytestmark = pytest.mark.filterwarnings("error")

GRAD_TOL = dict(rtol=1e-5, atol=1e-7)  # fp32 gradients (largest 1e-2 .. 1e-1; a sum that cancels keeps its terms' error)
SGD_TOL = dict(rtol=1e-6, atol=1e-7)  # fp32 weights after SGD steps (lr 0.1)
ADAMW_TOL = dict(rtol=0, atol=2e-4)  # fp32 weights after AdamW steps (lr 1e-2, eps 1e-6): 2% of one step
MIXED_TOL = dict(rtol=1e-4, atol=1e-5)  # fp16 / bf16 compute against the same casts, gradients and weights
STEPS = 3

# No width divides by 2 and 3 at once; units of 230 elements divide by 2, 23 and 13 by neither.
VOCAB, D_MODEL, D_HIDDEN, SEQ = 23, 10, 13, 5


class SmallNet(nn.Module):
    """Embedding, a pre-norm MLP block, a frozen Linear, and an output head (optionally tied to the embedding)."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.embedding = Embedding(VOCAB, D_MODEL)
        self.norm = RMSNorm(D_MODEL)
        self.up = Linear(D_MODEL, D_HIDDEN)
        self.down = Linear(D_HIDDEN, D_MODEL)
        self.frozen = Linear(D_MODEL, D_MODEL).requires_grad_(False)
        self.final_norm = RMSNorm(D_MODEL)
        self.head = Linear(D_MODEL, VOCAB)
        if tied:
            self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)  # (batch, seq, d_model)
        x = x + self.down(torch.relu(self.up(self.norm(x))))
        x = x + self.frozen(x)
        return self.head(self.final_norm(x))  # (batch, seq, vocab)

    def units(self) -> list:
        """One unit per layer, the MLP block as one: five units, the frozen one on its own."""
        return [self.embedding, (self.norm, self.up, self.down), self.frozen, (self.final_norm, self.head)]


class ToyModel(nn.Module):
    """The course's 2026 toy model: ``Embedding -> RMSNorm -> Linear``, trained on the last token's logits."""

    def __init__(self, vocab: int = VOCAB, d_model: int = 11):
        super().__init__()
        self.embedding = Embedding(vocab, d_model)
        self.norm = RMSNorm(d_model)
        self.head = Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embedding(tokens)))  # (batch, seq, vocab)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return cross_entropy(logits, targets)


def last_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return cross_entropy(logits[:, -1], targets[:, -1])


def full_batch(step: int, world_size: int, device: torch.device, vocab: int = VOCAB, seq: int = SEQ):
    """Tokens and targets ``(2 * world_size, seq)``, the same on every rank."""
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(vocab, (2 * world_size, seq + 1), generator=generator).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def rank_slice(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    size = batch[0].shape[0] // world_size
    return tuple(t[rank * size : (rank + 1) * size] for t in batch)


class MomentumSGD(torch.optim.Optimizer):
    """SGD with momentum. (``torch.optim``'s optimizers import ``torch._dynamo`` at their first step, which
    costs 15 s per process on a busy 2-core machine; this one and ``cs336_basics``' AdamW do not.)"""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buffer = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buffer.mul_(group["momentum"]).add_(p.grad)
                p.add_(buffer, alpha=-group["lr"])


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if name == "sgd":
        return MomentumSGD(params, lr=0.1, momentum=0.9)
    if name == "adamw":
        return AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)  # cs336_basics' AdamW
    raise ValueError(name)


def compare(actual: torch.Tensor | None, expected: torch.Tensor | None, where: str, tol: dict) -> None:
    if expected is None:
        assert actual is None, where
        return
    assert actual is not None and actual.shape == expected.shape and actual.dtype == expected.dtype, where
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{where}: {m}")


def assert_same_on_every_rank(tensor: torch.Tensor, where: str) -> None:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    for other, value in enumerate(gathered):
        assert torch.equal(value, tensor), f"{where}: rank {other} differs from rank {dist.get_rank()}"


def check_shards(fsdp: FSDP, where: str) -> None:
    """One fp32 parameter per unit, a view of the unit's flat shard of ``ceil(N / W)`` elements; gradients fp32,
    shaped like their shard."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for unit in fsdp.units:
        context = f"{where}, unit {unit.name}"
        assert unit.shard.dtype == torch.float32 and unit.shard_numel == -(-unit.numel // world), context
        assert unit.full.numel() == unit.shard_numel * world, context
        for part in (unit.param, unit.frozen):
            if part is not None:
                assert part.dtype == torch.float32 and part.dim() == 1, context
                assert part.untyped_storage().data_ptr() == unit.shard.untyped_storage().data_ptr(), context
        if unit.param is not None:
            trainable_here = min(max(unit.trainable_numel - rank * unit.shard_numel, 0), unit.shard_numel)
            assert unit.param.numel() == trainable_here, context
            if unit.param.grad is not None:
                assert unit.param.grad.dtype == torch.float32 and unit.param.grad.shape == unit.param.shape, context
        if unit.frozen is not None:
            assert not unit.frozen.requires_grad and unit.frozen.grad is None, context


@dataclass(frozen=True)
class Training:
    """What :func:`train_and_compare` trains and how closely it must match.

    ``make_reference()`` builds the one-process model; ``batch_of(step)`` the full batch; ``accumulate``: the
    one-process gradient accumulates the ranks' slices one by one (mixed precision); ``names(model)``: (name,
    parameter) pairs of a reference model under the wrapped module's names."""

    make_reference: Callable[[], nn.Module]
    batch_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer_name: str
    weight_tol: dict
    grad_tol: dict = field(default_factory=lambda: GRAD_TOL)
    steps: int = STEPS
    accumulate: bool = False
    names: Callable[[nn.Module], Iterable[tuple[str, nn.Parameter]]] = nn.Module.named_parameters


def train_and_compare(fsdp: FSDP, training: Training, where: str) -> None:
    """Train ``fsdp`` on each rank's slice and a reference on the full batch side by side. Every step: the gathered
    gradients match one process's gradient at the same weights (a probe model loaded with FSDP's weights: the
    gradient's own error, not the trajectories' drift), the weights after the step match the reference's, every
    rank gathers the same weights; frozen parameters never move."""
    rank, world_size, t = dist.get_rank(), dist.get_world_size(), training
    make_reference, batch_of, loss_fn, names = t.make_reference, t.batch_of, t.loss_fn, t.names
    reference, probe = make_reference(), make_reference()
    named, probe_named = dict(names(reference)), dict(names(probe))
    frozen_before = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad}
    full = adapters.fsdp_gather_full_params(fsdp)
    assert list(full) == list(named), where
    for name, tensor in full.items():
        compare(tensor, named[name].detach(), f"{where}, {name} after construction", dict(rtol=0, atol=0))
    optimizer = make_optimizer(t.optimizer_name, fsdp.parameters())
    reference_optimizer = make_optimizer(t.optimizer_name, reference.parameters())
    set_to_none = t.optimizer_name != "sgd"  # SGD: the gradients exist (zeros) and are added to

    def one_process_backward(model: nn.Module, batch) -> None:
        for x, y in [rank_slice(batch, r, world_size) for r in range(world_size)] if t.accumulate else [batch]:
            loss_fn(model(x), y).backward()
        if t.accumulate:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(world_size)

    for step in range(t.steps):
        batch = batch_of(step)
        optimizer.zero_grad(set_to_none=set_to_none)
        x, y = rank_slice(batch, rank, world_size)
        loss_fn(fsdp(x), y).backward()
        adapters.fsdp_on_after_backward(fsdp, optimizer)
        check_shards(fsdp, f"{where}, step {step}")
        with torch.no_grad():
            for name, param in probe_named.items():
                param.copy_(full[name])
                param.grad = None
        one_process_backward(probe, batch)
        grads = fsdp.gather_full_grads()
        # W ranks' gradients summed in the collective's order, not the reference's rank order: each of the W - 1
        # additions may round differently, so the absolute tolerance grows with them
        grad_tol = {**t.grad_tol, "atol": t.grad_tol["atol"] * max(1, world_size - 1)}
        for name, param in probe_named.items():
            compare(grads[name], param.grad, f"{where}, step {step}, gradient of {name}", grad_tol)
        optimizer.step()
        reference_optimizer.zero_grad(set_to_none=set_to_none)
        one_process_backward(reference, batch)
        reference_optimizer.step()
        full = adapters.fsdp_gather_full_params(fsdp)
        for name, param in named.items():
            compare(full[name], param.detach(), f"{where}, step {step}, {name}", t.weight_tol)
            assert_same_on_every_rank(full[name], f"{where}, {name}")
    for name, before in frozen_before.items():
        assert torch.equal(full[name], before) and torch.equal(named[name], before), f"{where}: frozen {name} moved"


def build(cls, seed: int, device: torch.device, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return cls(**kwargs).to(device)


WEIGHT_TOL = {"sgd": SGD_TOL, "adamw": ADAMW_TOL}


def check_toy_models(rank: int, world_size: int, device: torch.device) -> None:
    """fp32: the course's toy model and SmallNet (frozen layer, tied or not; default units and one unit per
    layer) with SGD and AdamW match one process on the full batch."""
    for optimizer_name in ("sgd", "adamw"):
        where = f"toy model, {optimizer_name}, rank {rank}/{world_size}"
        fsdp = adapters.get_fsdp(build(ToyModel, rank, device))
        assert [u.name for u in fsdp.units] == ["embedding", "_root"], where  # norm and head: the root unit
        train_and_compare(fsdp, Training(lambda: build(ToyModel, 0, device),
                                         lambda step: full_batch(step, world_size, device, seq=8), last_token_loss,
                                         optimizer_name, WEIGHT_TOL[optimizer_name]), where)
    for tied in (False, True):
        for per_layer in (False, True):
            for optimizer_name in ("sgd", "adamw"):
                where = f"SmallNet, tied={tied}, units per layer={per_layer}, {optimizer_name}, rank {rank}/{world_size}"
                model = build(SmallNet, rank, device, tied=tied)
                fsdp = FSDP(model, units=model.units()) if per_layer else adapters.get_fsdp(model)
                assert fsdp.module is model and not list(model.parameters()), where
                if tied:  # the shared weight goes to the root unit
                    assert "embedding" not in [u.name for u in fsdp.units], where
                train_and_compare(fsdp, Training(lambda tied=tied: build(SmallNet, 0, device, tied=tied),
                                                 lambda step: full_batch(step, world_size, device), lm_loss,
                                                 optimizer_name, WEIGHT_TOL[optimizer_name]), where)


def check_reduce_scatter_fallback(rank: int, world_size: int, device: torch.device) -> None:
    """The all-reduce + slice path (for backends without a mean reduce-scatter) gives the same training."""
    backend = dist.get_backend()
    saved = dict(fsdp_module.NATIVE_MEAN_REDUCE_SCATTER)
    fsdp_module.NATIVE_MEAN_REDUCE_SCATTER[backend] = False
    try:
        model = build(SmallNet, rank, device)
        training = Training(lambda: build(SmallNet, 0, device), lambda step: full_batch(step, world_size, device),
                            lm_loss, "sgd", SGD_TOL, steps=2)
        train_and_compare(FSDP(model, units=model.units()), training, f"fallback reduction, rank {rank}/{world_size}")
    finally:
        fsdp_module.NATIVE_MEAN_REDUCE_SCATTER.clear()
        fsdp_module.NATIVE_MEAN_REDUCE_SCATTER.update(saved)


def mixed_precision_reference(seed: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The non-parallel mixed-precision model: every parameter (norm gains too) cast to ``dtype`` for forward
    and backward, fp32 master weights and gradients."""
    return read_weights_in(build(SmallNet, seed, device), dtype)


def master_weights(model: nn.Module):
    """The reference's fp32 master weights under the plain model's names."""
    return [(master_name(name), p) for name, p in model.named_parameters()]


def check_mixed_precision(rank: int, world_size: int, device: torch.device) -> None:
    """fp16 / bf16 compute: weights travel and compute in the low precision, master weights and gradients stay
    fp32, and training matches the reference with the same casts."""
    for dtype in (torch.float16, torch.bfloat16):
        where = f"{dtype}, rank {rank}/{world_size}"
        model = build(SmallNet, rank, device)
        fsdp = adapters.get_fsdp(model, compute_dtype=dtype) if dtype == torch.bfloat16 else FSDP(
            model, compute_dtype=dtype, units=model.units())
        assert all(u.full.dtype == dtype for u in fsdp.units), where
        x, _ = rank_slice(full_batch(0, world_size, device), rank, world_size)
        assert fsdp(x).dtype == dtype, where
        fsdp.finish_gradient_synchronization()
        training = Training(lambda dtype=dtype: mixed_precision_reference(0, device, dtype),
                            lambda step: full_batch(step, world_size, device), lm_loss, "adamw", MIXED_TOL,
                            grad_tol=MIXED_TOL, accumulate=True, names=master_weights)
        train_and_compare(fsdp, training, where)
        assert all(p.dtype == torch.float32 for p in fsdp.parameters()), where


class Recorder:
    """Records, in order, the gathers FSDP issues (with the units gathered at that moment), the start and end
    of each unit's forward, and the most units gathered at once."""

    def __init__(self, fsdp: FSDP, modules: dict[str, tuple[nn.Module, nn.Module]]):
        self.fsdp, self.events, self.peak = fsdp, [], 0
        issue = fsdp._gather

        def recording_issue(unit):
            if not unit.allocated:
                self.events.append(("gather", unit.name))
            issue(unit)
            self.sample()

        fsdp._gather = recording_issue
        for name, (first, last) in modules.items():
            first.register_forward_pre_hook(lambda m, a, name=name: self.mark("start", name))  # after FSDP's hook
            last.register_forward_hook(lambda m, a, o, name=name: self.mark("done", name), prepend=True)

    def mark(self, kind: str, name: str) -> None:
        self.events.append((kind, name))
        self.sample()

    def sample(self) -> None:
        self.peak = max(self.peak, len([n for n in self.fsdp.gathered_units() if n != fsdp_module.ROOT_KEY]))

    def names(self, kind: str, events=None) -> list[str]:
        return [name for k, name in (self.events if events is None else events) if k == kind]


def BasicsLM4(config: LMConfig, device: torch.device):
    """The tiny LM with 4 blocks (the checkpointing groups of 2 need more than one group)."""
    return BasicsTransformerLM(vocab_size=VOCAB_SIZE, context_length=config.context_length,
                               **{**TINY, "num_layers": 4}).to(device)


def lm_batch(config: LMConfig, step: int, rank: int | None, world_size: int, device: torch.device):
    generator = torch.Generator().manual_seed(7 + step)
    tokens = torch.randint(10_000, (config.batch_size, config.context_length + 1), generator=generator).to(device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    return batch if rank is None else rank_slice(batch, rank, world_size)


def lm_units(model) -> dict[str, tuple[nn.Module, nn.Module]]:
    blocks = {f"layers.{i}": (block, block) for i, block in enumerate(model.layers)}
    return {"token_embeddings": (model.token_embeddings,) * 2, **blocks, "ln_final+lm_head": (model.ln_final, model.lm_head)}


def check_lm_prefetch_and_memory(rank: int, world_size: int, device: torch.device) -> None:
    """BasicsTransformerLM (4 blocks): units are the embedding, each block, the final norm with the head. In
    forward the next unit's gather is issued before this unit computes, and a unit is freed after its forward;
    in backward units are gathered again in reverse order (not the embedding, whose backward needs no weight;
    not the head, kept from forward). At most 2 units are gathered in forward and 3 in backward."""
    config = LMConfig("tiny", context_length=8, batch_size=2 * world_size)
    torch.manual_seed(0)
    model = BasicsLM4(config, device)
    fsdp = adapters.get_fsdp(model)
    order = ["token_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "ln_final+lm_head"]
    assert [u.name for u in fsdp.units] == order
    recorder = Recorder(fsdp, lm_units(model))
    optimizer = make_optimizer("adamw", fsdp.parameters())
    for step in range(2):
        recorder.events.clear()
        recorder.peak = 0
        x, y = lm_batch(config, step, rank, world_size, device)
        loss = lm_loss(fsdp(x), y)
        forward = list(recorder.events)
        assert fsdp.gathered_units() == ["ln_final+lm_head"], fsdp.gathered_units()  # kept for backward
        assert recorder.names("gather", forward) == order and recorder.names("done", forward) == order
        for i, name in enumerate(order[:-1]):
            nxt = forward.index(("gather", order[i + 1]))
            assert nxt < forward.index(("start", name)), (name, forward)  # prefetched before this unit runs
            if i >= 1:
                assert nxt > forward.index(("done", order[i - 1])), (name, forward)  # not earlier: bounds memory
        assert recorder.peak <= 2, (recorder.peak, forward)
        recorder.peak = 0
        loss.backward()
        adapters.fsdp_on_after_backward(fsdp, optimizer)
        assert recorder.names("gather", recorder.events[len(forward) :]) == order[1:-1][::-1]
        assert recorder.peak <= 3, recorder.peak
        assert fsdp.gathered_units() == []
        optimizer.step()


class CheckpointedBlock(nn.Module):
    """A caller's own activation checkpointing: the block runs under ``checkpoint(..., use_reentrant=False)``."""

    def __init__(self, block: nn.Module, use_reentrant: bool = False):
        super().__init__()
        self.block, self.use_reentrant = block, use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=self.use_reentrant)


def check_lm_training(rank: int, world_size: int, device: torch.device) -> None:
    """BasicsTransformerLM (4 blocks), fp32: plain, with the model's activation checkpointing in groups of 1 and
    2 blocks, and with each block wrapped by the caller, against one process without checkpointing. With
    checkpointing the blocks are gathered again for their recomputation and stay within 3 gathered units
    (groups of 1) or 4 (groups of 2)."""
    config = LMConfig("tiny", context_length=8, batch_size=2 * world_size)
    cases = [("plain", 0, "adamw"), ("checkpoint groups of 1", 1, "sgd"), ("checkpoint groups of 2", 2, "adamw"),
             ("caller's checkpoint", -1, "sgd")]
    for label, group, optimizer_name in cases:
        where = f"LM, {label}, {optimizer_name}, rank {rank}/{world_size}"
        torch.manual_seed(rank)
        model = BasicsLM4(config, device)
        if group > 0:
            model.set_activation_checkpointing(group)
        elif group < 0:
            for i, block in enumerate(model.layers):
                model.layers[i] = CheckpointedBlock(block)
        fsdp = adapters.get_fsdp(model)
        assert len(fsdp.units) == 6, where  # the wrapped blocks are still found
        blocks = [getattr(b, "block", b) for b in model.layers]  # inside the caller's wrappers
        block_units = [unit.name for unit in fsdp.units[1:5]]  # layers.i, or layers.i.block inside wrappers
        recorder = Recorder(fsdp, {name: (b, b) for name, b in zip(block_units, blocks)})
        prefix = "layers.{}.block." if group < 0 else "layers.{}."  # the wrapped model's names

        def reference():
            torch.manual_seed(0)
            return BasicsLM4(config, device)

        def names(model, prefix=prefix):
            return [(n.replace(f"layers.{n.split('.')[1]}.", prefix.format(n.split(".")[1])) if n.startswith("layers.")
                     else n, p) for n, p in model.named_parameters()]

        training = Training(reference, lambda step: lm_batch(config, step, None, world_size, device), lm_loss,
                            optimizer_name, WEIGHT_TOL[optimizer_name], steps=2, names=names)
        train_and_compare(fsdp, training, where)
        if group:  # each block: gathered in forward, then once in backward (recomputation and backward share it)
            gathers = recorder.names("gather")
            assert all(gathers.count(name) == 2 * 2 for name in block_units), gathers
            starts = recorder.names("start")  # forward, then the recomputation in backward
            assert all(starts.count(name) == 2 * 2 for name in block_units), starts
        assert recorder.peak <= (4 if group == 2 else 3), (where, recorder.peak)


def check_gradient_memory(rank: int, world_size: int, device: torch.device) -> None:
    """Gradient shards allocated on the reduction stream (on NCCL; gloo has one stream; the compute stream is the
    default, which every other test runs) train the 4-block LM like one process; an unknown placement is refused."""
    config = LMConfig("tiny", context_length=8, batch_size=2 * world_size)
    where = f"LM, gradient_memory=reduce_stream, rank {rank}/{world_size}"
    torch.manual_seed(rank)
    fsdp = FSDP(BasicsLM4(config, device), gradient_memory="reduce_stream")
    if dist.get_backend() == "nccl":
        assert fsdp.transport.gradient_memory == "reduce_stream", where

    def reference():
        torch.manual_seed(0)
        return BasicsLM4(config, device)

    training = Training(reference, lambda step: lm_batch(config, step, None, world_size, device), lm_loss, "adamw",
                        WEIGHT_TOL["adamw"], steps=2)
    train_and_compare(fsdp, training, where)
    try:
        FSDP(BasicsLM4(config, device), gradient_memory="host")
    except ValueError as error:
        assert "unknown gradient_memory 'host'" in str(error), where
    else:
        raise AssertionError(f"{where}: an unknown gradient_memory was accepted")


def check_errors(rank: int, world_size: int, device: torch.device) -> None:
    model = build(SmallNet, rank, device)
    fsdp = adapters.get_fsdp(model)
    x, y = rank_slice(full_batch(0, world_size, device), rank, world_size)
    with pytest.raises(RuntimeError, match="outside FSDP.forward"):
        fsdp.module.embedding(x)
    lm_loss(fsdp(x), y).backward()
    with pytest.raises(RuntimeError, match="finish_gradient_synchronization"):
        fsdp(x)
    fsdp.finish_gradient_synchronization()
    with torch.no_grad():  # evaluation: no backward, nothing to synchronise
        fsdp(x)
        fsdp(x)
    assert fsdp.gathered_units() == []
    fsdp(x)  # a forward with grad whose graph is dropped: the next forward starts afresh
    lm_loss(fsdp(x), y).backward()
    fsdp.finish_gradient_synchronization()
    with pytest.raises(ValueError, match="floating-point"):
        FSDP(build(SmallNet, rank, device), compute_dtype=torch.int32)
    other = build(SmallNet, rank, device)
    for units, message in (([other.up, Linear(2, 2)], "not a submodule"), ([other], "wrapped module itself"),
                           ([other.up, (other.norm, other.up)], "in units"), ([other.embedding, 3], "module")):
        with pytest.raises(ValueError, match=message):
            FSDP(other, units=units)
    # Reentrant checkpointing backpropagates through the recomputed graph: refused in backward.
    model = build(ToyModel, rank, device)
    model.norm = CheckpointedBlock(model.norm, use_reentrant=True)
    fsdp = FSDP(model, units=[model.embedding, model.norm.block])
    x, y = rank_slice(full_batch(0, world_size, device), rank, world_size)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        last_token_loss(fsdp(x), y).backward()
    fsdp.finish_gradient_synchronization()


def check_careless_use(rank: int, world_size: int, device: torch.device) -> None:
    """A second backward through one forward raises (it would read freed weights); a second
    finish_gradient_synchronization() changes nothing; an optimizer built before wrapping raises at its first step;
    a module without parameters is refused."""
    model = build(SmallNet, rank, device)
    early = AdamW(model.parameters(), lr=1e-2)
    fsdp = adapters.get_fsdp(model)
    x, y = rank_slice(full_batch(0, world_size, device), rank, world_size)
    loss = lm_loss(fsdp(x), y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the same FSDP forward is not supported"):
        loss.backward()
    adapters.fsdp_on_after_backward(fsdp, early)
    grads = [param.grad.clone() for param in fsdp.parameters() if param.grad is not None]
    adapters.fsdp_on_after_backward(fsdp, early)
    assert grads and all(torch.equal(param.grad, grad) for param, grad in zip(fsdp.parameters(), grads))
    with pytest.raises(RuntimeError, match="AdamW holds parameters of a module that FSDP has since wrapped"):
        early.step()
    AdamW(fsdp.parameters(), lr=1e-2).step()
    with pytest.raises(ValueError, match="no parameters to shard"):
        adapters.get_fsdp(nn.ReLU())


def check_ddp_2026_names(rank: int, world_size: int, device: torch.device) -> None:
    """``get_ddp`` / ``ddp_on_after_backward``: rank 0's weights at start, then single-process training."""
    ddp = adapters.get_ddp(build(SmallNet, rank, device))
    reference = build(SmallNet, 0, device)
    assert ddp.module.__class__ is SmallNet
    assert [n for n, _ in ddp.named_parameters()] == [f"module.{n}" for n, _ in reference.named_parameters()]
    optimizer = make_optimizer("adamw", ddp.parameters())
    reference_optimizer = make_optimizer("adamw", reference.parameters())
    for step in range(2):
        batch = full_batch(step, world_size, device)
        optimizer.zero_grad()
        x, y = rank_slice(batch, rank, world_size)
        lm_loss(ddp(x), y).backward()
        adapters.ddp_on_after_backward(ddp, optimizer)
        optimizer.step()
        reference_optimizer.zero_grad()
        lm_loss(reference(batch[0]), batch[1]).backward()
        reference_optimizer.step()
        for (name, p), q in zip(ddp.module.named_parameters(), reference.parameters()):
            where = f"DDP, {name}, step {step}"
            torch.testing.assert_close(p, q, **ADAMW_TOL, msg=lambda m, where=where: f"{where}: {m}")


def check_accounting_check(rank: int, world_size: int, device: torch.device) -> str | None:
    """The CLI's ``--check`` (fp32 and bf16 compute), without a CLI (no extra processes); at world size 2 only."""
    if world_size != 2:
        return "the CLI's check runs at world size 2"
    for dtype in (None, torch.bfloat16):
        result = fsdp_accounting.check_against_one_process(rank, world_size, device, dtype, steps=2)
        assert result["max_abs_diff"] <= 1e-4 and result["grad_max_abs_diff"] <= 1e-4, result
    return None


# Run in this order in one spawn per world size; each is its own test below. ``errors`` is last: it leaves a
# failed backward behind. A check returns None, or why it was skipped.
CHECKS = {
    "toy_models": check_toy_models,
    "reduce_scatter_fallback": check_reduce_scatter_fallback,
    "mixed_precision": check_mixed_precision,
    "lm_prefetch_and_memory": check_lm_prefetch_and_memory,
    "lm_training": check_lm_training,
    "gradient_memory": check_gradient_memory,
    "ddp_2026_names": check_ddp_2026_names,
    "accounting_check": check_accounting_check,
    "careless_use": check_careless_use,
    "errors": check_errors,
}


# Each spawn takes 20-30 s on two cores (imports, then every check): slow.
@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)],
                ids=lambda world_size: f"world{world_size}")
def gloo_outcomes(request) -> dict[str, list[str]]:
    """One spawn per world size (each costs seconds of imports) runs every check."""
    return run_checks(CHECKS, request.param, timeout_s=240, warnings_as_errors=True)


@pytest.mark.parametrize("check", list(CHECKS))
def test_fsdp_matches_single_process(gloo_outcomes, check):
    assert_passed(gloo_outcomes[check])


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_with_nccl():
    assert_all_passed(run_checks(CHECKS, gpu_world_size(), backend="nccl", timeout_s=300, warnings_as_errors=True))


def test_equality_demo_runs(capsys):
    """``scripts/fsdp_equality_demo.py`` (a leaf script, run in this process): one step, the table printed."""
    demo = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "fsdp_equality_demo.py"))
    demo["main"](["--steps", "1"])
    out = capsys.readouterr().out
    assert "head.weight" in out and "torch.equal on every parameter after 1 steps" in out


# ---------------------------------------------------------------------------------------------------
# fsdp_accounting: the CLI on the CPU, and the timeline analysis on a made-up trace
# ---------------------------------------------------------------------------------------------------


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # three quick runs of the CLI, each spawning its ranks: about 90 s on two cores
def test_fsdp_accounting_quick_on_cpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fsdp_accounting.main(["--help"])
    assert exit_info.value.code == 0 and "--quick" in capsys.readouterr().out
    argv = ["--quick", "--results-dir", str(tmp_path), "--backend", "gloo", "--world-size", "2"]
    fsdp_accounting.main([*argv, "--checkpointing", "0"])
    rows = {row["impl"]: row for row in read_rows(tmp_path / "fsdp_accounting.jsonl")}
    assert list(rows) == ["ddp", "fsdp2", "ours"]
    assert all(row["checkpointing"] == 0 for row in rows.values())
    for row in rows.values():
        assert row["measure"] == "step" and row["size"] == "tiny" and row["world_size"] == 2 and row["step_ms"] > 0
        assert len(row["step_ms_per_rank"]) == 2
    params = rows["ddp"]["params"]
    assert rows["ddp"]["local_params"] == params and rows["ddp"]["expected_saving_gb"] == 0
    # Sharded over 2 ranks: half the parameters each (ours pads each unit's flat buffer by at most one element).
    assert rows["fsdp2"]["local_params"] * 2 >= params and rows["ours"]["local_params"] * 2 >= params
    assert rows["ours"]["local_params"] * 2 - params < 10
    assert rows["ours"]["expected_saving_gb"] == pytest.approx(16 * (params - rows["ours"]["local_params"]) / 1e9)
    assert rows["ours"]["step_ratio_vs_fsdp2"] == pytest.approx(rows["ours"]["step_ms"] / rows["fsdp2"]["step_ms"])
    fsdp_accounting.main([*argv, "--checkpointing", "0"])  # measured already: resumes without starting any rank
    assert len(read_rows(tmp_path / "fsdp_accounting.jsonl")) == 3
    assert "nothing to measure (--force measures again)" in capsys.readouterr().err
    # Checkpointed blocks: a case of its own, compared with FSDP2 checkpointed alike.
    fsdp_accounting.main([*argv, "--checkpointing", "1", "--impls", "fsdp2", "ours"])
    checkpointed = {row["impl"]: row for row in read_rows(tmp_path / "fsdp_accounting.jsonl")[3:]}
    assert list(checkpointed) == ["fsdp2", "ours"] and checkpointed["ours"]["checkpointing"] == 1
    assert checkpointed["ours"]["step_ratio_vs_fsdp2"] == pytest.approx(
        checkpointed["ours"]["step_ms"] / checkpointed["fsdp2"]["step_ms"])


def _event(cat: str, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 1, "args": args}


def _launch(api: str, ts: float, kernel: str, start: float, dur: float, stream: int, correlation: int) -> list[dict]:
    """A host-side launch at ``ts`` and the GPU kernel it started."""
    return [_event("cuda_driver" if api == "cuLaunchKernelEx" else "cuda_runtime", api, ts, 1, correlation=correlation),
            _event("kernel", kernel, start, dur, stream=stream, correlation=correlation)]


def synthetic_trace() -> dict:
    """Weight a: gathered in time. Weight b: its layer waits for the gather. Then one reduction."""
    compute, gather = "sm90_xmma_gemm_bf16", "ncclDevKernel_AllGather_RING_LL"
    return {"traceEvents": [
        _event("user_annotation", "step.forward", 0, 1000),
        _event("user_annotation", "step.backward", 1000, 1000),
        *_launch("cudaLaunchKernel", 5, compute, 0, 40, stream=7, correlation=3),
        _event("user_annotation", "fsdp.all_gather a.weight", 10, 2),
        *_launch("cuLaunchKernelEx", 11, gather, 20, 30, stream=20, correlation=1),
        _event("user_annotation", "fsdp.use a.weight", 60, 1),
        *_launch("cudaLaunchKernel", 62, compute, 70, 30, stream=7, correlation=2),
        _event("user_annotation", "fsdp.all_gather b.weight", 100, 2),
        *_launch("cuLaunchKernelEx", 101, gather, 110, 190, stream=20, correlation=4),
        _event("user_annotation", "fsdp.use b.weight", 120, 1),
        *_launch("cudaLaunchKernel", 121, compute, 300, 20, stream=7, correlation=5),
        _event("user_annotation", "fsdp.reduce_scatter a.weight", 1100, 2),
        *_launch("cuLaunchKernelEx", 1101, "ncclDevKernel_SendRecv", 1110, 40, stream=20, correlation=6),
    ]}


def test_timeline_pairs_gathers_with_uses_and_draws(tmp_path):
    analysis = timeline.analyze_gathers(synthetic_trace())
    uses = {use.weight: use for use in analysis["uses"]}
    assert not uses["a.weight"].exposed and uses["a.weight"].stall_us == 0
    assert uses["b.weight"].exposed and uses["b.weight"].stall_us == pytest.approx(300 - 121)
    summary = analysis["summary"]
    assert summary["forward_gathers"] == 2 and summary["forward_gathers_exposed"] == 1
    assert summary["forward_stall_ms"] == pytest.approx(0.179) and summary["backward_gathers"] == 0
    assert summary["reduce_scatters"] == 1
    assert summary["comm_ms"] == pytest.approx(0.26) and summary["comm_hidden_ms"] == pytest.approx(0.02)
    assert summary["comm_exposed_ms"] == pytest.approx(0.24) and summary["span_ms"] == pytest.approx(1.15)
    timeline.render_gathers(analysis, tmp_path / "timeline.png", "synthetic", zoom_ms=0.5)
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="no GPU kernels"):
        timeline.render_gathers(timeline.analyze_gathers({"traceEvents": []}), tmp_path / "empty.png", "empty")


def test_fsdp_without_process_group_names_the_fix():
    with pytest.raises(RuntimeError, match=r"FSDP needs an initialised default process group: call torch\.distributed"):
        FSDP(nn.Linear(2, 2))
