"""The shared core of ``hetero preflight``: the ``Check`` row, and how an AWS error becomes one.

Every check module imports from here; this module imports none of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError
from botocore.parsers import ResponseParserError

from training.spec import ClusterSpec

log = logging.getLogger(__name__)

_MAX_PAGES = 20
"""Bound on NextToken pages per call (the requests here are small: a page or two at most)."""

# IAM action per API operation this package calls: named in the fix when a call is denied.
IAM_ACTIONS: dict[str, str] = {
    "GetCallerIdentity": "sts:GetCallerIdentity",
    "DescribeInstanceTypes": "ec2:DescribeInstanceTypes",
    "GetServiceQuota": "servicequotas:GetServiceQuota",
    "DescribeAvailabilityZones": "ec2:DescribeAvailabilityZones",
    "DescribeSubnets": "ec2:DescribeSubnets",
    "DescribeInstanceTypeOfferings": "ec2:DescribeInstanceTypeOfferings",
    "GetSpotPlacementScores": "ec2:GetSpotPlacementScores",
    "GetParameters": "ssm:GetParameters",
    "GetParameter": "ssm:GetParameter",
    "DescribeStacks": "cloudformation:DescribeStacks",
}
AWS_ERRORS = (ClientError, BotoCoreError, ResponseParserError)
"""What a call can raise when AWS (or the endpoint) says no or answers garbage; each becomes a
FAIL row. ResponseParserError is not a BotoCoreError."""
_ACCESS_DENIED = {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation"}
_BAD_CREDENTIALS = {
    "AuthFailure",
    "ExpiredToken",
    "ExpiredTokenException",
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "UnrecognizedClientException",
}
_CREDENTIALS_FIX = (
    "configure AWS credentials for the target account: AWS_PROFILE=... (aws configure / "
    "aws sso login) or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY[/AWS_SESSION_TOKEN]"
)


class Status(StrEnum):
    PASS = "PASS"
    WARN = "WARN"
    """Advisory: the deploy can go on, but may be slow to get capacity or miss a type."""
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    """One row of the preflight table."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    """What to do about a FAIL or WARN (empty for PASS)."""


def failure(name: str, error: Exception) -> Check:
    """A FAIL row for an AWS error: its code and message, and what to do about it."""
    if isinstance(error, NoCredentialsError):
        return Check(name, Status.FAIL, "NoCredentials: no AWS credentials found", _CREDENTIALS_FIX)
    if isinstance(error, NoRegionError):
        return Check(name, Status.FAIL, "NoRegion: no region", "pass --region or set AWS_REGION")
    if isinstance(error, ClientError):
        code = _code(error)
        message = error.response.get("Error", {}).get("Message", "")
        action = IAM_ACTIONS.get(error.operation_name, error.operation_name)
        detail = f"{code} on {error.operation_name}: {message}"
        if code in _ACCESS_DENIED:
            fix = f"allow {action} to the identity running preflight (an IAM policy statement)"
        elif code in _BAD_CREDENTIALS:
            fix = _CREDENTIALS_FIX
        else:
            fix = f"fix what the error says, then run preflight again (the call: {action})"
        return Check(name, Status.FAIL, detail, fix)
    # No usable answer at all (endpoint unreachable or not AWS, bad configuration).
    return Check(
        name,
        Status.FAIL,
        f"{type(error).__name__}: {error}",
        "check the network, the region and AWS_ENDPOINT_URL",
    )


def _guarded(name: str, fn: Callable[[], list[Check]]) -> list[Check]:
    try:
        return fn()
    except AWS_ERRORS as e:
        return [failure(name, e)]


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", "Unknown"))


def _spec_types(spec: ClusterSpec) -> list[str]:
    """Every instance type of the spec, once, in spec order."""
    return list(dict.fromkeys(t for g in spec.groups for t in g.instance_types))


def _pages(call: Callable[..., dict[str, Any]], **kwargs: Any) -> Iterator[dict[str, Any]]:
    """Pages of a NextToken-paged call, bounded to ``_MAX_PAGES``."""
    token: str | None = None
    for _ in range(_MAX_PAGES):
        page = call(**kwargs, **({"NextToken": token} if token else {}))
        yield page
        token = page.get("NextToken")
        if not token:
            return
    log.warning("stopped after %d pages of %s", _MAX_PAGES, getattr(call, "__name__", call))
