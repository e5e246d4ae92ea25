"""``hetero sagemaker submit``: run a spec as a SageMaker heterogeneous training job.

The job uses what the cluster stack (``<spec.name>-cluster``) already built: its image, its
SageMaker execution role, its subnet and security group, and its checkpoint bucket. The spec
itself reaches the containers at run time as the input channel ``spec`` (uploaded beside the
job's output), so a spec change needs no image rebuild.

How a spec becomes one ``CreateTrainingJob`` request:

- one SageMaker instance group per spec group, same name and count, with the group's FIRST
  instance type prefixed ``ml.`` (a SageMaker instance group has exactly one type);
- managed Spot (``EnableManagedSpotTraining``) only when every group is ``market = "spot"``:
  SageMaker's switch is per job, not per instance group, so a mixed spec runs On-Demand;
- one subnet (collocation) and the cluster security group;
- ``StoppingCondition.MaxRuntimeInSeconds``: ``--max-run``, or less where the spec's
  ``job.max_hours`` / ``job.max_usd`` allow less (``sagemaker_budget``: SageMaker stops the job
  there; ``job.max_usd`` is priced at SageMaker's own training rates, read from the Price List
  API, and refused when they cannot be read);
- ``CheckpointConfig`` at a job-specific prefix under the bucket's ``checkpoints/`` prefix (with
  ``--resume JOB``: JOB's, read with ``DescribeTrainingJob``, so the job continues from JOB's
  newest checkpoint), and the same URI in ``HETERO_CHECKPOINT_URI`` so the trainer writes every
  host's shards there itself (the container cannot see ``CheckpointConfig`` otherwise);
- a ``timm:NAME.TAG`` ``job.model.init`` is resolved here (the Hugging Face cache, or a download
  into it) and staged at ``checkpoints/init/<sha256>/`` unless it is there already
  (``training.common.timm_hub``; the job's subnet has no internet route), and
  ``HETERO_INIT_URI`` names that folder. An ``s3://`` init outside ``checkpoints/`` (another
  bucket: the execution role reads only the checkpoint prefix) is read here (``HeadObject``, or
  ``ListObjectsV2`` of a folder) and copied server-side, with the user's credentials, into
  ``checkpoints/init/<sha256 of its URI and ETags>/`` unless it is there already
  (``training.common.s3_init``); ``HETERO_INIT_URI`` names the copy.

Which instance types SageMaker offers: the ``TrainingInstanceType`` enum of the SageMaker
service model in the installed botocore (the same list the API reference publishes). A type
missing there is refused before anything is created; if SageMaker has added it since, upgrading
botocore (``pip install -U botocore boto3``) updates the list.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from training import instance_types
from training.common import aws
from training.common.jobparam import GroupPrice
from training.common.names import (
    ENV_CHECKPOINT_URI,
    ENV_INIT_URI,
    ENV_SPEC,
    SAGEMAKER_CHECKPOINT_DIR,
    SAGEMAKER_JOB_PREFIX,
    SAGEMAKER_OUTPUT_DIR,
    SAGEMAKER_SPEC_CHANNEL,
)
from training.common.s3 import s3_uri
from training.common.s3_init import (
    S3InitError,
    StagedS3Init,
    copy_staged,
    is_s3_init,
    plan_s3_init,
)
from training.common.tensorboard_paths import FOLDER as TB_FOLDER
from training.common.tensorboard_paths import tensorboard_uri
from training.common.timm_hub import (
    HubInitError,
    StagedInit,
    StagingError,
    human_size,
    is_timm_init,
    plan_staging,
    resolve_timm_init,
    upload_staged,
)
from training.prices import pricing_client
from training.spec import ClusterSpec, DatasetSource, InstanceGroup, Market, load_spec
from training.workstation.sagemaker_budget import PriceError, price_job, runtime_limit

log = logging.getLogger(__name__)

CONTAINER_INPUT_DIR = "/opt/ml/input/data"
DEFAULT_MAX_RUN_S = 86_400
"""SageMaker's own default for ``MaxRuntimeInSeconds`` (1 day)."""
MAX_RUN_LIMIT_S = 28 * 86_400
"""SageMaker's upper bound for ``MaxRuntimeInSeconds`` (28 days)."""
DEFAULT_VOLUME_GB = 100
"""EBS volume per instance: EBS-only types (c5, c6i...) need one; it holds the checkpoint copy
SageMaker restores into ``/opt/ml/checkpoints`` on a restart, and the job's output."""

REQUIRED_OUTPUTS = (
    "ImageUri",
    "SageMakerRoleArn",
    "SubnetId",
    "SecurityGroupId",
    "CheckpointBucketName",
    "CheckpointUri",
)
"""Cluster stack outputs the request is built from (``infra/stacks.py``)."""

RUNNING_STATUSES = frozenset({"InProgress", "Stopping"})
"""``TrainingJobStatus`` values of a job that may still write its checkpoints."""


class SubmitError(RuntimeError):
    """The job cannot be submitted; the message says what to change."""


@dataclass(frozen=True)
class SageMakerRules:
    """What the SageMaker API accepts, read from botocore's service model (not hard-coded, so
    a botocore upgrade brings new instance types and limits with it)."""

    instance_types: frozenset[str]
    """``TrainingInstanceType`` values (``ml.*``)."""
    max_instance_groups: int
    job_name_pattern: re.Pattern[str]
    job_name_max: int

    @classmethod
    def from_service_model(cls, model: Any) -> SageMakerRules:
        name = model.shape_for("TrainingJobName").metadata
        return cls(
            instance_types=frozenset(model.shape_for("TrainingInstanceType").enum),
            max_instance_groups=int(model.shape_for("InstanceGroups").metadata["max"]),
            job_name_pattern=re.compile(name["pattern"]),
            job_name_max=int(name["max"]),
        )


@dataclass(frozen=True)
class SubmitPlan:
    """Everything ``submit`` will do, decided before anything is called."""

    request: dict[str, Any]
    """Keyword arguments of ``CreateTrainingJob``."""
    spec_bucket: str
    spec_key: str
    """Where the spec file is uploaded (the ``spec`` channel's prefix plus its file name)."""
    warnings: tuple[str, ...]
    budget: tuple[str, ...] = ()
    """The plan's lines on what stops the job (``RuntimeLimit.lines``) and what it resumes."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    submit = actions.add_parser(
        "submit",
        help="create a SageMaker heterogeneous training job from the spec and the cluster stack",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    submit.add_argument(
        "--spec", default="cluster.toml", help="cluster spec (default: %(default)s)"
    )
    submit.add_argument(
        "--stack-name", help="the deployed cluster stack (default: <spec name>-cluster)"
    )
    submit.add_argument(
        "--job-name", help="training job name (default: <spec name>-<UTC yyyymmdd-HHMMSS>)"
    )
    submit.add_argument(
        "--max-run",
        type=int,
        default=DEFAULT_MAX_RUN_S,
        metavar="SECONDS",
        help="MaxRuntimeInSeconds: training time allowed (default: %(default)s)",
    )
    submit.add_argument(
        "--max-wait",
        type=int,
        metavar="SECONDS",
        help="managed Spot only, MaxWaitTimeInSeconds: training plus waiting for Spot capacity, "
        "at least --max-run (default: twice --max-run)",
    )
    submit.add_argument(
        "--resume",
        metavar="JOB",
        help="continue the earlier training job JOB (of this spec, ended) from its newest "
        "checkpoint: the new job reads and writes JOB's checkpoint prefix (DescribeTrainingJob)",
    )
    submit.add_argument(
        "--volume-size-gb",
        type=int,
        default=DEFAULT_VOLUME_GB,
        metavar="GB",
        help="EBS volume per instance (default: %(default)s)",
    )
    submit.add_argument(
        "--dry-run",
        action="store_true",
        help="print the CreateTrainingJob request as JSON; only read (DescribeStacks, and "
        "GetProducts for job.max_usd, DescribeTrainingJob for --resume, HeadObject or "
        "ListObjectsV2 of an s3:// init), create nothing",
    )


def run(args: argparse.Namespace) -> int:
    """``hetero sagemaker submit``: 0 submitted (or dry run), 2 nothing submitted because of
    what the message names, 1 an AWS call failed."""
    if args.action != "submit":  # pragma: no cover - argparse allows only the listed actions
        raise SystemExit(f"unknown action {args.action!r}")
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return submit(
            spec_path=args.spec,
            stack_name=args.stack_name,
            job_name=args.job_name,
            max_run_s=args.max_run,
            max_wait_s=args.max_wait,
            volume_size_gb=args.volume_size_gb,
            resume=args.resume,
            dry_run=args.dry_run,
            cloudformation=aws.client("cloudformation"),
            s3=aws.client("s3"),
            sagemaker=aws.client("sagemaker"),
            pricing=pricing_client(),
        )
    except SubmitError as e:
        print(f"hetero sagemaker submit: {e}", file=sys.stderr)
        return 2
    except (BotoCoreError, ClientError) as e:
        print(f"hetero sagemaker submit: AWS call failed: {e}", file=sys.stderr)
        return 1


def submit(
    *,
    spec_path: str | Path,
    cloudformation: Any,
    s3: Any,
    sagemaker: Any,
    pricing: Any = None,
    stack_name: str | None = None,
    job_name: str | None = None,
    max_run_s: int = DEFAULT_MAX_RUN_S,
    max_wait_s: int | None = None,
    volume_size_gb: int = DEFAULT_VOLUME_GB,
    resume: str | None = None,
    dry_run: bool = False,
    rules: SageMakerRules | None = None,
    now: datetime | None = None,
) -> int:
    """Describe the stack (and ``resume``'s job), price the job where ``job.max_usd`` needs it
    (``pricing``: the Price List client), build the request, then (unless ``dry_run``) upload
    the spec and create the job. Raises ``SubmitError`` (nothing created) or botocore's
    errors."""
    spec = load_spec(spec_path)
    stack = stack_name or f"{spec.name}-cluster"
    region = sagemaker.meta.region_name
    outputs = stack_outputs(
        cloudformation, stack, region=region, deploy=f"npx cdk deploy -c spec={spec_path} {stack}"
    )
    name = job_name or default_job_name(spec.name, now)
    rules = rules or SageMakerRules.from_service_model(sagemaker.meta.service_model)
    resumed = resume_checkpoints(sagemaker, resume, outputs["CheckpointUri"]) if resume else None
    prices = _job_prices(spec, rules, pricing, region, now)
    init = _init_staging(spec, outputs["CheckpointUri"], s3)
    plan = build_plan(
        spec,
        outputs,
        spec_file_name=Path(spec_path).name,
        job_name=name,
        max_run_s=max_run_s,
        max_wait_s=max_wait_s,
        volume_size_gb=volume_size_gb,
        rules=rules,
        init_uri=init.uri if init else None,
        prices=prices,
        resumed=resumed,
    )
    for warning in plan.warnings:
        log.warning("%s", warning)
    if dry_run:
        print(json.dumps(plan.request, indent=2))
        staged = (
            f", {'copy ' if isinstance(init, StagedS3Init) else ''}{init.init} "
            f"({human_size(init.size)}) to {init.uri} unless it is there,"
            if init
            else ""
        )
        print(
            f"dry run: would upload {spec_path} to s3://{plan.spec_bucket}/{plan.spec_key}"
            f"{staged} and create the job above; nothing was created",
            *plan.budget,
            sep="\n",
            file=sys.stderr,
        )
        return 0
    if init is not None:
        init = _stage(init, s3)
    s3.put_object(Bucket=plan.spec_bucket, Key=plan.spec_key, Body=Path(spec_path).read_bytes())
    sagemaker.create_training_job(**plan.request)
    print(f"created SageMaker training job {name}")
    print(f"  console: {console_url(region, name)}")
    print(
        f"  status:  aws sagemaker describe-training-job --training-job-name {name} "
        f"--region {region}"
    )
    if init is not None:
        print(f"  job.model.init: {init.describe()}")
    for line in plan.budget:
        print(f"  {line}")
    return 0


@dataclass(frozen=True)
class Resumed:
    """The earlier job a submission continues (``--resume``)."""

    job_name: str
    checkpoint_uri: str
    """Its ``CheckpointConfig.S3Uri``: the first job's prefix along a chain of resumes."""
    status: str
    """``TrainingJobStatus``, and the secondary status where it says more (e.g. ``Stopped,
    MaxRuntimeExceeded``)."""


def resume_checkpoints(sagemaker: Any, job_name: str, checkpoint_base_uri: str) -> Resumed:
    """Where ``job_name`` kept its checkpoints (``DescribeTrainingJob``); ``SubmitError``
    naming the fix when it does not exist, may still be writing them (in progress or
    stopping), or is not a job of this stack's bucket."""
    from botocore.exceptions import ClientError

    try:
        job = sagemaker.describe_training_job(TrainingJobName=job_name)
    except ClientError as e:
        # SageMaker answers a name it does not know with ValidationException.
        if e.response.get("Error", {}).get("Code") == "ValidationException":
            raise SubmitError(
                f"--resume {job_name}: SageMaker has no training job of that name in "
                f"{sagemaker.meta.region_name} ({e.response['Error'].get('Message', '')}); name "
                "an earlier job of this spec (aws sagemaker list-training-jobs)"
            ) from e
        raise
    status = job.get("TrainingJobStatus", "?")
    secondary = job.get("SecondaryStatus")
    shown = status if secondary in (None, status) else f"{status}, {secondary}"
    if status in RUNNING_STATUSES:
        raise SubmitError(
            f"--resume {job_name}: that job is {shown} and may still write its checkpoints; "
            f"wait until it ends, or stop it (aws sagemaker stop-training-job "
            f"--training-job-name {job_name}) and submit again once it is Stopped"
        )
    uri = (job.get("CheckpointConfig") or {}).get("S3Uri", "")
    base = f"{checkpoint_base_uri.rstrip('/')}/{SAGEMAKER_JOB_PREFIX}/"
    if not uri.startswith(base):
        raise SubmitError(
            f"--resume {job_name}: its checkpoints ({uri or 'no CheckpointConfig'}) are not "
            f"under this stack's {base}; resume a job this stack's `hetero sagemaker submit` "
            "created"
        )
    return Resumed(job_name, uri if uri.endswith("/") else uri + "/", shown)


def _job_prices(
    spec: ClusterSpec, rules: SageMakerRules, pricing: Any, region: str, now: datetime | None
) -> tuple[GroupPrice, ...] | None:
    """SageMaker's prices of the job's groups when ``job.max_usd`` needs them; None without
    it, or while a group's type is one SageMaker lacks (``build_plan`` names that problem)."""
    groups = [sagemaker_group(g) for g in spec.groups]
    if spec.job.max_usd is None or any(
        g["InstanceType"] not in rules.instance_types for g in groups
    ):
        return None
    try:
        return price_job(
            groups,
            pricing=pricing or pricing_client(),
            region=region,
            max_usd=spec.job.max_usd,
            now=now,
        )
    except PriceError as e:
        raise SubmitError(str(e)) from e


def _init_staging(
    spec: ClusterSpec, checkpoint_base_uri: str, s3: Any
) -> StagedInit | StagedS3Init | None:
    """A ``timm:`` init resolved on this machine, or an ``s3://`` one outside the checkpoint
    prefix read with ``s3``, and where it is staged (nothing uploaded or copied yet); None for
    any other init. ``SubmitError`` naming the fix when it cannot be resolved or read."""
    init = spec.job.model.init
    if is_s3_init(init):
        try:
            return plan_s3_init(str(init), s3=s3, checkpoint_base_uri=checkpoint_base_uri)
        except S3InitError as e:
            raise SubmitError(str(e)) from None
    if not is_timm_init(init):
        return None
    try:
        hub = resolve_timm_init(str(spec.job.model.init))
    except HubInitError as e:
        raise SubmitError(f"job.model.init = {e}") from None
    return plan_staging(hub, checkpoint_base_uri)


def _stage(init: StagedInit | StagedS3Init, s3: Any) -> StagedInit | StagedS3Init:
    """Upload a ``timm:`` init's files, or copy an ``s3://`` one's, unless they are there."""
    try:
        return copy_staged(init, s3) if isinstance(init, StagedS3Init) else upload_staged(init, s3)
    except StagingError as e:
        raise SubmitError(str(e)) from e


def stack_outputs(
    cloudformation: Any, stack_name: str, *, region: str, deploy: str
) -> dict[str, str]:
    """The stack's outputs by key; ``SubmitError`` naming the fix (``deploy``, the command that
    deploys it) when the stack is missing or lacks an output the job needs."""
    from botocore.exceptions import ClientError

    try:
        stacks = cloudformation.describe_stacks(StackName=stack_name)["Stacks"]
    except ClientError as e:
        error = e.response.get("Error", {})
        if error.get("Code") == "ValidationError" and "does not exist" in error.get("Message", ""):
            raise SubmitError(
                f"stack {stack_name!r} does not exist in {region}: deploy the cluster first "
                f"(`{deploy}`), or pass --stack-name / set AWS_REGION to where it is deployed"
            ) from e
        raise
    stack = stacks[0]
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
    missing = [k for k in REQUIRED_OUTPUTS if not outputs.get(k)]
    if missing:
        raise SubmitError(
            f"stack {stack_name!r} (status {stack.get('StackStatus', '?')}) has no output "
            f"{', '.join(missing)}: finish or redo `{deploy}` with this project's stacks"
        )
    return outputs


def default_job_name(cluster: str, now: datetime | None = None) -> str:
    """``<cluster>-<UTC yyyymmdd-HHMMSS>``: unique per second, sorted by time."""
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    return f"{cluster}-{moment:%Y%m%d-%H%M%S}"


def console_url(region: str, job_name: str) -> str:
    return (
        f"https://{region}.console.aws.amazon.com/sagemaker/home?region={region}#/jobs/{job_name}"
    )


def build_plan(
    spec: ClusterSpec,
    outputs: Mapping[str, str],
    *,
    spec_file_name: str,
    job_name: str,
    rules: SageMakerRules,
    max_run_s: int = DEFAULT_MAX_RUN_S,
    max_wait_s: int | None = None,
    volume_size_gb: int = DEFAULT_VOLUME_GB,
    init_uri: str | None = None,
    prices: tuple[GroupPrice, ...] | None = None,
    resumed: Resumed | None = None,
) -> SubmitPlan:
    """The ``CreateTrainingJob`` request for ``spec`` on the stack's resources (pure: nothing
    is called). ``init_uri``: where a ``timm:`` or ``s3://`` init is staged (``HETERO_INIT_URI``);
    ``prices``: the job's SageMaker prices (``job.max_usd`` needs them); ``resumed``: the job
    whose checkpoints this one continues. Every problem found is reported together in one
    ``SubmitError``."""
    problems: list[str] = []
    warnings: list[str] = []

    if not (
        1 <= len(job_name) <= rules.job_name_max and rules.job_name_pattern.fullmatch(job_name)
    ):
        problems.append(
            f"--job-name {job_name!r}: SageMaker job names are 1-{rules.job_name_max} letters, "
            "digits and '-', starting and ending with a letter or digit"
        )
    if not 1 <= max_run_s <= MAX_RUN_LIMIT_S:
        problems.append(
            f"--max-run {max_run_s}: SageMaker allows 1 to {MAX_RUN_LIMIT_S} seconds (28 days)"
        )
    if volume_size_gb < 1:
        problems.append(f"--volume-size-gb {volume_size_gb}: give at least 1 GB")

    groups = instance_groups(spec, rules, problems)
    spot_groups = [g.name for g in spec.groups if g.market is Market.SPOT]
    managed_spot = len(spot_groups) == len(spec.groups)
    limit = None
    if not problems:
        try:
            limit = runtime_limit(
                max_run_s=max_run_s,
                max_hours=spec.job.max_hours,
                max_usd=spec.job.max_usd,
                prices=prices or (),
                managed_spot=managed_spot,
            )
        except ValueError as e:
            problems.append(str(e))
    runtime_s = limit.seconds if limit else max_run_s
    if spec.job.dataset.source is DatasetSource.FOLDER:
        warnings.append(
            f"job.dataset is the folder {spec.job.dataset.path!r}: SageMaker gets no channel for "
            "it, so it must exist inside the image; use source = 's3' for data in S3"
        )

    if managed_spot:
        wait = max_wait_s if max_wait_s is not None else 2 * runtime_s
        if wait < runtime_s:
            runtime = (
                f"--max-run {runtime_s}"
                if limit is None or limit.from_max_run
                else f"MaxRuntimeInSeconds {runtime_s} (set by {limit.source})"
            )
            problems.append(
                f"--max-wait {wait} is below {runtime}: with managed Spot, "
                "MaxWaitTimeInSeconds counts the training time plus the time spent waiting for "
                f"Spot capacity, so it must be at least MaxRuntimeInSeconds; use --max-wait >= "
                f"{runtime_s}"
            )
    else:
        wait = 0
        if max_wait_s is not None:
            problems.append(
                "--max-wait applies to managed Spot only, and this job runs On-Demand (not every "
                "group is market = 'spot'); drop --max-wait or make every group Spot"
            )
        if spot_groups:
            on_demand = [g.name for g in spec.groups if g.market is not Market.SPOT]
            warnings.append(
                f"groups {', '.join(spot_groups)} ask for Spot but {', '.join(on_demand)} "
                "On-Demand: SageMaker's managed Spot is one switch for the whole job "
                "(EnableManagedSpotTraining), not per instance group, so every group runs "
                "On-Demand; set market = 'spot' on every group to use managed Spot"
            )

    if problems:
        raise SubmitError(
            f"{spec.source}: cannot submit ({len(problems)} problem(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )

    bucket = outputs["CheckpointBucketName"]
    job_uri = s3_uri(bucket, f"{SAGEMAKER_JOB_PREFIX}/{job_name}")
    checkpoint_uri = (
        resumed.checkpoint_uri
        if resumed
        else f"{outputs['CheckpointUri'].rstrip('/')}/{SAGEMAKER_JOB_PREFIX}/{job_name}/"
    )
    stopping: dict[str, int] = {"MaxRuntimeInSeconds": runtime_s}
    if managed_spot:
        stopping["MaxWaitTimeInSeconds"] = wait
    request: dict[str, Any] = {
        "TrainingJobName": job_name,
        "RoleArn": outputs["SageMakerRoleArn"],
        # No ContainerEntrypoint: SageMaker runs the image with `train`, which the image's
        # entry point (containers/entrypoint.sh) turns into `hetero launch --spec $HETERO_SPEC`.
        "AlgorithmSpecification": {
            "TrainingImage": outputs["ImageUri"],
            "TrainingInputMode": "File",
        },
        "ResourceConfig": {"InstanceGroups": groups, "VolumeSizeInGB": volume_size_gb},
        "InputDataConfig": [
            {
                "ChannelName": SAGEMAKER_SPEC_CHANNEL,
                "DataSource": {
                    "S3DataSource": {
                        "S3DataType": "S3Prefix",
                        "S3Uri": f"{job_uri}/{SAGEMAKER_SPEC_CHANNEL}/",
                        "S3DataDistributionType": "FullyReplicated",
                        # Every group's launcher reads the spec.
                        "InstanceGroupNames": [g.name for g in spec.groups],
                    }
                },
                "InputMode": "File",
            }
        ],
        "OutputDataConfig": {"S3OutputPath": f"{job_uri}/output/"},
        "VpcConfig": {
            "Subnets": [outputs["SubnetId"]],
            "SecurityGroupIds": [outputs["SecurityGroupId"]],
        },
        "StoppingCondition": stopping,
        "EnableManagedSpotTraining": managed_spot,
        "CheckpointConfig": {"S3Uri": checkpoint_uri, "LocalPath": SAGEMAKER_CHECKPOINT_DIR},
        # The trainer's event files (its run folder is SAGEMAKER_OUTPUT_DIR): SageMaker's own
        # TensorBoard finds them here, and SageMaker syncs them to the same S3 folder the
        # trainer uploads them to (training/trainer/tensorboard_log.py).
        "TensorBoardOutputConfig": {
            "LocalPath": f"{SAGEMAKER_OUTPUT_DIR}/{TB_FOLDER}",
            "S3OutputPath": tensorboard_uri(checkpoint_uri),
        },
        "Environment": {
            ENV_SPEC: f"{CONTAINER_INPUT_DIR}/{SAGEMAKER_SPEC_CHANNEL}/{spec_file_name}",
            ENV_CHECKPOINT_URI: checkpoint_uri,
            **({ENV_INIT_URI: init_uri} if init_uri else {}),
        },
    }
    return SubmitPlan(
        request=request,
        spec_bucket=bucket,
        spec_key=f"{SAGEMAKER_JOB_PREFIX}/{job_name}/{SAGEMAKER_SPEC_CHANNEL}/{spec_file_name}",
        warnings=tuple(warnings),
        budget=(
            *(limit.lines if limit else ()),
            f"checkpoints: {checkpoint_uri}"
            + (
                f" (resumes job {resumed.job_name}, {resumed.status}, from its newest complete "
                "checkpoint)"
                if resumed
                else " (a fresh start: --resume JOB continues an earlier job)"
            ),
        ),
    )


def instance_groups(
    spec: ClusterSpec, rules: SageMakerRules, problems: list[str]
) -> list[dict[str, Any]]:
    """SageMaker instance groups for the spec's groups; appends to ``problems`` what SageMaker
    cannot run."""
    if len(spec.groups) > rules.max_instance_groups:
        problems.append(
            f"groups: {len(spec.groups)} instance groups, SageMaker allows at most "
            f"{rules.max_instance_groups} per job; merge groups"
        )
    groups: list[dict[str, Any]] = []
    for i, g in enumerate(spec.groups):
        first = g.instance_types[0]
        ml_type = f"ml.{first}"
        if ml_type not in rules.instance_types:
            offered = [t for t in g.instance_types if f"ml.{t}" in rules.instance_types]
            # Suggest only what the spec accepts (the project's catalogue) and the group can
            # use (same GPU count: none for dataprep, the trainer's ranks per instance).
            gpus = instance_types.CATALOG[first].gpus
            usable = [
                t.name
                for t in instance_types.CATALOG.values()
                if f"ml.{t.name}" in rules.instance_types and t.gpus == gpus and not t.burstable
            ]
            close = difflib.get_close_matches(first, sorted(usable), n=3, cutoff=0.0)
            hint = (
                f"move {offered[0]} (listed, and SageMaker has it) first"
                if offered
                else f"list first a type SageMaker has (e.g. {', '.join(close)})"
                if close
                else "list first a type SageMaker has"
            )
            problems.append(
                f"groups[{i}] ({g.name}): SageMaker training has no instance type {ml_type} "
                f"(botocore's TrainingInstanceType list); {hint} in instance_types, or upgrade "
                "botocore if SageMaker added it recently"
            )
            continue
        if len(g.instance_types) > 1:
            log.info(
                "group %s lists %s; a SageMaker instance group has one type: using %s",
                g.name,
                ", ".join(g.instance_types),
                ml_type,
            )
        groups.append(sagemaker_group(g))
    return groups


def sagemaker_group(group: InstanceGroup) -> dict[str, Any]:
    """The SageMaker instance group that runs ``group``: its name and count, and its first
    listed type with ``ml.`` in front (a SageMaker instance group has one type)."""
    return {
        "InstanceGroupName": group.name,
        "InstanceType": f"ml.{group.instance_types[0]}",
        "InstanceCount": group.count,
    }
