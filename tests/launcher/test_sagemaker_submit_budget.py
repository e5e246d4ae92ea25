"""``hetero sagemaker submit`` keeps the spec's budget with SageMaker's own stop
(``training/workstation/sagemaker_budget.py``): ``StoppingCondition.MaxRuntimeInSeconds`` is the
smallest of ``--max-run``, ``job.max_hours`` and what ``job.max_usd`` buys at SageMaker's
On-Demand training rates, read from the Price List API; a price it cannot read refuses
``job.max_usd``; ``--resume`` continues an earlier job's checkpoints. Every AWS request is the
exact one expected (botocore's Stubber, parameters validated against the service models), in the
shapes the API references document."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import aws_calls
import pytest
from price_list import price_list_item

from training.common import call_log
from training.common.jobparam import GroupPrice
from training.workstation.sagemaker_budget import runtime_limit
from training.workstation.sagemaker_submit import SubmitError

from .sagemaker_support import (  # noqa: F401 (aws: a fixture)
    BUCKET,
    CHECKPOINT_URI,
    JOB,
    NOW,
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

STAMP = "2026-01-02T03:04:05Z"
G5 = "1.4080000000"  # ml.g5.xlarge, per hour: 2 of them
C6I = "0.9520000000"  # ml.c6i.4xlarge: 1
USD_PER_HOUR = 2 * 1.408 + 0.952  # 3.768
EARLIER = "vit-sm-20260101-000000"
EARLIER_URI = f"s3://{BUCKET}/checkpoints/sagemaker/{EARLIER}/"


def capped(**caps: float) -> str:
    """SPOT_SPEC (2 x g5.xlarge and 1 x c6i.4xlarge, all Spot) with ``caps`` under ``[job]``."""
    lines = "".join(f"{k} = {v}\n" for k, v in caps.items())
    return SPOT_SPEC.replace("[job]\nsteps = 100\n", f"[job]\nsteps = 100\n{lines}")


def sagemaker_product(ml_type: str, usd: str) -> str:
    """One ``PriceList`` item of service ``AmazonSageMaker`` for a training instance."""
    return price_list_item(
        service="AmazonSageMaker",
        family="ML Instance",
        attributes={
            "instanceName": ml_type,
            "component": "Training",
            "regionCode": REGION,
            "usagetype": f"USE1-Train:{ml_type}",
        },
        sku="SM" + ml_type.replace(".", "").upper(),
        usd=usd,
        description=f"${usd} per {ml_type} hour for Training",
        effective="2026-01-01",
    )


def products_request(ml_type: str) -> dict[str, Any]:
    """The GetProducts request for SageMaker's On-Demand training price of ``ml_type``."""
    terms = {"instanceName": ml_type, "regionCode": REGION, "component": "Training"}
    return {
        "ServiceCode": "AmazonSageMaker",
        "Filters": [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in terms.items()],
        "FormatVersion": "aws_v1",
    }


def _expect_prices(clients: Aws) -> None:
    for ml_type, usd in (("ml.g5.xlarge", G5), ("ml.c6i.4xlarge", C6I)):
        clients.stubs["pricing"].add_response(
            "get_products",
            {"FormatVersion": "aws_v1", "PriceList": [sagemaker_product(ml_type, usd)]},
            products_request(ml_type),
        )


def _expect_job(clients: Aws, text: str, request: dict[str, Any]) -> None:
    clients.stubs["s3"].add_response(
        "put_object",
        {"ETag": '"0123456789abcdef"'},
        {"Bucket": BUCKET, "Key": f"sagemaker/{JOB}/spec/vit.toml", "Body": text.encode()},
    )
    clients.stubs["sagemaker"].add_response(
        "create_training_job",
        {"TrainingJobArn": f"arn:aws:sagemaker:{REGION}:123456789012:training-job/{JOB}"},
        request,
    )


def stopping(max_run: int, max_wait: int) -> dict[str, Any]:
    request = expected_request(managed_spot=True)
    request["StoppingCondition"] = {
        "MaxRuntimeInSeconds": max_run,
        "MaxWaitTimeInSeconds": max_wait,
    }
    return request


PRICE_TABLE = [
    "  prices: SageMaker training, On-Demand, from the Price List API; managed Spot bills no more",
    "    group       at its most         market     USD/h each  USD/h   source, as of",
    f"    dnn_group   2 x ml.g5.xlarge    on-demand  1.4080      2.8160  price-list, {STAMP}",
    f"    data_group  1 x ml.c6i.4xlarge  on-demand  0.9520      0.9520  price-list, {STAMP}",
    "    total at its most: 3.7680 USD/h",
]
FRESH = f"  checkpoints: {CHECKPOINT_URI} (a fresh start: --resume JOB continues an earlier job)"


def _printed(capsys: pytest.CaptureFixture[str]) -> list[str]:
    """What the submission printed after the job's name, console URL and status command."""
    return capsys.readouterr().out.splitlines()[3:]


# ----------------------------------------------------------------------------- the limit


@pytest.mark.parametrize(
    ("max_run", "seconds", "line"),
    [
        # job.max_hours = 1.5 is shorter than --max-run (SageMaker's default, 1 day): it stops.
        (
            86400,
            5400,
            "set by job.max_hours = 1.5; --max-run allows 86400 s",
        ),
        # A --max-run shorter than the cap stays.
        (
            1800,
            1800,
            "set by --max-run; job.max_hours = 1.5 allows 5400 s",
        ),
    ],
)
def test_max_hours_or_a_shorter_max_run_sets_max_runtime(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    max_run: int,
    seconds: int,
    line: str,
) -> None:
    text = capped(max_hours=1.5)
    expect_describe_stacks(aws)
    _expect_job(aws, text, stopping(seconds, 2 * seconds))  # MaxWait: twice the runtime
    assert submit_spec(aws, write_spec(tmp_path, text), max_run_s=max_run) == 0
    assert_all_answered(aws)
    assert aws.calls == ["DescribeStacks", "PutObject", "CreateTrainingJob"]  # no price needed
    assert _printed(capsys) == [
        f"  stopping: MaxRuntimeInSeconds {seconds} ({seconds / 3600:.4f} h), {line}",
        FRESH,
    ]


def test_max_usd_buys_the_seconds_at_sagemakers_training_prices(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = capped(max_usd=10)
    expect_describe_stacks(aws)
    _expect_prices(aws)
    seconds = int(10 / USD_PER_HOUR * 3600)  # 9554: rounded down
    assert seconds == 9554
    _expect_job(aws, text, stopping(seconds, 2 * seconds))
    assert submit_spec(aws, write_spec(tmp_path, text)) == 0
    assert_all_answered(aws)
    assert aws.calls == [
        "DescribeStacks",
        "GetProducts",
        "GetProducts",
        "PutObject",
        "CreateTrainingJob",
    ]
    assert _printed(capsys) == [
        *PRICE_TABLE,
        "  stopping: MaxRuntimeInSeconds 9554 (2.6539 h), set by job.max_usd = 10 "
        "(10 USD at 3.7680 USD/h); --max-run allows 86400 s",
        "    at most 10.00 USD of instance time by then; the stop adds up to 120 s (SageMaker's "
        "SIGTERM window, for the checkpoint)",
        FRESH,
    ]


@pytest.mark.parametrize(
    ("max_usd", "max_hours", "seconds", "source"),
    [
        (10, 4, 9554, "job.max_usd = 10"),  # 10 USD last 2.65 h: before 4 h
        (40, 2, 7200, "job.max_hours = 2"),  # 40 USD last 10.6 h: after 2 h
    ],
)
def test_both_caps_the_first_reached_stops_the_job(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
    max_usd: float,
    max_hours: float,
    seconds: int,
    source: str,
) -> None:
    text = capped(max_usd=max_usd, max_hours=max_hours)
    expect_describe_stacks(aws)
    _expect_prices(aws)
    _expect_job(aws, text, stopping(seconds, 2 * seconds))
    assert submit_spec(aws, write_spec(tmp_path, text)) == 0
    assert_all_answered(aws)


def test_the_limit_names_every_cap_and_the_tie_goes_to_the_spec() -> None:
    prices = (GroupPrice("g", "ml.g5.xlarge", "on-demand", 1, 2.0, "price-list", STAMP),)
    limit = runtime_limit(max_run_s=3600, max_hours=1.0, max_usd=10.0, prices=prices)
    assert (limit.seconds, limit.source) == (3600, "job.max_hours = 1")
    assert limit.lines[-2] == (
        "stopping: MaxRuntimeInSeconds 3600 (1.0000 h), set by job.max_hours = 1; "
        "job.max_usd = 10 allows 18000 s, --max-run allows 3600 s"
    )


def test_max_wait_below_a_cap_derived_runtime_is_refused(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
) -> None:
    expect_describe_stacks(aws)
    with pytest.raises(SubmitError) as info:
        submit_spec(aws, write_spec(tmp_path, capped(max_hours=2)), max_wait_s=3600)
    assert str(info.value).endswith(
        "  - --max-wait 3600 is below MaxRuntimeInSeconds 7200 (set by job.max_hours = 2): with "
        "managed Spot, MaxWaitTimeInSeconds counts the training time plus the time spent "
        "waiting for Spot capacity, so it must be at least MaxRuntimeInSeconds; use --max-wait "
        ">= 7200"
    )
    assert aws.calls == ["DescribeStacks"]


def test_a_cap_that_buys_no_second_is_refused(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
) -> None:
    expect_describe_stacks(aws)
    _expect_prices(aws)
    with pytest.raises(SubmitError, match=re.escape("job.max_usd = 0.0001 allows less than")):
        submit_spec(aws, write_spec(tmp_path, capped(max_usd=0.0001)))
    assert "CreateTrainingJob" not in aws.calls


# ----------------------------------------------------------------------------- no price


def test_max_usd_without_a_price_list_answer_is_refused_with_the_fixes(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
) -> None:
    aws.stubs["pricing"].add_client_error(
        "get_products",
        service_error_code="AccessDeniedException",
        service_message="User is not authorized to perform: pricing:GetProducts",
        http_status_code=400,
        expected_params=products_request("ml.g5.xlarge"),
    )
    expect_describe_stacks(aws)
    with pytest.raises(SubmitError) as info:
        submit_spec(aws, write_spec(tmp_path, capped(max_usd=40)))
    assert str(info.value) == (
        "job.max_usd = 40 needs SageMaker's price of ml.g5.xlarge in us-east-1, which the Price "
        "List API did not give (An error occurred (AccessDeniedException) when "
        "calling the GetProducts operation: User is not authorized to perform: "
        "pricing:GetProducts); hetero keeps no SageMaker prices offline (its catalogue holds "
        "EC2's rates, which are not SageMaker's, so they would not bound the bill). Allow "
        "pricing:GetProducts to this identity (the user policy in docs/security.md has it) and "
        "submit again, or cap the job by time instead (job.max_hours, or --max-run without "
        "job.max_usd)"
    )
    assert_all_answered(aws)
    assert aws.calls == ["DescribeStacks", "GetProducts"]  # nothing created


def test_a_type_the_price_list_does_not_price_is_refused(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
) -> None:
    aws.stubs["pricing"].add_response(
        "get_products",
        {"FormatVersion": "aws_v1", "PriceList": []},
        products_request("ml.g5.xlarge"),
    )
    expect_describe_stacks(aws)
    with pytest.raises(SubmitError, match=re.escape("(the Price List API lists no SageMaker")):
        submit_spec(aws, write_spec(tmp_path, capped(max_usd=40)), dry_run=True)
    assert aws.calls == ["DescribeStacks", "GetProducts"]


def test_dry_run_prices_and_prints_the_limit(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    expect_describe_stacks(aws)
    _expect_prices(aws)
    assert submit_spec(aws, write_spec(tmp_path, capped(max_usd=10)), dry_run=True) == 0
    assert_all_answered(aws)
    assert aws.calls == ["DescribeStacks", "GetProducts", "GetProducts"]  # reads only
    out = capsys.readouterr()
    assert json.loads(out.out)["StoppingCondition"] == {
        "MaxRuntimeInSeconds": 9554,
        "MaxWaitTimeInSeconds": 19108,
    }
    assert [line.strip() for line in PRICE_TABLE] == [
        line.strip() for line in out.err.splitlines()[1:6]
    ]


# ----------------------------------------------------------------------------- --resume


def _expect_describe_job(clients: Aws, job: dict[str, Any]) -> None:
    response = {
        "TrainingJobName": EARLIER,
        "TrainingJobArn": f"arn:aws:sagemaker:{REGION}:123456789012:training-job/{EARLIER}",
        "ModelArtifacts": {"S3ModelArtifacts": f"s3://{BUCKET}/sagemaker/{EARLIER}/output/"},
        "AlgorithmSpecification": {"TrainingImage": "image", "TrainingInputMode": "File"},
        "ResourceConfig": {"VolumeSizeInGB": 100},
        "StoppingCondition": {"MaxRuntimeInSeconds": 5400},
        "CreationTime": datetime(2026, 1, 1, tzinfo=NOW.tzinfo),
        **job,
    }
    clients.stubs["sagemaker"].add_response(
        "describe_training_job", response, {"TrainingJobName": EARLIER}
    )


STOPPED_AT_ITS_LIMIT = {
    "TrainingJobStatus": "Stopped",
    "SecondaryStatus": "MaxRuntimeExceeded",
    "CheckpointConfig": {"S3Uri": EARLIER_URI, "LocalPath": "/opt/ml/checkpoints"},
}


def test_resume_continues_the_earlier_jobs_checkpoints(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    record_aws_calls: Callable[..., Path],
) -> None:
    # The calls it adds to the record (DescribeTrainingJob, GetProducts of AmazonSageMaker)
    # are the user's, and tests/infra proves the user policy allows them.
    record_aws_calls(aws_calls.Names(cluster="vit-sm", checkpoint_bucket=BUCKET))
    for client in (aws.cloudformation, aws.s3, aws.sagemaker, aws.pricing):
        call_log.attach(client)
    text = capped(max_usd=10)
    expect_describe_stacks(aws)
    _expect_describe_job(aws, STOPPED_AT_ITS_LIMIT)
    _expect_prices(aws)
    request = stopping(9554, 19108)
    request["CheckpointConfig"]["S3Uri"] = EARLIER_URI
    # The resumed job's curves go on in the earlier job's folder.
    request["TensorBoardOutputConfig"]["S3OutputPath"] = (
        f"s3://{BUCKET}/checkpoints/sagemaker/tensorboard/{EARLIER}/"
    )
    request["Environment"]["HETERO_CHECKPOINT_URI"] = EARLIER_URI
    _expect_job(aws, text, request)
    assert submit_spec(aws, write_spec(tmp_path, text), resume=EARLIER) == 0
    assert_all_answered(aws)
    assert aws.calls == [
        "DescribeStacks",
        "DescribeTrainingJob",
        "GetProducts",
        "GetProducts",
        "PutObject",
        "CreateTrainingJob",
    ]
    assert _printed(capsys)[-1] == (
        f"  checkpoints: {EARLIER_URI} (resumes job {EARLIER}, Stopped, MaxRuntimeExceeded, "
        "from its newest complete checkpoint)"
    )


@pytest.mark.parametrize(
    ("job", "message"),
    [
        (
            {
                **STOPPED_AT_ITS_LIMIT,
                "TrainingJobStatus": "InProgress",
                "SecondaryStatus": "Training",
            },
            f"--resume {EARLIER}: that job is InProgress, Training and may still write its "
            "checkpoints; wait until it ends, or stop it (aws sagemaker stop-training-job "
            f"--training-job-name {EARLIER}) and submit again once it is Stopped",
        ),
        (
            {
                **STOPPED_AT_ITS_LIMIT,
                "CheckpointConfig": {"S3Uri": f"s3://other/checkpoints/sagemaker/{EARLIER}/"},
            },
            f"--resume {EARLIER}: its checkpoints (s3://other/checkpoints/sagemaker/{EARLIER}/) "
            f"are not under this stack's s3://{BUCKET}/checkpoints/sagemaker/; resume a job this "
            "stack's `hetero sagemaker submit` created",
        ),
    ],
)
def test_resume_refuses_a_running_or_foreign_job(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
    job: dict[str, Any],
    message: str,
) -> None:
    expect_describe_stacks(aws)
    _expect_describe_job(aws, job)
    with pytest.raises(SubmitError) as info:
        submit_spec(aws, write_spec(tmp_path, SPOT_SPEC), resume=EARLIER)
    assert str(info.value) == message
    assert aws.calls == ["DescribeStacks", "DescribeTrainingJob"]


def test_resume_of_a_job_sagemaker_does_not_know(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
) -> None:
    expect_describe_stacks(aws)
    aws.stubs["sagemaker"].add_client_error(
        "describe_training_job",
        service_error_code="ValidationException",
        service_message="Requested resource not found.",
        http_status_code=400,
        expected_params={"TrainingJobName": EARLIER},
    )
    with pytest.raises(SubmitError) as info:
        submit_spec(aws, write_spec(tmp_path, SPOT_SPEC), resume=EARLIER)
    assert str(info.value) == (
        f"--resume {EARLIER}: SageMaker has no training job of that name in {REGION} "
        "(Requested resource not found.); name an earlier job of this spec "
        "(aws sagemaker list-training-jobs)"
    )


def test_no_cap_no_warning(
    aws: Aws,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The old warning ("will not stop this job") is gone: the caps do stop it now.
    expect_describe_stacks(aws)
    with caplog.at_level(logging.WARNING, logger="training.workstation.sagemaker_submit"):
        assert submit_spec(aws, write_spec(tmp_path, capped(max_hours=1)), dry_run=True) == 0
    assert caplog.records == []
