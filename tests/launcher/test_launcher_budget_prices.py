"""The budget's price: the job pointer's recorded prices (``hetero job start``), else every group
at its most from the spec and the dated catalogue (a deploy's job), with where it comes from in
the budget's lines and in ``hetero status``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from training.common.jobparam import GroupPrice, JobPointer, deployed_job_pointer, prices_to_json
from training.common.jobrecord import JobRecord
from training.costs.budget import Budget
from training.costs.deploy_prices import recorded_prices
from training.prices import price_lines
from training.spec import ClusterSpec, parse_spec
from training.workstation.status import JobStatus, budget_line, prices_text

STAMP = "2026-11-22T10:00:00Z"
# 3.00 USD/h in all: 2 x 1.25 + 4 x 0.125.
PRICES = (
    GroupPrice("trainer", "g5.xlarge", "spot", 2, 1.25, "spot-price-history", STAMP),
    GroupPrice("dataprep", "c7i.4xlarge", "spot", 4, 0.125, "catalogue", "2026-07-20"),
)
URI = "s3://ckpt/checkpoints/j-20261122T100000-ab12/"


@pytest.fixture
def spec() -> ClusterSpec:
    """Two Spot trainers of g5.xlarge or g6.xlarge; an elastic dataprep group (1 to 4) of
    c6i.4xlarge or c7i.4xlarge; a 1.5 USD cap."""
    return parse_spec(
        {
            "name": "capped",
            "groups": [
                {
                    "name": "trainer",
                    "role": "trainer",
                    "instance_types": ["g5.xlarge", "g6.xlarge"],
                    "count": 2,
                },
                {
                    "name": "dataprep",
                    "role": "dataprep",
                    "instance_types": ["c6i.4xlarge", "c7i.4xlarge"],
                    "count": 1,
                    "min_count": 1,
                    "max_count": 4,
                },
            ],
            "job": {"steps": 10, "max_usd": 1.5},
        }
    )


def test_the_pointers_prices_set_the_budget(spec: ClusterSpec) -> None:
    budget = Budget.of(spec, JobPointer("j-20261122T100000-ab12", URI, STAMP, prices=PRICES))
    assert budget.usd_per_hour == pytest.approx(3.0)
    assert budget.limit_s() == pytest.approx(1800.0)  # 1.5 USD at 3 USD/h: half an hour
    assert budget.priced == f"spot-price-history {STAMP}, catalogue 2026-07-20"
    assert budget.reason(1800.0) == (
        "budget: max_usd 1.5 reached (1.5000 USD over 0.5000 h at 3.00 USD/h from "
        f"spot-price-history {STAMP}, catalogue 2026-07-20); continue with hetero job start "
        "--resume"
    )
    assert budget.describe(900.0) == (
        f"0.75 USD over 0.25 h at 3.00 USD/h from spot-price-history {STAMP}, catalogue "
        "2026-07-20; max_usd 1.5"
    )


def test_a_deploys_job_is_priced_at_its_most_from_the_catalogue_with_a_warning(
    spec: ClusterSpec, caplog: pytest.LogCaptureFixture
) -> None:
    pointer = deployed_job_pointer("name = 'capped'\n", "s3://ckpt/checkpoints/")
    with caplog.at_level(logging.WARNING, logger="training.costs.budget"):
        budget = Budget.of(spec, pointer)
    # At its most: 2 x g5.xlarge (the dearer listed type) and 4 x c7i.4xlarge (max_count),
    # each the catalogue's On-Demand price x the Spot ratio 0.35; not spec.usd_per_hour(),
    # which is 1 dataprep instance of the first listed type.
    at_most = (2 * 1.006 + 4 * 0.714) * 0.35
    assert budget.usd_per_hour == pytest.approx(at_most)
    assert spec.usd_per_hour() == pytest.approx((2 * 1.006 + 0.68) * 0.35)
    assert budget.limit_s() == pytest.approx(1.5 / at_most * 3600.0)
    assert budget.priced == "catalogue 2026-07-20"
    assert [r.getMessage() for r in caplog.records] == [
        f"job {pointer.job_id} records no prices (neither its pointer, as `hetero job start` "
        "writes them, nor its record, as a deploy's first host does): its budget prices every "
        "group at its most from the offline catalogue of 2026-07-20"
    ]


def test_status_shows_the_recorded_prices_and_the_spend_at_them(
    spec: ClusterSpec, tmp_path: Path
) -> None:
    pointer = JobPointer("j-20261122T100000-ab12", URI, STAMP, prices=PRICES)
    status = JobStatus(cluster="capped", job=json.loads(pointer.to_json()))  # as collect() reads it
    assert prices_text(status.job or {}) == [
        "prices at the job's start, each group at its most:",
        "  group     at its most      market  USD/h each  USD/h   source, as of",
        f"  trainer   2 x g5.xlarge    spot    1.2500      2.5000  spot-price-history, {STAMP}",
        "  dataprep  4 x c7i.4xlarge  spot    0.1250      0.5000  catalogue, 2026-07-20",
        "  total at its most: 3.0000 USD/h",
    ]
    record = JobRecord(f"{tmp_path}/ckpt")
    started = 1795341600.0  # STAMP
    assert budget_line(spec, status, record, now=started + 1800) == (
        f"1.50 USD over 0.50 h at 3.00 USD/h from spot-price-history {STAMP}, catalogue "
        "2026-07-20; max_usd 1.5"
    )
    deployed = JobStatus(cluster="capped", job={"job_id": "d-0123456789ab", "checkpoint_uri": URI})
    assert prices_text(deployed.job or {}) == [
        "prices: none recorded in the job pointer or the job record: its budget prices the "
        "groups at their most from the spec and the dated catalogue"
    ]
    assert prices_text({}) == []
    # A deploy's job whose first host priced it: the record's prices, in the spend as well.
    record.record_prices(prices_to_json(PRICES))  # as deploy_prices writes them
    deployed.recorded_prices = recorded_prices(record)  # as collect() reads them
    assert deployed.recorded_prices == PRICES
    assert prices_text(deployed.job or {}, deployed.recorded_prices) == [
        "prices at the job's start (its first host's, in the job record), each at its most:",
        *[f"  {line}" for line in price_lines(PRICES)],
    ]
    record.started(started)
    assert budget_line(spec, deployed, record, now=started + 900).startswith(
        f"0.75 USD over 0.25 h at 3.00 USD/h from spot-price-history {STAMP}, catalogue"
    )
