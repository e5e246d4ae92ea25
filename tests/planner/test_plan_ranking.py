"""The ranking, computed by hand for a small table (tests/planner/support.py), with the network
and preemption terms both deciding places.

Shared figures:
- per GPU: 100 TFLOP/s x MFU 0.5 / 50 GFLOP = 1,000 samples/s; batch 100 -> compute 0.1 s/step;
- gradients: 1e8 params x 4 bytes (fp32, no compression) = 4e8 bytes;
- data: 100 x 100 x 3 = 30,000 bytes per sample;
- dataprep: 100 images/s per vCPU, c.cpu has 16 - 1 = 15 usable vCPUs, 0.50 USD/h;
- preemption: month = 1e6 s; band "hi" 20 and "lo" 0.5 interruptions per instance-month;
  C = 18 s (params equal the reference), R = 30 + 120 = 150 s.
"""

from __future__ import annotations

import math

import pytest

from training.planner.candidates import Candidate, Group, parse_config
from training.planner.evaluate import (
    DataprepPolicy,
    Excluded,
    PlanRow,
    evaluate,
    pareto_front,
    spot_score_groups,
)
from training.planner.evaluate import rank as rank_candidates
from training.planner.prices import PriceBook
from training.spec import Market

from .support import CATALOG, MEASURED, PRICES, facts, workload

POLICY = DataprepPolicy(types=("c.cpu",), market=Market.SPOT)


def plan(configs: list[str]) -> tuple[list[PlanRow], list[Excluded]]:
    f = facts()
    return rank_candidates(
        [parse_config(c, CATALOG) for c in configs],
        workload(),
        f,
        MEASURED,
        PriceBook(PRICES, CATALOG),
        POLICY,
    )


def test_hand_computed_ranking_with_network_and_preemption_terms() -> None:
    rows, excluded = plan(
        ["1 x g.one spot", "1 x g.alt spot", "1 x g.four on-demand", "4 x g.one spot"]
    )
    assert excluded == []
    assert [r.label for r in rows] == [
        "1 x g.alt spot",
        "1 x g.one spot",
        "1 x g.four on-demand",
        "4 x g.one spot",
    ]
    alt, one, four, four_spot = rows

    # 1 x g.alt spot: data 100 x 30,000 B = 3e6 B over min(1e9, one 10 Gbps flow) = 0.003 s;
    # no all-reduce (one GPU): step = compute 0.1 s -> 1,000 samples/s nominal.
    # M = 1e6 / (0.5 x 1) = 2e6 s; tau = sqrt(2 x 18 x 2e6) = 8485.28 s;
    # efficiency = 1 - 18/8485.28 - (4242.64 + 150)/2e6 = 0.99568240.
    assert alt.step.step_s == pytest.approx(0.1)
    assert alt.nominal_samples_per_s == pytest.approx(1000.0)
    assert alt.preemption is not None
    assert alt.preemption.mtbi_s == pytest.approx(2e6)
    assert alt.preemption.interval_s == pytest.approx(math.sqrt(7.2e7))
    eff_alt = 1 - 18 / math.sqrt(7.2e7) - (math.sqrt(7.2e7) / 2 + 150) / 2e6
    assert alt.preemption.efficiency == pytest.approx(eff_alt)
    assert eff_alt == pytest.approx(0.9956824, rel=1e-6)
    # 1,000 / 100 = 10 vCPUs -> 1 x c.cpu; USD/h = 0.41 + 0.50 = 0.91.
    assert (alt.dataprep.instance_type, alt.dataprep.count) == ("c.cpu", 1)
    assert alt.usd_per_hour == pytest.approx(0.91)
    # Nominal 1,000 x 3600 / 0.91 = 3,956,044; expected x 0.9956824 = 3,938,963.
    assert alt.nominal_samples_per_usd == pytest.approx(3600e3 / 0.91)
    assert alt.expected_samples_per_usd == pytest.approx(3600e3 / 0.91 * eff_alt)
    # Interval: 8485.28 s / 0.1 s per step = 84,853 steps; 3.6e6 samples at 995.68/s = 1.0043 h.
    assert alt.interval_steps == 84853
    assert alt.hours_to_train == pytest.approx(3.6e6 / (1000 * eff_alt) / 3600)
    assert alt.usd_to_train == pytest.approx(3.6e6 / (1000 * eff_alt) / 3600 * 0.91)

    # 1 x g.one spot: the same cluster 0.01 USD/h cheaper, so first on *nominal* samples per
    # dollar (1,000 x 3600 / 0.90 = 4,000,000 > 3,956,044), but its band is "hi":
    # M = 1e6 / 20 = 5e4 s; tau = sqrt(2 x 18 x 5e4) = 1341.64 s;
    # efficiency = 1 - 18/1341.64 - (670.82 + 150)/5e4 = 0.9701673 -> 3,880,669 expected,
    # below g.alt's 3,938,963: preemption decides the order.
    assert one.nominal_samples_per_usd == pytest.approx(4_000_000)
    assert one.nominal_samples_per_usd > alt.nominal_samples_per_usd
    eff_one = 1 - 18 / math.sqrt(1.8e6) - (math.sqrt(1.8e6) / 2 + 150) / 5e4
    assert one.expected_samples_per_usd == pytest.approx(4_000_000 * eff_one)
    assert eff_one == pytest.approx(0.9701673, rel=1e-6)
    assert one.interval_steps == round(math.sqrt(1.8e6) / 0.1)

    # 1 x g.four on-demand: intra-node all-reduce 2 x 3/4 x 4e8 = 6e8 B at 10 GB/s = 0.06 s,
    # data 4 x 3e6 B over min(1e10, 4 flows x 1.25e9) = 0.0024 s: 0.0624 s < compute 0.1 s, so
    # compute-bound: 4 x 100 / 0.1 = 4,000 samples/s, efficiency 1 (On-Demand).
    assert four.step.intra_node_s == pytest.approx(0.06)
    assert four.step.data_s == pytest.approx(0.0024)
    assert not four.step.network_bound
    assert four.nominal_samples_per_s == pytest.approx(4000.0)
    assert four.expected_samples_per_s == four.nominal_samples_per_s
    assert four.preemption is None and four.interval_steps == 500  # the spec's interval
    # 4,000 / 100 = 40 vCPUs -> ceil(40 / 15) = 3 x c.cpu; USD/h = 4.40 + 1.50 = 5.90.
    assert (four.dataprep.instance_type, four.dataprep.count) == ("c.cpu", 3)
    assert four.expected_samples_per_usd == pytest.approx(4000 * 3600 / 5.90)
    assert four.vcpus_per_gpu == pytest.approx(10.0)

    # 4 x g.one spot: all-reduce between instances 2 x 3/4 x 4e8 = 6e8 B at 1e9 B/s = 0.6 s,
    # + data 0.003 s = 0.603 s > compute 0.1 s: network-bound, kept with a note.
    # Nominal 4 x 100 / 0.603 = 663.35 samples/s; M = 1e6 / (20 x 4) = 12,500 s,
    # tau = sqrt(2 x 18 x 12,500) = 670.82 s, efficiency = 1 - 18/670.82 - (335.41 + 150)/12,500
    # = 0.9343340; USD/h = 4 x 0.40 + 0.50 = 2.10 -> 663.35 x 0.934334 x 3600 / 2.1.
    assert four_spot.step.inter_node_s == pytest.approx(0.6)
    assert four_spot.step.network_bound
    assert four_spot.nominal_samples_per_s == pytest.approx(400 / 0.603)
    eff_4 = 1 - 18 / math.sqrt(4.5e5) - (math.sqrt(4.5e5) / 2 + 150) / 12_500
    assert eff_4 == pytest.approx(0.9343340, rel=1e-6)
    assert four_spot.expected_samples_per_usd == pytest.approx(400 / 0.603 * eff_4 * 3600 / 2.1)
    # ceil(0.6 / (0.1 - 0.003)) = 7 micro-batches of accumulation would hide the all-reduce.
    assert any(
        "network-bound" in n and "grad_accum_steps >= 7" in n and "grad_compression" in n
        for n in four_spot.notes
    )


def test_pareto_front_is_time_against_samples_per_dollar() -> None:
    rows, _ = plan(["1 x g.one spot", "1 x g.alt spot", "1 x g.four on-demand", "4 x g.one spot"])
    by_label = {r.label: i for i, r in enumerate(rows)}
    # g.four trains fastest (0.25 h), g.alt gives the most samples per dollar; g.alt beats
    # g.one on both (1.004 h vs 1.031 h, 3.94 M vs 3.88 M per USD), so does g.four 4 x g.one.
    assert pareto_front(rows) == {by_label["1 x g.alt spot"], by_label["1 x g.four on-demand"]}


def test_bf16_gradient_compression_halves_the_all_reduce() -> None:
    f = facts()
    c = Candidate(Group("g.one", 4, Market.SPOT))
    prices = PriceBook(PRICES, CATALOG)
    plain = evaluate(c, workload(), f, MEASURED, prices, POLICY)
    compressed = evaluate(c, workload(grad_compression=True), f, MEASURED, prices, POLICY)
    assert isinstance(plain, PlanRow) and isinstance(compressed, PlanRow)
    # 2 x 3/4 x 1e8 x 2 bytes = 3e8 B at 1e9 B/s.
    assert compressed.step.inter_node_s == pytest.approx(0.3)
    assert plain.step.inter_node_s == pytest.approx(0.6)
    assert not any("grad_compression" in n for n in compressed.notes)


def test_async_checkpoint_uses_the_stall_and_adds_the_durable_lag() -> None:
    f = facts()
    c = Candidate(Group("g.one", 1, Market.SPOT))
    row = evaluate(
        c, workload(async_checkpoint=True), f, MEASURED, PriceBook(PRICES, CATALOG), POLICY
    )
    assert isinstance(row, PlanRow) and row.preemption is not None
    # C = 1 s stall, d = 18 s until durable: tau = sqrt(2 x 1 x 5e4) = 316.23 s;
    # efficiency = 1 - 1/316.23 - (158.11 + 18 + 150)/5e4.
    tau = math.sqrt(1e5)
    assert row.preemption.interval_s == pytest.approx(tau)
    assert row.preemption.efficiency == pytest.approx(1 - 1 / tau - (tau / 2 + 18 + 150) / 5e4)


def test_spot_types_with_the_same_gpu_count_and_size_are_scored_together() -> None:
    found = [
        parse_config(c, CATALOG)
        for c in ("4 x g.one spot", "4 x g.alt spot", "1 x g.four on-demand", "1 x g.one spot")
    ]
    # One GetSpotPlacementScores request per (GPUs per instance, count); On-Demand has none.
    assert spot_score_groups(found, facts()) == {(1, 4): ("g.one", "g.alt"), (1, 1): ("g.one",)}
