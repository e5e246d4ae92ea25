"""S3 URIs, and reading, heading and listing objects ("does this object exist" included).

Clients come from ``training.common.aws.client``."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

SCHEME = "s3://"
NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
"""Error codes S3 gives a missing key (GetObject, HeadObject) when the caller may list the
bucket."""


def is_s3_uri(location: str) -> bool:
    return location.startswith(SCHEME)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, key prefix ending in '/' or empty) of ``s3://bucket/prefix``; ValueError naming
    the URI when it is not one."""
    if not is_s3_uri(uri):
        raise ValueError(f"{uri!r} is not an s3:// URI (expected s3://bucket/prefix)")
    bucket, _, prefix = uri[len(SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} has no bucket name (expected s3://bucket/prefix)")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def parse_s3_object(uri: str) -> tuple[str, str]:
    """(bucket, key) of one object's ``s3://bucket/path/name``; ValueError naming the URI when it
    is not an object's URI (no bucket, no key, or a key ending in '/')."""
    if not is_s3_uri(uri):
        raise ValueError(f"{uri!r} is not an s3:// URI (expected s3://bucket/path/name)")
    bucket, _, key = uri[len(SCHEME) :].partition("/")
    if not bucket or not key or key.endswith("/"):
        raise ValueError(f"{uri!r} is not an object's URI (expected s3://bucket/path/name)")
    return bucket, key


def s3_uri(bucket: str, key: str = "") -> str:
    return f"{SCHEME}{bucket}/{key}"


DENIED = frozenset({"AccessDenied", "403", "Forbidden", "AllAccessDisabled"})
"""Error codes S3 gives a request the caller may not make, and a missing key to a caller that
may not list the bucket."""


def error_code(error: Exception) -> str:
    """The error code of a botocore ``ClientError`` (``""`` for any other exception)."""
    response = getattr(error, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def is_denied(error: Exception) -> bool:
    """Whether ``error`` (a botocore ``ClientError``) is S3's 403."""
    return error_code(error) in DENIED


def is_not_found(error: Exception) -> bool:
    """Whether ``error`` (a botocore ``ClientError``) says the object does not exist."""
    return error_code(error) in NOT_FOUND


def head_object(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """The object's HeadObject answer, or None when it does not exist."""
    from botocore.exceptions import ClientError

    try:
        return dict(client.head_object(Bucket=bucket, Key=key))
    except ClientError as e:
        if is_not_found(e):
            return None
        raise


def read_object(client: Any, bucket: str, key: str) -> bytes | None:
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
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if is_not_found(e):
            return None
        if status != 403 and e.response.get("Error", {}).get("Code") != "AccessDenied":
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


def list_keys(client: Any, bucket: str, prefix: str, *, delimiter: str | None = None) -> list[str]:
    """Every key under ``prefix`` (with ``delimiter='/'``: only those not in a sub-prefix)."""
    kwargs = {"Delimiter": delimiter} if delimiter else {}
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, **kwargs)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def list_prefixes(client: Any, bucket: str, prefix: str) -> list[str]:
    """The sub-prefixes one level under ``prefix`` (``Delimiter='/'``), never the keys: those
    of ``sub_prefix`` of every key under ``prefix``."""
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix, Delimiter="/"
    )
    return [p["Prefix"] for page in pages for p in page.get("CommonPrefixes", [])]


def sub_prefix(prefix: str, key: str) -> str | None:
    """The name of the sub-prefix one level under ``prefix`` that ``key`` is in (``a`` for
    ``<prefix>a/b/c.jpg``), None for a key directly under ``prefix``: how ``list_prefixes``
    (S3's ``CommonPrefixes``) groups the keys, told from a key."""
    name, slash, _ = key[len(prefix) :].partition("/")
    return name if slash else None
