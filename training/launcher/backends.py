"""Where ``hetero launch`` runs, as an object: the local run, EC2 and SageMaker each answer the
few questions the launcher asks of a place, so no ``if backend is ...`` chain is written
anywhere else (as torchtitan bundles a model's functions in one spec).

What a place decides:

- ``runs_generations``: EC2 runs the role in generations until the job is over, with its own
  start-up and failure handling (``ec2_start``); the local run and SageMaker run it once.
- ``checks_driver``: whether a trainer host must have a GPU driver that fits the image (a local
  run may be CPU-only); ``uses_efa``: whether a trainer may use EFA (a local run is loopback).
- ``run_dir``: the trainer's output folder when ``--run-dir`` gives none; ``checkpoint_dir``:
  its checkpoint folder when the job gives none (SageMaker syncs its own with S3).
- ``find_peers``: the hosts of a job whose hosts are fixed for its lifetime (local, SageMaker);
  EC2 finds them generation by generation (``membership``).
- ``data_servers``, ``autoscale``: where the trainer finds its data servers and what actuates an
  elastic data tier, as the trainer's ``--data-servers`` and ``--autoscale`` take them
  (``training.dataplane.discovery``, ``training.dataplane.autoscale``: each value is made and
  parsed there).
- ``server_host``, ``server_port``: where a data server listens.
- ``record_unfit``: where a host that cannot run its role says why, beyond its exit code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from training.common.files import write_atomically
from training.common.hosts import LOOPBACK
from training.common.names import SAGEMAKER_CHECKPOINT_DIR, SAGEMAKER_OUTPUT_DIR
from training.dataplane import autoscale, discovery
from training.launcher import peers
from training.launcher.group import GroupIdentity, GroupSource, read_resourceconfig
from training.launcher.imds import ImdsClient, ImdsError
from training.spec import ClusterSpec, InstanceGroup

log = logging.getLogger(__name__)

ANY_ADDRESS = "0.0.0.0"


class Backend(StrEnum):
    """A place's name (``hetero launch --backend``, the logs)."""

    LOCAL = "local"
    EC2 = "ec2"
    SAGEMAKER = "sagemaker"


@dataclass(frozen=True)
class Place:
    """What every place answers the same way; each place overrides what it does differently."""

    name: Backend
    runs_generations: bool = False
    checks_driver: bool = True
    uses_efa: bool = True

    def run_dir(self, spec: ClusterSpec) -> str:
        return f"runs/{spec.name}"

    def checkpoint_dir(self) -> str | None:
        """The trainer's checkpoint folder when the job names none (None: the spec's)."""
        return None

    def find_peers(
        self, spec: ClusterSpec, resourceconfig: Path, host_index: int
    ) -> tuple[peers.Peers, str | None]:
        """Every host of the job and this one's index, and the network interface the trainers
        talk over where the place names one."""
        raise NotImplementedError(f"the {self.name} backend finds its peers in each generation")

    def data_servers(
        self, spec: ClusterSpec, identity: GroupIdentity, found: peers.Peers
    ) -> tuple[str, ...]:
        """The trainer's ``--data-servers``: the servers found at start-up."""
        return found.data_servers

    def autoscale(self, spec: ClusterSpec, identity: GroupIdentity) -> str:
        """The trainer's ``--autoscale`` ("": no actuator)."""
        return ""

    def server_host(self, identity: GroupIdentity) -> str:
        return ANY_ADDRESS

    def server_port(self, spec: ClusterSpec, group: InstanceGroup, found: peers.Peers) -> int:
        """The first port of this host's data servers (one more for each further server)."""
        return spec.job.dataplane.port

    def record_unfit(self, why: str, failure_file: Path) -> None:
        """Say, where the place reads it, that this host cannot run its role."""


@dataclass(frozen=True)
class Local(Place):
    """Every host a process on this machine (``hetero launch --backend local``, the tests)."""

    name: Backend = Backend.LOCAL
    checks_driver: bool = False
    uses_efa: bool = False

    def find_peers(
        self, spec: ClusterSpec, resourceconfig: Path, host_index: int
    ) -> tuple[peers.Peers, str | None]:
        return peers.local_peers(spec, self_index=host_index), None

    def server_host(self, identity: GroupIdentity) -> str:
        return LOOPBACK

    def server_port(self, spec: ClusterSpec, group: InstanceGroup, found: peers.Peers) -> int:
        # On loopback every dataprep host needs its own ports.
        return spec.job.dataplane.port + found.self_index * group.ranks_per_instance


@dataclass(frozen=True)
class Ec2(Place):
    """An instance of the cluster's Auto Scaling groups."""

    name: Backend = Backend.EC2
    runs_generations: bool = True

    def data_servers(
        self, spec: ClusterSpec, identity: GroupIdentity, found: peers.Peers
    ) -> tuple[str, ...]:
        # The trainer keeps looking for data servers by the cluster's tags while it runs (a
        # replacement comes back at a new address).
        if not spec.dataprep_groups:
            return found.data_servers
        return (discovery.ec2_arg(identity.cluster or spec.name),)

    def autoscale(self, spec: ClusterSpec, identity: GroupIdentity) -> str:
        return autoscale.asg_arg(spec, identity.cluster or spec.name)

    def server_host(self, identity: GroupIdentity) -> str:
        # The instance's own private address: the one its peers find it by.
        return identity.host or ANY_ADDRESS


@dataclass(frozen=True)
class SageMaker(Place):
    """A host of a SageMaker heterogeneous training job: its hosts are fixed for its lifetime
    (a managed Spot restart starts the whole job again), so the list found at start-up
    suffices."""

    name: Backend = Backend.SAGEMAKER

    def run_dir(self, spec: ClusterSpec) -> str:
        return SAGEMAKER_OUTPUT_DIR

    def checkpoint_dir(self) -> str | None:
        # SageMaker syncs this folder with the job's CheckpointConfig S3 URI (managed Spot).
        return SAGEMAKER_CHECKPOINT_DIR

    def find_peers(
        self, spec: ClusterSpec, resourceconfig: Path, host_index: int
    ) -> tuple[peers.Peers, str | None]:
        config = read_resourceconfig(resourceconfig)
        return peers.sagemaker_peers(spec, config), config.get("network_interface_name")

    def autoscale(self, spec: ClusterSpec, identity: GroupIdentity) -> str:
        return autoscale.report_arg(spec)

    def record_unfit(self, why: str, failure_file: Path) -> None:
        # The job's FailureReason; SageMaker does not restart a failed container.
        try:
            write_atomically(failure_file, why + "\n")
        except OSError as e:
            log.error("could not write the failure reason to %s: %s", failure_file, e)


PLACES: dict[Backend, Place] = {p.name: p for p in (Local(), Ec2(), SageMaker())}
"""Each backend's place."""


def asks_imds(requested: str) -> bool:
    """Whether finding this host's group may ask the instance metadata service: not when
    ``--backend`` names a place without one."""
    return requested not in (Backend.LOCAL, Backend.SAGEMAKER)


def choose_place(
    requested: str, identity: GroupIdentity, resourceconfig: Path, imds: ImdsClient
) -> Place:
    """The place: as requested (``--backend``), else from the group's source; a group given by
    flag or env is on SageMaker if the resource config exists, on EC2 if IMDS answers, else
    local."""
    if requested != "auto":
        return PLACES[Backend(requested)]
    if identity.source is GroupSource.SAGEMAKER:
        return PLACES[Backend.SAGEMAKER]
    if identity.source is GroupSource.EC2:
        return PLACES[Backend.EC2]
    if resourceconfig.is_file():
        return PLACES[Backend.SAGEMAKER]
    try:
        if imds.get("/latest/meta-data/instance-id"):
            return PLACES[Backend.EC2]
    except ImdsError:
        pass
    return PLACES[Backend.LOCAL]
