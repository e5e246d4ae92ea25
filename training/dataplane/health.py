"""The standard gRPC health check of a data server (``grpc.health.v1``, the service
``training.dataplane.v1.DataPlane``): what the trainer's pool admits a server by
(``membership``) and what a data server's own launcher watches it by
(``training.launcher.server_watch``)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from training.dataplane.rpc import SERVICE_NAME

HEALTH_TIMEOUT_S = 2.0


def serving_problem(channel: grpc.Channel, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """None when the server answers ``SERVING`` within ``timeout_s``; else what it answered
    (``NOT_SERVING``...) or the RPC's error (``DEADLINE_EXCEEDED: ...``)."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s
        )
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()}" if isinstance(e, grpc.Call) else str(e)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return None
