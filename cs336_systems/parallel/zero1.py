"""ZeRO stage 1 on flat buffers: each rank reduces, steps and keeps optimizer state for one slice of them.

The parameters of a param group (one dtype and device at a time) become views into one flat buffer,
padded to a multiple of the world size W; their gradients become views into a flat gradient buffer of
the same layout. Rank r owns the contiguous slice ``[r * S, (r + 1) * S)`` of every buffer (S = padded
length / W). A step is three moves (the ZeRO-1 of Rajbhandari et al., 2020):

1. ``reduce_scatter_tensor`` of the flat gradients, in place: rank r's slice of its flat gradients
   receives the sum of that slice over the ranks, divided by W (the average, as DDP computes it);
2. the inner optimizer steps rank r's slice as one float32 parameter, so its state is 1/W of the model's;
3. ``all_gather_into_tensor`` of the updated slices back into the flat parameter buffer, on every rank.

Compared with :class:`~cs336_systems.parallel.sharded_optimizer.ShardedOptimizer` (DDP's all-reduce of
all gradients, then one broadcast per parameter from its owner), this moves the same bytes as one
all-reduce (a reduce-scatter plus an all-gather) instead of an all-reduce plus broadcasts, in W-balanced
slices instead of whole parameters, and in one or two collectives per buffer instead of one per parameter.

**Usage**: this optimizer averages the gradients itself, so the model must NOT be wrapped in a DDP that
all-reduces them (that would reduce twice). Build the model identically on every rank (or let this
optimizer broadcast rank 0's parameters, which it does at construction), feed each rank its own data,
call ``backward`` and ``step``::

    model = build_model().to(device)
    optimizer = FlatShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    for x, y in my_shard_of_the_batches:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()  # reduce-scatter, local step, all-gather

Design choices:

* Parameters become views into the flat buffer (``param.data = flat[offset:offset + n].view_as(param)``),
  and their ``.grad`` views into the flat gradient buffer, so the collectives read and write the model's own
  memory: no copy in or out. What breaks the views: moving the model (``model.to(...)``) after construction.
  A ``.grad`` replaced or set to None behind the optimizer's back (``model.zero_grad()``) is copied into
  (or zeroes) its slice at the next step, which then points ``.grad`` back at the slice.
  :meth:`zero_grad` zeroes the flat gradients in place whatever ``set_to_none`` says.
  After a step, this rank's slice of the gradients holds the averaged gradient (the reduce-scatter's output)
  and the rest this rank's own gradient.
* One flat buffer per param group and (dtype, device) in it, so each inner shard belongs to one group and
  keeps that group's hyper-parameters; a model with one group and one dtype has one buffer, hence one
  reduce-scatter and one all-gather per step.
* The inner optimizer's parameter is the float32 slice itself for float32 parameters (a view: the step
  updates the flat buffer in place, and the all-gather runs in place); for lower-precision parameters it
  is a float32 master copy of the slice, its gradient the upcast reduced slice, and the step writes the
  master back into the slice (rounded) before the all-gather.
* Parameters that do not require grad are left out of the buffers and never stepped. A trainable parameter
  that got no gradient in a step is stepped with a zero gradient (its slice of the flat gradients is zero),
  where a plain optimizer would skip it: weight decay and momentum still move it.

Collectives: ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` on every backend (gloo has both on
CPU tensors since torch 2.x; the tests run them there); tensors travel on their parameters' device.
It needs an initialised default process group, as the DDP wrappers do; with one rank it runs no collectives.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from cs336_systems.parallel.sharded_optimizer import (
    check_state_dict_groups,
    copy_hyperparameters,
    fill_in_defaults,
    rank_and_world_size,
)

# Scalar state entries of torch's optimizers. Only needed to read a state dict entry of a 0-dim parameter,
# whose per-element state (shape ()) looks like a scalar.
_SCALAR_STATE_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


@dataclass
class FlatBucket:
    """The parameters of one group, dtype and device, flattened; this rank's slice and its inner parameter."""

    params: list[nn.Parameter]  # in group order; each a view into flat_param
    offsets: list[int]  # where each parameter starts in the flat buffers
    flat_param: torch.Tensor  # (padded,)
    flat_grad: torch.Tensor  # (padded,): the parameters' .grad are views into it
    master: torch.Tensor  # (shard,) float32: what the inner optimizer steps
    start: int  # this rank's slice: flat[start:start + shard]

    @property
    def shard(self) -> int:
        return self.master.numel()

    def param_slice(self, index: int) -> slice:
        offset = self.offsets[index]
        return slice(offset, offset + self.params[index].numel())

    def local(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start : self.start + self.shard]


class FlatShardedOptimizer(Optimizer):
    """ZeRO-1: wraps ``optimizer_cls`` so that each rank averages, steps and keeps the state of a 1/W flat slice.

    ``params`` are tensors or param-group dicts (with their own hyper-parameters), as for any optimizer;
    ``kwargs`` are the defaults passed to ``optimizer_cls``. The model must not be under an all-reducing
    DDP: :meth:`step` averages the gradients over the ranks itself (see the module docstring).

    ``param_groups`` lists all parameters, with every hyper-parameter filled in; changes made to it (by a
    learning-rate schedule, say) reach the inner optimizer at the next :meth:`step`. The constructor,
    :meth:`add_param_group` (which broadcasts the new parameters from rank 0), :meth:`step` and
    :meth:`state_dict` are collective: call them identically on every rank.
    """

    def __init__(
        self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], optimizer_cls: type[Optimizer], **kwargs: Any
    ):
        self.rank, self.world_size = rank_and_world_size(optimizer_cls, type(self).__name__)
        self.optimizer_cls = optimizer_cls
        self.local_optimizer: Optimizer | None = None
        self.buckets: list[list[FlatBucket]] = []  # buckets[g]: the flat buffers of param_groups[g]
        self._local_groups: list[dict[str, Any]] = []  # collected while the base constructor adds groups
        super().__init__(params, defaults=dict(kwargs))
        # One inner group per outer group (its shards), so group g here is group g there.
        self.local_optimizer = optimizer_cls(self._local_groups, **kwargs)
        fill_in_defaults(self, self.local_optimizer)

    # ---------------------------------------------------------------------------------------------
    # Flattening
    # ---------------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its trainable parameters become views into new flat buffers (rank 0's values)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        seen: set[int] = set()
        for param in group["params"]:
            if not param.requires_grad or id(param) in seen:
                continue
            if param.is_sparse or not param.is_floating_point():
                raise ValueError(
                    f"flat sharding needs dense floating-point parameters, got a {param.dtype} "
                    f"{'sparse ' if param.is_sparse else ''}tensor: leave it out of the optimizer or give it its own"
                )
            seen.add(id(param))
            by_kind.setdefault((param.dtype, param.device), []).append(param)
        buckets = [self._flatten(params) for params in by_kind.values() if sum(p.numel() for p in params) > 0]
        self.buckets.append(buckets)
        local_group = {key: value for key, value in group.items() if key != "params"}
        local_group["params"] = [bucket.master for bucket in buckets]
        if self.local_optimizer is None:
            self._local_groups.append(local_group)
        else:
            self.local_optimizer.add_param_group(local_group)
            fill_in_defaults(self, self.local_optimizer)

    @torch.no_grad()
    def _flatten(self, params: list[nn.Parameter]) -> FlatBucket:
        offsets, total = [], 0
        for param in params:
            offsets.append(total)
            total += param.numel()
        padded = -(-total // self.world_size) * self.world_size
        dtype, device = params[0].dtype, params[0].device
        flat_param = torch.zeros(padded, dtype=dtype, device=device)
        flat_grad = torch.zeros(padded, dtype=dtype, device=device)
        for param, offset in zip(params, offsets):
            n = param.numel()
            flat_param[offset : offset + n].copy_(param.reshape(-1))
            param.data = flat_param[offset : offset + n].view_as(param)
            grad_view = flat_grad[offset : offset + n].view_as(param)
            if param.grad is not None:
                grad_view.copy_(param.grad)
            param.grad = grad_view
        if self.world_size > 1:
            dist.broadcast(flat_param, src=0)  # every rank starts from rank 0's parameters, as under DDP
        shard = padded // self.world_size
        start = self.rank * shard
        local = flat_param[start : start + shard]
        master = local if dtype == torch.float32 else local.float()
        return FlatBucket(params, offsets, flat_param, flat_grad, master, start)

    def _all_buckets(self) -> list[FlatBucket]:
        return [bucket for buckets in self.buckets for bucket in buckets]

    # ---------------------------------------------------------------------------------------------
    # Step
    # ---------------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any):
        """Reduce-scatter the gradients (averaged), step this rank's slices, all-gather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copy_hyperparameters(self.param_groups, self.local_optimizer.param_groups)
        self._reduce_scatter_gradients()
        self.local_optimizer.step(**kwargs)
        # Some optimizers keep per-group counters; let them show in param_groups.
        copy_hyperparameters(self.local_optimizer.param_groups, self.param_groups)
        self._all_gather_parameters()
        return loss

    @torch.no_grad()
    def _reduce_scatter_gradients(self) -> None:
        pending = []
        for bucket in self._all_buckets():
            self._attach_gradients(bucket)
            if self.world_size > 1:
                # In place: this rank's slice of the flat gradients receives the reduced slice (NCCL's in-place
                # form, output = input + rank * shard), so no shard-sized buffer is held.
                work = dist.reduce_scatter_tensor(
                    bucket.local(bucket.flat_grad), bucket.flat_grad, op=dist.ReduceOp.SUM, async_op=True
                )
                pending.append((bucket, work))
            else:
                pending.append((bucket, None))
        for bucket, work in pending:
            grad = bucket.local(bucket.flat_grad)  # reduced and averaged from here on
            if work is not None:
                work.wait()
                grad.div_(self.world_size)
            bucket.master.grad = grad if grad.dtype == torch.float32 else grad.float()

    @staticmethod
    def _attach_gradients(bucket: FlatBucket) -> None:
        """Bring gradients that left the flat buffer (set to None, or replaced) back into their slices."""
        for index, param in enumerate(bucket.params):
            view = bucket.flat_grad[bucket.param_slice(index)]
            grad = param.grad
            if grad is not None and grad.data_ptr() == view.data_ptr():
                continue
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad.reshape(-1))
            param.grad = view.view_as(param)

    @torch.no_grad()
    def _all_gather_parameters(self) -> None:
        pending = []
        for bucket in self._all_buckets():
            local = bucket.local(bucket.flat_param)
            if bucket.master.data_ptr() != local.data_ptr():
                local.copy_(bucket.master)  # float32 master back into the lower-precision slice
            if self.world_size > 1:
                # In place: the input is this rank's slice of the output.
                pending.append(dist.all_gather_into_tensor(bucket.flat_param, local, async_op=True))
        for work in pending:
            work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradients in place (the parameters' ``.grad`` stay views into them, whatever
        ``set_to_none`` says); parameters outside the buffers are handled as ``Optimizer.zero_grad`` does."""
        flattened = set()
        for bucket in self._all_buckets():
            bucket.flat_grad.zero_()
            self._attach_gradients(bucket)
            flattened.update(id(param) for param in bucket.params)
        for group in self.param_groups:
            for param in group["params"]:
                if id(param) in flattened or param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()

    # ---------------------------------------------------------------------------------------------
    # State dict: the format of optimizer_cls(all params).state_dict()
    # ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The state of all parameters, all-gathered from the slices on every rank (a collective call).

        The format is that of ``optimizer_cls(all params).state_dict()``: parameters numbered in
        ``param_groups`` order, state tensors shaped like their parameters (float32), so it also loads into
        an unsharded optimizer, and vice versa. Per-slice entries that are not per element (AdamW's
        ``step``) are the same on every rank and given to every parameter of the buffer.
        """
        copy_hyperparameters(self.local_optimizer.param_groups, self.param_groups)
        inner_state = self.local_optimizer.state
        state: dict[int, dict[str, Any]] = {}
        param_groups, next_index = [], 0
        for group, buckets in zip(self.param_groups, self.buckets):
            index_of = {id(param): next_index + i for i, param in enumerate(group["params"])}
            for bucket in buckets:
                shard_state = inner_state.get(bucket.master)
                if not shard_state:
                    continue  # not stepped yet: not stepped on any rank
                gathered = {key: self._gather_entry(bucket, value) for key, value in shard_state.items()}
                for index, param in enumerate(bucket.params):
                    state[index_of[id(param)]] = {
                        key: value[bucket.param_slice(index)].view_as(param).clone() if flat else copy.deepcopy(value)
                        for key, (flat, value) in gathered.items()
                    }
            saved = {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
            saved["params"] = list(range(next_index, next_index + len(group["params"])))
            next_index += len(group["params"])
            param_groups.append(saved)
        return {"state": state, "param_groups": param_groups}

    def _gather_entry(self, bucket: FlatBucket, value: Any) -> tuple[bool, Any]:
        """(True, the whole flat tensor) for a per-element entry of a slice, else (False, the entry)."""
        if not (torch.is_tensor(value) and value.shape == bucket.master.shape):
            return False, value
        if self.world_size == 1:
            return True, value
        wire = value.to(bucket.flat_param.device)
        full = torch.empty(bucket.flat_param.numel(), dtype=value.dtype, device=wire.device)
        dist.all_gather_into_tensor(full, wire)
        return True, full.to(value.device)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state dict (from :meth:`state_dict` or an unsharded optimizer); not collective."""
        saved_groups = check_state_dict_groups(state_dict, self.param_groups)
        local_groups, local_state, next_local_index = [], {}, 0
        for number, (saved, group, buckets) in enumerate(zip(saved_groups, self.param_groups, self.buckets)):
            hyperparameters = {key: copy.deepcopy(value) for key, value in saved.items() if key != "params"}
            group.update(hyperparameters)
            saved_index = {id(param): index for param, index in zip(group["params"], saved["params"])}
            local_indices = []
            for bucket in buckets:
                entries = [state_dict["state"].get(saved_index[id(param)]) for param in bucket.params]
                if any(entry is not None for entry in entries):
                    if any(entry is None for entry in entries):
                        raise ValueError(
                            f"param group {number}: the state dict has state for some parameters of a flat buffer "
                            "but not for others; step all of a group's parameters before saving"
                        )
                    local_state[next_local_index] = self._slice_entries(bucket, entries)
                local_indices.append(next_local_index)
                next_local_index += 1
            local_groups.append({**hyperparameters, "params": local_indices})
        # The inner optimizer copies the tensors, casting them to its parameters' devices and dtypes.
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})

    def _slice_entries(self, bucket: FlatBucket, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """This rank's slice of the per-parameter state ``entries`` of a buffer's parameters."""
        keys = list(entries[0])
        if any(list(entry) != keys for entry in entries):
            raise ValueError("the state dict's parameters of one flat buffer have different state entries")
        sliced = {}
        for key in keys:
            values = [entry[key] for entry in entries]
            per_element = all(
                torch.is_tensor(value) and value.shape == param.shape for value, param in zip(values, bucket.params)
            ) and not (key in _SCALAR_STATE_KEYS and all(value.dim() == 0 for value in values))
            if not per_element:
                sliced[key] = copy.deepcopy(values[0])
                continue
            flat = torch.zeros(bucket.flat_param.numel(), dtype=values[0].dtype, device=values[0].device)
            for index, value in enumerate(values):
                flat[bucket.param_slice(index)] = value.reshape(-1).to(flat.device)
            sliced[key] = bucket.local(flat).clone()
        return sliced
