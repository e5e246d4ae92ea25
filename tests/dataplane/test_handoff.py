"""Pixels from the augmentation workers through shared memory (training/dataplane/handoff.py):
a slot is lent to one part and free again only when its worker is done and its reader released
it; the bytes are those the pipe carries; a part that finds no slot takes the pipe."""

from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np
import pytest

from training.data.augment import AugmentedSamples
from training.dataplane.handoff import PixelArena
from training.dataplane.sources import AugmentingBatchSource, BatchWork, abandon
from training.spec import AugmentationSpec, DatasetSpec, Recipe

DATASET = DatasetSpec(num_samples=96, num_classes=10, image_size=32)
PART = 32 * 3 * 32 * 32  # one part of 32 images of 32 px


def work(start: int, n: int = 32) -> BatchWork:
    return BatchWork(
        tuple(range(start, start + n)), AugmentationSpec(preset=Recipe.STANDARD), 32, start
    )


def wait_until(check: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_slot_is_free_again_only_when_its_worker_and_its_reader_are_both_done() -> None:
    arena = PixelArena(PART, 2)
    try:
        a, b = arena.lend(PART), arena.lend(100)
        assert a is not None and b is not None and {a.index, b.index} == {0, 1}
        assert arena.lend(PART) is None  # both lent
        a.release()
        assert arena.free_slots == 0  # its worker may still write
        a.worker_done()
        assert arena.free_slots == 1
        b.worker_done()
        b.release()
        b.release()  # twice: freed once
        b.worker_done()
        assert arena.free_slots == 2
        assert arena.lend(PART + 1) is None  # bigger than a slot: the pipe
    finally:
        arena.close()


def test_a_view_reads_what_was_written_in_its_slot() -> None:
    arena = PixelArena(PART, 2)
    try:
        slot = arena.lend(PART)
        assert slot is not None
        ref = slot.ref
        data = np.arange(ref.nbytes, dtype=np.uint64).astype(np.uint8)
        arena.buffer[ref.offset : ref.offset + ref.nbytes] = data.tobytes()
        view = slot.view(32, (3, 32, 32))
        assert view.shape == (32, 3, 32, 32) and not view.flags.writeable
        assert np.array_equal(view.reshape(-1), data)
        del view
    finally:
        arena.close()


@pytest.fixture
def sources() -> object:
    """The same dataset served through shared memory and through the pipe, one worker each."""
    shared = AugmentingBatchSource(DATASET, workers=1)
    piped = AugmentingBatchSource(DATASET, workers=1, handoff_bytes=0)
    try:
        yield shared, piped
    finally:
        shared.close()
        piped.close()


def test_parts_through_shared_memory_are_the_bytes_the_pipe_carries(sources: object) -> None:
    shared, piped = sources  # type: ignore[misc]
    arena = shared._arena
    assert arena is not None and piped._arena is None
    slots = arena.free_slots
    for start in (0, 32, 64):
        got: AugmentedSamples = shared.submit(work(start)).result(timeout=60)
        expected: AugmentedSamples = piped.submit(work(start)).result(timeout=60)
        assert got.release is not None and expected.release is None
        assert arena.free_slots == slots - 1  # lent until released
        assert np.array_equal(got.pixels, expected.pixels)
        assert np.array_equal(got.sample_ids, expected.sample_ids)
        assert np.array_equal(got.labels, expected.labels)
        got.release()
        assert arena.free_slots == slots


def test_abandoned_parts_give_their_slots_back_made_or_not(sources: object) -> None:
    shared, _ = sources  # type: ignore[misc]
    arena = shared._arena
    slots = arena.free_slots
    parts: list[Future[AugmentedSamples]] = [shared.submit(work(s % 96)) for s in range(0, 320, 32)]
    parts[0].result(timeout=60)  # one made, the rest queued or running
    abandon(parts)
    wait_until(lambda: arena.free_slots == slots)
    assert all(p.done() for p in parts)


def test_a_part_that_finds_no_free_slot_takes_the_pipe() -> None:
    source = AugmentingBatchSource(DATASET, workers=1, handoff_bytes=PART)  # one slot
    try:
        first, second = source.submit(work(0)), source.submit(work(32))
        a, b = first.result(timeout=60), second.result(timeout=60)
        assert a.release is not None and b.release is None  # the second went through the pipe
        assert a.pixels.shape == b.pixels.shape == (32, 3, 32, 32)
        a.release()
        third = source.submit(work(64)).result(timeout=60)
        assert third.release is not None  # the slot is lent again
        third.release()
    finally:
        source.close()
