"""One configuration, evaluated; many, ranked by expected samples per dollar.

For a configuration (N x type, market; a dataprep group planned or given):

1. samples/s per GPU (``throughput``), step time against the network (``network``):
   ``nominal samples/s = N x GPUs x batch x accumulation / max(compute, communication)``;
2. the data plane it needs (``dataplane``), its cheapest dataprep group, the trainer host's CPUs;
3. price per hour of both groups (``prices``), in the AZ the placement score chose if any;
4. under Spot, expected efficiency and checkpoint interval (``preemption``):
   ``expected samples/s = nominal x efficiency`` (On-Demand: efficiency 1);
5. ``samples per dollar = samples/s x 3600 / (USD per hour)``, nominal and expected; time and
   cost to train the spec's samples at the expected rate;
6. with an accuracy target (``target``): the same time and cost for the samples it needs,
   ``hours = samples / expected samples/s / 3600`` and ``USD = hours x USD per hour``.

Rows rank by expected samples per dollar, or, with a target, by expected USD to reach it. For
one sample count the two orders agree (``USD to target = samples / expected samples per
dollar``); the target puts a price and a time on the order.

A configuration is excluded only when it cannot run at all (EFA the spec requires is missing,
too few CPUs, no progress under preemption); a network-bound one keeps its slower rank.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from training.planner.candidates import Candidate
from training.planner.dataplane import (
    DataprepGroup,
    check_fixed_dataprep,
    data_demand,
    plan_dataprep,
    read_bound,
    trainer_host_shortfall,
)
from training.planner.facts import Facts
from training.planner.network import StepTime, network_advice, step_time
from training.planner.placement import Placement
from training.planner.preemption import Preemption, preemption
from training.planner.prices import Price, PriceBook
from training.planner.results import Measured
from training.planner.target import Target
from training.planner.throughput import GpuThroughput, gpu_throughput
from training.planner.workload import Workload
from training.spec import Market


@dataclass(frozen=True)
class DataprepPolicy:
    """Which CPU types and market the planner may use for the dataprep group."""

    types: tuple[str, ...]
    market: Market = Market.SPOT
    efa_required: bool = False
    group_name: str = "dataprep"


@dataclass(frozen=True)
class PlanRow:
    candidate: Candidate
    gpus: int
    throughput: GpuThroughput
    step: StepTime
    nominal_samples_per_s: float
    expected_samples_per_s: float
    preemption: Preemption | None
    interval_steps: int
    """Recommended checkpoint interval (Spot: Young's; On-Demand: the spec's)."""
    trainer_price: Price
    """Per instance."""
    dataprep: DataprepGroup
    vcpus_per_gpu: float
    placement: Placement | None
    samples_to_train: int | None
    notes: tuple[str, ...] = ()
    samples_to_target: int | None = None
    """Training samples needed to reach the accuracy target, when one is given."""

    @property
    def label(self) -> str:
        return self.candidate.label

    @property
    def usd_per_hour(self) -> float:
        return self.candidate.trainer.count * self.trainer_price.usd_per_hour + (
            self.dataprep.usd_per_hour
        )

    @property
    def nominal_samples_per_usd(self) -> float:
        return self.nominal_samples_per_s * 3600 / self.usd_per_hour

    @property
    def expected_samples_per_usd(self) -> float:
        return self.expected_samples_per_s * 3600 / self.usd_per_hour

    def expected_hours(self, samples: int | None) -> float | None:
        """Hours to train ``samples`` at the expected (preemption-adjusted) rate."""
        if samples is None:
            return None
        return samples / self.expected_samples_per_s / 3600

    def expected_usd(self, samples: int | None) -> float | None:
        """USD to train ``samples``: their expected hours x USD per hour of both groups."""
        hours = self.expected_hours(samples)
        return None if hours is None else hours * self.usd_per_hour

    @property
    def hours_to_train(self) -> float | None:
        return self.expected_hours(self.samples_to_train)

    @property
    def usd_to_train(self) -> float | None:
        return self.expected_usd(self.samples_to_train)

    @property
    def hours_to_target(self) -> float | None:
        return self.expected_hours(self.samples_to_target)

    @property
    def usd_to_target(self) -> float | None:
        return self.expected_usd(self.samples_to_target)


@dataclass(frozen=True)
class Excluded:
    label: str
    reason: str


@dataclass
class Plan:
    rows: list[PlanRow]
    """Ranked, best first."""
    excluded: list[Excluded]
    workload: Workload
    region: str
    live: bool
    price_sources: list[str]
    created: datetime.datetime
    measured: Measured
    prices: PriceBook
    dataprep_policy: DataprepPolicy
    facts: Facts
    notes: list[str] = field(default_factory=list)
    """Plan-wide notes (fallbacks to offline data, missing credentials)."""
    target: Target | None = None
    """The accuracy target the rows are ranked by, if any."""


def spot_score_groups(
    candidates: Sequence[Candidate], facts: Facts
) -> dict[tuple[int, int], tuple[str, ...]]:
    """(GPUs per instance, count) -> the Spot candidate types with that GPU count, scored
    together (see ``placement``)."""
    groups: dict[tuple[int, int], list[str]] = {}
    for c in candidates:
        if c.trainer.market is Market.SPOT:
            key = (facts.instance(c.trainer.instance_type).gpus, c.trainer.count)
            types = groups.setdefault(key, [])
            if c.trainer.instance_type not in types:
                types.append(c.trainer.instance_type)
    return {k: tuple(v) for k, v in groups.items()}


def evaluate(
    candidate: Candidate,
    workload: Workload,
    facts: Facts,
    measured: Measured,
    prices: PriceBook,
    dataprep_policy: DataprepPolicy,
    placement: Placement | None = None,
    trainer_efa_required: bool = False,
    samples_to_target: int | None = None,
) -> PlanRow | Excluded:
    """Evaluate one configuration (see the module docstring for every step)."""
    trainer = candidate.trainer
    entry = facts.instance(trainer.instance_type)
    if trainer_efa_required and not entry.supports_efa:
        return Excluded(
            candidate.label,
            f"the spec's trainer group has efa = 'on' but {trainer.instance_type} has no EFA",
        )
    gpus = entry.gpus * trainer.count
    rate = gpu_throughput(trainer.instance_type, workload, facts, measured)
    step = step_time(trainer.instance_type, trainer.count, rate.samples_per_s, workload, facts)
    nominal = gpus * workload.samples_per_rank_step / step.step_s

    shortfall = trainer_host_shortfall(
        trainer.instance_type, nominal / trainer.count, workload, facts, measured
    )
    if shortfall:
        return Excluded(candidate.label, shortfall)

    zone = placement.zone if placement is not None and placement.score is not None else None
    demand = data_demand(nominal, workload, measured)
    dataprep: DataprepGroup | str
    if candidate.dataprep is not None:
        given = candidate.dataprep
        dataprep = check_fixed_dataprep(
            demand,
            DataprepGroup(
                given.instance_type,
                given.count,
                given.market,
                prices.price(given.instance_type, given.market, zone),
                fixed=True,
            ),
            facts,
        )
    else:
        types = dataprep_policy.types
        if dataprep_policy.efa_required:
            types = tuple(t for t in types if facts.instance(t).supports_efa)
        dataprep = plan_dataprep(
            demand,
            types,
            dataprep_policy.market,
            lambda t, m: prices.price(t, m, zone),
            facts,
        )
    if isinstance(dataprep, str):
        return Excluded(candidate.label, dataprep)

    notes: list[str] = []
    if not rate.measured:
        notes.append(f"throughput {rate.source}")
    reads = read_bound(nominal, workload, dataprep.instance_type, facts, measured)
    if reads is not None:
        notes.append(reads.note)
    if step.network_bound:
        notes.append(network_advice(step, workload))
    pre: Preemption | None = None
    expected = nominal * (reads.efficiency if reads is not None else 1.0)
    interval = workload.spec_interval_steps
    if trainer.market is Market.SPOT:
        pre = preemption(trainer.instance_type, trainer.count, workload, facts, measured)
        if pre.efficiency <= 0:
            return Excluded(
                candidate.label,
                f"no progress under preemption: mean {pre.mtbi_s:.0f} s between interruptions "
                f"({pre.band} per instance-month x {trainer.count}) against {pre.checkpoint_s:.0f}"
                f" s per checkpoint and {pre.recovery_s:.0f} s per recovery",
            )
        expected = expected * pre.efficiency
        interval = max(1, round(pre.interval_s / step.step_s))
        if workload.samples_to_train is not None:
            total_steps = workload.samples_to_train / (gpus * workload.samples_per_rank_step)
            if interval > total_steps:
                notes.append(
                    f"checkpoint interval {interval} steps exceeds the {total_steps:.0f} steps to "
                    "train: only the interruption-notice save and the final one matter"
                )
    if placement is not None and placement.note:
        notes.append(f"placement: {placement.note}")
    trainer_price = prices.price(trainer.instance_type, trainer.market, zone)
    return PlanRow(
        candidate=candidate,
        gpus=gpus,
        throughput=rate,
        step=step,
        nominal_samples_per_s=nominal,
        expected_samples_per_s=expected,
        preemption=pre,
        interval_steps=interval,
        trainer_price=trainer_price,
        dataprep=dataprep,
        vcpus_per_gpu=demand.vcpus_needed / gpus,
        placement=placement,
        samples_to_train=workload.samples_to_train,
        notes=tuple(notes),
        samples_to_target=samples_to_target,
    )


def rank(
    candidates: Sequence[Candidate],
    workload: Workload,
    facts: Facts,
    measured: Measured,
    prices: PriceBook,
    dataprep_policy: DataprepPolicy,
    placements: Mapping[tuple[int, int], Placement] | None = None,
    trainer_efa_required: bool = False,
    samples_to_target: int | None = None,
) -> tuple[list[PlanRow], list[Excluded]]:
    """Evaluate every candidate; rows best first by expected samples per dollar, or, given
    ``samples_to_target``, by expected USD to reach the target (cheapest first)."""
    rows: list[PlanRow] = []
    excluded: list[Excluded] = []
    for c in candidates:
        placement = None
        if placements is not None and c.trainer.market is Market.SPOT:
            key = (facts.instance(c.trainer.instance_type).gpus, c.trainer.count)
            placement = placements.get(key)
        result = evaluate(
            c,
            workload,
            facts,
            measured,
            prices,
            dataprep_policy,
            placement,
            trainer_efa_required,
            samples_to_target,
        )
        if isinstance(result, Excluded):
            excluded.append(result)
        else:
            rows.append(result)
    if samples_to_target is None:
        rows.sort(key=lambda r: -r.expected_samples_per_usd)
    else:
        rows.sort(key=_usd_to_target)
    return rows, excluded


def _usd_to_target(row: PlanRow) -> float:
    usd = row.usd_to_target
    assert usd is not None  # rank() gave every row the target's samples
    return usd


def pareto_front(rows: Sequence[PlanRow]) -> set[int]:
    """Indices of the rows no other row beats on both time to train (or, with no sample count,
    seconds per sample) and expected samples per dollar. Hours and USD to a target are the same
    two figures scaled (one sample count for every row), so this is also the front on USD to
    target against hours to target."""

    def time_of(r: PlanRow) -> float:
        hours = r.hours_to_train
        return hours if hours is not None else 1 / r.expected_samples_per_s

    front = set()
    for i, r in enumerate(rows):
        dominated = any(
            time_of(o) <= time_of(r)
            and o.expected_samples_per_usd >= r.expected_samples_per_usd
            and (time_of(o) < time_of(r) or o.expected_samples_per_usd > r.expected_samples_per_usd)
            for j, o in enumerate(rows)
            if j != i
        )
        if not dominated:
            front.add(i)
    return front
