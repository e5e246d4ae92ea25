"""What each instance group costs per hour at its most, priced where a job starts.

A group at its most is ``max_size`` instances (an elastic dataprep group's ``max_count``) of
the dearest of its listed types in its market: a Spot group's mixed-instances policy
(``price-capacity-optimized``) may launch any listed type. For each listed type, the first
source that answers wins:

1. the spec's ``[job.prices] usd_per_hour`` (the user said so): source ``spec``, undated;
2. AWS, that day (``price_groups``, for ``hetero job start``): Spot from EC2's
   ``DescribeSpotPriceHistory`` in the group's Availability Zone with start = end = now, which
   returns the price in effect at that time
   (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeSpotPriceHistory.html);
   On-Demand from the Price List API's ``GetProducts`` (Linux, shared tenancy, no pre-installed
   software, capacity status Used) at its us-east-1 endpoint, the region picked by the
   ``regionCode`` filter
   (https://docs.aws.amazon.com/goto/WebAPI/pricing-2017-10-15/GetProducts);
3. the dated offline catalogue (``instance_types.PRICES_AS_OF``: us-east-1 On-Demand list
   prices; Spot = ``spot_price_ratio`` x On-Demand): with a warning that names its date and why
   AWS's price was not used; alone (``offline_prices``) where nothing may ask AWS
   (``hetero spec check``, the budget of a job whose pointer records no prices).

Each group's price is a ``GroupPrice`` (``training.common.jobparam``): ``hetero job start``
records them in the job pointer, the launchers' budget (``training.costs.budget``) and
``hetero status`` read them there.

SageMaker bills its ``ml.*`` training instances at its own rates, not EC2's:
``sagemaker_training_price`` reads them from the same Price List API (service
``AmazonSageMaker``), for ``hetero sagemaker submit``'s ``job.max_usd``
(``training.workstation.sagemaker_budget``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from training.common.aws import client
from training.common.jobparam import PRICE_SOURCES, GroupPrice
from training.instance_types import PRICES_AS_OF, PRICES_REGION
from training.spec import ClusterSpec, InstanceGroup, Market, PricesSpec

log = logging.getLogger(__name__)

SOURCE_SPOT, SOURCE_PRICE_LIST, SOURCE_SPEC, SOURCE_CATALOGUE = PRICE_SOURCES
PRICING_REGION = "us-east-1"
"""Where the pricing client is created: its endpoint serves every region's prices (the
``regionCode`` filter picks one)."""
SPOT_PRODUCT = "Linux/UNIX"
EC2_SERVICE_CODE = "AmazonEC2"
SAGEMAKER_SERVICE_CODE = "AmazonSageMaker"
"""The Price List's service codes (``DescribeServices``) of EC2 and of SageMaker."""
MAX_ITEMS = 1000
"""Most prices read per request (paginated): a few types in one AZ need a handful."""

_Price = tuple[float, str, str | None]
"""One instance's USD per hour, its source and when it was true."""


@dataclass(frozen=True)
class Priced:
    """Every group's price at its most, and what could not be priced from AWS (and why)."""

    prices: tuple[GroupPrice, ...]
    warnings: tuple[str, ...] = ()

    @property
    def usd_per_hour(self) -> float:
        return sum(p.group_usd_per_hour for p in self.prices)


def pricing_client() -> Any:
    """The Price List API client (its endpoint in us-east-1 serves every region's prices)."""
    return client("pricing", region=PRICING_REGION)


def offline_prices(spec: ClusterSpec) -> Priced:
    """Every group at its most from the spec's prices, else the dated catalogue; no warning
    (the catalogue's date is in each ``GroupPrice``)."""
    return Priced(
        tuple(
            _dearest(g, {t: _offline(spec.job.prices, t, g.market) for t in g.instance_types})
            for g in spec.groups
        )
    )


NO_PRICE_LIST = (
    "the Price List API is not reachable from the cluster's subnets (no route out, and no "
    "Price List endpoint in the VPC)"
)
"""Why a price ``price_groups`` is asked for without a Price List client is the catalogue's."""


def price_groups(
    spec: ClusterSpec,
    *,
    ec2: Any,
    pricing: Any | None,
    zones: Mapping[str, Sequence[str]],
    region: str,
    now: datetime | None = None,
) -> Priced:
    """Every group at its most from AWS's prices at ``now``: Spot in the group's AZs
    (``zones``: group name -> the AZs its Auto Scaling group spans; none: any AZ of
    ``region``, the dearest), On-Demand from the Price List (``pricing`` None: not reachable,
    ``NO_PRICE_LIST``). A price AWS does not give (an error, no credentials, no answer) comes
    from the catalogue, with a warning."""
    now = (now or datetime.now(UTC)).astimezone(UTC)
    stamp = f"{now:%Y-%m-%dT%H:%M:%SZ}"
    warnings: list[str] = []
    live: dict[tuple[str, str, str | None], _Price] = {}  # (type, market, AZ) -> price
    spot_wanted: dict[str | None, list[str]] = {}
    on_demand_wanted: list[str] = []
    for g in spec.groups:
        for t in g.instance_types:
            if t in spec.job.prices.usd_per_hour:
                continue
            if g.market is Market.SPOT:
                for zone in _zones(g, zones):
                    spot_wanted.setdefault(zone, []).append(t)
            else:
                on_demand_wanted.append(t)
    for spot_zone, types in spot_wanted.items():
        where = f"in {spot_zone}" if spot_zone else f"in any AZ of {region}"
        try:
            found = spot_prices(ec2, dict.fromkeys(types), spot_zone, now)
        except Exception as e:  # botocore's service, credential and connection errors
            found = {}
            warnings.append(
                _fallback(spec, f"Spot prices of {', '.join(dict.fromkeys(types))} {where}", e)
            )
        else:
            missing = [t for t in dict.fromkeys(types) if t not in found]
            if missing:
                why = "DescribeSpotPriceHistory returned none"
                warnings.append(_fallback(spec, f"Spot price of {', '.join(missing)} {where}", why))
        for t, spot_usd in found.items():
            live[(t, Market.SPOT.value, spot_zone)] = (spot_usd, SOURCE_SPOT, stamp)
    for t in dict.fromkeys(on_demand_wanted):
        what = f"On-Demand price of {t} in {region}"
        if pricing is None:
            warnings.append(_fallback(spec, what, NO_PRICE_LIST))
            continue
        try:
            usd = on_demand_price(pricing, t, region)
        except Exception as e:  # botocore's errors, or a Price List answer it cannot read
            warnings.append(_fallback(spec, what, e))
            continue
        if usd is None:
            warnings.append(_fallback(spec, what, "the Price List API lists none"))
            continue
        live[(t, Market.ON_DEMAND.value, None)] = (usd, SOURCE_PRICE_LIST, stamp)
    prices = []
    for g in spec.groups:
        group_zones = _zones(g, zones) if g.market is Market.SPOT else [None]
        by_type = {
            # Where the group spans several AZs, the dearest AZ's price.
            t: max(
                (
                    live.get((t, g.market.value, zone)) or _offline(spec.job.prices, t, g.market)
                    for zone in group_zones
                ),
                key=lambda price: price[0],
            )
            for t in g.instance_types
        }
        prices.append(_dearest(g, by_type))
    for w in warnings:
        log.warning("%s", w)
    return Priced(tuple(prices), tuple(warnings))


def spot_prices(
    ec2: Any, types: Iterable[str], zone: str | None, now: datetime
) -> dict[str, float]:
    """The Linux Spot price of each of ``types`` in effect at ``now`` in ``zone`` (None: the
    dearest across the region's AZs); a type with no price is left out."""
    request: dict[str, Any] = {
        "InstanceTypes": list(types),
        "ProductDescriptions": [SPOT_PRODUCT],
        "StartTime": now,
        "EndTime": now,
    }
    if zone is not None:
        request["AvailabilityZone"] = zone
    newest: dict[tuple[str, str], tuple[datetime, float]] = {}
    pages = ec2.get_paginator("describe_spot_price_history").paginate(
        **request, PaginationConfig={"MaxItems": MAX_ITEMS}
    )
    for page in pages:
        for p in page.get("SpotPriceHistory", []):
            if zone is not None and p["AvailabilityZone"] != zone:
                continue  # AWS filters by the AZ asked; an emulator may not
            key = (p["InstanceType"], p["AvailabilityZone"])
            if key not in newest or p["Timestamp"] > newest[key][0]:
                newest[key] = (p["Timestamp"], float(p["SpotPrice"]))
    found: dict[str, float] = {}
    for (t, _), (_, usd) in newest.items():
        found[t] = max(usd, found.get(t, 0.0))
    return found


def on_demand_filters(instance_type: str, region: str) -> list[dict[str, str]]:
    """The GetProducts filters that select one Linux, shared-tenancy On-Demand price."""
    terms = {
        "instanceType": instance_type,
        "regionCode": region,
        "operatingSystem": "Linux",
        "tenancy": "Shared",
        "preInstalledSw": "NA",
        "capacitystatus": "Used",
        "licenseModel": "No License required",
    }
    return [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in terms.items()]


def hourly_usd(item: str) -> float | None:
    """The hourly USD price in one Price List product document (a JSON string), or None."""
    doc = json.loads(item)
    for term in doc.get("terms", {}).get("OnDemand", {}).values():
        for dim in term.get("priceDimensions", {}).values():
            if dim.get("unit") == "Hrs" and "USD" in dim.get("pricePerUnit", {}):
                usd = float(dim["pricePerUnit"]["USD"])
                if usd > 0:
                    return usd
    return None


def on_demand_price(pricing: Any, instance_type: str, region: str) -> float | None:
    """The On-Demand price of ``instance_type`` in ``region`` from the Price List API (the
    highest, should several products match), or None when it lists none."""
    return price_list_usd(pricing, EC2_SERVICE_CODE, on_demand_filters(instance_type, region))


def sagemaker_training_filters(ml_type: str, region: str) -> list[dict[str, str]]:
    """The GetProducts filters (service ``AmazonSageMaker``) that select SageMaker's
    On-Demand training price of one ``ml.*`` instance in ``region``: the attributes AWS's own
    SageMaker tooling filters on (``instanceName``, ``regionCode``, ``component``)."""
    terms = {"instanceName": ml_type, "regionCode": region, "component": "Training"}
    return [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in terms.items()]


def sagemaker_training_price(pricing: Any, ml_type: str, region: str) -> float | None:
    """What SageMaker bills per hour for one ``ml_type`` instance of a training job in
    ``region`` (On-Demand; the highest, should several products match), from the Price List
    API; None when it lists none. SageMaker prices its ``ml.*`` instances itself, not at EC2's
    rates (https://aws.amazon.com/sagemaker/pricing/)."""
    return price_list_usd(
        pricing, SAGEMAKER_SERVICE_CODE, sagemaker_training_filters(ml_type, region)
    )


def price_list_usd(pricing: Any, service_code: str, filters: list[dict[str, str]]) -> float | None:
    """The highest hourly USD price among the Price List products of ``service_code`` that
    match ``filters`` (paginated ``GetProducts``), or None when none has one."""
    pages = pricing.get_paginator("get_products").paginate(
        ServiceCode=service_code,
        Filters=filters,
        FormatVersion="aws_v1",
        PaginationConfig={"MaxItems": MAX_ITEMS},
    )
    prices = [
        usd
        for page in pages
        for item in page.get("PriceList", [])
        if (usd := hourly_usd(item)) is not None
    ]
    return max(prices) if prices else None


def sources_text(prices: Iterable[GroupPrice]) -> str:
    """Where the prices come from and when, e.g. ``spot-price-history 2026-11-22T10:00:00Z,
    catalogue 2026-07-20``."""
    seen = dict.fromkeys(p.source if p.as_of is None else f"{p.source} {p.as_of}" for p in prices)
    return ", ".join(seen)


def price_lines(prices: Sequence[GroupPrice]) -> list[str]:
    """The prices as an aligned table of text, one line per group, then the total."""
    rows = [("group", "at its most", "market", "USD/h each", "USD/h", "source, as of")]
    rows += [
        (
            p.group,
            f"{p.count} x {p.instance_type}",
            p.market,
            f"{p.usd_per_hour:.4f}",
            f"{p.group_usd_per_hour:.4f}",
            p.source if p.as_of is None else f"{p.source}, {p.as_of}",
        )
        for p in prices
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    total = sum(p.group_usd_per_hour for p in prices)
    return [*lines, f"total at its most: {total:.4f} USD/h"]


def _zones(group: InstanceGroup, zones: Mapping[str, Sequence[str]]) -> list[str | None]:
    """The AZs a Spot group is priced in: its Auto Scaling group's, else None (any AZ)."""
    return list(zones.get(group.name) or ()) or [None]


def _offline(prices: PricesSpec, instance_type: str, market: Market) -> _Price:
    if instance_type in prices.usd_per_hour:
        return float(prices.usd_per_hour[instance_type]), SOURCE_SPEC, None
    return prices.hourly(instance_type, market), SOURCE_CATALOGUE, PRICES_AS_OF


def _dearest(group: InstanceGroup, by_type: Mapping[str, _Price]) -> GroupPrice:
    """``group`` at its most: ``max_size`` of its dearest listed type (the first on a tie)."""
    dearest = max(group.instance_types, key=lambda t: by_type[t][0])
    usd, source, as_of = by_type[dearest]
    return GroupPrice(
        group=group.name,
        instance_type=dearest,
        market=group.market.value,
        count=group.max_size,
        usd_per_hour=usd,
        source=source,
        as_of=as_of,
    )


def _fallback(spec: ClusterSpec, what: str, why: object) -> str:
    """The warning for a price taken from the catalogue instead of AWS."""
    spot = what.startswith("Spot")
    how = f"{PRICES_REGION} On-Demand list price" + (
        f" x spot_price_ratio {spec.job.prices.spot_price_ratio:g}" if spot else ""
    )
    return f"{what}: {why}; priced from the offline catalogue of {PRICES_AS_OF} instead ({how})"
