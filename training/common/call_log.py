"""A record of every AWS call a process makes, for the IAM proof (docs/security.md), switched on
by the environment only: production runs never set it and pay nothing.

With ``HETERO_AWS_CALL_LOG`` set to a folder, every client from ``training.common.aws.client``
appends one JSON line per API call to ``<folder>/<pid>.jsonl``: the principal the process runs as
(``HETERO_AWS_PRINCIPAL``: ``instance`` on an EC2 instance, ``sagemaker`` inside a SageMaker job,
``user`` for the command line, the default), the service, the operation, and the call's
parameters that name resources or set request context (bucket, key, prefix, group, instance ids,
parameter name, namespace, role ARN...), never a body. botocore's ``provide-client-params``
event carries them once per call, before any retry.
"""

from __future__ import annotations

import json
import os
from typing import Any, Final

ENV_CALL_LOG: Final = "HETERO_AWS_CALL_LOG"
"""A folder: when set, every AWS call of the process is appended to ``<folder>/<pid>.jsonl``."""
ENV_PRINCIPAL: Final = "HETERO_AWS_PRINCIPAL"
"""Who the process's calls run as: ``instance``, ``sagemaker`` or ``user`` (unset)."""
PRINCIPALS: Final = ("instance", "sagemaker", "user")

_MAX_LIST = 20
"""Longer lists (a batch of keys to delete) keep their first items: enough to name the resource."""


def _recordable(value: Any) -> Any:
    """The value as JSON, or None where it is a body, a stream or bytes."""
    if isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list):
        return [r for r in map(_recordable, value[:_MAX_LIST]) if r is not None]
    if isinstance(value, dict):
        kept = {k: _recordable(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not None}
    return None


def attach(client: Any) -> Any:
    """Record ``client``'s calls when ``HETERO_AWS_CALL_LOG`` is set; return the client."""
    folder = os.environ.get(ENV_CALL_LOG)
    if not folder:
        return client
    principal = os.environ.get(ENV_PRINCIPAL) or "user"
    os.makedirs(folder, exist_ok=True)
    service = client.meta.service_model.service_name

    def record(params: dict[str, Any], model: Any, **_: Any) -> None:
        fields = {k: v for k, v in params.items() if k != "Body"}
        line = {
            "principal": principal,
            "service": service,
            "operation": model.name,
            "params": _recordable(fields),
        }
        # One write of one line to a file opened for appending: lines of concurrent threads
        # never interleave.
        with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a", encoding="utf-8") as out:
            out.write(json.dumps(line, sort_keys=True) + "\n")

    client.meta.events.register("provide-client-params", record)
    return client
