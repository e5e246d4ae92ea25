"""Who else is in the cluster: trainer hosts (in rendezvous order) and data server addresses.

Every host computes the same ordering on its own (no coordination): SageMaker's host names
sorted by their number, EC2 instances sorted by private IP (``membership.py`` builds the
trainer's elastic membership on EC2 from them), loopback locally.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from training.common.hosts import LOOPBACK, sagemaker_hosts
from training.dataplane.discovery import data_server_addresses, loopback_servers
from training.spec import ClusterSpec

log = logging.getLogger(__name__)

EXIT_PEERS = 3
"""``hetero launch``'s exit code when this host's peers were not found."""


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


# --------------------------------------------------------------------------------------------
# Local: every group on loopback.


def local_peers(spec: ClusterSpec, self_index: int = 0) -> Peers:
    """All groups on 127.0.0.1; data servers on consecutive ports from the spec's port."""
    hosts = {g.name: (LOOPBACK,) * g.count for g in spec.groups}
    return Peers(hosts=hosts, data_servers=loopback_servers(spec), self_index=self_index)


# --------------------------------------------------------------------------------------------
# SageMaker heterogeneous training jobs.


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
