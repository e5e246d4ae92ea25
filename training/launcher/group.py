"""Which instance group is this host in? Each source is tried in a fixed order.

1. the ``--group`` flag, then the ``HETERO_GROUP`` environment variable;
2. SageMaker's ``resourceconfig.json`` (``current_group_name``) in a heterogeneous training job;
3. the EC2 instance's own ``hetero:group`` tag, read through IMDSv2 (the launch template turns
   instance metadata tags on).

If none answers, ``GroupDetectionError`` lists every source and why it gave nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from training.common.names import ENV_GROUP, SAGEMAKER_RESOURCECONFIG, TAG_CLUSTER, TAG_GROUP
from training.launcher.imds import ImdsClient, ImdsError
from training.spec import ClusterSpec

log = logging.getLogger(__name__)


class GroupSource(StrEnum):
    FLAG = "flag"
    ENV = "env"
    SAGEMAKER = "sagemaker"
    EC2 = "ec2"


@dataclass(frozen=True)
class GroupIdentity:
    """This host's instance group and what the source that named it also told us."""

    group: str
    source: GroupSource
    host: str | None = None
    """SageMaker: ``current_host`` (e.g. ``algo-2``); EC2: the private IPv4 address."""
    instance_id: str | None = None
    """EC2 only."""
    region: str | None = None
    """EC2 only: the instance's region (from IMDS)."""
    availability_zone: str | None = None
    """EC2 only: the instance's Availability Zone (from IMDS)."""
    cluster: str | None = None
    """EC2 only: the ``hetero:cluster`` tag, when present."""


class GroupDetectionError(RuntimeError):
    """No source named this host's group; ``attempts`` holds one line per source tried."""

    def __init__(self, attempts: list[str]) -> None:
        self.attempts = attempts
        lines = "\n".join(f"  - {a}" for a in attempts)
        super().__init__(
            "could not tell which instance group this host is in. Tried, in order:\n"
            f"{lines}\nPass --group NAME or set {ENV_GROUP}=NAME."
        )


def detect_group(
    spec: ClusterSpec,
    *,
    flag: str | None = None,
    environ: Mapping[str, str],
    resourceconfig: Path = Path(SAGEMAKER_RESOURCECONFIG),
    imds: ImdsClient | None = None,
) -> GroupIdentity:
    """This host's group, from the first source that names one (order in the module docstring).

    The name is checked against the spec: a name the spec lacks raises ``GroupDetectionError``
    naming the source and the spec's groups. ``imds=None`` skips the EC2 source.
    """
    attempts: list[str] = []
    found: GroupIdentity | None = None
    if flag:
        found = GroupIdentity(flag, GroupSource.FLAG)
    else:
        attempts.append("--group flag: not given")
    if found is None:
        value = environ.get(ENV_GROUP, "").strip()
        if value:
            found = GroupIdentity(value, GroupSource.ENV)
        else:
            attempts.append(f"environment variable {ENV_GROUP}: not set")
    if found is None:
        found = _from_sagemaker(resourceconfig, attempts)
    if found is None:
        if imds is None:
            attempts.append("EC2 instance tags (IMDSv2): skipped")
        else:
            found = _from_imds(imds, attempts)
    if found is None:
        raise GroupDetectionError(attempts)
    names = [g.name for g in spec.groups]
    if found.group not in names:
        raise GroupDetectionError(
            [
                *attempts,
                f"{found.source.value}: named group {found.group!r}, but the spec "
                f"({spec.source}) has only {', '.join(names)}; fix the name or the spec",
            ]
        )
    log.info("instance group %r (from %s)", found.group, found.source.value)
    return found


def read_resourceconfig(path: Path) -> dict[str, Any]:
    """The parsed SageMaker resource config; ``ValueError`` says what is wrong with it."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _from_sagemaker(path: Path, attempts: list[str]) -> GroupIdentity | None:
    where = f"SageMaker resource config {path}"
    if not path.is_file():
        attempts.append(f"{where}: no such file (not a SageMaker training job)")
        return None
    try:
        data = read_resourceconfig(path)
    except (OSError, ValueError) as e:
        attempts.append(f"{where}: unreadable ({e})")
        return None
    group = data.get("current_group_name")
    if not isinstance(group, str) or not group:
        attempts.append(
            f"{where}: has no current_group_name (not a heterogeneous job; define instance "
            "groups named like the spec's groups)"
        )
        return None
    host = data.get("current_host")
    return GroupIdentity(group, GroupSource.SAGEMAKER, host=host if isinstance(host, str) else None)


def _from_imds(imds: ImdsClient, attempts: list[str]) -> GroupIdentity | None:
    where = f"EC2 instance tag {TAG_GROUP!r} via IMDSv2 at {imds.base_url}"
    try:
        group = imds.get(f"/latest/meta-data/tags/instance/{TAG_GROUP}")
        if group is None:
            attempts.append(
                f"{where}: not found (is the tag set, and are instance metadata tags enabled "
                "in the launch template?)"
            )
            return None
        cluster = imds.get(f"/latest/meta-data/tags/instance/{TAG_CLUSTER}")
        instance_id = imds.get("/latest/meta-data/instance-id")
        host = imds.get("/latest/meta-data/local-ipv4")
        region = imds.get("/latest/meta-data/placement/region")
        zone = imds.get("/latest/meta-data/placement/availability-zone")
    except ImdsError as e:
        attempts.append(f"{where}: {e}")
        return None
    return GroupIdentity(
        group.strip(),
        GroupSource.EC2,
        host=host,
        instance_id=instance_id,
        region=region,
        availability_zone=zone,
        cluster=cluster,
    )
