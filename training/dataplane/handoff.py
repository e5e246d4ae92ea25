"""Pixels from an augmentation worker to its data server through shared memory, not the pool's
pipe: the worker writes a batch part straight into a slot of the server's arena, and returns
only where it is.

Through the pipe, each part was pickled, copied through the kernel in 64 KiB pieces (a switch to
the server for each) and unpickled, before the encode copied it once more: 0.35 ms per 224 px
image of the server process's CPU, 11 % of the whole (docs/dataplane.md, "Per core"). With the
arena, the server's only copy of the pixels is the encode's.

The arena is one ``memfd`` (anonymous shared memory: no ``/dev/shm`` file, so neither Docker's
64 MB ``/dev/shm`` nor a SIGKILLed server leaves anything behind; the kernel frees it with the
last process that maps it), cut into equal slots of one part of the dataset's image size. A
worker opens it once through ``/proc/<server pid>/fd/<fd>``. A slot is free again only when both
its worker is done with it (the part's future finished, cancelled or failed) and its reader has
released it, so a stream that ends early never frees a slot a worker still writes. A part that
finds no free slot, or has another size, comes through the pipe as before.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotRef:
    """Where a worker writes one part: the arena (its server's pid and fd) and the slot."""

    pid: int
    fd: int
    offset: int
    nbytes: int


class Slot:
    """One slot lent to one part: free again once its worker is done and its reader released
    it (each at most once)."""

    def __init__(self, arena: PixelArena, index: int) -> None:
        self._arena = arena
        self.index = index
        self._lock = threading.Lock()
        self._worker_done = self._released = self._freed = False

    @property
    def ref(self) -> SlotRef:
        a = self._arena
        return SlotRef(os.getpid(), a.fd, self.index * a.slot_bytes, a.slot_bytes)

    def view(self, count: int, shape: tuple[int, ...]) -> np.ndarray:
        """The part's ``count`` images of ``shape``, read-only, in place (valid until
        ``release``)."""
        a = self._arena
        flat = np.frombuffer(
            a.buffer, np.uint8, count * math.prod(shape), self.index * a.slot_bytes
        )
        flat.flags.writeable = False
        return flat.reshape(count, *shape)

    def worker_done(self) -> None:
        self._settle(worker=True)

    def release(self) -> None:
        self._settle(worker=False)

    def _settle(self, *, worker: bool) -> None:
        with self._lock:
            if worker:
                self._worker_done = True
            else:
                self._released = True
            free = self._worker_done and self._released and not self._freed
            self._freed |= free  # later calls free nothing
        if free:
            self._arena.give_back(self.index)


class PixelArena:
    """``slots`` slots of ``slot_bytes`` in one memfd of this process."""

    def __init__(self, slot_bytes: int, slots: int) -> None:
        if slot_bytes <= 0 or slots <= 0:
            raise ValueError(f"an arena needs slots of some size, got {slots} x {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.fd = os.memfd_create("hetero-pixels", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, slot_bytes * slots)
        self.buffer = mmap.mmap(self.fd, slot_bytes * slots)
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    def lend(self, nbytes: int) -> Slot | None:
        """A free slot for ``nbytes``, or None (too big for a slot, or none free)."""
        if nbytes > self.slot_bytes:
            return None
        with self._lock:
            if not self._free:
                return None
            return Slot(self, self._free.pop())

    def give_back(self, index: int) -> None:
        with self._lock:
            self._free.append(index)

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        """Unmap and close the arena, unless a reader still holds a view on it (then the memory
        goes with the last view)."""
        try:
            self.buffer.close()
        except BufferError:
            return
        os.close(self.fd)


def watch_worker(slot: Slot, future: Future[object]) -> None:
    """Mark ``slot``'s worker done when ``future`` finishes, is cancelled or fails."""
    future.add_done_callback(lambda _: slot.worker_done())


@functools.lru_cache(maxsize=4)
def _attached(pid: int, fd: int) -> mmap.mmap:
    """The server's arena mapped into this worker (once per arena)."""
    with open(f"/proc/{pid}/fd/{fd}", "r+b") as f:
        return mmap.mmap(f.fileno(), 0)


def slot_array(ref: SlotRef, shape: tuple[int, ...]) -> np.ndarray | None:
    """The slot as a writable uint8 array of ``shape`` in the worker, or None where the arena
    cannot be opened (the part then goes through the pipe)."""
    try:
        buffer = _attached(ref.pid, ref.fd)
    except OSError as e:
        log.warning("pixel arena of process %d not reachable (%s): using the pipe", ref.pid, e)
        return None
    return np.ndarray(shape, np.uint8, buffer, ref.offset)
