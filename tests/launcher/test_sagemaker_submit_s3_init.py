"""``hetero sagemaker submit`` with ``job.model.init = "s3://..."`` in the user's own bucket: S3 is
moto's (the user's bucket beside the checkpoint bucket), CloudFormation and SageMaker botocore's
Stubber. The init is read, copied once, server-side, to ``checkpoints/init/<sha256>/`` before
the job is created, and ``HETERO_INIT_URI`` names the copy in the checkpoint bucket; a second
submission copies nothing, a dry run only reads, and a source the user cannot read (moto checking
IAM) or that is missing stops the submission before anything is created."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aws_calls
import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from training.common import call_log, s3_init
from training.workstation.sagemaker_submit import SubmitError

from .s3_init_support import (
    CONFIG,
    FILE_INIT,
    FILE_OBJECTS,
    FOLDER_INIT,
    FOLDER_OBJECTS,
    PART,
    SOURCE,
    WEIGHTS,
    as_user_denied_source,
    objects,
    put_source,
    staged_folder,
)
from .sagemaker_support import (
    BUCKET,
    JOB,
    REGION,
    SPOT_SPEC,
    Aws,
    assert_all_answered,
    expect_describe_stacks,
    expected_request,
    stubbed_client,
    submit_spec,
    write_spec,
)

NAMES = aws_calls.Names(cluster="vit-sm", checkpoint_bucket=BUCKET, init_bucket=SOURCE)
AGAIN = "vit-sm-20260102-030406"
"""A second job's name, a second after the first's."""
COPY_FILE = [  # the weights in parts (above 5 MiB here), config.json in one CopyObject
    "HeadObject", "HeadObject", "CreateMultipartUpload", "UploadPartCopy", "UploadPartCopy",
    "CompleteMultipartUpload", "HeadObject", "HeadObject", "CopyObject",
]  # fmt: skip


def spec_with(tmp_path: Path, init: str) -> Path:
    return write_spec(
        tmp_path, SPOT_SPEC + f'\n[job.model]\nname = "vit-cpu-tiny"\ninit = "{init}"\n'
    )


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[Aws]:
    """S3 in moto with the checkpoint bucket and the user's, the other clients stubbed; the
    operations asked for recorded in order, across clients."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setattr(s3_init, "MULTIPART_COPY_BYTES", PART)
    with mock_aws():
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=BUCKET)
        put_source(s3)
        stubbed = {s: stubbed_client(s) for s in ("cloudformation", "sagemaker", "pricing")}
        calls: list[str] = []
        for client in (s3, *stubbed.values()):
            client.meta.events.register(
                "before-parameter-build.*.*", lambda model, **_: calls.append(model.name)
            )
        stubs = {s: Stubber(c) for s, c in stubbed.items()}
        for stub in stubs.values():
            stub.activate()
        yield Aws(**stubbed, s3=s3, stubs=stubs, calls=calls)
        for stub in stubs.values():
            stub.deactivate()


def reader() -> Any:
    """A client of moto's S3 whose calls, the test's own, are not recorded."""
    return boto3.client("s3", region_name=REGION)


def expect_job(aws: Aws, init_uri: str, job: str = JOB) -> None:
    request = expected_request(managed_spot=True)
    request["Environment"]["HETERO_INIT_URI"] = init_uri
    text = json.dumps(request).replace(JOB, job)
    aws.stubs["sagemaker"].add_response(
        "create_training_job", {"TrainingJobArn": f"arn:{job}"}, json.loads(text)
    )


def test_a_file_is_copied_once_and_named_in_the_jobs_environment(
    aws: Aws,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    record_aws_calls: Callable[..., Path],
) -> None:
    spec = spec_with(tmp_path, FILE_INIT)
    folder = staged_folder(aws.s3, FILE_INIT, list(FILE_OBJECTS))
    aws.calls.clear()
    record_aws_calls(NAMES)
    for client in (aws.cloudformation, aws.s3, aws.sagemaker):
        call_log.attach(client)
    uri = f"s3://{BUCKET}/{folder}model.safetensors"
    expect_describe_stacks(aws)
    expect_job(aws, uri)
    assert submit_spec(aws, spec) == 0
    assert_all_answered(aws)
    assert aws.calls == [
        "DescribeStacks", "HeadObject", "HeadObject", *COPY_FILE, "PutObject", "CreateTrainingJob",
    ]  # fmt: skip
    assert objects(reader(), BUCKET, "checkpoints/init/") == {
        f"{folder}model.safetensors": WEIGHTS,
        f"{folder}config.json": CONFIG,
    }
    size = (len(WEIGHTS) + len(CONFIG)) / 1e6
    assert (
        f"  job.model.init: {FILE_INIT} -> {uri} (copied now ({size:.1f} MB, 2 object(s)))"
    ) in capsys.readouterr().out.splitlines()

    # The next submission finds the copy (each object with its size) and copies nothing.
    aws.calls.clear()
    expect_describe_stacks(aws)
    expect_job(aws, uri, job=AGAIN)
    assert submit_spec(aws, spec, job_name=AGAIN) == 0
    assert aws.calls == [
        "DescribeStacks", "HeadObject", "HeadObject", "HeadObject", "HeadObject", "PutObject",
        "CreateTrainingJob",
    ]  # fmt: skip
    assert len(objects(reader(), BUCKET, "checkpoints/init/")) == 2


def test_a_folder_is_copied_object_by_object(
    aws: Aws,
    tmp_path: Path,
    record_aws_calls: Callable[..., Path],
) -> None:
    folder = staged_folder(aws.s3, FOLDER_INIT, list(FOLDER_OBJECTS))
    aws.calls.clear()
    record_aws_calls(NAMES)
    call_log.attach(aws.s3)
    expect_describe_stacks(aws)
    expect_job(aws, f"s3://{BUCKET}/{folder}")
    assert submit_spec(aws, spec_with(tmp_path, FOLDER_INIT)) == 0
    assert_all_answered(aws)
    assert aws.calls[:2] == ["DescribeStacks", "ListObjectsV2"]
    assert aws.calls.count("CopyObject") == 3 and aws.calls.count("UploadPartCopy") == 2
    assert objects(reader(), BUCKET, "checkpoints/init/") == {
        folder + key.removeprefix("vit-hub/"): body for key, body in FOLDER_OBJECTS.items()
    }


def test_a_dry_run_reads_the_source_says_where_it_goes_and_copies_nothing(
    aws: Aws,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = spec_with(tmp_path, FILE_INIT)
    folder = staged_folder(aws.s3, FILE_INIT, list(FILE_OBJECTS))
    uri = f"s3://{BUCKET}/{folder}model.safetensors"
    aws.calls.clear()
    expect_describe_stacks(aws)
    assert submit_spec(aws, spec, dry_run=True) == 0
    assert aws.calls == ["DescribeStacks", "HeadObject", "HeadObject"]
    out = capsys.readouterr()
    assert json.loads(out.out)["Environment"]["HETERO_INIT_URI"] == uri
    size = (len(WEIGHTS) + len(CONFIG)) / 1e6
    assert (
        f"would upload {spec} to s3://{BUCKET}/sagemaker/{JOB}/spec/vit.toml, copy {FILE_INIT} "
        f"({size:.1f} MB) to {uri} unless it is there, and create the job above; nothing was "
        "created"
    ) in out.err
    assert objects(reader(), BUCKET, "checkpoints/init/") == {}


def test_a_source_the_user_cannot_read_is_refused_before_anything_is_created(
    aws: Aws,
    tmp_path: Path,
) -> None:
    spec = spec_with(tmp_path, FILE_INIT)

    def submit_as(credentials: dict[str, str]) -> None:
        user_s3 = boto3.client("s3", region_name=REGION, **credentials)  # type: ignore[call-overload]
        user_s3.meta.events.register(
            "before-parameter-build.*.*", lambda model, **_: aws.calls.append(model.name)
        )
        expect_describe_stacks(aws)
        with pytest.raises(
            SubmitError,
            match=rf"^job\.model\.init: your credentials cannot read "
            rf"{FILE_INIT} \(.*AccessDenied.*\); the job is started with a copy",
        ):
            submit_spec(dataclasses.replace(aws, s3=user_s3), spec)

    as_user_denied_source(submit_as)
    assert aws.calls == ["DescribeStacks", "HeadObject"]
    assert objects(reader(), BUCKET, "") == {}


def test_a_missing_source_is_refused_before_anything_is_created(aws: Aws, tmp_path: Path) -> None:
    missing = f"s3://{SOURCE}/vit/other.safetensors"
    expect_describe_stacks(aws)
    with pytest.raises(SubmitError) as refused:
        submit_spec(aws, spec_with(tmp_path, missing))
    assert str(refused.value) == (
        f"job.model.init: no object at {missing}; check the bucket and key "
        f"(aws s3 ls s3://{SOURCE}/vit/) and fix job.model.init"
    )
    assert aws.calls == ["DescribeStacks", "HeadObject"]
    assert objects(reader(), BUCKET, "") == {}
