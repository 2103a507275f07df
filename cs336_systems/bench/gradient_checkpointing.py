"""Activation checkpointing in groups of blocks (problem ``gradient_checkpointing``).

With one level of recomputation and groups of ``k`` of the ``N`` blocks, the forward keeps each group's
input (``a`` bytes: one residual-stream activation) and backward rebuilds one group at a time, holding
its ``k`` blocks' saved activations (``b`` bytes each). The activation peak is about

    ceil(N / k) * a + k * b,        minimised near k* = sqrt(N * a / b).

``b`` is measured, not guessed: one block's forward runs under
``torch.autograd.graph.saved_tensors_hooks``, which sees every tensor autograd saves (parameters
excluded; a storage counted once). Then the full training step (AdamW) of the model is measured for no
checkpointing and for each group size: peak memory and step time.

Examples::

    python -m cs336_systems.bench.gradient_checkpointing                     # xl, batch 4, context 2048
    python -m cs336_systems.bench.gradient_checkpointing --edition 2025      # 2025's xl (1600 wide)
    python -m cs336_systems.bench.gradient_checkpointing --group-sizes 1 2 4 --context-length 1024
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import nn

from cs336_systems.attention import ATTENTION_NAMES
from cs336_systems.bench.common import cli, model_sizes, result_store, timing
from cs336_systems.bench.common.lm import (
    DTYPES,
    LMConfig,
    autocast,
    build_model,
    make_optimizer,
    make_step,
    random_batch,
)

PROBLEM = "gradient_checkpointing"
GROUP_SIZES = [1, 2, 3, 4, 6, 8, 12, 0]  # 0: no checkpointing (last: it is the one most likely to run out)


def parser():
    p = cli.base_parser(__doc__)
    cli.add_model_size(p, multiple=False, default="xl")
    p.add_argument("--context-length", type=cli.positive_int, default=None, help="default 2048")
    p.add_argument("--batch-size", type=cli.positive_int, default=4)
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--attention", default="naive", choices=ATTENTION_NAMES)
    p.add_argument("--group-sizes", nargs="+", type=cli.non_negative_int, default=GROUP_SIZES,
                   help="blocks per group (0: none)")
    p.add_argument("--steps", type=cli.positive_int, default=3, help="timed training steps after one warm-up step")
    return p


def saved_activation_bytes(module: nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes of the tensors autograd saves for backward in ``module(x)`` (parameters excluded, storages once)."""
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(x.device, dtype):
        module(x)
    return sum(seen.values())


def predicted_peak_activations(n_blocks: int, group: int, boundary: int, per_block: int) -> int:
    """``ceil(N / k) * a + k * b`` bytes; ``k = 0`` (no checkpointing): ``N * b``."""
    if group == 0:
        return n_blocks * per_block
    return math.ceil(n_blocks / group) * boundary + min(group, n_blocks) * per_block


def measure_group(model, optimizer, config: LMConfig, group: int, dtype: str, steps: int, device) -> dict[str, Any]:
    model.set_activation_checkpointing(group)
    step = make_step(model, random_batch(config, device), "train_step", DTYPES[dtype], optimizer)
    step(None)  # warm-up (the optimizer state exists from the first step on)
    seconds = []
    with timing.peak_memory(device) as peak:
        for _ in range(steps):
            phases: dict[str, float] = {}
            step(phases)
            seconds.append(sum(phases.values()))
    return {**timing.summarize_ms(seconds), "peak_gb": peak.get("peak_gb")}


def main(argv: list[str] | None = None) -> None:
    args, device, tiny = cli.start(parser(), argv)
    size = args.size or ("tiny" if tiny else model_sizes.canonical_size("xl", args.edition))
    context = args.context_length or (32 if tiny else 2048)
    if tiny:
        args.batch_size, args.steps = min(args.batch_size, 2), 1
    config = LMConfig(size, context, args.batch_size)
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force, edition=args.edition)
    base = dict(size=size, context_length=context, batch_size=args.batch_size, dtype=args.dtype,
                attention=args.attention)
    cases = store.pending([{**base, "group_size": k} for k in args.group_sizes])
    if not cases:  # the store said so
        return
    model = build_model(config, device, args.attention)
    n_blocks = len(model.layers)
    x = torch.randn(args.batch_size, context, config.hparams["d_model"], device=device, requires_grad=True)
    per_block = saved_activation_bytes(model.layers[0], x, DTYPES[args.dtype])
    boundary = x.numel() * x.element_size()
    del x
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 4  # weights, grads, Adam m and v
    optimum = min(range(1, n_blocks + 1), key=lambda k: predicted_peak_activations(n_blocks, k, boundary, per_block))
    print(f"# per-block saved activations {per_block / 1e9:.3f} GB, group input {boundary / 1e9:.3f} GB, "
          f"model state {state / 1e9:.1f} GB: predicted optimum k = {optimum} "
          f"(sqrt(N a / b) = {math.sqrt(n_blocks * boundary / per_block):.2f})", file=sys.stderr)
    optimizer = make_optimizer(model)
    for case in cli.progress(cases, PROBLEM):
        k = case["group_size"]
        result = result_store.measure_or_oom(
            lambda: measure_group(model, optimizer, config, k, args.dtype, args.steps, device))
        model.zero_grad(set_to_none=True)
        timing.free_memory()
        result.update(
            n_blocks=n_blocks, saved_per_block_gb=per_block / 1e9, group_input_gb=boundary / 1e9,
            model_state_gb=state / 1e9, predicted_optimum=optimum,
            predicted_activation_gb=predicted_peak_activations(n_blocks, k, boundary, per_block) / 1e9,
        )
        result["predicted_peak_gb"] = result["model_state_gb"] + result["predicted_activation_gb"]
        store.add(case, result)
    cli.print_table(store.asked_rows(), ["group_size", "peak_gb", "predicted_peak_gb", "mean_ms", "oom"])


if __name__ == "__main__":
    main()
