"""A data server's own launcher watches it with the standard gRPC health check
(training.launcher.server_watch): a real gRPC server in a process of its own, serving, then
stopped (SIGSTOP: alive and silent), then at its stream limit (busy: an answer)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from frozen import freeze

from training.launcher.server_watch import ServerWatch

REPO = Path(__file__).resolve().parents[2]
SERVER = r"""
import sys, threading
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from training.dataplane.rpc import SERVICE_NAME
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
servicer = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
server.add_insecure_port(f"127.0.0.1:{sys.argv[1]}")
server.start()
print("ready", flush=True)
threading.Event().wait(120)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc, f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_a_serving_server_answers_and_a_stopped_one_is_not_answering_after_the_bound(
    server: tuple[subprocess.Popen[str], str],
) -> None:
    proc, address = server
    now = [0.0]
    with ServerWatch([address], bound_s=60.0, clock=lambda: now[0]) as watch:
        assert watch.check() is None and watch.answered[address] == 0.0
        now[0] = 10.0
        assert watch.check() is None and watch.answered[address] == 10.0
        freeze(proc.pid)
        now[0] = 50.0
        assert watch.check() is None  # 40 s without an answer: within the bound
        assert watch.problems[address].startswith("DEADLINE_EXCEEDED")
        now[0] = 70.0
        reason = watch.check()
        assert reason == watch.found
        assert reason is not None and reason.startswith(
            f"not answering: data server {address} has not answered its health check for 60 s "
            "since its last answer (last: DEADLINE_EXCEEDED"
        ), reason
        os.kill(proc.pid, signal.SIGCONT)


def test_a_server_that_never_started_has_four_bounds_at_least_ten_minutes() -> None:
    """A start (imports, the dataset's index) may take longer than a silence may last."""
    address = f"127.0.0.1:{free_port()}"  # nothing listens
    now = [100.0]
    with ServerWatch([address], bound_s=300.0, clock=lambda: now[0]) as watch:
        assert watch.startup_s == 1200.0
        now[0] = 1200.0
        assert watch.check() is None  # 1100 s: past one bound, within four
        assert watch.problems[address].startswith("UNAVAILABLE")
        now[0] = 1301.0
        reason = watch.check()
        assert reason is not None and "for 1201 s since the generation's start" in reason
    with ServerWatch([address], bound_s=16.0, clock=lambda: now[0]) as watch:
        assert watch.startup_s == 600.0  # a rehearsal's 16 s bound: ten minutes to start


def test_a_server_at_its_stream_limit_is_busy_not_silent(tmp_path: Path) -> None:
    """gRPC answers RESOURCE_EXHAUSTED for a server whose every RPC slot is taken: alive."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from training.dataplane.rpc import SERVICE_NAME

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), maximum_concurrent_rpcs=0)
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        now = [0.0]
        with ServerWatch([f"127.0.0.1:{port}"], bound_s=5.0, clock=lambda: now[0]) as watch:
            now[0] = 10.0
            assert watch.check() is None
            assert watch.answered[f"127.0.0.1:{port}"] == 10.0
    finally:
        server.stop(None)


def test_a_server_that_starts_after_the_first_check_is_seen_at_the_next() -> None:
    """A refused first connection puts a gRPC channel in reconnect backoff (up to minutes): each
    check after a failure uses a fresh channel, so the server's start is seen at once."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    with ServerWatch([address], bound_s=60.0) as watch:
        assert watch.check() is None and watch.answered[address] is None
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(port)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            assert watch.check() is None
            assert watch.answered[address] is not None, watch.problems
        finally:
            proc.kill()
            proc.wait()
