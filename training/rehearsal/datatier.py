"""The rehearsal's view of an elastic data tier (``training.dataplane.autoscale``): what the
controller decided and what the dataprep group did.

``DesiredWatch`` follows every group's desired capacity while the rehearsal runs (each change
becomes a ``group-desired`` event); ``data_tier_facts`` puts together, for the report's
``data_tier`` entry, the controller's decisions (from the job record: ``job/autoscale/``), the
group's desired capacity over time, its instances and the instance-seconds they ran.

``consistent`` holds when every desired capacity the group had before the job's end (its scale
to zero) was one the controller asked for, in the order it asked: the start count, then each
acted decision's ``to_count``. A loss counted twice shows there: a Spot interruption during a
scale-in taken as one more removal (a desired count under the controller's), or its replacement
kept on top of the controller's count (over it), or a controller that restarted from a count
the group does not have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from training.spec import ClusterSpec


@dataclass
class DesiredWatch:
    """Each group's desired capacity as last seen, and every change (seconds since the start)."""

    history: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def observe(self, t: float, desired: Mapping[str, int]) -> list[tuple[str, int, int | None]]:
        """Take one look; the changes since the last one: (group, new value, old value)."""
        changes: list[tuple[str, int, int | None]] = []
        for group, value in desired.items():
            seen = self.history.setdefault(group, [])
            old = seen[-1][1] if seen else None
            if old != value:
                seen.append((round(t, 2), int(value)))
                changes.append((group, int(value), old))
        return changes


def collapse(values: Sequence[int]) -> list[int]:
    """``values`` without consecutive repeats."""
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


def expected_desired(start: int, decisions: Sequence[Mapping[str, Any]]) -> list[int]:
    """The desired capacities the controller asked for, in order: the start count, then each
    acted change."""
    asked = [start] + [
        int(d["to_count"])
        for d in decisions
        if d.get("acted") and d.get("to_count") != d.get("from_count")
    ]
    return collapse(asked)


def before_end(values: Sequence[int]) -> list[int]:
    """The desired capacities before the job's end: the trailing zeros (every group scaled to
    zero when the job ended) left out."""
    out = list(values)
    while out and out[-1] == 0:
        out.pop()
    return out


def last_job(values: Sequence[int], jobs_resumed: int) -> list[int]:
    """The desired capacities of the last job: a stopped job's end scaled the group to 0 (an
    elastic group's minimum is at least 1), so the values after the ``jobs_resumed``-th 0."""
    out = list(values)
    for _ in range(jobs_resumed):
        out = out[out.index(0) + 1 :] if 0 in out else []
    return out


def data_tier_facts(
    spec: ClusterSpec,
    asg_names: Mapping[str, str],
    decisions: Sequence[Mapping[str, Any]],
    watch: DesiredWatch,
    instances: Sequence[Mapping[str, Any]],
    *,
    started_wall: float,
    ended_t: float,
    jobs_resumed: int = 0,
) -> dict[str, Any] | None:
    """The report's ``data_tier`` entry, or None without an elastic dataprep group.
    ``instances``: the report's instance rows (``group``, ``instance``, ``launched_t``,
    ``terminated_t``); ``ended_t``: seconds since the start when the rehearsal stopped watching
    (the end of an instance never seen terminated); ``jobs_resumed``: stopped jobs the rehearsal
    continued (the controller's ``decisions`` are the last job's, from its record; the desired
    capacities compared with them are that job's too)."""
    elastic = [g for g in spec.dataprep_groups if g.elastic]
    if not elastic:
        return None
    group = elastic[0]
    asg = asg_names.get(group.name, "")
    history = watch.history.get(asg, [])
    seen = last_job(collapse([v for _, v in history]), jobs_resumed)
    expected = expected_desired(group.count, decisions)
    rows = [i for i in instances if i["group"] == group.name]
    seconds = sum(
        (ended_t if i["terminated_t"] is None else i["terminated_t"]) - i["launched_t"]
        for i in rows
    )
    return {
        "group": group.name,
        "asg": asg,
        "start_count": group.count,
        "min_count": group.min_size,
        "max_count": group.max_size,
        "decisions": [{**d, "t": round(float(d["time"]) - started_wall, 2)} for d in decisions],
        "changes": [
            [int(d["from_count"]), int(d["to_count"])]
            for d in decisions
            if d.get("acted") and d.get("to_count") != d.get("from_count")
        ],
        "desired": [{"t": t, "desired": v} for t, v in history],
        "desired_before_end": before_end(seen),
        "expected_desired": expected,
        "consistent": before_end(seen) == expected,
        "instances_launched": len(rows),
        "instance_seconds": round(seconds, 1),
    }
