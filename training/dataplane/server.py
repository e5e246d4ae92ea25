"""The data server: streams augmented batches over gRPC (``training.dataplane.v1.DataPlane``).

``create_server(source)`` builds and starts a server on a port (0: any free one) and returns
``(server, port)``; ``serve(...)`` is the process entry point used by ``hetero serve``.
"""

from __future__ import annotations

import collections
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn, TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from training.data.augment import AugmentedSamples, list_unreadable
from training.data.order import batch_seed
from training.data.splits import Split, parse_split
from training.data.transforms import EvalTransform, decode_recipe, encode_recipe
from training.dataplane.budget import MB, ByteBudget, default_memory_budget_bytes
from training.dataplane.load import ImageRateThrottle, PoolLoad, check_images_per_s
from training.dataplane.rpc import MAX_MESSAGE_BYTES, SERVICE_NAME, channel_options
from training.dataplane.sources import (
    PART_IMAGES,
    AugmentingBatchSource,
    BatchSource,
    BatchWork,
    abandon,
)
from training.dataplane.v1 import dataplane_pb2
from training.dataplane.wire import encode_batch
from training.spec import ClusterSpec, Recipe

log = logging.getLogger(__name__)

# Room in a message for everything but the pixels (shape, labels, ids, framing).
_HEADER_BYTES_PER_SAMPLE = 32
_HEADER_BYTES = 1024
DEFAULT_GRACE_S = 5.0
# A Shutdown RPC may give running streams up to an hour; more is a mistake, not a plan.
MAX_GRACE_S = 3600.0
# What one batch costs the memory budget, in multiples of its pixel bytes (N x 3 x S x S). At most
# three copies of a batch's size are alive for it at once: the worker's result unpickled in this
# process (briefly next to its pickled bytes), then the encoded message and gRPC's copy of it;
# the previous message of the stream, which gRPC keeps until the client's flow control lets it
# go, is the third while the result is gone. (Measured: with clients that stop reading, gRPC
# holds about one sent message per stream.)
BATCH_MEMORY_FACTOR = 3
# How often a waiting stream (for the memory budget, for a worker) checks that its client is
# still there.
_POLL_S = 0.25

# A batch under way in a stream: its positions [start, stop), its charge to the memory budget,
# the workers' futures (one per part, in order), and when the throttle lets it go (None: no
# throttle).
_Pending = tuple[int, int, int, list[futures.Future[AugmentedSamples]], float | None]

_Request = TypeVar("_Request", bound=Message)


@dataclass(frozen=True)
class UndecodableRequest:
    """A request body that is not a valid ``message_type`` (what the deserializer returns instead
    of raising, so the handler can answer INVALID_ARGUMENT rather than gRPC's INTERNAL)."""

    message_type: str
    error: str


def _lenient_deserializer(
    message_type: type[_Request],
) -> Callable[[bytes], _Request | UndecodableRequest]:
    """``message_type.FromString`` that returns an ``UndecodableRequest`` for bytes that do not
    parse, instead of raising."""

    def deserialize(data: bytes) -> _Request | UndecodableRequest:
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return UndecodableRequest(message_type.DESCRIPTOR.name, str(e))

    return deserialize


def _refuse_undecodable(request: UndecodableRequest, context: grpc.ServicerContext) -> NoReturn:
    """Abort the RPC with INVALID_ARGUMENT: its request did not parse."""
    problem = f"request is not a valid {request.message_type}: {request.error}"
    log.warning("refused a request from %s: %s", context.peer(), problem)
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)


def batch_memory_bytes(batch_size: int, image_size: int) -> int:
    """What a batch of ``batch_size`` images of ``image_size`` px costs the server's memory
    budget while it is in flight."""
    return BATCH_MEMORY_FACTOR * batch_size * 3 * image_size * image_size


class DataPlaneServicer:
    """Serves one ``BatchSource``; ``on_shutdown(grace_s)`` is called by the Shutdown RPC.

    ``memory_budget`` bounds the batch bytes in flight across all streams (``batch_memory_bytes``
    per batch): a stream that does not fit waits, up to ``batch_timeout_s``, for others to send.

    ``max_images_per_s`` (tests, rehearsals: a stand-in for a slower machine) makes the server as
    a whole deliver at most that many images per second (``load.ImageRateThrottle``); its load
    (``GetInfo``'s ``busy_s``) is then the throttle's busy time rather than the worker pool's.
    """

    def __init__(
        self,
        source: BatchSource,
        on_shutdown: Callable[[float], None],
        *,
        memory_budget: ByteBudget,
        inflight_batches: int | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        batch_timeout_s: float = 120.0,
        max_images_per_s: float | None = None,
    ) -> None:
        self._throttle = (
            ImageRateThrottle(max_images_per_s) if max_images_per_s is not None else None
        )
        self._started = time.monotonic()
        self._pool_load = PoolLoad(source.workers)
        self._active_streams = 0
        self._streams_lock = threading.Lock()
        self._source = source
        self._on_shutdown = on_shutdown
        self._budget = memory_budget
        # Bounded work per stream: enough to keep every worker busy, no more (backpressure: a
        # slow client stops the server's work for it, through gRPC flow control and this bound).
        self._inflight = inflight_batches or max(2, 2 * max(1, source.workers))
        self._max_message_bytes = max_message_bytes
        self._batch_timeout_s = batch_timeout_s
        self._orders: collections.OrderedDict[tuple[int, int], torch.Tensor] = (
            collections.OrderedDict()
        )
        self._orders_lock = threading.Lock()

    # ---- helpers -------------------------------------------------------------------------

    def _order(self, seed: int, epoch: int) -> torch.Tensor:
        """The epoch's permutation, cached for the few epochs in use (it is reused per range)."""
        key = (seed, epoch)
        with self._orders_lock:
            if key in self._orders:
                self._orders.move_to_end(key)
                return self._orders[key]
        order = self._source.order(seed, epoch)
        with self._orders_lock:
            self._orders[key] = order
            while len(self._orders) > 4:
                self._orders.popitem(last=False)
        return order

    def max_batch_size(self, image_size: int) -> int:
        per_image = 3 * image_size * image_size + _HEADER_BYTES_PER_SAMPLE
        return max(0, (self._max_message_bytes - _HEADER_BYTES) // per_image)

    def validate(self, request: dataplane_pb2.StreamBatchesRequest) -> str | None:
        """Why the request cannot be served, or None when it can."""
        try:
            split = parse_split(request.split)
        except ValueError as e:
            return str(e)
        if request.batch_size < 1:
            return "batch_size must be at least 1"
        if request.stop <= request.start:
            return (
                f"empty range: stop ({request.stop}) must be greater than start ({request.start})"
            )
        if split is Split.VAL:
            n = self._source.num_val_samples
            if n == 0:
                return (
                    "this data server has no validation set: its spec sets neither "
                    "job.dataset.val_path nor job.dataset.val_fraction (start the data servers "
                    "with the trainer's spec)"
                )
            if request.stop > n:
                return f"stop ({request.stop}) is beyond the validation set: it has {n} samples"
        elif request.stop > self._source.num_samples:
            return (
                f"stop ({request.stop}) is beyond the epoch: the dataset has "
                f"{self._source.num_samples} samples"
            )
        if request.recipe:
            try:
                decode_recipe(request.recipe)
            except ValueError as e:
                return f"recipe: {e}"
        size = request.image_size or self._source.image_size
        if not 16 <= size <= 1024:
            return f"image_size must be between 16 and 1024, got {size}"
        limit = self.max_batch_size(size)
        if request.batch_size > limit:
            return (
                f"batch_size {request.batch_size} at {size}px exceeds the "
                f"{self._max_message_bytes} byte message limit; use at most {limit}"
            )
        return None

    def _wait_for_budget(self, nbytes: int, context: grpc.ServicerContext) -> bool:
        """Take ``nbytes`` from the memory budget, waiting while other streams hold it. Returns
        False when the client went away meanwhile; aborts the RPC (RESOURCE_EXHAUSTED) when the
        budget stays full for ``batch_timeout_s``."""
        deadline = time.monotonic() + self._batch_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if self._budget.acquire(nbytes, timeout=max(0.0, min(_POLL_S, remaining))):
                return True
            if not context.is_active():
                return False
            if remaining <= 0:
                problem = (
                    f"the server's memory budget ({self._budget.limit // MB} MB) stayed full "
                    f"for {self._batch_timeout_s:g}s; retry later or on another server"
                )
                log.warning("StreamBatches from %s: %s", context.peer(), problem)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, problem)

    def _encode_next(
        self,
        pending: collections.deque[_Pending],
        context: grpc.ServicerContext,
    ) -> tuple[bytes, int] | None:
        """Wait for the oldest pending batch and encode it; returns the message and the bytes it
        holds of the memory budget, or None when the client went away meanwhile. (A function of
        its own so that the worker's result is freed when it returns: only the message stays
        alive while gRPC sends it.) With a throttle, the batch also waits for its time."""
        start, stop, charge, parts, ready_at = pending.popleft()
        try:
            return self._encode(start, stop, charge, parts, ready_at, context)
        finally:
            abandon(parts)  # encoded (or given up): the workers' shared memory is free again

    def _encode(
        self,
        start: int,
        stop: int,
        charge: int,
        parts: list[futures.Future[AugmentedSamples]],
        ready_at: float | None,
        context: grpc.ServicerContext,
    ) -> tuple[bytes, int] | None:
        deadline = time.monotonic() + self._batch_timeout_s
        # Waits in short steps: a stream whose client is gone stops at once (its ``finally``
        # cancels the batches queued for it) instead of when this batch is done.
        while futures.wait(parts, timeout=_POLL_S).not_done:
            if not context.is_active():
                return None
            if time.monotonic() > deadline:
                problem = f"batch [{start}, {stop}) took more than {self._batch_timeout_s:g}s"
                log.error("%s", problem)
                context.abort(grpc.StatusCode.INTERNAL, problem)
        try:
            made = [part.result(timeout=0) for part in parts]
        except futures.CancelledError:
            # The source was closed under this stream: the server is stopping.
            context.abort(grpc.StatusCode.UNAVAILABLE, "the data server is stopping")
        except Exception as e:
            log.exception("batch [%d, %d) failed", start, stop)
            context.abort(grpc.StatusCode.INTERNAL, f"batch [{start}, {stop}) failed: {e}")
        if ready_at is not None:
            # The throttle's time for this batch, in the same short steps.
            while (left := ready_at - time.monotonic()) > 0:
                if not context.is_active():
                    return None
                time.sleep(min(_POLL_S, left))
        skipped = [u for part in made for u in part.skipped]
        if skipped:
            log.warning(
                "batch [%d, %d): skipped %d unreadable sample(s): %s",
                start, stop, len(skipped), list_unreadable(skipped),
            )  # fmt: skip
        return encode_batch(made, start, stop), charge

    # ---- RPCs ----------------------------------------------------------------------------

    def StreamBatches(
        self,
        request: dataplane_pb2.StreamBatchesRequest | UndecodableRequest,
        context: grpc.ServicerContext,
    ) -> Iterator[bytes]:
        """``_stream_batches``, counted in ``active_streams`` while it runs."""
        with self._streams_lock:
            self._active_streams += 1
        try:
            yield from self._stream_batches(request, context)
        finally:
            with self._streams_lock:
                self._active_streams -= 1

    def _stream_batches(
        self,
        request: dataplane_pb2.StreamBatchesRequest | UndecodableRequest,
        context: grpc.ServicerContext,
    ) -> Iterator[bytes]:
        """Yields encoded ``Batch`` messages (``wire.encode_batch``: the pixels copied once).

        Each batch is charged to the memory budget before a worker is asked for it. Once gRPC
        has taken the message, its charge stays with the stream (gRPC may hold the message until
        the client's flow control lets it go) until the next message replaces it or the stream
        ends; the stream's next batch takes that charge over instead of asking for more. A
        stream only waits for the budget when it has nothing under way (else it sends what it
        has first), so it never waits on bytes it holds itself."""
        if isinstance(request, UndecodableRequest):
            _refuse_undecodable(request, context)
        problem = self.validate(request)
        if problem is not None:
            log.warning("refused StreamBatches from %s: %s", context.peer(), problem)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        split = parse_split(request.split)
        if request.recipe:
            recipe = decode_recipe(request.recipe)
        elif split is Split.VAL:
            recipe = self._source.default_eval_recipe
        else:
            recipe = self._source.default_recipe
        size = request.image_size or self._source.image_size
        # Training: the epoch's permutation. Validation: identity order (position i is
        # validation sample i), whatever the seed and epoch.
        order = self._order(request.seed, request.epoch) if split is Split.TRAIN else None
        pending: collections.deque[_Pending] = collections.deque()
        held = 0  # bytes of the memory budget this stream holds, of which
        retained = 0  # for the last message gRPC took
        position = request.start
        try:
            while position < request.stop or pending:
                while position < request.stop and len(pending) < self._inflight:
                    end = min(position + request.batch_size, request.stop)
                    charge = batch_memory_bytes(end - position, size)
                    if pending:
                        if not self._budget.acquire(charge, timeout=0):
                            break  # send what is under way first
                        held += charge
                    elif retained >= charge:
                        # The last message's charge carries over: this batch's covers both.
                        charge, retained = retained, 0
                    else:
                        if retained:  # a bigger batch than the last: queue like a new stream
                            self._budget.release(retained)
                            held, retained = held - retained, 0
                        if not self._wait_for_budget(charge, context):
                            return  # the client went away while this stream waited
                        held += charge
                    indices = (
                        order[position:end].tolist() if order is not None
                        else range(position, end)
                    )  # fmt: skip
                    ready_at = (
                        self._throttle.reserve(end - position)
                        if self._throttle is not None
                        else None
                    )
                    parts: list[futures.Future[AugmentedSamples]] = []
                    # Queued before its parts: if a submit raises, ``finally`` cancels those
                    # already made and frees the charge ``held`` counts.
                    pending.append((position, end, charge, parts, ready_at))
                    for at in range(position, end, PART_IMAGES):
                        work = BatchWork(
                            indices=tuple(indices[at - position : at - position + PART_IMAGES]),
                            recipe=recipe,
                            image_size=size,
                            rng_seed=batch_seed(request.seed, request.epoch, at),
                            split=split,
                        )
                        try:
                            part = self._source.submit(work)
                        except RuntimeError as e:
                            # The worker pool broke (a worker died; the source starts a new
                            # pool) or was shut down (the server is stopping): the client
                            # retries.
                            context.abort(
                                grpc.StatusCode.UNAVAILABLE,
                                f"cannot make batch [{position}, {end}): {e or type(e).__name__}",
                            )
                        self._pool_load.track(part)
                        parts.append(part)
                    position = end
                encoded = self._encode_next(pending, context)
                if encoded is None:
                    return  # the client went away
                message, charge = encoded
                del encoded
                yield message
                # Resumed: gRPC has taken the message and let go of the one before.
                del message
                if retained:
                    self._budget.release(retained)
                    held -= retained
                retained = charge
        finally:
            # Client went away or the stream failed: do not augment batches nobody will read.
            for _, _, _, parts, _ in pending:
                abandon(parts)
            if held:
                self._budget.release(held)

    def GetInfo(
        self,
        request: dataplane_pb2.GetInfoRequest | UndecodableRequest,
        context: grpc.ServicerContext,
    ) -> dataplane_pb2.ServerInfo:
        if isinstance(request, UndecodableRequest):
            _refuse_undecodable(request, context)
        return dataplane_pb2.ServerInfo(
            num_samples=self._source.num_samples,
            num_val_samples=self._source.num_val_samples,
            num_classes=self._source.num_classes,
            image_size=self._source.image_size,
            default_recipe=encode_recipe(self._source.default_recipe),
            recipes=[r.value for r in Recipe],
            max_message_bytes=self._max_message_bytes,
            workers=self._source.workers,
            busy_s=self.busy_s(),
            uptime_s=self.uptime_s(),
            active_streams=self.active_streams,
        )

    # ---- load ------------------------------------------------------------------------------

    def uptime_s(self) -> float:
        """Seconds since this servicer started (monotonic clock)."""
        return time.monotonic() - self._started

    def busy_s(self) -> float:
        """Seconds of capacity used since the start, at most 1 per second: the worker pool's
        share in use (``PoolLoad``), or with a throttle the throttle's busy time."""
        if self._throttle is not None:
            return self._throttle.busy_s()
        return self._pool_load.busy_s()

    @property
    def active_streams(self) -> int:
        with self._streams_lock:
            return self._active_streams

    def Shutdown(
        self,
        request: dataplane_pb2.ShutdownRequest | UndecodableRequest,
        context: grpc.ServicerContext,
    ) -> dataplane_pb2.ShutdownResponse:
        if isinstance(request, UndecodableRequest):
            _refuse_undecodable(request, context)
        grace = request.grace_s
        if not (math.isfinite(grace) and 0 <= grace <= MAX_GRACE_S):
            problem = (
                f"grace_s must be between 0 and {MAX_GRACE_S:g} seconds "
                f"(0: the server default, {DEFAULT_GRACE_S:g}s), got {grace}"
            )
            log.warning("refused Shutdown from %s: %s", context.peer(), problem)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        grace = grace or DEFAULT_GRACE_S
        log.info("Shutdown requested by %s (grace %.1fs)", context.peer(), grace)
        self._on_shutdown(grace)
        return dataplane_pb2.ShutdownResponse()


class _Stopper:
    """Stops a server once: health goes NOT_SERVING first so clients move on, then a graceful
    stop that lets running streams finish within the grace period."""

    def __init__(self, health_servicer: health.HealthServicer) -> None:
        self._health = health_servicer
        self._server: grpc.Server | None = None
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    def attach(self, server: grpc.Server) -> None:
        self._server = server

    def __call__(self, grace_s: float) -> None:
        with self._lock:
            if self.stopping.is_set() or self._server is None:
                return
            self.stopping.set()
        self._health.enter_graceful_shutdown()
        self._server.stop(grace_s)


def _add_dataplane_servicer(servicer: DataPlaneServicer, server: grpc.Server) -> None:
    """``add_DataPlaneServicer_to_server`` with two changes: StreamBatches yields bytes already
    encoded by ``wire.encode_batch``, so its response serializer is the identity (None); and a
    request that does not parse reaches the handler as an ``UndecodableRequest`` (answered with
    INVALID_ARGUMENT) instead of failing in gRPC as INTERNAL with a logged traceback."""
    pb = dataplane_pb2
    handlers: dict[str, grpc.RpcMethodHandler] = {
        "StreamBatches": grpc.unary_stream_rpc_method_handler(
            servicer.StreamBatches,
            request_deserializer=_lenient_deserializer(pb.StreamBatchesRequest),
            response_serializer=None,
        ),
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetInfo,
            request_deserializer=_lenient_deserializer(pb.GetInfoRequest),
            response_serializer=pb.ServerInfo.SerializeToString,
        ),
        "Shutdown": grpc.unary_unary_rpc_method_handler(
            servicer.Shutdown,
            request_deserializer=_lenient_deserializer(pb.ShutdownRequest),
            response_serializer=pb.ShutdownResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def create_server(
    source: BatchSource,
    *,
    port: int = 0,
    host: str = "127.0.0.1",
    max_concurrent_streams: int = 64,
    inflight_batches: int | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    memory_budget_bytes: int = 0,
    batch_timeout_s: float = 120.0,
    max_images_per_s: float | None = None,
) -> tuple[grpc.Server, int]:
    """Start a data server for ``source`` on ``host:port`` (port 0: a free one) with health
    checking; return ``(server, bound_port)``. At most ``memory_budget_bytes`` of batches are in
    flight across its streams (0: ``budget.default_memory_budget_bytes()``); a stream fails when a
    batch (or its wait for the budget) takes longer than ``batch_timeout_s``. The Shutdown RPC
    stops it gracefully; the caller closes ``source`` after ``server.wait_for_termination()``.
    ``max_images_per_s`` throttles the whole server to that rate (tests and rehearsals: a
    stand-in for a slower machine; None: no throttle)."""
    if memory_budget_bytes < 0:
        raise ValueError(f"memory_budget_bytes must be 0 or more, got {memory_budget_bytes}")
    if max_images_per_s is not None:
        max_images_per_s = check_images_per_s(max_images_per_s)
    budget = ByteBudget(memory_budget_bytes or default_memory_budget_bytes())
    # Streams mostly wait on workers or flow control; threads beyond the worker count are cheap.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_concurrent_streams + 4),
        options=channel_options(max_message_bytes),
        maximum_concurrent_rpcs=max_concurrent_streams,
    )
    health_servicer = health.HealthServicer()
    stopper = _Stopper(health_servicer)
    servicer = DataPlaneServicer(
        source,
        stopper,
        memory_budget=budget,
        inflight_batches=inflight_batches,
        max_message_bytes=max_message_bytes,
        batch_timeout_s=batch_timeout_s,
        max_images_per_s=max_images_per_s,
    )
    _add_dataplane_servicer(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (in use or not a local address?)")
    stopper.attach(server)
    server.start()
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "data server on %s:%d: %d samples (+ %d validation), %dpx, recipe %s, %d worker(s), "
        "memory budget %d MB for batches in flight",
        host,
        bound,
        source.num_samples,
        source.num_val_samples,
        source.image_size,
        encode_recipe(source.default_recipe),
        source.workers,
        budget.limit // MB,
    )
    if max_images_per_s is not None:
        log.warning("throttled to %g images/s (max_images_per_s)", max_images_per_s)
    return server, bound


def serve(
    spec: ClusterSpec,
    *,
    port: int | None = None,
    host: str = "0.0.0.0",
    workers: int | None = None,
    memory_mb: int | None = None,
    max_images_per_s: float | None = None,
    on_listening: Callable[[int], None] | None = None,
    on_stopped: Callable[[int], None] | None = None,
) -> int:
    """Run a data server for ``spec`` until Shutdown RPC, SIGTERM or SIGINT; return 0 when it
    stopped gracefully. ``workers`` and ``memory_mb`` (the memory budget for batches in flight;
    0: derived from the host's memory) override the spec; ``max_images_per_s`` throttles the
    server (``create_server``). ``on_listening(port)`` is called once it accepts requests, and
    ``on_stopped(port)`` once it no longer does, before its batch source closes."""
    if max_images_per_s is not None:
        max_images_per_s = check_images_per_s(max_images_per_s)
    dp = spec.job.dataplane
    memory_mb = dp.server_memory_mb if memory_mb is None else memory_mb
    budget_bytes = memory_mb * MB or default_memory_budget_bytes()
    source = AugmentingBatchSource(
        spec.job.dataset,
        recipe=spec.job.augmentation,
        eval_recipe=EvalTransform.from_spec(spec.job.eval),
        workers=workers if workers is not None else dp.workers_per_server,
        # The parts in flight are bounded by the memory budget: their shared memory too.
        handoff_bytes=budget_bytes,
    )
    try:
        source.warm_up()
        server, bound = create_server(
            source,
            port=dp.port if port is None else port,
            host=host,
            memory_budget_bytes=budget_bytes,
            max_images_per_s=max_images_per_s,
        )

        def _on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("signal %d: stopping gracefully", signum)
            # server.stop is thread-safe and returns at once; safe in a signal handler.
            server.stop(DEFAULT_GRACE_S)

        previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            if on_listening is not None:
                on_listening(bound)
            server.wait_for_termination()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        log.info("data server on port %d stopped", bound)
        if on_stopped is not None:
            on_stopped(bound)
    finally:
        source.close()
    return 0
