"""The order of an epoch: position -> dataset index, identical on every process that asks."""

from __future__ import annotations

import numpy as np
import torch


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed derived from (seed, epoch), well mixed so neighbouring epochs differ."""
    state = np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, epoch]).generate_state(1, np.uint64)
    return int(state[0]) & 0x7FFFFFFFFFFFFFFF


def epoch_order(seed: int, epoch: int, num_samples: int) -> torch.Tensor:
    """The permutation of ``range(num_samples)`` for this epoch (int64); position i of the epoch
    is dataset sample ``order[i]``. Deterministic in (seed, epoch, num_samples)."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def batch_seed(seed: int, epoch: int, position: int) -> int:
    """Seed for the random augmentation of the batch that starts at ``position``: the same batch
    is augmented the same way whichever data server makes it."""
    state = np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, epoch, position])
    return int(state.generate_state(1, np.uint32)[0])
