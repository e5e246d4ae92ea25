"""Single-AZ Spot placement scores: where a Spot trainer group is likely to get its capacity.

One ``GetSpotPlacementScores`` request (``SingleAvailabilityZone=True``) per Spot trainer group
the plan considers: the candidate types with the same GPU count, together, and the group's
instance count. AWS scores a request naming one or two types always low ("If you specify one or
two instance types ... the returned placement score will always be low", API reference of
GetSpotPlacementScores, https://docs.aws.amazon.com/AWSEC2/latest/APIReference/
API_GetSpotPlacementScores.html), which is why same-GPU types are scored as one group and why a
written spec lists them all. The AZ with the best score is mapped to the
``availability_zone_index`` the stacks use (``Fn::GetAZs`` order, as ``hetero preflight``
resolves it). Offline there are no scores, and none is ever made up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from training.planner.errors import aws_problem
from training.preflight import AWS_ERRORS, Zone, cloudformation_azs
from training.preflight.zones import _placement_scores
from training.spec import InstanceGroup, Market, Role


@dataclass(frozen=True)
class Placement:
    """The best-scoring AZ for one Spot group, or why there is none."""

    types: tuple[str, ...]
    count: int
    score: int | None = None
    zone: str | None = None
    """AZ name."""
    zone_index: int | None = None
    """Index in Fn::GetAZs order (``availability_zone_index``)."""
    note: str = ""


def zones(ec2: Any) -> tuple[list[Zone], str]:
    """The region's AZs in ``Fn::GetAZs`` order, or [] and why not."""
    try:
        return cloudformation_azs(ec2), ""
    except AWS_ERRORS as e:
        return [], f"availability zones: {aws_problem(e)}"


def best_placement(
    ec2: Any, types: Sequence[str], count: int, region: str, zone_list: Sequence[Zone]
) -> Placement:
    """Score ``count`` instances of any of ``types`` per AZ; keep the best AZ the stacks can
    select by index."""
    group = InstanceGroup(
        name="plan", role=Role.TRAINER, instance_types=tuple(types), count=count, market=Market.SPOT
    )
    try:
        scores = _placement_scores(ec2, group, region)
    except AWS_ERRORS as e:
        return Placement(tuple(types), count, note=f"no score: {aws_problem(e)}")
    index_of = {z.zone_id: i for i, z in enumerate(zone_list)}
    ranked = sorted(
        ((s, index_of[zid]) for zid, s in scores.items() if zid in index_of),
        key=lambda x: (-x[0], x[1]),
    )
    low = " (AWS scores one or two types low)" if len(types) < 3 else ""
    if not ranked:
        return Placement(tuple(types), count, note=f"no AZ of {region} was scored{low}")
    score, index = ranked[0]
    return Placement(
        tuple(types), count, score, zone_list[index].name, index, note=low.strip(" ()")
    )
