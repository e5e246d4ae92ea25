"""The SageMaker execution role's S3 access, statement by statement, and the dataset read grant
that the EC2 instance role shares (``grant_dataset_read``); group names with '_' (as SageMaker
heterogeneous clusters name them) go through the whole cluster stack."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk import aws_iam as iam
from aws_cdk.assertions import Template
from infra_support import DATASET_URI, SAGEMAKER_SPEC, BuiltApp, build, cdk_context

from infra.cluster import (
    CheckpointBucket,
    ClusterImage,
    SageMakerExecutionRole,
    dataset_read_uri,
    grant_dataset_read,
)
from training.common.names import CHECKPOINT_PREFIX, TAG_GROUP

PARTITION = {"Ref": "AWS::Partition"}


@pytest.fixture(scope="module")
def sm(tmp_path_factory: pytest.TempPathFactory) -> BuiltApp:
    return build(tmp_path_factory.mktemp("sm"), SAGEMAKER_SPEC)


def _role_statements(stack: cdk.Stack, template: Template, role: iam.Role) -> list[dict[str, Any]]:
    """Every statement of the policies attached to ``role``, in order."""
    role_lid = stack.get_logical_id(role.node.default_child)  # type: ignore[arg-type]
    statements: list[dict[str, Any]] = []
    for res in template.find_resources("AWS::IAM::Policy").values():
        if {"Ref": role_lid} in res["Properties"]["Roles"]:
            statements += res["Properties"]["PolicyDocument"]["Statement"]
    assert statements, f"no policy attached to {role.node.path}"
    return statements


def _s3_statements(statements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def actions(s: dict[str, Any]) -> list[str]:
        return s["Action"] if isinstance(s["Action"], list) else [s["Action"]]

    return [s for s in statements if any(a.startswith("s3:") for a in actions(s))]


def _bucket_arn(stack: cdk.Stack, checkpoints: CheckpointBucket) -> dict[str, Any]:
    lid = stack.get_logical_id(checkpoints.bucket.node.default_child)  # type: ignore[arg-type]
    return {"Fn::GetAtt": [lid, "Arn"]}


def _objects(bucket_arn: dict[str, Any], suffix: str) -> dict[str, Any]:
    return {"Fn::Join": ["", [bucket_arn, suffix]]}


def _checkpoint_statements(bucket_arn: dict[str, Any]) -> list[dict[str, Any]]:
    prefix = CHECKPOINT_PREFIX
    return [
        {
            "Sid": "CheckpointObjects",
            "Effect": "Allow",
            # Sorted: how the synthesized policy lists them (cdk.json's feature flags).
            "Action": [
                "s3:AbortMultipartUpload",
                "s3:DeleteObject",
                "s3:GetObject",
                "s3:PutObject",
            ],
            "Resource": _objects(bucket_arn, f"/{prefix}/*"),
        },
        {
            "Sid": "CheckpointListing",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": bucket_arn,
            "Condition": {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}},
        },
    ]


def _job_statements(bucket_arn: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "Sid": "SageMakerJobOutput",
            "Effect": "Allow",
            "Action": "s3:PutObject",
            "Resource": _objects(bucket_arn, "/sagemaker/*"),
        },
        {
            "Sid": "SageMakerJobSpec",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": _objects(bucket_arn, "/sagemaker/*/spec/*"),
        },
        {
            "Sid": "SageMakerJobListing",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": bucket_arn,
            "Condition": {"StringLike": {"s3:prefix": ["sagemaker", "sagemaker/*"]}},
        },
    ]


def _dataset_statements(bucket: str, prefix: str) -> list[dict[str, Any]]:
    listing: dict[str, Any] = {
        "Sid": "DatasetListing",
        "Effect": "Allow",
        "Action": "s3:ListBucket",
        "Resource": {"Fn::Join": ["", ["arn:", PARTITION, f":s3:::{bucket}"]]},
    }
    if prefix:
        listing["Condition"] = {"StringLike": {"s3:prefix": [f"{prefix}*"]}}
    return [
        {
            "Sid": "DatasetObjects",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": {"Fn::Join": ["", ["arn:", PARTITION, f":s3:::{bucket}/{prefix}*"]]},
        },
        listing,
    ]


# ------------------------------------------------------------------ the role in the cluster stack


def test_sagemaker_role_s3_access_is_checkpoints_and_job_files_only(sm: BuiltApp) -> None:
    stack = sm.stacks.cluster
    statements = _role_statements(stack, sm.cluster, stack.sagemaker_role.role)
    bucket_arn = _bucket_arn(stack, stack.checkpoints)
    # Exactly these S3 statements, nothing broader (no s3:*, no other bucket or prefix); the
    # dataset reads are asserted on their own below.
    s3 = [s for s in _s3_statements(statements) if not s["Sid"].startswith("Dataset")]
    assert s3 == [*_checkpoint_statements(bucket_arn), *_job_statements(bucket_arn)]


def test_both_roles_read_the_spec_dataset_in_the_cluster_stack(sm: BuiltApp) -> None:
    stack = sm.stacks.cluster
    expected = _dataset_statements("vit-datasets", "imagenet/train/")
    for role in (stack.sagemaker_role.role, stack.instance_role.role):
        statements = _role_statements(stack, sm.cluster, role)
        assert [s for s in statements if s.get("Sid", "").startswith("Dataset")] == expected


def test_group_names_with_underscores_go_through_the_cluster_stack(sm: BuiltApp) -> None:
    # Construct ids (Group-dnn_group), Auto Scaling group names, tags and the instance role's
    # ARNs all take the name as it is.
    assert set(sm.stacks.cluster.fleets) == {"dnn_group", "data_group"}
    asgs = sm.cluster.find_resources("AWS::AutoScaling::AutoScalingGroup")
    names = sorted(a["Properties"]["AutoScalingGroupName"] for a in asgs.values())
    assert names == ["vit-sm-data_group", "vit-sm-dnn_group"]
    group_tags = sorted(
        t["Value"] for a in asgs.values() for t in a["Properties"]["Tags"] if t["Key"] == TAG_GROUP
    )
    assert group_tags == ["data_group", "dnn_group"]
    stack = sm.stacks.cluster
    statements = _role_statements(stack, sm.cluster, stack.instance_role.role)
    (scale,) = [s for s in statements if s.get("Sid") == "ScaleOwnGroupsToZero"]
    suffixes = sorted(r["Fn::Join"][1][-1] for r in scale["Resource"])
    assert suffixes == [
        ":autoScalingGroup:*:autoScalingGroupName/vit-sm-data_group",
        ":autoScalingGroup:*:autoScalingGroupName/vit-sm-dnn_group",
    ]


# ------------------------------------------------------------- the role with a dataset, alone


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> tuple[cdk.Stack, Template, dict[str, Any]]:
    """The SageMaker role given the spec's dataset, plus a plain EC2 role given the same grant
    (standing in for the instance role), in one small stack."""
    context = tmp_path_factory.mktemp("context")
    # A stand-in build context: the role only needs the image's repository, not a real image.
    (context / "containers").mkdir()
    (context / "containers" / "Dockerfile").write_text("FROM scratch\n")
    app = cdk.App(outdir=str(tmp_path_factory.mktemp("out")), context=cdk_context())
    stack = cdk.Stack(app, "RoleOnly")
    image = ClusterImage(stack, "Image", build_context=Path(context))
    checkpoints = CheckpointBucket(stack, "Checkpoints")
    sagemaker = SageMakerExecutionRole(
        stack,
        "SageMakerRole",
        cluster_name="vit-sm",
        image=image,
        checkpoints=checkpoints,
        dataset_uri=DATASET_URI,
    )
    ec2_role = iam.Role(stack, "Ec2Role", assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"))
    grant_dataset_read(ec2_role, "s3://vit-datasets/imagenet/train")  # no trailing '/'
    root_role = iam.Role(stack, "RootRole", assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"))
    grant_dataset_read(root_role, "s3://whole-bucket")
    template = Template.from_stack(stack)
    roles = {"sagemaker": sagemaker, "ec2": ec2_role, "root": root_role, "checkpoints": checkpoints}
    return stack, template, roles


def test_sagemaker_role_reads_the_spec_dataset_prefix(
    alone: tuple[cdk.Stack, Template, dict[str, Any]],
) -> None:
    stack, template, roles = alone
    statements = _role_statements(stack, template, roles["sagemaker"].role)
    bucket_arn = _bucket_arn(stack, roles["checkpoints"])
    assert _s3_statements(statements) == [
        *_checkpoint_statements(bucket_arn),
        *_job_statements(bucket_arn),
        *_dataset_statements("vit-datasets", "imagenet/train/"),
    ]


def test_dataset_grant_for_the_instance_role_is_the_same_statements(
    alone: tuple[cdk.Stack, Template, dict[str, Any]],
) -> None:
    stack, template, roles = alone
    # The prefix is read as the dataset reader lists it: with a trailing '/'.
    assert _role_statements(stack, template, roles["ec2"]) == _dataset_statements(
        "vit-datasets", "imagenet/train/"
    )
    # A dataset at the bucket's root: every object, listing without a prefix condition.
    assert _role_statements(stack, template, roles["root"]) == _dataset_statements(
        "whole-bucket", ""
    )


@pytest.mark.parametrize("bad", ["vit-datasets/imagenet/", "https://vit-datasets/x/", "s3:///x/"])
def test_dataset_grant_refuses_what_is_not_an_s3_uri(bad: str) -> None:
    stack = cdk.Stack(cdk.App(), "Bad")
    role = iam.Role(stack, "R", assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"))
    with pytest.raises(ValueError, match="must look like s3://bucket/prefix/"):
        grant_dataset_read(role, bad)


@pytest.mark.parametrize(
    ("source", "path", "expected"),
    [
        ("s3", DATASET_URI, DATASET_URI),
        ("shards", "s3://vit-datasets/imagenet-shards/", "s3://vit-datasets/imagenet-shards/"),
        ("shards", "s3://vit-datasets/imagenet-shards", "s3://vit-datasets/imagenet-shards/"),
        (
            "shards",
            "s3://vit-datasets/imagenet-shards/manifest.json",
            "s3://vit-datasets/imagenet-shards/",
        ),
        ("shards", "/data/imagenet-shards", None),
        ("folder", "/data/imagenet", None),
    ],
)
def test_the_instances_read_a_prepared_dataset_in_s3_where_its_shards_are(
    source: str, path: str, expected: str | None
) -> None:
    """A prepared dataset (`source = "shards"`) in S3 is read from the folder of its manifest:
    the same folder the reader derives (training.data.manifest), so the grant covers every
    shard and nothing beside it."""
    from training.data.manifest import folder_of, manifest_uri
    from training.spec import DatasetSource, DatasetSpec

    dataset = DatasetSpec(source=DatasetSource(source), path=path)
    assert dataset_read_uri(dataset) == expected
    if expected is not None and source == "shards":
        assert expected == folder_of(manifest_uri(path))


def test_a_prepared_dataset_in_s3_is_granted_to_the_instance_role(tmp_path: Path) -> None:
    text = SAGEMAKER_SPEC.replace('source = "s3"', 'source = "shards"').replace(
        DATASET_URI, "s3://vit-datasets/imagenet-shards/manifest.json"
    )
    built = build(tmp_path, text)
    stack = built.stacks.cluster
    assert stack.dataset_uri == "s3://vit-datasets/imagenet-shards/"
    statements = _role_statements(stack, built.cluster, stack.instance_role.role)
    assert [s for s in statements if s.get("Sid", "").startswith("Dataset")] == (
        _dataset_statements("vit-datasets", "imagenet-shards/")
    )
