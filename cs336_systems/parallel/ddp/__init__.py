"""Data-parallel training wrappers, from naive to bucketed (SPEC section 4).

All share one interface, so a benchmark can swap them: ``wrapper(module, ...)``, ``.module``,
``forward``, ``no_sync()`` and ``finish_gradient_synchronization()`` after backward.

* :class:`DDPNaive`: one blocking all-reduce per gradient, after backward;
* :class:`DDPFlattened`: one blocking all-reduce over all gradients, flattened;
* :class:`DDPIndividualParameters`: one async all-reduce per gradient, launched during backward;
* :class:`DDPBucketed`: one async all-reduce per bucket of at most ``bucket_size_mb`` MiB.

``python -m cs336_systems.parallel.ddp.toy_training`` checks each against single-process training.
"""

from torch import nn

from .base import DataParallelModule, broadcast_module_state
from .bucketed import DDPBucketed
from .flattened import DDPFlattened
from .naive import DDPNaive
from .overlapped import DDPIndividualParameters

DDP_VARIANTS = ("naive", "flattened", "overlapped", "bucketed")


def wrap_ddp(variant: str, module: nn.Module, bucket_size_mb: float | None = None) -> DataParallelModule:
    """Wrap ``module`` in the DDP variant named ``variant`` (one of :data:`DDP_VARIANTS`)."""
    if variant == "naive":
        return DDPNaive(module)
    if variant == "flattened":
        return DDPFlattened(module)
    if variant == "overlapped":
        return DDPIndividualParameters(module)
    if variant == "bucketed":
        if bucket_size_mb is None:
            raise ValueError("the bucketed variant needs bucket_size_mb")
        return DDPBucketed(module, bucket_size_mb)
    raise ValueError(f"unknown DDP variant {variant!r}; choose from {DDP_VARIANTS}")

__all__ = [
    "DDP_VARIANTS",
    "DDPBucketed",
    "DDPFlattened",
    "DDPIndividualParameters",
    "DDPNaive",
    "DataParallelModule",
    "broadcast_module_state",
    "wrap_ddp",
]
