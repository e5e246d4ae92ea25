"""Where the data servers are: a discovery source the client asks every few seconds.

A source returns the ``host:port`` of every data server that should exist now; the client
(``training.dataplane.membership``) health-checks new addresses before they get work, retries
failed ones with backoff and forgets addresses the source no longer lists. Sources:

- ``StaticServers``: a fixed list (``--data-servers host:port,host:port``);
- ``FileServers``: a file with one ``host:port`` per line, read again on every refresh
  (``--data-servers file:PATH``; anything that can write a file can steer the client);
- ``SageMakerServers``: the dataprep groups' hosts in SageMaker's ``resourceconfig.json``
  (``--data-servers sagemaker[:PATH]``);
- ``Ec2Servers``: ``DescribeInstances`` by the cluster's tags, running and not terminating in
  their Auto Scaling group (``--data-servers ec2[:CLUSTER]``);
- ``loopback``: the local run's ports on 127.0.0.1 (a ``StaticServers``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from training.common import aws
from training.common.hosts import (
    LOOPBACK,
    list_cluster_instances,
    sagemaker_hosts,
    terminating_instances,
)
from training.common.names import ENV_REGION, SAGEMAKER_RESOURCECONFIG
from training.spec import ClusterSpec

log = logging.getLogger(__name__)


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


def loopback_servers(spec: ClusterSpec) -> tuple[str, ...]:
    """Every data server of the spec on 127.0.0.1, on consecutive ports from the spec's port
    (a local run)."""
    port = spec.job.dataplane.port
    count = sum(g.count * g.ranks_per_instance for g in spec.dataprep_groups)
    return tuple(f"{LOOPBACK}:{port + i}" for i in range(count))


class DiscoveryError(RuntimeError):
    """The source could not be read this time (the client keeps its last answer)."""


class ServerDiscovery(Protocol):
    """Lists the data servers that should exist now."""

    def addresses(self) -> list[str]:
        """Every data server's ``host:port``, in a stable order. Raises ``DiscoveryError``."""
        ...

    def describe(self) -> str:
        """A short description for logs and errors."""
        ...


def check_address(address: str) -> str:
    """``address`` stripped, or ``ValueError`` saying what a valid one looks like."""
    text = address.strip()
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port (e.g. 127.0.0.1:50061)")
    return text


class StaticServers:
    def __init__(self, addresses: Sequence[str]) -> None:
        self._addresses = list(dict.fromkeys(check_address(a) for a in addresses if a.strip()))

    def addresses(self) -> list[str]:
        return list(self._addresses)

    def describe(self) -> str:
        return f"static list ({', '.join(self._addresses) or 'empty'})"


class FileServers:
    """Addresses from a file, one per line (``#`` comments and blank lines ignored), read again
    on every call; a missing file lists no server."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def addresses(self) -> list[str]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        except OSError as e:
            raise DiscoveryError(f"cannot read {self.path}: {e}") from e
        out: list[str] = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                out.append(check_address(line))
            except ValueError as e:
                raise DiscoveryError(f"{self.path} line {n}: {e}") from e
        return list(dict.fromkeys(out))

    def describe(self) -> str:
        return f"file {self.path}"


class SageMakerServers:
    """The spec's dataprep groups' hosts in SageMaker's resource config."""

    def __init__(self, spec: ClusterSpec, path: str | Path = SAGEMAKER_RESOURCECONFIG) -> None:
        self.spec = spec
        self.path = Path(path)

    def addresses(self) -> list[str]:
        try:
            config = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise DiscoveryError(f"cannot read SageMaker's {self.path}: {e}") from e
        return list(data_server_addresses(self.spec, sagemaker_hosts(config)))

    def describe(self) -> str:
        return f"SageMaker resource config {self.path}"


class Ec2Servers:
    """Running instances of the cluster's dataprep groups (tags ``hetero:cluster`` and
    ``hetero:group``), minus those their Auto Scaling group is terminating."""

    def __init__(
        self,
        spec: ClusterSpec,
        *,
        cluster: str | None = None,
        ec2: Any = None,
        autoscaling: Any = None,
        region: str | None = None,
    ) -> None:
        self.spec = spec
        self.cluster = cluster or spec.name
        self.region = region
        self._ec2 = ec2
        self._autoscaling = autoscaling

    def _clients(self) -> None:
        """boto3 clients, made on first use (parsing a spec needs no AWS)."""
        self._ec2 = self._ec2 or aws.client("ec2", region=self.region)
        self._autoscaling = self._autoscaling or aws.client("autoscaling", region=self.region)

    def addresses(self) -> list[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        dataprep = {g.name for g in self.spec.dataprep_groups}
        try:
            self._clients()
            grouped = list_cluster_instances(self._ec2, self.cluster)
            instances = [i for name, insts in grouped.items() if name in dataprep for i in insts]
            leaving = terminating_instances(self._autoscaling, [i["InstanceId"] for i in instances])
        except (BotoCoreError, ClientError) as e:
            raise DiscoveryError(f"DescribeInstances for cluster {self.cluster!r}: {e}") from e
        hosts = {
            name: [
                i["PrivateIpAddress"]
                for i in insts
                if i["InstanceId"] not in leaving and i.get("PrivateIpAddress")
            ]
            for name, insts in grouped.items()
            if name in dataprep
        }
        return list(data_server_addresses(self.spec, hosts))

    def describe(self) -> str:
        return f"EC2 instances tagged hetero:cluster={self.cluster}"


def ec2_arg(cluster: str) -> str:
    """``--data-servers`` on EC2: ``ec2:CLUSTER``, the data servers found by the cluster's tags
    while the trainer runs."""
    return f"ec2:{cluster}"


def file_arg(path: Path) -> str:
    """``--data-servers`` in ``hetero local`` with an elastic tier: ``file:PATH``, one address a
    line, reread as its runner starts and stops servers."""
    return f"file:{path}"


def parse_discovery(text: str, spec: ClusterSpec) -> ServerDiscovery:
    """The source named by ``--data-servers`` (as ``ec2_arg`` and ``file_arg`` make it):
    ``ec2[:CLUSTER]``, ``sagemaker[:PATH]``,
    ``file:PATH``, ``loopback``, or a comma-separated ``host:port`` list. ``ValueError`` names
    the accepted forms when ``text`` is none of them."""
    text = text.strip()
    kind, _, arg = text.partition(":")
    if kind == "ec2":
        region = os.environ.get("AWS_REGION") or os.environ.get(ENV_REGION)
        return Ec2Servers(spec, cluster=arg or None, region=region)
    if kind == "sagemaker":
        return SageMakerServers(spec, arg or SAGEMAKER_RESOURCECONFIG)
    if kind == "file":
        if not arg:
            raise ValueError("file: needs a path (file:/path/to/servers.txt)")
        return FileServers(arg)
    if kind == "loopback" and not arg:
        return StaticServers(loopback_servers(spec))
    try:
        return StaticServers(text.split(","))
    except ValueError as e:
        raise ValueError(
            f"{e}; --data-servers takes host:port[,host:port...], file:PATH, ec2[:CLUSTER], "
            "sagemaker[:PATH] or loopback"
        ) from None


def describe_sources() -> str:
    """The accepted ``--data-servers`` forms, for help texts."""
    return "host:port[,host:port...], file:PATH, ec2[:CLUSTER], sagemaker[:PATH] or loopback"


__all__ = [
    "DiscoveryError",
    "Ec2Servers",
    "FileServers",
    "SageMakerServers",
    "ServerDiscovery",
    "StaticServers",
    "check_address",
    "describe_sources",
    "parse_discovery",
]
