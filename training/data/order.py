"""The order of an epoch: position -> dataset index, identical on every process that asks."""

from __future__ import annotations

from collections.abc import Sequence

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


def shard_epoch_order(
    seed: int, epoch: int, shard_counts: Sequence[int], window: int
) -> torch.Tensor:
    """The epoch's permutation of a sharded split (shard ``k`` holds the ``shard_counts[k]``
    samples after shard ``k - 1``'s): a seeded order of the shards, then, for each run of
    ``window`` shards in that order, a seeded order of all their samples. Deterministic in
    (seed, epoch, shard_counts, window).

    What it does to shuffle quality: a sample's neighbours in the epoch come from the
    ``window`` shards of its run, not from the whole dataset, so prep must spread classes over
    the shards (``hetero dataset prep`` shuffles before it shards); a batch then mixes up to
    ``window`` random shards, and the run order changes every epoch. What it buys: the
    positions of a run read only its ``window`` shards, so a data server serving a range reads
    a few whole shards, not one object per sample."""
    counts = [int(c) for c in shard_counts]
    if not counts or min(counts) < 1:
        raise ValueError(f"shard_counts must be a non-empty list of counts >= 1, got {counts[:5]}")
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    shards = torch.randperm(len(counts), generator=generator).tolist()
    parts = []
    for w in range(0, len(shards), window):
        run = torch.cat(
            [torch.arange(starts[k], starts[k] + counts[k]) for k in shards[w : w + window]]
        )
        parts.append(run[torch.randperm(run.numel(), generator=generator)])
    return torch.cat(parts)


def order_for(source: object, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's order of ``source``: shard-aware for a sharded source (one with a
    ``shard_layout()`` of (shard counts, window)), else ``epoch_order``. Every process that
    orders the same source asks this, so they agree."""
    layout = getattr(source, "shard_layout", None)
    if callable(layout):
        counts, window = layout()
        return shard_epoch_order(seed, epoch, counts, window)
    return epoch_order(seed, epoch, len(source))  # type: ignore[arg-type]
