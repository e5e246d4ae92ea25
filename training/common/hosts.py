"""Which hosts a job has: SageMaker's resource config, and EC2 instances by the cluster's tags.

Every host derives the same order from the same answer (``algo-2`` before ``algo-10``; EC2
instances by private IP, then id), so ranks and data-server lists agree without talking.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from training.common.names import MARKET_ON_DEMAND, MARKET_SPOT, TAG_CLUSTER, TAG_GROUP

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def _host_key(host: str) -> tuple[int, str]:
    # algo-10 must come after algo-2: sort by the trailing number, then by name.
    m = re.search(r"(\d+)$", host)
    return (int(m.group(1)) if m else -1, host)


def sagemaker_hosts(resourceconfig: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Instance group name -> its hosts (``algo-2`` before ``algo-10``) in SageMaker's
    ``resourceconfig.json``."""
    groups: dict[str, tuple[str, ...]] = {}
    for entry in resourceconfig.get("instance_groups", []) or []:
        name = entry.get("instance_group_name")
        hosts = entry.get("hosts", [])
        if isinstance(name, str) and isinstance(hosts, list):
            groups[name] = tuple(sorted((str(h) for h in hosts), key=_host_key))
    return groups


def _ip_key(instance: Mapping[str, Any]) -> tuple[int, str]:
    ip = instance.get("PrivateIpAddress") or ""
    try:
        return (int(ipaddress.ip_address(ip)), instance.get("InstanceId", ""))
    except ValueError:
        return (0, instance.get("InstanceId", ""))


def cluster_instances(ec2: Any, cluster: str, *filters: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every instance tagged ``hetero:cluster=cluster`` that DescribeInstances lists for
    ``filters`` too, all pages."""
    cluster_filter = {"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]}
    pages = ec2.get_paginator("describe_instances").paginate(Filters=[cluster_filter, *filters])
    for page in pages:
        for reservation in page.get("Reservations", []):
            yield from reservation.get("Instances", [])


def tag(instance: Mapping[str, Any], key: str) -> str | None:
    return next((t["Value"] for t in instance.get("Tags", []) if t["Key"] == key), None)


def instance_market(instance: Mapping[str, Any]) -> str:
    """``spot`` for an instance DescribeInstances lists with ``InstanceLifecycle`` ``spot``,
    else ``on-demand``."""
    return MARKET_SPOT if instance.get("InstanceLifecycle") == MARKET_SPOT else MARKET_ON_DEMAND


def list_cluster_instances(ec2: Any, cluster: str) -> dict[str, list[dict[str, Any]]]:
    """Running instances tagged ``hetero:cluster=cluster``, grouped by ``hetero:group`` and sorted
    by private IP (then instance id) so that every host derives the same order."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for inst in cluster_instances(
        ec2, cluster, {"Name": "instance-state-name", "Values": ["running"]}
    ):
        group = tag(inst, TAG_GROUP)
        if group is None:
            log.warning("instance %s has no %s tag; ignored", inst["InstanceId"], TAG_GROUP)
            continue
        grouped.setdefault(group, []).append(inst)
    for instances in grouped.values():
        instances.sort(key=_ip_key)
    return grouped


def terminating_instances(autoscaling: Any, instance_ids: Sequence[str]) -> set[str]:
    """Those of ``instance_ids`` whose Auto Scaling lifecycle state is ``Terminating*``: still
    ``running`` to EC2 while a termination lifecycle hook holds them (``Terminating:Wait``)."""
    out: set[str] = set()
    ids = list(instance_ids)
    for i in range(0, len(ids), 50):  # DescribeAutoScalingInstances takes at most 50 ids.
        resp = autoscaling.describe_auto_scaling_instances(InstanceIds=ids[i : i + 50])
        for inst in resp.get("AutoScalingInstances", []):
            if str(inst.get("LifecycleState", "")).startswith("Terminating"):
                out.add(inst["InstanceId"])
    return out
