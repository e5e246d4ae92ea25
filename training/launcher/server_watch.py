"""A data server that runs but does not answer: found by its own launcher, which takes the host
out of its group.

A data server's process can live while it serves nothing: stopped, wedged in a worker, its
threads deadlocked. Its launcher goes on writing to the job record, so it is not silent
(``silent_hosts``), and the trainers' pools only stop sending it work
(``training.dataplane.membership``): the instance bills, unreplaced, until the job ends. So at
each heartbeat of a data server generation, its launcher sends each of its servers the standard
gRPC health check (``training.dataplane.health``), over the same address the trainers use. A
server that has not answered ``SERVING`` (or, at its stream limit, ``RESOURCE_EXHAUSTED``) for
``bound_s`` (the silent-host bound, ``LoopSettings.silent_after``) since its last answer is not
answering: ``check`` returns the reason, and ``ec2_job`` ends the generation and takes the host
out as it would a silent one. A server that said it stopped on request (``stopped(address)``:
its ``server-<PORT>.stopped``, ``training.common.outcome``) is not judged: the job's Shutdown
closed its port, and its process may take a while to exit. Before its first answer a server is
starting (importing, reading its dataset's index), which may take much longer on a busy host: it
gets ``STARTUP_BOUNDS`` times ``bound_s``, at least ``STARTUP_FLOOR_S``, from the generation's
start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import grpc

from training.dataplane.health import serving_problem
from training.dataplane.rpc import channel_options

log = logging.getLogger(__name__)

STARTUP_BOUNDS = 4
"""Before a server's first answer, the bound is this many times ``bound_s`` ..."""
STARTUP_FLOOR_S = 600.0
"""... and at least this long."""
BUSY = "RESOURCE_EXHAUSTED"
"""What gRPC answers for the server when it is at its ``maximum_concurrent_rpcs`` (every stream
slot taken by the trainers): alive and busy, which counts as an answer."""


class ServerWatch:
    """``check()``: the reason once one of ``addresses`` (``host:port``) has not answered
    ``SERVING`` for ``bound_s``; None otherwise. A context manager (its channels close)."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        bound_s: float,
        stopped: Callable[[str], bool] = lambda address: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bound_s = bound_s
        self.stopped = stopped
        self.clock = clock
        started = clock()
        self.channels = {a: _channel(a) for a in addresses}
        self.started = started
        self.answered: dict[str, float | None] = dict.fromkeys(addresses)
        """When each server last answered ``SERVING`` (None: not yet)."""
        self.problems: dict[str, str] = {}
        self.found: str | None = None
        """The reason, once a server did not answer for ``bound_s``."""
        self.startup_s = max(STARTUP_BOUNDS * bound_s, STARTUP_FLOOR_S)
        """The bound before a server's first answer."""

    def __enter__(self) -> ServerWatch:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for channel in self.channels.values():
            channel.close()

    def check(self) -> str | None:
        now = self.clock()
        for address, channel in list(self.channels.items()):
            problem = serving_problem(channel)
            if problem is None or problem.startswith(BUSY):
                self.answered[address] = now
                self.problems.pop(address, None)
                continue
            self.problems[address] = problem
            if self.stopped(address):
                continue  # on request: its silence is the job's end, not a fault
            # A channel whose connection failed waits out gRPC's reconnect backoff (growing to
            # two minutes) before it tries again: the next check gets a fresh one, which
            # connects at once (a server that started meanwhile is seen).
            channel.close()
            self.channels[address] = _channel(address)
            last = self.answered[address]
            silent = now - (last if last is not None else self.started)
            bound = self.bound_s if last is not None else self.startup_s
            if silent >= bound:
                since = "its last answer" if last is not None else "the generation's start"
                self.found = (
                    f"not answering: data server {address} has not answered its health check "
                    f"for {silent:.0f} s since {since} (last: {problem}) while its process runs"
                )
                return self.found
            log.warning("data server %s does not answer its health check: %s", address, problem)
        return None


def _channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=channel_options())
