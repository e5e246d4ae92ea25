"""What the ``hetero sagemaker submit`` tests share: the stack's outputs, the specs, the request
they expect, and botocore's Stubber on every client (``aws``: parameters validated against the
service models, the operations asked for recorded in order)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.stub import Stubber

from training.workstation.sagemaker_submit import submit

REGION = "us-east-1"
STACK = "vit-sm-cluster"
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
JOB = "vit-sm-20260102-030405"
BUCKET = "vit-sm-cluster-checkpointsbucket-1a2b3c"
IMAGE = (
    "123456789012.dkr.ecr.us-east-1.amazonaws.com/"
    "cdk-hnb659fds-container-assets-123456789012-us-east-1:0123abcd"
)
ROLE = "arn:aws:iam::123456789012:role/vit-sm-cluster-SageMakerRole-ABC123"
SUBNET = "subnet-0123456789abcdef0"
SECURITY_GROUP = "sg-0123456789abcdef0"
OUTPUTS = {
    "ImageUri": IMAGE,
    "SageMakerRoleArn": ROLE,
    "SubnetId": SUBNET,
    "SecurityGroupId": SECURITY_GROUP,
    "CheckpointBucketName": BUCKET,
    "CheckpointUri": f"s3://{BUCKET}/checkpoints/",
    "LogGroupName": "/hetero/vit-sm",
}

SPOT_SPEC = """
name = "vit-sm"

[[groups]]
name = "dnn_group"
role = "trainer"
instance_types = ["g5.xlarge", "g6.xlarge"]
count = 2
market = "spot"

[[groups]]
name = "data_group"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 1
market = "spot"

[job]
steps = 100

[job.dataset]
source = "s3"
path = "s3://vit-datasets/imagenet/train/"
"""

MIXED_SPEC = SPOT_SPEC.replace(
    'count = 1\nmarket = "spot"', 'count = 1\nmarket = "on-demand"'
).replace("count = 2\n", "count = 3\n")

CHECKPOINT_URI = f"s3://{BUCKET}/checkpoints/sagemaker/{JOB}/"


def expected_request(*, managed_spot: bool, trainers: int = 2) -> dict[str, Any]:
    """The CreateTrainingJob request, written out field by field."""
    stopping: dict[str, int] = {"MaxRuntimeInSeconds": 86400}
    if managed_spot:
        stopping["MaxWaitTimeInSeconds"] = 172800
    return {
        "TrainingJobName": JOB,
        "RoleArn": ROLE,
        "AlgorithmSpecification": {"TrainingImage": IMAGE, "TrainingInputMode": "File"},
        "ResourceConfig": {
            "InstanceGroups": [
                {
                    "InstanceGroupName": "dnn_group",
                    "InstanceType": "ml.g5.xlarge",
                    "InstanceCount": trainers,
                },
                {
                    "InstanceGroupName": "data_group",
                    "InstanceType": "ml.c6i.4xlarge",
                    "InstanceCount": 1,
                },
            ],
            "VolumeSizeInGB": 100,
        },
        "InputDataConfig": [
            {
                "ChannelName": "spec",
                "DataSource": {
                    "S3DataSource": {
                        "S3DataType": "S3Prefix",
                        "S3Uri": f"s3://{BUCKET}/sagemaker/{JOB}/spec/",
                        "S3DataDistributionType": "FullyReplicated",
                        "InstanceGroupNames": ["dnn_group", "data_group"],
                    }
                },
                "InputMode": "File",
            }
        ],
        "OutputDataConfig": {"S3OutputPath": f"s3://{BUCKET}/sagemaker/{JOB}/output/"},
        "VpcConfig": {"Subnets": [SUBNET], "SecurityGroupIds": [SECURITY_GROUP]},
        "StoppingCondition": stopping,
        "EnableManagedSpotTraining": managed_spot,
        "CheckpointConfig": {"S3Uri": CHECKPOINT_URI, "LocalPath": "/opt/ml/checkpoints"},
        # The trainer's event files, beside every job's: SageMaker's TensorBoard reads them.
        "TensorBoardOutputConfig": {
            "LocalPath": "/opt/ml/output/data/tensorboard",
            "S3OutputPath": f"s3://{BUCKET}/checkpoints/sagemaker/tensorboard/{JOB}/",
        },
        "Environment": {
            "HETERO_SPEC": "/opt/ml/input/data/spec/vit.toml",
            "HETERO_CHECKPOINT_URI": CHECKPOINT_URI,
        },
    }


@dataclasses.dataclass
class Aws:
    """Stubbed clients and the operations they were asked for, in order, across clients."""

    cloudformation: Any
    s3: Any
    sagemaker: Any
    pricing: Any
    stubs: dict[str, Stubber]
    calls: list[str]


def stubbed_client(service: str) -> Any:
    return boto3.client(  # type: ignore[call-overload]
        service,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        # What `hetero sagemaker submit` passes too: the request is checked against the model.
        config=Config(parameter_validation=True),
    )


@pytest.fixture
def aws() -> Iterator[Aws]:
    calls: list[str] = []
    clients = {s: stubbed_client(s) for s in ("cloudformation", "s3", "sagemaker", "pricing")}
    for client in clients.values():
        client.meta.events.register(
            "before-parameter-build.*.*", lambda model, **_: calls.append(model.name)
        )
    stubs = {s: Stubber(c) for s, c in clients.items()}
    for stub in stubs.values():
        stub.activate()
    yield Aws(**clients, stubs=stubs, calls=calls)
    for stub in stubs.values():
        stub.deactivate()


def stack_response(outputs: dict[str, str]) -> dict[str, Any]:
    return {
        "Stacks": [
            {
                "StackName": STACK,
                "CreationTime": NOW,
                "StackStatus": "CREATE_COMPLETE",
                "Outputs": [{"OutputKey": k, "OutputValue": v} for k, v in outputs.items()],
            }
        ]
    }


def expect_describe_stacks(aws: Aws, outputs: dict[str, str] | None = None) -> None:
    aws.stubs["cloudformation"].add_response(
        "describe_stacks", stack_response(outputs or OUTPUTS), {"StackName": STACK}
    )


def write_spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "vit.toml"
    path.write_text(text)
    return path


def submit_spec(aws: Aws, spec: Path, **kwargs: Any) -> int:
    return submit(
        spec_path=spec,
        cloudformation=aws.cloudformation,
        s3=aws.s3,
        sagemaker=aws.sagemaker,
        pricing=aws.pricing,
        now=NOW,
        **kwargs,
    )


def assert_all_answered(aws: Aws) -> None:
    for stub in aws.stubs.values():
        stub.assert_no_pending_responses()
