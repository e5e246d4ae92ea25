"""Cluster-wide resources: the image, the checkpoint bucket, the log group, and the two IAM
roles (EC2 instances and SageMaker training jobs). Placement groups are per instance group
(``infra.instance_group``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

from aws_cdk import ArnFormat, Aws, Duration, RemovalPolicy, Stack
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from constructs import Construct

from training.common.names import (
    CHECKPOINT_PREFIX,
    SAGEMAKER_JOB_PREFIX,
    SAGEMAKER_SPEC_CHANNEL,
    TAG_CLUSTER,
)
from training.common.s3_init import is_file_init, is_s3_init
from training.spec import DatasetSource, DatasetSpec, Role

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The Docker build context: the Dockerfile COPYs containers/, pyproject.toml, README.md and
training/ (``.dockerignore`` lets in nothing else). No spec: it reaches the instances at run
time (EC2 user data, SageMaker's ``spec`` channel)."""
DOCKERFILE = "containers/Dockerfile"


TRAINER_TARGET = "trainer"
"""The Dockerfile target of the GPU image: trainer groups, and every SageMaker job (SageMaker runs
one image on all of a job's instance groups)."""
DATA_SERVER_TARGET = "data-server"
"""The Dockerfile target of the CPU image: dataprep groups (no CUDA, no EFA)."""


class ClusterImage(Construct):
    """The cluster's two container images, two targets of ``containers/Dockerfile``: the trainer
    image (torch with its CUDA wheels, the EFA stack) and the data-server image (PyTorch's CPU
    builds, nothing GPU), so a CPU instance the elastic tier adds pulls no CUDA.

    Attributes: ``asset`` and ``image_uri`` (the trainer image; ``cdk deploy`` builds and pushes
    each asset to the bootstrap ECR repository), ``data_server_asset``,
    ``data_server_image_uri``, and ``uri_for(role)``.
    """

    def __init__(self, scope: Construct, construct_id: str, *, build_context: Path) -> None:
        super().__init__(scope, construct_id)
        dockerfile = build_context / DOCKERFILE
        if not dockerfile.is_file():
            raise FileNotFoundError(f"{dockerfile}: the image's Dockerfile is missing")

        def image(asset_id: str, target: str, name: str) -> ecr_assets.DockerImageAsset:
            # The repo root is the context (the image installs the project); .dockerignore
            # there keeps .venv, node_modules and cdk.out out of the staged asset.
            return ecr_assets.DockerImageAsset(
                self,
                asset_id,
                directory=str(build_context),
                file=DOCKERFILE,
                target=target,
                platform=ecr_assets.Platform.LINUX_AMD64,
                display_name=name,
            )

        self.asset = image("Asset", TRAINER_TARGET, "hetero trainer image")
        self.image_uri: str = self.asset.image_uri
        self.data_server_asset = image("DataServerAsset", DATA_SERVER_TARGET, "hetero data server")
        self.data_server_image_uri: str = self.data_server_asset.image_uri

    def uri_for(self, role: Role) -> str:
        """The image the instances of ``role`` run."""
        return self.image_uri if role is Role.TRAINER else self.data_server_image_uri


class CheckpointBucket(Construct):
    """The S3 bucket the trainer writes checkpoints to: SSL only, encrypted, versioned, no
    public access, old versions expire; retained on ``cdk destroy`` unless ``destroy_on_delete``.

    Attributes: ``bucket``, ``prefix`` (key prefix the roles may use) and ``uri``
    (``s3://bucket/prefix/``).
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        destroy_on_delete: bool = False,
        noncurrent_version_days: int = 30,
    ) -> None:
        super().__init__(scope, construct_id)
        self.prefix = CHECKPOINT_PREFIX
        self.bucket = s3.Bucket(
            self,
            "Bucket",
            encryption=s3.BucketEncryption.S3_MANAGED,
            enforce_ssl=True,
            versioned=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            lifecycle_rules=[
                s3.LifecycleRule(
                    id="expire-old-checkpoint-versions",
                    noncurrent_version_expiration=Duration.days(noncurrent_version_days),
                    abort_incomplete_multipart_upload_after=Duration.days(7),
                )
            ],
            removal_policy=RemovalPolicy.DESTROY if destroy_on_delete else RemovalPolicy.RETAIN,
            auto_delete_objects=destroy_on_delete,
        )
        self.uri = f"s3://{self.bucket.bucket_name}/{self.prefix}/"

    def grant_checkpoint_access(self, grantee: iam.IGrantable) -> None:
        """Let ``grantee`` list, read, write and delete objects under the prefix, nothing else."""
        grantee.grant_principal.add_to_principal_policy(
            iam.PolicyStatement(
                sid="CheckpointObjects",
                actions=[
                    "s3:GetObject",
                    "s3:PutObject",
                    "s3:DeleteObject",
                    "s3:AbortMultipartUpload",
                ],
                resources=[self.bucket.arn_for_objects(f"{self.prefix}/*")],
            )
        )
        grantee.grant_principal.add_to_principal_policy(
            iam.PolicyStatement(
                sid="CheckpointListing",
                actions=["s3:ListBucket"],
                resources=[self.bucket.bucket_arn],
                conditions={"StringLike": {"s3:prefix": [self.prefix, f"{self.prefix}/*"]}},
            )
        )


def dataset_location(dataset_uri: str) -> tuple[str, str]:
    """(bucket, key prefix) of an ``s3://bucket/prefix/`` dataset URI, the prefix as the
    dataset reader lists it (``training/data/datasets.py``: ending in '/', or empty)."""
    parsed = urlparse(dataset_uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"dataset URI {dataset_uri!r} must look like s3://bucket/prefix/")
    prefix = parsed.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return parsed.netloc, prefix


def dataset_read_uri(dataset: DatasetSpec) -> str | None:
    """The ``s3://bucket/prefix/`` the instances must read for ``[job.dataset]``, or None (no
    data in S3): the prefix of ``source = "s3"``, or the folder that holds the manifest and the
    shards of ``source = "shards"`` in S3 (its ``path`` may name ``manifest.json`` itself)."""
    if dataset.source is DatasetSource.S3:
        return dataset.path
    path = dataset.path or ""
    if dataset.source is DatasetSource.SHARDS and path.startswith("s3://"):
        # training.data.manifest's folder_of(manifest_uri(path)), without importing the data
        # package (and torch) into a synth; a test keeps the two the same.
        return path.rsplit("/", 1)[0] + "/" if path.endswith(".json") else path.rstrip("/") + "/"
    return None


def grant_dataset_read(grantee: iam.IGrantable, dataset_uri: str) -> None:
    """Let ``grantee`` list and read the objects under ``dataset_uri`` (the spec's
    ``job.dataset.path`` with ``source = "s3"``, ``s3://bucket/prefix/``) and nothing else in
    that bucket: the trainer and the data servers read the images from S3 themselves."""
    grant_prefix_read(grantee, dataset_uri, "Dataset")


def init_read_uri(init: str | None) -> str | None:
    """The ``s3://bucket/folder/`` the instances read an ``s3://`` ``job.model.init`` from in the
    job ``cdk deploy`` starts (``hetero job start`` and ``sagemaker submit`` copy it into the
    checkpoint bucket first: ``training.common.s3_init``): the init's folder, or the folder that
    holds its file (the ``config.json`` beside a weights file is read too), or None."""
    if not is_s3_init(init):
        return None
    uri = str(init).strip()
    return uri.rsplit("/", 1)[0] + "/" if is_file_init(uri) else uri.rstrip("/") + "/"


def grant_prefix_read(
    grantee: iam.IGrantable, uri: str, name: str, *, listing: bool = True
) -> None:
    """``<name>Objects``: ``s3:GetObject`` on the objects under ``uri`` (``s3://bucket/prefix/``);
    with ``listing``, ``<name>Listing``: ``s3:ListBucket`` on its bucket for that prefix only;
    nothing else in that bucket."""
    bucket, prefix = dataset_location(uri)
    # The bucket is the user's, not the stack's: its ARN is built, not referenced.
    bucket_arn = f"arn:{Aws.PARTITION}:s3:::{bucket}"
    grantee.grant_principal.add_to_principal_policy(
        iam.PolicyStatement(
            sid=f"{name}Objects",
            actions=["s3:GetObject"],
            resources=[f"{bucket_arn}/{prefix}*"],
        )
    )
    if not listing:
        return
    grantee.grant_principal.add_to_principal_policy(
        iam.PolicyStatement(
            sid=f"{name}Listing",
            actions=["s3:ListBucket"],
            resources=[bucket_arn],
            # A prefix at the bucket's root lists with no prefix: no condition can apply.
            conditions={"StringLike": {"s3:prefix": [f"{prefix}*"]}} if prefix else None,
        )
    )


class InstanceRole(Construct):
    """The role of every EC2 instance in the cluster, with only what the launcher needs.

    Pull this cluster's image; read/write the checkpoint prefix; write to the cluster's log
    group (the trainer's metrics travel in it as embedded-metric-format events, so no
    ``cloudwatch:PutMetricData``); ``ec2:DescribeInstances`` (peer discovery); scale the cluster's
    own Auto Scaling groups (by name and by ``hetero:cluster`` tag) at job end; Session Manager.

    Attributes: ``role``.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        cluster_name: str,
        image: ClusterImage,
        checkpoints: CheckpointBucket,
        log_group: logs.ILogGroup,
        asg_names: Sequence[str],
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description=f"{cluster_name}: instances of the training cluster (least privilege)",
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="SessionManager",
                # Session Manager instead of SSH: what the SSM agent needs for sessions alone,
                # as AWS's minimal Session Manager policy lists it
                # (https://docs.aws.amazon.com/systems-manager/latest/userguide/getting-started-create-iam-instance-profile.html).
                # Not AmazonSSMManagedInstanceCore: it also allows ssm:GetParameter(s) on "*",
                # every parameter of the account. None of the five has resource types.
                actions=[
                    "ssm:UpdateInstanceInformation",
                    "ssmmessages:CreateControlChannel",
                    "ssmmessages:CreateDataChannel",
                    "ssmmessages:OpenControlChannel",
                    "ssmmessages:OpenDataChannel",
                ],
                resources=["*"],
            )
        )
        # Both images are in the one bootstrap repository: this grant covers them both.
        image.asset.repository.grant_pull(self.role)
        checkpoints.grant_checkpoint_access(self.role)
        log_group.grant_write(self.role)
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="PeerDiscovery",
                # None of the three supports resource-level permissions: Resource must be "*".
                # DescribeAutoScalingInstances tells the data plane which running instances
                # their group is terminating (lifecycle state Terminating:Wait);
                # DescribeAutoScalingGroups gives the data-tier controller its group's bounds
                # and desired capacity (training/dataplane/autoscale.py).
                actions=[
                    "ec2:DescribeInstances",
                    "autoscaling:DescribeAutoScalingInstances",
                    "autoscaling:DescribeAutoScalingGroups",
                ],
                resources=["*"],
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="SpotPrices",
                # A deploy's job is priced by its first host (training/costs/deploy_prices.py):
                # the Spot price in its AZ now. No resource-level permissions: Resource "*".
                actions=["ec2:DescribeSpotPriceHistory"],
                resources=["*"],
            )
        )
        asg_arns = [
            stack.format_arn(
                service="autoscaling",
                resource="autoScalingGroup",
                # The group's UUID is unknown before deploy; the name and the tag pin it down.
                resource_name=f"*:autoScalingGroupName/{name}",
                arn_format=ArnFormat.COLON_RESOURCE_NAME,
            )
            for name in asg_names
        ]
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="ScaleOwnGroupsToZero",
                # CompleteLifecycleAction: the termination hook, once the checkpoint is saved, and
                # for the instance's own termination after the job's end (groups at zero).
                # TerminateInstanceInAutoScalingGroup: an instance that holds an older spec than
                # the deployed job's has the group replace it (keeping the desired capacity).
                # SetInstanceHealth: a launcher that cannot start its job loop marks its own
                # instance Unhealthy, so the group replaces it
                # (https://docs.aws.amazon.com/autoscaling/ec2/APIReference/API_SetInstanceHealth.html).
                # PutScheduledUpdateGroupAction / DeleteScheduledAction: the budget's backstop,
                # every group to zero at the deadline, deleted at job end (costs/backstop.py).
                # All seven take the group as resource and aws:ResourceTag conditions
                # (https://docs.aws.amazon.com/service-authorization/latest/reference/list_amazonec2autoscaling.html).
                actions=[
                    "autoscaling:UpdateAutoScalingGroup",
                    "autoscaling:SetDesiredCapacity",
                    "autoscaling:CompleteLifecycleAction",
                    "autoscaling:TerminateInstanceInAutoScalingGroup",
                    "autoscaling:SetInstanceHealth",
                    "autoscaling:PutScheduledUpdateGroupAction",
                    "autoscaling:DeleteScheduledAction",
                ],
                resources=asg_arns,
                conditions={"StringEquals": {f"aws:ResourceTag/{TAG_CLUSTER}": cluster_name}},
            )
        )


class SageMakerExecutionRole(Construct):
    """The execution role for this cluster's SageMaker heterogeneous training jobs: pull the
    image, use the checkpoint prefix, read each job's spec channel and write its output under
    the bucket's ``sagemaker/`` prefix (``hetero sagemaker submit``), read the spec's S3 dataset
    (``dataset_uri``), write training-job logs and metrics, and create the network interfaces
    SageMaker puts into the cluster subnet.

    Attributes: ``role``.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        cluster_name: str,
        image: ClusterImage,
        checkpoints: CheckpointBucket,
        dataset_uri: str | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"),
            description=f"{cluster_name}: SageMaker training jobs of the cluster",
        )
        image.asset.repository.grant_pull(self.role)
        checkpoints.grant_checkpoint_access(self.role)
        # A job's files live under sagemaker/<job>/: SageMaker lists and downloads the spec
        # channel (sagemaker/<job>/spec/) and uploads the output (sagemaker/<job>/output/)
        # with this role: s3:ListBucket, s3:GetObject and s3:PutObject scoped to the channel's
        # S3Uri and the S3OutputPath
        # (https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-roles.html#sagemaker-roles-createtrainingjob-perms).
        bucket = checkpoints.bucket
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="SageMakerJobOutput",
                actions=["s3:PutObject"],
                resources=[bucket.arn_for_objects(f"{SAGEMAKER_JOB_PREFIX}/*")],
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="SageMakerJobSpec",
                actions=["s3:GetObject"],
                resources=[
                    bucket.arn_for_objects(f"{SAGEMAKER_JOB_PREFIX}/*/{SAGEMAKER_SPEC_CHANNEL}/*")
                ],
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="SageMakerJobListing",
                actions=["s3:ListBucket"],
                resources=[bucket.bucket_arn],
                conditions={
                    "StringLike": {
                        "s3:prefix": [
                            SAGEMAKER_JOB_PREFIX,
                            f"{SAGEMAKER_JOB_PREFIX}/*",
                        ]
                    }
                },
            )
        )
        if dataset_uri is not None:
            grant_dataset_read(self.role, dataset_uri)
        training_logs = stack.format_arn(
            service="logs",
            resource="log-group",
            resource_name="/aws/sagemaker/TrainingJobs:*",
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="TrainingJobLogs",
                actions=[
                    "logs:CreateLogGroup",
                    "logs:CreateLogStream",
                    "logs:PutLogEvents",
                    "logs:DescribeLogStreams",
                ],
                resources=[training_logs],
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="SageMakerJobMetrics",
                # SageMaker's own job metrics only: the trainer's metrics are EMF log events,
                # which CloudWatch Logs turns into metrics without a PutMetricData of ours.
                # No resource-level permissions: Resource must be "*"; the namespace scopes it.
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={
                    "StringEquals": {"cloudwatch:namespace": ["/aws/sagemaker/TrainingJobs"]}
                },
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                sid="VpcNetworkInterfaces",
                # What SageMaker needs to place a job in a VPC subnet, on "*" as SageMaker
                # documents it (link above the class's S3 statements). The Describe* actions have
                # no resource types; the four network-interface actions do, so "*" is the one
                # accepted exception (tests/infra/test_security_invariants.py,
                # SAGEMAKER_ENI_ACTIONS; docs/security.md says how it could be narrowed).
                actions=[
                    "ec2:CreateNetworkInterface",
                    "ec2:CreateNetworkInterfacePermission",
                    "ec2:DeleteNetworkInterface",
                    "ec2:DeleteNetworkInterfacePermission",
                    "ec2:DescribeNetworkInterfaces",
                    "ec2:DescribeVpcs",
                    "ec2:DescribeDhcpOptions",
                    "ec2:DescribeSubnets",
                    "ec2:DescribeSecurityGroups",
                ],
                resources=["*"],
            )
        )
