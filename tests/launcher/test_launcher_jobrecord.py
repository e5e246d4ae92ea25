"""The job record reads a missing S3 object as missing whether S3 says 404 or 403.

S3 answers GetObject on a missing key with 403 AccessDenied when the caller lacks
``s3:ListBucket`` (https://docs.aws.amazon.com/AmazonS3/latest/API/API_GetObject.html,
"Permissions"); the instance role's ListBucket grant is conditioned on ``s3:prefix``, so the
reader probes with ListObjectsV2 on the exact key. Every call is answered by botocore's Stubber,
which also asserts each request's exact parameters and that no other call is made.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber

from training.common.jobrecord import JobRecord
from training.common.outcome import Outcome
from training.common.s3 import read_object

from .conftest import stubbed

BUCKET = "hetero-checkpoints"
URI = f"s3://{BUCKET}/checkpoints/j-20260101T000000Z-abcd/"
OUTCOME_KEY = "checkpoints/j-20260101T000000Z-abcd/job/outcome.json"


@pytest.fixture
def s3() -> Iterator[tuple[Any, Stubber]]:
    yield from stubbed("s3")


def expect_get_denied(stub: Stubber, key: str = OUTCOME_KEY) -> None:
    """GetObject answered as S3 answers a caller without s3:ListBucket: 403 AccessDenied."""
    stub.add_client_error(
        "get_object",
        service_error_code="AccessDenied",
        service_message="Access Denied",
        http_status_code=403,
        expected_params={"Bucket": BUCKET, "Key": key},
    )


def expect_probe(stub: Stubber, keys: list[str], key: str = OUTCOME_KEY) -> None:
    """ListObjectsV2 on the exact key (the prefix-conditioned grant covers it)."""
    stub.add_response(
        "list_objects_v2",
        {
            "IsTruncated": False,
            "Name": BUCKET,
            "Prefix": key,
            "MaxKeys": 1,
            "KeyCount": len(keys),
            **({"Contents": [{"Key": k, "Size": 10} for k in keys]} if keys else {}),
        },
        expected_params={"Bucket": BUCKET, "Prefix": key, "MaxKeys": 1},
    )


def test_403_with_the_key_not_listed_reads_as_absent(s3: tuple[Any, Stubber]) -> None:
    client, stub = s3
    expect_get_denied(stub)
    expect_probe(stub, [])
    assert JobRecord(URI, s3_client=client).outcome() is None


def test_403_with_only_longer_keys_listed_reads_as_absent(s3: tuple[Any, Stubber]) -> None:
    """The prefix matches longer keys too; only the exact key counts as present."""
    client, stub = s3
    expect_get_denied(stub)
    expect_probe(stub, [OUTCOME_KEY + ".tmp"])
    assert JobRecord(URI, s3_client=client).outcome() is None


def test_403_with_the_key_listed_raises_the_original_error(s3: tuple[Any, Stubber]) -> None:
    """The object is there and reading it is denied: a real permission problem, never absent."""
    client, stub = s3
    expect_get_denied(stub)
    expect_probe(stub, [OUTCOME_KEY])
    with pytest.raises(ClientError) as raised:
        JobRecord(URI, s3_client=client).outcome()
    assert raised.value.operation_name == "GetObject"
    assert raised.value.response["Error"]["Code"] == "AccessDenied"
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


def test_403_whose_probe_is_denied_too_raises_the_original_error(
    s3: tuple[Any, Stubber],
) -> None:
    client, stub = s3
    expect_get_denied(stub)
    stub.add_client_error(
        "list_objects_v2",
        service_error_code="AccessDenied",
        service_message="Access Denied",
        http_status_code=403,
        expected_params={"Bucket": BUCKET, "Prefix": OUTCOME_KEY, "MaxKeys": 1},
    )
    with pytest.raises(ClientError) as raised:
        read_object(client, BUCKET, OUTCOME_KEY)
    assert raised.value.operation_name == "GetObject"
    assert isinstance(raised.value.__cause__, ClientError)
    assert raised.value.__cause__.operation_name == "ListObjectsV2"


def test_no_such_key_reads_as_absent_without_a_probe(s3: tuple[Any, Stubber]) -> None:
    client, stub = s3
    stub.add_client_error(
        "get_object",
        service_error_code="NoSuchKey",
        service_message="The specified key does not exist.",
        http_status_code=404,
        expected_params={"Bucket": BUCKET, "Key": OUTCOME_KEY},
    )
    # No ListObjectsV2 queued: the Stubber fails the test if one is made.
    assert JobRecord(URI, s3_client=client).outcome() is None


def test_other_errors_are_raised_without_a_probe(s3: tuple[Any, Stubber]) -> None:
    client, stub = s3
    stub.add_client_error(
        "get_object",
        service_error_code="InvalidArgument",
        service_message="bad request",
        http_status_code=400,
        expected_params={"Bucket": BUCKET, "Key": OUTCOME_KEY},
    )
    with pytest.raises(ClientError):
        read_object(client, BUCKET, OUTCOME_KEY)


def test_a_present_object_is_read(s3: tuple[Any, Stubber]) -> None:
    client, stub = s3
    body = b'{"outcome": "finished", "reason": "training finished", "by": "i-1", "time": 1}'
    stub.add_response(
        "get_object",
        {"Body": StreamingBody(io.BytesIO(body), len(body)), "ContentLength": len(body)},
        expected_params={"Bucket": BUCKET, "Key": OUTCOME_KEY},
    )
    outcome = JobRecord(URI, s3_client=client).outcome()
    assert outcome is not None and outcome["outcome"] == "finished"


def test_end_writes_the_outcome_after_a_403_read(s3: tuple[Any, Stubber]) -> None:
    """The first host to end the job reads no outcome (403, not listed) and writes its own."""
    client, stub = s3
    expect_get_denied(stub)
    expect_probe(stub, [])
    stub.add_response(
        "put_object",
        {},
        expected_params={"Bucket": BUCKET, "Key": OUTCOME_KEY, "Body": ANY},
    )
    value = JobRecord(URI, s3_client=client).end(
        Outcome.FINISHED, reason="training finished", by="i-1"
    )
    assert value["outcome"] == "finished"


# -- the data-tier controller's decisions --------------------------------------------------------


def _decision(time_s: float, step: int, to_count: int, *, acted: bool = True) -> dict[str, Any]:
    return {
        "time": time_s,
        "step": step,
        "from_count": to_count - 1,
        "to_count": to_count,
        "reason": f"wait share high at step {step}",
        "wait_share": 0.2,
        "busy_share": None if step == 0 else 0.9,
        "serving": to_count - 1,
        "acted": acted,
    }


# Written out of time order, with a time 10x smaller than the others (fewer digits: the name's
# zero padding must still sort it first) and two decisions in the same millisecond.
DECISIONS = [
    _decision(1_700_000_100.25, 200, 4),
    _decision(170_000_000.5, 0, 2),
    _decision(1_700_000_000.0, 100, 3, acted=False),
    _decision(1_700_000_300.0, 300, 5),
    _decision(1_700_000_300.0001, 301, 6),
    _decision(1_700_000_400.0, 400, 7),
]
IN_TIME_ORDER = sorted(DECISIONS, key=lambda d: (d["time"], d["step"]))


def _check_decisions(record: JobRecord, keys: Callable[[], list[str]]) -> None:
    assert record.decisions() == []
    for d in DECISIONS:
        record.add_decision(d)
    assert sorted(keys()) == sorted(
        [
            "job/autoscale/001700000100250-200.json",
            "job/autoscale/000170000000500-0.json",
            "job/autoscale/001700000000000-100.json",
            "job/autoscale/001700000300000-300.json",
            "job/autoscale/001700000300000-301.json",
            "job/autoscale/001700000400000-400.json",
        ]
    )
    assert record.decisions() == IN_TIME_ORDER[-5:]  # the newest five, oldest first
    assert record.decisions(limit=2) == IN_TIME_ORDER[-2:]
    assert record.decisions(limit=100) == IN_TIME_ORDER
    assert record.decisions(limit=0) == []
    # Decisions are neither hosts nor an outcome.
    assert record.hosts() == {} and record.outcome() is None


def test_decisions_in_a_folder(tmp_path: Path) -> None:
    record = JobRecord(str(tmp_path / "ckpt"))

    def keys() -> list[str]:
        return [
            p.relative_to(tmp_path / "ckpt").as_posix()
            for p in (tmp_path / "ckpt").rglob("*")
            if p.is_file()
        ]

    _check_decisions(record, keys)
    # A stray file in the folder is no decision.
    (tmp_path / "ckpt" / "job" / "autoscale" / "notes.txt").write_text("x")
    assert record.decisions(limit=100) == IN_TIME_ORDER


def test_decisions_in_s3(aws: Any) -> None:
    s3 = aws.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    record = JobRecord(URI, s3_client=s3)
    prefix = "checkpoints/j-20260101T000000Z-abcd/"

    _check_decisions(
        record, lambda: [k.removeprefix(prefix) for k in aws.list_keys(BUCKET, prefix)]
    )
