"""The 2026 leaderboard step on the ranks, and its check (``leaderboard_2026 --check``): each stack of
:data:`cs336_systems.train.SHARDED_STACKS` built from one seed, a rank's slice of the batch, and one step of each
stack compared with one process running the plain model on the whole batch (SDPA, plain RMSNorm and
cross-entropy, ``torch.optim.AdamW``, fp32 masters read in the same compute dtype)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from cs336_basics.model import BasicsTransformerLM
from cs336_systems.bench.common import distributed_launch as dl
from cs336_systems.bench.common import timing
from cs336_systems.bench.common.leaderboard_2026_model import BATCH, MODEL, TINY
from cs336_systems.bench.common.lm import master_name, read_weights_in
from cs336_systems.train import SHARDED_STACKS, build_training_step
from cs336_systems.train.step import ADAMW_HYPERPARAMETERS


def build(stack: str, config: dict[str, int], device: torch.device, compute_dtype: torch.dtype,
          block_modes: tuple[str, ...] | None = None, residual_norm: str | None = None):
    """The training step of ``stack`` on a fresh model of ``config`` (seed 0: the same weights on every rank);
    ``block_modes``: each block's checkpoint mode, in place of the stack's own checkpointing; ``residual_norm``:
    the residual adds ``fused`` into the norms or ``separate`` (None: as the stack has them)."""
    torch.manual_seed(0)
    model = BasicsTransformerLM(**config, device=device)
    parts = SHARDED_STACKS[stack]
    if block_modes is not None:
        parts = parts.with_(checkpointing=block_modes)
    if residual_norm is not None:
        parts = parts.with_residual_norm(residual_norm)
    if device.type != "cuda":
        parts = parts.with_(compile="none")  # Inductor on CPU ranks would only cost minutes
    return build_training_step(model, parts, autocast_dtype=compute_dtype)


def batch_of_rank(config: dict[str, int], device: torch.device, rank: int, world_size: int, batch: int):
    """This rank's slice of the step's batch (the same tokens whatever the world size)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config["vocab_size"], (batch, config["context_length"] + 1), generator=generator)
    per_rank = batch // world_size
    mine = tokens[rank * per_rank : (rank + 1) * per_rank].to(device)
    return mine[:, :-1], mine[:, 1:]


def reference_step(config: dict[str, int], device: torch.device, compute_dtype: torch.dtype, batch: int):
    """One process, the whole batch: the plain model (SDPA, plain norms and loss, ``torch.optim.AdamW``) with
    fp32 masters read in ``compute_dtype``. Returns the loss and the parameters after one step."""
    from cs336_systems.train.step import plain_loss

    torch.manual_seed(0)
    model = BasicsTransformerLM(**config, device=device)
    from cs336_systems.attention import get_attention

    model.set_attention(get_attention("sdpa"))
    read_weights_in(model, compute_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW_HYPERPARAMETERS)
    x, y = batch_of_rank(config, device, 0, 1, batch)
    loss = plain_loss(model.hidden_states(x), model.lm_head, y)
    loss.backward()
    optimizer.step()
    params = {master_name(name): p.detach() for name, p in model.named_parameters()}
    return loss.item(), params


def run_check(rank: int, world_size: int, stacks: list[str], quick: bool, out_path: str, rank_env: dict[str, str],
              residual_norm: str | None = None) -> None:
    """One rank of the check: each of ``stacks`` steps once from the same weights; rank 0 compares the losses and
    updates with :func:`reference_step` and writes the report (JSON) to ``out_path``. ``rank_env``: environment
    variables the libraries read (e.g. ``TRITON_INTERPRET``), set before anything is built; ``residual_norm``: as
    :func:`build`'s."""
    os.environ.update(rank_env)
    device = dl.rank_device()
    on_gpu = device.type == "cuda"
    config = dict(MODEL, num_layers=2, context_length=4096) if on_gpu and not quick else dict(TINY)
    compute_dtype = torch.bfloat16 if on_gpu else torch.float32
    results = {}
    for stack in stacks:
        step = build(stack, config, device, compute_dtype, residual_norm=residual_norm)
        x, y = batch_of_rank(config, device, rank, world_size, BATCH)
        initial = full_parameters(step)
        loss = step(x, y).float().reshape(1)
        dist.all_reduce(loss)
        params = full_parameters(step)
        results[stack] = (loss.item() / world_size, initial, params)
        del step
        timing.free_memory()
    if rank != 0:
        return
    ref_loss, ref_params = reference_step(config, device, compute_dtype, BATCH)
    lr = ADAMW_HYPERPARAMETERS["lr"]
    report = {}
    for stack, (loss, initial, params) in results.items():
        worst_update, flipped, count = 0.0, 0, 0
        for name, ref in ref_params.items():
            ours, start = params[name].to(ref.device), initial[name].to(ref.device)
            difference = (ours - start) - (ref - start)  # the two updates
            worst_update = max(worst_update, difference.abs().max().item() / lr)
            flipped += (difference.abs() > lr).sum().item()  # an update of the other sign (|update| ~ lr)
            count += ref.numel()
        report[stack] = dict(loss=loss, reference_loss=ref_loss, loss_rel_error=abs(loss - ref_loss) / abs(ref_loss),
                             worst_update_difference_in_lr=worst_update, flipped_share=flipped / count)
    with open(out_path, "w") as f:
        json.dump(report, f)


def full_parameters(step) -> dict[str, torch.Tensor]:
    """Every parameter of the stepped model by its ``BasicsTransformerLM`` name, full, fp32, on the CPU."""
    net = step.net
    if hasattr(net, "gather_full_params"):
        full = net.gather_full_params()
    else:
        full = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p) for name, p in net.named_parameters()}
    return {name.removeprefix("model."): t.detach().float().cpu() for name, t in full.items()}


def check_passes(report: dict[str, dict[str, float]], bf16: bool) -> bool:
    """Loss within 1e-2 relative (bf16; 1e-5 fp32); no update differs by more than 2 lr plus a little (bf16 AdamW's
    first step is ~lr per element, sign flips on near-zero gradients give ~2 lr); at most 1 % of updates flipped."""
    loss_tol, flip_tol = (1e-2, 1e-2) if bf16 else (1e-5, 1e-4)
    return all(r["loss_rel_error"] <= loss_tol and r["worst_update_difference_in_lr"] <= 2.05
               and r["flipped_share"] <= flip_tol for r in report.values())
