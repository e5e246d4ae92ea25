"""The configurations a plan compares.

With ``--compare``, each argument is ``"N x TYPE [MARKET]"`` (market ``spot`` by default), e.g.
``"4 x g5.xlarge spot"`` or ``"1 x g5.12xlarge on-demand"``, optionally followed by a dataprep
group it must use, ``"+ M x CPU_TYPE [MARKET]"``; without one the planner sizes the dataprep
group itself. Without ``--compare``, the candidates are every type of the spec's trainer group x
counts {1, 2, 4, the spec's count} x both markets: small enough to read, and ``--compare``
covers anything else.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from training import instance_types
from training.planner.errors import PlanError
from training.spec import ClusterSpec, Market

ENUMERATED_COUNTS = (1, 2, 4)
_PART = r"(\d+)\s*[x*]\s*([A-Za-z0-9][A-Za-z0-9.\-]*)(?:\s+(spot|on-demand|ondemand))?"
_CONFIG_RE = re.compile(rf"\s*{_PART}\s*(?:\+\s*{_PART}\s*)?", re.IGNORECASE)


@dataclass(frozen=True)
class Group:
    instance_type: str
    count: int
    market: Market

    @property
    def label(self) -> str:
        return f"{self.count} x {self.instance_type} {self.market.value}"


@dataclass(frozen=True)
class Candidate:
    trainer: Group
    dataprep: Group | None = None
    """A dataprep group the configuration insists on; None: the planner sizes one."""

    @property
    def label(self) -> str:
        return self.trainer.label + (f" + {self.dataprep.label}" if self.dataprep else "")


def _market(raw: str | None) -> Market:
    if raw is None:
        return Market.SPOT
    return Market.ON_DEMAND if raw.lower() in ("on-demand", "ondemand") else Market.SPOT


def _known_type(
    name: str, role: str, catalog: Mapping[str, instance_types.InstanceType], where: str
) -> str:
    entry = catalog.get(name)
    if entry is None:
        close = difflib.get_close_matches(name, list(catalog), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise PlanError(
            f"{where}: unknown instance type {name!r}{hint}; the planner knows the types of "
            "training/instance_types.py"
        )
    if role == "trainer" and entry.gpus == 0:
        raise PlanError(f"{where}: {name} has no GPU; the first group trains, give a GPU type")
    # A GPU the image's wheels have no kernels for (spec check would refuse the plan's spec);
    # a type whose capability the catalogue does not know (the tests' own) is not refused here.
    known = role == "trainer" and entry.compute_capability is not None
    unsupported = entry.image_problem() if known else None
    if unsupported:
        raise PlanError(f"{where}: {unsupported}; give a GPU type the image runs on")
    if role == "dataprep" and (entry.gpus or entry.burstable):
        raise PlanError(
            f"{where}: {name} is not a dataprep type; after '+' give a CPU type such as c6i.4xlarge"
        )
    return name


def parse_config(
    text: str, catalog: Mapping[str, instance_types.InstanceType] = instance_types.CATALOG
) -> Candidate:
    """``"4 x g5.xlarge spot"`` or ``"2 x g5.xlarge spot + 1 x c6i.8xlarge spot"``."""
    m = _CONFIG_RE.fullmatch(text)
    where = f"--compare {text!r}"
    if m is None:
        raise PlanError(
            f"{where}: expected 'N x TYPE [spot|on-demand]' with an optional "
            "'+ M x CPU_TYPE [spot|on-demand]', e.g. '4 x g5.xlarge spot'"
        )
    n, t, market, dn, dt, dmarket = m.groups()
    if int(n) < 1 or (dn is not None and int(dn) < 1):
        raise PlanError(f"{where}: instance counts must be at least 1")
    trainer = Group(_known_type(t, "trainer", catalog, where), int(n), _market(market))
    dataprep = None
    if dt is not None:
        dataprep = Group(_known_type(dt, "dataprep", catalog, where), int(dn), _market(dmarket))
    return Candidate(trainer, dataprep)


def from_spec(spec: ClusterSpec) -> list[Candidate]:
    """Every trainer type of the spec x counts {1, 2, 4, spec count} x {spot, on-demand}."""
    group = spec.trainer_group
    counts = sorted({*ENUMERATED_COUNTS, group.count})
    return [
        Candidate(Group(t, n, market))
        for t in group.instance_types
        for n in counts
        for market in (Market.SPOT, Market.ON_DEMAND)
    ]


def candidates(spec: ClusterSpec, compare: Sequence[str] | None) -> list[Candidate]:
    """The configurations to plan, in the order given (duplicates dropped)."""
    found = [parse_config(c) for c in compare] if compare else from_spec(spec)
    return list(dict.fromkeys(found))


def check_region(region: str, known: Iterable[str]) -> str:
    """``region`` if it is a region EC2 has, else a PlanError listing the valid ones."""
    valid = sorted(known)
    if region in valid:
        return region
    close = difflib.get_close_matches(region, valid, n=2)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise PlanError(f"unknown region {region!r}{hint}; valid regions: {', '.join(valid)}")
