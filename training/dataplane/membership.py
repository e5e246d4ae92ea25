"""Which data servers the client uses now: discovered, health-checked, retried with backoff.

``ServerPool`` asks its discovery source every ``refresh_s`` seconds. A new address is admitted
(state ``serving``) once the standard gRPC health check answers ``SERVING`` and ``GetInfo``
reports the dataset the client expects (the size of its split: ``num_samples`` for training,
``num_val_samples`` for a validation client, which never admits a server without one); then
every listener is told, so an epoch in flight gives it work at once. A stream that fails
reports it here: the server is ``failed`` and checked again after a backoff (``backoff_s``
doubling to ``max_backoff_s``), and readmitted when healthy. An address the source no longer
lists is forgotten and its channels closed (its streams' ranges go back to the pool).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import grpc

from training.dataplane.discovery import DiscoveryError, ServerDiscovery
from training.dataplane.health import HEALTH_TIMEOUT_S, serving_problem
from training.dataplane.rpc import channel_options
from training.dataplane.v1 import dataplane_pb2, dataplane_pb2_grpc

log = logging.getLogger(__name__)


class ServerState(StrEnum):
    NEW = "new"
    """Discovered, not yet checked."""
    SERVING = "serving"
    """Healthy: streams may take ranges from it."""
    FAILED = "failed"
    """A check or a stream failed; checked again at ``retry_at``."""


@dataclass
class _Server:
    address: str
    channels: list[grpc.Channel]
    state: ServerState = ServerState.NEW
    failures: int = 0
    retry_at: float = 0.0
    last_error: str = "not checked yet"
    num_samples: int | None = None
    admitted: int = 0
    """How many times it was admitted (readmissions count)."""


@dataclass
class ServerPool:
    """The client's data servers. ``streams_per_server`` channels are opened per server, each
    its own TCP connection (gRPC would otherwise share one connection between them)."""

    discovery: ServerDiscovery
    refresh_s: float = 5.0
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    streams_per_server: int = 1
    expected_samples: int | None = None
    """Servers reporting another dataset size are not admitted (their order would differ)."""
    validation: bool = False
    """The sizes compared are the validation split's (``ServerInfo.num_val_samples``), not the
    training split's; a server with no validation set is not admitted."""
    _servers: dict[str, _Server] = field(default_factory=dict)
    _listeners: list[Callable[[str], None]] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _closed: threading.Event = field(default_factory=threading.Event)
    _poke: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _discovered_at: float = float("-inf")
    _discovery_error: str | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Discover and check once now, then keep refreshing in a background thread."""
        with self._cond:
            if self._thread is not None or self._closed.is_set():
                return
            self._thread = threading.Thread(
                target=self._loop, name="dataplane-membership", daemon=True
            )
        self.refresh()
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._poke.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        with self._cond:
            servers, self._servers = list(self._servers.values()), {}
            self._cond.notify_all()
        for s in servers:
            for ch in s.channels:
                ch.close()

    def _loop(self) -> None:
        while not self._closed.is_set():
            self._poke.wait(self._next_wake())
            self._poke.clear()
            if self._closed.is_set():
                return
            try:
                self.refresh()
            except Exception:  # never let the membership thread die silently
                log.exception("data server membership refresh failed")

    def _next_wake(self) -> float:
        now = time.monotonic()
        with self._cond:
            due = [s.retry_at for s in self._servers.values() if s.state is not ServerState.SERVING]
        wake = min([self._discovered_at + self.refresh_s, *due])
        return min(self.refresh_s, max(0.02, wake - now))

    # ---- refresh ---------------------------------------------------------------------------

    def refresh(self, *, rediscover: bool = False) -> None:
        """One pass: ask the source (every ``refresh_s``, or now with ``rediscover``), then
        check every new, due or serving server."""
        now = time.monotonic()
        if rediscover or now >= self._discovered_at + self.refresh_s:
            self._discovered_at = now
            self._apply_discovery()
        with self._cond:
            todo = [
                s
                for s in self._servers.values()
                if s.state is ServerState.SERVING or s.retry_at <= now
            ]
        for server in todo:
            if self._closed.is_set():
                return
            self._check(server)

    def _apply_discovery(self) -> None:
        try:
            found = self.discovery.addresses()
        except DiscoveryError as e:
            if self._discovery_error != str(e):
                log.warning("data server discovery (%s): %s", self.discovery.describe(), e)
            self._discovery_error = str(e)
            return
        self._discovery_error = None
        gone: list[_Server] = []
        with self._cond:
            for address in found:
                if address not in self._servers:
                    self._servers[address] = _Server(address, self._open(address))
                    log.info("data server %s discovered", address)
            for address in [a for a in self._servers if a not in found]:
                gone.append(self._servers.pop(address))
            self._cond.notify_all()
        for s in gone:
            log.info(
                "data server %s is no longer listed by %s", s.address, self.discovery.describe()
            )
            for ch in s.channels:
                ch.close()  # cancels its streams: their ranges go back to the pool

    def _open(self, address: str) -> list[grpc.Channel]:
        options = [
            *channel_options(),
            # = grpc.experimental.ChannelOptions.SingleThreadedUnaryStream: the stream's own
            # thread reads its messages, no hand-off from gRPC's polling thread.
            ("SingleThreadedUnaryStream", 1),
            # One TCP connection per channel, not one shared by all channels to the address.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        return [
            grpc.insecure_channel(address, options=options) for _ in range(self.streams_per_server)
        ]

    def _check(self, server: _Server) -> None:
        channel = server.channels[0]
        problem: str | None = None
        info_samples: int | None = None
        try:
            problem = serving_problem(channel)
            if problem is None and server.state is not ServerState.SERVING:
                info = dataplane_pb2_grpc.DataPlaneStub(channel).GetInfo(
                    dataplane_pb2.GetInfoRequest(), timeout=HEALTH_TIMEOUT_S
                )
                if self.validation:
                    info_samples = int(info.num_val_samples)
                    if info_samples == 0:
                        problem = (
                            "has no validation set (its spec sets neither job.dataset.val_path "
                            "nor job.dataset.val_fraction)"
                        )
                else:
                    info_samples = int(info.num_samples)
                expected = self.expected_samples
                if problem is None and expected is not None and info_samples != expected:
                    problem = self._size_mismatch(info_samples, expected)
        except grpc.RpcError as e:
            problem = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.Call) else str(e)
        admitted = False
        with self._cond:
            if self._servers.get(server.address) is not server:
                return  # forgotten meanwhile
            if problem is None:
                if server.state is not ServerState.SERVING:
                    server.state, admitted = ServerState.SERVING, True
                    server.admitted += 1
                    if info_samples is not None:
                        server.num_samples = info_samples
                server.retry_at = 0.0
            else:
                self._fail(server, problem)
            self._cond.notify_all()
            listeners = list(self._listeners) if admitted else []
        if admitted:
            log.info(
                "data server %s %s",
                server.address,
                "admitted" if server.admitted == 1 else "healthy again: readmitted",
            )
            for listener in listeners:
                listener(server.address)

    def _size_mismatch(self, served: int, expected: int) -> str:
        what = "validation samples" if self.validation else "samples"
        return (
            f"serves {served} {what}, the job has {expected}: a different dataset (check its spec)"
        )

    def _fail(self, server: _Server, problem: str) -> None:
        """Mark ``server`` failed and schedule its next check (the lock is held)."""
        was = server.state
        server.state = ServerState.FAILED
        server.failures += 1
        server.last_error = problem
        delay = min(self.backoff_s * 2 ** (server.failures - 1), self.max_backoff_s)
        server.retry_at = time.monotonic() + delay
        if was is ServerState.SERVING or server.failures == 1:
            log.warning(
                "data server %s failed (%s); checking again in %.1fs",
                server.address,
                problem,
                delay,
            )

    # ---- what streams and the client use --------------------------------------------------

    def subscribe(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(address)`` whenever a server is admitted or readmitted."""
        with self._cond:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[str], None]) -> None:
        with self._cond:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def serving(self) -> list[str]:
        with self._cond:
            return [a for a, s in self._servers.items() if s.state is ServerState.SERVING]

    def is_serving(self, address: str) -> bool:
        with self._cond:
            s = self._servers.get(address)
            return s is not None and s.state is ServerState.SERVING

    def known(self) -> list[str]:
        with self._cond:
            return list(self._servers)

    def channel(self, address: str, slot: int = 0) -> grpc.Channel | None:
        with self._cond:
            s = self._servers.get(address)
            return s.channels[slot % len(s.channels)] if s is not None else None

    def num_samples(self) -> int | None:
        """The size of the pool's split a serving server reported, if any has."""
        with self._cond:
            for s in self._servers.values():
                if s.state is ServerState.SERVING and s.num_samples is not None:
                    return s.num_samples
        return None

    def expect_samples(self, num_samples: int) -> None:
        """From now on admit only servers of a ``num_samples`` dataset; fail serving ones that
        reported another size."""
        with self._cond:
            self.expected_samples = num_samples
            for s in self._servers.values():
                if s.state is ServerState.SERVING and s.num_samples not in (None, num_samples):
                    assert s.num_samples is not None
                    self._fail(s, self._size_mismatch(s.num_samples, num_samples))
            self._cond.notify_all()

    def report_failure(self, address: str, problem: str) -> None:
        """A stream to ``address`` failed: stop giving it work until it is healthy again."""
        with self._cond:
            s = self._servers.get(address)
            if s is None or s.state is not ServerState.SERVING:
                return
            self._fail(s, problem)
            self._cond.notify_all()
        self._poke.set()

    def report_progress(self, address: str) -> None:
        """A stream delivered: the server's failure count starts again from zero."""
        with self._cond:
            s = self._servers.get(address)
            if s is not None and s.state is ServerState.SERVING:
                s.failures = 0

    def wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until ``predicate()`` holds; re-checked on every change."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def errors(self) -> dict[str, str]:
        """Each known server's last problem (``serving`` for healthy ones)."""
        with self._cond:
            out = {
                a: ("serving" if s.state is ServerState.SERVING else s.last_error)
                for a, s in self._servers.items()
            }
        if not out:
            out["(none)"] = self._discovery_error or f"{self.discovery.describe()} lists no server"
        return out

    def server_loads(self, timeout_s: float = 2.0) -> dict[str, tuple[float, float]]:
        """``{address: (busy_s, uptime_s)}`` from ``GetInfo`` of each serving server, on the
        pool's channel to it; cumulative since the server started (the busy share over a while
        is the change of busy_s over the change of uptime_s). The calls run concurrently, each
        bounded by ``timeout_s``; a server whose call fails is left out (logged at debug)."""
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        with self._cond:
            serving = [
                (a, s.channels[0])
                for a, s in self._servers.items()
                if s.state is ServerState.SERVING
            ]
        calls: list[tuple[str, grpc.Future]] = []
        for address, channel in serving:
            try:
                calls.append(
                    (
                        address,
                        dataplane_pb2_grpc.DataPlaneStub(channel).GetInfo.future(
                            dataplane_pb2.GetInfoRequest(), timeout=timeout_s
                        ),
                    )
                )
            except Exception as e:  # e.g. its channel was closed meanwhile (forgotten)
                log.debug("load of data server %s: %s", address, e)
        loads: dict[str, tuple[float, float]] = {}
        for address, call in calls:
            try:
                # The RPC's own deadline bounds it; the margin only guards against a hang.
                info = call.result(timeout=timeout_s + 1.0)
            except grpc.RpcError as e:
                problem = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.Call) else str(e)
                log.debug("load of data server %s: %s", address, problem)
                continue
            except Exception as e:
                call.cancel()
                log.debug("load of data server %s: %s", address, e or type(e).__name__)
                continue
            loads[address] = (float(info.busy_s), float(info.uptime_s))
        return loads

    def describe_errors(self) -> str:
        return "\n".join(f"  {a}: {e}" for a, e in self.errors().items())
