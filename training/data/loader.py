"""The local data path: a torch DataLoader over the same dataset and recipe as the data plane.

The trainer uses it for homogeneous runs (no data servers), so both paths deliver the same
``Batch`` built from the same samples, order and augmentation.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from training.common.names import ENV_LOADER_WORKERS
from training.data.augment import augment_sample, list_unreadable
from training.data.batch import Batch, Unreadable
from training.data.datasets import ImageSource
from training.data.order import epoch_seed, order_for
from training.data.splits import build_split
from training.data.transforms import Transform, build_transform
from training.spec import JobSpec

log = logging.getLogger(__name__)

_Item = tuple[torch.Tensor | Unreadable, int, int]


class AugmentedImages(Dataset[_Item]):
    """``(uint8 [3,S,S] tensor, or why the sample is unreadable; label, sample id)`` per
    index."""

    def __init__(self, source: ImageSource, transform: Transform) -> None:
        self.source = source
        self.transform = transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> _Item:
        image = augment_sample(self.source, index, self.transform)
        if isinstance(image, Unreadable):
            return image, -1, index
        return image, self.source.label(index), index


def collate_batch(items: list[_Item]) -> Batch:
    """Stack the readable items into a ``Batch``; the unreadable ones go to its ``skipped``
    (and the log, by name)."""
    images = [img for img, _, _ in items if isinstance(img, torch.Tensor)]
    kept = [(label, idx) for img, label, idx in items if isinstance(img, torch.Tensor)]
    skipped = tuple(img for img, _, _ in items if isinstance(img, Unreadable))
    if skipped:
        log.warning(
            "batch: skipped %d unreadable sample(s): %s", len(skipped), list_unreadable(skipped)
        )
    return Batch(
        images=torch.stack(images) if images else torch.empty((0, 3, 0, 0), dtype=torch.uint8),
        labels=torch.tensor([label for label, _ in kept], dtype=torch.int64),
        sample_ids=torch.tensor([idx for _, idx in kept], dtype=torch.int64),
        skipped=skipped,
    )


def default_workers(environ: Mapping[str, str] | None = None) -> int:
    """One worker per available core, at most ``HETERO_LOADER_WORKERS`` when it is set: the
    launcher sets it where ``/dev/shm`` cannot hold the batches of that many workers (each
    worker hands its batches to the rank through shared memory)."""
    cores = len(os.sched_getaffinity(0))
    cap = (os.environ if environ is None else environ).get(ENV_LOADER_WORKERS, "").strip()
    return min(cores, int(cap)) if cap else cores


def local_loader(
    job: JobSpec,
    rank: int = 0,
    world_size: int = 1,
    epoch: int = 0,
    *,
    num_workers: int | None = None,
    source: ImageSource | None = None,
) -> DataLoader[Any]:
    """A DataLoader yielding ``Batch`` of ``job.batch_size`` for ``rank``'s share of the epoch:
    positions ``rank, rank + world_size, ...`` of the same (seed, epoch) order the data servers
    use, over the training split (``build_split(job.dataset, "train")``: never a validation
    image) unless ``source`` is given. ``num_workers`` defaults to the cores available, at most
    ``HETERO_LOADER_WORKERS`` (``default_workers``)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    source = source if source is not None else build_split(job.dataset, "train")
    transform = build_transform(job.augmentation, job.dataset.image_size)
    order = order_for(source, job.seed, epoch)
    shard = order[rank::world_size].tolist()
    workers = num_workers if num_workers is not None else default_workers()
    return DataLoader(
        AugmentedImages(source, transform),
        batch_size=job.batch_size,
        sampler=shard,
        num_workers=workers,
        collate_fn=collate_batch,
        # Seeds the workers' augmentation RNGs: the same epoch augments the same way on re-run.
        generator=torch.Generator().manual_seed(epoch_seed(job.seed, epoch) + rank),
        persistent_workers=False,
        pin_memory=False,
    )
