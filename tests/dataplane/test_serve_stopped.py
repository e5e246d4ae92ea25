"""`hetero serve --outcome-dir` says when it has stopped on request (the job's Shutdown RPC):
``server-<PORT>.stopped`` is there once its port is closed and before its process exits, so its
launcher's health watch does not take the silence for a server that stopped working."""

from __future__ import annotations

from pathlib import Path

import grpc

from training.common.outcome import server_stopped
from training.dataplane.processes import start_server_process
from training.dataplane.v1 import dataplane_pb2, dataplane_pb2_grpc


def test_a_server_shut_down_writes_that_it_stopped(spec_path: Path, tmp_path: Path) -> None:
    outcome = tmp_path / "outcome"
    server = start_server_process(spec_path, workers=1, outcome_dir=outcome)
    try:
        assert not server_stopped(outcome, server.address)  # serving: nothing said yet
        with grpc.insecure_channel(server.address) as channel:
            stub = dataplane_pb2_grpc.DataPlaneStub(channel)
            stub.Shutdown(dataplane_pb2.ShutdownRequest(grace_s=1.0), timeout=10)
        assert server.process.wait(timeout=60) == 0
        assert server_stopped(outcome, server.address)
        assert [p.name for p in outcome.iterdir()] == [
            f"server-{server.address.split(':')[1]}.stopped"
        ]
    finally:
        server.stop()
