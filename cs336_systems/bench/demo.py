"""A first look at the repository in about a minute, on whatever machine it finds.

On a CPU:

* our Triton FlashAttention-2 run through Triton's CPU interpreter (``TRITON_INTERPRET=1``) on a tiny causal
  input, against the plain PyTorch attention: the largest error of the output and of the three gradients;
* the toy model trained on 2 gloo ranks with each DDP variant and the sharded optimizer, against one process
  trained on the full batches: the largest weight difference.

On a GPU:

* our attention beside SDPA's cuDNN backend at (4, 16, 2048, 64) bf16, causal: forward + backward time and the
  error of each against the float32 reference;
* one training step of the small model (context 512, batch 4, bf16 autocast) of our stack and of PyTorch's
  (``cs336_systems.train``): median step time after warm-up (the first steps compile the blocks).

It prints a table and where its rows went (``.scratch/results/demo.jsonl`` unless ``--results-dir`` says
otherwise: a demonstration, not a measurement for the writeup). Every number here has a full benchmark tool
behind it (README: "Every deliverable").

    python -m cs336_systems.bench.demo
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch

from cs336_systems.bench.common import cli, result_store

PROBLEM = "demo"
CPU_ATTENTION_SHAPE = (1, 2, 48, 32)  # (batch, heads, seq, d_head): a partial tile, two heads
GPU_ATTENTION_SHAPE = (4, 16, 2048, 64)
TOY_WORLD_SIZE = 2


def parser() -> argparse.ArgumentParser:
    p = cli.base_parser(__doc__, resumes=False)
    p.set_defaults(results_dir=result_store.SCRATCH_DIR / "results")
    return p


# ---------------------------------------------------------------------------------------------------
# Attention: ours against a reference
# ---------------------------------------------------------------------------------------------------


def attention_errors(attend, reference, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> dict[str, float]:
    """Largest absolute error of ``attend``'s output and gradients against ``reference`` in float32, causal."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad_out = (torch.randn(shape, device=device, generator=generator) for _ in range(4))
    errors = {}
    outputs = []
    for fn, cast in ((attend, dtype), (reference, torch.float32)):
        inputs = [x.to(cast).requires_grad_() for x in (q, k, v)]
        out = fn(*inputs, True)
        grads = torch.autograd.grad(out, inputs, grad_out.to(cast))
        outputs.append([t.float() for t in (out, *grads)])
    for name, ours, exact in zip(("O", "dQ", "dK", "dV"), *outputs):
        errors[f"max_err_{name}"] = (ours - exact).abs().max().item()
    return errors


Case = tuple[dict[str, Any], dict[str, Any]]  # (configuration, measurements) of one row


def cpu_attention() -> Case:
    """Our Triton kernels under the interpreter against the plain attention (the interpreter is set by main)."""
    from cs336_systems.attention import get_attention

    errors = attention_errors(get_attention("triton"), get_attention("naive"), CPU_ATTENTION_SHAPE, torch.float32,
                              torch.device("cpu"))
    config = {"what": "attention", "provider": "ours (Triton interpreter)", "shape": list(CPU_ATTENTION_SHAPE),
              "dtype": "fp32"}
    return config, errors


def gpu_attention(device: torch.device) -> list[Case]:
    """Ours and SDPA's cuDNN backend: forward + backward time and error against the float32 reference."""
    import triton.testing

    from cs336_systems.attention import get_attention
    from cs336_systems.bench.common.attention_providers import get_provider

    sdpa_cudnn = get_provider("sdpa_cudnn")
    sdpa = sdpa_cudnn.build()

    def cudnn(q, k, v, is_causal):
        with sdpa_cudnn.context():  # pins SDPA's cuDNN backend
            return sdpa(q, k, v, is_causal)

    reference = get_attention("sdpa")  # in float32: SDPA's math or efficient kernels, not the tested ones
    cases = []
    for provider, attend in (("ours", get_attention("triton")), ("sdpa_cudnn", cudnn)):
        q, k, v = (torch.randn(GPU_ATTENTION_SHAPE, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        ms = triton.testing.do_bench(lambda: attend(q, k, v, True).sum().backward(), rep=200)
        errors = attention_errors(attend, reference, GPU_ATTENTION_SHAPE, torch.bfloat16, device)
        config = {"what": "attention", "provider": provider, "shape": list(GPU_ATTENTION_SHAPE), "dtype": "bf16"}
        cases.append((config, {"fwd_bwd_ms": ms, **errors}))
    return cases


# ---------------------------------------------------------------------------------------------------
# Training: the toy DDP check (CPU), the model's step (GPU)
# ---------------------------------------------------------------------------------------------------


def _toy_ranks(rank: int, world_size: int, options, results_dir) -> None:
    """Every rank trains each variant; rank 0 writes the largest weight difference of each."""
    from cs336_systems.parallel.ddp import toy_training

    store = result_store.ResultStore(PROBLEM, results_dir, force=True, quiet=True) if rank == 0 else None
    for variant in toy_training.VARIANTS:
        difference = toy_training.max_weight_difference(variant, rank, world_size, torch.device("cpu"), options)
        if store is not None:
            store.add({"what": "toy DDP", "provider": variant, "world_size": world_size},
                      {"max_weight_diff": difference, "matches": difference <= options.atol,
                       "steps": options.steps})


def cpu_toy_training(results_dir) -> list[dict[str, Any]]:
    """The toy model on gloo ranks with each DDP variant and the sharded optimizer, against one process."""
    from cs336_systems.parallel.ddp import toy_training
    from cs336_systems.parallel.distributed import spawn

    options = toy_training.ToyTraining()
    spawn(_toy_ranks, TOY_WORLD_SIZE, options, results_dir, backend="gloo", timeout_s=300.0)
    rows = result_store.ResultStore(PROBLEM, results_dir, quiet=True).rows()
    return rows[-len(toy_training.VARIANTS):]


def gpu_training_steps(device: torch.device) -> list[Case]:
    """One training step of the small model, our stack and PyTorch's, median over timed steps."""
    from cs336_systems.bench.common.lm import LMConfig, measure_stack

    model = LMConfig("small", context_length=512, batch_size=4)
    cases = []
    for stack in ("ours", "torch"):
        result = measure_stack(model, stack, "bf16", warmup=3, steps=5, device=device)
        config = {"what": "training step", "provider": stack, "size": "small", "context_length": 512,
                  "batch_size": 4, "dtype": "bf16"}
        cases.append((config, {"step_ms": statistics.median(result["step_ms"])}))
        torch._dynamo.reset()
    return cases


# ---------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        # Our kernels read this when first imported: the attention below runs them through the CPU interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if on_gpu else "cpu")
    print(f"# {'GPU: ' + torch.cuda.get_device_name(device) if on_gpu else 'no GPU: a CPU demonstration'}",
          file=sys.stderr)
    store = result_store.ResultStore(PROBLEM, args.results_dir, force=True, quiet=True)
    shown: list[dict[str, Any]] = []
    if on_gpu:
        print("# attention: ours and SDPA's cuDNN backend", file=sys.stderr)
        shown += [store.add(*case) for case in gpu_attention(device)]
        print("# one training step of the small model, our stack and PyTorch's (compiling first)", file=sys.stderr)
        shown += [store.add(*case) for case in gpu_training_steps(device)]
    else:
        print("# attention: our Triton kernels through the CPU interpreter against the plain attention",
              file=sys.stderr)
        shown.append(store.add(*cpu_attention()))
        print(f"# the toy model on {TOY_WORLD_SIZE} gloo ranks, each DDP variant and the sharded optimizer, "
              "against one process", file=sys.stderr)
        shown += cpu_toy_training(store.path.parent)
    errors = ["max_err_O", "max_err_dQ", "max_err_dK", "max_err_dV", "max_weight_diff"]
    # Errors span many orders of magnitude: shown in scientific notation.
    table = [{**row, **{key: f"{row[key]:.1e}" for key in errors if row.get(key) is not None}} for row in shown]
    columns = ["what", "provider", "fwd_bwd_ms", "step_ms", *errors, "matches"]
    cli.print_table(table, [c for c in columns if any(row.get(c) is not None for row in table)], digits=3)
    print(f"# rows in {store.path}", file=sys.stderr)


if __name__ == "__main__":
    main()
