"""cdk-nag wiring: AWS Solutions checks at every synth, and each acknowledged finding with
the reason it is acceptable here (docs/infrastructure.md explains each rule)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks
from constructs import IConstruct

from infra.cluster import dataset_location
from infra.stacks import ClusterStack, NetworkStack
from training.common.names import SAGEMAKER_JOB_PREFIX, SAGEMAKER_SPEC_CHANNEL

logger = logging.getLogger(__name__)

REASON_STAR_REQUIRED = (
    "These actions support no resource-level permissions, so AWS requires Resource '*': "
    "ecr:GetAuthorizationToken (registry login), ec2:DescribeInstances and "
    "autoscaling:DescribeAutoScalingInstances (peer and data server discovery), "
    "ec2:DescribeSpotPriceHistory (a deploy's job priced by its first host), "
    "and, for SageMaker, cloudwatch:PutMetricData (scoped by a cloudwatch:namespace condition "
    "instead) and the EC2 Describe* actions it needs to join the cluster subnet. The exception: "
    "SageMaker's four network-interface actions, which AWS documents on '*' for training jobs "
    "in a VPC although they have resource types (docs/security.md)."
)
REASON_CHECKPOINT_PREFIX = (
    "Object access is limited to the checkpoint prefix of this cluster's own bucket; the "
    "trailing /* is what names the objects under that prefix (checkpoint files are created "
    "at run time with step-numbered keys)."
)
REASON_ASG_ARN = (
    "Auto Scaling group ARNs contain a UUID only known after creation; the ARN pins the "
    "group by its fixed name and the statement also requires the group's hetero:cluster tag "
    "to equal this cluster, so the role can scale only its own groups (to zero at job end)."
)
REASON_SAGEMAKER_LOGS = (
    "SageMaker training jobs write to log streams named after the job inside the fixed "
    "/aws/sagemaker/TrainingJobs log group; the stream names are only known at run time."
)
REASON_SAGEMAKER_JOB_FILES = (
    "Each SageMaker job keeps its files under sagemaker/<job name>/ in this cluster's own "
    "bucket: the role reads the job's spec channel (sagemaker/<job>/spec/) and writes its "
    "output; job names are chosen at submit time, so the job part of the key is a wildcard."
)
REASON_DATASET_PREFIX = (
    "Read-only access to the S3 prefix the spec names as its dataset (GetObject on the objects "
    "under it, ListBucket only with that prefix); the trailing * names the images under it."
)


@dataclass(frozen=True)
class NagAcknowledgment:
    """One accepted finding: where (construct path), which rule (with its finding) and why."""

    path: str
    rule: str
    reason: str


def add_nag_checks(app: cdk.App) -> AwsSolutionsChecks:
    """Register the AWS Solutions rule pack on ``app``: at synth, any unacknowledged finding
    (error or warning) fails synthesis with the report."""
    pack = AwsSolutionsChecks(app)
    cdk.Validations.of(app).add_plugins(pack)
    return pack


def _ack(scope: IConstruct, rule: str, reason: str) -> NagAcknowledgment:
    cdk.Validations.of(scope).acknowledge(cdk.Acknowledgment(id=rule, reason=reason))
    return NagAcknowledgment(path=scope.node.path, rule=rule, reason=reason)


def acknowledge_findings(
    *, network: NetworkStack, cluster: ClusterStack
) -> list[NagAcknowledgment]:
    """Acknowledge, on the narrowest construct, each finding this design accepts; return them.

    The network stack needs none. Wildcard findings are acknowledged one by one (cdk-nag 3
    matches the finding, e.g. ``AwsSolutions-IAM5[Resource::*]``), so a new wildcard fails synth.
    """
    del network  # No findings to accept: listed so a new one is a deliberate decision.
    acks: list[NagAcknowledgment] = []
    bucket = cluster.checkpoints.bucket
    bucket_resource = bucket.node.default_child
    assert isinstance(bucket_resource, cdk.CfnResource)
    bucket_arn = f"<{cluster.get_logical_id(bucket_resource)}.Arn>"
    prefix_finding = f"AwsSolutions-IAM5[Resource::{bucket_arn}/{cluster.checkpoints.prefix}/*]"

    acks.append(
        _ack(
            bucket,
            "AwsSolutions-S1",
            "Server access logs would need a second bucket per cluster; the bucket holds only "
            "this job's checkpoints, written by its own two roles, and is private, SSL-only and "
            "versioned. Enable CloudTrail S3 data events where an access audit is required.",
        )
    )

    instance_role = cluster.instance_role.role
    acks.append(_ack(instance_role, "AwsSolutions-IAM5[Resource::*]", REASON_STAR_REQUIRED))
    acks.append(_ack(instance_role, prefix_finding, REASON_CHECKPOINT_PREFIX))
    for fleet in cluster.fleets.values():
        arn = (
            "arn:<AWS::Partition>:autoscaling:<AWS::Region>:<AWS::AccountId>:autoScalingGroup:"
            f"*:autoScalingGroupName/{fleet.asg_name}"
        )
        acks.append(_ack(instance_role, f"AwsSolutions-IAM5[Resource::{arn}]", REASON_ASG_ARN))

        asg = fleet.auto_scaling_group
        acks.append(
            _ack(
                asg,
                "AwsSolutions-EC26",
                "False positive: the rule reads only an Auto Scaling group's top-level launch "
                "template, not one referenced through a mixed-instances policy. The group's "
                "launch template encrypts its only (root) EBS volume; tests/infra asserts it.",
            )
        )
        acks.append(
            _ack(
                asg,
                "AwsSolutions-AS3",
                "A training job's groups scale only at start, on Spot replacement and at job "
                "end; those events are in the group's activity history and in EventBridge "
                "(aws.autoscaling). An SNS topic per group with no subscriber adds nothing.",
            )
        )

    sagemaker_role = cluster.sagemaker_role.role
    acks.append(_ack(sagemaker_role, "AwsSolutions-IAM5[Resource::*]", REASON_STAR_REQUIRED))
    acks.append(_ack(sagemaker_role, prefix_finding, REASON_CHECKPOINT_PREFIX))
    acks.append(
        _ack(
            sagemaker_role,
            "AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:logs:<AWS::Region>:"
            "<AWS::AccountId>:log-group:/aws/sagemaker/TrainingJobs:*]",
            REASON_SAGEMAKER_LOGS,
        )
    )
    for resource in (
        f"{bucket_arn}/{SAGEMAKER_JOB_PREFIX}/*",
        f"{bucket_arn}/{SAGEMAKER_JOB_PREFIX}/*/{SAGEMAKER_SPEC_CHANNEL}/*",
    ):
        acks.append(
            _ack(
                sagemaker_role,
                f"AwsSolutions-IAM5[Resource::{resource}]",
                REASON_SAGEMAKER_JOB_FILES,
            )
        )
    if cluster.dataset_uri is not None:
        dataset_bucket, dataset_prefix = dataset_location(cluster.dataset_uri)
        objects = f"arn:<AWS::Partition>:s3:::{dataset_bucket}/{dataset_prefix}*"
        finding = f"AwsSolutions-IAM5[Resource::{objects}]"
        for role in (instance_role, sagemaker_role):
            acks.append(_ack(role, finding, REASON_DATASET_PREFIX))
    for ack in acks:
        logger.debug("cdk-nag: acknowledged %s on %s", ack.rule, ack.path)
    return acks
