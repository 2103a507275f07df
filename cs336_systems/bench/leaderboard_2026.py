"""The course's 2026 leaderboard: one training step of an 8B model on two GPUs (problem ``leaderboard_2026``).

The step: forward, loss, backward and AdamW of ``BasicsTransformerLM`` with vocabulary 151,936, d_model 4096, d_ff
11,008, 34 layers, 32 heads, causal, bf16 compute, at batch 2 and context 32,768 (one sequence per rank), timed as the
course does: ``triton.testing.do_bench(train_step, rep=30_000, warmup=10_000)`` (its mean, in ms;
:func:`cs336_systems.bench.common.timing.do_bench_on_ranks` runs the same algorithm with one runtime estimate agreed by
the ranks, so that all run the same number of steps). The ranks meet in a barrier before each step. Two stacks of
:data:`cs336_systems.train.SHARDED_STACKS`, each in its own freshly spawned ranks:

* ``ours``: our FSDP by blocks (fp32 master shards, bf16 gathers, fp32 reduce-scatters), compiled blocks (each
  block's forward: one graph for all), our attention operator,
  fused RMSNorm, fused LM head + cross-entropy, fused AdamW on the shards; every block checkpointed, keeping
  its attention output and log-sum-exp (selective checkpointing: backward recomputes the rest of the block, never
  the attention);
* ``torch`` (rows: ``pytorch``): FSDP2 ``fully_shard`` per block and root (bf16 parameters in compute, fp32 reductions,
  fp32 masters), SDPA, every block checkpointed and compiled, the LM head and ``F.cross_entropy`` over chunks of 4,096
  tokens, each recomputed in backward (the full logits, 40 GB with their softmax and gradient, do not fit an 80 GB H100
  beside the rest), ``torch.optim.AdamW(fused=True)``.

Both build the same model from the same seed. By default each stack gets fresh, empty Triton and Inductor caches
(``--warm`` keeps the usual ones), so ``first_step_s`` (the first step, compilation included) and ``cold_total_s``
(launch to last timed step: process start, model build, compilation, timing) are what an empty cache costs. MFU counts
the matmul FLOPs of the step (weights 3x forward, causal attention 3.5x forward: FlashAttention's backward runs five
matmuls to the forward's two) against the bf16 matmul rate measured in the same run.

``--check`` trains 2 layers at context 4096 with the full vocabulary for one step on the ranks and compares the
loss and every parameter with one process running the plain model (SDPA, plain RMSNorm and cross-entropy,
``torch.optim.AdamW``) on the whole batch with the same precision (fp32 masters read in bf16); it exits non-zero
on a mismatch. Without GPUs the tool runs 2 gloo ranks with a tiny model in fp32, our Triton kernels through the
interpreter (it hands ``TRITON_INTERPRET=1`` to the ranks it spawns; under torchrun, set it yourself).

The FLOP and memory models live in ``bench/common/leaderboard_2026_model.py``, the check in
``bench/common/leaderboard_2026_check.py``, the ranks' ``do_bench`` in ``bench/common/timing.py``.

    python -m cs336_systems.bench.leaderboard_2026                         # both stacks, official timing
    python -m cs336_systems.bench.leaderboard_2026 --stacks ours --rep-ms 3000 --warmup-ms 1000 --num-layers 4
    python -m cs336_systems.bench.leaderboard_2026 --check
    python -m cs336_systems.bench.leaderboard_2026 --world-size 1 --per-rank-batch 1 --num-layers 4   # one-GPU proxy

*The checkpoint plan* (``--checkpoint-plan``): what each block's backward recomputes, the same way in both stacks
(our stack through our selective checkpointing, PyTorch's through ``torch.utils.checkpoint`` with its
selective-checkpoint contexts): ``selective`` (every block keeps its attention output and log-sum-exp), ``full`` (every
block recomputed whole), or ``auto``: each rank measures its free memory before building anything
(``torch.cuda.mem_get_info``; on CPU ranks, the host's available memory), and the least of the ranks, less
``--memory-margin-gib`` (by default the larger of 4 GiB and 5 % of it), is the budget
:mod:`cs336_systems.train.checkpoint_plan` fills from the memory model (every block selective where that fits, then
blocks kept whole, from the last, while they fit); ``auto`` is the default. ``stack`` gives each stack the checkpointing
it ran before the plans existed (ours selective, PyTorch's full; rows without ``checkpoint_option``). Every row records
the plan (``checkpoint_plan``: its one-line description and predicted peak) and, on a GPU, the caching allocator's
retries and syncs during the timed steps (``allocator_events_ranks``: each retry frees the allocator's cache and
synchronises the device).

*The residual adds* (``--residual-norm``): ``fused`` runs our stack with each residual add inside the norm that
reads its sum (the ``fused_residual_norm`` part; ``--check`` then checks that step), ``separate`` as it is by
default; given either way, our rows record it (``residual_norm``; rows without the key are ``separate``).
PyTorch's stack keeps its adds and norms.

*The one-GPU proxy* (``--world-size 1``): one rank's work of the two-GPU step, on one GPU: one sequence of
32,768 tokens (``--per-rank-batch 1``), ``--num-layers`` blocks and the full 151,936-word head, both stacks in the
same invocation. Our FSDP and FSDP2 run on a one-rank group (their gathers and reductions are copies), so the rows
(``world_size: 1``) measure a rank's compute, launch path and memory, not its communication.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cs336_systems.bench.common import cli, memory, result_store, timing
from cs336_systems.bench.common import distributed_launch as dl
from cs336_systems.bench.common.leaderboard_2026_check import batch_of_rank, build, check_passes, run_check
from cs336_systems.bench.common.leaderboard_2026_model import (
    BATCH, GB, MODEL, ROW_NAMES, STACK_OF_ROW, TINY, memory_budget, plan_of_option, step_flops,
)
from cs336_systems.train import SHARDED_STACKS
from cs336_systems.train.checkpoint_plan import GiB, CheckpointPlan
from cs336_systems.train.step import RESIDUAL_NORMS

PROBLEM = "leaderboard_2026"
OFFICIAL = dict(rep_ms=30_000, warmup_ms=10_000)
OFFICIAL_WORLD_SIZE = 2  # one sequence of the batch on each
CHECKPOINT_PLANS = ("auto", "selective", "full", "stack")


def parser():
    p = cli.base_parser(__doc__)
    p.add_argument("--stacks", nargs="+", default=["torch", "ours"], choices=list(SHARDED_STACKS),
                   help="stacks of cs336_systems.train.SHARDED_STACKS (rows call torch's 'pytorch')")
    p.add_argument("--rep-ms", type=cli.positive_float, default=OFFICIAL["rep_ms"],
                   help="do_bench rep (official 30000)")
    p.add_argument("--warmup-ms", type=cli.positive_float, default=OFFICIAL["warmup_ms"],
                   help="do_bench warmup (official 10000)")
    p.add_argument("--num-layers", type=cli.positive_int, default=None, help="fewer layers for a trial (official 34)")
    p.add_argument("--context-length", type=cli.positive_int, default=None,
                   help="shorter sequences for a trial (official 32768)")
    p.add_argument("--warm", action="store_true", help="keep the usual Triton/Inductor caches (default: fresh ones)")
    p.add_argument("--check", action="store_true", help="only the correctness check against one process")
    p.add_argument("--world-size", type=cli.positive_int, default=2, help="ranks when not under torchrun (default 2)")
    p.add_argument("--per-rank-batch", type=cli.positive_int, default=1,
                   help="sequences per rank (official 1: batch 2 on two ranks); with --world-size 1, one rank's work")
    p.add_argument("--timeout-s", type=cli.positive_float, default=900.0,
                   help="give up on a stack whose ranks hang this long")
    p.add_argument("--checkpoint-plan", choices=CHECKPOINT_PLANS, default="auto",
                   help="what each block's backward recomputes, in both stacks: 'auto' (default) plans from the free "
                        "memory measured on the ranks (every block selective where that fits, then blocks kept "
                        "whole, from the last, while they fit); 'selective' / 'full' in every block; 'stack': each "
                        "stack's own (ours selective, pytorch full)")
    p.add_argument("--residual-norm", choices=RESIDUAL_NORMS, default=None,
                   help="our stack's residual adds fused into its RMSNorm or separate (default: separate, rows "
                        "without the key)")
    p.add_argument("--memory-margin-gib", type=float, default=None,
                   help="memory left out of the auto plan's budget (default: the larger of 4 GiB and 5 %% of the "
                        "free memory: allocator, NCCL, CUDA context and what the memory model leaves out)")
    return p


def model_config(args, on_gpu: bool) -> dict[str, int]:
    config = dict(MODEL if on_gpu and not args.quick else TINY)
    if args.num_layers:
        config["num_layers"] = args.num_layers
    if args.context_length:
        config["context_length"] = args.context_length
    return config


# ---------------------------------------------------------------------------------------------------
# One stack on the ranks
# ---------------------------------------------------------------------------------------------------


def run_stack(rank: int, world_size: int, args, stack: str, launched_at: float, rank_env: dict[str, str]) -> None:
    """One rank timing ``stack``; rank 0 writes the row. ``rank_env``: environment variables the libraries read
    (``TRITON_INTERPRET``, the cache folders), set before anything is built."""
    os.environ.update(rank_env)
    device = dl.rank_device()
    on_gpu = device.type == "cuda"
    config = model_config(args, on_gpu)
    compute_dtype = torch.bfloat16 if on_gpu else torch.float32
    plan = rank_plan(args, stack, config, world_size, device)
    if rank == 0:
        print(f"# {stack}: checkpoint plan: {plan.describe()}", file=sys.stderr)
    step = build(stack, config, device, compute_dtype, block_modes=plan.modes, residual_norm=args.residual_norm)
    batch = args.per_rank_batch * world_size
    x, y = batch_of_rank(config, device, rank, world_size, batch)

    def train_step() -> None:
        dist.barrier()
        step(x, y)

    measured = _time_train_step(train_step, device, args)
    cold_total_s = time.time() - launched_at
    loss = step(x, y).float().reshape(1)
    dist.all_reduce(loss)  # the sum of the ranks' mean losses
    measured["matmul_tflops"] = timing.measure_matmul_tflops(device) if on_gpu else None
    everyone = dl.gather(measured)
    if rank != 0:
        return
    result = _stack_result(args, stack, config, world_size, everyone, on_gpu, compute_dtype, cold_total_s,
                           loss.item() / world_size, plan)
    _write_row(args, stack, config, world_size, result)


def rank_plan(args, stack: str, config: dict[str, int], world_size: int, device: torch.device) -> CheckpointPlan:
    """``stack``'s checkpoint plan as ``--checkpoint-plan`` says (module docstring); ``auto`` measures the free
    memory of every rank, so call it on all ranks before anything is built."""
    free = dl.least_free_bytes(device) if args.checkpoint_plan == "auto" else None
    margin = None if args.memory_margin_gib is None else args.memory_margin_gib * GiB
    option = None if args.checkpoint_plan == "stack" else args.checkpoint_plan
    return plan_of_option(option, config, stack, world_size, args.per_rank_batch, free, margin)


def _time_train_step(train_step: Callable[[], None], device: torch.device, args) -> dict[str, float | None]:
    """This rank's ``first_step_s`` (the first step, compilation included), then ``step_ms``: on a GPU the mean of
    ``do_bench_on_ranks`` and ``peak_gb`` allocated meanwhile, on CPU the best of two steps (no peak)."""
    start = time.perf_counter()
    train_step()
    timing.synchronize(device)
    first_step_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = memory.allocator_events(device)
        step_ms = timing.do_bench_on_ranks(train_step, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, device=device)
        peak_gb = torch.cuda.max_memory_allocated(device) / GB
        events = memory.allocator_events_since(before, device)
    else:
        step_ms = 1e3 * min(timing.time_calls(train_step, warmup=0, steps=2, device=device))
        peak_gb = events = None
    return dict(step_ms=step_ms, peak_gb=peak_gb, first_step_s=first_step_s, allocator_events=events)


def _stack_result(args, stack: str, config: dict[str, int], world_size: int, everyone: list[dict[str, Any]],
                  on_gpu: bool, compute_dtype: torch.dtype, cold_total_s: float, loss: float,
                  plan: CheckpointPlan) -> dict[str, Any]:
    """The row's measurements from every rank's (``everyone``): the slowest rank's step, the largest peak, MFU
    against the slowest matmul rate; with how the step was built (its checkpoint ``plan``) and the predicted
    memory."""
    step_ms = max(r["step_ms"] for r in everyone)
    rates = [r["matmul_tflops"] for r in everyone if r["matmul_tflops"]]
    step_flop_count = step_flops(config, args.per_rank_batch * world_size)
    mfu = step_flop_count / (step_ms / 1e3) / (world_size * min(rates) * 1e12) if rates else None
    return {
        "step_ms": step_ms,
        "step_ms_per_rank": [r["step_ms"] for r in everyone],
        "peak_gb_per_rank": max(r["peak_gb"] for r in everyone) if on_gpu else None,
        "peak_gb_ranks": [r["peak_gb"] for r in everyone],
        # during the timed steps, per rank: retries after freeing the cache (each synchronises the device) and more
        "allocator_events_ranks": [r["allocator_events"] for r in everyone],
        "first_step_s": max(r["first_step_s"] for r in everyone),
        "cold_total_s": cold_total_s,
        "cold_caches": not args.warm,
        "mfu": mfu,
        "flops": step_flop_count,
        "matmul_tflops": min(rates) if rates else None,
        "param_dtype": "fp32 (master)",
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "checkpoint_plan": {"describe": plan.describe(), "predicted_peak_gb": plan.peak_bytes / GB},
        "parts": dataclasses.asdict(SHARDED_STACKS[stack].with_(checkpointing=plan.modes)
                                    .with_residual_norm(args.residual_norm or "separate")),
        "timer": "do_bench_on_ranks (triton do_bench, mean)" if on_gpu else "time_calls (min of 2)",
        "predicted_memory": memory_budget(config, stack, world_size, args.per_rank_batch, modes=plan.modes),
        "loss_after_timing": loss,
    }


def _write_row(args, stack: str, config: dict[str, int], world_size: int, result: dict[str, Any]) -> None:
    """Store and print ``stack``'s row; whichever stack runs second carries ``ours_over_pytorch``, its step time over
    the other's in the same case."""
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force)
    case = case_of(args, stack, config, world_size)
    other_case = case_of(args, "torch" if stack == "ours" else "ours", config, world_size)
    other = store.newest(other_case)
    # The same plan option and residual adds (a row without a key matches rows with it: newest reads a subset)
    if other is not None and all(other.get(key) == other_case.get(key) for key in ("checkpoint_option",
                                                                                    "residual_norm")):
        step_ms = result["step_ms"]
        ours_ms, pytorch_ms = (step_ms, other["step_ms"]) if stack == "ours" else (other["step_ms"], step_ms)
        result["ours_over_pytorch"] = ours_ms / pytorch_ms
    row = store.add(case, result)
    cli.print_table([row], ["stack", "step_ms", "peak_gb_per_rank", "first_step_s", "cold_total_s", "mfu",
                            "ours_over_pytorch"], digits=3)


def case_of(args, stack: str, config: dict[str, int], world_size: int) -> dict[str, Any]:
    batch = args.per_rank_batch * world_size
    # Rows measured before the option existed checkpoint as 'stack' does: their case has no such key.
    plan = {"checkpoint_option": args.checkpoint_plan} if args.checkpoint_plan != "stack" else {}
    if args.residual_norm and SHARDED_STACKS[stack].rmsnorm == "fused":
        plan["residual_norm"] = args.residual_norm
    return dict(**plan, stack=ROW_NAMES[stack], num_layers=config["num_layers"],
                context_length=config["context_length"],
                batch_size=batch, world_size=world_size, rep_ms=args.rep_ms, warmup_ms=args.warmup_ms,
                official=args.rep_ms == OFFICIAL["rep_ms"] and args.warmup_ms == OFFICIAL["warmup_ms"]
                and config["num_layers"] == MODEL["num_layers"] and config["context_length"] == MODEL["context_length"]
                and world_size == OFFICIAL_WORLD_SIZE and batch == BATCH)


# ---------------------------------------------------------------------------------------------------
# Entry
# ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    world_size = int(os.environ["WORLD_SIZE"]) if dl.under_torchrun() else args.world_size
    backend, reason = dl.choose_backend(world_size)
    on_gpu = backend == "nccl"
    if dl.is_rank0_process():
        cli.announce(torch.device("cuda" if on_gpu else "cpu"), args.quick)
        print(f"# {world_size} ranks, {backend}: {reason}", file=sys.stderr)
    rank_env = {}  # what the libraries on the ranks read from the environment, handed to the ranks
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1" and not dl.under_torchrun():
        # Our Triton kernels run on CPU ranks only through the interpreter, read when the ranks import them.
        rank_env["TRITON_INTERPRET"] = "1"
        print("# CPU ranks: TRITON_INTERPRET=1 for our Triton kernels", file=sys.stderr)
    if args.check:
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "check.json")
            dl.launch(run_check, world_size, args.stacks, args.quick, out, rank_env, args.residual_norm,
                      backend=backend, timeout_s=args.timeout_s)
            if not dl.is_rank0_process():
                return
            with open(out) as f:
                report = json.load(f)
        cli.print_table([{"stack": k, **v} for k, v in report.items()],
                        ["stack", "loss", "reference_loss", "loss_rel_error", "worst_update_difference_in_lr",
                         "flipped_share"], digits=6)
        if not check_passes(report, bf16=on_gpu and not args.quick):
            raise SystemExit("leaderboard_2026 check FAILED: a stack differs from one process")
        print("# check passed", file=sys.stderr)
        return
    config = model_config(args, on_gpu)
    store = result_store.ResultStore(PROBLEM, args.results_dir, args.force)
    pending = store.pending([case_of(args, stack, config, world_size) for stack in args.stacks])
    if not pending:  # the store said so
        return
    # Read when CUDA starts, before a rank could set it: inherited (the user's own setting wins).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for case in pending:
        stack = STACK_OF_ROW[case["stack"]]
        caches = {}
        if not args.warm and not dl.under_torchrun():
            folder = tempfile.mkdtemp(prefix=f"cs336-cold-{stack}-")
            caches = {"TRITON_CACHE_DIR": os.path.join(folder, "triton"),
                      "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor")}
        print(f"# {stack}: {config['num_layers']} layers, context {config['context_length']}", file=sys.stderr)
        dl.launch(run_stack, world_size, args, stack, time.time(), {**rank_env, **caches}, backend=backend,
                  timeout_s=args.timeout_s)


if __name__ == "__main__":
    main()
