"""``hetero sagemaker submit``: the exact AWS calls (botocore's Stubber, parameters validated
against the service models) for an all-Spot spec, a mixed one, a type SageMaker lacks, a
missing stack and a dry run. No AWS endpoint is reached: every call is answered by a stub.
The budget (``StoppingCondition`` from ``job.max_hours`` / ``job.max_usd``) and ``--resume``
are in test_sagemaker_submit_budget.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aws_calls
import boto3
import pytest
from botocore.exceptions import ParamValidationError

from training import cli
from training.common import call_log
from training.spec import load_spec
from training.workstation.sagemaker_submit import SageMakerRules, SubmitError, build_plan

from .sagemaker_support import (  # noqa: F401 (aws: a fixture)
    BUCKET,
    CHECKPOINT_URI,
    JOB,
    MIXED_SPEC,
    OUTPUTS,
    REGION,
    SPOT_SPEC,
    STACK,
    Aws,
    assert_all_answered,
    aws,
    expect_describe_stacks,
    expected_request,
    stack_response,
    stubbed_client,
    submit_spec,
    write_spec,
)

# ----------------------------------------------------------------------------- submissions


def test_all_spot_spec_uploads_the_spec_then_creates_a_managed_spot_job(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    record_aws_calls: Callable[..., Path],
) -> None:
    record_aws_calls(aws_calls.Names(cluster="vit-sm", checkpoint_bucket=BUCKET))
    for client in (aws.cloudformation, aws.s3, aws.sagemaker):
        call_log.attach(client)
    spec = write_spec(tmp_path, SPOT_SPEC)
    expect_describe_stacks(aws)
    aws.stubs["s3"].add_response(
        "put_object",
        {"ETag": '"0123456789abcdef"'},
        {"Bucket": BUCKET, "Key": f"sagemaker/{JOB}/spec/vit.toml", "Body": SPOT_SPEC.encode()},
    )
    aws.stubs["sagemaker"].add_response(
        "create_training_job",
        {"TrainingJobArn": f"arn:aws:sagemaker:{REGION}:123456789012:training-job/{JOB}"},
        expected_request(managed_spot=True),
    )
    with caplog.at_level(logging.WARNING, logger="training.workstation.sagemaker_submit"):
        assert submit_spec(aws, spec) == 0
    assert_all_answered(aws)
    # The spec is in S3 before the job that reads it exists.
    assert aws.calls == ["DescribeStacks", "PutObject", "CreateTrainingJob"]
    assert caplog.records == []
    assert capsys.readouterr().out.splitlines() == [
        f"created SageMaker training job {JOB}",
        f"  console: https://{REGION}.console.aws.amazon.com/sagemaker/home?region={REGION}"
        f"#/jobs/{JOB}",
        f"  status:  aws sagemaker describe-training-job --training-job-name {JOB} "
        f"--region {REGION}",
        # What stops the job, and where its checkpoints go.
        "  stopping: MaxRuntimeInSeconds 86400 (24.0000 h), set by --max-run",
        "    the spec sets no job.max_usd or job.max_hours",
        f"  checkpoints: {CHECKPOINT_URI} (a fresh start: --resume JOB continues an earlier job)",
    ]


def test_mixed_markets_run_on_demand_with_a_warning_that_says_why(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec = write_spec(tmp_path, MIXED_SPEC)
    expect_describe_stacks(aws)
    aws.stubs["s3"].add_response(
        "put_object",
        {"ETag": '"0123456789abcdef"'},
        {"Bucket": BUCKET, "Key": f"sagemaker/{JOB}/spec/vit.toml", "Body": MIXED_SPEC.encode()},
    )
    aws.stubs["sagemaker"].add_response(
        "create_training_job",
        {"TrainingJobArn": f"arn:aws:sagemaker:{REGION}:123456789012:training-job/{JOB}"},
        expected_request(managed_spot=False, trainers=3),
    )
    with caplog.at_level(logging.WARNING, logger="training.workstation.sagemaker_submit"):
        assert submit_spec(aws, spec) == 0
    assert_all_answered(aws)
    assert aws.calls == ["DescribeStacks", "PutObject", "CreateTrainingJob"]
    assert [r.getMessage() for r in caplog.records] == [
        "groups dnn_group ask for Spot but data_group On-Demand: SageMaker's managed Spot is "
        "one switch for the whole job (EnableManagedSpotTraining), not per instance group, so "
        "every group runs On-Demand; set market = 'spot' on every group to use managed Spot"
    ]


def test_a_type_sagemaker_lacks_is_refused_before_anything_is_created(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
) -> None:
    # Every type the project's catalogue knows is a SageMaker type today; a model whose type
    # list lacks ml.c6i.4xlarge stands for one that lacks a listed type.
    rules = SageMakerRules.from_service_model(aws.sagemaker.meta.service_model)
    assert "ml.c6i.4xlarge" in rules.instance_types
    without = dataclasses.replace(
        rules, instance_types=frozenset({"ml.g5.xlarge", "ml.c6i.8xlarge", "ml.m6i.4xlarge"})
    )
    spec = write_spec(tmp_path, SPOT_SPEC)
    expect_describe_stacks(aws)
    with pytest.raises(SubmitError) as info:
        submit_spec(aws, spec, rules=without)
    assert str(info.value) == (
        f"{spec}: cannot submit (1 problem(s)):\n"
        "  - groups[1] (data_group): SageMaker training has no instance type ml.c6i.4xlarge "
        "(botocore's TrainingInstanceType list); list first a type SageMaker has "
        "(e.g. m6i.4xlarge, c6i.8xlarge) in instance_types, or upgrade botocore if SageMaker "
        "added it recently"
    )
    assert_all_answered(aws)
    assert aws.calls == ["DescribeStacks"]  # no PutObject, no CreateTrainingJob


def test_a_later_listed_type_sagemaker_has_is_named_as_the_fix(aws: Aws, tmp_path: Path) -> None:  # noqa: F811
    rules = SageMakerRules.from_service_model(aws.sagemaker.meta.service_model)
    without = dataclasses.replace(rules, instance_types=rules.instance_types - {"ml.g5.xlarge"})
    spec = load_spec(write_spec(tmp_path, SPOT_SPEC))
    with pytest.raises(SubmitError, match=re.escape("move g6.xlarge (listed, and SageMaker has")):
        build_plan(spec, OUTPUTS, spec_file_name="vit.toml", job_name=JOB, rules=without)


def test_missing_stack_says_to_deploy_it(aws: Aws, tmp_path: Path) -> None:  # noqa: F811
    spec = write_spec(tmp_path, SPOT_SPEC)
    aws.stubs["cloudformation"].add_client_error(
        "describe_stacks",
        service_error_code="ValidationError",
        service_message=f"Stack with id {STACK} does not exist",
        http_status_code=400,
        expected_params={"StackName": STACK},
    )
    with pytest.raises(SubmitError) as info:
        submit_spec(aws, spec)
    assert str(info.value) == (
        f"stack '{STACK}' does not exist in {REGION}: deploy the cluster first "
        f"(`npx cdk deploy -c spec={spec} {STACK}`), or pass --stack-name / set AWS_REGION to "
        "where it is deployed"
    )
    assert_all_answered(aws)
    assert aws.calls == ["DescribeStacks"]


def test_stack_without_the_outputs_names_them(aws: Aws, tmp_path: Path) -> None:  # noqa: F811
    spec = write_spec(tmp_path, SPOT_SPEC)
    partial = {k: v for k, v in OUTPUTS.items() if k not in ("SubnetId", "SageMakerRoleArn")}
    expect_describe_stacks(aws, partial)
    with pytest.raises(SubmitError) as info:
        submit_spec(aws, spec)
    assert str(info.value) == (
        f"stack '{STACK}' (status CREATE_COMPLETE) has no output SageMakerRoleArn, SubnetId: "
        f"finish or redo `npx cdk deploy -c spec={spec} {STACK}` with this project's stacks"
    )
    assert aws.calls == ["DescribeStacks"]


def test_dry_run_prints_the_request_and_calls_only_describe_stacks(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = write_spec(tmp_path, SPOT_SPEC)
    expect_describe_stacks(aws)
    assert submit_spec(aws, spec, dry_run=True) == 0
    assert_all_answered(aws)
    assert aws.calls == ["DescribeStacks"]
    out = capsys.readouterr()
    assert json.loads(out.out) == expected_request(managed_spot=True)
    assert f"would upload {spec} to s3://{BUCKET}/sagemaker/{JOB}/spec/vit.toml" in out.err
    assert out.err.splitlines()[-3:] == [
        "stopping: MaxRuntimeInSeconds 86400 (24.0000 h), set by --max-run",
        "  the spec sets no job.max_usd or job.max_hours",
        f"checkpoints: {CHECKPOINT_URI} (a fresh start: --resume JOB continues an earlier job)",
    ]


def test_explicit_names_and_times(aws: Aws, tmp_path: Path) -> None:  # noqa: F811
    spec = write_spec(tmp_path, SPOT_SPEC)
    aws.stubs["cloudformation"].add_response(
        "describe_stacks", stack_response(OUTPUTS), {"StackName": "other-stack"}
    )
    request = expected_request(managed_spot=True)
    request["TrainingJobName"] = "vit-run-7"
    checkpoint = f"s3://{BUCKET}/checkpoints/sagemaker/vit-run-7/"
    request["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] = (
        f"s3://{BUCKET}/sagemaker/vit-run-7/spec/"
    )
    request["OutputDataConfig"] = {"S3OutputPath": f"s3://{BUCKET}/sagemaker/vit-run-7/output/"}
    request["CheckpointConfig"]["S3Uri"] = checkpoint
    request["TensorBoardOutputConfig"]["S3OutputPath"] = (
        f"s3://{BUCKET}/checkpoints/sagemaker/tensorboard/vit-run-7/"
    )
    request["Environment"]["HETERO_CHECKPOINT_URI"] = checkpoint
    request["StoppingCondition"] = {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 3600}
    request["ResourceConfig"]["VolumeSizeInGB"] = 200
    aws.stubs["s3"].add_response(
        "put_object",
        {"ETag": '"0123456789abcdef"'},
        {"Bucket": BUCKET, "Key": "sagemaker/vit-run-7/spec/vit.toml", "Body": SPOT_SPEC.encode()},
    )
    aws.stubs["sagemaker"].add_response(
        "create_training_job",
        {"TrainingJobArn": f"arn:aws:sagemaker:{REGION}:123456789012:training-job/vit-run-7"},
        request,
    )
    assert (
        submit_spec(
            aws,
            spec,
            stack_name="other-stack",
            job_name="vit-run-7",
            max_run_s=3600,
            max_wait_s=3600,  # equal is allowed: MaxWait >= MaxRuntime
            volume_size_gb=200,
        )
        == 0
    )
    assert_all_answered(aws)


# ----------------------------------------------------------------------------- refusals


def _plan_problems(tmp_path: Path, text: str, **kwargs: Any) -> str:
    rules = SageMakerRules.from_service_model(stubbed_client("sagemaker").meta.service_model)
    spec = load_spec(write_spec(tmp_path, text))
    args: dict[str, Any] = {"spec_file_name": "vit.toml", "job_name": JOB, "rules": rules}
    args.update(kwargs)
    with pytest.raises(SubmitError) as info:
        build_plan(spec, OUTPUTS, **args)
    return str(info.value)


def test_max_wait_below_max_run_is_refused_with_the_rule(tmp_path: Path) -> None:
    msg = _plan_problems(tmp_path, SPOT_SPEC, max_run_s=7200, max_wait_s=3600)
    assert msg.endswith(
        "  - --max-wait 3600 is below --max-run 7200: with managed Spot, MaxWaitTimeInSeconds "
        "counts the training time plus the time spent waiting for Spot capacity, so it must be "
        "at least MaxRuntimeInSeconds; use --max-wait >= 7200"
    )


def test_max_wait_without_managed_spot_is_refused(tmp_path: Path) -> None:
    msg = _plan_problems(tmp_path, MIXED_SPEC, max_wait_s=100_000)
    assert msg.endswith(
        "  - --max-wait applies to managed Spot only, and this job runs On-Demand (not every "
        "group is market = 'spot'); drop --max-wait or make every group Spot"
    )


@pytest.mark.parametrize("name", ["vit_run", "-vit", "vit-", "v" * 64, ""])
def test_job_names_sagemaker_refuses(tmp_path: Path, name: str) -> None:
    msg = _plan_problems(tmp_path, SPOT_SPEC, job_name=name)
    assert msg.endswith(
        f"  - --job-name {name!r}: SageMaker job names are 1-63 letters, digits and '-', "
        "starting and ending with a letter or digit"
    )


def test_max_run_beyond_28_days_is_refused(tmp_path: Path) -> None:
    msg = _plan_problems(tmp_path, SPOT_SPEC, max_run_s=28 * 86400 + 1)
    assert "--max-run 2419201: SageMaker allows 1 to 2419200 seconds (28 days)" in msg


# ----------------------------------------------------------------------------- the model


def _model_violations(shape: Any, value: Any, path: str = "") -> list[str]:
    """What botocore's own validator leaves out: enums, patterns and maximum sizes."""
    found: list[str] = []
    meta = shape.metadata
    if shape.type_name == "structure":
        for key, member in value.items():
            found += _model_violations(shape.members[key], member, f"{path}.{key}")
    elif shape.type_name == "list":
        if "max" in meta and len(value) > meta["max"]:
            found.append(f"{path}: {len(value)} items > {meta['max']}")
        for i, item in enumerate(value):
            found += _model_violations(shape.member, item, f"{path}[{i}]")
    elif shape.type_name == "map":
        for k, v in value.items():
            found += _model_violations(shape.key, k, f"{path}<key>")
            found += _model_violations(shape.value, v, f"{path}[{k}]")
    elif shape.type_name == "string":
        if shape.enum and value not in shape.enum:
            found.append(f"{path}: {value!r} not in the enum")
        if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
            found.append(f"{path}: {value!r} !~ {meta['pattern']}")
        if len(value) > meta.get("max", len(value)):
            found.append(f"{path}: longer than {meta['max']}")
    elif shape.type_name == "integer" and value > meta.get("max", value):
        found.append(f"{path}: {value} > {meta['max']}")
    return found


@pytest.mark.parametrize("text", [SPOT_SPEC, MIXED_SPEC])
def test_request_meets_every_rule_of_the_sagemaker_model(tmp_path: Path, text: str) -> None:
    from botocore.validate import validate_parameters

    client = stubbed_client("sagemaker")
    rules = SageMakerRules.from_service_model(client.meta.service_model)
    spec = load_spec(write_spec(tmp_path, text))
    request = build_plan(
        spec, OUTPUTS, spec_file_name="vit.toml", job_name=JOB, rules=rules
    ).request
    shape = client.meta.service_model.operation_model("CreateTrainingJob").input_shape
    validate_parameters(request, shape)  # botocore's validator: raises on a violation
    assert _model_violations(shape, request) == []


def test_stubbed_clients_validate_parameters(aws: Aws) -> None:  # noqa: F811
    # The Stubber answers only after botocore validated the request against the model, so a
    # malformed request fails here as it would against AWS.
    for client in (aws.cloudformation, aws.s3, aws.sagemaker):
        assert client.meta.config.parameter_validation is True
    aws.stubs["sagemaker"].add_response("create_training_job", {"TrainingJobArn": "x" * 20})
    bad = expected_request(managed_spot=True)
    bad["ResourceConfig"]["InstanceGroups"][0]["InstanceCount"] = "two"
    with pytest.raises(ParamValidationError, match="InstanceCount"):
        aws.sagemaker.create_training_job(**bad)


# ----------------------------------------------------------------------------- the command


def test_hetero_sagemaker_submit_runs_through_the_cli(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = write_spec(tmp_path, SPOT_SPEC)
    made: list[tuple[str, bool]] = []

    def stubbed_client(service: str, *, config: Any, region_name: str | None = None) -> Any:
        made.append((service, config.parameter_validation))
        clients = {"cloudformation": aws.cloudformation, "s3": aws.s3, "sagemaker": aws.sagemaker}
        return {**clients, "pricing": aws.pricing}[service]

    monkeypatch.setattr(boto3, "client", stubbed_client)
    aws.stubs["cloudformation"].add_client_error(
        "describe_stacks",
        service_error_code="ValidationError",
        service_message=f"Stack with id {STACK} does not exist",
        http_status_code=400,
        expected_params={"StackName": STACK},
    )
    code = cli.main(["sagemaker", "submit", "--spec", str(spec), "--dry-run"])
    assert code == 2
    assert made == [("cloudformation", True), ("s3", True), ("sagemaker", True), ("pricing", True)]
    assert f"`npx cdk deploy -c spec={spec} {STACK}`" in capsys.readouterr().err
    assert aws.calls == ["DescribeStacks"]


def test_cli_parses_the_nested_action() -> None:
    args = cli.build_parser("sagemaker").parse_args(
        ["sagemaker", "submit", "--spec", "x.toml", "--max-run", "60", "--max-wait", "120"]
    )
    assert (args._module, args.action, args.spec) == (
        "training.workstation.sagemaker_submit",
        "submit",
        "x.toml",
    )
    assert (args.max_run, args.max_wait, args.dry_run, args.job_name) == (60, 120, False, None)
    assert args.resume is None
