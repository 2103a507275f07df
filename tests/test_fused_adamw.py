"""The fused Triton AdamW (``cs336_systems.kernels.adamw``) against ``cs336_basics.optimizer.AdamW`` and a
float64 reference: through the Triton CPU interpreter (``tests/interpreter/test_fused_adamw.py``),
and on a GPU; constructor checks and the CPU-without-interpreter error here.

The checks below take a device and are shared by both.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from tests._flash_checks import relative_error

STEPS = 20
SHAPES = [(1,), (17,), (1000,), (4097,), (33, 65), (3, 5, 7), (0,)]
GPU_SHAPES = SHAPES + [(1024, 1024), (3, 1000, 77), (3 * 50257 + 5,)]

FLOAT32_TOLERANCE = 1e-6
"""Relative error (norm of the difference over the reference's norm) of float32 parameters and moments
against the plain AdamW, and of the float32 moments against float64: both compute the same float32
operations, differing only by fused multiply-adds and the order of rounding."""

MAX_ULPS = 2
"""16-bit parameters may differ from the float64 reference rounded every step by this many units in the last
place (a float32 result on the other side of a rounding boundary, carried on), ..."""
MAX_DIFFERING_FRACTION = 0.01
"""... in at most this fraction of the elements."""


def round_to_nearest(x: Tensor, dtype: torch.dtype) -> Tensor:
    """float64 ``x`` rounded to ``dtype`` and back, as a GPU stores a float32 result in ``dtype``."""
    return x.float().to(dtype).double()


ROUND = round_to_nearest
"""How the kernel rounds float32 to 16 bits; the interpreter tests swap in truncation for bfloat16."""


# ---------------------------------------------------------------------------------------------------
# Inputs and references
# ---------------------------------------------------------------------------------------------------


def make_params(shapes, dtype: torch.dtype, device, misaligned: bool = False) -> list[Tensor]:
    """Leaf tensors of the given shapes, values about N(0, 1). ``misaligned``: the first one is a view one
    element into a buffer, so its address is not a multiple of 16 bytes (an FSDP shard can be like that)."""
    params = [torch.randn(shape, device=device).to(dtype) for shape in shapes]
    if misaligned:
        buffer = torch.randn(params[0].numel() + 1, device=device).to(dtype)
        params[0] = buffer[1:].view(params[0].shape)
    return params


def random_gradient(p: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A gradient like ``p`` with values about N(0, 1) and no exact zeros. One group of :data:`GROUPS` has
    ``eps = 0``: an element whose gradient is exactly 0 from the first step on has both moments 0 and updates
    by 0 / 0, NaN in the plain AdamW as in ours. CUDA's ``randn`` does return exact zeros (585 in 5.4e9 samples
    on an H200, one in 9e6): the likely cause of a NaN in the H200 run of the state-dict round trip (in its
    largest eps = 0 parameter)."""
    g = torch.randn_like(p, dtype=torch.float32)
    return torch.where(g == 0, torch.ones_like(g), g).to(dtype or p.dtype)


def clones(tensors: list[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in tensors]


def set_grads(params: list[Tensor], grads: list[Tensor | None], in_place: bool) -> None:
    """``p.grad = g`` (a fresh tensor each step), or ``in_place``: into the gradient already there, which keeps
    its address (as gradient accumulation after ``zero_grad(set_to_none=False)`` does)."""
    for p, g in zip(params, grads):
        if g is None:
            p.grad = None
        elif in_place and p.grad is not None:
            p.grad.copy_(g)
        else:
            p.grad = g.clone()


GROUPS = [
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    dict(lr=3e-3, betas=(0.3, 0.95), eps=1e-6, weight_decay=0.1),  # lerp weight over 0.5: torch's other formula
    dict(lr=5e-2, betas=(0.0, 0.5), eps=0.0, weight_decay=0.0),
]


def learning_rate_factor(step: int) -> float:
    """A schedule, applied to every group's lr before each step."""
    return 1 + math.sin(step)


def param_groups(params: list[Tensor]) -> list[dict]:
    """The parameters dealt round-robin to the groups of :data:`GROUPS`."""
    return [dict(GROUPS[i], params=params[i::len(GROUPS)]) for i in range(len(GROUPS))]


def step_with_schedule(optimizer: torch.optim.Optimizer, step: int) -> None:
    for group, settings in zip(optimizer.param_groups, GROUPS):
        group["lr"] = settings["lr"] * learning_rate_factor(step)
    optimizer.step()


def assert_close(value: Tensor, reference: Tensor, name: str, tolerance: float = FLOAT32_TOLERANCE) -> None:
    assert value.shape == reference.shape, name
    error = relative_error(value, reference)
    assert error <= tolerance, f"{name}: relative error {error:.2e} (tolerance {tolerance:.0e})"


def assert_same_state(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer, ours_params, their_params) -> None:
    for i, (p, q) in enumerate(zip(ours_params, their_params)):
        assert_close(p, q, f"param {i} {tuple(p.shape)}")
        if q not in theirs.state:
            assert p not in ours.state, f"param {i}: state without a step"
            continue
        state, reference = ours.state[p], theirs.state[q]
        assert type(state["step"]) is int and state["step"] == reference["step"], f"param {i}: step"
        for name in ("exp_avg", "exp_avg_sq"):
            assert state[name].dtype == torch.float32, f"param {i}: {name} is {state[name].dtype}"
            assert_close(state[name], reference[name], f"param {i} {name}")


# ---------------------------------------------------------------------------------------------------
# Checks (any device)
# ---------------------------------------------------------------------------------------------------


def check_float32_against_basics(shapes, device, steps: int = STEPS) -> None:
    """float32 parameters in three param groups (different betas, eps, weight decay), the learning rates
    changed before every step, one misaligned parameter and one that never gets a gradient: ours and the plain
    AdamW agree to float32 rounding on parameters, moments and steps. Gradients are written into the same
    tensors every step, so the launch tables are built once per param group."""
    from cs336_basics.optimizer import AdamW
    from cs336_systems.kernels.adamw import FusedAdamW

    ours_params = make_params(shapes, torch.float32, device, misaligned=True)
    their_params = clones(ours_params)
    ours, theirs = FusedAdamW(param_groups(ours_params)), AdamW(param_groups(their_params))
    no_grad = 2
    untouched = ours_params[no_grad].clone()
    for step in range(steps):
        grads = [None if i == no_grad else random_gradient(p) for i, p in enumerate(ours_params)]
        set_grads(ours_params, grads, in_place=True)
        set_grads(their_params, grads, in_place=True)
        step_with_schedule(ours, step)
        step_with_schedule(theirs, step)
    assert torch.equal(ours_params[no_grad], untouched) and ours_params[no_grad] not in ours.state
    assert_same_state(ours, theirs, ours_params, their_params)
    assert ours._tables.misses == len(GROUPS), f"{ours._tables.misses} tables built for {len(GROUPS)} launches a step"


def check_low_precision_against_float64(shapes, dtype: torch.dtype, device, grad_dtype: torch.dtype | None = None,
                                        steps: int = STEPS) -> None:
    """16-bit parameters (gradients in ``grad_dtype``, by default the parameters'), fresh gradient tensors every
    step: float32 moments within float32 rounding of float64 ones, and parameters as the float64 update rounded
    to ``dtype`` every step, to within :data:`MAX_ULPS` in a few elements."""
    from cs336_systems.kernels.adamw import FusedAdamW

    settings = GROUPS[0]
    lr, (beta1, beta2), eps, weight_decay = settings["lr"], settings["betas"], settings["eps"], settings["weight_decay"]
    params = make_params(shapes, dtype, device)
    if grad_dtype not in (None, dtype):
        for p in params:
            p.grad_dtype = None  # torch refuses a gradient of another dtype unless told to accept any
    reference = [p.double() for p in params]
    exp_avgs = [torch.zeros_like(p) for p in reference]
    exp_avg_sqs = [torch.zeros_like(p) for p in reference]
    optimizer = FusedAdamW(params, **settings)
    for t in range(1, steps + 1):
        grads = [random_gradient(p, grad_dtype or dtype) for p in params]
        set_grads(params, grads, in_place=False)
        optimizer.step()
        step_size = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        eps_hat = eps * math.sqrt(1 - beta2**t)
        for i, g in enumerate(grads):
            g = g.double()
            exp_avgs[i].lerp_(g, 1 - beta1)
            exp_avg_sqs[i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            p = reference[i] * (1 - lr * weight_decay) - step_size * exp_avgs[i] / (exp_avg_sqs[i].sqrt() + eps_hat)
            reference[i] = ROUND(p, dtype)
    ulp = torch.finfo(dtype).eps
    for i, (p, expected) in enumerate(zip(params, reference)):
        state = optimizer.state[p]
        assert p.dtype == dtype and state["step"] == steps
        for name, moment in (("exp_avg", exp_avgs[i]), ("exp_avg_sq", exp_avg_sqs[i])):
            assert state[name].dtype == torch.float32, f"param {i}: {name} is {state[name].dtype}"
            assert_close(state[name], moment, f"param {i} {name}")
        if p.numel() == 0:
            continue
        # One unit in the last place of |x| in [2^k, 2^(k+1)) is eps * 2^k. Elements near zero are measured in
        # the ulp of the tensor's typical magnitude: a one-ulp difference in a float32 intermediate (GPUs contract
        # into FMAs) that flips one rounding moves a value crossing zero by many of its own, tiny, ulps.
        scale = torch.maximum(expected.abs(), expected.abs().median())
        units = (p.double() - expected).abs() / (ulp * torch.exp2(torch.floor(torch.log2(scale))))
        assert units.max().item() <= MAX_ULPS, f"param {i}: {units.max().item():.1f} units in the last place"
        differing = (units > 0).double().mean().item()
        assert differing <= MAX_DIFFERING_FRACTION, f"param {i}: {differing:.1%} of the elements differ"


def check_state_dict_round_trip(shapes, device, steps: int = 4) -> None:
    """The plain AdamW for ``steps``, ours from its state dict for ``steps`` more, the plain one again from ours:
    the same as the plain AdamW all along."""
    from cs336_basics.optimizer import AdamW
    from cs336_systems.kernels.adamw import FusedAdamW

    params = make_params(shapes, torch.float32, device)
    continuous_params, relay_params = clones(params), clones(params)
    continuous = AdamW(param_groups(continuous_params))
    relay = AdamW(param_groups(relay_params))
    for leg, optimizer_class in enumerate((None, FusedAdamW, AdamW)):
        if optimizer_class is not None:
            state_dict = relay.state_dict()
            relay_params = clones(relay_params)
            relay = optimizer_class(param_groups(relay_params))
            relay.load_state_dict(state_dict)
            if optimizer_class is FusedAdamW:
                for state in relay.state.values():
                    assert type(state["step"]) is int
                    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        for step in range(leg * steps, (leg + 1) * steps):
            grads = [random_gradient(p) for p in params]
            set_grads(continuous_params, grads, in_place=False)
            set_grads(relay_params, grads, in_place=False)
            step_with_schedule(continuous, step)
            step_with_schedule(relay, step)
    for i, (p, q) in enumerate(zip(relay_params, continuous_params)):
        assert_close(p, q, f"param {i}")
        for name in ("exp_avg", "exp_avg_sq"):
            assert_close(relay.state[p][name], continuous.state[q][name], f"param {i} {name}")


def check_bfloat16_state_dict_keeps_float32_moments(device) -> None:
    """Our state dict of bfloat16 parameters loads back into a FusedAdamW with the float32 moments unchanged
    (torch's loader would round them to bfloat16), and into the plain AdamW, which can step from it."""
    from cs336_basics.optimizer import AdamW
    from cs336_systems.kernels.adamw import FusedAdamW

    params = make_params([(17,), (5, 9)], torch.bfloat16, device)
    optimizer = FusedAdamW(params)
    for _ in range(3):
        set_grads(params, [random_gradient(p) for p in params], in_place=False)
        optimizer.step()
    state_dict = optimizer.state_dict()
    reloaded = FusedAdamW(params)
    reloaded.load_state_dict(state_dict)
    for p in params:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(reloaded.state[p][name], optimizer.state[p][name]), name
            assert reloaded.state[p][name].dtype == torch.float32
        assert reloaded.state[p]["step"] == 3
    theirs = AdamW(params)
    theirs.load_state_dict(state_dict)
    theirs.step()
    assert all(theirs.state[p]["step"] == 4 for p in params)


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-1e-3), "invalid learning rate"),
        (dict(betas=(1.0, 0.999)), "invalid betas"),
        (dict(betas=(0.9, -0.1)), "invalid betas"),
        (dict(eps=-1e-8), "invalid eps"),
    ],
)
def test_invalid_hyperparameters(kwargs, message):
    from cs336_basics.optimizer import AdamW
    from cs336_systems.kernels.adamw import FusedAdamW

    for optimizer_class in (FusedAdamW, AdamW):
        with pytest.raises(ValueError, match=message):
            optimizer_class([torch.zeros(3)], **kwargs)


@pytest.mark.compiled_kernels
def test_cpu_tensor_without_interpreter():
    from cs336_systems.kernels import adamw
    from cs336_systems.kernels.launch import interpreting

    if interpreting():
        pytest.skip("TRITON_INTERPRET=1 in this process")
    p = torch.zeros(3)
    p.grad = torch.ones(3)
    optimizer = adamw.FusedAdamW([p])
    with pytest.raises(ValueError, match="the kernels of FusedAdamW need CUDA tensors, .*TRITON_INTERPRET=1"):
        optimizer.step()
    assert torch.equal(p, torch.zeros(3)) and optimizer.state[p]["step"] == 0


@pytest.mark.compiled_kernels
@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_aligned_launches_compile_to_16_byte_accesses(param_dtype):
    """Addresses read from the table carry no alignment: only the ``ALIGNED`` hint lets the compiler use
    16-byte vector loads and stores. Compiled for an H100/H200 (sm_90) without a GPU; PTX inspected."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cs336_systems.kernels import adamw
    from cs336_systems.kernels.launch import interpreting

    if interpreting():
        pytest.skip("TRITON_INTERPRET=1 in this process")
    kernel = adamw.fused_adamw_kernel
    constexprs = {"PARAM_DTYPE": getattr(tl, {"fp32": "float32", "bf16": "bfloat16"}[param_dtype]),
                  "GRAD_DTYPE": tl.float32, "BLOCK": adamw.BLOCK}
    signature = {"Table": "*i64", "BlockTensor": "*i32"}
    signature |= {name: "fp32" for name in kernel.arg_names if name not in signature and name.islower()}
    signature |= {name: "constexpr" for name in (*constexprs, "ALIGNED")}
    for aligned in (True, False):
        source = ASTSource(fn=kernel, signature=signature, constexprs={**constexprs, "ALIGNED": aligned})
        options = {"num_warps": adamw.NUM_WARPS}
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        for access in ("ld.global.v4.b32", "st.global.v4.b32"):
            assert (access in ptx) == aligned, f"ALIGNED={aligned}: {access} {'missing' if aligned else 'present'}"


def check_master_weights_train_like_float32(shapes, dtype: torch.dtype, device, steps: int = 5) -> None:
    """16-bit parameters with float32 master weights: the masters follow the plain AdamW run on float32 copies of
    the parameters with the same (16-bit) gradients, to float32 rounding; each parameter is its master rounded
    (as the kernel rounds: :data:`ROUND`)."""
    from cs336_basics.optimizer import AdamW
    from cs336_systems.kernels.adamw import FusedAdamW

    settings = GROUPS[0]
    params = make_params(shapes, dtype, device)
    masters = [p.detach().float().requires_grad_() for p in params]
    ours, theirs = FusedAdamW(params, **settings, master_weights=True), AdamW(masters, **settings)
    for _ in range(steps):
        grads = [random_gradient(p) for p in params]
        set_grads(params, grads, in_place=False)
        set_grads(masters, [g.float() for g in grads], in_place=False)
        ours.step()
        theirs.step()
    for p, master in zip(params, masters):
        kept = ours.state[p]["master"]
        assert kept.dtype == torch.float32
        torch.testing.assert_close(kept, master.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.double(), ROUND(kept, dtype)), "the parameter is its master rounded"


@pytest.mark.gpu
def test_fused_adamw_on_gpu():
    from cs336_systems.kernels.adamw import fused_adamw_kernel

    check_float32_against_basics(GPU_SHAPES, "cuda")
    for dtype, grad_dtype in ((torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, torch.float32)):
        check_low_precision_against_float64(GPU_SHAPES, dtype, "cuda", grad_dtype)
    check_state_dict_round_trip(GPU_SHAPES, "cuda")
    check_bfloat16_state_dict_keeps_float32_moments("cuda")
    check_master_weights_train_like_float32(GPU_SHAPES, torch.bfloat16, "cuda")
    # Learning rates changed every step, yet one compiled kernel per (dtypes, alignment, masters): float32 aligned
    # and misaligned, bfloat16, float16, bfloat16 with float32 gradients, bfloat16 with masters.
    kernels = fused_adamw_kernel.device_caches[torch.cuda.current_device()][0]
    assert len(kernels) == 6, f"{len(kernels)} compiled kernels"
