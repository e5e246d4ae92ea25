"""How busy a data server is, for ``GetInfo`` (``ServerInfo.busy_s``/``uptime_s``), and the
throttle that makes a server stand in for a slower machine in tests and rehearsals.

``PoolLoad`` integrates over time the share of the worker pool in use,
``min(batches in flight, workers) / workers``: its ``busy_s`` grows by at most 1 per second, so
``busy_s / uptime_s`` is the fraction of the pool's capacity used. ``ImageRateThrottle`` is one
virtual pipeline delivering at most R images/s: each batch of n images is done at
``max(now, last done) + n / R``; its ``busy_s`` is the time that pipeline was busy (images
served / R, per second of uptime at most 1).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

Clock = Callable[[], float]

ENV_MAX_IMAGES_PER_S = "HETERO_SERVE_MAX_IMAGES_PER_S"
"""``hetero serve`` reads its ``--max-images-per-s`` from here when the option is not given."""


def check_images_per_s(value: float, name: str = "max_images_per_s") -> float:
    """``value`` as a float when it is a positive, finite rate; else ValueError saying so."""
    rate = float(value)
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(
            f"{name} must be a positive, finite number of images per second, got {value}"
        )
    return rate


class PoolLoad:
    """Thread-safe meter of a pool of ``workers`` (0: counted as 1). A batch is in flight from
    ``track(future)`` (call it right after submitting) until its future is done or cancelled."""

    def __init__(self, workers: int, *, clock: Clock = time.monotonic) -> None:
        self._capacity = max(1, workers)
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy = 0.0
        self._since = clock()

    def _advance(self, now: float) -> None:
        """Count the time since the last change at the share in use then (the lock is held)."""
        if now > self._since:
            self._busy += (
                (now - self._since) * min(self._in_flight, self._capacity) / self._capacity
            )
            self._since = now

    def track(self, future: Future[Any]) -> None:
        with self._lock:
            self._advance(self._clock())
            self._in_flight += 1
        # Called at once when the future is already done (a premade batch): no time counted.
        future.add_done_callback(self._done)

    def _done(self, _future: Future[Any]) -> None:
        with self._lock:
            self._advance(self._clock())
            self._in_flight = max(0, self._in_flight - 1)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def busy_s(self) -> float:
        """Seconds of the pool's capacity used so far (cumulative)."""
        with self._lock:
            self._advance(self._clock())
            return self._busy


class ImageRateThrottle:
    """One shared virtual pipeline that delivers at most ``images_per_s`` images per second
    (thread-safe). ``reserve(n)`` books n images and returns the clock time they are done; the
    caller holds the batch until then. A batch booked and then not sent (its client went away)
    keeps its slot, as a machine that already started on it would."""

    def __init__(self, images_per_s: float, *, clock: Clock = time.monotonic) -> None:
        self.images_per_s = check_images_per_s(images_per_s)
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        # Busy periods before the current one, and the current one: [_period_start, _done_at).
        self._busy_before = 0.0
        self._period_start = now
        self._done_at = now

    def reserve(self, images: int) -> float:
        """Book ``images`` on the pipeline; return the clock time (``clock()``) they are done."""
        with self._lock:
            now = self._clock()
            if now > self._done_at:  # idle since the last batch: a new busy period starts now
                self._busy_before += self._done_at - self._period_start
                self._period_start = self._done_at = now
            self._done_at += max(0, images) / self.images_per_s
            return self._done_at

    def busy_s(self) -> float:
        """Seconds the pipeline has been busy so far (booked time still ahead is not counted)."""
        with self._lock:
            now = self._clock()
            current = min(max(0.0, now - self._period_start), self._done_at - self._period_start)
            return self._busy_before + current
