"""The launch plan: everything ``hetero launch`` will do on this host, decided before anything
starts (pure: nothing here starts a process or calls AWS), and how it is shown."""

from __future__ import annotations

import logging
import shlex
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from training.common.names import ENV_CHECKPOINT_URI, ENV_INIT_URI, ENV_REGION
from training.common.s3 import is_s3_uri
from training.launcher import efa, peers
from training.launcher.backends import ANY_ADDRESS, LOOPBACK, Backend, Place
from training.launcher.group import GroupIdentity
from training.processes import roles
from training.spec import ClusterSpec, Role

log = logging.getLogger(__name__)


def checkpoint_staging_dir(tmpdir: str | Path | None = None) -> str:
    """This host's staging folder for checkpoint shards on their way to S3: under the temporary
    folder (``TMPDIR``, else ``/tmp``), never in a run folder that SageMaker would upload.
    Hosts that share a machine (``hetero rehearse``) must give each its own ``TMPDIR``;
    ``tmpdir`` names another host's (the rehearsal watches an instance's staging folder)."""
    return str(Path(tmpdir or tempfile.gettempdir()) / "hetero" / "checkpoints")


@dataclass(frozen=True)
class LaunchPlan:
    """Everything this host will do, decided before anything starts."""

    backend: Backend
    identity: GroupIdentity
    role: Role
    peers: peers.Peers
    commands: tuple[tuple[str, roles.RoleCommand], ...]
    """(name, command) for each process of the role."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables added for every process of the role."""
    checkpoint_s3_uri: str | None = None
    """Trainer with an ``s3://`` checkpoint URI: passed as ``--checkpoint-s3-uri``; the trainer
    uploads every host's shards and downloads the newest step on resume itself."""
    checkpoint_dir: str | None = None
    """The trainer's checkpoint folder when the launcher chose it (else the spec's); with an S3
    URI, each host's local staging folder."""
    serves: tuple[str, ...] = ()
    """A data server host's servers, ``host:port`` as the trainers reach them."""


def make_plan(
    spec: ClusterSpec,
    *,
    spec_path: str,
    identity: GroupIdentity,
    place: Place,
    found_peers: peers.Peers,
    run_dir: str | None,
    environ: Mapping[str, str],
    network_interface: str | None = None,
    efa_env: Mapping[str, str] | None = None,
    rendezvous_port: int = roles.RENDEZVOUS_PORT,
    rendezvous_timeout_s: int | None = None,
    outcome_dir: str | None = None,
) -> LaunchPlan:
    """The role's commands for this host (pure: nothing is started). ``efa_env``: the trainer's
    network variables, decided at start-up by ``efa.trainer_network``."""
    group = spec.group(identity.group)
    env: dict[str, str] = {}
    uri = environ.get(ENV_CHECKPOINT_URI, "").strip()
    checkpoint_s3_uri: str | None = None
    checkpoint_dir: str | None = None
    if is_s3_uri(uri):
        checkpoint_s3_uri, checkpoint_dir = uri, checkpoint_staging_dir()
    else:
        checkpoint_dir = uri or place.checkpoint_dir()
    serves: tuple[str, ...] = ()
    if group.role is Role.TRAINER:
        if network_interface:
            env["NCCL_SOCKET_IFNAME"] = network_interface
        if identity.region and spec.dataprep_groups:  # EC2 (IMDS): where to look for servers
            env.setdefault(ENV_REGION, identity.region)
        # EFA or TCP sockets, decided once at start-up: FI_* variables only where EFA works.
        env.update(efa_env or {})
        # A timm: init's staged copy, from the job pointer (the EC2 launcher puts it here).
        init_uri = environ.get(ENV_INIT_URI, "").strip()
        if init_uri:
            env[ENV_INIT_URI] = init_uri
        cmd = roles.trainer_command(
            spec,
            spec_path=spec_path,
            run_dir=run_dir or place.run_dir(spec),
            trainer_hosts=found_peers.trainer_hosts(spec),
            node_rank=found_peers.self_index,
            data_servers=place.data_servers(spec, identity, found_peers),
            checkpoint_dir=checkpoint_dir,
            rendezvous_port=rendezvous_port,
            rendezvous_timeout_s=rendezvous_timeout_s,
            outcome_dir=outcome_dir,
            autoscale=place.autoscale(spec, identity),
            env=env,
        )
        if checkpoint_s3_uri is not None:
            cmd = roles.RoleCommand((*cmd.argv, "--checkpoint-s3-uri", checkpoint_s3_uri), cmd.env)
        commands: tuple[tuple[str, roles.RoleCommand], ...] = (("trainer", cmd),)
    else:
        host = place.server_host(identity)
        base = place.server_port(spec, group, found_peers)
        commands = tuple(
            (
                f"data-server-{i}",
                roles.RoleCommand(
                    roles.data_server_command(
                        spec_path=spec_path, port=base + i, host=host, outcome_dir=outcome_dir
                    ).argv,
                    env,
                ),
            )
            for i in range(group.ranks_per_instance)
        )
        reach = LOOPBACK if host == ANY_ADDRESS else host
        serves = tuple(f"{reach}:{base + i}" for i in range(group.ranks_per_instance))
    return LaunchPlan(
        backend=place.name,
        identity=identity,
        role=group.role,
        peers=found_peers,
        commands=commands,
        env=env,
        checkpoint_s3_uri=checkpoint_s3_uri if group.role is Role.TRAINER else None,
        checkpoint_dir=checkpoint_dir if group.role is Role.TRAINER else None,
        serves=serves,
    )


def trainer_efa_env(
    spec: ClusterSpec, identity: GroupIdentity, place: Place
) -> dict[str, str] | None:
    """A trainer's EFA and NCCL variables (``efa.trainer_network``, which logs its decision);
    None, logged, when the group has efa = "on" and this host cannot give NCCL EFA. Local runs
    talk over loopback on one machine: EFA plays no part there (``Place.uses_efa``)."""
    group = spec.group(identity.group)
    if group.role is not Role.TRAINER or not place.uses_efa:
        return {}
    try:
        return dict(efa.trainer_network(group).env)
    except efa.EfaUnavailable as e:
        log.error("%s", e)
        return None


def log_plan(plan: LaunchPlan) -> None:
    log.info(
        "backend %s, group %r (%s), host %d of %d",
        plan.backend.value,
        plan.identity.group,
        plan.role.value,
        plan.peers.self_index + 1,
        len(plan.peers.hosts[plan.identity.group]),
    )


def print_plan(plan: LaunchPlan) -> None:
    for name, cmd in plan.commands:
        extra = " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items())
        print(f"{name}: {extra + ' ' if extra else ''}{shlex.join(cmd.argv)}")
