"""``hetero launch``: the container's entry point on every instance.

Finds this host's instance group, finds its peers and runs the group's role under supervision.
On EC2 it runs the role in generations until the job is over (``ec2_job``: elastic trainer
membership, Spot and Auto Scaling notices, restarts within a budget, job end in every outcome).

Exit codes (``training.outcome``): 0 the job finished; 75 this host stopped (an interruption
notice, an Auto Scaling termination; the job goes on without it); 1 failed; 2 bad spec or no
group; 3 peers not found; 128+N stopped by signal N.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from training.launcher import ec2_job, job_end, peers, roles
from training.launcher.group import (
    SAGEMAKER_RESOURCECONFIG,
    GroupDetectionError,
    GroupIdentity,
    GroupSource,
    detect_group,
    read_resourceconfig,
)
from training.launcher.imds import (
    DEFAULT_IMDS_URL,
    ENV_IMDS_ENDPOINT,
    ImdsClient,
    ImdsError,
    endpoint_from_env,
)
from training.launcher.jobrecord import JobRecord
from training.launcher.membership import MembershipTimeout, wait_for_membership
from training.launcher.names import (
    CLUSTER_TAG,
    ENV_CHECKPOINT_URI,
    ENV_CLUSTER,
    ENV_REGION,
    ENV_SPEC,
)
from training.launcher.supervisor import Supervisor, exit_code_for_signal
from training.outcome import Outcome, clear_outcomes, read_host_outcome
from training.spec import ClusterSpec, Role, load_spec

log = logging.getLogger(__name__)

EXIT_CONFIG = 2
EXIT_PEERS = 3
SAGEMAKER_CHECKPOINT_DIR = "/opt/ml/checkpoints"
SAGEMAKER_OUTPUT_DIR = "/opt/ml/output/data"


def checkpoint_staging_dir(tmpdir: str | Path | None = None) -> str:
    """This host's staging folder for checkpoint shards on their way to S3: under the temporary
    folder (``TMPDIR``, else ``/tmp``), never in a run folder that SageMaker would upload.
    Hosts that share a machine (``hetero rehearse``) must give each its own ``TMPDIR``;
    ``tmpdir`` names another host's (the rehearsal watches an instance's staging folder)."""
    return str(Path(tmpdir or tempfile.gettempdir()) / "hetero" / "checkpoints")


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
    parser.add_argument(
        "--imds-url",
        default=endpoint_from_env(os.environ),
        help=f"instance metadata endpoint (default: ${ENV_IMDS_ENDPOINT}, as boto3 reads it, "
        f"else {DEFAULT_IMDS_URL})",
    )
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
        "--restart-budget",
        type=int,
        default=3,
        help="EC2: failed runs of the role this host retries before it ends the job as failed",
    )
    parser.add_argument(
        "--restart-backoff",
        type=float,
        default=10.0,
        help="EC2: seconds before the first retry, doubled for each further failure (max 120)",
    )
    parser.add_argument(
        "--rendezvous-timeout",
        type=int,
        default=ec2_job.RENDEZVOUS_TIMEOUT_S,
        help="EC2: seconds trainer hosts wait for each other in torchrun's rendezvous",
    )
    parser.add_argument(
        "--poll", type=float, default=5.0, help="EC2: seconds between membership checks"
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
    rendezvous_port: int = roles.RENDEZVOUS_PORT,
    rendezvous_timeout_s: int | None = None,
    outcome_dir: str | None = None,
) -> LaunchPlan:
    """The role's commands for this host (pure: nothing is started)."""
    group = spec.group(identity.group)
    env: dict[str, str] = {}
    uri = environ.get(ENV_CHECKPOINT_URI, "").strip()
    checkpoint_s3_uri: str | None = None
    checkpoint_dir: str | None = None
    if uri.startswith("s3://"):
        checkpoint_s3_uri, checkpoint_dir = uri, checkpoint_staging_dir()
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
            rendezvous_port=rendezvous_port,
            rendezvous_timeout_s=rendezvous_timeout_s,
            outcome_dir=outcome_dir,
            env=env,
        )
        if checkpoint_s3_uri is not None:
            cmd = roles.RoleCommand((*cmd.argv, "--checkpoint-s3-uri", checkpoint_s3_uri), cmd.env)
        commands: tuple[tuple[str, roles.RoleCommand], ...] = (("trainer", cmd),)
    else:
        # On EC2, the instance's own private address: the one its peers find it by.
        host = {Backend.LOCAL: "127.0.0.1", Backend.EC2: identity.host or "0.0.0.0"}.get(
            backend, "0.0.0.0"
        )
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
    if backend is Backend.EC2:
        return _run_ec2(spec, args, identity, imds)
    network_interface: str | None = None
    try:
        if backend is Backend.SAGEMAKER:
            config = read_resourceconfig(resourceconfig)
            network_interface = config.get("network_interface_name")
            found = peers.sagemaker_peers(spec, config)
        else:
            found = peers.local_peers(spec, self_index=args.host_index)
    except (peers.PeerDiscoveryError, OSError, ValueError) as e:
        log.error("peer discovery failed (%s backend): %s", backend.value, e)
        return EXIT_PEERS
    run_dir = args.run_dir or (
        SAGEMAKER_OUTPUT_DIR if backend is Backend.SAGEMAKER else f"runs/{spec.name}"
    )
    outcome_dir = Path(run_dir) / "outcome"
    try:
        plan = make_plan(
            spec,
            spec_path=args.spec,
            identity=identity,
            backend=backend,
            found_peers=found,
            run_dir=run_dir,
            environ=os.environ,
            network_interface=network_interface,
            outcome_dir=str(outcome_dir),
        )
    except ValueError as e:  # e.g. --host-index outside the group
        log.error("%s", e)
        return EXIT_CONFIG
    _log_plan(plan, found)
    if args.dry_run:
        _print_plan(plan)
        return 0
    clear_outcomes(outcome_dir)
    code, stopped = _run_role(plan, args)
    if stopped is not None:
        return exit_code_for_signal(stopped)
    if plan.role is Role.TRAINER:
        # torchrun turns every non-zero rank exit into 1: the ranks' files tell the outcome.
        outcome, _ = read_host_outcome(outcome_dir, spec.group(identity.group).ranks_per_instance)
        if code != 0 or outcome is not Outcome.FINISHED:
            return outcome.exit_code
    return code


def _log_plan(plan: LaunchPlan, found: peers.Peers) -> None:
    log.info(
        "backend %s, group %r (%s), host %d of %d",
        plan.backend.value,
        plan.identity.group,
        plan.role.value,
        found.self_index + 1,
        len(found.hosts[plan.identity.group]),
    )


def _print_plan(plan: LaunchPlan) -> None:
    for name, cmd in plan.commands:
        extra = " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items())
        print(f"{name}: {extra + ' ' if extra else ''}{shlex.join(cmd.argv)}")


def _run_ec2(
    spec: ClusterSpec, args: argparse.Namespace, identity: GroupIdentity, imds: ImdsClient
) -> int:
    """EC2: the generation loop of ``ec2_job`` (or, with ``--dry-run``, the first plan)."""
    import boto3  # only EC2 needs it; keeps local starts light

    try:
        identity = _ec2_identity(identity, imds)
    except ImdsError as e:
        log.error("peer discovery failed (ec2 backend): %s", e)
        return EXIT_PEERS
    if not identity.instance_id:
        log.error("IMDS did not give this instance's id")
        return EXIT_PEERS
    region = _region(identity)
    ec2 = boto3.client("ec2", region_name=region)
    autoscaling = boto3.client("autoscaling", region_name=region)
    location = ec2_job.record_location(os.environ, spec)
    record = JobRecord(location) if location else None
    run_dir = Path(args.run_dir or f"runs/{spec.name}")

    def plan_for(found: peers.Peers, port: int, outcome_dir: str) -> LaunchPlan:
        return make_plan(
            spec,
            spec_path=args.spec,
            identity=identity,
            backend=Backend.EC2,
            found_peers=found,
            run_dir=str(run_dir),
            environ=os.environ,
            rendezvous_port=port,
            rendezvous_timeout_s=args.rendezvous_timeout,
            outcome_dir=outcome_dir,
        )

    job = ec2_job.Ec2Job(
        spec,
        identity=identity,
        settings=ec2_job.default_settings(args),
        plan_for=plan_for,
        environ=dict(os.environ),
        run_dir=run_dir,
        ec2=ec2,
        autoscaling=autoscaling,
        record=record,
        asg_names=job_end.asg_names_from_env(os.environ),
    )
    if args.dry_run:
        return _dry_run_ec2(job, args)
    log.info(
        "backend ec2, group %r (%s), instance %s at %s",
        identity.group, spec.group(identity.group).role.value, identity.instance_id, identity.host,
    )  # fmt: skip
    return job.run()


def _dry_run_ec2(job: ec2_job.Ec2Job, args: argparse.Namespace) -> int:
    """Print the first generation's plan (waiting, bounded, for the trainer group to form)."""
    membership = None
    if job.group.role is Role.TRAINER:
        try:
            membership = wait_for_membership(
                job.current_membership,
                count=job.group.count,
                own_instance_id=job.instance_id,
                timeout_s=args.peer_timeout,
                poll_s=args.poll,
            )
        except MembershipTimeout as e:
            log.error("%s", e)
            return EXIT_PEERS
    plan = job.plan(membership)
    _log_plan(plan, plan.peers)
    _print_plan(plan)
    return 0


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
        codes = sup.run_until_done()
    for child, code in zip(children, codes, strict=True):
        log.info("%s exited with code %d", child.name, code)
    if sup.stop_signal is not None:
        log.warning("stopped: %s", sup.stop_reason)
    return next((c for c in codes if c != 0), 0), sup.stop_signal


def _region(identity: GroupIdentity) -> str | None:
    """IMDS's region, else the environment's (None: boto3 resolves it as usual)."""
    return identity.region or os.environ.get("AWS_REGION") or os.environ.get(ENV_REGION)
