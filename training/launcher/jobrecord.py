"""The job record: what every host of a job must agree on, kept beside the checkpoints.

Under ``<checkpoint URI>/job/`` (S3 on AWS, a folder otherwise):

- ``outcome.json``: ``{"outcome": "finished" | "failed" | "stopped", "reason", "by", "time"}``,
  written once by the host that ends the job (``stopped``: the budget ran out, see
  ``budget.py``; ``hetero job start --resume`` continues it). Its presence means the job is
  over: a host that starts or restarts afterwards does not run the role again.
- ``started.json``: ``{"started": <epoch seconds>}``, the job's start for its budget when the job
  pointer has none (a deploy's job), written by the first host that needs it.
- ``leaving/<instance-id>.json``: a host that got an interruption notice or an Auto Scaling
  termination says so here first, so the others re-form the job without it while it is still
  running (EC2 keeps it ``running`` until the termination).
- ``hosts/<instance-id>.json``: each host's latest state (``hetero status`` shows them).
- ``autoscale/<milliseconds>-<step>.json``: each decision of the data-tier controller
  (``training.dataplane.autoscale``, on the trainer's rank 0, for an elastic dataprep group),
  as its ``Decision.as_dict()``: ``time``, ``step``, ``from_count``, ``to_count``, ``reason``,
  ``wait_share``, ``busy_share``, ``serving``, ``acted``. The name is the decision's time in
  milliseconds, zero-padded to ``DECISION_TIME_DIGITS`` digits, so names sort by time
  (``hetero status`` shows the newest).

Each object has one writer (or, for the outcome, writers that agree), so S3's last-writer-wins
is enough: no locking.

A missing object reads as missing whether S3 answers 404 or 403 (``read_s3_object``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from training.outcome import Outcome

log = logging.getLogger(__name__)

PREFIX = "job/"
DECISIONS = "autoscale/"
"""The data-tier controller's decisions, under ``PREFIX``."""
DECISION_TIME_DIGITS = 15
"""Zero-padding of a decision's milliseconds: 15 digits last until the year 33658."""

_NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
"""Error codes S3 gives a missing key when the caller may list the bucket."""


def read_s3_object(client: Any, bucket: str, key: str) -> bytes | None:
    """The object's bytes, or None when the object does not exist.

    S3 says "does not exist" with 404 ``NoSuchKey`` only to a caller that has ``s3:ListBucket``
    on the bucket; to one without it, the same GetObject is 403 AccessDenied
    (https://docs.aws.amazon.com/AmazonS3/latest/API/API_GetObject.html, "Permissions": "If you
    don't have the s3:ListBucket permission, Amazon S3 returns an HTTP status code 403"). The
    instance role's ListBucket is conditioned on ``s3:prefix`` (``infra/cluster.py``,
    ``CheckpointListing``), a key GetObject does not carry, so on a 403 this probes with
    ListObjectsV2 on the exact key (``Prefix`` = the key, ``MaxKeys`` 1), which that grant does
    cover: a listing without the key means absent; otherwise (the key is there, or the probe
    fails too) the original error is raised, so a real permission problem never reads as
    "absent".
    """
    from botocore.exceptions import ClientError

    try:
        resp = client.get_object(Bucket=bucket, Key=key)
    except ClientError as e:
        error = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if error.get("Code") in _NOT_FOUND:
            return None
        if status != 403 and error.get("Code") != "AccessDenied":
            raise
        try:
            listed = client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
        except ClientError as probe:
            log.warning("s3://%s/%s: GetObject denied, and listing the key failed: %s",
                        bucket, key, probe)  # fmt: skip
            raise e from probe
        if any(o.get("Key") == key for o in listed.get("Contents", [])):
            raise  # The object exists and reading it is denied: a real permission problem.
        return None
    return bytes(resp["Body"].read())


class _Backend(Protocol):
    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, body: bytes) -> None: ...
    def list(self, prefix: str) -> list[str]: ...


class _S3Backend:
    def __init__(self, uri: str, client: Any | None = None) -> None:
        from training.trainer.checkpoint_s3 import parse_s3_uri

        self.bucket, self.prefix = parse_s3_uri(uri)
        if client is None:
            import boto3

            client = boto3.client("s3")
        self.client = client

    def get(self, key: str) -> bytes | None:
        return read_s3_object(self.client, self.bucket, self.prefix + key)

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=body)

    def list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        for page in pages:
            keys.extend(o["Key"][len(self.prefix) :] for o in page.get("Contents", []))
        return keys


class _FolderBackend:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def get(self, key: str) -> bytes | None:
        try:
            return (self.folder / key).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, key: str, body: bytes) -> None:
        path = self.folder / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(body)
        tmp.replace(path)

    def list(self, prefix: str) -> list[str]:
        base = self.folder / prefix
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.folder).as_posix() for p in base.rglob("*") if p.is_file())


class JobRecord:
    """Read and write the job record under ``location`` (``s3://...`` or a folder path)."""

    def __init__(self, location: str, *, s3_client: Any | None = None) -> None:
        self.location = location.rstrip("/") + "/"
        self._store: _Backend
        if location.startswith("s3://"):
            self._store = _S3Backend(location, s3_client)
        else:
            self._store = _FolderBackend(Path(location))

    def _get_json(self, key: str) -> dict[str, Any] | None:
        body = self._store.get(PREFIX + key)
        if body is None:
            return None
        try:
            value = json.loads(body)
        except ValueError:
            log.warning("job record %s%s%s is not JSON: ignored", self.location, PREFIX, key)
            return None
        return value if isinstance(value, dict) else None

    def _put_json(self, key: str, value: Mapping[str, Any]) -> None:
        self._store.put(PREFIX + key, json.dumps({"time": time.time(), **value}).encode())

    # -- outcome -----------------------------------------------------------------------------

    def outcome(self) -> dict[str, Any] | None:
        """The job's final outcome, or None while the job is not over."""
        return self._get_json("outcome.json")

    def end(self, outcome: Outcome, *, reason: str, by: str) -> dict[str, Any]:
        """Record the job's end (``finished``, ``failed``, or ``stopped`` by its budget); a job
        already ended keeps its first outcome, which is returned."""
        current = self.outcome()
        if current is not None:
            return current
        value = {"outcome": outcome.value, "reason": reason, "by": by, "time": time.time()}
        self._put_json("outcome.json", value)
        log.info("job record: outcome %s (%s)", outcome.value, reason)
        return value

    def started(self, now: float) -> float:
        """The job's start for its budget: ``started.json``'s, else ``now``, written there.
        Hosts that start together may both write; their times differ by seconds and the last
        write stays for everyone after."""
        current = self.started_at()
        if current is not None:
            return current
        self._put_json("started.json", {"started": now})
        return now

    def started_at(self) -> float | None:
        """``started.json``'s time, or None when no host has written it (read only)."""
        current = self._get_json("started.json")
        value = current.get("started") if current else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        return None

    # -- hosts -------------------------------------------------------------------------------

    def mark_leaving(self, instance_id: str, reason: str) -> None:
        """This host is about to go (interruption notice, Auto Scaling termination)."""
        self._put_json(
            f"leaving/{instance_id}.json", {"instance_id": instance_id, "reason": reason}
        )

    def leaving(self) -> set[str]:
        """Instance ids that said they are leaving."""
        out = set()
        for key in self._store.list(PREFIX + "leaving/"):
            name = key.rsplit("/", 1)[-1]
            if name.endswith(".json"):
                out.add(name[: -len(".json")])
        return out

    def mark_replaced(self, instance_id: str, *, group: str | None, reason: str) -> None:
        """This instance could not start the launcher's job loop and leaves its group
        (``early_exit``); one object per instance, so a restarted launcher counts once."""
        self._put_json(
            f"replaced/{instance_id}.json",
            {"instance_id": instance_id, "group": group, "reason": reason},
        )

    def replaced(self) -> dict[str, dict[str, Any]]:
        """The instances taken out of service so far, by id (the job's replacement count)."""
        out: dict[str, dict[str, Any]] = {}
        for key in self._store.list(PREFIX + "replaced/"):
            name = key[len(PREFIX) :]
            if name.endswith(".json"):
                out[name[len("replaced/") : -len(".json")]] = self._get_json(name) or {}
        return out

    def set_host(self, instance_id: str, **state: Any) -> None:
        """This host's latest state (group, address, generation, step, outcome...)."""
        self._put_json(f"hosts/{instance_id}.json", {"instance_id": instance_id, **state})

    # -- data tier ---------------------------------------------------------------------------

    def add_decision(self, decision: Mapping[str, Any]) -> None:
        """One decision of the data-tier controller (its one writer): ``autoscale/<time in
        milliseconds, zero-padded>-<step>.json``, the decision as given."""
        millis = round(float(decision["time"]) * 1000)
        key = f"{DECISIONS}{millis:0{DECISION_TIME_DIGITS}d}-{int(decision['step'])}.json"
        self._put_json(key, decision)

    def decisions(self, limit: int = 5) -> list[dict[str, Any]]:
        """The newest ``limit`` decisions, oldest first (none: an empty list)."""
        if limit <= 0:
            return []
        found: list[tuple[tuple[int, int], str]] = []
        for key in self._store.list(PREFIX + DECISIONS):
            name = key[len(PREFIX) :]
            millis, _, step = name[len(DECISIONS) :].removesuffix(".json").partition("-")
            if name.endswith(".json") and millis.isdigit() and step.isdigit():
                found.append(((int(millis), int(step)), name))
        out = []
        for _, name in sorted(found)[-limit:]:
            value = self._get_json(name)
            if value is not None:
                out.append(value)
        return out

    def hosts(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for key in self._store.list(PREFIX + "hosts/"):
            name = key[len(PREFIX) :]
            value = self._get_json(name)
            if value is not None:
                out[str(value.get("instance_id", name))] = value
        return out
