"""Data-parallel training wrappers, from naive to bucketed.

All share one interface, so a benchmark can swap them: ``wrapper(module, ...)``, ``.module``,
``forward``, ``no_sync()`` and ``finish_gradient_synchronization()`` after backward.

* :class:`DDPNaive`: one blocking all-reduce per gradient, after backward;
* :class:`DDPFlattened`: one blocking all-reduce over all gradients, flattened;
* :class:`DDPIndividualParameters`: one async all-reduce per gradient, launched during backward;
* :class:`DDPBucketed`: one async all-reduce per bucket of at most ``bucket_size_mb`` MiB.

:func:`wrap_ddp` picks one by the name the benchmarks use: ``naive``, ``flat``, ``overlap``, ``bucketed_<N>mb``
(and ``torch_ddp``, PyTorch's own).

``python -m cs336_systems.bench.naive_ddp`` checks each against single-process training.
"""

from cs336_systems.parallel.distributed import broadcast_module_state

from .base import DataParallelModule
from .bucketed import DDPBucketed
from .flattened import DDPFlattened
from .naive import DDPNaive
from .overlapped import DDPIndividualParameters
from .variants import DDP_VARIANTS, bucket_size_mb, bucketed, check_variant, variant_type, wrap_ddp

__all__ = [
    "DDP_VARIANTS",
    "DDPBucketed",
    "DDPFlattened",
    "DDPIndividualParameters",
    "DDPNaive",
    "DataParallelModule",
    "broadcast_module_state",
    "bucket_size_mb",
    "bucketed",
    "check_variant",
    "variant_type",
    "wrap_ddp",
]
