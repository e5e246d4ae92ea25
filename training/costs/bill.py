"""A job's bill: instance-seconds per group and market, from the job record, times the prices the
job recorded when it started.

**Where the seconds come from.** Every host of the job keeps a census of the cluster's instances
(``Census``) and writes it with its state into the job record (``hosts/<instance-id>.json``,
under ``instances``). For each instance it holds its group (tag ``hetero:group``), type, market
(``InstanceLifecycle`` ``spot``, else On-Demand), EC2 ``LaunchTime``, the last time the host saw
it ``running`` (``seen``) and the first time after that it saw it no longer running (``gone``).
A host looks whenever it lists the cluster's running instances (``DescribeInstances``, the call
membership already makes): at each heartbeat, at each membership poll of a trainer, and, on the
host that ends the job, once more just before it records the outcome. A boot that gave up, or an
early exit (a launcher that could not start its loop: ``early_exit``), may end before any host
saw it running: the boot watch (``boot_watch``) adds it, ``gone`` when it was first seen shut
down or terminated.

Each instance counts from its launch (or the job's ``started``, for a job that
``hetero job start`` started: an instance of the previous job still running then counts from
there) to

- the job's end, for an instance running when the job ended (exact: the time the outcome was
  recorded, just before the groups are scaled to zero);
- the middle of (``seen``, ``gone``] for one that went while the job ran (a Spot loss, a hard
  kill, a scale-in, a replacement): off by at most half that gap, which is at most half a
  heartbeat while a host of the job beats (``--heartbeat`` 30 s: 15 s), less with several hosts
  looking;
- the middle of (launch, ``gone``] for one no host saw running (a boot that gave up, or an early
  exit, before any launcher looked): off by at most half of that.

The launch is EC2's ``LaunchTime``, which EC2 gives to the second: the bill takes the middle of
that second, off by at most half a second where the second is cut (moto's is; AWS does not say
whether it cuts or rounds: at worst a second). The ``pending`` state that follows the launch is
not billed by EC2 (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-instance-lifecycle.html)
and the bill counts it: that errs on the side of more. ``uncertain_s`` is the sum of the bounds
(the half-gaps, and half a second per launch counted).

**Prices.** A line (group, market) is priced at the group's price the job recorded
(``JobPointer.prices``; a deploy's job: the spec's and the dated catalogue's, as its budget,
``Budget.of``) when the market is the one priced; the price is the group's dearest listed type,
so a group that ran a cheaper listed type is billed as if it ran the dearest. An instance of
another market than the one priced has no recorded price: its line is ``unpriced`` (USD left
out, the seconds shown).

Not in the bill: what follows the job's end (Auto Scaling's termination of each instance, a
trainer's termination hook until its launcher completes it), EBS volumes, VPC endpoints, data
transfer, and Spot's rule that an instance EC2 interrupts within its first hour is not charged
(the bill counts it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from training.common.hosts import instance_market, tag
from training.common.jobparam import GroupPrice
from training.common.names import MARKET_ON_DEMAND, MARKET_SPOT, TAG_GROUP

LAUNCH_RESOLUTION_S = 1.0
"""EC2's ``LaunchTime`` is given to the second (the bill counts from its middle)."""
UNPRICED = "unpriced"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Sighting:
    """One instance as one or more hosts of the job saw it (times in epoch seconds)."""

    instance_id: str
    group: str
    instance_type: str
    market: str
    """``spot`` or ``on-demand``."""
    launched: float
    """EC2's ``LaunchTime``."""
    seen: float | None = None
    """The last time a host saw it running; None: never."""
    gone: float | None = None
    """The first time after ``seen`` (or, never seen running, after its launch) a host saw it
    no longer running; None: running when last seen."""

    def merged(self, other: Sighting) -> Sighting:
        """Two looks at the same instance together: the latest time seen running, the first
        time seen gone after that; group, type and market of the latest look."""
        seen = max((t for t in (self.seen, other.seen) if t is not None), default=None)
        gones = [g for g in (self.gone, other.gone) if g is not None and (seen is None or g > seen)]
        newer = other if (other.seen or 0.0) >= (self.seen or 0.0) else self
        return replace(
            newer,
            launched=min(self.launched, other.launched),
            seen=seen,
            gone=min(gones, default=None),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "type": self.instance_type,
            "market": self.market,
            "launched": self.launched,
            "seen": self.seen,
            "gone": self.gone,
        }

    @classmethod
    def from_json(cls, instance_id: str, value: Any) -> Sighting | None:
        """A sighting as ``to_json`` wrote it; None when it is not one (a newer or broken
        record: left out)."""
        if not isinstance(value, Mapping):
            return None
        launched = _number(value.get("launched"))
        if launched is None or not isinstance(value.get("group"), str):
            return None
        return cls(
            instance_id=instance_id,
            group=value["group"],
            instance_type=str(value.get("type") or ""),
            market=MARKET_SPOT if value.get("market") == MARKET_SPOT else MARKET_ON_DEMAND,
            launched=launched,
            seen=_number(value.get("seen")),
            gone=_number(value.get("gone")),
        )


def sighting(
    instance: Mapping[str, Any],
    *,
    group: str | None = None,
    seen: float | None = None,
    gone: float | None = None,
) -> Sighting | None:
    """An instance as ``DescribeInstances`` lists it, as a sighting; None without a launch time
    or a group (its ``hetero:group`` tag, unless ``group`` is given)."""
    launched: Any = instance.get("LaunchTime")
    when = launched.timestamp() if hasattr(launched, "timestamp") else _number(launched)
    group = group or tag(instance, TAG_GROUP)
    if when is None or not group or not instance.get("InstanceId"):
        return None
    return Sighting(
        instance_id=str(instance["InstanceId"]),
        group=group,
        instance_type=str(instance.get("InstanceType") or ""),
        market=instance_market(instance),
        launched=float(when),
        seen=seen,
        gone=gone,
    )


class Census:
    """Sightings of the cluster's instances, by instance id; thread-safe (a host's heartbeat,
    its membership wait and its job end all look)."""

    def __init__(self, sightings: Iterable[Sighting] = ()) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Sighting] = {}
        for s in sightings:
            self.add(s)

    def add(self, found: Sighting) -> None:
        """One more look at an instance (merged with what was known)."""
        with self._lock:
            known = self._by_id.get(found.instance_id)
            self._by_id[found.instance_id] = found if known is None else known.merged(found)

    def observe(self, now: float, running: Mapping[str, Iterable[Mapping[str, Any]]]) -> None:
        """The cluster's running instances by group at ``now`` (``hosts.list_cluster_instances``):
        each listed one is seen running at ``now``; one seen running before and not listed is
        gone by ``now``."""
        listed = [
            s for group, instances in running.items() for inst in instances
            if (s := sighting(inst, group=group, seen=now)) is not None
        ]  # fmt: skip
        for s in listed:
            self.add(s)
        ids = {s.instance_id for s in listed}
        with self._lock:
            for instance_id, s in self._by_id.items():
                if instance_id not in ids and s.seen is not None and s.gone is None:
                    self._by_id[instance_id] = replace(s, gone=max(now, s.seen))

    def sightings(self) -> list[Sighting]:
        with self._lock:
            return list(self._by_id.values())

    def to_json(self) -> dict[str, dict[str, Any]]:
        """The ledger a host writes into its job-record state (``instances``)."""
        return {s.instance_id: s.to_json() for s in self.sightings()}

    def load(self, ledger: Any) -> None:
        """Add a ledger ``to_json`` wrote (a host's ``instances``); anything else is ignored."""
        if not isinstance(ledger, Mapping):
            return
        for instance_id, value in ledger.items():
            found = Sighting.from_json(str(instance_id), value)
            if found is not None:
                self.add(found)


@dataclass(frozen=True)
class BillLine:
    """One group's instances of one market."""

    group: str
    market: str
    instances: int
    instance_seconds: float
    uncertain_s: float
    """The instance-seconds are off by at most this much (see the module docstring)."""
    types: tuple[str, ...]
    """The instance types it ran."""
    price: GroupPrice | None
    """The group's recorded price in this market; None: the job recorded none."""

    @property
    def usd(self) -> float | None:
        if self.price is None:
            return None
        return self.price.usd_per_hour * self.instance_seconds / 3600.0

    def to_json(self) -> dict[str, Any]:
        p = self.price
        return {
            "group": self.group,
            "market": self.market,
            "instances": self.instances,
            "instance_seconds": round(self.instance_seconds, 3),
            "uncertain_s": round(self.uncertain_s, 3),
            "types": list(self.types),
            "usd_per_hour": p.usd_per_hour if p else None,
            "priced_type": p.instance_type if p else None,
            "source": p.source if p else UNPRICED,
            "as_of": p.as_of if p else None,
            "usd": None if self.usd is None else round(self.usd, 6),
        }


@dataclass(frozen=True)
class Spell:
    """One instance's counted time."""

    sighting: Sighting
    start: float
    end: float
    uncertain_s: float
    running: bool
    """Still running at the bill's end."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


def spell(s: Sighting, *, until: float, since: float | None = None) -> Spell | None:
    """The time ``s`` counts in a bill from ``since`` (None: each instance's launch) to
    ``until``; None when it ran none of it."""
    launched = s.launched + LAUNCH_RESOLUTION_S / 2.0  # the middle of the second it names
    start = launched if since is None else max(launched, since)
    uncertain = LAUNCH_RESOLUTION_S / 2.0 if start == launched else 0.0
    if s.seen is None and s.gone is None:
        return None  # nobody saw it either way: a broken record
    if s.gone is None:  # running when last seen, so at the end too
        end, running = until, True
    else:
        after = start if s.seen is None else s.seen
        end, running = (after + s.gone) / 2.0, False
        uncertain += (s.gone - after) / 2.0
    end = min(end, until)
    if end <= start:
        return None
    return Spell(s, start, end, uncertain, running)


@dataclass(frozen=True)
class Bill:
    """What the job's instances cost from ``since`` (None: their launches) to ``until``."""

    lines: tuple[BillLine, ...]
    spells: tuple[Spell, ...]
    until: float
    since: float | None = None

    @property
    def instance_seconds(self) -> float:
        return sum(line.instance_seconds for line in self.lines)

    @property
    def uncertain_s(self) -> float:
        return sum(line.uncertain_s for line in self.lines)

    @property
    def usd(self) -> float:
        """Priced lines only (an ``unpriced`` line has no USD)."""
        return sum(line.usd or 0.0 for line in self.lines)

    def to_json(self) -> dict[str, Any]:
        """What the outcome records (``bill``) and ``hetero status --json`` shows."""
        return {
            "since": self.since,
            "until": self.until,
            "instance_seconds": round(self.instance_seconds, 3),
            "uncertain_s": round(self.uncertain_s, 3),
            "usd": round(self.usd, 6),
            "running": sum(1 for s in self.spells if s.running),
            "lines": [line.to_json() for line in self.lines],
            "instances": {
                s.sighting.instance_id: {
                    "group": s.sighting.group,
                    "market": s.sighting.market,
                    "start": round(s.start, 3),
                    "end": round(s.end, 3),
                    "uncertain_s": round(s.uncertain_s, 3),
                }
                for s in self.spells
            },
        }


def make_bill(
    sightings: Iterable[Sighting],
    prices: Sequence[GroupPrice],
    *,
    until: float,
    since: float | None = None,
) -> Bill:
    """The bill of ``sightings`` (see the module docstring), one line per group and market in
    the order of ``prices``' groups, then any other group by name."""
    spells = [x for s in sightings if (x := spell(s, until=until, since=since)) is not None]
    order = {p.group: i for i, p in enumerate(prices)}
    keys = sorted(
        {(x.sighting.group, x.sighting.market) for x in spells},
        key=lambda k: (order.get(k[0], len(order)), k[0], k[1]),
    )
    lines = []
    for group, market in keys:
        mine = [x for x in spells if (x.sighting.group, x.sighting.market) == (group, market)]
        lines.append(
            BillLine(
                group=group,
                market=market,
                instances=len(mine),
                instance_seconds=sum(x.seconds for x in mine),
                uncertain_s=sum(x.uncertain_s for x in mine),
                types=tuple(sorted({x.sighting.instance_type for x in mine})),
                price=next((p for p in prices if (p.group, p.market) == (group, market)), None),
            )
        )
    return Bill(tuple(lines), tuple(spells), until=until, since=since)


def job_bill(
    hosts: Mapping[str, Mapping[str, Any]],
    prices: Sequence[GroupPrice],
    *,
    until: float,
    since: float | None = None,
    running: Mapping[str, Iterable[Mapping[str, Any]]] | None = None,
    own: Census | None = None,
) -> Bill:
    """The bill from the job record's ``hosts`` (each one's ``instances``), with this host's
    own census (``own``, fresher than what it wrote) and, when given, a listing of the cluster's
    running instances at ``until`` (what still runs then, and what went since the last look)."""
    census = Census(own.sightings() if own is not None else ())
    for state in hosts.values():
        census.load(state.get("instances"))
    if running is not None:
        census.observe(until, running)
    return make_bill(census.sightings(), prices, until=until, since=since)


def bill_lines(bill: Mapping[str, Any]) -> list[str]:
    """A bill as ``Bill.to_json`` wrote it, as an aligned table of text, one line per group and
    market, then the total."""
    rows = [("group", "market", "instances", "instance-h", "± s", "USD/h each", "USD", "priced")]
    for line in bill.get("lines") or []:
        usd_h, usd = line.get("usd_per_hour"), line.get("usd")
        source = line.get("source") or UNPRICED
        rows.append(
            (
                str(line.get("group")),
                str(line.get("market")),
                str(line.get("instances")),
                f"{float(line.get('instance_seconds') or 0.0) / 3600.0:.4f}",
                f"{float(line.get('uncertain_s') or 0.0):.0f}",
                "-" if usd_h is None else f"{usd_h:.4f}",
                "-" if usd is None else f"{usd:.4f}",
                source if line.get("as_of") is None else f"{source}, {line['as_of']}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    hours = float(bill.get("instance_seconds") or 0.0) / 3600.0
    total = (
        f"total: {float(bill.get('usd') or 0.0):.4f} USD for {hours:.4f} instance-h "
        f"(± {float(bill.get('uncertain_s') or 0.0):.0f} instance-s)"
    )
    if any(line.get("usd") is None for line in bill.get("lines") or []):
        total += "; unpriced lines left out of the USD"
    return [*out, total]
