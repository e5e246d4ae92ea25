"""Each instance group priced at its most (``training/prices.py``): AWS's answers come from
botocore's Stubber, in the shapes the API references document (``DescribeSpotPriceHistory``'s
``SpotPriceHistory``; ``GetProducts``' ``PriceList`` of JSON documents with
``terms.OnDemand.*.priceDimensions.*.pricePerUnit.USD``), and every request is checked against
the one expected; the dated catalogue is the named fallback."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber
from price_list import price_list_item

from training.common.jobparam import (
    GroupPrice,
    JobPointer,
    deployed_job_pointer,
    prices_from_json,
)
from training.common.jobrecord import JobRecord
from training.costs.budget import Budget
from training.costs.deploy_prices import deploy_job_prices
from training.prices import (
    NO_PRICE_LIST,
    offline_prices,
    price_groups,
    price_lines,
    spot_prices,
)
from training.spec import ClusterSpec, parse_spec

REGION = "us-east-1"
ZONE = "us-east-1b"
NOW = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
STAMP = "2026-11-22T10:00:00Z"
CATALOGUE = "2026-07-20"
FALLBACK = (
    f"priced from the offline catalogue of {CATALOGUE} instead (us-east-1 On-Demand list price"
)


def make_spec(prices: dict[str, float] | None = None) -> ClusterSpec:
    """An On-Demand trainer group of two types and an elastic Spot dataprep group (1-4)."""
    job: dict[str, Any] = {"steps": 10}
    if prices:
        job["prices"] = {"usd_per_hour": prices}
    return parse_spec(
        {
            "name": "priced",
            "groups": [
                {
                    "name": "trainer",
                    "role": "trainer",
                    "instance_types": ["g6.xlarge", "g5.xlarge"],
                    "count": 2,
                    "market": "on-demand",
                },
                {
                    "name": "dataprep",
                    "role": "dataprep",
                    "instance_types": ["c6i.4xlarge", "c7i.4xlarge"],
                    "count": 2,
                    "min_count": 1,
                    "max_count": 4,
                },
            ],
            "job": job,
        }
    )


@pytest.fixture
def clients() -> Iterator[tuple[Any, Stubber, Any, Stubber]]:
    session = boto3.Session(
        aws_access_key_id="AKIDTEST", aws_secret_access_key="secret", region_name=REGION
    )
    ec2: Any = session.client("ec2")
    pricing: Any = session.client("pricing", region_name="us-east-1")
    with Stubber(ec2) as ec2_stub, Stubber(pricing) as pricing_stub:
        yield ec2, ec2_stub, pricing, pricing_stub
        ec2_stub.assert_no_pending_responses()
        pricing_stub.assert_no_pending_responses()


def spot(instance_type: str, usd: str, minutes_ago: int, zone: str = ZONE) -> dict[str, Any]:
    """One ``SpotPriceHistory`` entry (the API reference's SpotPrice shape)."""
    return {
        "AvailabilityZone": zone,
        "InstanceType": instance_type,
        "ProductDescription": "Linux/UNIX",
        "SpotPrice": usd,
        "Timestamp": NOW - timedelta(minutes=minutes_ago),
    }


def spot_request(types: list[str], zone: str | None = ZONE, **extra: Any) -> dict[str, Any]:
    request = {
        "InstanceTypes": types,
        "ProductDescriptions": ["Linux/UNIX"],
        "StartTime": NOW,
        "EndTime": NOW,
        **extra,
    }
    return request | ({"AvailabilityZone": zone} if zone else {})


# The attributes of an On-Demand Linux item on shared tenancy, as the Price List has them and as
# the request filters on them (with the license model, which the item leaves out here).
LINUX_SHARED_USED = {
    "regionCode": REGION,
    "operatingSystem": "Linux",
    "tenancy": "Shared",
    "preInstalledSw": "NA",
    "capacitystatus": "Used",
}


def product(instance_type: str, usd: str) -> str:
    """One ``PriceList`` item for an EC2 Linux instance type."""
    return price_list_item(
        service="AmazonEC2",
        family="Compute Instance",
        attributes={"instanceType": instance_type, **LINUX_SHARED_USED},
        sku="SKU" + instance_type.replace(".", "").upper(),
        usd=usd,
        description=f"${usd} per On Demand Linux {instance_type}",
        effective="2026-11-01",
    )


def products_request(instance_type: str) -> dict[str, Any]:
    terms = {
        "instanceType": instance_type,
        **LINUX_SHARED_USED,
        "licenseModel": "No License required",
    }
    return {
        "ServiceCode": "AmazonEC2",
        "Filters": [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in terms.items()],
        "FormatVersion": "aws_v1",
    }


def price(spec: ClusterSpec, ec2: Any, pricing: Any, zones: Any = None) -> Any:
    zones = {"trainer": (ZONE,), "dataprep": (ZONE,)} if zones is None else zones
    return price_groups(spec, ec2=ec2, pricing=pricing, zones=zones, region=REGION, now=NOW)


def test_each_group_at_its_most_from_the_days_prices(
    clients: tuple[Any, Stubber, Any, Stubber],
) -> None:
    """The elastic group at max_count, each group's dearest listed type, the newest Spot price
    in the group's AZ, the Price List's On-Demand price."""
    ec2, ec2_stub, pricing, pricing_stub = clients
    ec2_stub.add_response(
        "describe_spot_price_history",
        {
            "SpotPriceHistory": [
                # The newer price is the one in effect now, in whichever order they come.
                spot("c6i.4xlarge", "0.2500", minutes_ago=10),
                spot("c6i.4xlarge", "0.3000", minutes_ago=90),
                spot("c7i.4xlarge", "0.2700", minutes_ago=240),
                # Another AZ's price: AWS filters by the AZ asked; an emulator may not.
                spot("c7i.4xlarge", "0.9900", minutes_ago=1, zone="us-east-1a"),
            ]
        },
        spot_request(["c6i.4xlarge", "c7i.4xlarge"]),
    )
    pricing_stub.add_response(
        "get_products",
        {"FormatVersion": "aws_v1", "PriceList": [product("g6.xlarge", "0.8048000000")]},
        products_request("g6.xlarge"),
    )
    pricing_stub.add_response(
        "get_products",
        {"FormatVersion": "aws_v1", "PriceList": [product("g5.xlarge", "1.0060000000")]},
        products_request("g5.xlarge"),
    )
    priced = price(make_spec(), ec2, pricing)
    assert priced.prices == (
        GroupPrice("trainer", "g5.xlarge", "on-demand", 2, 1.006, "price-list", STAMP),
        GroupPrice("dataprep", "c7i.4xlarge", "spot", 4, 0.27, "spot-price-history", STAMP),
    )
    assert priced.warnings == ()
    assert priced.usd_per_hour == pytest.approx(2 * 1.006 + 4 * 0.27)


def test_spot_prices_are_read_across_pages(clients: tuple[Any, Stubber, Any, Stubber]) -> None:
    ec2, ec2_stub, _, _ = clients
    ec2_stub.add_response(
        "describe_spot_price_history",
        {"SpotPriceHistory": [spot("c6i.4xlarge", "0.2500", 10)], "NextToken": "page-2"},
        spot_request(["c6i.4xlarge", "c7i.4xlarge"]),
    )
    ec2_stub.add_response(
        "describe_spot_price_history",
        {"SpotPriceHistory": [spot("c7i.4xlarge", "0.2700", 20)], "NextToken": ""},
        spot_request(["c6i.4xlarge", "c7i.4xlarge"], NextToken="page-2"),
    )
    assert spot_prices(ec2, ["c6i.4xlarge", "c7i.4xlarge"], ZONE, NOW) == {
        "c6i.4xlarge": 0.25,
        "c7i.4xlarge": 0.27,
    }


def test_a_group_in_no_known_az_is_priced_at_its_dearest_az(
    clients: tuple[Any, Stubber, Any, Stubber],
) -> None:
    ec2, ec2_stub, _, _ = clients
    ec2_stub.add_response(
        "describe_spot_price_history",
        {
            "SpotPriceHistory": [
                spot("c6i.4xlarge", "0.2500", 10, zone="us-east-1a"),
                spot("c6i.4xlarge", "0.3100", 10, zone="us-east-1c"),
            ]
        },
        spot_request(["c6i.4xlarge"], zone=None),
    )
    assert spot_prices(ec2, ["c6i.4xlarge"], None, NOW) == {"c6i.4xlarge": 0.31}


def test_what_aws_does_not_price_comes_from_the_catalogue_with_a_warning_naming_its_date(
    clients: tuple[Any, Stubber, Any, Stubber],
) -> None:
    ec2, ec2_stub, pricing, pricing_stub = clients
    ec2_stub.add_response(
        "describe_spot_price_history",
        {"SpotPriceHistory": [spot("c6i.4xlarge", "0.2500", 10)]},  # none for c7i.4xlarge
        spot_request(["c6i.4xlarge", "c7i.4xlarge"]),
    )
    pricing_stub.add_client_error(
        "get_products",
        service_error_code="AccessDeniedException",
        service_message="User: arn:aws:iam::123456789012:user/u is not authorized to perform: "
        "pricing:GetProducts",
        http_status_code=400,
        expected_params=products_request("g6.xlarge"),
    )
    pricing_stub.add_response(
        "get_products", {"FormatVersion": "aws_v1", "PriceList": []}, products_request("g5.xlarge")
    )
    priced = price(make_spec(), ec2, pricing)
    assert priced.prices == (
        # The catalogue's g5.xlarge (1.006) is dearer than its g6.xlarge (0.8048).
        GroupPrice("trainer", "g5.xlarge", "on-demand", 2, 1.006, "catalogue", CATALOGUE),
        # The catalogue's c7i.4xlarge Spot estimate (0.714 x 0.35 = 0.2499) is below the live
        # c6i.4xlarge price.
        GroupPrice("dataprep", "c6i.4xlarge", "spot", 4, 0.25, "spot-price-history", STAMP),
    )
    assert priced.warnings == (
        "Spot price of c7i.4xlarge in us-east-1b: DescribeSpotPriceHistory returned none; "
        f"{FALLBACK} x spot_price_ratio 0.35)",
        "On-Demand price of g6.xlarge in us-east-1: An error occurred (AccessDeniedException) "
        "when calling the GetProducts operation: User: arn:aws:iam::123456789012:user/u is not "
        f"authorized to perform: pricing:GetProducts; {FALLBACK})",
        f"On-Demand price of g5.xlarge in us-east-1: the Price List API lists none; {FALLBACK})",
    )


def test_without_credentials_every_price_is_the_catalogues(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    session = boto3.Session(region_name=REGION)
    spec = make_spec()
    priced = price(spec, session.client("ec2"), session.client("pricing"))
    assert priced.prices == offline_prices(spec).prices
    assert priced.warnings == (
        "Spot prices of c6i.4xlarge, c7i.4xlarge in us-east-1b: Unable to locate credentials; "
        f"{FALLBACK} x spot_price_ratio 0.35)",
        f"On-Demand price of g6.xlarge in us-east-1: Unable to locate credentials; {FALLBACK})",
        f"On-Demand price of g5.xlarge in us-east-1: Unable to locate credentials; {FALLBACK})",
    )


def test_the_specs_own_prices_win_and_are_not_asked_for(
    clients: tuple[Any, Stubber, Any, Stubber],
) -> None:
    ec2, ec2_stub, pricing, pricing_stub = clients
    ec2_stub.add_response(
        "describe_spot_price_history",
        {"SpotPriceHistory": [spot("c6i.4xlarge", "0.2500", 10)]},
        spot_request(["c6i.4xlarge"]),
    )
    pricing_stub.add_response(
        "get_products",
        {"FormatVersion": "aws_v1", "PriceList": [product("g6.xlarge", "0.8048000000")]},
        products_request("g6.xlarge"),
    )
    priced = price(make_spec({"g5.xlarge": 0.9, "c7i.4xlarge": 0.5}), ec2, pricing)
    assert priced.prices == (
        GroupPrice("trainer", "g5.xlarge", "on-demand", 2, 0.9, "spec", None),
        GroupPrice("dataprep", "c7i.4xlarge", "spot", 4, 0.5, "spec", None),
    )
    assert priced.warnings == ()


def test_offline_prices_take_each_group_at_its_most_from_the_catalogue() -> None:
    priced = offline_prices(make_spec({"g6.xlarge": 2.0}))
    assert priced.prices == (
        GroupPrice("trainer", "g6.xlarge", "on-demand", 2, 2.0, "spec", None),
        # c7i.4xlarge's list price (0.714) is above c6i.4xlarge's (0.68); Spot at 0.35 of it.
        GroupPrice("dataprep", "c7i.4xlarge", "spot", 4, 0.714 * 0.35, "catalogue", CATALOGUE),
    )
    assert priced.usd_per_hour == pytest.approx(4.0 + 4 * 0.714 * 0.35)


def test_the_prices_as_a_table() -> None:
    prices = (
        GroupPrice("trainer", "g5.xlarge", "on-demand", 2, 1.006, "price-list", STAMP),
        GroupPrice("dataprep", "c7i.4xlarge", "spot", 4, 0.27, "spec", None),
    )
    assert price_lines(prices) == [
        "group     at its most      market     USD/h each  USD/h   source, as of",
        f"trainer   2 x g5.xlarge    on-demand  1.0060      2.0120  price-list, {STAMP}",
        "dataprep  4 x c7i.4xlarge  spot       0.2700      1.0800  spec",
        "total at its most: 3.0920 USD/h",
    ]


# -- a deploy's job, priced by its first host (training/costs/deploy_prices.py) -------------


def test_a_deploys_first_host_prices_spot_from_aws_and_records_it_for_every_other_host(
    clients: tuple[Any, Stubber, Any, Stubber], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Spot in the instance's AZ from DescribeSpotPriceHistory; On-Demand from the catalogue
    (no Price List from the cluster's subnets), with a warning; recorded once in the job
    record, which later hosts (and a restarted launcher) read without asking AWS again."""
    ec2, ec2_stub, _, _ = clients  # the Price List's stub gets no call
    ec2_stub.add_response(
        "describe_spot_price_history",
        {
            "SpotPriceHistory": [
                spot("c6i.4xlarge", "0.2500", 10),
                spot("c7i.4xlarge", "0.2700", 20),
            ]
        },
        spot_request(["c6i.4xlarge", "c7i.4xlarge"]) | {"StartTime": ANY, "EndTime": ANY},
    )
    spec, record = make_spec(), JobRecord(f"{tmp_path}/ckpt")
    deployed = deployed_job_pointer("name = 'priced'\n", "s3://ckpt/checkpoints/")
    with caplog.at_level(logging.WARNING, logger="training.prices"):
        first = deploy_job_prices(spec, deployed, record, ec2=ec2, zone=ZONE, region=REGION)
    assert first is not None
    trainer, dataprep = first
    assert (dataprep.instance_type, dataprep.count, dataprep.usd_per_hour, dataprep.source) == (
        "c7i.4xlarge", 4, 0.27, "spot-price-history",
    )  # fmt: skip
    assert (trainer.instance_type, trainer.count, trainer.source) == ("g5.xlarge", 2, "catalogue")
    assert trainer.usd_per_hour == pytest.approx(1.006)
    assert [r.getMessage() for r in caplog.records] == [
        f"On-Demand price of {t} in {REGION}: {NO_PRICE_LIST}; {FALLBACK})"
        for t in ("g6.xlarge", "g5.xlarge")
    ]
    assert prices_from_json(record.prices(), source="test") == first
    # Every other host: the record's prices, no call (the stub has no response left).
    again = deploy_job_prices(spec, deployed, record, ec2=ec2, zone=ZONE, region=REGION)
    assert again == first
    budget = Budget.of(spec, deployed, recorded=again)
    assert budget.usd_per_hour == pytest.approx(2 * 1.006 + 4 * 0.27)
    assert budget.priced == f"catalogue {CATALOGUE}, spot-price-history {first[1].as_of}"


def test_a_job_start_or_a_jobless_host_is_not_priced_here_and_a_failed_price_is_not_recorded(
    clients: tuple[Any, Stubber, Any, Stubber], tmp_path: Path
) -> None:
    ec2, ec2_stub, _, _ = clients
    spec, record = make_spec(), JobRecord(f"{tmp_path}/ckpt")
    priced = GroupPrice("dataprep", "c7i.4xlarge", "spot", 4, 0.3, "spot-price-history", STAMP)
    started = JobPointer("j-20261122T100000-ab12", "s3://ckpt/j/", STAMP, prices=(priced,))
    # `hetero job start` recorded the prices in the pointer; a host without a record (SageMaker,
    # a local run) has nowhere to keep them: no call either way.
    assert deploy_job_prices(spec, started, record, ec2=ec2, zone=ZONE, region=REGION) is None
    assert deploy_job_prices(spec, None, None, ec2=ec2, zone=ZONE, region=REGION) is None
    # EC2 did not answer: this host prices Spot from the catalogue and records nothing, so the
    # next host asks AWS again.
    ec2_stub.add_client_error("describe_spot_price_history", "RequestLimitExceeded")
    deployed = deployed_job_pointer("name = 'priced'\n", "s3://ckpt/checkpoints/")
    fallback = deploy_job_prices(spec, deployed, record, ec2=ec2, zone=ZONE, region=REGION)
    assert fallback is not None and {p.source for p in fallback} == {"catalogue"}
    assert record.prices() is None
