"""Batch sources: what a data server streams. ``AugmentingBatchSource`` augments a dataset in a
pool of worker processes; ``PremadeBatchSource`` hands out the same pre-made pixels (to measure
the transport alone)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
import random
import threading
from concurrent.futures import (
    Executor,
    Future,
    InvalidStateError,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
)
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from training.data.augment import AugmentedSamples, augment_samples
from training.data.datasets import ImageSource
from training.data.order import epoch_order, order_for
from training.data.splits import Split, build_splits
from training.data.transforms import EvalTransform, Transform, TransformSpec, build_transform
from training.dataplane.handoff import PixelArena, Slot, SlotRef, slot_array
from training.dataplane.lifetime import init_worker_lifetime, start_guarded_forkserver
from training.spec import AugmentationSpec, DatasetSpec, Recipe

log = logging.getLogger(__name__)

PART_IMAGES = 32
"""A batch is made in parts of at most this many images, each by one worker and seeded by its
first position (``server.batch_seed``): a server's workers share a big batch (made whole by one
worker, a 256-image batch kept the others idle), and its bytes are the same whatever the
server's worker count."""
DEFAULT_HANDOFF_BYTES = 256 * 1024 * 1024
"""Shared memory for the parts in flight from the workers (sparse: pages are used as written)."""


@dataclass(frozen=True)
class BatchWork:
    """One batch to make: ``indices`` of the ``split``'s source in order, with the recipe, crop
    size and the seed for its random augmentation."""

    indices: tuple[int, ...]
    recipe: TransformSpec
    image_size: int
    rng_seed: int
    split: Split = Split.TRAIN


class BatchSource(Protocol):
    """What a data server serves. ``submit`` must not block for long: it queues the work."""

    num_samples: int
    """Samples of the training split."""
    num_val_samples: int
    """Samples of the validation split (0: none)."""
    num_classes: int
    image_size: int
    default_recipe: TransformSpec
    default_eval_recipe: TransformSpec
    """What a validation request with no recipe gets."""
    workers: int

    def submit(self, work: BatchWork) -> Future[AugmentedSamples]: ...

    def order(self, seed: int, epoch: int) -> torch.Tensor:
        """The training split's order for the epoch (``training.data.order.order_for``)."""
        ...

    def close(self) -> None: ...


def available_cores() -> int:
    """Cores this process may run on (cgroup/affinity aware)."""
    return len(os.sched_getaffinity(0))


# Worker-side memo: each worker process builds the splits and transform once per config (the
# S3 listing, folder scan, timm transform) and reuses them for every later batch.
@functools.cache
def _worker_splits(spec: DatasetSpec) -> tuple[ImageSource, ImageSource | None]:
    return build_splits(spec)


def _worker_source(spec: DatasetSpec, split: Split = Split.TRAIN) -> ImageSource:
    """The ``split``'s source in a worker process (the same ``build_splits`` as the server)."""
    train, val = _worker_splits(spec)
    if split is Split.TRAIN:
        return train
    if val is None:
        raise ValueError("this data server has no validation set")
    return val


@functools.cache
def _worker_transform(recipe: TransformSpec, image_size: int) -> Transform:
    return build_transform(recipe, image_size)


def _augment_in_worker(
    spec: DatasetSpec, work: BatchWork, reseed: bool, slot: SlotRef | None = None
) -> AugmentedSamples:
    """The part ``work`` names; its pixels written into ``slot`` of the server's arena where one
    is given and reachable (then returned without them), else returned whole."""
    if reseed:
        # Worker processes own their RNGs: seeding per batch makes a batch's augmentation the
        # same whichever worker or server makes it.
        random.seed(work.rng_seed)
        np.random.seed(work.rng_seed)  # timm's RandAugment picks its ops with np.random
        torch.manual_seed(work.rng_seed)
    size = work.image_size
    out = slot_array(slot, (len(work.indices), 3, size, size)) if slot is not None else None
    made = augment_samples(
        _worker_source(spec, work.split),
        _worker_transform(work.recipe, size),
        work.indices,
        size,
        out=out,
    )
    if out is None:
        return made
    empty = np.empty((0, 3, size, size), dtype=np.uint8)
    return dataclasses.replace(made, pixels=empty, in_slot=len(made.pixels))


def _through_arena(inner: Future[AugmentedSamples], slot: Slot) -> Future[AugmentedSamples]:
    """The part ``inner`` makes, its pixels a view on ``slot`` (released by its reader through
    ``AugmentedSamples.release``). Cancelling it cancels ``inner``; a part whose reader gave it
    up, or that failed, frees its slot once its worker is done with it."""
    outer: Future[AugmentedSamples] = Future()

    def inner_done(f: Future[AugmentedSamples]) -> None:
        slot.worker_done()
        try:
            if f.cancelled():
                outer.cancel()
            elif (error := f.exception()) is not None:
                outer.set_exception(error)
            elif (made := f.result()).in_slot is None:  # the worker used the pipe
                outer.set_result(made)
            else:
                pixels = slot.view(made.in_slot, made.pixels.shape[1:])  # pixels: [0, 3, S, S]
                outer.set_result(dataclasses.replace(
                    made, pixels=pixels, in_slot=None, release=slot.release
                ))  # fmt: skip
                return
        except InvalidStateError:
            pass  # the reader cancelled it meanwhile
        slot.release()  # nobody reads this slot

    outer.add_done_callback(lambda o: inner.cancel() if o.cancelled() else None)
    inner.add_done_callback(inner_done)
    return outer


def abandon(parts: list[Future[AugmentedSamples]]) -> None:
    """The reader is done with ``parts`` (read or not): cancel those not started, and release
    each one's shared memory once it is made (at once for those made already)."""
    for part in parts:
        part.cancel()
        part.add_done_callback(_release)


def _release(part: Future[AugmentedSamples]) -> None:
    if not part.cancelled() and part.exception() is None:
        release = part.result().release
        if release is not None:
            release()


def _init_worker() -> None:
    # Die with the server, also when it is SIGKILLed (no orphaned workers holding memory).
    init_worker_lifetime()
    # One thread per worker: the pool already has one worker per core.
    torch.set_num_threads(1)


class AugmentingBatchSource:
    """Augments ``dataset`` on CPU in ``workers`` processes (default: one per core): its
    training split, and its validation split (``training.data.splits.build_splits``) for
    validation requests. ``source``/``val_source`` replace the splits in this process (tests);
    worker processes always build theirs from ``dataset``.

    ``processes=False`` runs the same code in threads of this process (small tests, debugging).
    A worker that dies is replaced: the pool is rebuilt and the batch fails (the stream reports
    it and the client retries the range). The workers die with this process, also when it is
    killed (``lifetime``): create the source on a thread that lives as long as the process.
    """

    def __init__(
        self,
        dataset: DatasetSpec,
        *,
        recipe: TransformSpec | Recipe = Recipe.STANDARD,
        eval_recipe: EvalTransform | None = None,
        workers: int = 0,
        processes: bool = True,
        source: ImageSource | None = None,
        val_source: ImageSource | None = None,
        handoff_bytes: int = DEFAULT_HANDOFF_BYTES,
    ) -> None:
        self.dataset = dataset
        self.default_recipe: TransformSpec = (
            AugmentationSpec(preset=Recipe(recipe)) if isinstance(recipe, str) else recipe
        )
        self.default_eval_recipe: TransformSpec = eval_recipe or EvalTransform()
        self.image_size = dataset.image_size
        self.workers = workers if workers > 0 else available_cores()
        self._processes = processes
        # The server process lists the dataset once to learn the splits' sizes; workers list
        # their own.
        if source is None:
            self._source, self._val_source = build_splits(dataset)
        else:
            self._source, self._val_source = source, val_source
        self.num_samples = len(self._source)
        self.num_val_samples = len(self._val_source) if self._val_source is not None else 0
        self.num_classes = self._source.num_classes
        self._lock = threading.Lock()
        # Workers hand their pixels over in shared memory (training.dataplane.handoff): slots of
        # one part at the dataset's image size, as many as ``handoff_bytes`` holds.
        part_bytes = PART_IMAGES * 3 * self.image_size**2
        self._arena = (
            PixelArena(part_bytes, max(1, handoff_bytes // part_bytes))
            if processes and handoff_bytes > 0
            else None
        )
        self._executor = self._new_executor()

    def _new_executor(self) -> Executor:
        if not self._processes:
            return ThreadPoolExecutor(self.workers, thread_name_prefix="augment")
        # forkserver: the server process runs gRPC threads, which fork() must not copy.
        ctx = multiprocessing.get_context("forkserver")
        start_guarded_forkserver()
        return ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker)

    def submit(self, work: BatchWork) -> Future[AugmentedSamples]:
        with self._lock:
            try:
                if self._processes:
                    return self._submit_to_worker(work)
                split_source = self._source if work.split is Split.TRAIN else self._val_source
                if split_source is None:
                    raise ValueError("this data server has no validation set")
                return self._executor.submit(
                    augment_samples,
                    split_source,
                    _worker_transform(work.recipe, work.image_size),
                    work.indices,
                    work.image_size,
                )
            except BrokenProcessPool:
                log.error("an augmentation worker died; starting a new pool")
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = self._new_executor()
                raise

    def _submit_to_worker(self, work: BatchWork) -> Future[AugmentedSamples]:
        nbytes = len(work.indices) * 3 * work.image_size**2
        slot = self._arena.lend(nbytes) if self._arena is not None else None
        if slot is None:  # no arena, none free, or another size: through the pipe
            return self._executor.submit(_augment_in_worker, self.dataset, work, True)
        try:
            inner = self._executor.submit(_augment_in_worker, self.dataset, work, True, slot.ref)
        except BaseException:
            slot.worker_done()
            slot.release()
            raise
        return _through_arena(inner, slot)

    def order(self, seed: int, epoch: int) -> torch.Tensor:
        return order_for(self._source, seed, epoch)

    def warm_up(self) -> None:
        """Start every worker and build its dataset and transform now, not on the first request."""
        n = min(self.num_samples, 1)
        work = BatchWork(tuple(range(n)), self.default_recipe, self.image_size, 0)
        for f in [self.submit(work) for _ in range(self.workers)]:
            f.result()

    def close(self) -> None:
        with self._lock:
            self._executor.shutdown(wait=True, cancel_futures=True)
            if self._arena is not None:
                self._arena.close()


class PremadeBatchSource:
    """Serves the same random pixels for every batch: the transport without the augmentation."""

    def __init__(
        self,
        num_samples: int,
        *,
        image_size: int = 224,
        max_batch: int = 32,
        num_classes: int = 1000,
    ) -> None:
        self.num_samples = num_samples
        self.num_val_samples = 0
        self.num_classes = num_classes
        self.image_size = image_size
        self.default_recipe: TransformSpec = AugmentationSpec()
        self.default_eval_recipe: TransformSpec = EvalTransform()
        self.workers = 0
        rng = np.random.default_rng(0)
        self._pixels = rng.integers(0, 256, (max_batch, 3, image_size, image_size), dtype=np.uint8)

    def submit(self, work: BatchWork) -> Future[AugmentedSamples]:
        n = len(work.indices)
        if n > len(self._pixels) or work.image_size != self.image_size:
            raise ValueError(
                f"premade batches are at most {len(self._pixels)} x {self.image_size}px"
            )
        ids = np.asarray(work.indices, dtype=np.int64)
        future: Future[AugmentedSamples] = Future()
        future.set_result(AugmentedSamples(self._pixels[:n], ids % self.num_classes, ids, []))
        return future

    def order(self, seed: int, epoch: int) -> torch.Tensor:
        return epoch_order(seed, epoch, self.num_samples)

    def close(self) -> None:
        pass
