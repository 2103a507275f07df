"""Overlapped DDP: each gradient's all-reduce starts as soon as autograd has accumulated it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .base import DataParallelModule


class DDPIndividualParameters(DataParallelModule):
    """One asynchronous all-reduce per parameter, launched from a post-accumulate-grad hook.

    Communication of the last layers' gradients overlaps with the backward pass of the first layers;
    :meth:`finish_gradient_synchronization` waits for the outstanding all-reduces and averages.

    Every rank must compute gradients for the same parameters (the hooks fire in the order autograd
    produces gradients, which is the same on every rank for the same graph, and each fire is one
    collective). A parameter without a gradient keeps ``grad is None``. Each parameter's gradient may be
    produced once per synchronisation: for gradient accumulation, use :meth:`no_sync` for all but the
    last micro-batch.
    """

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self._in_flight: list[tuple[torch.Tensor, torch.Tensor, dist.Work]] = []  # (grad, wire, work)
        self._launched: set[int] = set()  # id() of the parameters whose all-reduce was launched this step
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(self._on_gradient_ready) for param in self.trainable_parameters()
        ]

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        if not self._gradient_sync_enabled:
            return
        if id(param) in self._launched:
            raise RuntimeError(
                "a gradient was produced twice before finish_gradient_synchronization(): run the backward "
                "passes of all but the last micro-batch inside no_sync()"
            )
        self._launched.add(id(param))
        grad = param.grad
        wire = grad if grad.is_contiguous() else grad.contiguous()
        self._in_flight.append((grad, wire, dist.all_reduce(wire, op=dist.ReduceOp.SUM, async_op=True)))

    def finish_gradient_synchronization(self) -> None:
        """Wait for every launched all-reduce, then divide the gradients by the world size."""
        for grad, wire, work in self._in_flight:
            work.wait()
            if wire is not grad:
                grad.copy_(wire)
        grads = [grad for grad, _, _ in self._in_flight]
        if grads:
            torch._foreach_div_(grads, self.world_size)
        self._reset_step_state()

    def on_train_batch_start(self) -> None:
        """Forget the previous step's bookkeeping (waiting for any all-reduce still in flight)."""
        for _, _, work in self._in_flight:
            work.wait()
        self._reset_step_state()

    def _reset_step_state(self) -> None:
        self._in_flight.clear()
        self._launched.clear()
