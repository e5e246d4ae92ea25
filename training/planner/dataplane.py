"""The data plane a configuration needs: dataprep vCPUs, which CPU type feeds them cheapest,
and whether the trainer hosts have the CPUs to receive the stream.

- Augmentation rate per vCPU for the spec's recipe, at the job's image size: measured
  (benchmarks/results) or prior, scaled by output pixels from the size it was measured at
  (*estimate*: decode and augmentation cost taken as proportional to pixels).
- ``dataprep vCPUs per GPU = trainer samples/s per GPU / images/s per vCPU``.
- For each CPU type: ``count = max(ceil(vCPUs needed / (vCPUs - reserved)),
  ceil(stream bytes/s / baseline bandwidth))``; the cheapest group wins (fewer instances on a
  tie). None within ``MAX_DATAPREP_INSTANCES`` -> excluded, "too few CPUs".
- Trainer host: ``ranks x TRAINER_VCPUS_PER_RANK + samples/s per instance / receive rate`` must
  fit in its vCPUs, else "too few CPUs" on the trainer host.
- A prepared dataset (``source = "shards"``, ``Workload.dataset_read``): in an epoch read from
  S3 (every epoch when the servers' caches cannot hold the dataset, else the first), each data
  server reads every shard (a run of shards spans ranges of every server), so it must read
  ``samples/s x bytes per image`` from S3; at the dataprep type's baseline bandwidth
  (*estimate*: S3 may deliver less to one instance) the GPUs then get at most
  ``bandwidth / bytes per image`` samples/s in those epochs (``read_bound``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from training.planner.facts import Facts
from training.planner.prices import Price
from training.planner.results import Measured
from training.planner.workload import Workload
from training.spec import Market


@dataclass(frozen=True)
class DataDemand:
    images_per_s: float
    """What the whole trainer group consumes."""
    images_per_vcpu: float
    """Augmentation rate of one dataprep vCPU at the job's image size."""
    rate_source: str
    bytes_per_s: float

    @property
    def vcpus_needed(self) -> float:
        return self.images_per_s / self.images_per_vcpu


@dataclass(frozen=True)
class DataprepGroup:
    instance_type: str
    count: int
    market: Market
    price: Price
    """Per instance."""
    fixed: bool = False
    """True when the configuration named the group (``+ M x TYPE``), False when planned."""

    @property
    def usd_per_hour(self) -> float:
        return self.count * self.price.usd_per_hour


def scaled_rate(rate: float, measured_px: int, image_size: int) -> float:
    """A per-pixel cost measured at ``measured_px`` applied at ``image_size``."""
    return rate * (measured_px / image_size) ** 2


def data_demand(images_per_s: float, workload: Workload, measured: Measured) -> DataDemand:
    rate, px, source = measured.augment_rate(workload.recipe, workload.image_size)
    return DataDemand(
        images_per_s=images_per_s,
        images_per_vcpu=scaled_rate(rate, px, workload.image_size),
        rate_source=f"{workload.recipe}: {source}, {rate:.0f} images/s per vCPU at {px} px",
        bytes_per_s=images_per_s * workload.bytes_per_sample,
    )


@dataclass(frozen=True)
class ReadBound:
    """How reading a prepared dataset from S3 slows the job on a dataprep type."""

    factor: float
    """Throughput in an epoch read from S3, as a share of the GPUs' (1: not read-bound)."""
    cold_share: float
    """The share of training read from S3 (``Workload.cold_epoch_share``)."""
    note: str

    @property
    def efficiency(self) -> float:
        """Average throughput as a share of the GPUs': the read-bound share of the samples at
        ``factor``, the rest at full speed (time-weighted)."""
        return 1.0 / ((1.0 - self.cold_share) + self.cold_share / self.factor)


def read_bound(
    images_per_s: float,
    workload: Workload,
    dataprep_type: str,
    facts: Facts,
    measured: Measured | None = None,
) -> ReadBound | None:
    """None when the job reads no prepared dataset; else what its S3 reads cost (see the
    module docstring). The read rate is the one ``hetero bench`` measured on ``dataprep_type``
    when there is one (at most its bandwidth), else the type's baseline bandwidth."""
    read = workload.dataset_read
    if read is None:
        return None
    need = images_per_s * read.bytes_per_image
    link = facts.bandwidth_gbps(dataprep_type) * 1e9 / 8
    rate_source = "estimate"
    figure = measured.shard_read_bytes_per_s.get(dataprep_type) if measured else None
    if figure is not None and figure[0] < link:
        link, rate_source = figure[0], f"S3 reads {figure[1]}"
    factor = min(1.0, link / need) if need > 0 else 1.0
    cold = workload.cold_epoch_share
    when = (
        "every epoch (the dataset is larger than "
        f"{read.cache_note}, {read.cache_bytes / 1e9:.0f} GB)"
        if not read.cache_fits
        else f"the first epoch ({cold:.0%} of training; then {read.cache_note} holds it)"
    )
    note = (
        f"reads the dataset from S3 in {when}: {need * 8 / 1e9:.2f} Gbps per data server "
        f"({read.bytes_per_image / 1e3:.0f} KB per image)"
    )
    if factor < 1.0:
        note += (
            f", more than {dataprep_type}'s {link * 8 / 1e9:.1f} Gbps ({rate_source}): "
            f"{factor:.0%} of the GPUs' rate while it does"
        )
    return ReadBound(factor, cold, note)


def trainer_host_shortfall(
    instance_type: str,
    images_per_s_per_instance: float,
    workload: Workload,
    facts: Facts,
    measured: Measured,
) -> str | None:
    """Why one trainer instance lacks the vCPUs to train and receive, or None if it has them."""
    entry = facts.instance(instance_type)
    rate, px, _ = measured.receive_rate(workload.image_size)
    receive = images_per_s_per_instance / scaled_rate(rate, px, workload.image_size)
    need = max(1, entry.gpus) * facts.trainer_vcpus_per_rank + receive
    if need <= entry.vcpus:
        return None
    return (
        f"too few CPUs on the trainer host: {instance_type} has {entry.vcpus} vCPUs, needs "
        f"{need:.1f} ({max(1, entry.gpus)} rank(s) + {receive:.1f} to receive the stream)"
    )


def plan_dataprep(
    demand: DataDemand,
    types: Sequence[str],
    market: Market,
    price_of: Callable[[str, Market], Price],
    facts: Facts,
) -> DataprepGroup | str:
    """The cheapest dataprep group that feeds ``demand``, or the reason none can."""
    best: DataprepGroup | None = None
    for t in types:
        entry = facts.instance(t)
        usable = entry.vcpus - facts.dataprep_reserved_vcpus
        link = facts.bandwidth_gbps(t) * 1e9 / 8
        if usable <= 0:
            continue
        count = max(
            1, math.ceil(demand.vcpus_needed / usable), math.ceil(demand.bytes_per_s / link)
        )
        if count > facts.max_dataprep_instances:
            continue
        group = DataprepGroup(t, count, market, price_of(t, market))
        if best is None or (group.usd_per_hour, group.count) < (best.usd_per_hour, best.count):
            best = group
    if best is None:
        return (
            f"too few CPUs: the data plane needs {demand.vcpus_needed:.0f} vCPUs "
            f"({demand.images_per_s:.0f} images/s), more than "
            f"{facts.max_dataprep_instances} instances of any of {', '.join(types)} provide"
        )
    return best


def check_fixed_dataprep(
    demand: DataDemand, group: DataprepGroup, facts: Facts
) -> DataprepGroup | str:
    """A dataprep group named by the configuration, or why it cannot feed the GPUs."""
    entry = facts.instance(group.instance_type)
    usable = group.count * (entry.vcpus - facts.dataprep_reserved_vcpus)
    link = group.count * facts.bandwidth_gbps(group.instance_type) * 1e9 / 8
    if usable < demand.vcpus_needed:
        return (
            f"too few CPUs: {group.count} x {group.instance_type} has {usable} usable vCPUs, the "
            f"GPUs need {demand.vcpus_needed:.1f} ({demand.images_per_s:.0f} images/s)"
        )
    if link < demand.bytes_per_s:
        return (
            f"too little network: {group.count} x {group.instance_type} sends "
            f"{link * 8 / 1e9:.1f} Gbps, the GPUs need {demand.bytes_per_s * 8 / 1e9:.1f} Gbps"
        )
    return group
