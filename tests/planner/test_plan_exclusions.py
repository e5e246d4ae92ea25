"""Exclusion rules: only configurations that cannot run at all leave the ranking, each with its
reason; a network-bound one stays (see test_plan_ranking)."""

from __future__ import annotations

from training.planner.candidates import parse_config
from training.planner.evaluate import DataprepPolicy, Excluded, PlanRow, evaluate, rank
from training.planner.prices import PriceBook
from training.spec import Market

from .support import CATALOG, MEASURED, PRICES, facts, workload

POLICY = DataprepPolicy(types=("c.cpu",), market=Market.SPOT)
PRICEBOOK = PriceBook(PRICES, CATALOG)


def test_fixed_dataprep_group_with_too_few_cpus_is_excluded() -> None:
    # 1 x g.four: 4,000 samples/s / 100 per vCPU = 40 vCPUs; 1 x c.cpu has 16 - 1 = 15.
    c = parse_config("1 x g.four on-demand + 1 x c.cpu spot", CATALOG)
    result = evaluate(c, workload(), facts(), MEASURED, PRICEBOOK, POLICY)
    assert result == Excluded(
        "1 x g.four on-demand + 1 x c.cpu spot",
        "too few CPUs: 1 x c.cpu has 15 usable vCPUs, the GPUs need 40.0 (4000 images/s)",
    )
    # Three of them (45 vCPUs) feed it, and the given group is used as is.
    enough = evaluate(
        parse_config("1 x g.four on-demand + 3 x c.cpu on-demand", CATALOG),
        workload(),
        facts(),
        MEASURED,
        PRICEBOOK,
        POLICY,
    )
    assert isinstance(enough, PlanRow)
    assert (enough.dataprep.count, enough.dataprep.market, enough.dataprep.fixed) == (
        3,
        Market.ON_DEMAND,
        True,
    )


def test_planned_dataprep_beyond_the_group_bound_is_excluded() -> None:
    # 40 vCPUs need 3 x c.cpu; with at most 2 dataprep instances nothing feeds the GPUs.
    c = parse_config("1 x g.four on-demand", CATALOG)
    result = evaluate(c, workload(), facts(max_dataprep_instances=2), MEASURED, PRICEBOOK, POLICY)
    assert isinstance(result, Excluded)
    assert result.reason == (
        "too few CPUs: the data plane needs 40 vCPUs (4000 images/s), more than 2 instances of "
        "any of c.cpu provide"
    )


def test_trainer_host_without_cpus_to_receive_is_excluded() -> None:
    # g.tiny: 1 vCPU; 1 rank (1 vCPU) + 1,000 / 10,000 = 0.1 vCPU to receive = 1.1 > 1.
    result = evaluate(
        parse_config("1 x g.tiny on-demand", CATALOG),
        workload(),
        facts(),
        MEASURED,
        PRICEBOOK,
        POLICY,
    )
    assert result == Excluded(
        "1 x g.tiny on-demand",
        "too few CPUs on the trainer host: g.tiny has 1 vCPUs, needs 1.1 (1 rank(s) + 0.1 to "
        "receive the stream)",
    )


def test_efa_required_by_the_spec_excludes_types_without_it() -> None:
    rows, excluded = rank(
        [parse_config(c, CATALOG) for c in ("1 x g.one spot", "1 x g.four on-demand")],
        workload(),
        facts(),
        MEASURED,
        PRICEBOOK,
        POLICY,
        trainer_efa_required=True,
    )
    assert [r.label for r in rows] == ["1 x g.four on-demand"]  # g.four has an EFA card
    assert excluded == [
        Excluded("1 x g.one spot", "the spec's trainer group has efa = 'on' but g.one has no EFA")
    ]


def test_no_progress_under_preemption_is_excluded_and_on_demand_is_not() -> None:
    # 100,000 interruptions per instance-month (1e6 s): M = 10 s, shorter than C + R.
    f = facts(band_rate={"hi": 100_000.0, "lo": 0.5})
    spot = evaluate(
        parse_config("1 x g.one spot", CATALOG), workload(), f, MEASURED, PRICEBOOK, POLICY
    )
    assert isinstance(spot, Excluded)
    assert spot.reason.startswith("no progress under preemption: mean 10 s between interruptions")
    on_demand = evaluate(
        parse_config("1 x g.one on-demand", CATALOG), workload(), f, MEASURED, PRICEBOOK, POLICY
    )
    assert isinstance(on_demand, PlanRow)
