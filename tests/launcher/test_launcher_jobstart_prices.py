"""``hetero job start`` prices the new job (moto for SSM, S3 and Auto Scaling; botocore's Stubber
for EC2's Spot price history and the Price List API where exact answers matter): each group at
its most in the pointer, the report's table, the recorded calls, and ``--offline-prices``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aws_calls
import boto3
import pytest
from botocore.stub import Stubber
from test_prices import spot

from training.cli import main
from training.common.jobparam import GroupPrice, read_job_pointer
from training.spec import ClusterSpec
from training.workstation.jobstart import report

from .conftest import CLUSTER_TOML
from .test_launcher_jobstart import (  # noqa: F401 (aws: a fixture)
    CATALOGUE_PRICES,
    NAME,
    NOW,
    REGION,
    ZONE,
    aws,
    start,
)


def test_the_command_prices_an_on_demand_group_from_the_price_list_else_says_why_not(
    aws: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    record_aws_calls: Callable[..., Path],
) -> None:
    """The user's GetProducts call is recorded (for the IAM proof); moto has no Price List
    API, so the On-Demand price falls back to the catalogue, with a warning naming its date."""
    record_aws_calls(aws_calls.Names(cluster="vit-test", checkpoint_bucket="ckpt"))
    path = tmp_path / "on-demand.toml"
    path.write_text(CLUSTER_TOML.replace("count = 2\n", 'count = 2\nmarket = "on-demand"\n', 1))
    assert main(["job", "start", "--spec", str(path), "--fresh", "--region", REGION]) == 0
    pointer = read_job_pointer(aws["ssm"], NAME)
    assert pointer.prices is not None
    assert pointer.prices[0] == GroupPrice(
        "trainer", "g5.12xlarge", "on-demand", 2, 5.672, "catalogue", "2026-07-20"
    )
    warned = [r.getMessage() for r in caplog.records if r.name == "training.prices"]
    assert len(warned) == 1
    assert warned[0].startswith("On-Demand price of g5.12xlarge in us-east-1: ")
    assert warned[0].endswith(
        "; priced from the offline catalogue of 2026-07-20 instead (us-east-1 On-Demand list price)"
    )
    assert "  trainer   2 x g5.12xlarge  on-demand  5.6720      11.3440  catalogue, 2026-07-20" in (
        capsys.readouterr().out.splitlines()
    )


def test_offline_prices_ask_aws_nothing(
    aws: dict[str, Any],  # noqa: F811
    spec_path: Path,
    record_aws_calls: Callable[..., Path],
) -> None:
    folder = record_aws_calls(aws_calls.Names(cluster="vit-test", checkpoint_bucket="ckpt"))
    assert main(["job", "start", "--spec", str(spec_path), "--fresh", "--offline-prices"]) == 0
    assert read_job_pointer(aws["ssm"], NAME).prices == CATALOGUE_PRICES
    calls = {c["operation"] for c in aws_calls.read_log(folder)}
    assert not calls & {"DescribeSpotPriceHistory", "GetProducts"}


def test_job_start_records_the_days_prices_in_the_groups_az_at_their_most(
    aws: dict[str, Any],  # noqa: F811
    spec: ClusterSpec,
) -> None:
    """Spot from DescribeSpotPriceHistory in the AZ the Auto Scaling group spans (the newest
    price per type, the dearest listed type, an elastic group at max_count); the pointer, the
    budget and the report carry them."""
    dataprep = replace(
        spec.group("dataprep"), instance_types=("c6i.4xlarge", "c7i.4xlarge"), max_count=4,
        min_count=1,
    )  # fmt: skip
    elastic = replace(spec, groups=(spec.group("trainer"), dataprep))
    aws["asg"].update_auto_scaling_group(AutoScalingGroupName="vit-test-dataprep", MaxSize=4)
    ec2 = boto3.client("ec2", region_name=REGION)
    pricing = boto3.client("pricing", region_name=REGION)
    with Stubber(ec2) as ec2_stub, Stubber(pricing) as pricing_stub:
        ec2_stub.add_response(
            "describe_spot_price_history",
            {
                "SpotPriceHistory": [
                    spot("g5.12xlarge", "2.1000", 30, ZONE),
                    spot("c6i.4xlarge", "0.3000", 90, ZONE),
                    spot("c6i.4xlarge", "0.2500", 10, ZONE),  # the newer: in effect now
                    spot("c7i.4xlarge", "0.2700", 240, ZONE),
                ]
            },
            {
                "InstanceTypes": ["g5.12xlarge", "c6i.4xlarge", "c7i.4xlarge"],
                "ProductDescriptions": ["Linux/UNIX"],
                "StartTime": NOW,
                "EndTime": NOW,
                "AvailabilityZone": ZONE,
            },
        )
        started = start(aws, elastic, ec2=ec2, pricing=pricing)
        ec2_stub.assert_no_pending_responses()
        pricing_stub.assert_no_pending_responses()  # Spot groups only: no Price List call
    stamp = "2026-11-22T10:00:00Z"
    assert started.pointer.prices == (
        GroupPrice("trainer", "g5.12xlarge", "spot", 2, 2.1, "spot-price-history", stamp),
        GroupPrice("dataprep", "c7i.4xlarge", "spot", 4, 0.27, "spot-price-history", stamp),
    )
    assert started.priced.warnings == ()
    assert read_job_pointer(aws["ssm"], NAME) == started.pointer
    assert report(started, spec_path="s.toml").splitlines()[-5:] == [
        "  group     at its most      market  USD/h each  USD/h   source, as of",
        f"  trainer   2 x g5.12xlarge  spot    2.1000      4.2000  spot-price-history, {stamp}",
        f"  dataprep  4 x c7i.4xlarge  spot    0.2700      1.0800  spot-price-history, {stamp}",
        "  total at its most: 5.2800 USD/h",
        "follow it: hetero status --spec s.toml",
    ]
