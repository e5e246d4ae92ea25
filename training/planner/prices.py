"""Instance prices, with where each one comes from and when.

Order, first match wins:
1. the spec's ``[job.prices] usd_per_hour`` (the user said so);
2. live, where credentials exist: On-Demand from the Price List API (``GetProducts`` at the
   us-east-1 pricing endpoint, Linux, shared tenancy, no pre-installed software, capacity status
   Used), Spot from ``DescribeSpotPriceHistory`` in the plan's region with start = end = now,
   which returns the price in effect at that time in each AZ
   (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeSpotPriceHistory.html);
3. offline: the catalogue's On-Demand list prices (``instance_types.PRICES_AS_OF``, us-east-1)
   and, for Spot, ``priors.SPOT_PRICE_RATIO`` (per type) x On-Demand (an estimate), else the spec's
   ``spot_price_ratio``.

Every ``Price`` carries its source and date, and every output prints them.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from training import instance_types
from training.planner import priors
from training.planner.errors import aws_problem
from training.preflight import AWS_ERRORS
from training.preflight.core import _pages
from training.prices import SPOT_PRODUCT, hourly_usd, on_demand_filters
from training.spec import Market, PricesSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Price:
    usd_per_hour: float
    source: str
    """Where the figure comes from, with its date."""
    estimate: bool = False


@dataclass
class PriceBook:
    """Prices per instance type and market (and AZ, for live Spot prices)."""

    spec_prices: PricesSpec = field(default_factory=PricesSpec)
    catalog: Mapping[str, instance_types.InstanceType] = field(
        default_factory=lambda: instance_types.CATALOG
    )
    on_demand_live: dict[str, Price] = field(default_factory=dict)
    spot_live: dict[str, dict[str, Price]] = field(default_factory=dict)
    """instance type -> AZ name -> the price in effect there."""
    region: str = instance_types.PRICES_REGION

    def price(self, instance_type: str, market: Market, zone: str | None = None) -> Price:
        """USD per hour for one instance; ``zone`` picks the AZ's live Spot price."""
        explicit = self.spec_prices.usd_per_hour.get(instance_type)
        if explicit is not None:
            return Price(float(explicit), "spec [job.prices] usd_per_hour")
        if market is Market.ON_DEMAND and instance_type in self.on_demand_live:
            return self.on_demand_live[instance_type]
        if market is Market.SPOT and self.spot_live.get(instance_type):
            by_zone = self.spot_live[instance_type]
            if zone is not None and zone in by_zone:
                return by_zone[zone]
            cheapest = min(by_zone.values(), key=lambda p: p.usd_per_hour)
            return Price(cheapest.usd_per_hour, f"{cheapest.source}, cheapest AZ", False)
        return self.offline(instance_type, market)

    def offline(self, instance_type: str, market: Market) -> Price:
        on_demand = self.catalog[instance_type].on_demand_usd_per_hour
        where = f"{instance_types.PRICES_REGION} list price {instance_types.PRICES_AS_OF}"
        if self.region != instance_types.PRICES_REGION:
            where += f" (not {self.region}'s)"
        if market is Market.ON_DEMAND:
            return Price(on_demand, f"offline {where}")
        if instance_type in priors.SPOT_PRICE_RATIO:
            ratio = priors.SPOT_PRICE_RATIO[instance_type]
            source = f"estimate: {ratio:g} x {where} (Spot ratio {priors.SPOT_PRICES_AS_OF})"
        else:
            ratio = self.spec_prices.spot_price_ratio
            source = f"estimate: spec spot_price_ratio {ratio:g} x {where}"
        return Price(on_demand * ratio, source, True)

    def sources(self) -> list[str]:
        """One line per kind of source in use, for the outputs' header."""
        lines = []
        if self.spec_prices.usd_per_hour:
            lines.append(
                "spec [job.prices] usd_per_hour for "
                + ", ".join(sorted(self.spec_prices.usd_per_hour))
            )
        if self.on_demand_live:
            lines.append(next(iter(self.on_demand_live.values())).source)
        if self.spot_live:
            first = next(iter(next(iter(self.spot_live.values())).values()))
            lines.append(first.source.rsplit(" in ", 1)[0])
        lines.append(
            f"offline: On-Demand {instance_types.PRICES_REGION} list prices as of "
            f"{instance_types.PRICES_AS_OF}; Spot estimated as a share of On-Demand as of "
            f"{priors.SPOT_PRICES_AS_OF}"
        )
        return lines


# --------------------------------------------------------------------------------------------
# Live prices.


def live_on_demand(
    pricing: Any, types: Iterable[str], region: str, today: datetime.date
) -> tuple[dict[str, Price], list[str]]:
    """On-Demand prices from the Price List API, and a note per type it could not price."""
    out: dict[str, Price] = {}
    notes: list[str] = []
    for t in types:
        try:
            prices = {
                usd
                for page in _pages(
                    pricing.get_products,
                    ServiceCode="AmazonEC2",
                    Filters=on_demand_filters(t, region),
                    FormatVersion="aws_v1",
                )
                for item in page.get("PriceList", [])
                if (usd := hourly_usd(item)) is not None
            }
        except AWS_ERRORS as e:
            notes.append(f"On-Demand price of {t}: {aws_problem(e)}; offline price used")
            continue
        except (ValueError, KeyError, TypeError) as e:
            notes.append(f"On-Demand price of {t}: unreadable Price List answer ({e}); offline")
            continue
        if not prices:
            notes.append(f"On-Demand price of {t}: the Price List API lists none in {region}")
            continue
        if len(prices) > 1:
            notes.append(f"On-Demand price of {t}: several prices {sorted(prices)}; took lowest")
        out[t] = Price(min(prices), f"Price List API {region} {today.isoformat()}")
    return out, notes


def live_spot(
    ec2: Any, types: Iterable[str], region: str, now: datetime.datetime
) -> tuple[dict[str, dict[str, Price]], list[str]]:
    """The Spot price in effect at ``now`` per type and AZ, and a note if it failed."""
    types = list(types)
    if not types:
        return {}, []
    newest: dict[tuple[str, str], tuple[datetime.datetime, float]] = {}
    try:
        for page in _pages(
            ec2.describe_spot_price_history,
            InstanceTypes=types,
            ProductDescriptions=[SPOT_PRODUCT],
            StartTime=now,
            EndTime=now,
        ):
            for p in page.get("SpotPriceHistory", []):
                key = (p["InstanceType"], p["AvailabilityZone"])
                stamp = p["Timestamp"]
                if key not in newest or stamp > newest[key][0]:
                    newest[key] = (stamp, float(p["SpotPrice"]))
    except AWS_ERRORS as e:
        return {}, [f"Spot prices: {aws_problem(e)}; offline estimates used"]
    out: dict[str, dict[str, Price]] = {}
    stamp_text = now.strftime("%Y-%m-%dT%H:%MZ")
    for (t, zone), (_, usd) in sorted(newest.items()):
        out.setdefault(t, {})[zone] = Price(
            usd, f"Spot price history {region} {stamp_text} in {zone}"
        )
    missing = [t for t in types if t not in out]
    notes = [f"no Spot price history for {', '.join(missing)}; estimates used"] if missing else []
    return out, notes
