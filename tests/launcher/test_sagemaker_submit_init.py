"""``hetero sagemaker submit`` with ``job.model.init = "timm:NAME.TAG"`` (botocore's Stubber, the
Hugging Face cache written by the test and offline): the files are staged at
``checkpoints/init/<sha256>/`` before the job is created, only when absent, and
``HETERO_INIT_URI`` in the job's environment names that folder; a dry run uploads nothing."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aws_calls
import pytest
from botocore.stub import ANY
from hub_cache import INIT, HubCache, offline_hub, write_hub_cache

from training.common import call_log
from training.workstation.sagemaker_submit import SubmitError

from .sagemaker_support import (  # noqa: F401 (aws: a fixture)
    BUCKET,
    JOB,
    REGION,
    SPOT_SPEC,
    Aws,
    assert_all_answered,
    aws,
    expect_describe_stacks,
    expected_request,
    submit_spec,
    write_spec,
)

FILES = ("config.json", "model.safetensors")
SPEC = SPOT_SPEC + f'\n[job.model]\nname = "vit-cpu-tiny"\ninit = "{INIT}"\n'


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubCache:
    cache = write_hub_cache(tmp_path / "hf")
    offline_hub(monkeypatch, cache.root)
    return cache


def staged_folder(snapshot: Path) -> str:
    digest = hashlib.sha256()
    for name in FILES:
        data = (snapshot / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return f"checkpoints/init/{digest.hexdigest()}/"


def request_with_init(uri: str) -> dict[str, Any]:
    request = expected_request(managed_spot=True)
    request["Environment"]["HETERO_INIT_URI"] = uri
    return request


def test_a_timm_init_is_staged_then_named_in_the_jobs_environment(
    aws: Aws,  # noqa: F811
    hub: HubCache,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    record_aws_calls: Callable[..., Path],
) -> None:
    record_aws_calls(aws_calls.Names(cluster="vit-sm", checkpoint_bucket=BUCKET))
    for client in (aws.cloudformation, aws.s3, aws.sagemaker):
        call_log.attach(client)
    spec = write_spec(tmp_path, SPEC)
    folder = staged_folder(hub.snapshot)
    expect_describe_stacks(aws)
    s3 = aws.stubs["s3"]
    # Weights first, config.json last: absent, so uploaded (small: one PutObject each).
    for name in ("model.safetensors", "config.json"):
        s3.add_client_error(
            "head_object", "404", "Not Found", 404, {"Bucket": BUCKET, "Key": folder + name}
        )
    for name in ("model.safetensors", "config.json"):
        s3.add_response(
            "put_object",
            {"ETag": '"1"'},
            {"Bucket": BUCKET, "Key": folder + name, "Body": ANY, "ChecksumAlgorithm": ANY},
        )
    s3.add_response(
        "put_object",
        {"ETag": '"2"'},
        {"Bucket": BUCKET, "Key": f"sagemaker/{JOB}/spec/vit.toml", "Body": SPEC.encode()},
    )
    aws.stubs["sagemaker"].add_response(
        "create_training_job",
        {"TrainingJobArn": f"arn:aws:sagemaker:{REGION}:123456789012:training-job/{JOB}"},
        request_with_init(f"s3://{BUCKET}/{folder}"),
    )
    assert submit_spec(aws, spec) == 0
    assert_all_answered(aws)
    assert aws.calls == [
        "DescribeStacks", "HeadObject", "HeadObject", "PutObject", "PutObject", "PutObject",
        "CreateTrainingJob",
    ]  # fmt: skip
    size = sum((hub.snapshot / n).stat().st_size for n in FILES)
    assert (
        f"  job.model.init: {INIT} -> s3://{BUCKET}/{folder} (uploaded now ({size / 1e3:.1f} kB))"
    ) in capsys.readouterr().out.splitlines()


def test_files_already_staged_are_not_uploaded_again(
    aws: Aws,  # noqa: F811
    hub: HubCache,
    tmp_path: Path,
) -> None:
    spec = write_spec(tmp_path, SPEC)
    folder = staged_folder(hub.snapshot)
    expect_describe_stacks(aws)
    for name in ("model.safetensors", "config.json"):
        aws.stubs["s3"].add_response(
            "head_object",
            {"ContentLength": (hub.snapshot / name).stat().st_size},
            {"Bucket": BUCKET, "Key": folder + name},
        )
    aws.stubs["s3"].add_response("put_object", {"ETag": '"2"'}, None)  # the spec
    aws.stubs["sagemaker"].add_response(
        "create_training_job",
        {"TrainingJobArn": "arn"},
        request_with_init(f"s3://{BUCKET}/{folder}"),
    )
    assert submit_spec(aws, spec) == 0
    assert_all_answered(aws)
    assert aws.calls == [
        "DescribeStacks", "HeadObject", "HeadObject", "PutObject", "CreateTrainingJob",
    ]  # fmt: skip


def test_a_dry_run_says_where_the_init_goes_and_uploads_nothing(
    aws: Aws,  # noqa: F811
    hub: HubCache,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = write_spec(tmp_path, SPEC)
    folder = staged_folder(hub.snapshot)
    expect_describe_stacks(aws)
    assert submit_spec(aws, spec, dry_run=True) == 0
    assert aws.calls == ["DescribeStacks"]
    out = capsys.readouterr()
    assert json.loads(out.out) == request_with_init(f"s3://{BUCKET}/{folder}")
    size = sum((hub.snapshot / n).stat().st_size for n in FILES)
    assert (
        f"would upload {spec} to s3://{BUCKET}/sagemaker/{JOB}/spec/vit.toml, {INIT} "
        f"({size / 1e3:.1f} kB) to s3://{BUCKET}/{folder} unless it is there, and create the job "
        "above; nothing was created"
    ) in out.err


def test_an_init_the_cache_lacks_is_refused_before_anything_is_created(
    aws: Aws,  # noqa: F811
    hub: HubCache,
    tmp_path: Path,
) -> None:
    spec = write_spec(tmp_path, SPEC.replace(INIT, "timm:vit_tiny_patch16_224.augreg_in21k"))
    expect_describe_stacks(aws)
    with pytest.raises(
        SubmitError,
        match=r"^job\.model\.init = 'timm:vit_tiny_patch16_224\."
        r"augreg_in21k': config\.json of .* is not in the Hugging Face cache",
    ):
        submit_spec(aws, spec)
    assert aws.calls == ["DescribeStacks"]
