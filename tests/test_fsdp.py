"""FSDP against single-process training (gloo on CPU at world sizes 2 and 3; NCCL with 2+ GPUs), the 2026
DDP entry points, and the ``fsdp_accounting`` CLI on the CPU.

Every spawn costs seconds of imports, so each world size is one spawn that runs all the checks; every
check goes through the grader's adapters. The reference is one process training on the full batch by
gradient accumulation over the ranks' slices, in rank order, then dividing by the world size: the same
gradient as one backward over the full batch (checked to float tolerance below), in the one summation
order a data-parallel run can reproduce bit for bit (``cs336_systems/parallel/fsdp.py`` explains).
Warnings are errors, in the workers and here.
"""

from __future__ import annotations

import json
import math
import time
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from cs336_basics.model import Embedding, Linear, RMSNorm
from cs336_basics.nn_utils import cross_entropy
from cs336_basics.optimizer import AdamW
from cs336_systems.bench import fsdp_accounting
from cs336_systems.bench.common import timeline
from cs336_systems.bench.common.lm import LMConfig, build_model
from cs336_systems.parallel.distributed import spawn
from cs336_systems.parallel.fsdp import FSDP
from tests import adapters
from tests._ddp_toy_models import current_device

pytestmark = pytest.mark.filterwarnings("error")

# No width divides by 2 and 3 at once; 10 rows divide by 2 (the unpadded path), 23 and 13 by neither.
VOCAB, D_MODEL, D_HIDDEN, SEQ = 23, 10, 13, 5
STEPS = 3


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


def build(seed: int, device: torch.device, **kwargs) -> SmallNet:
    torch.manual_seed(seed)
    return SmallNet(**kwargs).to(device)


def full_batch(step: int, world_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets ``(2 * world_size, SEQ)``, the same on every rank."""
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(VOCAB, (2 * world_size, SEQ + 1), generator=generator).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def rank_slice(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    size = batch[0].shape[0] // world_size
    return tuple(t[rank * size : (rank + 1) * size] for t in batch)


def reference_backward(model: nn.Module, batch, world_size: int) -> None:
    """The full batch's gradient by accumulation over the ranks' slices in rank order, then / world size."""
    for rank in range(world_size):
        x, y = rank_slice(batch, rank, world_size)
        cross_entropy(model(x), y).backward()
    for param in model.parameters():
        if param.grad is not None:
            param.grad.div_(world_size)


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
        return AdamW(params, lr=1e-2, weight_decay=0.1)  # cs336_basics' AdamW
    raise ValueError(name)


def compare(actual: torch.Tensor, expected: torch.Tensor, where: str, exact: bool, tol: float = 1e-6) -> None:
    if exact:
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where}: max |diff| {(actual - expected).abs().max().item():.3e}"
    else:
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{where}: {m}")


def full_rows(weight, rank: int) -> slice:
    """The rows of the full weight that ``rank``'s shard holds (the rest of the shard is padding)."""
    start = rank * weight.shard_rows
    return slice(start, min(start + weight.shard_rows, weight.rows))


def assert_same_on_every_rank(tensor: torch.Tensor, where: str) -> None:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    for other, value in enumerate(gathered):
        assert torch.equal(value, tensor), f"{where}: rank {other} differs from rank {dist.get_rank()}"


def check_gradients(fsdp: FSDP, reference: nn.Module, rank: int, where: str, exact: bool, tol: float = 1e-6) -> None:
    """Every gradient fp32, shaped like its parameter; shards hold the reference's rows; replicated ones agree."""
    reference_grads = {name: p.grad for name, p in reference.named_parameters()}
    sharded = {id(w.param): w for w in fsdp.sharded_weights}
    for name, param in fsdp.module.named_parameters():
        context = f"{where}, gradient of {name}"
        expected = reference_grads[name]
        if not param.requires_grad:
            assert param.grad is None and expected is None, context
            continue
        assert param.grad is not None and param.grad.shape == param.shape, context
        assert param.grad.dtype == torch.float32, context
        weight = sharded.get(id(param))
        if weight is None:
            assert_same_on_every_rank(param.grad, context)
            compare(param.grad, expected, context, exact, tol)
        else:
            rows = full_rows(weight, rank)
            compare(param.grad[: rows.stop - rows.start], expected[rows], context, exact, tol)
            assert not param.grad[rows.stop - rows.start :].any(), f"{context}: padding rows got a gradient"


def check_full_params(fsdp: FSDP, reference: nn.Module, where: str, exact: bool, tol: float = 1e-6) -> None:
    grads = fsdp.gather_full_grads()
    for name, param in reference.named_parameters():
        if param.grad is None:
            assert grads[name] is None, f"{where}, {name}"
        else:
            compare(grads[name], param.grad, f"{where}, full gradient of {name}", exact, tol)
    full = adapters.fsdp_gather_full_params(fsdp)
    expected = dict(reference.named_parameters())
    assert list(full) == list(expected), where
    for name, tensor in full.items():
        compare(tensor, expected[name].detach(), f"{where}, {name}", exact, tol)


def check_matches_single_process(rank: int, world_size: int, device: torch.device, exact: bool) -> None:
    """fp32: gradients and weights equal the reference's after every SGD / AdamW step (bit for bit on CPU)."""
    for tied in (False, True):
        for optimizer_name in ("sgd", "adamw"):
            where = f"fp32, tied={tied}, {optimizer_name}, rank {rank}/{world_size}"
            fsdp = adapters.get_fsdp(build(seed=rank, device=device, tied=tied))
            reference = build(seed=0, device=device, tied=tied)
            assert fsdp.module.__class__ is SmallNet
            assert [n for n, _ in fsdp.module.named_parameters()] == [n for n, _ in reference.named_parameters()]
            check_full_params(fsdp, reference, f"{where}, after construction", exact=True)
            optimizer = make_optimizer(optimizer_name, fsdp.parameters())
            reference_optimizer = make_optimizer(optimizer_name, reference.parameters())
            set_to_none = optimizer_name != "sgd"  # SGD: shard gradients exist (zeros) and are added to
            for step in range(STEPS):
                batch = full_batch(step, world_size, device)
                optimizer.zero_grad(set_to_none=set_to_none)
                x, y = rank_slice(batch, rank, world_size)
                cross_entropy(fsdp(x), y).backward()
                adapters.fsdp_on_after_backward(fsdp, optimizer)
                reference_optimizer.zero_grad(set_to_none=set_to_none)
                reference_backward(reference, batch, world_size)
                check_gradients(fsdp, reference, rank, f"{where}, step {step}", exact)
                optimizer.step()
                reference_optimizer.step()
                check_full_params(fsdp, reference, f"{where}, after step {step}", exact)

    # The accumulated reference is the full-batch gradient: one backward over the whole batch agrees to
    # float tolerance (and only to tolerance: one matmul sums the tokens in its own order).
    reference, single = build(seed=0, device=device), build(seed=0, device=device)
    batch = full_batch(0, world_size, device)
    reference_backward(reference, batch, world_size)
    cross_entropy(single(batch[0]), batch[1]).backward()
    for (name, p), q in zip(reference.named_parameters(), single.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


class CastTo(nn.Module):
    """Parametrization: the weight read in forward is the fp32 master weight cast to ``dtype``."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(self.dtype)


def mixed_precision_reference(seed: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The non-parallel mixed-precision model: Linear and Embedding weights cast to ``dtype`` for forward and
    backward, fp32 master weights and gradients."""
    model = build(seed=seed, device=device)
    for unit in model.modules():
        if isinstance(unit, (Linear, Embedding)):
            parametrize.register_parametrization(unit, "weight", CastTo(dtype), unsafe=True)
    return model


class MasterWeights(nn.Module):
    """Names the reference's fp32 master weights as the plain model names them."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def named_parameters(self, *args, **kwargs):
        for name, param in self.model.named_parameters():
            yield name.replace(".parametrizations.weight.original", ".weight"), param


def check_mixed_precision(rank: int, world_size: int, device: torch.device) -> None:
    """fp16 / bf16 compute: weights travel and compute in the low precision, master weights and gradients stay
    fp32, and training matches the reference with the same casts to 1e-4."""
    for dtype in (torch.float16, torch.bfloat16):
        where = f"{dtype}, rank {rank}/{world_size}"
        fsdp = adapters.get_fsdp(build(seed=rank, device=device), compute_dtype=dtype)
        reference = mixed_precision_reference(seed=0, device=device, dtype=dtype)
        named_reference = MasterWeights(reference)
        dtypes = []
        start_gather = fsdp._start_gather

        def recording_gather(weight, start_gather=start_gather, dtypes=dtypes):
            gather = start_gather(weight)
            dtypes.append(gather.buffer.dtype)
            return gather

        fsdp._start_gather = recording_gather
        optimizer = make_optimizer("adamw", fsdp.parameters())
        reference_optimizer = make_optimizer("adamw", reference.parameters())
        for step in range(STEPS):
            batch = full_batch(step, world_size, device)
            optimizer.zero_grad()
            x, y = rank_slice(batch, rank, world_size)
            logits = fsdp(x)
            assert logits.dtype == dtype, where
            cross_entropy(logits, y).backward()
            adapters.fsdp_on_after_backward(fsdp, optimizer)
            reference_optimizer.zero_grad()
            reference_backward(reference, batch, world_size)
            check_gradients(fsdp, named_reference, rank, f"{where}, step {step}", exact=False, tol=1e-4)
            optimizer.step()
            reference_optimizer.step()
            check_full_params(fsdp, named_reference, f"{where}, after step {step}", exact=False, tol=1e-4)
        assert all(p.dtype == torch.float32 for p in fsdp.parameters()), where
        assert dtypes and set(dtypes) == {dtype}, f"{where}: gathered in {set(dtypes)}"


def check_shard_storage(rank: int, world_size: int, device: torch.device) -> None:
    """Each shard owns its storage, ``ceil(rows / W)`` rows of the full weight's row size, in fp32."""
    reference = build(seed=0, device=device)
    fsdp = adapters.get_fsdp(build(seed=rank, device=device))
    full_bytes = padded_bytes = shard_bytes = 0
    storages = set()
    for weight in fsdp.sharded_weights:
        full = dict(reference.named_parameters())[weight.name]
        row_bytes = full[0].numel() * 4
        storage = weight.param.untyped_storage()
        assert weight.param.dtype == torch.float32 and weight.param.shape[1:] == full.shape[1:]
        assert storage.nbytes() == math.ceil(full.shape[0] / world_size) * row_bytes, weight.name
        storages.add(storage.data_ptr())
        full_bytes += full.numel() * 4
        padded_bytes += weight.padded_shape.numel() * 4
        shard_bytes += storage.nbytes()
    assert len(storages) == len(fsdp.sharded_weights)
    assert shard_bytes * world_size == padded_bytes < full_bytes + world_size * 4 * sum(
        w.padded_shape[1:].numel() for w in fsdp.sharded_weights
    )
    assert_same_on_every_rank(torch.tensor([shard_bytes], device=device), "shard bytes")


def check_prefetch_and_free(rank: int, world_size: int, device: torch.device) -> None:
    """The gather of unit call i starts once call i - 2 has finished its forward; gathered weights are freed
    after use and gathered again in backward; at most three are alive at once."""
    fsdp = adapters.get_fsdp(build(seed=rank, device=device))
    order = ["embedding", "up", "down", "frozen", "head"]
    events: list[tuple[str, str]] = []
    buffers: list[weakref.ref] = []
    alive_peak = [0]
    start_gather = fsdp._start_gather

    def alive(limit: int = 0) -> int:
        """Gathered weights still alive, once at most ``limit`` or after 2 s. The backend's threads let go of
        a finished collective's tensors a moment after completing it (gloo's worker, NCCL's watchdog)."""
        deadline = time.monotonic() + 2.0
        while True:
            count = sum(ref() is not None for ref in buffers)
            if count <= limit or time.monotonic() > deadline:
                return count
            time.sleep(0.002)

    def recording_gather(weight):
        gather = start_gather(weight)
        events.append(("gather", weight.name.removesuffix(".weight")))
        buffers.append(weakref.ref(gather.buffer))
        alive_peak[0] = max(alive_peak[0], alive(limit=3))
        return gather

    fsdp._start_gather = recording_gather
    for name in order:  # runs before FSDP's own hook, which starts the next prefetch
        getattr(fsdp.module, name).register_forward_hook(
            lambda unit, args, out, name=name: events.append(("done", name)), prepend=True
        )
    optimizer = make_optimizer("adamw", fsdp.parameters())
    for step in range(2):
        events.clear()
        optimizer.zero_grad()
        x, y = rank_slice(full_batch(step, world_size, device), rank, world_size)
        logits = fsdp(x)
        forward_events = list(events)
        assert alive() == 0, f"step {step}: {alive()} gathered weights outlive the forward"
        assert [name for kind, name in forward_events if kind == "gather"] == order
        assert [name for kind, name in forward_events if kind == "done"] == order
        for i, name in enumerate(order):
            position = forward_events.index(("gather", name))
            if i >= 2:
                assert forward_events.index(("done", order[i - 2])) < position, (name, forward_events)
            if i >= 1:
                assert position < forward_events.index(("done", order[i - 1])), (name, forward_events)
        cross_entropy(logits, y).backward()
        adapters.fsdp_on_after_backward(fsdp, optimizer)
        backward_gathers = [name for kind, name in events[len(forward_events) :] if kind == "gather"]
        # The embedding's backward needs no weight; the others are gathered again, last first.
        assert backward_gathers == ["head", "frozen", "down", "up"], backward_gathers
        assert alive() == 0
        optimizer.step()
    assert alive_peak[0] <= 3, alive_peak[0]


def check_errors(rank: int, world_size: int, device: torch.device) -> None:
    fsdp = adapters.get_fsdp(build(seed=rank, device=device))
    x, y = rank_slice(full_batch(0, world_size, device), rank, world_size)
    with pytest.raises(RuntimeError, match="outside FSDP.forward"):
        fsdp.module(x)
    cross_entropy(fsdp(x), y).backward()
    with pytest.raises(RuntimeError, match="finish_gradient_synchronization"):
        fsdp(x)
    fsdp.finish_gradient_synchronization()
    with torch.no_grad():  # evaluation: no backward, nothing to synchronise
        fsdp(x)
        fsdp(x)
    with pytest.raises(ValueError, match="floating-point"):
        FSDP(build(seed=rank, device=device), compute_dtype=torch.int32)


def check_tiny_lm(rank: int, world_size: int, device: torch.device, exact: bool) -> None:
    """The real ``BasicsTransformerLM`` (size "tiny") against one process, AdamW, fp32."""
    config = LMConfig("tiny", context_length=16, batch_size=2 * world_size)
    torch.manual_seed(rank)
    fsdp = adapters.get_fsdp(build_model(config, device))
    torch.manual_seed(0)
    reference = build_model(config, device)
    optimizer = make_optimizer("adamw", fsdp.parameters())
    reference_optimizer = make_optimizer("adamw", reference.parameters())
    generator = torch.Generator().manual_seed(7)
    for step in range(2):
        tokens = torch.randint(10_000, (config.batch_size, config.context_length + 1), generator=generator).to(device)
        batch = (tokens[:, :-1], tokens[:, 1:])
        optimizer.zero_grad()
        x, y = rank_slice(batch, rank, world_size)
        cross_entropy(fsdp(x), y).backward()
        adapters.fsdp_on_after_backward(fsdp, optimizer)
        reference_optimizer.zero_grad()
        reference_backward(reference, batch, world_size)
        check_gradients(fsdp, reference, rank, f"tiny LM, step {step}", exact, tol=1e-5)
        optimizer.step()
        reference_optimizer.step()
    check_full_params(fsdp, reference, "tiny LM", exact, tol=1e-5)


def check_ddp_2026_names(rank: int, world_size: int, device: torch.device) -> None:
    """``get_ddp`` / ``ddp_on_after_backward``: rank 0's weights at start, then single-process training."""
    ddp = adapters.get_ddp(build(seed=rank, device=device))
    reference = build(seed=0, device=device)
    assert ddp.module.__class__ is SmallNet
    assert [n for n, _ in ddp.named_parameters()] == [f"module.{n}" for n, _ in reference.named_parameters()]
    optimizer = make_optimizer("adamw", ddp.parameters())
    reference_optimizer = make_optimizer("adamw", reference.parameters())
    for step in range(2):
        batch = full_batch(step, world_size, device)
        optimizer.zero_grad()
        x, y = rank_slice(batch, rank, world_size)
        cross_entropy(ddp(x), y).backward()
        adapters.ddp_on_after_backward(ddp, optimizer)
        optimizer.step()
        reference_optimizer.zero_grad()
        reference_backward(reference, batch, world_size)
        reference_optimizer.step()
        for (name, p), q in zip(ddp.module.named_parameters(), reference.parameters()):
            where = f"DDP, {name}, step {step}"
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, where=where: f"{where}: {m}")


def run_checks(rank: int, world_size: int, exact: bool) -> None:
    warnings.simplefilter("error")
    torch.set_num_threads(1)  # the reference runs in the same process with the same kernels
    device = current_device()
    check_matches_single_process(rank, world_size, device, exact)
    check_mixed_precision(rank, world_size, device)
    check_shard_storage(rank, world_size, device)
    check_prefetch_and_free(rank, world_size, device)
    check_errors(rank, world_size, device)
    check_ddp_2026_names(rank, world_size, device)
    if world_size == 2:
        check_tiny_lm(rank, world_size, device, exact)
        for dtype in (None, torch.bfloat16):  # the CLI's --check, without a CLI (no extra processes)
            result = fsdp_accounting.check_against_one_process(rank, world_size, device, dtype, steps=2)
            assert result["bit_exact"] or not exact, result
            assert result["max_abs_diff"] <= 1e-4 and result["grad_max_abs_diff"] <= 1e-4, result


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_matches_single_process(world_size):
    spawn(run_checks, world_size, True, backend="gloo", timeout_s=240)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_with_nccl():
    # GPU kernels are deterministic for equal shapes, but not promised to be: compare to float tolerance.
    spawn(run_checks, 2, False, backend="nccl", timeout_s=300)


# ---------------------------------------------------------------------------------------------------
# fsdp_accounting: the CLI on the CPU, and the timeline analysis on a made-up trace
# ---------------------------------------------------------------------------------------------------


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fsdp_accounting_quick_on_cpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fsdp_accounting.main(["--help"])
    assert exit_info.value.code == 0 and "--quick" in capsys.readouterr().out
    argv = ["--quick", "--results-dir", str(tmp_path), "--backend", "gloo", "--world-size", "2"]
    fsdp_accounting.main(argv)
    rows = {row["impl"]: row for row in read_rows(tmp_path / "fsdp_accounting.jsonl")}
    assert list(rows) == ["ddp", "fsdp2", "ours"]
    for row in rows.values():
        assert row["measure"] == "step" and row["size"] == "tiny" and row["world_size"] == 2 and row["step_ms"] > 0
        assert len(row["step_ms_per_rank"]) == 2
    params = rows["ddp"]["params"]
    assert rows["ddp"]["local_params"] == params and rows["ddp"]["expected_saving_gb"] == 0
    # Sharded over 2 ranks: half the parameters each (ours pads odd row counts by a row).
    assert rows["fsdp2"]["local_params"] * 2 >= params and rows["ours"]["local_params"] * 2 >= params
    assert rows["ours"]["local_params"] * 2 - params < 1000
    assert rows["ours"]["expected_saving_gb"] == pytest.approx(16 * (params - rows["ours"]["local_params"]) / 1e9)
    assert rows["ours"]["step_ratio_vs_fsdp2"] == pytest.approx(rows["ours"]["step_ms"] / rows["fsdp2"]["step_ms"])
    fsdp_accounting.main(argv)  # measured already: resumes without starting any rank
    assert len(read_rows(tmp_path / "fsdp_accounting.jsonl")) == 3
    assert "already measured" in capsys.readouterr().err


def _event(cat: str, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 1, "args": args}


def synthetic_trace() -> dict:
    """Weight a: gathered in time. Weight b: its layer waits for the gather. Then one reduction."""
    compute = "sm90_xmma_gemm_bf16"
    return {"traceEvents": [
        _event("user_annotation", "step.forward", 0, 1000),
        _event("user_annotation", "step.backward", 1000, 1000),
        _event("cuda_runtime", "cudaLaunchKernel", 5, 1, correlation=3),
        _event("kernel", compute, 0, 40, stream=7, correlation=3),
        _event("user_annotation", "fsdp.all_gather a.weight", 10, 2),
        _event("cuda_driver", "cuLaunchKernelEx", 11, 1, correlation=1),
        _event("kernel", "ncclDevKernel_AllGather_RING_LL", 20, 30, stream=20, correlation=1),
        _event("user_annotation", "fsdp.use a.weight", 60, 1),
        _event("cuda_runtime", "cudaLaunchKernel", 62, 1, correlation=2),
        _event("kernel", compute, 70, 30, stream=7, correlation=2),
        _event("user_annotation", "fsdp.all_gather b.weight", 100, 2),
        _event("cuda_driver", "cuLaunchKernelEx", 101, 1, correlation=4),
        _event("kernel", "ncclDevKernel_AllGather_RING_LL", 110, 190, stream=20, correlation=4),
        _event("user_annotation", "fsdp.use b.weight", 120, 1),
        _event("cuda_runtime", "cudaLaunchKernel", 121, 1, correlation=5),
        _event("kernel", compute, 300, 20, stream=7, correlation=5),
        _event("user_annotation", "fsdp.reduce_scatter a.weight", 1100, 2),
        _event("cuda_driver", "cuLaunchKernelEx", 1101, 1, correlation=6),
        _event("kernel", "ncclDevKernel_SendRecv", 1110, 40, stream=20, correlation=6),
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
