"""The availability zone and what it offers: the zone ``availability_zone_index`` selects, the
instance types offered there, Spot placement scores and cluster placement groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from training.preflight.core import AWS_ERRORS, Check, Status, _pages, _spec_types, failure
from training.spec import PLACEMENT_WARNING_FIX, ClusterSpec, InstanceGroup, Market

LOW_PLACEMENT_SCORE = 3
"""A Spot placement score at or below this (scale 1-10) is a warning."""


@dataclass(frozen=True)
class Zone:
    name: str
    zone_id: str
    state: str


def cloudformation_azs(ec2: Any) -> list[Zone]:
    """The region's AZs as ``Fn::GetAZs`` lists them, which is what the network stack indexes
    with ``availability_zone_index`` (``Fn::Select(index, Fn::GetAZs(""))``).

    Assumptions, from https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/
    intrinsic-function-reference-getavailabilityzones.html: Fn::GetAZs lists the region's AZs
    in alphabetical order, only those with a default subnet unless none has one. The same page
    says the order "isn't guaranteed", so name order is an assumption. Zones are those enabled
    for the account (opt-in not required, or opted in) of type ``availability-zone`` (no Local or
    Wavelength Zones); a zone's state is not a filter (an impaired zone keeps its index).
    """
    reply = ec2.describe_availability_zones(
        Filters=[
            {"Name": "zone-type", "Values": ["availability-zone"]},
            {"Name": "opt-in-status", "Values": ["opt-in-not-required", "opted-in"]},
        ]
    )
    zones = sorted(
        (
            Zone(z["ZoneName"], z["ZoneId"], z.get("State", "available"))
            for z in reply.get("AvailabilityZones", [])
        ),
        key=lambda z: z.name,
    )
    with_default_subnet: set[str] = set()
    for page in _pages(
        ec2.describe_subnets, Filters=[{"Name": "default-for-az", "Values": ["true"]}]
    ):
        with_default_subnet.update(s["AvailabilityZone"] for s in page.get("Subnets", []))
    if with_default_subnet:
        zones = [z for z in zones if z.name in with_default_subnet]
    return zones


def check_availability_zone(spec: ClusterSpec, zones: Sequence[Zone], region: str) -> Check:
    """The AZ ``availability_zone_index`` selects exists (and is available)."""
    index = spec.availability_zone_index
    listed = ", ".join(f"{i}: {z.name}" for i, z in enumerate(zones)) or "none"
    if index >= len(zones):
        return Check(
            "availability zone",
            Status.FAIL,
            f"availability_zone_index = {index}, but Fn::GetAZs in {region} lists "
            f"{len(zones)} zone(s) ({listed})",
            f"set availability_zone_index to 0..{len(zones) - 1} in {spec.source}"
            if zones
            else f"choose a region with availability zones (none listed in {region})",
        )
    zone = zones[index]
    detail = f"index {index} -> {zone.name} ({zone.zone_id}); Fn::GetAZs order: {listed}"
    if zone.state != "available":
        return Check(
            "availability zone",
            Status.WARN,
            f"{detail}; the zone's state is {zone.state}",
            "choose another availability_zone_index, or wait until the zone is available",
        )
    return Check("availability zone", Status.PASS, detail)


def check_offerings(spec: ClusterSpec, ec2: Any, zone: Zone) -> list[Check]:
    """Every group has at least one of its types offered in ``zone`` (one row per group)."""
    types = _spec_types(spec)
    offered: set[str] = set()
    for page in _pages(
        ec2.describe_instance_type_offerings,
        LocationType="availability-zone",
        Filters=[
            {"Name": "location", "Values": [zone.name]},
            {"Name": "instance-type", "Values": types},
        ],
    ):
        offered.update(o["InstanceType"] for o in page.get("InstanceTypeOfferings", []))
    rows = []
    for group in spec.groups:
        name = f"offered in {zone.name} ({group.name})"
        have = [t for t in group.instance_types if t in offered]
        lack = [t for t in group.instance_types if t not in offered]
        if not lack:
            rows.append(Check(name, Status.PASS, f"all offered: {', '.join(have)}"))
        elif have:
            rows.append(
                Check(
                    name,
                    Status.WARN,
                    f"not offered: {', '.join(lack)}; offered: {', '.join(have)} (the group "
                    "launches only those)",
                    f"remove {', '.join(lack)} from group '{group.name}' or choose another "
                    "availability_zone_index",
                )
            )
        else:
            rows.append(
                Check(
                    name,
                    Status.FAIL,
                    f"none of {', '.join(lack)} is offered in {zone.name}",
                    f"choose another availability_zone_index, or instance types for group "
                    f"'{group.name}' that {zone.name} offers (aws ec2 "
                    "describe-instance-type-offerings --location-type availability-zone "
                    f"--filters Name=location,Values={zone.name})",
                )
            )
    return rows


def check_placement_scores(
    spec: ClusterSpec, ec2: Any, region: str, zones: Sequence[Zone], zone: Zone
) -> list[Check]:
    """Single-AZ Spot placement score of ``zone`` for each Spot group (advisory)."""
    spot_groups = [g for g in spec.groups if g.market is Market.SPOT]
    if not spot_groups:
        return [Check("Spot placement score", Status.PASS, "no Spot groups")]
    index_of = {z.zone_id: i for i, z in enumerate(zones)}
    rows = []
    for group in spot_groups:
        name = f"Spot placement score ({group.name})"
        try:
            scores = _placement_scores(ec2, group, region)
        except AWS_ERRORS as e:
            rows.append(failure(name, e))
            continue
        # Only zones Fn::GetAZs lists can be chosen by index.
        ranked = sorted(
            ((s, zid) for zid, s in scores.items() if zid in index_of), key=lambda x: -x[0]
        )
        best = (
            f"best: {zones[index_of[ranked[0][1]]].name} (index {index_of[ranked[0][1]]}, "
            f"score {ranked[0][0]})"
            if ranked
            else "no zone of the region scored"
        )
        what = f"{group.count} x {'/'.join(group.instance_types)}"
        score = scores.get(zone.zone_id)
        if score is not None and score > LOW_PLACEMENT_SCORE:
            rows.append(Check(name, Status.PASS, f"{score}/10 in {zone.name} for {what}; {best}"))
            continue
        shown = f"{score}/10" if score is not None else "no score (only the top 10 are returned)"
        if ranked and ranked[0][1] != zone.zone_id and (score is None or ranked[0][0] > score):
            fix = (
                f"set availability_zone_index = {index_of[ranked[0][1]]} in {spec.source} "
                f"({zones[index_of[ranked[0][1]]].name}, score {ranked[0][0]})"
            )
        else:
            fix = (
                "no zone of the region scores higher: add instance types to the group, "
                "lower its count, or choose another region"
            )
        if len(group.instance_types) < 3:
            # "If you specify one or two instance types ... the returned placement score will
            # always be low" (API reference of GetSpotPlacementScores, InstanceTypes).
            fix += (
                f"; group '{group.name}' lists {len(group.instance_types)} type(s) and AWS "
                "always scores fewer than three low: add types with the same GPU count"
            )
        rows.append(Check(name, Status.WARN, f"{shown} in {zone.name} for {what}; {best}", fix))
    return rows


def check_cluster_placement(spec: ClusterSpec) -> list[Check]:
    """One row per group that uses a cluster placement group (``uses_cluster_placement``):
    WARN where it lists several instance types (``InstanceGroup.placement_warning``: AWS
    recommends one type per cluster placement group). Groups without one get no row."""
    rows = []
    for group in spec.groups:
        if not group.uses_cluster_placement:
            continue
        name = f"cluster placement ({group.name})"
        warning = group.placement_warning
        if warning is None:
            detail = f"{group.instance_types[0]} only: one instance type, as AWS advises"
            rows.append(Check(name, Status.PASS, detail))
        else:
            rows.append(
                Check(name, Status.WARN, warning, f"{PLACEMENT_WARNING_FIX} in {spec.source}")
            )
    return rows


def _placement_scores(ec2: Any, group: InstanceGroup, region: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for page in _pages(
        ec2.get_spot_placement_scores,
        InstanceTypes=list(group.instance_types),
        TargetCapacity=group.count,
        TargetCapacityUnitType="units",
        SingleAvailabilityZone=True,
        RegionNames=[region],
    ):
        for s in page.get("SpotPlacementScores", []):
            if "AvailabilityZoneId" in s and "Score" in s:
                out[s["AvailabilityZoneId"]] = int(s["Score"])
    return out
