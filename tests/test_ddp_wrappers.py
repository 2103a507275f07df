"""The DDP wrappers against single-process training (gloo on CPU, world size 2; NCCL with 2+ GPUs).

Every spawned process costs seconds of imports, so each family of variants (``naive``, ``flat``, ``overlap``, the
``bucketed_<N>mb`` ones) is one spawn (``tests/_distributed.py``) whose checks loop over models and optimizers. In every run each rank builds the model from its own seed (the wrapper
must broadcast rank 0's weights), trains on its slice of each batch, and after every step its gradients
and weights are compared with a single-process model that started from rank 0's weights and trained on
the full batch (loss averaged over the batch).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from cs336_systems.parallel.ddp import DDPBucketed, bucket_size_mb, bucketed, wrap_ddp
from tests._ddp_toy_models import MODELS, BranchNet, assert_close, assert_same_tensors, build, make_optimizer
from tests._distributed import Check, assert_all_passed, gpu_world_size, run_checks

BATCH_SIZE = 8
STEPS = 4
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# Tiny: every tensor in a bucket of its own; 0.0015 MiB: a few tensors per bucket; huge: one bucket per dtype.
BUCKET_SIZES_MB = (1e-6, 0.0015, 1000.0)
FAMILIES = {"naive": ("naive",), "flat": ("flat",), "overlap": ("overlap",),
            "bucketed": tuple(bucketed(mb) for mb in BUCKET_SIZES_MB)}


def _grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: param.grad for name, param in module.named_parameters()}


def _assert_same_grads(ddp_model: nn.Module, reference: nn.Module, context: str) -> None:
    actual, expected = _grads(ddp_model.module), _grads(reference)
    for name, expected_grad in expected.items():
        if expected_grad is None:
            assert actual[name] is None, f"{context}, {name}: has a gradient, single-process training has none"
        else:
            assert actual[name] is not None, f"{context}, {name}: no gradient"
            assert_close(actual[name], expected_grad, f"{context}, {name}", **TOLERANCE)


def check_matches_single_process(rank: int, world_size: int, device: torch.device, variant: str) -> None:
    """Construction broadcast, parameter order, then several steps of SGD and AdamW against one process."""
    local = slice(rank * BATCH_SIZE // world_size, (rank + 1) * BATCH_SIZE // world_size)
    for model_name, model_cls in MODELS.items():
        for optimizer_name in ("sgd", "adamw"):
            context = f"{variant}, {model_name}, {optimizer_name}, rank {rank}"
            ddp_model = wrap_ddp(variant, build(model_cls, seed=rank, device=device))
            reference = build(model_cls, seed=0, device=device)

            assert ddp_model.module.__class__ is model_cls
            assert [name for name, _ in ddp_model.named_parameters()] == [
                f"module.{name}" for name, _ in reference.named_parameters()
            ], context
            assert_same_tensors(
                dict(ddp_model.module.state_dict()), dict(reference.state_dict()), f"{context}, after construction"
            )
            frozen = {name: p.detach().clone() for name, p in reference.named_parameters() if not p.requires_grad}

            optimizer = make_optimizer(optimizer_name, ddp_model.parameters())
            reference_optimizer = make_optimizer(optimizer_name, reference.parameters())
            # SGD keeps gradients allocated (zeroed in place), AdamW sets them to None: both paths of the
            # bucketed wrapper's gradient views get exercised.
            set_to_none = optimizer_name == "adamw"
            for step in range(STEPS):
                x, y = model_cls.batch(step, BATCH_SIZE, device)
                ddp_model.on_train_batch_start()
                optimizer.zero_grad(set_to_none=set_to_none)
                model_cls.loss(ddp_model(x[local]), y[local]).backward()
                ddp_model.finish_gradient_synchronization()
                optimizer.step()

                reference_optimizer.zero_grad(set_to_none=set_to_none)
                model_cls.loss(reference(x), y).backward()
                reference_optimizer.step()

                _assert_same_grads(ddp_model, reference, f"{context}, step {step}")
                assert_same_tensors(
                    dict(ddp_model.module.named_parameters()),
                    dict(reference.named_parameters()),
                    f"{context}, step {step}",
                    **TOLERANCE,
                )
            for name, param in ddp_model.module.named_parameters():
                if name in frozen:
                    assert param.grad is None and torch.equal(param, frozen[name]), (
                        f"{context}: frozen {name} changed"
                    )


def check_gradient_accumulation(rank: int, world_size: int, device: torch.device, variant: str) -> None:
    """Two micro-batches, the first under no_sync(), then one synchronisation: the full-batch gradient."""
    model_cls = MODELS["frozen_parts"]
    local = slice(rank * BATCH_SIZE // world_size, (rank + 1) * BATCH_SIZE // world_size)
    context = f"{variant}, gradient accumulation, rank {rank}"
    ddp_model = wrap_ddp(variant, build(model_cls, seed=rank, device=device))
    reference = build(model_cls, seed=0, device=device)
    micro_batches = [model_cls.batch(step, BATCH_SIZE, device) for step in range(2)]
    for repeat in range(2):  # the second round starts from the views left by the first
        ddp_model.on_train_batch_start()
        ddp_model.zero_grad(set_to_none=repeat == 0)
        reference.zero_grad(set_to_none=repeat == 0)
        with ddp_model.no_sync():
            x, y = micro_batches[0]
            model_cls.loss(ddp_model(x[local]), y[local]).backward()
        x, y = micro_batches[1]
        model_cls.loss(ddp_model(x[local]), y[local]).backward()
        ddp_model.finish_gradient_synchronization()
        for x, y in micro_batches:
            model_cls.loss(reference(x), y).backward()
        _assert_same_grads(ddp_model, reference, f"{context}, round {repeat}")


def check_careless_use_is_harmless(rank: int, world_size: int, device: torch.device, variant: str) -> None:
    """An optimizer built before wrapping trains the wrapped model like one process; a second
    finish_gradient_synchronization() leaves the averaged gradients as they are; a module without parameters works."""
    model_cls = MODELS["frozen_parts"]
    local = slice(rank * BATCH_SIZE // world_size, (rank + 1) * BATCH_SIZE // world_size)
    context = f"{variant}, optimizer built before wrapping, rank {rank}"
    model = build(model_cls, seed=rank, device=device)
    optimizer = make_optimizer("adamw", model.parameters())
    ddp_model = wrap_ddp(variant, model)
    reference = build(model_cls, seed=0, device=device)
    reference_optimizer = make_optimizer("adamw", reference.parameters())
    for step in range(2):
        x, y = model_cls.batch(step, BATCH_SIZE, device)
        ddp_model.on_train_batch_start()
        optimizer.zero_grad()
        model_cls.loss(ddp_model(x[local]), y[local]).backward()
        ddp_model.finish_gradient_synchronization()
        averaged = {name: grad.clone() for name, grad in _grads(ddp_model.module).items() if grad is not None}
        ddp_model.finish_gradient_synchronization()
        again = {name: grad for name, grad in _grads(ddp_model.module).items() if grad is not None}
        assert_same_tensors(again, averaged, f"{context}, step {step}, finish_gradient_synchronization() twice")
        optimizer.step()
        reference_optimizer.zero_grad()
        model_cls.loss(reference(x), y).backward()
        reference_optimizer.step()
        assert_same_tensors(dict(ddp_model.module.named_parameters()), dict(reference.named_parameters()),
                            f"{context}, step {step}", **TOLERANCE)
    no_parameters = wrap_ddp(variant, nn.ReLU())
    x = torch.tensor([[-1.0, 2.0]], device=device, requires_grad=True)
    no_parameters(x).sum().backward()
    no_parameters.finish_gradient_synchronization()
    assert x.grad.tolist() == [[0.0, 1.0]]


def check_second_backward_raises(rank: int, world_size: int, device: torch.device, variant: str) -> None:
    """Producing a gradient twice before synchronising is an error, not a silent race with the wire."""
    model_cls = MODELS["tied_embedding"]
    ddp_model = wrap_ddp(variant, build(model_cls, seed=rank, device=device))
    x, y = model_cls.batch(0, BATCH_SIZE, device)
    model_cls.loss(ddp_model(x), y).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        model_cls.loss(ddp_model(x), y).backward()
    ddp_model.on_train_batch_start()  # waits for what the first backward launched
    ddp_model.zero_grad()
    model_cls.loss(ddp_model(x), y).backward()
    ddp_model.finish_gradient_synchronization()


def check_rank_dependent_unused_parameter(rank: int, world_size: int, device: torch.device) -> None:
    """Only rank 0 uses a branch: no hang, and every rank ends with the same, averaged gradients.

    A rank without a gradient counts as zeros; a parameter no rank used keeps ``grad is None``.
    """
    local_size = BATCH_SIZE // world_size
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH_SIZE, BranchNet.in_features, generator=generator).to(device)
    y = torch.randn(BATCH_SIZE, generator=generator).to(device)

    def local_loss(model: nn.Module, some_rank: int) -> torch.Tensor:
        part = slice(some_rank * local_size, (some_rank + 1) * local_size)
        return ((model(x[part], use_branch=some_rank == 0) - y[part]) ** 2).mean()

    reference = build(BranchNet, seed=0, device=device)
    expected = {}
    for some_rank in range(world_size):
        reference.zero_grad()
        local_loss(reference, some_rank).backward()
        for name, param in reference.named_parameters():
            if param.grad is not None:
                expected[name] = expected.get(name, 0) + param.grad / world_size

    for size_mb in BUCKET_SIZES_MB:
        context = f"{bucketed(size_mb)}, branch used on rank 0 only, rank {rank}"
        ddp_model = DDPBucketed(build(BranchNet, seed=rank, device=device), size_mb)
        for step in range(2):
            ddp_model.on_train_batch_start()
            ddp_model.zero_grad(set_to_none=step == 0)
            local_loss(ddp_model, rank).backward()
            ddp_model.finish_gradient_synchronization()
            for name, param in ddp_model.module.named_parameters():
                if name in expected:
                    assert_close(param.grad, expected[name], f"{context}, {name}", **TOLERANCE)
                else:
                    assert param.grad is None, f"{context}, {name}: no rank used it, yet it has a gradient"


def family_checks(family: str) -> dict[str, Check]:
    """The checks of a family of variants: each variant against one process, with gradient accumulation, and used
    carelessly; a second backward refused where gradients travel during backward; a parameter only some ranks use
    (bucketed)."""
    checks: dict[str, Check] = {}
    for variant in FAMILIES[family]:
        checks[f"{variant} matches single process"] = partial(check_matches_single_process, variant=variant)
        checks[f"{variant} gradient accumulation"] = partial(check_gradient_accumulation, variant=variant)
        checks[f"{variant} careless use"] = partial(check_careless_use_is_harmless, variant=variant)
    first = FAMILIES[family][0]  # for bucketed: every tensor in a bucket of its own
    if family in ("overlap", "bucketed"):
        checks[f"{first} second backward raises"] = partial(check_second_backward_raises, variant=first)
    if family == "bucketed":
        checks["unused parameter on some ranks"] = check_rank_dependent_unused_parameter
    return checks


@pytest.mark.slow  # a spawn each: 10-25 s on two cores
@pytest.mark.parametrize("family", FAMILIES)
def test_ddp_wrapper_matches_single_process(family):
    assert_all_passed(run_checks(family_checks(family), 2, timeout_s=180))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_wrappers_with_nccl():
    checks = {name: check for family in FAMILIES for name, check in family_checks(family).items()}
    assert_all_passed(run_checks(checks, gpu_world_size(), backend="nccl", timeout_s=300))


def test_bucket_assignment():
    """Reverse order, the cap respected, an oversized tensor alone, a new bucket when the dtype changes."""
    from cs336_systems.parallel.ddp.bucketed import assign_buckets

    params = [
        nn.Parameter(torch.zeros(10)),  # 40 bytes
        nn.Parameter(torch.zeros(10)),
        nn.Parameter(torch.zeros(100)),  # 400 bytes: over the cap, alone
        nn.Parameter(torch.zeros(5, dtype=torch.float64)),  # 40 bytes, another dtype
        nn.Parameter(torch.zeros(10)),
    ]
    groups = assign_buckets(params, bucket_size_bytes=100)
    index = {id(param): i for i, param in enumerate(params)}
    assert [[index[id(param)] for param in group] for group in groups] == [[4], [3], [2], [1, 0]]
    assert len(assign_buckets(params, bucket_size_bytes=1)) == len(params)


@pytest.mark.parametrize("variant", ["naive", "flat", "overlap", "bucketed_1mb"])
def test_wrapper_without_process_group_names_the_fix(variant):
    with pytest.raises(RuntimeError, match=r"needs an initialised default process group: call torch\.distributed\.init_process_group"):
        wrap_ddp(variant, nn.Linear(2, 2))


def test_variant_names():
    assert bucketed(25) == "bucketed_25mb" and bucketed(0.5) == "bucketed_0.5mb" and bucketed(1e-6) == "bucketed_1e-06mb"
    assert [bucket_size_mb(name) for name in ("bucketed_25mb", "bucketed_0.5mb", "bucketed_1e-06mb", "naive")] == [
        25.0, 0.5, 1e-6, None]
    for unknown in ("flattened", "overlapped", "bucketed", "bucketed_0mb", "bucketed_fastmb", "bucketed_10"):
        with pytest.raises(ValueError, match=f"unknown DDP variant '{unknown}': one of naive, flat, overlap, "
                                             r"bucketed_<N>mb, torch_ddp"):
            wrap_ddp(unknown, nn.Linear(2, 2))


@pytest.mark.parametrize("size", ["10", 0, -1.0, float("nan"), float("inf"), True, None])
def test_bucket_size_must_be_a_positive_number(size):
    with pytest.raises(ValueError, match=r"bucket_size_mb must be a positive number of MiB \(e\.g\. 25 or 0\.5\), got "):
        DDPBucketed(nn.Linear(2, 2), size)
