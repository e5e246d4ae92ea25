"""The trainer's validation batches: every validation sample exactly once per pass, each rank
its own contiguous block, made with timm's eval transform (``[job.eval]``: resize, centre crop
with ``crop_pct``; no randomness).

- ``DATAPLANE``: a second ``DataPlaneClient`` over the same data servers (``split="val"``:
  position ``i`` is validation sample ``i``), made once and kept for the trainer's life; each
  pass rewinds it and streams the rank's block again.
- ``LOCAL``: a DataLoader over ``build_split(job.dataset, "val")``, sequential, a few workers.
- ``SYNTHETIC``: no images, nothing to evaluate (``ValueError``).

Ranks' blocks can differ in size by one sample and so in batch count by one: every rank must
run ``batches_per_rank`` forward passes (the caller pads with empty batches) so that FSDP's
collectives line up. A batch whose samples were all unreadable is yielded empty, never
dropped, so the counts stay the same on every rank. ``Batch.sample_ids`` are indices into the
validation split (``training.data.splits``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from training.data.batch import Batch
from training.data.loader import AugmentedImages, collate_batch
from training.data.splits import NO_VALIDATION, build_split
from training.data.transforms import EvalTransform, build_transform, encode_recipe
from training.dataplane.discovery import parse_discovery
from training.trainer.config import InputKind, TrainerConfig
from training.trainer.remote import dataplane_client

if TYPE_CHECKING:
    from training.dataplane.client import DataPlaneClient

log = logging.getLogger(__name__)

# The trainer's host is busy training: the local eval loader decodes on at most this many
# worker processes.
LOCAL_EVAL_WORKERS = 2


def eval_shard(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s block ``[start, stop)`` of ``n`` validation positions: the blocks of ranks
    ``0 .. world_size - 1`` cover ``[0, n)`` exactly once, in order, their sizes differing by at
    most one (the first ``n % world_size`` ranks take one more); empty when ``n < world_size``
    leaves a rank none."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank {rank} of {world_size}")
    if n < 0:
        raise ValueError(f"n must be 0 or more, got {n}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ValidationBatches:
    """This rank's validation batches, pass after pass (``iter_batches``)."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        rank: int,
        world_size: int,
        num_workers: int | None = None,
        eval_transform: EvalTransform | None = None,
    ) -> None:
        """``eval_transform``: the trainer's resolved one (``training.trainer.data_config``;
        default: the spec's ``[job.eval]`` values)."""
        job = config.spec.job
        if config.input.kind is InputKind.SYNTHETIC:
            raise ValueError(
                "synthetic input has no images to evaluate: validation needs a dataset "
                "(drop --synthetic-data)"
            )
        if not job.dataset.has_validation:
            raise ValueError(NO_VALIDATION)
        self.kind = config.input.kind
        self.rank = rank
        self.world_size = world_size
        self.batch_size = job.eval.batch_size or config.batch_size
        self.recipe = eval_transform or EvalTransform.from_spec(job.eval)
        self.image_size = job.dataset.image_size
        self._client: DataPlaneClient | None = None
        if self.kind is InputKind.LOCAL:
            self._source = build_split(job.dataset, "val")
            self.num_samples = len(self._source)
            self._transform = build_transform(self.recipe, self.image_size)
            cores = len(os.sched_getaffinity(0))
            self._workers = (
                num_workers if num_workers is not None else min(LOCAL_EVAL_WORKERS, cores)
            )
        else:
            self._client = dataplane_client(
                config, parse_discovery(config.input.data_servers, config.spec),
                recipe=encode_recipe(self.recipe), batch_size=self.batch_size, split="val",
            )  # fmt: skip
            try:
                # Waits (at most wait_for_data_s) for a server that has the validation set.
                self.num_samples = self._client.num_samples
            except BaseException:
                self._client.close()
                raise
        self.block = eval_shard(self.num_samples, rank, world_size)
        if self._client is not None and self.block[1] > self.block[0]:
            self._client.share = self.block
        self.batches_per_rank = math.ceil(
            math.ceil(self.num_samples / world_size) / self.batch_size
        )
        """The most batches any rank gets per pass (the first ranks' blocks are the biggest)."""
        log.info(
            "validation (%s): %d samples, rank %d takes [%d, %d) in batches of %d "
            "(%d per rank at most)",
            self.kind, self.num_samples, rank, *self.block, self.batch_size,
            self.batches_per_rank,
        )  # fmt: skip

    @property
    def batches(self) -> int:
        """This rank's batch count per pass (``<= batches_per_rank``)."""
        return math.ceil((self.block[1] - self.block[0]) / self.batch_size)

    def set_interrupt(self, check: Callable[[], bool]) -> None:
        """While waiting for data servers, ``check()`` True ends the wait with
        ``training.dataplane.client.DataWaitInterrupted``."""
        if self._client is not None:
            self._client.interrupt = check

    def iter_batches(self) -> Iterator[Batch]:
        """One pass: this rank's block in position order, each sample exactly once (``batches``
        batches, unreadable samples left out, an all-unreadable batch yielded empty)."""
        start, stop = self.block
        if stop <= start:
            return
        if self._client is not None:
            self._client.rewind()
            yield from self._client.iter_epoch(0)
            return
        loader: DataLoader[Any] = DataLoader(
            AugmentedImages(self._source, self._transform),
            batch_size=self.batch_size,
            sampler=range(start, stop),
            num_workers=self._workers,
            collate_fn=collate_batch,
            persistent_workers=False,
            pin_memory=False,
        )
        yield from loader

    def close(self) -> None:
        """Close the data plane client's streams and channels (the servers keep running)."""
        if self._client is not None:
            self._client.close()
