"""Where the trainer's batches come from: the data plane, a local DataLoader, or memory; and the
data-tier controller beside a data-plane input (``build_autoscaler``).

Each input is a ``BatchStream`` (``training.trainer.stream``: the contract every input keeps).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from training.common.jobrecord import JobRecord
from training.data.batch import Batch, Unreadable
from training.data.loader import local_loader
from training.data.order import epoch_order
from training.data.splits import build_split
from training.dataplane.autoscale import Autoscaler, actuator_from_arg, policy_for
from training.spec import JobSpec
from training.trainer.config import InputKind, TrainerConfig
from training.trainer.remote import DataPlaneBatches
from training.trainer.stream import BatchStream, EndOfData, rank_positions

log = logging.getLogger(__name__)


class SyntheticBatches:
    """Deterministic uint8 batches made in memory: sample ``i`` of the dataset is
    ``pool[i % pool_size]`` with label ``i % num_classes``; epoch order from
    ``training.data.order.epoch_order``. Costs an index and a copy per batch: the loop-overhead
    benchmark and the tests use it to take augmentation out of the picture."""

    def __init__(
        self,
        *,
        num_samples: int,
        num_classes: int,
        image_size: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        epochs: int | None = None,
        pool_size: int = 256,
        pin_memory: bool = False,
    ) -> None:
        """``pin_memory``: make each batch in page-locked memory (for a GPU: no copy into it
        before the transfer, and no fresh pages to fault in for every batch)."""
        self.num_samples = num_samples
        self.num_classes = num_classes
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epochs = epochs
        self.pin_memory = pin_memory
        self.batches_per_epoch, self._positions = rank_positions(
            num_samples, rank, world_size, batch_size
        )
        g = torch.Generator().manual_seed(seed)
        size = min(pool_size, num_samples)
        self._pool = torch.randint(0, 256, (size, 3, image_size, image_size), generator=g).to(
            torch.uint8
        )
        self.epoch = 0
        self._batch = 0
        self._order: torch.Tensor | None = None

    def _sample_ids(self) -> torch.Tensor:
        if self._order is None:
            order = epoch_order(self.seed, self.epoch, self.num_samples)
            self._order = order[self._positions.start : self._positions.stop : self.world_size]
        start = self._batch * self.batch_size
        return self._order[start : start + self.batch_size]

    def next(self) -> Batch:
        if self._batch >= self.batches_per_epoch:
            self.epoch, self._batch, self._order = self.epoch + 1, 0, None
        if self.epochs is not None and self.epoch >= self.epochs:
            raise EndOfData
        ids = self._sample_ids()
        self._batch += 1
        images = torch.empty(
            (len(ids), *self._pool.shape[1:]), dtype=torch.uint8, pin_memory=self.pin_memory
        )
        torch.index_select(self._pool, 0, ids % self._pool.shape[0], out=images)
        return Batch(images=images, labels=ids % self.num_classes, sample_ids=ids)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self._batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._batch, self._order = int(state["epoch"]), int(state["batch"]), None

    def close(self, *, job_done: bool) -> None:
        pass


class LocalBatches:
    """``training.data.local_loader`` epoch after epoch over the training split (augmentation
    on this host)."""

    def __init__(
        self, job: JobSpec, *, rank: int, world_size: int, epochs: int | None = None
    ) -> None:
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.epochs = epochs
        # The training split: with a validation share or folder, never a validation image.
        self._dataset = build_split(job.dataset, "train")
        self.batches_per_epoch, _ = rank_positions(
            len(self._dataset), rank, world_size, job.batch_size
        )
        self.epoch = 0
        self._batch = 0
        self._iter: Iterator[Batch] | None = None

    def _open(self) -> Iterator[Batch]:
        loader = local_loader(
            self.job, self.rank, self.world_size, self.epoch, source=self._dataset
        )
        it: Iterator[Batch] = iter(loader)
        if self._batch:
            # The loader has no start offset: resuming mid-epoch re-makes the skipped batches.
            log.info("resuming epoch %d at batch %d (skipping ahead)", self.epoch, self._batch)
            it = itertools.islice(it, self._batch, None)
        return it

    def next(self) -> Batch:
        """The next batch with a readable sample; the unreadable samples of the batches passed
        over come with it (``Batch.skipped``)."""
        passed: tuple[Unreadable, ...] = ()
        while True:
            if self._batch >= self.batches_per_epoch:
                self.epoch, self._batch, self._iter = self.epoch + 1, 0, None
            if self.epochs is not None and self.epoch >= self.epochs:
                raise EndOfData
            if self._iter is None:
                self._iter = self._open()
            batch = next(self._iter)
            self._batch += 1
            if len(batch):
                return dataclasses.replace(batch, skipped=passed + batch.skipped)
            passed += batch.skipped
            log.warning("epoch %d batch %d: no readable sample, skipped", self.epoch, self._batch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self._batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._batch, self._iter = int(state["epoch"]), int(state["batch"]), None

    def close(self, *, job_done: bool) -> None:
        self._iter = None


def build_stream(
    config: TrainerConfig, *, rank: int, world_size: int, pin_memory: bool = False
) -> BatchStream:
    """The input named by ``config.input`` for this rank (``pin_memory``: synthetic and
    data-plane batches in page-locked memory, for a GPU)."""
    job = config.spec.job
    if config.input.kind is InputKind.SYNTHETIC:
        return SyntheticBatches(
            num_samples=job.dataset.num_samples,
            num_classes=config.model.num_classes,
            image_size=job.dataset.image_size,
            batch_size=config.batch_size,
            seed=config.seed,
            rank=rank,
            world_size=world_size,
            epochs=config.epochs,
            pin_memory=pin_memory,
        )
    if config.input.kind is InputKind.LOCAL:
        return LocalBatches(job, rank=rank, world_size=world_size, epochs=config.epochs)
    return DataPlaneBatches(config, rank=rank, world_size=world_size, pin_memory=pin_memory)


def build_autoscaler(config: TrainerConfig, stream: Any, rank: int) -> Autoscaler | None:
    """The data-tier controller beside the trainer, or None: built on global rank 0 only, for an
    elastic dataprep group, when the launcher names a backend (``--autoscale``). Its decisions
    also go to the job record where the job keeps one (checkpoints in S3)."""
    backend = config.input.autoscale
    if rank != 0 or config.input.kind is not InputKind.DATAPLANE or not backend:
        return None
    policy = policy_for(config.spec)
    if policy is None:
        log.info("--autoscale %s: no dataprep group is elastic; the count stays", backend)
        return None
    group = next(g for g in config.spec.dataprep_groups if g.name == policy.group)
    record = JobRecord(config.checkpoint.s3_uri) if config.checkpoint.s3_uri else None
    return Autoscaler(
        policy,
        actuator_from_arg(backend, group.count, record.leaving if record is not None else None),
        stream.client.pool.server_loads,
        run_dir=config.run_dir,
        start_count=group.count,
        on_decision=None if record is None else lambda d: record.add_decision(d.as_dict()),
    )
