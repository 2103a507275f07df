"""Memory and time of optimizer-state sharding on the XL model, 2 GPUs (problem
``optimizer_state_sharding_accounting``).

Four optimizers, all AdamW with the same hyper-parameters, on the same data; the first three under the same
data-parallel wrapper (``--ddp``, default our bucketed DDP with 100 MiB buckets):

* ``adamw``: every rank keeps the optimizer state of every parameter;
* ``sharded``: our :class:`~cs336_systems.parallel.sharded_optimizer.ShardedOptimizer` (each rank steps
  and keeps state for its share of the parameters, then every owner broadcasts its parameters);
* ``zero_redundancy``: ``torch.distributed.optim.ZeroRedundancyOptimizer``;
* ``zero1_flat``: our :class:`~cs336_systems.parallel.zero1.FlatShardedOptimizer` (ZeRO-1 on flat buffers:
  reduce-scatter of the gradients, the step of this rank's slice, all-gather of the parameters). It averages
  the gradients itself, so its model runs without a DDP wrapper (its rows say ``ddp: local``) and its step
  time includes all of the communication.

Memory is read at three points, each after a full step of warm-up so that the optimizer state exists:

* ``after_init``: the model just built (its peak and what is allocated);
* ``before_step``: forward, backward and gradient synchronisation done (the peak is the activations' one);
* ``after_step``: the optimizer step done (the peak is the step's own temporaries on top).

At each point the allocated bytes are split into parameters, gradients and optimizer state (counted from
the tensors themselves, a storage once) and the rest (``peak - the three``: activations before the step,
the optimizer's temporaries during it, communication buffers). Every rank measures; the row holds the
rank with the highest peak and every rank's peak and optimizer state. The time per iteration is the
median step (forward, backward, synchronisation, optimizer step) over ``--steps`` steps, averaged over ranks.

Examples::

    python -m cs336_systems.bench.optimizer_state_sharding_accounting
    python -m cs336_systems.bench.optimizer_state_sharding_accounting --optimizers adamw sharded --dtype bf16
    python -m cs336_systems.bench.optimizer_state_sharding_accounting --optimizers sharded zero1_flat
    torchrun --nproc_per_node=2 -m cs336_systems.bench.optimizer_state_sharding_accounting
"""

from __future__ import annotations

import argparse

import statistics
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from cs336_basics.optimizer import AdamW
from cs336_systems.attention import ATTENTION_NAMES
from cs336_systems.bench.common import cli, result_store, timing
from cs336_systems.bench.common import distributed_launch as dl
from cs336_systems.bench.common.ddp_step import LOCAL, Marker, make_train_step, time_steps, variant_name, wrap
from cs336_systems.bench.common.lm import DTYPES, LMConfig, build_model, random_batch
from cs336_systems.parallel.sharded_optimizer import ShardedOptimizer
from cs336_systems.parallel.zero1 import FlatShardedOptimizer
from cs336_systems.train.step import ADAMW_HYPERPARAMETERS

PROBLEM = "optimizer_state_sharding_accounting"
OPTIMIZERS = ["adamw", "sharded", "zero_redundancy", "zero1_flat"]
REDUCES_GRADIENTS = {"zero1_flat"}  # optimizers that average the gradients themselves: no DDP wrapper
POINTS = ("after_init", "before_step", "after_step")
GB = 1e9


def parser():
    p = cli.base_parser(__doc__)
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=OPTIMIZERS)
    p.add_argument("--ddp", type=variant_name, default="bucketed_100mb",
                   help="data-parallel wrapper, a ddp_benchmarking variant (default bucketed_100mb)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    cli.add_model_size(p, multiple=False, default="xl; tiny on CPU")
    p.add_argument("--context-length", type=cli.positive_int, default=None, help="default 512 (32 on CPU)")
    p.add_argument("--batch-size", type=cli.positive_int, default=None, help="sequences per rank (default 4; 2 on CPU)")
    p.add_argument("--attention", default="naive", choices=ATTENTION_NAMES)
    p.add_argument("--world-size", type=cli.positive_int, default=2, help="ranks when not under torchrun (default 2)")
    p.add_argument("--warmup", type=cli.non_negative_int, default=2, help="untimed steps (default 2)")
    p.add_argument("--steps", type=cli.positive_int, default=5, help="timed steps (default 5)")
    p.add_argument("--timeout-s", type=cli.positive_float, default=3600.0, help="give up if the run hangs this long")
    return p


def make_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adamw":
        return AdamW(params, **ADAMW_HYPERPARAMETERS)
    if name == "sharded":
        return ShardedOptimizer(params, AdamW, **ADAMW_HYPERPARAMETERS)
    if name == "zero_redundancy":
        return ZeroRedundancyOptimizer(params, optimizer_class=AdamW, **ADAMW_HYPERPARAMETERS)
    if name == "zero1_flat":
        return FlatShardedOptimizer(params, AdamW, **ADAMW_HYPERPARAMETERS)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (views of one buffer count once)."""
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The state tensors this rank holds (the inner optimizer's for the sharded ones)."""
    inner = getattr(optimizer, "local_optimizer", None) or getattr(optimizer, "optim", None) or optimizer
    return [value for state in inner.state.values() for value in state.values() if torch.is_tensor(value)]


def memory_point(model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device) -> dict[str, Any]:
    """Peak since the last reset, allocated now, and the parameter/gradient/optimizer-state split (GB)."""
    params = list(model.parameters())
    point = {
        "params_gb": tensor_bytes(params) / GB,
        "grads_gb": tensor_bytes(p.grad for p in params) / GB,
        "optimizer_state_gb": tensor_bytes(optimizer_state(optimizer)) / GB if optimizer is not None else 0.0,
        "peak_gb": None,
        "allocated_gb": None,
        "rest_gb": None,
    }
    if device.type == "cuda":
        timing.synchronize(device)
        point["peak_gb"] = torch.cuda.max_memory_allocated(device) / GB
        point["allocated_gb"] = torch.cuda.memory_allocated(device) / GB
        point["rest_gb"] = point["peak_gb"] - point["params_gb"] - point["grads_gb"] - point["optimizer_state_gb"]
        torch.cuda.reset_peak_memory_stats(device)
    return point


def measure(name: str, batch, device: torch.device, args) -> dict[str, Any]:
    """This rank's memory at the three points and its step times."""
    config = LMConfig(args.size, args.context_length, args.batch_size)
    timing.free_memory()
    torch.manual_seed(0)
    model = build_model(config, device, args.attention)
    memory = {"after_init": memory_point(model, None, device)}
    wrapped = wrap(ddp_variant(name, args), model)
    optimizer = make_optimizer(name, [p for p in model.parameters() if p.requires_grad])
    marker = Marker(device)
    step = make_train_step(wrapped, optimizer, batch, DTYPES[args.dtype], marker)
    step_ms, _ = time_steps(step, device, marker, max(1, args.warmup), args.steps)
    memory_point(model, optimizer, device)  # resets the peak
    step(update=False)
    memory["before_step"] = memory_point(model, optimizer, device)
    optimizer.step()
    memory["after_step"] = memory_point(model, optimizer, device)
    local_params = sum(p.numel() for p in optimizer_state_owners(optimizer))
    total_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del step, optimizer, wrapped, model
    timing.free_memory()
    return {"step_ms": step_ms, "memory": memory, "local_param_share": local_params / total_params}


def optimizer_state_owners(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters whose state this rank keeps."""
    inner = getattr(optimizer, "local_optimizer", None) or getattr(optimizer, "optim", None) or optimizer
    return [p for group in inner.param_groups for p in group["params"]]


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from every rank's measurement: the rank with the highest peak, and every rank's key numbers."""
    steps = dl.mean_over_ranks([r["step_ms"] for r in per_rank])
    peaks = [max((p["peak_gb"] or 0.0) for p in r["memory"].values()) for r in per_rank]
    worst = max(range(len(per_rank)), key=lambda i: peaks[i])
    memory = per_rank[worst]["memory"]
    at_peak = max(POINTS, key=lambda point: memory[point]["peak_gb"] or 0.0)
    has_peaks = memory["after_step"]["peak_gb"] is not None
    return {
        "step_ms": statistics.median(steps),
        "step_mean_ms": statistics.fmean(steps),
        "steps_ms": steps,
        "peak_gb": peaks[worst] if has_peaks else None,
        "peak_at": at_peak if has_peaks else None,
        "params_gb": memory["after_step"]["params_gb"],
        "grads_gb": memory["before_step"]["grads_gb"],
        "optimizer_state_gb": memory["after_step"]["optimizer_state_gb"],
        "rest_gb": memory[at_peak]["rest_gb"],
        "peak_rank": worst,
        "memory": memory,
        "rank_peak_gb": peaks if has_peaks else None,
        "rank_optimizer_state_gb": [r["memory"]["after_step"]["optimizer_state_gb"] for r in per_rank],
        "rank_local_param_share": [r["local_param_share"] for r in per_rank],
    }


def ddp_variant(optimizer: str, args) -> str:
    """The data-parallel wrapper ``optimizer`` runs under: none (``local``) for one that reduces the gradients."""
    return LOCAL if optimizer in REDUCES_GRADIENTS else args.ddp


def wanted_cases(args, world_size: int) -> list[dict[str, Any]]:
    base = dict(size=args.size, context_length=args.context_length, batch_size=args.batch_size,
                world_size=world_size, dtype=args.dtype, attention=args.attention)
    return [{**base, "ddp": ddp_variant(o, args), "optimizer": o} for o in args.optimizers]


def _worker(rank: int, world_size: int, args) -> None:
    device = dl.rank_device()
    store = (result_store.ResultStore(PROBLEM, args.results_dir, args.force, edition=args.edition)
             if rank == 0 else None)
    cases = dl.from_rank0(store.pending(wanted_cases(args, world_size)) if rank == 0 else None)
    if not cases:
        return
    batch = random_batch(LMConfig(args.size, args.context_length, args.batch_size), device, generator_seed=rank)
    rows = []
    for case in cli.progress(cases, PROBLEM) if rank == 0 else cases:
        per_rank = dl.gather(measure(case["optimizer"], batch, device, args))
        if rank == 0:
            rows.append(store.add(case, {**summarize(per_rank), "warmup": args.warmup, "steps": args.steps,
                                         "backend": dist.get_backend()}))
    if rank == 0:
        cli.print_table(rows, ["optimizer", "step_ms", "peak_gb", "peak_at", "params_gb", "grads_gb",
                                   "optimizer_state_gb", "rest_gb"])


def main(argv: list[str] | None = None) -> None:
    dl.launch_lm_benchmark(PROBLEM, _worker, parser().parse_args(argv), wanted_cases, isolate=one_optimizer_each)


def one_optimizer_each(args) -> list:
    """One launch per optimizer, each on fresh ranks (run one after another in one process, the later ones
    showed the earlier ones' allocations: the sharded optimizer's peak stayed at plain AdamW's)."""
    return [argparse.Namespace(**{**vars(args), "optimizers": [name]}) for name in args.optimizers]

if __name__ == "__main__":
    main()
