"""Random language-modelling batches from a token array."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
from jaxtyping import Int
from torch import Tensor


def get_batch(
    dataset: npt.NDArray, batch_size: int, context_length: int, device: str | torch.device = "cpu"
) -> tuple[Int[Tensor, "batch context"], Int[Tensor, "batch context"]]:
    """Sample ``batch_size`` windows of ``context_length`` tokens and the same windows shifted by one."""
    if len(dataset) <= context_length:
        raise ValueError(f"dataset of {len(dataset)} tokens is too short for context_length {context_length}")
    starts = np.random.randint(0, len(dataset) - context_length, size=batch_size)
    windows = np.stack([dataset[s : s + context_length + 1] for s in starts]).astype(np.int64)
    batch = torch.from_numpy(windows).to(device)
    return batch[:, :-1], batch[:, 1:]
