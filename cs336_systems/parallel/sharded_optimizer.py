"""Optimizer-state sharding: each rank keeps optimizer state for its own parameters only.

Every rank holds all parameters and all (already averaged) gradients, as in plain data parallelism.
The parameters are split among the ranks; a rank's inner optimizer steps only the ones it owns, so the
optimizer state (for AdamW, two tensors per parameter) is divided by the world size. After the local
step, each owner broadcasts its updated parameters so that every rank again holds all of them.
Compared with ZeRO stage 1, which reduce-scatters gradients and all-gathers parameters, this keeps
the DDP all-reduce of full gradients and adds one broadcast of every parameter per step.

Only broadcast is used (gloo supports it on CPU and CUDA tensors, NCCL on GPUs); tensors travel on the
device of their parameter. It needs an initialised default process group, as the DDP wrappers do (one rank
is a group of one: ``cs336_systems.parallel.distributed.one_rank_group``).
ZeRO stage 1 itself, on flat buffers, is :class:`~cs336_systems.parallel.zero1.FlatShardedOptimizer`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from cs336_systems.parallel.distributed import broadcast_in_place, require_process_group


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def fill_in_defaults(outer: Optimizer, inner: Optimizer) -> None:
    """Copy ``inner``'s default hyper-parameters into ``outer``'s defaults and groups that did not set them
    (group g of a wrapping optimizer is group g of its inner one)."""
    for key, value in inner.defaults.items():
        outer.defaults.setdefault(key, value)
    for group, local_group in zip(outer.param_groups, inner.param_groups):
        for key, value in local_group.items():
            if key != "params":
                group.setdefault(key, value)


def copy_hyperparameters(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Copy every hyper-parameter (all but ``params``) of each source group onto the matching target group."""
    for source_group, target_group in zip(source, target):
        for key, value in source_group.items():
            if key != "params":
                target_group[key] = value


def rank_and_world_size(optimizer_cls: type[Optimizer], who: str) -> tuple[int, int]:
    """This process's rank and the world size, once ``optimizer_cls`` is checked to be an optimizer class and the
    default process group to be initialised (what ``who`` needs)."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
        raise TypeError(f"optimizer_cls must be an optimizer class such as torch.optim.AdamW, got {optimizer_cls!r}")
    require_process_group(who)
    return dist.get_rank(), dist.get_world_size()


def check_state_dict_groups(state_dict: dict[str, Any], param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The state dict's param groups, once checked to match ``param_groups`` in number and sizes."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"state dict has {len(saved_groups)} param groups, optimizer has {len(param_groups)}")
    for number, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param group {number}: state dict has {len(saved['params'])} parameters, "
                f"optimizer has {len(group['params'])}"
            )
    return saved_groups


class ShardedOptimizer(Optimizer):
    """Wraps ``optimizer_cls`` so that each rank holds the optimizer state of a share of the parameters.

    ``params`` are tensors or param-group dicts (with their own hyper-parameters), as for any optimizer;
    ``kwargs`` are the defaults passed to ``optimizer_cls``. Parameters are assigned to ranks greedily,
    largest first, each to the rank holding the fewest bytes so far (ties to the lowest rank): the same
    answer on every rank, since every rank sees the same parameters. With more ranks than parameters
    some ranks own nothing; they still take part in every broadcast.

    ``param_groups`` lists all parameters, with every hyper-parameter filled in; changes made to it (by
    a learning-rate schedule, say) reach the inner optimizer at the next :meth:`step`.
    :meth:`add_param_group`, :meth:`step` and :meth:`state_dict` are collective or must be called
    identically on every rank.
    """

    def __init__(
        self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], optimizer_cls: type[Optimizer], **kwargs: Any
    ):
        self.rank, self.world_size = rank_and_world_size(optimizer_cls, type(self).__name__)
        self.optimizer_cls = optimizer_cls
        self.local_optimizer: Optimizer | None = None
        self.owners: list[list[int]] = []  # owners[g][i]: the rank that steps param_groups[g]["params"][i]
        self._bytes_per_rank = [0] * self.world_size
        self._local_groups: list[dict[str, Any]] = []  # collected while the base constructor adds groups
        super().__init__(params, defaults=dict(kwargs))
        # One inner group per outer group, possibly with no parameters, so group g here is group g there.
        self.local_optimizer = optimizer_cls(self._local_groups, **kwargs)
        self._fill_in_defaults()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its parameters are assigned to ranks and this rank's share joins its inner optimizer."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        owners = self._assign_owners(group["params"])
        self.owners.append(owners)
        local_group = {key: value for key, value in group.items() if key != "params"}
        local_group["params"] = [param for param, owner in zip(group["params"], owners) if owner == self.rank]
        if self.local_optimizer is None:
            self._local_groups.append(local_group)
        else:
            self.local_optimizer.add_param_group(local_group)
            self._fill_in_defaults()

    def _assign_owners(self, params: list[torch.Tensor]) -> list[int]:
        owners = [0] * len(params)
        largest_first = sorted(range(len(params)), key=lambda i: (-_nbytes(params[i]), i))
        for index in largest_first:
            owner = min(range(self.world_size), key=lambda rank: (self._bytes_per_rank[rank], rank))
            owners[index] = owner
            self._bytes_per_rank[owner] += _nbytes(params[index])
        return owners

    def _fill_in_defaults(self) -> None:
        fill_in_defaults(self, self.local_optimizer)

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any):
        """Step the parameters this rank owns, then broadcast every parameter from its owner."""
        copy_hyperparameters(self.param_groups, self.local_optimizer.param_groups)
        loss = self.local_optimizer.step(closure, **kwargs)
        # Some optimizers keep per-group counters; let them show in param_groups.
        copy_hyperparameters(self.local_optimizer.param_groups, self.param_groups)
        if self.world_size > 1:
            self._broadcast_parameters()
        return loss

    def _broadcast_parameters(self) -> None:
        broadcast_in_place(
            (param, owner)
            for group, owners in zip(self.param_groups, self.owners)
            for param, owner in zip(group["params"], owners)
        )

    def state_dict(self) -> dict[str, Any]:
        """The state of all parameters, gathered from their owners on every rank (a collective call).

        The format is that of ``optimizer_cls(all params).state_dict()``: parameters numbered in
        ``param_groups`` order, so it also loads into an unsharded optimizer, and vice versa.
        """
        copy_hyperparameters(self.local_optimizer.param_groups, self.param_groups)
        indexed = []  # (index in the state dict, parameter, owner), in param_groups order
        for group, owners in zip(self.param_groups, self.owners):
            for param, owner in zip(group["params"], owners):
                indexed.append((len(indexed), param, owner))
        local_state = self.local_optimizer.state
        # What each owner holds: for every state entry, either ("tensor", shape, dtype, device type) or
        # ("value", the value itself). Tensors then travel by broadcast on their parameter's device.
        layout = {}
        for index, param, owner in indexed:
            if owner == self.rank and param in local_state:
                layout[index] = {
                    key: ("tensor", tuple(value.shape), value.dtype, value.device.type)
                    if torch.is_tensor(value)
                    else ("value", value)
                    for key, value in local_state[param].items()
                }
        layouts = self._every_rank(layout)

        state: dict[int, dict[str, Any]] = {}
        for index, param, owner in indexed:
            if index not in layouts[owner]:
                continue
            entries = {}
            for key, description in layouts[owner][index].items():
                if description[0] == "value":
                    entries[key] = copy.deepcopy(description[1])
                    continue
                _, shape, dtype, device_type = description
                if owner == self.rank:
                    tensor = local_state[param][key]
                    if self.world_size > 1:
                        broadcast_in_place([(tensor.to(param.device), owner)])
                else:
                    tensor = torch.empty(shape, dtype=dtype, device=param.device)
                    broadcast_in_place([(tensor, owner)])
                    if device_type != param.device.type:
                        tensor = tensor.to(device_type)
                entries[key] = tensor
            state[index] = entries

        param_groups = []
        next_index = 0
        for group in self.param_groups:
            saved = {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
            saved["params"] = list(range(next_index, next_index + len(group["params"])))
            next_index += len(group["params"])
            param_groups.append(saved)
        return {"state": state, "param_groups": param_groups}

    def _every_rank(self, obj: Any) -> list[Any]:
        """Each rank's ``obj``, in rank order (one broadcast from each rank)."""
        if self.world_size == 1:
            return [obj]
        gathered = []
        for src in range(self.world_size):
            message = [obj if src == self.rank else None]
            dist.broadcast_object_list(message, src=src)
            gathered.append(message[0])
        return gathered

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state dict (from :meth:`state_dict` or an unsharded optimizer); not collective."""
        saved_groups = check_state_dict_groups(state_dict, self.param_groups)
        local_groups, local_state, next_local_index = [], {}, 0
        for saved, group, owners in zip(saved_groups, self.param_groups, self.owners):
            hyperparameters = {key: copy.deepcopy(value) for key, value in saved.items() if key != "params"}
            group.update(hyperparameters)
            local_indices = []
            for saved_index, owner in zip(saved["params"], owners):
                if owner != self.rank:
                    continue
                if saved_index in state_dict["state"]:
                    local_state[next_local_index] = state_dict["state"][saved_index]
                local_indices.append(next_local_index)
                next_local_index += 1
            local_groups.append({**hyperparameters, "params": local_indices})
        # The inner optimizer copies the tensors, casting them to its parameters' devices and dtypes.
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
