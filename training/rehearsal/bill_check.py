"""The rehearsal's check of the job's bill (``training.costs.bill``): the instance-seconds the
job's end recorded, per group, against those the group simulator counted, at the prices the bill
recorded.

The simulator counts each instance from when moto created it to when moto terminated it, as
moto's backend in the rehearsal's process knows them (``ec2_launched_t``, ``ec2_terminated_t``:
to the microsecond, where the API gives the launch to the second and no termination time);
without them, from the look that found it running to the one that found it terminated (every
half second); an instance still running when the rehearsal stopped counts to then. Both are
taken up to the bill's end (``until``, the job's end): what the instances ran after it (the
outcome's write and the groups' scale to zero, tens of milliseconds here; on AWS their
termination) the bill leaves out by design, and the report gives it apart (``after_end_s``).
The bill comes from what the launchers saw and wrote into the job record.

The bill counts from the middle of EC2's ``LaunchTime`` second, off by up to half a second per
launch, the same for every instance launched within the same second; that part of the
difference (``launch_rounding_s``) the rehearsal measures exactly, from moto's creation times.
A group agrees when its instance-seconds (so its USD, at one price) are within ``TOLERANCE`` of
the simulator's: in full (``checked_in_full``) where half a second per launch is at most that
tolerance of its instance-seconds, so that the launch second alone cannot use it up; else apart
from the launch rounding, with the full difference reported (the fault-free rehearsal: four
instances of about 40 s launched within the same second, each off by up to 1.25 % together).
Where the bill's own bound on its ends (``ends_bound_s``: half the gap between the two looks
that bracket each instance it saw go, or its launch and the first look that found it gone) is
wider than the tolerance, that bound is what it is held to: a group of boots that gave up within
a second or two, between two looks of hosts that look every two seconds, cannot be known to 1 %.

Not checked at all (``checked`` false, with why): a job whose end recorded no bill (no outcome,
or an end before any launcher ran its loop), and a rehearsal that resumed a stopped job (the
record's bill is the last job's; the simulator counts every job's instances).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from training.costs.bill import LAUNCH_RESOLUTION_S

TOLERANCE = 0.01
"""The largest relative difference, per group, between the bill's instance-seconds and the
simulator's."""


def bill_facts(
    bill: Mapping[str, Any] | None,
    instances: Sequence[Mapping[str, Any]],
    *,
    ended_t: float,
    started_wall: float,
    resumed: bool = False,
) -> dict[str, Any]:
    """The report's ``bill`` entry. ``instances``: the report's instance rows (``instance``,
    ``group``, ``launched_t``, ``terminated_t``, ``ec2_launched_t``, ``ec2_terminated_t``,
    seconds since the start, ``started_wall``); ``ended_t``: when the rehearsal stopped
    watching (the end of an instance never seen terminated)."""
    if not isinstance(bill, Mapping):
        return {"checked": False, "why": "the job's outcome records no bill"}
    if resumed:
        return {"checked": False, "why": "a stopped job was resumed: the bill is the last job's"}
    rows = {str(i["instance"]): i for i in instances}
    # The bill covers the job up to its end (``until``); what the instances ran after it (the
    # outcome's write, the groups' scale to zero) it leaves out by design: reported apart.
    until_t = float(bill["until"]) - started_wall if "until" in bill else ended_t
    counted = {i: max(0.0, min(_end(r, ended_t), until_t) - _start(r)) for i, r in rows.items()}
    after_end = {i: max(0.0, _end(r, ended_t) - max(until_t, _start(r))) for i, r in rows.items()}
    billed: dict[str, Mapping[str, Any]] = dict(bill.get("instances") or {})
    group_of = {i: str(row["group"]) for i, row in rows.items()}
    group_of.update({i: str(v.get("group")) for i, v in billed.items() if i not in group_of})
    prices: dict[str, float] = {}
    for line in bill.get("lines") or []:
        if line.get("usd_per_hour") is not None:
            prices.setdefault(str(line["group"]), float(line["usd_per_hour"]))
    rounding: dict[str, float] = {}
    """Instance -> how much later the bill starts it than moto created it."""
    if bill.get("since") is None:
        for i, v in billed.items():
            exact = rows.get(i, {}).get("ec2_launched_t")
            if exact is not None:
                rounding[i] = float(v["start"]) - started_wall - float(exact)
    groups = {
        group: _group(
            [i for i in group_of if group_of[i] == group], counted, billed, rounding,
            prices.get(group), launch_s=LAUNCH_RESOLUTION_S / 2.0 if bill.get("since") is None
            else 0.0,
        )
        | {"after_end_s": round(sum(after_end.get(i, 0.0) for i in group_of
                                    if group_of[i] == group), 3)}
        for group in sorted(set(group_of.values()))
    }  # fmt: skip
    differences = sorted(
        ((_seconds(billed.get(i)) - counted.get(i, 0.0), i) for i in group_of),
        key=lambda x: -abs(x[0]),
    )
    return {
        "checked": True,
        "tolerance": TOLERANCE,
        "groups": groups,
        "uncertain_s": bill.get("uncertain_s"),
        "missing_from_bill": sorted(set(counted) - set(billed)),
        "not_in_simulator": sorted(set(billed) - set(counted)),
        "largest_instance_differences_s": [[i, round(d, 2)] for d, i in differences[:3]],
        "ok": all(g["ok"] for g in groups.values()),
    }


def _group(
    ids: list[str],
    counted: Mapping[str, float],
    billed: Mapping[str, Mapping[str, Any]],
    rounding: Mapping[str, float],
    price: float | None,
    *,
    launch_s: float,
) -> dict[str, Any]:
    sim_s = sum(counted.get(i, 0.0) for i in ids)
    bill_s = sum(_seconds(billed.get(i)) for i in ids)
    rounding_s = sum(rounding.get(i, 0.0) for i in ids)
    resolution_s = sum(1 for i in ids if i in counted) * LAUNCH_RESOLUTION_S / 2.0
    # The bill's own bound on its ends (each instance's ``uncertain_s`` less its launch's half
    # second): an instance it could only bracket, between two looks, may be off by that much.
    ends_s = sum(
        max(0.0, float(billed[i].get("uncertain_s") or 0.0) - launch_s) for i in ids if i in billed
    )
    in_full = resolution_s <= TOLERANCE * sim_s
    share = _share(bill_s - sim_s, sim_s)
    # A later start shortens the bill: adding the rounding back leaves the rest of the difference.
    apart = _share(bill_s - sim_s + rounding_s, sim_s)
    allowed_s = max(TOLERANCE * sim_s, ends_s + (resolution_s if in_full else 0.0))
    difference_s = bill_s - sim_s + (0.0 if in_full else rounding_s)
    return {
        "simulator_s": round(sim_s, 2),
        "bill_s": round(bill_s, 2),
        "difference_share": round(share, 5),
        "launch_rounding_s": round(rounding_s, 3),
        "difference_apart_from_rounding_share": round(apart, 5),
        "launch_resolution_s": resolution_s,
        "checked_in_full": in_full,
        "ends_bound_s": round(ends_s, 3),
        "allowed_s": round(allowed_s, 3),
        "over_tolerance_within_bound": TOLERANCE * sim_s < abs(difference_s) <= allowed_s,
        "usd_per_hour": price,
        "simulator_usd": None if price is None else round(sim_s * price / 3600.0, 6),
        "bill_usd": None if price is None else round(bill_s * price / 3600.0, 6),
        "ok": abs(difference_s) <= allowed_s,
    }


def _share(difference: float, of: float) -> float:
    if of > 0:
        return difference / of
    return 0.0 if difference == 0 else 1.0


def _seconds(spell: Mapping[str, Any] | None) -> float:
    return 0.0 if spell is None else float(spell["end"]) - float(spell["start"])


def _start(row: Mapping[str, Any]) -> float:
    exact = row.get("ec2_launched_t")
    return float(row["launched_t"] if exact is None else exact)


def _end(row: Mapping[str, Any], ended_t: float) -> float:
    for key in ("ec2_terminated_t", "terminated_t"):
        if row.get(key) is not None:
            return float(row[key])
    return ended_t


def detail(facts: Mapping[str, Any]) -> str:
    """The check in words: each group's billed and counted instance-seconds and difference."""
    if not facts.get("checked"):
        return f"not checked: {facts.get('why')}"
    parts = []
    for name, g in facts["groups"].items():
        part = (
            f"{name} {g['bill_s']:.1f} instance-s billed, {g['simulator_s']:.1f} counted "
            f"({g['difference_share'] * 100:+.2f} %"
        )
        if not g["checked_in_full"]:
            part += (
                f", {g['difference_apart_from_rounding_share'] * 100:+.2f} % apart from "
                f"LaunchTime's second ({g['launch_rounding_s']:+.2f} s; its ± "
                f"{g['launch_resolution_s']:g} s is over the tolerance)"
            )
        if g["over_tolerance_within_bound"]:
            part += (
                f"; over 1 %, within the bill's own bound on its ends, ± {g['ends_bound_s']:.2f} s"
            )
        parts.append(part + ")")
    bound = facts.get("uncertain_s")
    return (
        "; ".join(parts)
        + f"; tolerance {facts['tolerance'] * 100:g} %"
        + ("" if bound is None else f", the bill's own bound ± {float(bound):.1f} instance-s")
    )
