"""Bucketed DDP: gradients grouped into buckets of bounded size, each all-reduced once it is full.

Each bucket owns one flat buffer laid out as ``[gradients of its parameters | one flag per parameter]``.
A parameter's ``.grad`` becomes a view of its slice of the buffer, so autograd accumulates straight into
the buffer and no copy is needed before or after the all-reduce (when the optimizer's ``zero_grad``
sets gradients to ``None``, the fresh gradient is copied in once and the view put back). The flag says
"this rank has a gradient for this parameter"; summed over ranks by the same all-reduce, it tells every
rank, identically, which parameters got a gradient anywhere.

Buckets are all-reduced in their index order, a bucket starting once it is complete and all buckets
before it have started. Collectives must be issued in the same order on every rank; tying the order to
the bucket index rather than to the order gradients happen to arrive makes that hold even when ranks
produce gradients in different orders or for different parameters, at the cost of a bucket that is
complete early sometimes waiting for an earlier one.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .base import DataParallelModule

BYTES_PER_MB = 1024**2


@dataclass(eq=False)
class GradientBucket:
    """A group of parameters whose gradients share one buffer and one all-reduce."""

    params: list[nn.Parameter]
    buffer: torch.Tensor  # (total gradient numel + len(params),): gradients, then presence flags
    grad_views: list[torch.Tensor]  # grad_views[i] is params[i]'s slice of the buffer, shaped like it
    arrived: set[int] = field(default_factory=set)  # positions whose gradient arrived through a hook this step
    work: dist.Work | None = None

    @property
    def flags(self) -> torch.Tensor:
        return self.buffer[self.buffer.numel() - len(self.params) :]

    @property
    def is_complete(self) -> bool:
        return len(self.arrived) == len(self.params)

    @property
    def nbytes(self) -> int:
        return (self.buffer.numel() - len(self.params)) * self.buffer.element_size()


def check_bucket_size(bucket_size_mb: object) -> None:
    """Raise unless ``bucket_size_mb`` is a positive, finite number of MiB (a real number, not a string)."""
    is_number = isinstance(bucket_size_mb, numbers.Real) and not isinstance(bucket_size_mb, bool)
    if not (is_number and 0 < bucket_size_mb < float("inf")):
        raise ValueError(f"bucket_size_mb must be a positive number of MiB (e.g. 25 or 0.5), got {bucket_size_mb!r}")


def assign_buckets(params: list[nn.Parameter], bucket_size_bytes: float) -> list[list[nn.Parameter]]:
    """Split ``params``, taken in reverse order, into consecutive groups of at most ``bucket_size_bytes``.

    Reverse ``parameters()`` order approximates the order in which backward produces gradients, so the
    first bucket fills first. A tensor larger than the cap gets a bucket of its own, and a bucket never
    mixes dtypes or devices (it is one flat tensor).
    """
    groups: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    current_bytes = 0
    for param in reversed(params):
        nbytes = param.numel() * param.element_size()
        if current and (
            current_bytes + nbytes > bucket_size_bytes
            or param.dtype != current[0].dtype
            or param.device != current[0].device
        ):
            groups.append(current)
            current, current_bytes = [], 0
        current.append(param)
        current_bytes += nbytes
    if current:
        groups.append(current)
    return groups


def _make_bucket(params: list[nn.Parameter]) -> GradientBucket:
    total = sum(param.numel() for param in params)
    buffer = torch.zeros(total + len(params), dtype=params[0].dtype, device=params[0].device)
    views, offset = [], 0
    for param in params:
        views.append(buffer[offset : offset + param.numel()].view(param.shape))
        offset += param.numel()
    return GradientBucket(params=params, buffer=buffer, grad_views=views)


class DDPBucketed(DataParallelModule):
    """DDP that all-reduces gradients in buckets of at most ``bucket_size_mb`` MiB, overlapped with backward.

    Call :meth:`on_train_batch_start` at the start of each step (optional: the per-step state is also
    reset at the end of :meth:`finish_gradient_synchronization`) and
    :meth:`finish_gradient_synchronization` after backward, before ``optimizer.step()``.

    * Parameters with ``requires_grad=False`` are broadcast at construction and never bucketed.
    * A shared (tied) parameter appears once in ``parameters()``: one gradient, one slot, one hook call per
      backward pass however many times it is used.
    * A parameter that gets no gradient in a step (unused in the forward pass, on some ranks or all):
      its bucket never completes through hooks, so :meth:`finish_gradient_synchronization` launches it,
      contributing zeros for the missing gradient. Afterwards the parameter's gradient is the average
      (missing gradients counted as zeros) on every rank if any rank had one, and stays ``None`` on every
      rank otherwise, so the optimizer skips it as it would in single-process training.
    * Gradient accumulation: run all micro-batches but the last inside :meth:`no_sync`; producing a
      gradient twice between two synchronisations raises, because its bucket may already be on the wire.
      A gradient left in place from a previous step (``zero_grad`` not called) is carried along, which is
      also what single-process training does.

    Which parameters require gradients is read at construction.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        check_bucket_size(bucket_size_mb)
        super().__init__(module)
        self.bucket_size_mb = bucket_size_mb
        groups = assign_buckets(self.trainable_parameters(), bucket_size_mb * BYTES_PER_MB)
        self.buckets = [_make_bucket(group) for group in groups]
        self._next_to_launch = 0
        self._hook_handles = []
        for bucket in self.buckets:
            for position, param in enumerate(bucket.params):
                hook = self._make_gradient_hook(bucket, position)
                self._hook_handles.append(param.register_post_accumulate_grad_hook(hook))

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        """Gradient bytes in each bucket, in all-reduce order."""
        return [bucket.nbytes for bucket in self.buckets]

    def _make_gradient_hook(self, bucket: GradientBucket, position: int):
        def on_gradient_ready(param: nn.Parameter) -> None:
            if not self._gradient_sync_enabled:
                return
            if position in bucket.arrived:
                raise RuntimeError(
                    "a gradient was produced twice before finish_gradient_synchronization(): run the backward "
                    "passes of all but the last micro-batch inside no_sync()"
                )
            self._adopt_gradient(bucket, position)
            bucket.arrived.add(position)
            if bucket.is_complete:
                self._launch_buckets_in_order(force=False)

        return on_gradient_ready

    @staticmethod
    def _adopt_gradient(bucket: GradientBucket, position: int) -> None:
        """Make the parameter's gradient the bucket's view, copying it in if autograd allocated a new one."""
        param, view = bucket.params[position], bucket.grad_views[position]
        grad = param.grad
        if grad is None:
            return
        if grad.data_ptr() != view.data_ptr() or grad.shape != view.shape:
            view.copy_(grad)
            param.grad = view

    def _launch_buckets_in_order(self, force: bool) -> None:
        """Launch buckets from the next unlaunched one on, while complete (all of them when ``force``)."""
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if bucket.is_complete:
                bucket.flags.fill_(1)
            elif force:
                self._fill_missing_gradients(bucket)
            else:
                return
            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, async_op=True)
            self._next_to_launch += 1

    def _fill_missing_gradients(self, bucket: GradientBucket) -> None:
        """Prepare an incomplete bucket: gradients that exist go in, missing ones are zeros (flag 0)."""
        flags = torch.zeros(len(bucket.params), dtype=bucket.buffer.dtype)
        for position, param in enumerate(bucket.params):
            if position in bucket.arrived or param.grad is not None:
                self._adopt_gradient(bucket, position)
                flags[position] = 1
            else:
                bucket.grad_views[position].zero_()
        bucket.flags.copy_(flags)

    def finish_gradient_synchronization(self) -> None:
        """Launch the buckets not yet launched, wait for all of them, and average the gradients."""
        self._launch_buckets_in_order(force=True)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.buffer.div_(self.world_size)
            if not bucket.is_complete:
                # Only a bucket that missed a local gradient can hold a parameter no rank had a gradient
                # for; reading its flags costs a device-to-host copy, which complete buckets skip.
                for param, view, count in zip(bucket.params, bucket.grad_views, bucket.flags.tolist()):
                    param.grad = view if count > 0 else None
        self._reset_step_state()

    def on_train_batch_start(self) -> None:
        """Forget the previous step's bookkeeping (waiting for any all-reduce still in flight)."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
        self._reset_step_state()

    def _reset_step_state(self) -> None:
        for bucket in self.buckets:
            bucket.arrived.clear()
            bucket.work = None
        self._next_to_launch = 0
