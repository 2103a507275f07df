"""DDP with one all-reduce over all gradients, flattened into a single buffer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .base import DataParallelModule


class DDPFlattened(DataParallelModule):
    """Like :class:`~cs336_systems.parallel.ddp.naive.DDPNaive`, but one all-reduce instead of one per parameter.

    The gradients are copied into one flat buffer per dtype and device (a buffer holds a single dtype),
    reduced, and copied back: fewer, larger messages in exchange for two extra copies and a buffer as
    large as the gradients. Nothing overlaps with the backward pass.
    """

    def finish_gradient_synchronization(self) -> None:
        """All-reduce all gradients as one flat tensor per dtype and device, then average."""
        grads_by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for param in self.trainable_parameters():
            if param.grad is not None:
                grads_by_kind.setdefault((param.grad.dtype, param.grad.device), []).append(param.grad)
        for grads in grads_by_kind.values():
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world_size)
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)
