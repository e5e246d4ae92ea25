"""``hetero launch``: the container's entry point on every instance.

Finds this host's instance group, finds its peers and runs the group's role under supervision.
On EC2 it runs the role in generations until the job is over (``ec2_job``: elastic trainer
membership, Spot and Auto Scaling notices, restarts within a budget, job end in every outcome).

Exit codes (``training.outcome``): 0 the job finished; 75 this host stopped (an interruption
notice, an Auto Scaling termination; the job goes on without it); 1 failed; 2 bad spec or no
group; 3 peers not found; 128+N stopped by signal N. On EC2 with a job pointer
(``HETERO_JOB_PARAMETER``), a host whose job was superseded starts again on the new job (76
only if that fails).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from training.aws_tags import ENV_JOB_PARAMETER
from training.dataplane.autoscale import backend_arg
from training.launcher import early_exit, ec2_job, efa, job_end, jobparam, peers, roles
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
    ENV_GROUP,
    ENV_INSTANCE_ID,
    ENV_LIFECYCLE_HOOK,
    ENV_REGION,
    ENV_SPEC,
)
from training.launcher.spot import TARGET_LIFECYCLE_PATH
from training.launcher.supervisor import Supervisor, exit_code_for_signal
from training.launcher.trainer_watch import NO_TRAINER_TIMEOUT_S
from training.outcome import EXIT_STOPPED, Outcome, clear_outcomes, read_host_outcome
from training.spec import ClusterSpec, Role, load_spec

log = logging.getLogger(__name__)

EXIT_CONFIG = 2
EXIT_PEERS = 3
MAX_JOB_SWITCHES = 20
"""Re-executions for new jobs one launcher process may do (a bound, never reached by hand)."""
_ENV_JOB_SWITCHES = "HETERO_LAUNCHER_JOB_SWITCHES"
"""How many times this launcher re-executed itself for a new job (its own bookkeeping)."""
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
        "--replacement-budget",
        type=int,
        default=early_exit.REPLACEMENT_BUDGET,
        help="EC2: instances per job taken out of service because the launcher could not start "
        "its job loop; one more ends the job as failed",
    )
    parser.add_argument(
        "--no-trainer-timeout",
        type=float,
        default=NO_TRAINER_TIMEOUT_S,
        help="EC2, data servers: seconds without any trainer host in the job record before the "
        "job ends as failed",
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=30.0,
        help="EC2: seconds between a running host's writes of its state to the job record, and "
        "its checks for failed boots (and, on a data server, for live trainers)",
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
        "--job-poll",
        type=float,
        default=30.0,
        help=f"EC2 with ${ENV_JOB_PARAMETER}: seconds between reads of the job pointer while "
        "the role runs (a new job stops it)",
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
    if uri.startswith("s3://"):
        checkpoint_s3_uri, checkpoint_dir = uri, checkpoint_staging_dir()
    elif uri:
        checkpoint_dir = uri
    elif backend is Backend.SAGEMAKER:
        # SageMaker syncs this folder with the job's CheckpointConfig S3 URI (managed Spot).
        checkpoint_dir = SAGEMAKER_CHECKPOINT_DIR
    if group.role is Role.TRAINER:
        default_dir = SAGEMAKER_OUTPUT_DIR if backend is Backend.SAGEMAKER else f"runs/{spec.name}"
        if network_interface:
            env["NCCL_SOCKET_IFNAME"] = network_interface
        # On EC2 the trainer keeps looking for data servers by the cluster's tags while it runs
        # (a replacement comes back at a new address). A SageMaker job's hosts are fixed for
        # its lifetime (a managed Spot restart starts the whole job again): the list suffices.
        data_servers: tuple[str, ...] = found_peers.data_servers
        if spec.dataprep_groups and backend is Backend.EC2:
            data_servers = (f"ec2:{identity.cluster or spec.name}",)
            if identity.region:
                env.setdefault(ENV_REGION, identity.region)
        # EFA or TCP sockets, decided once at start-up: FI_* variables only where EFA works.
        env.update(efa_env or {})
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
            autoscale=backend_arg(spec, backend.value, identity.cluster or spec.name),
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
        return _cannot_start(f"no instance group: {e}", EXIT_CONFIG, spec, args, imds, None)
    backend = choose_backend(args.backend, identity, resourceconfig, imds)
    efa_env = _trainer_efa_env(spec, identity, backend)
    if efa_env is None:
        if backend is not Backend.EC2:
            return EXIT_CONFIG
        return _cannot_start(
            'efa = "on" and this host cannot give NCCL EFA', EXIT_CONFIG, spec, args, imds, identity
        )
    if backend is Backend.EC2:
        return _run_ec2(spec, args, identity, imds, efa_env)
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
            efa_env=efa_env,
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


def _trainer_efa_env(
    spec: ClusterSpec, identity: GroupIdentity, backend: Backend
) -> dict[str, str] | None:
    """A trainer's EFA and NCCL variables (``efa.trainer_network``, which logs its decision);
    None, logged, when the group has efa = "on" and this host cannot give NCCL EFA. Local runs
    talk over loopback on one machine: EFA plays no part there."""
    group = spec.group(identity.group)
    if group.role is not Role.TRAINER or backend is Backend.LOCAL:
        return {}
    try:
        return dict(efa.trainer_network(group).env)
    except efa.EfaUnavailable as e:
        log.error("%s", e)
        return None


def _cannot_start(
    why: str,
    code: int,
    spec: ClusterSpec,
    args: argparse.Namespace,
    imds: ImdsClient,
    identity: GroupIdentity | None,
) -> int:
    """The launcher cannot start its job loop. Deployed by the stack on EC2
    (``HETERO_ASG_NAMES``), the instance leaves service (``early_exit.leave_service``: replaced
    within the job's budget, else the job ends failed); anywhere else, exit with ``code``."""
    if args.dry_run or not early_exit.deployed(os.environ):
        return code
    import boto3

    def imds_get(path: str) -> str | None:
        try:
            return imds.get(path)
        except ImdsError:
            return None

    # IMDS first; else the id the boot read from IMDS and gave the container.
    instance_id = (
        (identity.instance_id if identity else None)
        or imds_get("/latest/meta-data/instance-id")
        or os.environ.get(ENV_INSTANCE_ID, "").strip()
        or None
    )
    region = (identity.region if identity else None) or os.environ.get(ENV_REGION) or None
    # The job record as far as this host knows it: the job pointer's folder is not known when
    # the pointer could not be read, so then it is the stack's HETERO_CHECKPOINT_URI.
    location = ec2_job.record_location(os.environ, spec)
    group = identity.group if identity else os.environ.get(ENV_GROUP) or args.group
    hook = os.environ.get(ENV_LIFECYCLE_HOOK, "").strip() or None
    try:
        autoscaling = boto3.client("autoscaling", region_name=region)
    except Exception as e:  # e.g. no region known: nothing to call
        log.error("no Auto Scaling client (%s): the instance stays; exiting %d", e, code)
        return code
    return early_exit.leave_service(
        why,
        code,
        instance_id=instance_id,
        group=group,
        record=JobRecord(location) if location else None,
        autoscaling=autoscaling,
        asg_names=job_end.asg_names_from_env(os.environ),
        budget=args.replacement_budget,
        hook=hook,
        target_state=lambda: imds_get(TARGET_LIFECYCLE_PATH),
        poll_s=args.spot_poll,
    )


def _replace_this_instance(why: str, region: str | None, instance_id: str, dry_run: bool) -> int:
    """Leave the Auto Scaling group without lowering its desired capacity, so that it launches
    a replacement from the current launch template, which holds the deployed spec."""
    import boto3

    log.error("%s: asking Auto Scaling to replace this instance", why)
    if dry_run:
        return EXIT_STOPPED
    try:
        boto3.client("autoscaling", region_name=region).terminate_instance_in_auto_scaling_group(
            InstanceId=instance_id, ShouldDecrementDesiredCapacity=False
        )
    except Exception as e:  # Still do not run the job with the wrong spec.
        log.error("could not replace this instance (%s): terminate %s by hand", e, instance_id)
    return EXIT_STOPPED


def _run_ec2(
    spec: ClusterSpec,
    args: argparse.Namespace,
    identity: GroupIdentity,
    imds: ImdsClient,
    efa_env: Mapping[str, str],
) -> int:
    """EC2: the generation loop of ``ec2_job`` (or, with ``--dry-run``, the first plan)."""
    import boto3  # only EC2 needs it; keeps local starts light

    try:
        identity = _ec2_identity(identity, imds)
    except ImdsError as e:
        log.error("peer discovery failed (ec2 backend): %s", e)
        return _cannot_start(f"IMDS: {e}", EXIT_PEERS, spec, args, imds, identity)
    if not identity.instance_id:
        log.error("IMDS did not give this instance's id")
        return _cannot_start("IMDS gave no instance id", EXIT_PEERS, spec, args, imds, identity)
    region = _region(identity)
    environ = dict(os.environ)
    job_watch: jobparam.JobWatch | None = None
    parameter = environ.get(ENV_JOB_PARAMETER, "").strip()
    if parameter:
        # The job pointer comes first: its checkpoint URI is the one the plan, the job record
        # and the trainer's environment use from here on.
        ssm = jobparam.ssm_client(region)
        try:
            pointer = jobparam.read_job_pointer_patiently(ssm, parameter)
        except (jobparam.JobParameterNotFound, jobparam.JobPointerError) as e:
            log.error("%s", e)
            return _cannot_start(f"job pointer: {e}", EXIT_CONFIG, spec, args, imds, identity)
        log.info("job %s, checkpoints %s", pointer.job_id, pointer.checkpoint_uri)
        stale = jobparam.stale_spec(pointer, Path(args.spec).read_text())
        if stale is not None:
            return _replace_this_instance(stale, region, str(identity.instance_id), args.dry_run)
        environ[ENV_CHECKPOINT_URI] = pointer.checkpoint_uri
        job_watch = jobparam.JobWatch(ssm, parameter, pointer)
    ec2 = boto3.client("ec2", region_name=region)
    autoscaling = boto3.client("autoscaling", region_name=region)
    location = ec2_job.record_location(environ, spec)
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
            environ=environ,
            rendezvous_port=port,
            rendezvous_timeout_s=args.rendezvous_timeout,
            outcome_dir=outcome_dir,
            efa_env=efa_env,
        )

    job = ec2_job.Ec2Job(
        spec,
        identity=identity,
        settings=ec2_job.default_settings(args),
        plan_for=plan_for,
        environ=environ,
        run_dir=run_dir,
        ec2=ec2,
        autoscaling=autoscaling,
        record=record,
        asg_names=job_end.asg_names_from_env(os.environ),
        job_watch=job_watch,
    )
    if args.dry_run:
        return _dry_run_ec2(job, args)
    log.info(
        "backend ec2, group %r (%s), instance %s at %s",
        identity.group, spec.group(identity.group).role.value, identity.instance_id, identity.host,
    )  # fmt: skip
    code = job.run()
    if code == ec2_job.EXIT_NEW_JOB:
        return restart_for_new_job()
    return code


def restart_for_new_job(environ: Mapping[str, str] | None = None) -> int:
    """Run this launcher again, from the start, on the new job: ``os.execve`` of the same command
    line. Returns only when that is not possible (``ec2_job.EXIT_NEW_JOB``).

    Why re-execute rather than exit and let Docker restart the container
    (``--restart on-failure:N`` in the user data): each such restart would spend one of the N
    that are there for crashes ("the number of times to retry before giving up",
    https://docs.docker.com/reference/api/engine/version/v1.57/schemas/RestartPolicy/) and
    would report a healthy hand-over as a failure. ``execve`` keeps the process (PID 1 of the
    container, so ``docker stop`` still reaches it) and replaces everything in it: no thread,
    signal handler, client or job record of the old job survives, and the new process reads
    the pointer first, like any start. The role's processes were stopped before (the
    supervisor waits for them)."""
    env = dict(os.environ if environ is None else environ)
    switches = int(env.get(_ENV_JOB_SWITCHES, "0") or 0) + 1
    if switches > MAX_JOB_SWITCHES:
        log.error(
            "this launcher already started %d new jobs; exiting %d so that Docker restarts it",
            MAX_JOB_SWITCHES, ec2_job.EXIT_NEW_JOB,
        )  # fmt: skip
        return ec2_job.EXIT_NEW_JOB
    env[_ENV_JOB_SWITCHES] = str(switches)
    argv = [sys.executable, *sys.orig_argv[1:]]
    log.info("starting again on the new job: %s", shlex.join(argv))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as e:
        log.error("could not re-execute the launcher (%s): exiting %d", e, ec2_job.EXIT_NEW_JOB)
    return ec2_job.EXIT_NEW_JOB


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
