"""``hetero launch`` on EC2: this instance's identity from IMDS, the job pointer, then the
generation loop of ``ec2_job`` (or, with ``--dry-run``, its first plan); a new job re-executes
the launcher. A launcher that cannot start its job loop takes the instance out of service
(``early_exit``), and one that holds another spec than its job's has it replaced."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from training.common import jobparam
from training.common.aws import client
from training.common.jobrecord import JobRecord
from training.common.names import (
    ENV_CHECKPOINT_URI,
    ENV_CLUSTER,
    ENV_GROUP,
    ENV_INIT_URI,
    ENV_INSTANCE_ID,
    ENV_JOB_PARAMETER,
    ENV_LIFECYCLE_HOOK,
    ENV_REGION,
    TAG_CLUSTER,
)
from training.common.outcome import EXIT_CONFIG, EXIT_FAILED, EXIT_STOPPED
from training.launcher import early_exit, job_end, peers
from training.launcher.backends import PLACES, Backend
from training.launcher.ec2_job import EXIT_NEW_JOB, Ec2Job, JobAws, job_clock
from training.launcher.group import GroupIdentity
from training.launcher.host_checks import HostCheck
from training.launcher.imds import ImdsClient, ImdsError
from training.launcher.loop_settings import default_settings
from training.launcher.membership import MembershipTimeout, wait_for_membership
from training.launcher.plan import LaunchPlan, log_plan, make_plan, print_plan
from training.launcher.spot import TARGET_LIFECYCLE_PATH
from training.spec import ClusterSpec, Role

log = logging.getLogger(__name__)

EC2 = PLACES[Backend.EC2]

MAX_JOB_SWITCHES = 20
"""Re-executions for new jobs one launcher process may do (a bound, never reached by hand)."""
_ENV_JOB_SWITCHES = "HETERO_LAUNCHER_JOB_SWITCHES"
"""How many times this launcher re-executed itself for a new job (its own bookkeeping)."""


def record_location(environ: Mapping[str, str], spec: ClusterSpec) -> str | None:
    """Where the job record lives: beside the checkpoints (``HETERO_CHECKPOINT_URI``, else the
    spec's checkpoint folder)."""
    return environ.get(ENV_CHECKPOINT_URI, "").strip() or spec.job.checkpoint.dir or None


def staged_init(pointer: jobparam.JobPointer, spec: ClusterSpec) -> str | None:
    """Where this job reads ``job.model.init``: the pointer's ``init_uri`` (a ``timm:`` init
    staged in S3, ``training.common.timm_hub``, or an ``s3://`` one copied into the checkpoint
    bucket, ``training.common.s3_init``) when the pointer's ``init`` is this spec's;
    otherwise None (and a warning when the pointer has a staged init for another spec)."""
    if pointer.init_uri is None:
        return None
    if pointer.init != spec.job.model.init:
        log.warning(
            "job %s staged job.model.init %r at %s, but this instance's spec has %r: not used "
            "(start jobs with the deployed spec)",
            pointer.job_id, pointer.init, pointer.init_uri, spec.job.model.init,
        )  # fmt: skip
        return None
    log.info("job.model.init %s: the job reads its staged copy %s", pointer.init, pointer.init_uri)
    return pointer.init_uri


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
        or imds.get(f"/latest/meta-data/tags/instance/{TAG_CLUSTER}"),
    )


def cannot_start(
    why: str,
    code: int,
    spec: ClusterSpec,
    args: argparse.Namespace,
    imds: ImdsClient,
    identity: GroupIdentity | None,
    *,
    replaceable: bool = True,
    environ: Mapping[str, str] | None = None,
) -> int:
    """The launcher cannot start its job loop. Deployed by the stack on EC2
    (``HETERO_ASG_NAMES``), the instance leaves service (``early_exit.leave_service``: replaced
    within the job's budget, else the job ends failed; a failure that is not ``replaceable``
    ends the job failed at once); anywhere else, exit with ``code``. ``environ``: the
    launcher's variables once the job pointer gave its checkpoint URI (default: the process's)."""
    if args.dry_run or not early_exit.deployed(os.environ):
        return code

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
    location = record_location(os.environ if environ is None else environ, spec)
    group = identity.group if identity else os.environ.get(ENV_GROUP) or args.group
    hook = os.environ.get(ENV_LIFECYCLE_HOOK, "").strip() or None
    try:
        autoscaling = client("autoscaling", region=region)
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
        replaceable=replaceable,
        hook=hook,
        target_state=lambda: imds_get(TARGET_LIFECYCLE_PATH),
        poll_s=args.spot_poll,
    )


def _replace_this_instance(why: str, region: str | None, instance_id: str, dry_run: bool) -> int:
    """Leave the Auto Scaling group without lowering its desired capacity, so that it launches
    a replacement from the current launch template, which holds the deployed spec."""
    log.error("%s: asking Auto Scaling to replace this instance", why)
    if dry_run:
        return EXIT_STOPPED
    try:
        client("autoscaling", region=region).terminate_instance_in_auto_scaling_group(
            InstanceId=instance_id, ShouldDecrementDesiredCapacity=False
        )
    except Exception as e:  # Still do not run the job with the wrong spec.
        log.error("could not replace this instance (%s): terminate %s by hand", e, instance_id)
    return EXIT_STOPPED


def run_ec2(
    spec: ClusterSpec,
    args: argparse.Namespace,
    identity: GroupIdentity,
    imds: ImdsClient,
    efa_env: Mapping[str, str],
    host: HostCheck | None = None,
) -> int:
    """The EC2 launcher. ``host``: what ``host_checks`` found on this host; a problem there ends
    the job failed, once the job pointer has shown that this host holds the job's spec (a host
    left from an earlier deploy, with an older AMI perhaps, is replaced instead)."""
    try:
        identity = _ec2_identity(identity, imds)
    except ImdsError as e:
        log.error("peer discovery failed (ec2 backend): %s", e)
        return cannot_start(f"IMDS: {e}", peers.EXIT_PEERS, spec, args, imds, identity)
    if not identity.instance_id:
        log.error("IMDS did not give this instance's id")
        return cannot_start(
            "IMDS gave no instance id", peers.EXIT_PEERS, spec, args, imds, identity
        )
    region = _region(identity)
    environ = dict(os.environ)
    job_watch: jobparam.JobWatch | None = None
    parameter = environ.get(ENV_JOB_PARAMETER, "").strip()
    if parameter:
        # The job pointer comes first: its checkpoint URI is the one the plan, the job record
        # and the trainer's environment use from here on.
        ssm = client("ssm", region=region, attempts=jobparam.MAX_ATTEMPTS)
        try:
            pointer = jobparam.read_job_pointer_patiently(ssm, parameter)
        except (jobparam.JobParameterNotFound, jobparam.JobPointerError) as e:
            log.error("%s", e)
            return cannot_start(f"job pointer: {e}", EXIT_CONFIG, spec, args, imds, identity)
        log.info("job %s, checkpoints %s", pointer.job_id, pointer.checkpoint_uri)
        stale = jobparam.stale_spec(pointer, Path(args.spec).read_text())
        if stale is not None:
            return _replace_this_instance(stale, region, str(identity.instance_id), args.dry_run)
        environ[ENV_CHECKPOINT_URI] = pointer.checkpoint_uri
        init_uri = staged_init(pointer, spec)
        if init_uri is not None:
            environ[ENV_INIT_URI] = init_uri
        job_watch = jobparam.JobWatch(ssm, parameter, pointer)
    if host is not None and host.problem is not None:
        return cannot_start(
            host.problem, EXIT_FAILED, spec, args, imds, identity,
            replaceable=False, environ=environ,
        )  # fmt: skip
    efa_env = {**efa_env, **(host.env if host is not None else {})}  # the trainer's variables
    location = record_location(environ, spec)
    record = JobRecord(location) if location else None
    run_dir = Path(args.run_dir or EC2.run_dir(spec))

    def plan_for(found: peers.Peers, port: int, outcome_dir: str) -> LaunchPlan:
        return make_plan(
            spec,
            spec_path=args.spec,
            identity=identity,
            place=EC2,
            found_peers=found,
            run_dir=str(run_dir),
            environ=environ,
            rendezvous_port=port,
            rendezvous_timeout_s=args.rendezvous_timeout,
            outcome_dir=outcome_dir,
            efa_env=efa_env,
        )

    aws = JobAws(
        ec2=client("ec2", region=region),
        autoscaling=client("autoscaling", region=region),
        record=record,
        asg_names=job_end.asg_names_from_env(os.environ),
    )
    job = Ec2Job(
        spec,
        identity=identity,
        settings=default_settings(args),
        plan_for=plan_for,
        environ=environ,
        run_dir=run_dir,
        aws=aws,
        clock=job_clock(spec, identity, aws, job_watch),
        job_watch=job_watch,
    )
    if args.dry_run:
        return _dry_run_ec2(job, args)
    log.info(
        "backend ec2, group %r (%s), instance %s at %s",
        identity.group, spec.group(identity.group).role.value, identity.instance_id, identity.host,
    )  # fmt: skip
    code = job.run()
    if code == EXIT_NEW_JOB:
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
            MAX_JOB_SWITCHES, EXIT_NEW_JOB,
        )  # fmt: skip
        return EXIT_NEW_JOB
    env[_ENV_JOB_SWITCHES] = str(switches)
    argv = [sys.executable, *sys.orig_argv[1:]]
    log.info("starting again on the new job: %s", shlex.join(argv))
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as e:
        log.error("could not re-execute the launcher (%s): exiting %d", e, EXIT_NEW_JOB)
    return EXIT_NEW_JOB


def _dry_run_ec2(job: Ec2Job, args: argparse.Namespace) -> int:
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
            return peers.EXIT_PEERS
    plan = job.plan(membership)
    log_plan(plan)
    print_plan(plan)
    return 0


def _region(identity: GroupIdentity) -> str | None:
    """IMDS's region, else the environment's (None: boto3 resolves it as usual)."""
    return identity.region or os.environ.get("AWS_REGION") or os.environ.get(ENV_REGION)
