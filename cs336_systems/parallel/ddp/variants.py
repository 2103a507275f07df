"""The DDP variants by name, the names the benchmarks store their results under.

``naive``, ``flat``, ``overlap``, ``bucketed_<N>mb`` (buckets of at most N MiB, e.g. ``bucketed_25mb`` or
``bucketed_0.5mb``) and ``torch_ddp`` (PyTorch's ``DistributedDataParallel``, for comparison).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from torch import nn

from .base import DataParallelModule
from .bucketed import DDPBucketed, check_bucket_size
from .flattened import DDPFlattened
from .naive import DDPNaive
from .overlapped import DDPIndividualParameters

TORCH_DDP = "torch_ddp"
FIXED_VARIANTS = {"naive": DDPNaive, "flat": DDPFlattened, "overlap": DDPIndividualParameters}
DDP_VARIANTS = (*FIXED_VARIANTS, "bucketed_<N>mb", TORCH_DDP)
_BUCKETED = re.compile(r"bucketed_(?P<mb>\d+(?:\.\d*)?(?:e[+-]?\d+)?)mb")


def bucketed(bucket_size_mb: float) -> str:
    """The name of bucketed DDP with buckets of at most ``bucket_size_mb`` MiB: ``bucketed(25) == "bucketed_25mb"``."""
    check_bucket_size(bucket_size_mb)
    return f"bucketed_{bucket_size_mb:g}mb"


def bucket_size_mb(variant: str) -> float | None:
    """The bucket cap a ``bucketed_<N>mb`` name gives (N), None for the other variants' names."""
    match = _BUCKETED.fullmatch(variant)
    return float(match["mb"]) if match else None


def check_variant(variant: str) -> str:
    """``variant`` if it names a DDP variant; else a ``ValueError`` listing the names."""
    if variant in FIXED_VARIANTS or variant == TORCH_DDP or (bucket_size_mb(variant) or 0) > 0:
        return variant
    raise ValueError(f"unknown DDP variant {variant!r}: one of {', '.join(DDP_VARIANTS)} "
                     "(N in MiB, e.g. bucketed_25mb)")


def variant_type(*others: str) -> Callable[[str], str]:
    """An argparse ``type`` that accepts a DDP variant's name or one of ``others`` (names a tool adds)."""

    def parse(name: str) -> str:
        if name in others:
            return name
        try:
            return check_variant(name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{error}" + "".join(f"; or {other}" for other in others)) from None

    return parse


def wrap_ddp(variant: str, module: nn.Module) -> DataParallelModule | nn.parallel.DistributedDataParallel:
    """``module`` inside the DDP wrapper that ``variant`` names (see :data:`DDP_VARIANTS`).

    ``torch_ddp`` wraps it in PyTorch's ``DistributedDataParallel`` on the device of its first parameter.
    """
    check_variant(variant)
    if variant in FIXED_VARIANTS:
        return FIXED_VARIANTS[variant](module)
    if variant == TORCH_DDP:
        device = next(module.parameters()).device
        return nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    return DDPBucketed(module, bucket_size_mb(variant))
