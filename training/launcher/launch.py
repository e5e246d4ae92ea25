"""``hetero launch``: the container's entry point on every instance.

Finds this host's instance group, finds its peers, runs the group's role under supervision,
watches for Spot interruption on EC2 and, when the trainer's first host finishes successfully on
EC2, scales the cluster's Auto Scaling groups to zero.

Exit codes: the role's own exit code (0: the job is done); 2: bad spec or no group; 3: peers not
found; 128+N: stopped by signal N or, on a Spot notice, 143 (SIGTERM): the trainer checkpointed
and the replacement instance resumes.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from training.launcher import job_end, peers, roles
from training.launcher.group import (
    SAGEMAKER_RESOURCECONFIG,
    GroupDetectionError,
    GroupIdentity,
    GroupSource,
    detect_group,
    read_resourceconfig,
)
from training.launcher.imds import DEFAULT_IMDS_URL, ImdsClient, ImdsError
from training.launcher.names import (
    CLUSTER_TAG,
    ENV_CHECKPOINT_URI,
    ENV_CLUSTER,
    ENV_REGION,
    ENV_SPEC,
)
from training.launcher.spot import SpotWatcher
from training.launcher.supervisor import Supervisor, exit_code_for_signal
from training.spec import ClusterSpec, Role, load_spec

log = logging.getLogger(__name__)

EXIT_CONFIG = 2
EXIT_PEERS = 3
SAGEMAKER_CHECKPOINT_DIR = "/opt/ml/checkpoints"
SAGEMAKER_OUTPUT_DIR = "/opt/ml/output/data"
CHECKPOINT_CACHE = "/tmp/hetero/checkpoints"


class Backend(StrEnum):
    LOCAL = "local"
    EC2 = "ec2"
    SAGEMAKER = "sagemaker"


@dataclass(frozen=True)
class LaunchPlan:
    """Everything this host will do, decided before anything starts."""

    backend: Backend
    identity: GroupIdentity
    role: Role
    peers: peers.Peers
    commands: tuple[tuple[str, roles.RoleCommand], ...]
    """(name, command) for each process of the role."""
    job_leader: bool
    """True on the first trainer host: it ends the job (scales the groups to zero on EC2)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables added for every process of the role."""
    checkpoint_s3_uri: str | None = None
    """Trainer with an ``s3://`` checkpoint URI: passed as ``--checkpoint-s3-uri``; the trainer
    uploads every host's shards and downloads the newest step on resume itself."""
    checkpoint_dir: str | None = None
    """The trainer's checkpoint folder when the launcher chose it (else the spec's); with an S3
    URI, each host's local staging folder."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec",
        default=os.environ.get(ENV_SPEC, "cluster.toml"),
        help=f"cluster spec (default: ${ENV_SPEC} or cluster.toml)",
    )
    parser.add_argument("--group", help="this host's instance group (wins over detection)")
    parser.add_argument(
        "--backend",
        choices=["auto", *[b.value for b in Backend]],
        default="auto",
        help="where peers come from (default auto: from where the group was found)",
    )
    parser.add_argument("--run-dir", help="trainer output folder (default: per backend)")
    parser.add_argument(
        "--host-index",
        type=int,
        default=0,
        help="local backend only: this host's index in its group (trainer node rank)",
    )
    parser.add_argument(
        "--resourceconfig",
        default=str(SAGEMAKER_RESOURCECONFIG),
        help="SageMaker resource config path",
    )
    parser.add_argument("--imds-url", default=DEFAULT_IMDS_URL, help="instance metadata endpoint")
    parser.add_argument("--imds-timeout", type=float, default=1.0, help="seconds per IMDS call")
    parser.add_argument(
        "--peer-timeout", type=float, default=900.0, help="seconds to wait for every peer (EC2)"
    )
    parser.add_argument(
        "--spot-poll", type=float, default=5.0, help="seconds between Spot notice polls (EC2)"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=90.0,
        help="seconds the role gets to checkpoint and exit after SIGTERM before it is killed",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan (group, peers, commands) and exit"
    )


def choose_backend(
    requested: str, identity: GroupIdentity, resourceconfig: Path, imds: ImdsClient
) -> Backend:
    """The backend: as requested, else from the group's source; a group given by flag or env
    is on SageMaker if the resource config exists, on EC2 if IMDS answers, else local."""
    if requested != "auto":
        return Backend(requested)
    if identity.source is GroupSource.SAGEMAKER:
        return Backend.SAGEMAKER
    if identity.source is GroupSource.EC2:
        return Backend.EC2
    if resourceconfig.is_file():
        return Backend.SAGEMAKER
    try:
        if imds.get("/latest/meta-data/instance-id"):
            return Backend.EC2
    except ImdsError:
        pass
    return Backend.LOCAL


def _ec2_identity(identity: GroupIdentity, imds: ImdsClient) -> GroupIdentity:
    """Fill in instance id and region from IMDS when the group came from a flag or env."""
    if identity.instance_id and identity.region:
        return identity
    return GroupIdentity(
        identity.group,
        identity.source,
        host=identity.host or imds.get("/latest/meta-data/local-ipv4"),
        instance_id=imds.get("/latest/meta-data/instance-id"),
        region=imds.get("/latest/meta-data/placement/region"),
        cluster=identity.cluster
        or os.environ.get(ENV_CLUSTER)
        or imds.get(f"/latest/meta-data/tags/instance/{CLUSTER_TAG}"),
    )


def make_plan(
    spec: ClusterSpec,
    *,
    spec_path: str,
    identity: GroupIdentity,
    backend: Backend,
    found_peers: peers.Peers,
    run_dir: str | None,
    environ: Mapping[str, str],
    network_interface: str | None = None,
    efa: bool | None = None,
) -> LaunchPlan:
    """The role's commands for this host (pure: nothing is started)."""
    group = spec.group(identity.group)
    env: dict[str, str] = {}
    uri = environ.get(ENV_CHECKPOINT_URI, "").strip()
    checkpoint_s3_uri: str | None = None
    checkpoint_dir: str | None = None
    if uri.startswith("s3://"):
        checkpoint_s3_uri, checkpoint_dir = uri, CHECKPOINT_CACHE
    elif uri:
        checkpoint_dir = uri
    elif backend is Backend.SAGEMAKER:
        # SageMaker syncs this folder with the job's CheckpointConfig S3 URI (managed Spot).
        checkpoint_dir = SAGEMAKER_CHECKPOINT_DIR
    if group.role is Role.TRAINER:
        default_dir = SAGEMAKER_OUTPUT_DIR if backend is Backend.SAGEMAKER else f"runs/{spec.name}"
        env.update(
            roles.network_env(
                group,
                efa=roles.efa_present() if efa is None else efa,
                socket_ifname=network_interface,
            )
        )
        # On EC2 the trainer keeps looking for data servers by the cluster's tags while it runs
        # (a replacement comes back at a new address). A SageMaker job's hosts are fixed for
        # its lifetime (a managed Spot restart starts the whole job again): the list suffices.
        data_servers: tuple[str, ...] = found_peers.data_servers
        if spec.dataprep_groups and backend is Backend.EC2:
            data_servers = (f"ec2:{identity.cluster or spec.name}",)
            if identity.region:
                env.setdefault(ENV_REGION, identity.region)
        cmd = roles.trainer_command(
            spec,
            spec_path=spec_path,
            run_dir=run_dir or default_dir,
            trainer_hosts=found_peers.trainer_hosts(spec),
            node_rank=found_peers.self_index,
            data_servers=data_servers,
            checkpoint_dir=checkpoint_dir,
            env=env,
        )
        if checkpoint_s3_uri is not None:
            cmd = roles.RoleCommand((*cmd.argv, "--checkpoint-s3-uri", checkpoint_s3_uri), cmd.env)
        commands: tuple[tuple[str, roles.RoleCommand], ...] = (("trainer", cmd),)
    else:
        host = "127.0.0.1" if backend is Backend.LOCAL else "0.0.0.0"
        base = spec.job.dataplane.port
        if backend is Backend.LOCAL:
            # On loopback every dataprep instance needs its own ports.
            base += found_peers.self_index * group.ranks_per_instance
        commands = tuple(
            (
                f"data-server-{i}",
                roles.RoleCommand(
                    roles.data_server_command(spec_path=spec_path, port=base + i, host=host).argv,
                    env,
                ),
            )
            for i in range(group.ranks_per_instance)
        )
    return LaunchPlan(
        backend=backend,
        identity=identity,
        role=group.role,
        peers=found_peers,
        commands=commands,
        job_leader=group.role is Role.TRAINER and found_peers.self_index == 0,
        env=env,
        checkpoint_s3_uri=checkpoint_s3_uri if group.role is Role.TRAINER else None,
        checkpoint_dir=checkpoint_dir if group.role is Role.TRAINER else None,
    )


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    imds = ImdsClient(args.imds_url, timeout_s=args.imds_timeout)
    resourceconfig = Path(args.resourceconfig)
    try:
        identity = detect_group(
            spec,
            flag=args.group,
            environ=os.environ,
            resourceconfig=resourceconfig,
            imds=None if args.backend in ("local", "sagemaker") else imds,
        )
    except GroupDetectionError as e:
        log.error("%s", e)
        return EXIT_CONFIG
    backend = choose_backend(args.backend, identity, resourceconfig, imds)
    network_interface: str | None = None
    try:
        if backend is Backend.SAGEMAKER:
            config = read_resourceconfig(resourceconfig)
            network_interface = config.get("network_interface_name")
            found = peers.sagemaker_peers(spec, config)
        elif backend is Backend.EC2:
            identity = _ec2_identity(identity, imds)
            found = _find_ec2_peers(spec, identity, args.peer_timeout)
        else:
            found = peers.local_peers(spec, self_index=args.host_index)
    except (peers.PeerDiscoveryError, ImdsError, OSError, ValueError) as e:
        log.error("peer discovery failed (%s backend): %s", backend.value, e)
        return EXIT_PEERS
    try:
        plan = make_plan(
            spec,
            spec_path=args.spec,
            identity=identity,
            backend=backend,
            found_peers=found,
            run_dir=args.run_dir,
            environ=os.environ,
            network_interface=network_interface,
        )
    except ValueError as e:  # e.g. --host-index outside the group
        log.error("%s", e)
        return EXIT_CONFIG
    log.info(
        "backend %s, group %r (%s), host %d of %d",
        backend.value,
        identity.group,
        plan.role.value,
        found.self_index + 1,
        len(found.hosts[identity.group]),
    )
    if args.dry_run:
        for name, cmd in plan.commands:
            extra = " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items())
            print(f"{name}: {extra + ' ' if extra else ''}{shlex.join(cmd.argv)}")
        return 0
    code, stopped = _run_role(plan, args)
    if stopped is not None:
        return exit_code_for_signal(stopped)
    if code == 0 and plan.backend is Backend.EC2 and plan.job_leader:
        _end_job(identity)
    return code


def _find_ec2_peers(spec: ClusterSpec, identity: GroupIdentity, timeout_s: float) -> peers.Peers:
    import boto3  # only EC2 needs it; keeps local starts light

    if not identity.instance_id:
        raise peers.PeerDiscoveryError("IMDS did not give this instance's id")
    ec2 = boto3.client("ec2", region_name=_region(identity))
    return peers.ec2_peers(
        spec,
        ec2,
        own_group=identity.group,
        own_instance_id=identity.instance_id,
        cluster=identity.cluster,
        timeout_s=timeout_s,
    )


def _run_role(plan: LaunchPlan, args: argparse.Namespace) -> tuple[int, int | None]:
    """Run the role's processes to the end; (exit code, stop signal or None)."""
    with Supervisor(grace_s=args.grace, subreaper=True) as sup:
        sup.install_signal_handlers()
        children = [
            sup.start(
                name,
                cmd.argv,
                env={**os.environ, **cmd.env},
                stop_workers=plan.role is Role.TRAINER,
            )
            for name, cmd in plan.commands
        ]
        watcher: SpotWatcher | None = None
        if plan.backend is Backend.EC2:
            watcher = SpotWatcher(
                ImdsClient(args.imds_url, timeout_s=args.imds_timeout),
                lambda notice: sup.request_stop(signal.SIGTERM, notice.describe()),
                interval_s=args.spot_poll,
            )
            watcher.start()
        codes = sup.run_until_done()
        if watcher is not None:
            watcher.stop()
    for child, code in zip(children, codes, strict=True):
        log.info("%s exited with code %d", child.name, code)
    if sup.stop_signal is not None:
        log.warning("stopped: %s", sup.stop_reason)
    return next((c for c in codes if c != 0), 0), sup.stop_signal


def _region(identity: GroupIdentity) -> str | None:
    """IMDS's region, else the environment's (None: boto3 resolves it as usual)."""
    return identity.region or os.environ.get("AWS_REGION") or os.environ.get(ENV_REGION)


def _end_job(identity: GroupIdentity) -> None:
    names = job_end.asg_names_from_env(os.environ)
    if not names:
        log.warning("training finished but no Auto Scaling groups are named (set HETERO_ASG_NAMES)")
        return
    import boto3

    client = boto3.client("autoscaling", region_name=identity.region or os.environ.get(ENV_REGION))
    job_end.scale_to_zero(client, names)
