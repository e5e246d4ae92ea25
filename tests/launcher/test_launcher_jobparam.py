"""The job pointer: its JSON both ways, errors that say what to fix, and reading it from SSM
(moto; botocore's Stubber for an SSM that fails first)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from training.common.jobparam import (
    GroupPrice,
    JobParameterNotFound,
    JobPointer,
    JobPointerError,
    JobWatch,
    deployed_job_id,
    deployed_job_pointer,
    parse_job_pointer,
    read_job_pointer,
    read_job_pointer_patiently,
)

NAME = "/hetero/vit-test/job"
POINTER = JobPointer(
    job_id="j-20261122T100000-ab12",
    checkpoint_uri="s3://ckpt/checkpoints/d-0123456789ab/",
    started="2026-11-22T10:00:00Z",
    resumed_from="d-0123456789ab",
)


@pytest.fixture
def ssm() -> Iterator[Any]:
    with mock_aws():
        yield boto3.client("ssm", region_name="us-east-1")


def test_round_trip_keeps_every_field_in_the_documented_json() -> None:
    text = POINTER.to_json()
    assert text == (
        '{"job_id": "j-20261122T100000-ab12", '
        '"checkpoint_uri": "s3://ckpt/checkpoints/d-0123456789ab/", '
        '"started": "2026-11-22T10:00:00Z", "resumed_from": "d-0123456789ab"}'
    )
    assert parse_job_pointer(text) == POINTER
    deployed = JobPointer("d-0123456789ab", "s3://ckpt/checkpoints/d-0123456789ab/")
    assert parse_job_pointer(deployed.to_json()) == deployed


def test_a_jobs_own_caps_round_trip_and_are_left_out_when_unset() -> None:
    capped = JobPointer(POINTER.job_id, POINTER.checkpoint_uri, max_usd=12.5, max_hours=2.0)
    text = capped.to_json()
    assert json.loads(text) == {
        "job_id": POINTER.job_id, "checkpoint_uri": POINTER.checkpoint_uri, "started": None,
        "resumed_from": None, "max_usd": 12.5, "max_hours": 2.0,
    }  # fmt: skip
    assert parse_job_pointer(text) == capped
    assert "max_usd" not in POINTER.to_json()  # a deploy's pointer is as before the caps


def test_the_prices_a_job_start_records_round_trip_and_a_deploys_pointer_has_none() -> None:
    prices = (
        GroupPrice("trainer", "g5.xlarge", "spot", 2, 0.4321, "spot-price-history",
                   "2026-11-22T10:00:00Z"),
        GroupPrice("dataprep", "c7i.4xlarge", "on-demand", 4, 0.714, "catalogue", "2026-07-20"),
        GroupPrice("eval", "g6.xlarge", "spot", 1, 0.25, "spec", None),
    )  # fmt: skip
    priced = JobPointer(POINTER.job_id, POINTER.checkpoint_uri, prices=prices)
    text = priced.to_json()
    assert json.loads(text)["prices"] == [
        {"group": "trainer", "instance_type": "g5.xlarge", "market": "spot", "count": 2,
         "usd_per_hour": 0.4321, "source": "spot-price-history", "as_of": "2026-11-22T10:00:00Z"},
        {"group": "dataprep", "instance_type": "c7i.4xlarge", "market": "on-demand", "count": 4,
         "usd_per_hour": 0.714, "source": "catalogue", "as_of": "2026-07-20"},
        {"group": "eval", "instance_type": "g6.xlarge", "market": "spot", "count": 1,
         "usd_per_hour": 0.25, "source": "spec", "as_of": None},
    ]  # fmt: skip
    assert parse_job_pointer(text) == priced
    assert priced.usd_per_hour == pytest.approx(2 * 0.4321 + 4 * 0.714 + 0.25)
    # The stack's pointer (a CloudFormation value) is what it was before prices existed.
    deployed = deployed_job_pointer("name = 'x'\n", "s3://b/checkpoints/")
    assert "prices" not in json.loads(deployed.to_json())
    assert deployed.prices is None and deployed.usd_per_hour is None


PRICE = (
    '{"group": "trainer", "instance_type": "g5.xlarge", "market": "spot", "count": 2, '
    '"usd_per_hour": 0.5, "source": "spot-price-history", "as_of": "2026-11-22T10:00:00Z"}'
)


def one(old: str, new: str) -> str:
    """A ``prices`` list of one good group price with ``old`` in its JSON replaced by ``new``."""
    assert old in PRICE
    return f"[{PRICE.replace(old, new)}]"


@pytest.mark.parametrize(
    ("prices", "expected"),
    [
        ("[]", "prices must be a list of objects, one per instance group (got [])"),
        ('{"trainer": 1}', "prices must be a list of objects, one per instance group"),
        (one('"spot",', '"reserved",'),
         "prices[0].market must be one of spot, on-demand (got 'reserved')"),
        (one('"spot-price-history"', '"guess"'),
         "prices[0].source must be one of spot-price-history, price-list, spec, catalogue "
         "(got 'guess')"),
        (one('"count": 2', '"count": 0'),
         "prices[0].count must be a whole number above 0 (got 0)"),
        (one('"usd_per_hour": 0.5', '"usd_per_hour": "0.5"'),
         "prices[0].usd_per_hour must be a number of 0 or more (got '0.5')"),
        (one('"usd_per_hour": 0.5', '"usd_per_hour": -1'),
         "prices[0].usd_per_hour must be a number of 0 or more (got -1)"),
        (one('"group": "trainer"', '"group": ""'),
         "prices[0].group must be a non-empty string (got '')"),
        (one('"as_of": "2026-11-22T10:00:00Z"', '"as_of": 5'),
         "prices[0].as_of must be a string or null (got 5)"),
    ],
)  # fmt: skip
def test_each_wrong_price_is_named(prices: str, expected: str) -> None:
    text = f'{{"job_id": "j-1", "checkpoint_uri": "s3://b/c/", "prices": {prices}}}'
    with pytest.raises(JobPointerError) as e:
        parse_job_pointer(text, source=f"SSM parameter {NAME}")
    assert str(e.value).startswith(f"SSM parameter {NAME} is not a valid job pointer: ")
    assert expected in str(e.value)
    assert str(e.value).endswith("run `hetero job start --spec FILE` to write a valid one")


def test_unknown_keys_are_ignored() -> None:
    value = json.loads(POINTER.to_json()) | {"note": "from a newer writer"}
    assert parse_job_pointer(json.dumps(value)) == POINTER


def test_bad_json_says_so_and_how_to_fix_it() -> None:
    with pytest.raises(JobPointerError) as e:
        parse_job_pointer('{"job_id": "j-1",', source=f"SSM parameter {NAME}")
    message = str(e.value)
    assert message.startswith(f"SSM parameter {NAME} is not JSON (")
    assert message.endswith("run `hetero job start --spec FILE` to write a valid one")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('["j-1"]', "must be a JSON object with job_id and checkpoint_uri, got list"),
        (
            '{"checkpoint_uri": "s3://b/c/"}',
            "job_id must be a string of letters, digits, '.', '_' or '-' (got None)",
        ),
        (
            '{"job_id": "j 1", "checkpoint_uri": "s3://b/c/"}',
            "job_id must be a string of letters, digits, '.', '_' or '-' (got 'j 1')",
        ),
        (
            '{"job_id": "j-1", "checkpoint_uri": "s3://b/c"}',
            "checkpoint_uri must be a folder URI ending in '/', e.g. "
            "s3://bucket/checkpoints/<job id>/ (got 's3://b/c')",
        ),
        (
            '{"job_id": "j-1", "checkpoint_uri": "s3://b/c/", "started": 5}',
            "started must be a string or null (got 5)",
        ),
        (
            '{"job_id": "j-1", "checkpoint_uri": "s3://b/c/", "max_usd": 0}',
            "max_usd must be a number above 0 or null (got 0)",
        ),
        (
            '{"job_id": "j-1", "checkpoint_uri": "s3://b/c/", "max_hours": "2"}',
            "max_hours must be a number above 0 or null (got '2')",
        ),
        (
            '{"job_id": "j-1", "checkpoint_uri": "s3://b/c/", "max_usd": true}',
            "max_usd must be a number above 0 or null (got True)",
        ),
    ],
)
def test_each_wrong_field_is_named(text: str, expected: str) -> None:
    with pytest.raises(JobPointerError) as e:
        parse_job_pointer(text)
    assert expected in str(e.value)
    assert "hetero job start" in str(e.value)


def test_deployed_pointer_is_the_spec_hash_in_its_own_folder() -> None:
    job_id = deployed_job_id("name = 'x'\n")
    assert job_id == "d-" + hashlib.sha256(b"name = 'x'\n").hexdigest()[:12]
    assert deployed_job_pointer("name = 'x'\n", "s3://b/checkpoints/") == JobPointer(
        job_id, f"s3://b/checkpoints/{job_id}/", None, None
    )
    assert deployed_job_pointer("name = 'x'\n", "s3://b/checkpoints").checkpoint_uri == (
        f"s3://b/checkpoints/{job_id}/"
    )


def test_checkpoint_base_is_the_parent_folder() -> None:
    assert POINTER.checkpoint_base == "s3://ckpt/checkpoints/"
    assert JobPointer("j-1", "s3://ckpt/d-1/").checkpoint_base == "s3://ckpt/"
    with pytest.raises(JobPointerError, match="has no parent folder"):
        _ = JobPointer("j-1", "s3://ckpt/").checkpoint_base


def test_read_from_ssm_and_a_missing_parameter_says_deploy_first(ssm: Any) -> None:
    with pytest.raises(JobParameterNotFound) as e:
        read_job_pointer(ssm, NAME)
    assert str(e.value) == (
        f"SSM parameter {NAME} does not exist: deploy the cluster stack first "
        "(npx cdk deploy --all -c spec=FILE), which creates it"
    )
    ssm.put_parameter(Name=NAME, Value=POINTER.to_json(), Type="String")
    assert read_job_pointer(ssm, NAME) == POINTER
    ssm.put_parameter(Name=NAME, Value="not json", Type="String", Overwrite=True)
    with pytest.raises(JobPointerError, match=f"^SSM parameter {NAME} is not JSON"):
        read_job_pointer(ssm, NAME)


def test_job_watch_sees_a_new_job_and_stays_on_a_read_failure(ssm: Any) -> None:
    ssm.put_parameter(Name=NAME, Value=POINTER.to_json(), Type="String")
    watch = JobWatch(ssm, NAME, POINTER)
    assert watch.newer() is None
    newer = JobPointer("j-20261122T110000-cd34", POINTER.checkpoint_uri, None, POINTER.job_id)
    ssm.put_parameter(Name=NAME, Value=newer.to_json(), Type="String", Overwrite=True)
    assert watch.newer() == newer
    ssm.delete_parameter(Name=NAME)  # unreadable: the host stays on its job
    assert watch.newer() is None


def test_a_patient_read_retries_until_ssm_answers() -> None:
    ssm = boto3.client("ssm", region_name="us-east-1")
    with Stubber(ssm) as stub:
        for _ in range(2):
            stub.add_client_error(
                "get_parameter", "ThrottlingException", expected_params={"Name": NAME}
            )
        stub.add_response(
            "get_parameter",
            {"Parameter": {"Name": NAME, "Type": "String", "Value": POINTER.to_json()}},
            {"Name": NAME},
        )
        assert read_job_pointer_patiently(ssm, NAME, timeout_s=5, pause_s=0.01) == POINTER
        stub.assert_no_pending_responses()


def test_a_patient_read_gives_up_in_time_and_a_missing_parameter_at_once() -> None:
    ssm = boto3.client("ssm", region_name="us-east-1")
    with Stubber(ssm) as stub:
        for _ in range(3):
            stub.add_client_error(
                "get_parameter", "AccessDeniedException", expected_params={"Name": NAME}
            )
        with pytest.raises(JobPointerError) as e:
            read_job_pointer_patiently(ssm, NAME, timeout_s=0.05, pause_s=0.02)
        assert str(e.value).startswith(f"could not read SSM parameter {NAME} in 0.05s (")
        assert "ssm:GetParameter" in str(e.value)
    with Stubber(ssm) as stub:
        stub.add_client_error("get_parameter", "ParameterNotFound", expected_params={"Name": NAME})
        with pytest.raises(JobParameterNotFound):
            read_job_pointer_patiently(ssm, NAME, timeout_s=60, pause_s=30)
        stub.assert_no_pending_responses()
