"""``hetero job start``: start another job on a deployed cluster, without a redeploy.

A job ends with its outcome in the job record and every Auto Scaling group at zero
(``training.launcher.job_end``). Starting the next one takes a new job id, a choice of
checkpoints and the groups back at their counts:

1. read the job pointer (``/hetero/<cluster>/job``, ``training.common.jobparam``); none: deploy
   first;
2. refuse while the current job still runs (a group with desired capacity or instances in
   service), unless ``--force``;
3. ``--resume`` (the default): the new job keeps the checkpoint URI and resumes from its newest
   complete checkpoint; the old job record (``<uri>job/``) is moved to
   ``<uri>job-history/<old job id>/`` first, so the new job starts with an empty record (a host
   that found the old outcome there would run nothing) and nothing is lost.
   ``--fresh``: the new job gets its own folder, ``<parent of the old URI>/<new job id>/``,
   and starts from step 0;
4. price every group at its most (``training.prices``: Spot from ``DescribeSpotPriceHistory``
   in the AZs of the group's Auto Scaling group, On-Demand from the Price List API, the spec's
   ``[job.prices]`` first, the dated catalogue where AWS gives none, with a warning), for the
   pointer: the new job's budget is those prices (``--offline-prices``: the catalogue's, asking
   AWS nothing);
5. a spec whose ``job.model.init`` is ``timm:NAME.TAG``: resolve it here, through the Hugging
   Face cache (or a download into it), and stage its files into the checkpoint bucket at
   ``<checkpoint prefix>/init/<sha256>/`` unless they are there already
   (``training.common.timm_hub``; the instances have no internet route); the pointer names
   that folder (``init_uri``) beside the spec's value (``init``). An ``s3://`` init outside the
   checkpoint prefix (another bucket: the instance role reads only that prefix) is read first
   (``HeadObject``, or ``ListObjectsV2`` of a folder: missing or unreadable, nothing changes)
   and copied server-side into ``<checkpoint prefix>/init/<sha256 of its URI and ETags>/``
   unless it is there already (``training.common.s3_init``); the pointer names the copy the
   same way;
6. write the new pointer, then set every group to ``MinSize=0, MaxSize=DesiredCapacity=count``
   (pointer first: an instance that starts must read the new job); an elastic dataprep group
   (``min_count``/``max_count``) gets ``MinSize=min_size, MaxSize=max_size,
   DesiredCapacity=count``, the sizes the stack gives it (``group_sizes``). An earlier job's
   budget backstop (``training.costs.backstop``) is deleted first; a group it set to
   ``MaxSize=0`` counts as the deployed spec's.

Instances still running the old job (``--force``) read the pointer at least every
``--job-poll`` seconds: they stop the old job's role (the trainer checkpoints) and start again
on the new job; they never end the old job or scale its groups down
(``training.launcher.ec2_job``).

The caller's credentials need ``ssm:GetParameter`` and ``ssm:PutParameter`` on the parameter,
``autoscaling:DescribeAutoScalingGroups``, ``autoscaling:UpdateAutoScalingGroup`` and
``autoscaling:DeleteScheduledAction``, ``ec2:DescribeSpotPriceHistory`` and
``pricing:GetProducts`` (without them the prices fall back to the catalogue), and on
the checkpoint bucket ``s3:ListBucket``, ``s3:GetObject``, ``s3:PutObject`` and
``s3:DeleteObject`` (``--resume`` moves the record; a ``timm:`` init is looked for and uploaded,
an ``s3://`` one copied); an ``s3://`` init in another bucket needs ``s3:GetObject`` on its
objects (and ``s3:ListBucket`` on its bucket for a folder).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from training.common.aws import client
from training.common.jobparam import (
    MAX_ATTEMPTS,
    STARTED_ID_PREFIX,
    JobParameterNotFound,
    JobPointer,
    JobPointerError,
    read_job_pointer,
)
from training.common.names import asg_name, job_parameter_name
from training.common.s3 import list_keys, parse_s3_uri, s3_uri
from training.common.s3_init import (
    S3InitError,
    StagedS3Init,
    copy_staged,
    is_s3_init,
    plan_s3_init,
)
from training.common.timm_hub import (
    HubInit,
    HubInitError,
    StagedInit,
    StagingError,
    is_timm_init,
    resolve_timm_init,
    stage_timm_init,
)
from training.costs.backstop import remove_backstop
from training.prices import Priced, offline_prices, price_groups, price_lines, pricing_client
from training.spec import ClusterSpec, InstanceGroup, load_spec

log = logging.getLogger(__name__)

RECORD_PREFIX = "job/"
"""The job record's folder under the checkpoint URI (``jobrecord.PREFIX``)."""
HISTORY_PREFIX = "job-history/"
"""Where ``--resume`` keeps earlier jobs' records: ``<uri>job-history/<job id>/``."""
EXIT_REFUSED = 1
_DELETE_BATCH = 1000
"""Keys per DeleteObjects request (S3's limit)."""


class JobStartError(RuntimeError):
    """The new job was not started (the message says why and what to do)."""


@dataclass(frozen=True)
class StartedJob:
    pointer: JobPointer
    previous: JobPointer
    moved: tuple[str, ...]
    """The old record's objects, by their new ``s3://`` URI (``--resume``)."""
    history_uri: str | None
    """Where the old record went (``--resume``), else None."""
    groups: tuple[tuple[str, int], ...]
    """(Auto Scaling group, desired capacity) as set."""
    priced: Priced
    """Every group's price at its most (also in ``pointer.prices``), and why a price is the
    catalogue's."""
    init: StagedInit | StagedS3Init | None = None
    """A ``timm:`` init's staged copy, or an ``s3://`` one's (also in ``pointer.init_uri``);
    None for other specs."""


def group_sizes(group: InstanceGroup) -> tuple[int, int, int]:
    """(MinSize, MaxSize, DesiredCapacity) of ``group`` at a job's start, as the stack sets
    them (``infra/instance_group.py``): ``(0, count, count)``, or for an elastic group
    ``(min_size, max_size, count)``."""
    if group.elastic:
        return group.min_size, group.max_size, group.count
    return 0, group.count, group.count


def new_job_id(now: datetime, token: str) -> str:
    """``j-<UTC yyyymmddTHHMMSS>-<token>``: sorts by start time; ``token`` (4 hex) keeps two
    starts within a second apart."""
    return f"{STARTED_ID_PREFIX}{now.astimezone(UTC):%Y%m%dT%H%M%S}-{token}"


def _split_s3(uri: str) -> tuple[str, str]:
    try:
        return parse_s3_uri(uri)
    except ValueError as e:
        raise JobStartError(
            f"the job's checkpoint URI {uri!r} is not in S3: hetero job start moves and creates "
            "job folders in the stack's checkpoint bucket only (s3://...)"
        ) from e


def check_groups(
    spec: ClusterSpec, autoscaling: Any, *, job_id: str, spec_path: str, force: bool
) -> dict[str, dict[str, Any]]:
    """Refuse (``JobStartError``) when a group is missing, was deployed with another count
    than the spec's, or still has capacity (unless ``force``). Returns each spec group's Auto
    Scaling group as ``DescribeAutoScalingGroups`` describes it, by spec group name."""
    names = {g.name: asg_name(spec.name, g.name) for g in spec.groups}
    found = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=list(names.values()))
    by_name = {g["AutoScalingGroupName"]: g for g in found.get("AutoScalingGroups", [])}
    missing = [n for n in names.values() if n not in by_name]
    if missing:
        raise JobStartError(
            f"Auto Scaling group(s) {', '.join(missing)} not found: deploy the stack with this "
            f"spec first (npx cdk deploy --all -c spec={spec_path}), or pass the deployed spec"
        )
    # The stack sets MaxSize to the spec's count (an elastic group's: max_count) and job end
    # leaves it; the budget's backstop sets it to 0 (``backstop``). Another value means another
    # spec than the deployed one (whose copy the instances run).
    other = [
        f"{names[g.name]} (MaxSize {by_name[names[g.name]]['MaxSize']}, spec "
        + (f"max_count {g.max_size})" if g.elastic else f"count {g.count})")
        for g in spec.groups
        if by_name[names[g.name]]["MaxSize"] not in (0, g.max_size)
    ]
    if other:
        raise JobStartError(
            f"{spec_path} is not the spec the stack was deployed with: {', '.join(other)}. "
            "Pass the deployed spec, or deploy this one (npx cdk deploy --all -c "
            f"spec={spec_path}), which starts it as a new job"
        )
    running = []
    for name in names.values():
        asg = by_name[name]
        in_service = sum(1 for i in asg.get("Instances", []) if i["LifecycleState"] == "InService")
        if asg["DesiredCapacity"] > 0 or in_service:
            running.append((name, asg["DesiredCapacity"], in_service))
    if running and not force:
        described = "; ".join(
            f"{name} has desired capacity {desired} and {n} instance(s) in service"
            for name, desired, n in running
        )
        stop = "\n".join(
            f"  aws autoscaling update-auto-scaling-group --auto-scaling-group-name {name} "
            "--min-size 0 --desired-capacity 0"
            for name, _, _ in running
        )
        raise JobStartError(
            f"job {job_id} is still running: {described}.\n"
            "Let it end (its launchers scale every group to 0 when it finishes or fails; "
            f"`hetero status --spec {spec_path}` shows it), or stop it:\n{stop}\n"
            "then run this again. Or pass --force to start the new job now: the old job's hosts "
            "stop its role (the trainer checkpoints) and join the new job."
        )
    if running:
        log.warning("--force: starting a new job while job %s still runs", job_id)
    return {g: by_name[asg] for g, asg in names.items()}


def archive_job_record(s3: Any, checkpoint_uri: str, job_id: str) -> tuple[str, tuple[str, ...]]:
    """Move every object under ``<checkpoint_uri>job/`` to
    ``<checkpoint_uri>job-history/<job_id>/``: copy all, then delete the originals (a failure
    midway leaves every object in at least one place; running it again finishes the move).
    Returns the history folder's URI and the moved objects' new URIs."""
    bucket, prefix = _split_s3(checkpoint_uri)
    source = prefix + RECORD_PREFIX
    target = f"{prefix}{HISTORY_PREFIX}{job_id}/"
    keys = list_keys(s3, bucket, source)
    moved = []
    for key in keys:
        new_key = target + key[len(source) :]
        s3.copy_object(Bucket=bucket, Key=new_key, CopySource={"Bucket": bucket, "Key": key})
        moved.append(s3_uri(bucket, new_key))
    for i in range(0, len(keys), _DELETE_BATCH):
        batch = keys[i : i + _DELETE_BATCH]
        reply = s3.delete_objects(
            Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
        )
        if reply.get("Errors"):
            first = reply["Errors"][0]
            raise JobStartError(
                f"could not delete {len(reply['Errors'])} object(s) of the old job record after "
                f"copying them to s3://{bucket}/{target} (first: {first.get('Key')}: "
                f"{first.get('Code')} {first.get('Message')}); run this again to finish the move"
            )
    return s3_uri(bucket, target), tuple(moved)


def start_job(
    spec: ClusterSpec,
    *,
    ssm: Any,
    autoscaling: Any,
    s3: Any,
    fresh: bool = False,
    force: bool = False,
    spec_path: str = "cluster.toml",
    now: datetime | None = None,
    token: str | None = None,
    max_usd: float | None = None,
    max_hours: float | None = None,
    ec2: Any | None = None,
    pricing: Any | None = None,
) -> StartedJob:
    """Start a new job on the deployed cluster of ``spec`` (see the module docstring), with its
    own budget where ``max_usd`` / ``max_hours`` are given (else the deployed spec's). Its
    groups are priced with ``ec2`` (Spot) and ``pricing`` (On-Demand, the Price List API);
    without both, from the spec and the dated catalogue alone."""
    for flag, cap in (("--max-usd", max_usd), ("--max-hours", max_hours)):
        if cap is not None and not cap > 0:
            raise JobStartError(f"{flag} must be above 0, got {cap:g}")
    hub = None
    if is_timm_init(spec.job.model.init):
        try:  # On this machine, before anything changes: the instances cannot download it.
            hub = resolve_timm_init(str(spec.job.model.init))
        except HubInitError as e:
            raise JobStartError(f"job.model.init = {e}") from None
    name = job_parameter_name(spec.name)
    previous = read_job_pointer(ssm, name)
    found = check_groups(
        spec, autoscaling, job_id=previous.job_id, spec_path=spec_path, force=force
    )
    planned = _plan_s3_init(spec, s3, previous.checkpoint_base)
    now = now or datetime.now(UTC)
    if ec2 is None or pricing is None:
        priced = offline_prices(spec)
    else:
        priced = price_groups(
            spec,
            ec2=ec2,
            pricing=pricing,
            # The stack puts each group in the one subnet of the spec's AZ.
            zones={g: tuple(asg.get("AvailabilityZones", ())) for g, asg in found.items()},
            region=ec2.meta.region_name,
            now=now,
        )
    job_id = new_job_id(now, token or secrets.token_hex(2))
    started = f"{now.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"
    history_uri: str | None = None
    moved: tuple[str, ...] = ()
    uri, resumed = (
        (f"{previous.checkpoint_base}{job_id}/", None)
        if fresh
        else (previous.checkpoint_uri, previous.job_id)
    )
    init = _stage_init(hub, planned, s3, previous.checkpoint_base)
    pointer = JobPointer(
        job_id, uri, started, resumed, max_usd, max_hours, priced.prices,
        init=init.init if init else None, init_uri=init.uri if init else None,
    )  # fmt: skip
    if fresh:
        _split_s3(pointer.checkpoint_uri)  # Refuse a non-S3 folder before anything changes.
    else:
        # Before the pointer: an instance of the new job must not find the old outcome.
        history_uri, moved = archive_job_record(s3, previous.checkpoint_uri, previous.job_id)
    ssm.put_parameter(Name=name, Value=pointer.to_json(), Type="String", Overwrite=True)
    log.info("job pointer %s: %s", name, pointer.to_json())
    sizes = {asg_name(spec.name, g.name): group_sizes(g) for g in spec.groups}
    groups = tuple((asg, desired) for asg, (_, _, desired) in sizes.items())
    # An earlier job's budget deadline, left when its launchers could not end it, must not stop
    # this one: its launchers schedule their own where it has a budget.
    remove_backstop(autoscaling, list(sizes))
    failed = []
    for asg, (low, high, desired) in sizes.items():
        try:
            autoscaling.update_auto_scaling_group(
                AutoScalingGroupName=asg, MinSize=low, MaxSize=high, DesiredCapacity=desired
            )
        except Exception as e:  # Try every group; report all that failed.
            failed.append(f"{asg}: {e}")
    if failed:
        fix = "\n".join(
            f"  aws autoscaling update-auto-scaling-group --auto-scaling-group-name {asg} "
            f"--min-size {low} --max-size {high} --desired-capacity {desired}"
            for asg, (low, high, desired) in sizes.items()
        )
        raise JobStartError(
            f"job {job_id} is the current job now ({name}), but these groups were not scaled: "
            f"{'; '.join(failed)}. Fix the cause and set the sizes:\n{fix}"
        )
    return StartedJob(pointer, previous, moved, history_uri, groups, priced, init)


def _plan_s3_init(spec: ClusterSpec, s3: Any, checkpoint_base: str) -> StagedS3Init | None:
    """Where an ``s3://`` init outside the checkpoint prefix is copied, its source read now,
    before anything changes; None for any other init."""
    if not is_s3_init(spec.job.model.init):
        return None
    _split_s3(checkpoint_base)
    try:
        return plan_s3_init(str(spec.job.model.init), s3=s3, checkpoint_base_uri=checkpoint_base)
    except S3InitError as e:
        raise JobStartError(str(e)) from None


def _stage_init(
    hub: HubInit | None, planned: StagedS3Init | None, s3: Any, checkpoint_base: str
) -> StagedInit | StagedS3Init | None:
    """Upload a ``timm:`` init's files, or copy an ``s3://`` one's, unless they are staged
    already; None when the init needs neither."""
    try:
        if hub is not None:
            _split_s3(checkpoint_base)
            return stage_timm_init(hub, s3=s3, checkpoint_base_uri=checkpoint_base)
        return copy_staged(planned, s3) if planned is not None else None
    except StagingError as e:
        raise JobStartError(str(e)) from e


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="job_action", required=True, metavar="ACTION")
    start = actions.add_parser(
        "start",
        help="start another job on the deployed cluster (no redeploy)",
        description="Start another job on the deployed cluster: a new job id in the SSM job "
        "pointer, then every Auto Scaling group at the spec's count.",
    )
    start.add_argument("--spec", default="cluster.toml", help="the deployed cluster spec")
    mode = start.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume",
        dest="fresh",
        action="store_false",
        help="(default) keep the checkpoints: resume from the newest complete one; the old job "
        "record moves to <uri>job-history/<old job id>/",
    )
    mode.add_argument(
        "--fresh",
        dest="fresh",
        action="store_true",
        help="new checkpoint folder <parent of the current one>/<new job id>/: start at step 0",
    )
    start.set_defaults(fresh=False)
    start.add_argument(
        "--force",
        action="store_true",
        help="start even while the current job runs (its hosts leave it for the new one)",
    )
    start.add_argument(
        "--max-usd",
        type=float,
        help="this job's cap in USD instead of the spec's job.max_usd (e.g. to resume a job its "
        "budget stopped with more to spend)",
    )
    start.add_argument(
        "--max-hours",
        type=float,
        help="this job's cap in hours instead of the spec's job.max_hours",
    )
    start.add_argument(
        "--offline-prices",
        action="store_true",
        help="price the groups from the spec and the dated offline catalogue only, asking AWS "
        "nothing (default: Spot price history and the Price List API, that day)",
    )
    start.add_argument("--region", help="AWS region (default: the usual boto3 configuration)")


def run(args: argparse.Namespace) -> int:
    from botocore.exceptions import BotoCoreError, ClientError  # Deferred: a heavy import.

    spec = load_spec(args.spec)
    try:
        started = start_job(
            spec,
            ssm=client("ssm", region=args.region, attempts=MAX_ATTEMPTS),
            autoscaling=client("autoscaling", region=args.region),
            s3=client("s3", region=args.region),
            fresh=args.fresh,
            force=args.force,
            spec_path=args.spec,
            max_usd=args.max_usd,
            max_hours=args.max_hours,
            ec2=None if args.offline_prices else client("ec2", region=args.region),
            pricing=None if args.offline_prices else pricing_client(),
        )
    except (JobStartError, JobParameterNotFound, JobPointerError) as e:
        print(f"hetero job start: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (BotoCoreError, ClientError) as e:
        print(f"hetero job start: AWS refused or could not be reached: {e}", file=sys.stderr)
        return EXIT_REFUSED
    print(report(started, spec_path=args.spec))
    return 0


def report(started: StartedJob, *, spec_path: str) -> str:
    """What ``hetero job start`` prints: the job, its checkpoints and how to follow it."""
    p = started.pointer
    lines = [
        f"started job {p.job_id}"
        + (f" (resumes job {p.resumed_from})" if p.resumed_from else " (fresh, from step 0)"),
        f"checkpoints: {p.checkpoint_uri}",
    ]
    if started.init is not None:
        lines.append(f"job.model.init: {started.init.describe()}")
    caps = [f"{k} {v:g}" for k, v in (("max_usd", p.max_usd), ("max_hours", p.max_hours)) if v]
    if caps:
        lines.append(f"budget: {', '.join(caps)} (instead of the spec's)")
    if started.history_uri is not None:
        lines.append(
            f"job {started.previous.job_id}'s record: moved to {started.history_uri} "
            f"({len(started.moved)} objects)"
        )
    lines.append("groups: " + ", ".join(f"{asg} {count}" for asg, count in started.groups))
    lines.append("prices, each group at its most (the job's budget):")
    lines += [f"  {line}" for line in price_lines(started.priced.prices)]
    lines.append(f"follow it: hetero status --spec {spec_path}")
    return "\n".join(lines)
