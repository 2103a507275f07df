"""The training step composed from named parts (``cs336_systems.train``): part validation, the PyTorch stack on
the CPU, our stack under the Triton interpreter (``tests/interpreter/test_train.py``), and both stacks on a GPU."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

from cs336_systems.bench.common.lm import LMConfig, build_model, random_batch
from cs336_systems.train import SHARDED_STACKS, STACKS, Parts, build_training_step
from cs336_systems.train.step import chunked_loss, plain_loss


def test_parts_are_checked():
    with pytest.raises(ValueError, match="optimizer"):
        Parts(optimizer="sgd")
    with pytest.raises(ValueError, match="compile"):
        STACKS["ours"].with_(compile="everything")
    with pytest.raises(ValueError, match="unknown checkpoint mode"):
        Parts(checkpointing="some")
    with pytest.raises(ValueError, match="unknown stack"):
        build_training_step(build_model(LMConfig("tiny", 8, 1), torch.device("cpu")), "fastest")
    with pytest.raises(ValueError, match="sharding='none'"):
        Parts(cudagraphs=True, sharding="fsdp2")
    with pytest.raises(ValueError, match="optimizer='fused'"):
        Parts(weights="bf16", optimizer="torch_fused")
    with pytest.raises(ValueError, match="unknown weights"):
        Parts(weights="fp8")
    assert STACKS["torch"].with_overrides(["cudagraphs=true"]).cudagraphs
    with pytest.raises(ValueError, match="unknown gradient_memory"):
        Parts(sharding="ours", gradient_memory="host")
    with pytest.raises(ValueError, match="needs sharding='ours'"):
        Parts(sharding="fsdp2", gradient_memory="reduce_stream")
    assert SHARDED_STACKS["ours"].gradient_memory == "compute_stream"  # the default
    assert SHARDED_STACKS["ours"].with_overrides(["gradient_memory=reduce_stream"]).gradient_memory == "reduce_stream"


def test_cudagraphs_needs_a_gpu():
    config = LMConfig("tiny", 16, 2)
    step = build_training_step(build_model(config, torch.device("cpu")),
                               STACKS["torch"].with_(compile="none", cudagraphs=True), autocast_dtype=None)
    with pytest.raises(ValueError, match="cudagraphs needs a CUDA device"):
        step(*random_batch(config, torch.device("cpu")))



@pytest.mark.parametrize("recompute", [False, True])
def test_recompute_materialized_is_what_the_partitioner_sees_during_the_forward(recompute):
    """Compiled graphs are split into forward and backward at their first call, inside the step's forward: the part
    sets the partitioner's option there, and only there."""
    import torch._functorch.config as partitioner

    config = LMConfig("tiny", 16, 2)
    parts = STACKS["torch"].with_overrides([f"recompute_materialized={recompute}"])
    step = build_training_step(build_model(config, torch.device("cpu")), parts, autocast_dtype=None)
    seen = []

    class Spy(torch.nn.Module):
        def forward(self, token_ids, targets):
            seen.append(partitioner.ban_recompute_materialized_backward)
            return token_ids.float().sum()

    step.net = Spy()  # before any call: the compiled blocks never compile
    step._forward(*random_batch(config, torch.device("cpu")))
    assert seen == [not recompute] and partitioner.ban_recompute_materialized_backward
    with pytest.raises(ValueError, match="recompute_materialized .* needs compile"):
        Parts(compile="none", recompute_materialized=True)
    with pytest.raises(ValueError, match="recompute_materialized .* needs compile"):
        STACKS["ours"].with_(compile="none", recompute_materialized=True)


def test_turning_compilation_off_turns_the_partitioners_option_off():
    """Ours' stack lets the partitioner recompute (``recompute_materialized``); the same stack without compilation
    (as tests and ``--override compile=none`` ask for it) drops that option instead of refusing the change."""
    assert STACKS["ours"].recompute_materialized and STACKS["ours"].compile == "blocks"
    for uncompiled in (STACKS["ours"].with_(compile="none"), STACKS["ours"].with_overrides(["compile=none"])):
        assert uncompiled.compile == "none" and not uncompiled.recompute_materialized
    assert STACKS["ours"].with_(compile="model").recompute_materialized


def test_parts_errors_name_the_part_and_the_choices():
    with pytest.raises(ValueError, match="unknown attention 'nope'; choose one of naive, "):
        Parts().with_(attention="nope")
    with pytest.raises(ValueError, match="unknown part 'optimiser'; choose among attention, rmsnorm"):
        Parts().with_(optimiser="fused")
    with pytest.raises(ValueError, match="unknown checkpoint mode 'two'; choose among keep, selective, full"):
        Parts().with_overrides(["checkpointing=two"])
    with pytest.raises(ValueError, match="cudagraphs is true or false"):
        Parts().with_overrides(["cudagraphs=maybe"])
    with pytest.raises(ValueError, match="part=value"):
        Parts().with_overrides(["rmsnorm"])
    assert Parts().with_overrides(["checkpointing=selective", "cudagraphs=yes"]).cudagraphs


@pytest.mark.slow
def test_train_step_cli_refuses_a_bad_override_in_one_line():
    """Checked before any child process starts: one line on stderr naming the part and its choices."""
    done = subprocess.run([sys.executable, "-m", "cs336_systems.bench.train_step", "--override", "rmsnorm=nope"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("#")]
    assert lines == ["train_step: --override: unknown rmsnorm 'nope'; choose one of plain, fused"], done.stderr


def test_torch_stack_steps_and_phases_on_cpu():
    config = LMConfig("tiny", 16, 2)
    model = build_model(config, torch.device("cpu"))
    step = build_training_step(model, STACKS["torch"].with_(compile="none", checkpointing="full"), autocast_dtype=None)
    x, y = random_batch(config, torch.device("cpu"))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    phases: dict[str, float] = {}
    first = step(x, y, phases)
    assert set(phases) == {"forward", "backward", "optimizer"} and all(t > 0 for t in phases.values())
    assert all(not torch.equal(before[name], p) for name, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert step(x, y).item() < first.item()  # the same batch again: the loss went down


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64])
def test_chunked_loss_matches_the_plain_loss_and_its_gradients(chunk_tokens):
    """float64, 2 x 13 tokens: chunks that divide the tokens unevenly (7), one token each, and one chunk; some
    targets ignored (-100), so the mean is over the others as F.cross_entropy's."""
    generator = torch.Generator().manual_seed(chunk_tokens)
    hidden = torch.randn(2, 13, 8, dtype=torch.float64, generator=generator)
    head = torch.nn.Linear(8, 11, bias=False, dtype=torch.float64)
    targets = torch.randint(0, 11, (2, 13), generator=generator)
    targets[0, 3] = targets[1, 12] = -100
    grads = {}
    for name, loss_head in (("plain", plain_loss), ("chunked", functools.partial(chunked_loss, chunk_tokens=chunk_tokens))):
        hidden_in = hidden.clone().requires_grad_()
        head.zero_grad()
        loss = loss_head(hidden_in, head, targets)
        loss.backward()
        grads[name] = (loss.detach(), hidden_in.grad, head.weight.grad.clone())
    for plain, chunked in zip(grads["plain"], grads["chunked"]):
        torch.testing.assert_close(chunked, plain, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_mode", ["none", "blocks"])
def test_our_stack_trains_like_pytorchs_on_gpu(compile_mode):
    """bf16 autocast on both: losses and parameters after a few steps agree to bf16 tolerance."""
    config = LMConfig("tiny", 256, 4)
    device = torch.device("cuda")
    x, y = random_batch(config, device)
    results = {}
    for stack in ("torch", "ours"):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = build_model(config, device)
        step = build_training_step(model, STACKS[stack].with_(compile=compile_mode))
        # Ours holds its linear weights in bf16 (float32 masters in the optimizer): compare as float32.
        results[stack] = ([step(x, y).item() for _ in range(4)], [p.detach().float() for p in model.parameters()])
    assert results["ours"][0] == pytest.approx(results["torch"][0], rel=2e-2)
    for ours, theirs in zip(results["ours"][1], results["torch"][1]):
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("stack", ["ours", "torch"])
def test_captured_step_matches_the_uncaptured_one_on_gpu(stack):
    """The cudagraphs part: forward, loss and backward captured once and replayed (our attention, fused RMSNorm and
    fused cross-entropy inside the graph, our AdamW after it) give the losses and parameters of the plain step."""
    config = LMConfig("tiny", 256, 4)
    device = torch.device("cuda")
    batches = [random_batch(config, device, generator_seed=seed) for seed in range(4)]
    results = {}
    for cudagraphs in (False, True):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = build_model(config, device)
        step = build_training_step(model, STACKS[stack].with_(cudagraphs=cudagraphs))
        losses = [step(x, y).item() for x, y in batches]
        phases: dict[str, float] = {}
        losses.append(step(*batches[0], phases).item())
        results[cudagraphs] = (losses, [p.detach().clone() for p in model.parameters()])
        assert set(phases) == {"forward", "backward", "optimizer"}
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-3)
    for captured, plain in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(captured, plain, rtol=1e-3, atol=1e-4)


def test_bf16_weights_part_on_cpu():
    """The ``weights='bf16'`` part holds the linear layers' weights in bf16 (the fused AdamW keeps float32 masters;
    the GPU test compares the training with PyTorch's stack); embeddings and norms stay float32."""
    from cs336_basics.model import Linear

    model = build_model(LMConfig("tiny", 16, 2), torch.device("cpu"))
    step = build_training_step(model, Parts(attention="naive", optimizer="fused", compile="none", weights="bf16"))
    linear = [m.weight.dtype for m in model.modules() if isinstance(m, Linear)]
    assert linear and set(linear) == {torch.bfloat16}
    others = {p.dtype for p in model.parameters()} - {torch.bfloat16}
    assert others == {torch.float32}
    assert step.optimizer.master_weights
