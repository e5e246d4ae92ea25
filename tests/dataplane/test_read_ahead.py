"""The reorder window across an epoch's end (``iter_epoch(e, then=e + 1)``), against real servers:
the next epoch's first batches are made while the trainer takes the last of this one, never more
than ``prefetch_batches`` held in all, adopted without being made again, in the order of an
epoch read on its own; and dropped (their streams ended) when anything but that epoch follows.
(The fixture's servers augment in threads, unseeded; the bytes of a position are the same
whoever makes it where workers are processes: the rehearsals' bit-equal weights.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from training.data.batch import Batch
from training.dataplane.client import DataPlaneClient

PER_EPOCH = 12  # the fixture's 96 samples in batches of 8
WINDOW = 4


def _client(servers: list[str]) -> DataPlaneClient:
    return DataPlaneClient(servers, batch_size=8, seed=7, prefetch_batches=WINDOW, chunk_batches=2)


def _received(client: DataPlaneClient) -> int:
    return sum(client.batches_by_server.values())


def _settled(count: Callable[[], int], timeout_s: float = 10.0) -> int:
    """``count()`` once it has not changed for half a second (the window filled)."""
    deadline = time.monotonic() + timeout_s
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.5:
            return now
    raise AssertionError(f"still changing after {timeout_s}s: {last}")


def _streams() -> list[str]:
    """The stream threads alive (``dataplane-<address>-<slot>``; not the pool's own)."""
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("dataplane-") and t.name != "dataplane-membership"
    ]


def _no_streams_within(timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while _streams() and time.monotonic() < deadline:
        time.sleep(0.05)
    return _streams()


def _read_alone(servers: list[str], epoch: int) -> list[Batch]:
    """``epoch`` as a client of its own reads it, with no epoch before it."""
    with _client(servers) as alone:
        return list(alone.iter_epoch(epoch))


def _same(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.sample_ids, y.sample_ids) and torch.equal(x.labels, y.labels)
        for x, y in zip(a, b, strict=True)
    )


def test_the_window_runs_on_into_the_next_epoch_and_its_batches_are_not_made_twice(
    two_servers: list[str],
) -> None:
    expected = _read_alone(two_servers, 1)

    with _client(two_servers) as client:
        first: list[Batch] = []
        epoch0 = client.iter_epoch(0, then=1)
        for taken in range(1, PER_EPOCH + 1):
            first.append(next(epoch0))
            # Held or asked for: exactly the window past what the trainer took, the next
            # epoch's share included (without reading ahead it stops at this epoch's 12).
            assert _settled(lambda: _received(client)) == taken + WINDOW, taken
        assert next(epoch0, None) is None
        second = list(client.iter_epoch(1))
        # The 4 read ahead were taken over, not asked for again.
        assert _received(client) == 2 * PER_EPOCH
    assert sorted(i for b in first for i in b.sample_ids.tolist()) == list(range(96))
    assert _same(second, expected)
    assert _no_streams_within() == []


def test_a_read_ahead_is_dropped_when_another_epoch_follows_or_the_epoch_is_left(
    two_servers: list[str],
) -> None:
    expected = _read_alone(two_servers, 2)

    with _client(two_servers) as client:
        assert len(list(client.iter_epoch(0, then=1))) == PER_EPOCH
        assert _settled(lambda: _received(client)) == PER_EPOCH + WINDOW
        # Epoch 2 instead of 1: the run read ahead for 1 is closed, epoch 2 comes whole.
        assert _same(list(client.iter_epoch(2)), expected)
        assert _received(client) == 2 * PER_EPOCH + WINDOW
        assert _no_streams_within() == []

        # Left early (a stop, an error): the run reading ahead ends with it.
        before = _received(client)
        partial = client.iter_epoch(3, then=4)
        for _ in range(PER_EPOCH - 2):
            next(partial)
        assert _settled(lambda: _received(client)) == before + PER_EPOCH - 2 + WINDOW
        partial.close()
        assert _no_streams_within() == []

        # A restore drops it too: the state names the epoch to continue.
        assert len(list(client.iter_epoch(5, then=6))) == PER_EPOCH
        client.load_state_dict({**client.state_dict(), "epoch": 2, "consumed": []})
        assert _no_streams_within() == []
        assert _same(list(client.iter_epoch(2)), expected)
