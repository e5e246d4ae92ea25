"""``hetero local`` with an elastic dataprep group: data server processes come and go.

The trainer finds the servers through a file (``--data-servers file:PATH``, read again every
``refresh_s``) and its rank 0's controller writes the count it wants to another
(``--autoscale file:PATH``, ``training.dataplane.autoscale.FileActuator``). ``LocalDataTier``
runs beside the trainer and reconciles the two, as an Auto Scaling group does on EC2:

- **Out**: it starts the missing servers and lists each in the servers file once it reports
  SERVING (the trainer admits it at its next refresh and gives it ranges).
- **In**: it takes the newest servers out of the file first, so the trainer forgets them and
  their ranges go back to the pool (every sample still exactly once), and only after the
  trainer's refresh period (plus a margin) asks them to shut down (the Shutdown RPC).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from training.common.files import write_atomically
from training.dataplane.autoscale import read_desired, write_desired
from training.dataplane.v1 import dataplane_pb2, dataplane_pb2_grpc
from training.processes.supervisor import Child

log = logging.getLogger(__name__)

SERVERS_FILE = "data-servers.txt"
DESIRED_FILE = "data-servers-desired.json"
DRAIN_MARGIN_S = 2.0
"""Beyond the trainer's refresh period, how long a server taken out of the list keeps running
before it is asked to shut down."""
SHUTDOWN_GRACE_S = 5.0


@dataclass
class _Server:
    address: str
    child: Child
    since: float
    """Started (starting), listed (serving) or taken out of the list (draining)."""
    shutdown_sent: bool = False


class LocalDataTier:
    """The elastic group's servers of a local run. ``fixed``: servers of groups that do not
    scale (always listed); ``elastic``: the elastic group's servers at start (healthy);
    ``start(i)`` starts server number ``i`` and returns ``(address, child)``; a count is in
    instances, each ``per_instance`` servers."""

    def __init__(
        self,
        run_dir: Path,
        *,
        fixed: list[tuple[str, Child]],
        elastic: list[tuple[str, Child]],
        start: Callable[[int], tuple[str, Child]],
        per_instance: int,
        refresh_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.servers_file = run_dir / SERVERS_FILE
        self.desired_file = run_dir / DESIRED_FILE
        self._fixed = fixed
        self._start = start
        self._per_instance = per_instance
        self._drain_s = refresh_s + DRAIN_MARGIN_S
        self._clock = clock
        now = clock()
        self._serving = [_Server(a, c, now) for a, c in elastic]
        self._starting: list[_Server] = []
        self._draining: list[_Server] = []
        self.started: list[tuple[str, Child]] = [*fixed, *elastic]
        """Every server this run started (the local run's summary lists them)."""
        self.stopped: set[str] = set()
        """Servers stopped with a signal before they served (their exit code is no failure)."""
        self._next = len(self.started)
        self._write_servers()
        write_desired(self.desired_file, len(elastic) // max(1, per_instance))

    @property
    def count(self) -> int:
        """Elastic servers listed or starting."""
        return len(self._serving) + len(self._starting)

    def addresses(self) -> list[str]:
        return [a for a, _ in self._fixed] + [s.address for s in self._serving]

    def _write_servers(self) -> None:
        write_atomically(self.servers_file, "".join(f"{a}\n" for a in self.addresses()))

    def reconcile(self) -> None:
        """One pass: start, list, unlist and stop servers toward the desired count."""
        desired = read_desired(self.desired_file)
        now = self._clock()
        if desired is not None:
            want = desired * self._per_instance
            while self.count < want:
                address, child = self._start(self._next)
                self._next += 1
                self.started.append((address, child))
                self._starting.append(_Server(address, child, now))
                log.info("data tier: starting server %s (%d wanted)", address, want)
            while self.count > want:
                self._take_out(now)
        changed = False
        for server in list(self._starting):
            if server.child.returncode is not None:
                log.warning(
                    "data tier: server %s exited (%s) before serving; starting another",
                    server.address, server.child.returncode,
                )  # fmt: skip
                self._starting.remove(server)
            elif _serving(server.address):
                self._starting.remove(server)
                self._serving.append(_Server(server.address, server.child, now))
                changed = True
                log.info("data tier: server %s serving; %d listed", server.address, self.count)
        for server in list(self._serving):
            if server.child.returncode is not None:  # died: the trainer copes; list a new one
                log.warning(
                    "data tier: server %s exited (%s)", server.address, server.child.returncode
                )
                self._serving.remove(server)
                changed = True
        if changed:
            self._write_servers()
        for server in list(self._draining):
            if server.child.returncode is not None:
                self._draining.remove(server)
            elif not server.shutdown_sent and now - server.since >= self._drain_s:
                server.shutdown_sent = True
                _shutdown(server.address)
                log.info("data tier: server %s asked to shut down", server.address)

    def _take_out(self, now: float) -> None:
        """The newest server goes first: one still starting is stopped at once; a listed one
        leaves the list now and is asked to shut down after the trainer's refresh."""
        if self._starting:
            self._stop(self._starting.pop())
            return
        server = self._serving.pop()
        server.since = now
        self._draining.append(server)
        self._write_servers()
        log.info(
            "data tier: server %s taken out of the list; %d listed", server.address, self.count
        )

    def _stop(self, server: _Server) -> None:
        server.child.send_stop(signal.SIGTERM)
        self.stopped.add(server.address)
        log.info("data tier: server %s stopped before it served", server.address)

    def finish(self) -> None:
        """The trainer is done: servers still starting never served; stop them (the trainer
        shut down the listed ones)."""
        while self._starting:
            self._stop(self._starting.pop())


def reports_serving(channel: grpc.Channel, timeout_s: float) -> bool:
    """One standard health check over ``channel``: True when the server answers SERVING (False
    when it does not, or is not listening yet)."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
        )
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        return reports_serving(channel, timeout_s=0.5)


def _shutdown(address: str) -> None:
    try:
        with grpc.insecure_channel(address) as channel:
            dataplane_pb2_grpc.DataPlaneStub(channel).Shutdown(
                dataplane_pb2.ShutdownRequest(grace_s=SHUTDOWN_GRACE_S), timeout=5.0
            )
    except grpc.RpcError as e:
        log.warning("data tier: Shutdown to %s failed: %s", address, e.code())
