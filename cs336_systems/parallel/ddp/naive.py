"""Naive DDP: after the backward pass, one blocking all-reduce per parameter gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import DataParallelModule


def all_reduce_sum_(tensor: torch.Tensor) -> None:
    """Blocking SUM all-reduce of ``tensor`` in place (through a contiguous copy if it needs one)."""
    if tensor.is_contiguous():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return
    wire = tensor.contiguous()
    dist.all_reduce(wire, op=dist.ReduceOp.SUM)
    tensor.copy_(wire)


class DDPNaive(DataParallelModule):
    """Data parallelism at its simplest: nothing overlaps, every gradient is its own all-reduce.

    The baseline of the DDP benchmarks. Every rank must produce gradients for the same parameters
    (a parameter without a gradient on every rank is skipped and keeps ``grad is None``). With
    gradient accumulation, run every micro-batch's backward, then call
    :meth:`finish_gradient_synchronization` once; :meth:`no_sync` changes nothing here.
    """

    def finish_gradient_synchronization(self) -> None:
        """All-reduce each parameter's gradient in ``parameters()`` order and divide by the world size."""
        grads = [param.grad for param in self.trainable_parameters() if param.grad is not None]
        for grad in grads:
            all_reduce_sum_(grad)
        if grads:
            torch._foreach_div_(grads, self.world_size)
