"""The prices of a deploy's job, asked of AWS by its first host.

``hetero job start`` prices a job from AWS on the machine that starts it and records the prices
in the job pointer (``training.prices``). The job a deploy starts has no such step: the stack
writes its pointer when the template is made, without prices (``infra/job.py``). So the first
host of the job prices it, once, and records the prices in the job record (``prices.json``),
where every host of the job (their budget and bill) and ``hetero status`` read them:

- Spot: ``DescribeSpotPriceHistory`` in this instance's Availability Zone (every group runs in
  the cluster's one subnet), through the VPC's EC2 endpoint: the price in effect now;
- On-Demand: the dated catalogue, with a warning (``prices.NO_PRICE_LIST``);
- the spec's ``[job.prices]`` first, as everywhere.

Where AWS does not answer, that host's Spot prices are the catalogue's (with a warning that
names its date) and nothing is recorded: the next host asks again.
"""

from __future__ import annotations

import logging
from typing import Any

from training.common.jobparam import GroupPrice, JobPointer, prices_from_json, prices_to_json
from training.common.jobrecord import JobRecord
from training.common.names import MARKET_SPOT
from training.prices import SOURCE_CATALOGUE, price_groups
from training.spec import ClusterSpec

log = logging.getLogger(__name__)


def recorded_prices(record: JobRecord) -> tuple[GroupPrice, ...] | None:
    """The prices a host of the job recorded (None: none yet, or not readable: logged)."""
    try:
        value = record.prices()
    except Exception as e:  # S3 unreachable: no prices from the record this time
        log.warning("could not read the job's recorded prices: %s", e)
        return None
    return prices_from_json(value, source=f"{record.location}job/prices.json")


def deploy_job_prices(
    spec: ClusterSpec,
    pointer: JobPointer | None,
    record: JobRecord | None,
    *,
    ec2: Any,
    zone: str | None,
    region: str | None,
) -> tuple[GroupPrice, ...] | None:
    """For a deploy's job (its pointer records no prices, and it has a record): the job's
    recorded prices; else priced now (Spot in ``zone``, see the module docstring) and recorded.
    None otherwise (the caller prices from the pointer)."""
    if record is None or (pointer is not None and pointer.prices):
        return None
    recorded = recorded_prices(record)
    if recorded:
        return recorded
    zones = {g.name: [zone] for g in spec.groups} if zone else {}
    priced = price_groups(
        spec, ec2=ec2, pricing=None, zones=zones, region=region or "this instance's region"
    )
    if any(p.market == MARKET_SPOT and p.source == SOURCE_CATALOGUE for p in priced.prices):
        return priced.prices  # AWS did not answer (warned): the next host asks again
    try:
        record.record_prices(prices_to_json(priced.prices))
    except Exception as e:  # S3 unreachable: this host's prices; the next host tries again
        log.warning("could not record the job's prices: %s", e)
        return priced.prices
    log.info("priced the deploy's job from AWS and recorded it in %sjob/prices.json",
             record.location)  # fmt: skip
    return priced.prices
