"""The one boto3 client factory: every AWS client of the project comes from ``client``.

Its waits are bounded (a few seconds to connect or to hear back, a few attempts in all with
botocore's ``standard`` retry mode and backoff), so an outage fails a call within seconds instead
of hanging a save, a heartbeat or a start-up; the caller decides what a failed call means. boto3
takes the endpoint, region and credentials from the usual places (``AWS_ENDPOINT_URL``,
``AWS_REGION``, the instance role), so tests point it at a local moto server. With
``HETERO_AWS_CALL_LOG`` set, its calls are recorded (``training.common.call_log``).
"""

from __future__ import annotations

from typing import Any

from training.common import call_log

CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 10.0
MAX_ATTEMPTS = 3
"""Attempts per request in all (botocore's ``standard`` retry mode, with backoff)."""


def client(
    service: str = "s3",
    *,
    region: str | None = None,
    attempts: int = MAX_ATTEMPTS,
    connections: int | None = None,
) -> Any:
    """A boto3 client whose every call ends within seconds when the service cannot be reached.
    ``connections``: the pool size, for callers that move many objects on threads."""
    import boto3  # Deferred: local-only runs and the CDK stacks never import boto3.
    from botocore.config import Config

    config = Config(
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
        retries={"total_max_attempts": attempts, "mode": "standard"},
        # botocore's default, stated: every request is checked against the service model
        # before it leaves the machine.
        parameter_validation=True,
    )
    if connections:
        config = config.merge(Config(max_pool_connections=connections))
    made = boto3.client(service, region_name=region, config=config)  # type: ignore[call-overload]
    return call_log.attach(made)
