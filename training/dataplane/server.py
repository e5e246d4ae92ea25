"""The data server: streams augmented batches over gRPC (``training.dataplane.v1.DataPlane``).

``create_server(source)`` builds and starts a server on a port (0: any free one) and returns
``(server, port)``; ``serve(...)`` is the process entry point used by ``hetero serve``.
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from types import FrameType

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from training.data.augment import AugmentedSamples
from training.data.order import batch_seed, epoch_order
from training.dataplane.sources import AugmentingBatchSource, BatchSource, BatchWork
from training.dataplane.v1 import dataplane_pb2
from training.dataplane.wire import encode_batch
from training.spec import ClusterSpec, Recipe

log = logging.getLogger(__name__)

SERVICE_NAME = "training.dataplane.v1.DataPlane"
# Messages stay a few MB (a 32 x 224 px batch is 4.8 MB); the limit leaves room for big crops.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Room in a message for everything but the pixels (shape, labels, ids, framing).
_HEADER_BYTES_PER_SAMPLE = 32
_HEADER_BYTES = 1024
DEFAULT_GRACE_S = 5.0


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC options both ends use: explicit message limits and keepalive pings, so a vanished
    peer is noticed in seconds rather than at the TCP timeout."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Multi-MB messages: bigger HTTP/2 frames and socket reads mean fewer trips through the
        # transport per batch (receive CPU on the trainer host is what the design saves).
        ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
        ("grpc.experimental.tcp_read_chunk_size", 4 * 1024 * 1024),
        ("grpc.experimental.tcp_min_read_chunk_size", 1024 * 1024),
        ("grpc.experimental.tcp_max_read_chunk_size", 16 * 1024 * 1024),
    ]


class DataPlaneServicer:
    """Serves one ``BatchSource``; ``on_shutdown(grace_s)`` is called by the Shutdown RPC."""

    def __init__(
        self,
        source: BatchSource,
        on_shutdown: Callable[[float], None],
        *,
        inflight_batches: int | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        batch_timeout_s: float = 120.0,
    ) -> None:
        self._source = source
        self._on_shutdown = on_shutdown
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
        order = epoch_order(seed, epoch, self._source.num_samples)
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
        n = self._source.num_samples
        if request.batch_size < 1:
            return "batch_size must be at least 1"
        if request.stop <= request.start:
            return (
                f"empty range: stop ({request.stop}) must be greater than start ({request.start})"
            )
        if request.stop > n:
            return f"stop ({request.stop}) is beyond the epoch: the dataset has {n} samples"
        valid = [r.value for r in Recipe]
        if request.recipe and request.recipe not in valid:
            return f"unknown recipe {request.recipe!r}; use one of {', '.join(valid)}"
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

    # ---- RPCs ----------------------------------------------------------------------------

    def StreamBatches(
        self, request: dataplane_pb2.StreamBatchesRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        """Yields encoded ``Batch`` messages (``wire.encode_batch``: the pixels copied once)."""
        problem = self.validate(request)
        if problem is not None:
            log.warning("refused StreamBatches from %s: %s", context.peer(), problem)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        recipe = Recipe(request.recipe) if request.recipe else self._source.default_recipe
        size = request.image_size or self._source.image_size
        order = self._order(request.seed, request.epoch)
        pending: collections.deque[tuple[int, int, futures.Future[AugmentedSamples]]] = (
            collections.deque()
        )
        position = request.start
        try:
            while position < request.stop or pending:
                while position < request.stop and len(pending) < self._inflight:
                    end = min(position + request.batch_size, request.stop)
                    work = BatchWork(
                        indices=tuple(order[position:end].tolist()),
                        recipe=recipe,
                        image_size=size,
                        rng_seed=batch_seed(request.seed, request.epoch, position),
                    )
                    pending.append((position, end, self._source.submit(work)))
                    position = end
                start, stop, future = pending.popleft()
                try:
                    samples = future.result(timeout=self._batch_timeout_s)
                except Exception as e:
                    log.exception("batch [%d, %d) failed", start, stop)
                    context.abort(grpc.StatusCode.INTERNAL, f"batch [{start}, {stop}) failed: {e}")
                if samples.skipped_ids:
                    log.warning(
                        "skipped %d unreadable sample(s): %s",
                        len(samples.skipped_ids),
                        samples.skipped_ids,
                    )
                yield encode_batch(samples, start, stop)
        finally:
            # Client went away or the stream failed: do not augment batches nobody will read.
            for _, _, future in pending:
                future.cancel()

    def GetInfo(
        self, request: dataplane_pb2.GetInfoRequest, context: grpc.ServicerContext
    ) -> dataplane_pb2.ServerInfo:
        return dataplane_pb2.ServerInfo(
            num_samples=self._source.num_samples,
            num_classes=self._source.num_classes,
            image_size=self._source.image_size,
            default_recipe=self._source.default_recipe.value,
            recipes=[r.value for r in Recipe],
            max_message_bytes=self._max_message_bytes,
            workers=self._source.workers,
        )

    def Shutdown(
        self, request: dataplane_pb2.ShutdownRequest, context: grpc.ServicerContext
    ) -> dataplane_pb2.ShutdownResponse:
        if request.grace_s < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "grace_s must not be negative")
        grace = request.grace_s or DEFAULT_GRACE_S
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
    """``add_DataPlaneServicer_to_server`` with one change: StreamBatches yields bytes already
    encoded by ``wire.encode_batch``, so its response serializer is the identity (None)."""
    pb = dataplane_pb2
    handlers = {
        "StreamBatches": grpc.unary_stream_rpc_method_handler(
            servicer.StreamBatches,
            request_deserializer=pb.StreamBatchesRequest.FromString,
            response_serializer=None,
        ),
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetInfo,
            request_deserializer=pb.GetInfoRequest.FromString,
            response_serializer=pb.ServerInfo.SerializeToString,
        ),
        "Shutdown": grpc.unary_unary_rpc_method_handler(
            servicer.Shutdown,
            request_deserializer=pb.ShutdownRequest.FromString,
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
) -> tuple[grpc.Server, int]:
    """Start a data server for ``source`` on ``host:port`` (port 0: a free one) with health
    checking; return ``(server, bound_port)``. The Shutdown RPC stops it gracefully; the caller
    closes ``source`` after ``server.wait_for_termination()``."""
    # Streams mostly wait on workers or flow control; threads beyond the worker count are cheap.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_concurrent_streams + 4),
        options=channel_options(max_message_bytes),
        maximum_concurrent_rpcs=max_concurrent_streams,
    )
    health_servicer = health.HealthServicer()
    stopper = _Stopper(health_servicer)
    servicer = DataPlaneServicer(
        source, stopper, inflight_batches=inflight_batches, max_message_bytes=max_message_bytes
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
        "data server on %s:%d: %d samples, %dpx, recipe %s, %d worker(s)",
        host,
        bound,
        source.num_samples,
        source.image_size,
        source.default_recipe.value,
        source.workers,
    )
    return server, bound


def serve(
    spec: ClusterSpec,
    *,
    port: int | None = None,
    host: str = "0.0.0.0",
    workers: int | None = None,
    on_listening: Callable[[int], None] | None = None,
) -> int:
    """Run a data server for ``spec`` until Shutdown RPC, SIGTERM or SIGINT; return 0 when it
    stopped gracefully. ``on_listening(port)`` is called once it accepts requests."""
    dp = spec.job.dataplane
    source = AugmentingBatchSource(
        spec.job.dataset,
        recipe=spec.job.augmentation,
        workers=workers if workers is not None else dp.workers_per_server,
    )
    try:
        source.warm_up()
        server, bound = create_server(source, port=dp.port if port is None else port, host=host)

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
    finally:
        source.close()
    return 0
