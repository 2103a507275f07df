"""The model sizes of the course's two editions: one table of shapes, each edition's names for them, and what the
weights and optimizer state of a size need in memory.

The shape defines the key: the 2026 handout's ``xl`` (2560 wide, 32 layers) is the 2025 handout's ``2.7B``, so it
has one key, ``2.7B``. A row keeps that canonical key in ``size`` (a row measured once serves both editions) and the
name in the edition a tool ran for in ``size_label``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from cs336_basics.model import MODEL_SIZES

VOCAB_SIZE = 10_000
# Canonical keys in the order every table uses; the 2025 handout's five, then the 2026 handout's 10B (head dim 128).
SHAPES: dict[str, dict[str, int]] = {
    **MODEL_SIZES,
    "10B": dict(d_model=4608, d_ff=12288, num_layers=50, num_heads=36),
}
# A model small enough for a CPU smoke test; no edition's size, accepted in both.
TINY = dict(d_model=64, d_ff=256, num_layers=2, num_heads=4)
SIZES: dict[str, dict[str, int]] = {**SHAPES, "tiny": TINY}

EDITIONS: dict[str, dict[str, str]] = {
    "2025": {"small": "small", "medium": "medium", "large": "large", "xl": "xl", "2.7B": "2.7B"},
    "2026": {"small": "small", "medium": "medium", "large": "large", "xl": "2.7B", "10B": "10B"},
}
"""Each edition's size names -> canonical keys."""
DEFAULT_EDITION = "2026"  # the edition of the course release whose pins we follow

# fp32 bytes a parameter holds on the device: weights; + gradients; + AdamW's two moments.
BYTES_PER_PARAMETER = {"forward": 4, "forward_backward": 8, "train_step": 16}


def edition_names(edition: str) -> list[str]:
    """The size names ``edition`` accepts (``tiny`` too)."""
    return [*EDITIONS[edition], "tiny"]


def canonical_size(name: str, edition: str) -> str:
    """The canonical key of ``edition``'s size ``name`` (``xl`` in 2026 -> ``2.7B``); ValueError for other names."""
    if name == "tiny":
        return name
    if name not in EDITIONS[edition]:
        raise ValueError(f"{name!r} is no model size of the {edition} edition; choose from "
                         f"{', '.join(edition_names(edition))}")
    return EDITIONS[edition][name]


def size_label(size: str, edition: str) -> str | None:
    """``edition``'s name for the canonical ``size`` (``2.7B`` in 2026 -> ``xl``), None if the edition has none."""
    if size == "tiny":
        return size
    return next((name for name, key in EDITIONS[edition].items() if key == size), None)


def edition_sizes(edition: str) -> list[str]:
    """The canonical keys of ``edition``'s table, in its order."""
    return list(EDITIONS[edition].values())


def parameter_count(vocab_size: int, d_model: int, d_ff: int, num_layers: int, **_: Any) -> int:
    """``BasicsTransformerLM`` parameters: embedding and untied LM head, per block 4d² (attention) + 3·d·d_ff
    (SwiGLU) + 2d (two RMSNorm gains), and the final RMSNorm gain."""
    return 2 * vocab_size * d_model + num_layers * (4 * d_model**2 + 3 * d_model * d_ff + 2 * d_model) + d_model


def size_parameters(size: str, vocab_size: int = VOCAB_SIZE) -> int:
    """:func:`parameter_count` of the model of ``size`` (a canonical key)."""
    return parameter_count(vocab_size=vocab_size, **SIZES[size])


def device_memory_bytes(device: torch.device) -> int:
    """All memory of ``device``: the GPU's, or on a CPU the host's physical memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def estimated_oom(size: str, mode: str, device: torch.device) -> dict | None:
    """An out-of-memory row for a step of ``mode`` that cannot fit, made without trying it; None where it might fit.

    The estimate counts only parameters x fp32 bytes per parameter (weights; gradients; AdamW's two moments):
    activations come on top, so a case above it never fits.
    """
    params, per_parameter = size_parameters(size), BYTES_PER_PARAMETER[mode]
    need, have = params * per_parameter, device_memory_bytes(device)
    if need <= have:
        return None
    what = {"forward": "weights", "forward_backward": "weights + gradients",
            "train_step": "weights + gradients + AdamW moments"}[mode]
    reason = (f"{what}: {params / 1e9:.2f}e9 parameters x {per_parameter:g} B = {need / 1e9:.0f} GB "
              f"> {have / 1e9:.0f} GB of device memory, before any activation")
    return {"oom": True, "oom_estimate_gb": need / 1e9, "device_memory_gb": have / 1e9, "oom_reason": reason}
