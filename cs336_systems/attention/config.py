"""Which FlashAttention kernels run, as explicit configuration: a frozen :class:`FlashConfig`, set for the process
or for a block. The operator (``op.py``) resolves the choice it implies once per (device, dtype, head dim, shape
class) and caches it.

    from cs336_systems.attention.config import FLASH_CONFIG
    with FLASH_CONFIG.use(kernels="triton"):      # the portable kernels only, e.g. to compare
        ...
    FLASH_CONFIG.set(FlashConfig.from_environment())   # command-line tools: CS336_FLASH_KERNELS, CS336_FLASH_AUTOTUNE

The library never reads the environment; the command-line tools that time our attention
(``bench.flash_benchmarking``, ``bench.leaderboard``, ``scripts/flash_shapes_bench.py``) build their configuration
from it, so that a variant can be chosen per process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from cs336_systems.kernels.launch import CurrentConfig

KERNEL_FAMILIES = ("auto", "hopper", "triton")
FP32_PRODUCTS = ("ieee", "tf32x3")


@dataclass(frozen=True)
class FlashConfig:
    """How our attention operator chooses and launches its kernels.

    ``kernels``: "auto" runs the Gluon kernels (``backends/hopper.py``) on Hopper GPUs (compute capability 9.x) for
    float16/bfloat16 inputs with at least ``hopper_min_programs`` programs, else the portable Triton kernels;
    "hopper" runs them wherever they can run and raises where they cannot; "triton" never runs them.
    ``autotune``: the Triton kernels' tiles picked by ``triton.autotune`` per (coarsened lengths, head dim, causal,
    dtype), tens of seconds per new length bucket, instead of the fixed tiles per dtype and head dim (float32 calls
    that split their sweeps over more programs keep the fixed tiles).
    ``hopper_min_programs``: counted as ``batch * heads`` times the tiles of 128 queries (forward) or keys
    (backward) (``hopper.programs``): the backward's programs, the tiles the persistent forward's programs share.
    From one head of 4,096 (32 programs) up the Hopper kernels are at least as fast as the Triton kernels; below,
    both are bound by their launches (optimisation log: hopper-from-32-programs).
    ``fp32_products``: how the Triton kernels multiply float32 inputs where PyTorch does not allow TF32 (where it
    does, they use TF32 as PyTorch's matmuls do): "ieee" on the FMA units, or "tf32x3" on the tensor cores, each
    operand split into a TF32 high part and a TF32 remainder and the product summed from three TF32 products (the
    remainders' product dropped), which stays close to float32's rounding at about a third of TF32's rate. The
    default is "tf32x3": the IEEE path's error against float64, 2-4x faster (optimisation log:
    fp32-tf32x3-products).
    """

    kernels: str = "auto"
    autotune: bool = False
    hopper_min_programs: int = 32
    fp32_products: str = "tf32x3"

    def __post_init__(self):
        if self.kernels not in KERNEL_FAMILIES:
            raise ValueError(f"FlashConfig.kernels must be one of {', '.join(KERNEL_FAMILIES)}, not {self.kernels!r}")
        if self.fp32_products not in FP32_PRODUCTS:
            raise ValueError(f"FlashConfig.fp32_products must be one of {', '.join(FP32_PRODUCTS)}, "
                             f"not {self.fp32_products!r}")
        if self.hopper_min_programs < 1:
            raise ValueError(f"FlashConfig.hopper_min_programs must be >= 1, not {self.hopper_min_programs}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> FlashConfig:
        """``CS336_FLASH_KERNELS`` (auto, hopper, triton), ``CS336_FLASH_AUTOTUNE`` (1 to autotune) and
        ``CS336_FLASH_FP32`` (ieee, tf32x3), for command-line tools."""
        return cls(kernels=environ.get("CS336_FLASH_KERNELS", "auto"),
                   autotune=environ.get("CS336_FLASH_AUTOTUNE", "0") == "1",
                   fp32_products=environ.get("CS336_FLASH_FP32", "tf32x3"))


FLASH_CONFIG: CurrentConfig[FlashConfig] = CurrentConfig(FlashConfig())
"""The configuration our attention runs with (``.get()``, ``.set()``, ``with .use(...)``)."""
