"""What every data-parallel wrapper shares: rank 0's weights at start, forward, and ``no_sync``.

A wrapper holds the model in ``self.module``, so its ``parameters()`` and ``named_parameters()`` are
the model's own, in the model's order (names prefixed with ``module.``). Gradients are averaged with
a SUM all-reduce followed by a division by the world size, because gloo has no AVG reduction.
Only broadcast and all-reduce are used, which gloo supports on CPU and CUDA tensors and NCCL on GPUs,
so the same code runs on either backend; tensors are communicated on the device they live on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch import nn

from cs336_systems.parallel.distributed import broadcast_module_state, require_process_group


class DataParallelModule(nn.Module):
    """Base class of the DDP wrappers: holds ``module``, broadcasts its state, forwards calls.

    Subclasses implement :meth:`finish_gradient_synchronization`, which must be called after the
    backward pass and before ``optimizer.step()``; afterwards every rank holds the gradients averaged
    over all ranks.

    Gradient accumulation: run the backward passes of all micro-batches but the last inside
    :meth:`no_sync` (gradients then only accumulate locally), the last one outside it, then call
    :meth:`finish_gradient_synchronization` once.

    Calling :meth:`finish_gradient_synchronization` again with no backward in between is harmless: the
    gradients are already averaged, equal on every rank, and averaging them again leaves them as they are
    (exactly when the world size is a power of two, else to rounding). The overlapped wrapper then has
    nothing to wait for and does nothing; the others all-reduce again, so every rank must repeat the call.
    An optimizer built on the module's parameters before wrapping trains the wrapped model (the wrappers
    keep the module's own parameter objects), and a module without parameters is wrapped as it is.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        require_process_group(type(self).__name__)
        self.module = module
        self.world_size = dist.get_world_size()
        self._gradient_sync_enabled = True
        broadcast_module_state(module, src=0)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block start no communication; gradients accumulate locally."""
        previous = self._gradient_sync_enabled
        self._gradient_sync_enabled = False
        try:
            yield
        finally:
            self._gradient_sync_enabled = previous

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The module's parameters that require a gradient, in ``parameters()`` order (shared ones once)."""
        return [param for param in self.module.parameters() if param.requires_grad]

    def on_train_batch_start(self) -> None:
        """Called at the start of each training step; wrappers with per-step state reset it here."""

    def finish_gradient_synchronization(self) -> None:
        """Complete the gradient all-reduces; afterwards every rank holds the averaged gradients."""
        raise NotImplementedError
