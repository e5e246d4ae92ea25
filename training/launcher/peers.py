"""Who else is in the cluster: trainer hosts (in rendezvous order) and data server addresses.

Every host computes the same ordering on its own (no coordination): SageMaker's host names
sorted by their number, EC2 instances sorted by private IP (``membership.py`` builds the
trainer's elastic membership on EC2 from them), loopback locally.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from training.launcher.names import CLUSTER_TAG, GROUP_TAG
from training.spec import ClusterSpec

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class PeerDiscoveryError(RuntimeError):
    """The cluster's hosts could not be listed or did not all appear in time."""


@dataclass(frozen=True)
class Peers:
    """The cluster as this host sees it."""

    hosts: Mapping[str, tuple[str, ...]]
    """Group name -> its hosts' addresses, in the order every host agrees on."""
    data_servers: tuple[str, ...]
    """``host:port`` of every data server (each dataprep host runs ``ranks_per_instance``)."""
    self_index: int
    """This host's position in its own group's ``hosts`` (the trainer's node rank)."""

    def trainer_hosts(self, spec: ClusterSpec) -> tuple[str, ...]:
        return self.hosts[spec.trainer_group.name]


def data_server_addresses(
    spec: ClusterSpec, hosts: Mapping[str, Sequence[str]], base_port: int | None = None
) -> tuple[str, ...]:
    """``host:port`` for each data server: ports ``base_port + i`` for the i-th on a host."""
    port = spec.job.dataplane.port if base_port is None else base_port
    out: list[str] = []
    for g in spec.dataprep_groups:
        for host in hosts.get(g.name, ()):
            out.extend(f"{host}:{port + i}" for i in range(g.ranks_per_instance))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Local: every group on loopback.


def local_peers(spec: ClusterSpec, self_index: int = 0) -> Peers:
    """All groups on 127.0.0.1; data servers on consecutive ports from the spec's port."""
    hosts = {g.name: (LOOPBACK,) * g.count for g in spec.groups}
    servers: list[str] = []
    port = spec.job.dataplane.port
    for g in spec.dataprep_groups:
        for _ in range(g.count * g.ranks_per_instance):
            servers.append(f"{LOOPBACK}:{port}")
            port += 1
    return Peers(hosts=hosts, data_servers=tuple(servers), self_index=self_index)


# --------------------------------------------------------------------------------------------
# SageMaker heterogeneous training jobs.


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


def sagemaker_peers(spec: ClusterSpec, resourceconfig: Mapping[str, Any]) -> Peers:
    """Peers from SageMaker's ``resourceconfig.json`` (``instance_groups`` and ``current_host``).

    Every spec group must appear as an instance group of the job with the same name.
    """
    groups = sagemaker_hosts(resourceconfig)
    missing = [g.name for g in spec.groups if g.name not in groups]
    if missing:
        raise PeerDiscoveryError(
            f"SageMaker job has no instance group named {', '.join(map(repr, missing))} "
            f"(it has: {', '.join(groups) or 'none'}); name the job's InstanceGroups like the "
            "spec's groups"
        )
    for g in spec.groups:
        if len(groups[g.name]) != g.count:
            log.warning(
                "SageMaker group %r has %d hosts; the spec says %d (using the job's hosts)",
                g.name,
                len(groups[g.name]),
                g.count,
            )
    current = resourceconfig.get("current_host")
    own_group = resourceconfig.get("current_group_name")
    if not isinstance(own_group, str) or own_group not in groups:
        raise PeerDiscoveryError(f"resource config current_group_name {own_group!r} is unknown")
    if current not in groups[own_group]:
        raise PeerDiscoveryError(
            f"current_host {current!r} is not among group {own_group!r}'s hosts "
            f"{list(groups[own_group])}"
        )
    return Peers(
        hosts=groups,
        data_servers=data_server_addresses(spec, groups),
        self_index=groups[own_group].index(current),
    )


# --------------------------------------------------------------------------------------------
# EC2: DescribeInstances by the cluster's tags.


def _ip_key(instance: Mapping[str, Any]) -> tuple[int, str]:
    ip = instance.get("PrivateIpAddress") or ""
    try:
        return (int(ipaddress.ip_address(ip)), instance.get("InstanceId", ""))
    except ValueError:
        return (0, instance.get("InstanceId", ""))


def list_cluster_instances(ec2: Any, cluster: str) -> dict[str, list[dict[str, Any]]]:
    """Running instances tagged ``hetero:cluster=cluster``, grouped by ``hetero:group`` and sorted
    by private IP (then instance id) so that every host derives the same order."""
    paginator = ec2.get_paginator("describe_instances")
    pages = paginator.paginate(
        Filters=[
            {"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]},
            {"Name": "instance-state-name", "Values": ["running"]},
        ]
    )
    grouped: dict[str, list[dict[str, Any]]] = {}
    for page in pages:
        for reservation in page.get("Reservations", []):
            for inst in reservation.get("Instances", []):
                tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                group = tags.get(GROUP_TAG)
                if group is None:
                    log.warning("instance %s has no %s tag; ignored", inst["InstanceId"], GROUP_TAG)
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
