"""A data server's memory budget: a bound on the batch bytes in flight across all its streams.

Each stream charges a batch's bytes before it asks a worker for the batch and gives them back once
gRPC has let go of the encoded message (when the stream's next message replaces it, or the stream
ends), so many streams (or slow clients) make streams wait instead of making the server grow
until the host kills it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

MB = 1024 * 1024
# Default budget: a share of the host's (or container's) memory, never below a floor that holds a
# few full-size batches. The rest is for the workers' own memory, gRPC and the page cache.
DEFAULT_HOST_SHARE = 0.25
MIN_DEFAULT_BYTES = 256 * MB
# cgroup v2, then v1: a container's limit is the memory this server really has.
_CGROUP_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


class ByteBudget:
    """Up to ``limit`` bytes, shared by threads: ``acquire`` blocks while the bytes in use plus
    the request would exceed the limit, except that a request is always admitted when nothing is
    in use (so a batch bigger than the whole budget still makes progress, one at a time).

    Waiters are served in arrival order, and a request does not overtake a waiting one (even with
    ``timeout=0``): a stream that keeps streaming cannot starve a stream that is waiting.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a byte budget needs a positive limit, got {limit}")
        self.limit = limit
        self._used = 0
        self._cond = threading.Condition()
        self._waiting: collections.deque[object] = collections.deque()

    @property
    def used(self) -> int:
        """Bytes acquired and not yet released."""
        with self._cond:
            return self._used

    def _fits(self, nbytes: int) -> bool:
        return self._used == 0 or self._used + nbytes <= self.limit

    def acquire(self, nbytes: int, timeout: float | None = None) -> bool:
        """Take ``nbytes`` from the budget, waiting at most ``timeout`` seconds (None: as long as
        it takes; 0: not at all). Returns True when taken, False when the time ran out."""
        if nbytes < 0:
            raise ValueError(f"cannot acquire a negative number of bytes ({nbytes})")
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._cond:
            if not self._waiting and self._fits(nbytes):
                self._used += nbytes
                return True
            if deadline is not None and deadline <= time.monotonic():
                return False
            ticket = object()
            self._waiting.append(ticket)
            try:
                while not (self._waiting[0] is ticket and self._fits(nbytes)):
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cond.wait(remaining)
                self._used += nbytes
                return True
            finally:
                self._waiting.remove(ticket)
                # The next in line may fit now (it was waiting behind this one, not for bytes).
                self._cond.notify_all()

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken by ``acquire``; wakes the waiters that now fit."""
        with self._cond:
            if nbytes < 0 or nbytes > self._used:
                raise ValueError(f"cannot release {nbytes} bytes: {self._used} in use")
            self._used -= nbytes
            self._cond.notify_all()


def host_memory_bytes() -> int:
    """The memory this process may use: the host's RAM, or the container's cgroup limit when that
    is lower."""
    total = int(psutil.virtual_memory().total)
    for path in _CGROUP_LIMIT_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (cgroup v2) means no limit
            total = min(total, int(text))
        break
    return total


def default_memory_budget_bytes() -> int:
    """The budget a data server uses when none is configured: ``DEFAULT_HOST_SHARE`` of
    ``host_memory_bytes()``, at least ``MIN_DEFAULT_BYTES``."""
    return max(MIN_DEFAULT_BYTES, int(host_memory_bytes() * DEFAULT_HOST_SHARE))
