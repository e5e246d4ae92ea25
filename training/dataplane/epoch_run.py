"""One epoch in flight between the data servers and a trainer rank (``EpochRun``): the planned
batches, the ranges not yet handed out, the batches received ahead of the trainer (never beyond
the reorder window) and one thread per stream. ``training.dataplane.client`` plans the epochs and
keeps the checkpointable position; this module moves the batches.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from training.data.splits import Split
from training.dataplane.membership import ServerPool
from training.dataplane.rpc import SERVICE_NAME
from training.dataplane.v1 import dataplane_pb2
from training.dataplane.wire import ReceivedBatch, decode_batch

log = logging.getLogger(__name__)

# Codes that mean "this request is wrong", not "this server is unwell": retrying cannot help.
_FATAL_CODES = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
)
# How often a trainer waiting for data says so.
WAIT_LOG_EVERY_S = 5.0


class DataPlaneError(RuntimeError):
    """The data plane cannot deliver the epoch (bad request, or no server left)."""


class DataPlaneUnavailable(DataPlaneError):
    """No data server delivered in time; the message lists each address and its last error."""


class DataWaitInterrupted(DataPlaneError):
    """``interrupt()`` said to stop while the trainer waited for its next batch (a stop was
    requested); the batch was not consumed."""


class _ServerProblem(Exception):
    """A stream went wrong in a way that says the server is unwell (not the request)."""


def _describe_rpc_error(e: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    if isinstance(e, grpc.Call):
        return e.code(), f"{e.code().name}: {e.details()}"
    return None, str(e)


class RunSettings(Protocol):
    """What a run takes from its client (``training.dataplane.client.DataPlaneClient``): the
    servers, the request's fields and the window."""

    @property
    def pool(self) -> ServerPool: ...

    seed: int
    batch_size: int
    recipe: str
    image_size: int
    split: Split
    prefetch_batches: int
    chunk_batches: int
    streams_per_server: int
    rpc_timeout_s: float
    wait_for_data_s: float
    pin_memory: bool
    batches_by_server: collections.Counter[str]
    interrupt: Callable[[], bool] | None


def stream_batches(channel: grpc.Channel) -> grpc.UnaryStreamMultiCallable:
    """StreamBatches yielding ``ReceivedBatch``: the generated stub's, except that the images
    stay a view on the received bytes (``wire.decode_batch``) instead of two copies."""
    return channel.unary_stream(
        f"/{SERVICE_NAME}/StreamBatches",
        request_serializer=dataplane_pb2.StreamBatchesRequest.SerializeToString,
        response_deserializer=decode_batch,
    )


class EpochRun:
    """One epoch in flight: the planned batches, the ranges not yet handed out, the batches
    received ahead of the trainer (never beyond the reorder window) and one thread per stream
    (``streams_per_server`` per serving server)."""

    def __init__(
        self,
        client: RunSettings,
        epoch: int,
        batches: list[tuple[int, int]],
        after: EpochRun | None = None,
    ) -> None:
        self.client = client
        self.pool = client.pool  # started on first use
        self.epoch = epoch
        self.batches = batches
        self.pending: list[tuple[int, int]] = self._ranges()
        """Ranges of batch indices [i, j) not handed out, sorted."""
        self.received: dict[int, ReceivedBatch] = {}
        self.next = 0
        """Index of the batch the trainer gets next."""
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.threads: dict[tuple[str, int], threading.Thread] = {}
        self.calls: dict[tuple[str, int], grpc.Call] = {}
        self.after = after
        """The epoch the trainer takes before this one (a run read ahead): its batches still to
        be taken count against the same reorder window."""
        self.follower: EpochRun | None = None
        """The run reading ahead after this one, woken as the trainer takes batches."""

    def _backlog(self) -> int:
        """Batches of the epoch before this one that the trainer has yet to take (read without
        its lock: a stale count only delays a range by one wake-up)."""
        before = self.after
        return 0 if before is None else max(0, len(before.batches) - before.next)

    def _ranges(self) -> list[tuple[int, int]]:
        """Up to ``chunk_batches`` consecutive batches per range, never across a gap."""
        out: list[tuple[int, int]] = []
        i, n, chunk = 0, len(self.batches), self.client.chunk_batches
        while i < n:
            j = i + 1
            while j < n and j - i < chunk and self.batches[j][0] == self.batches[j - 1][1]:
                j += 1
            out.append((i, j))
            i = j
        return out

    # ---- streams ---------------------------------------------------------------------------

    def start(self) -> None:
        self.pool.subscribe(self._on_admitted)
        for address in self.pool.serving():
            self._on_admitted(address)

    def _on_admitted(self, address: str) -> None:
        """Open this server's streams (those not already running)."""
        with self.cond:
            if self.stop.is_set() or self.next >= len(self.batches):
                return
            for slot in range(self.client.streams_per_server):
                key = (address, slot)
                if key in self.threads:
                    continue
                thread = threading.Thread(
                    target=self._stream_loop,
                    args=(key,),
                    name=f"dataplane-{address}-{slot}",
                    daemon=True,
                )
                self.threads[key] = thread
                thread.start()

    def _forget(self, key: tuple[str, int]) -> None:
        """The stream thread is about to exit (lock held): a readmission starts a new one."""
        if self.threads.get(key) is threading.current_thread():
            del self.threads[key]

    def _take(self, key: tuple[str, int]) -> tuple[int, int] | None:
        """The next range for this stream, within the reorder window; None: the stream ends
        (epoch done, run stopped, or its server is no longer serving)."""
        window = self.client.prefetch_batches
        with self.cond:
            while True:
                if (
                    self.stop.is_set()
                    or self.error is not None
                    or self.next >= len(self.batches)
                    or not self.pool.is_serving(key[0])
                ):
                    self._forget(key)
                    return None
                if self.pending:
                    i, j = self.pending[0]
                    limit = self.next + window - self._backlog()
                    if i < limit:
                        cut = min(j, limit)
                        if cut < j:
                            self.pending[0] = (cut, j)
                        else:
                            self.pending.pop(0)
                        return i, cut
                self.cond.wait(0.5)

    def _give_back(self, i: int, j: int) -> None:
        """Batches [i, j) were not received: back to the pending ranges (lock held)."""
        if j > i:
            bisect.insort(self.pending, (i, j))
            self.cond.notify_all()

    def _stream_loop(self, key: tuple[str, int]) -> None:
        address, slot = key
        c = self.client
        try:
            while True:
                taken = self._take(key)
                if taken is None:
                    return
                i, j = taken
                k = i
                try:
                    channel = self.pool.channel(address, slot)
                    if channel is None:
                        raise _ServerProblem("no longer listed")
                    request = dataplane_pb2.StreamBatchesRequest(
                        seed=c.seed,
                        epoch=self.epoch,
                        start=self.batches[i][0],
                        stop=self.batches[j - 1][1],
                        batch_size=c.batch_size,
                        recipe=c.recipe,
                        image_size=c.image_size,
                        split="" if c.split is Split.TRAIN else c.split.value,
                    )
                    call = stream_batches(channel)(request, timeout=c.rpc_timeout_s)
                    with self.cond:
                        self.calls[key] = call
                    if self.stop.is_set():
                        call.cancel()
                    for received in call:
                        got = (received.position_start, received.position_stop)
                        if k >= j or got != self.batches[k]:
                            expected = self.batches[k] if k < j else "the end of the range"
                            raise _ServerProblem(f"sent positions {got}, expected {expected}")
                        if c.pin_memory:
                            received = received.pinned()
                        with self.cond:
                            self.received[k] = received
                            self.client.batches_by_server[address] += 1
                            k += 1
                            self.cond.notify_all()
                    if k < j:
                        raise _ServerProblem(
                            f"ended range [{self.batches[i][0]}, {self.batches[j - 1][1]}) "
                            f"at batch {k - i} of {j - i}"
                        )
                    self.pool.report_progress(address)
                except (grpc.RpcError, _ServerProblem) as e:
                    if isinstance(e, grpc.RpcError):
                        code, problem = _describe_rpc_error(e)
                    else:
                        code, problem = None, str(e)
                    with self.cond:
                        self._give_back(k, j)
                        if self.stop.is_set():
                            self._forget(key)
                            return
                        if code in _FATAL_CODES:
                            self.error = DataPlaneError(
                                f"data server {address} refused a request: {problem}"
                            )
                            self.cond.notify_all()
                            self._forget(key)
                            return
                        self._forget(key)
                    if k > i:
                        self.pool.report_progress(address)
                    self.pool.report_failure(address, problem)
                    return
                finally:
                    with self.cond:
                        self.calls.pop(key, None)
        except BaseException as e:  # unexpected: surface it to the trainer, never die silently
            with self.cond:
                if self.error is None:
                    self.error = e
                self._forget(key)
                self.cond.notify_all()

    # ---- the trainer's side ----------------------------------------------------------------

    def next_batch(self) -> ReceivedBatch:
        """The next batch in the planned order; waits (at most ``wait_for_data_s``) while no
        server delivers it, logging every few seconds."""
        c = self.client
        started = last_log = time.monotonic()
        with self.cond:
            while True:
                if self.error is not None:
                    raise self.error
                received = self.received.pop(self.next, None)
                if received is not None:
                    self.next += 1
                    self.cond.notify_all()  # the window moved: streams may take more
                    follower = self.follower
                    if follower is not None:  # its share of the window grew too
                        with follower.cond:
                            follower.cond.notify_all()
                    return received
                if c.interrupt is not None and c.interrupt():
                    raise DataWaitInterrupted(
                        f"stopped while waiting for position {self.batches[self.next][0]} "
                        f"of epoch {self.epoch}"
                    )
                now = time.monotonic()
                waited = now - started
                position = self.batches[self.next][0]
                if waited >= c.wait_for_data_s:
                    raise DataPlaneUnavailable(
                        f"no batch for position {position} of epoch {self.epoch} after "
                        f"{waited:.0f}s (job.dataplane.wait_for_data_s); data servers "
                        f"({self.pool.discovery.describe()}):\n{self.pool.describe_errors()}"
                    )
                if now - last_log >= WAIT_LOG_EVERY_S:
                    last_log = now
                    log.warning(
                        "waiting %.0fs for data (position %d of epoch %d); %d data server(s) "
                        "serving:\n%s",
                        waited,
                        position,
                        self.epoch,
                        len(self.pool.serving()),
                        self.pool.describe_errors(),
                    )
                self.cond.wait(0.5)

    def close(self) -> None:
        self.pool.unsubscribe(self._on_admitted)
        with self.cond:
            self.stop.set()
            calls = list(self.calls.values())
            threads = list(self.threads.values())
            self.cond.notify_all()
        for call in calls:
            call.cancel()
        for thread in threads:
            thread.join(timeout=10)
