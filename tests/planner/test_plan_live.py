"""Live prices and Spot placement scores, every AWS call answered by botocore's Stubber, which
also checks each request is exactly the one expected."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from training.planner.cli import make_plan, pricing_client
from training.planner.facts import Facts
from training.spec import ClusterSpec, parse_spec

REGION = "us-east-1"
NOW = datetime.datetime(2026, 11, 22, 6, 0, tzinfo=datetime.UTC)
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FACTS = replace(Facts(), dataprep_types=("c6i.4xlarge",))
COMPARE = ["2 x g5.xlarge spot", "1 x g5.12xlarge on-demand"]
# Fn::GetAZs order is name order; ids as AWS would map them for some account.
ZONES = [("us-east-1a", "use1-az6"), ("us-east-1b", "use1-az1"), ("us-east-1c", "use1-az4")]


@pytest.fixture
def spec() -> ClusterSpec:
    return parse_spec(
        {
            "name": "plan-live",
            "groups": [
                {"name": "trainer", "role": "trainer", "instance_types": ["g5.xlarge"], "count": 2},
                {
                    "name": "dataprep",
                    "role": "dataprep",
                    "instance_types": ["c6i.4xlarge"],
                    "count": 1,
                },
            ],
            "job": {"steps": 100},
        }
    )


@pytest.fixture
def clients() -> Iterator[tuple[Any, Any, Stubber, Stubber]]:
    session = boto3.Session(
        aws_access_key_id="AKIDTEST", aws_secret_access_key="secret", region_name=REGION
    )
    ec2: Any = session.client("ec2")
    pricing: Any = session.client("pricing", region_name="us-east-1")
    with Stubber(ec2) as ec2_stub, Stubber(pricing) as pricing_stub:
        yield ec2, pricing, ec2_stub, pricing_stub
        ec2_stub.assert_no_pending_responses()
        pricing_stub.assert_no_pending_responses()


def expect_zones(ec2: Stubber) -> None:
    ec2.add_response(
        "describe_availability_zones",
        {
            "AvailabilityZones": [
                {"ZoneName": n, "ZoneId": i, "State": "available"} for n, i in reversed(ZONES)
            ]
        },
        {
            "Filters": [
                {"Name": "zone-type", "Values": ["availability-zone"]},
                {"Name": "opt-in-status", "Values": ["opt-in-not-required", "opted-in"]},
            ]
        },
    )
    ec2.add_response(
        "describe_subnets",
        {"Subnets": [{"AvailabilityZone": n, "SubnetId": f"subnet-{i}"} for n, i in ZONES]},
        {"Filters": [{"Name": "default-for-az", "Values": ["true"]}]},
    )


SCORE_REQUEST = {
    "InstanceTypes": ["g5.xlarge"],
    "TargetCapacity": 2,
    "TargetCapacityUnitType": "units",
    "SingleAvailabilityZone": True,
    "RegionNames": [REGION],
}
SPOT_REQUEST = {
    "InstanceTypes": ["g5.xlarge", "c6i.4xlarge"],
    "ProductDescriptions": ["Linux/UNIX"],
    "StartTime": NOW,
    "EndTime": NOW,
}
PRODUCTS_REQUEST = {
    "ServiceCode": "AmazonEC2",
    "Filters": [
        {"Type": "TERM_MATCH", "Field": "instanceType", "Value": "g5.12xlarge"},
        {"Type": "TERM_MATCH", "Field": "regionCode", "Value": REGION},
        {"Type": "TERM_MATCH", "Field": "operatingSystem", "Value": "Linux"},
        {"Type": "TERM_MATCH", "Field": "tenancy", "Value": "Shared"},
        {"Type": "TERM_MATCH", "Field": "preInstalledSw", "Value": "NA"},
        {"Type": "TERM_MATCH", "Field": "capacitystatus", "Value": "Used"},
        {"Type": "TERM_MATCH", "Field": "licenseModel", "Value": "No License required"},
    ],
    "FormatVersion": "aws_v1",
}


def product(usd: str) -> str:
    """One Price List product document as GetProducts returns it (a JSON string)."""
    return json.dumps(
        {
            "product": {"attributes": {"instanceType": "g5.12xlarge", "regionCode": REGION}},
            "terms": {
                "OnDemand": {
                    "SKU.TERM": {
                        "priceDimensions": {
                            "SKU.TERM.RATE": {"unit": "Hrs", "pricePerUnit": {"USD": usd}}
                        }
                    }
                }
            },
        }
    )


def spot_price(t: str, zone: str, usd: str, minutes_ago: int) -> dict[str, Any]:
    return {
        "InstanceType": t,
        "AvailabilityZone": zone,
        "ProductDescription": "Linux/UNIX",
        "SpotPrice": usd,
        "Timestamp": NOW - datetime.timedelta(minutes=minutes_ago),
    }


def test_live_prices_and_scores_pick_the_zone_and_its_price(
    spec: ClusterSpec, clients: tuple[Any, Any, Stubber, Stubber]
) -> None:
    ec2, pricing, ec2_stub, pricing_stub = clients
    expect_zones(ec2_stub)
    ec2_stub.add_response(
        "get_spot_placement_scores",
        {
            "SpotPlacementScores": [
                {"Region": REGION, "AvailabilityZoneId": "use1-az6", "Score": 3},
                {"Region": REGION, "AvailabilityZoneId": "use1-az1", "Score": 9},
                {"Region": REGION, "AvailabilityZoneId": "use1-az4", "Score": 5},
                {"Region": REGION, "AvailabilityZoneId": "use1-az9", "Score": 10},  # not listed
            ]
        },
        SCORE_REQUEST,
    )
    ec2_stub.add_response(
        "describe_spot_price_history",
        {
            "SpotPriceHistory": [
                spot_price("g5.xlarge", "us-east-1b", "0.3100", 90),
                spot_price("g5.xlarge", "us-east-1b", "0.3300", 10),  # newest in 1b
                spot_price("g5.xlarge", "us-east-1a", "0.2500", 5),  # cheaper, lower score
                spot_price("c6i.4xlarge", "us-east-1b", "0.2000", 20),
            ]
        },
        SPOT_REQUEST,
    )
    pricing_stub.add_response(
        "get_products", {"PriceList": [product("5.5000000000")]}, PRODUCTS_REQUEST
    )

    plan = make_plan(
        spec,
        COMPARE,
        region=REGION,
        results_dir=RESULTS,
        ec2=ec2,
        pricing=pricing,
        now=NOW,
        facts=FACTS,
    )
    assert plan.live and plan.notes == []
    rows = {r.label: r for r in plan.rows}
    spot = rows["2 x g5.xlarge spot"]
    # The best score among the zones Fn::GetAZs lists (use1-az9 is not one of them).
    assert spot.placement is not None
    assert (spot.placement.score, spot.placement.zone, spot.placement.zone_index) == (
        9,
        "us-east-1b",
        1,
    )
    # The newest price in that AZ, not the cheaper one elsewhere.
    assert spot.trainer_price.usd_per_hour == 0.33
    assert (
        spot.trainer_price.source == "Spot price history us-east-1 2026-11-22T06:00Z in us-east-1b"
    )
    assert spot.dataprep.price.usd_per_hour == 0.20
    assert spot.usd_per_hour == pytest.approx(2 * 0.33 + 0.20)
    on_demand = rows["1 x g5.12xlarge on-demand"]
    assert on_demand.trainer_price.usd_per_hour == 5.5
    assert on_demand.trainer_price.source == "Price List API us-east-1 2026-11-22"
    assert on_demand.placement is None
    assert "Price List API us-east-1 2026-11-22" in plan.price_sources


def test_aws_errors_fall_back_to_offline_data_with_a_note(
    spec: ClusterSpec, clients: tuple[Any, Any, Stubber, Stubber]
) -> None:
    ec2, pricing, ec2_stub, pricing_stub = clients
    expect_zones(ec2_stub)
    ec2_stub.add_client_error(
        "get_spot_placement_scores",
        service_error_code="UnauthorizedOperation",
        service_message="not allowed",
        expected_params=SCORE_REQUEST,
    )
    ec2_stub.add_response("describe_spot_price_history", {"SpotPriceHistory": []}, SPOT_REQUEST)
    pricing_stub.add_client_error(
        "get_products",
        service_error_code="AccessDeniedException",
        service_message="denied",
        expected_params=PRODUCTS_REQUEST,
    )
    plan = make_plan(
        spec,
        COMPARE,
        region=REGION,
        results_dir=RESULTS,
        ec2=ec2,
        pricing=pricing,
        now=NOW,
        facts=FACTS,
    )
    rows = {r.label: r for r in plan.rows}
    spot = rows["2 x g5.xlarge spot"]
    # No score is invented: none, and the reason with the IAM action to allow.
    assert spot.placement is not None and spot.placement.score is None
    assert "UnauthorizedOperation on GetSpotPlacementScores" in spot.placement.note
    assert "(allow ec2:GetSpotPlacementScores to the identity running hetero plan)" in (
        spot.placement.note
    )
    assert spot.trainer_price.estimate and spot.trainer_price.source.startswith("estimate: 0.41 x")
    on_demand = rows["1 x g5.12xlarge on-demand"]
    assert on_demand.trainer_price.usd_per_hour == 5.672  # the catalogue's list price
    assert on_demand.trainer_price.source == "offline us-east-1 list price 2026-07-20"
    assert plan.notes == [
        "no Spot price history for g5.xlarge, c6i.4xlarge; estimates used",
        "On-Demand price of g5.12xlarge: AccessDeniedException on GetProducts: denied (allow "
        "pricing:GetProducts to the identity running hetero plan); offline price used",
    ]


def test_the_pricing_client_uses_the_us_east_1_price_list_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    assert pricing_client().meta.endpoint_url == "https://api.pricing.us-east-1.amazonaws.com"
