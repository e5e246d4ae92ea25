"""Parsing one ``[[groups]]`` table into an ``InstanceGroup``."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from training import instance_types
from training.spec.enums import Efa, Market, Placement, Role
from training.spec.reader import _Reader
from training.spec.schema import InstanceGroup

_GROUP_NAME_RE = re.compile(r"[a-z][a-z0-9_-]{0,30}")
"""Group names also allow '_' (SageMaker heterogeneous-cluster examples use names such as
``dnn_group``); every place a group name goes accepts it: Auto Scaling group names, tags, CDK
construct ids, SageMaker ``InstanceGroupName``, log stream names and IAM ARNs."""


def _parse_group(r: _Reader, t: Mapping[str, Any]) -> InstanceGroup | None:
    r.check_keys(t, InstanceGroup)
    name = r.get(t, "name", str, "")
    if not name:
        r.problem("name", 'missing; give the group a name such as "trainer" or "dataprep"')
    elif not _GROUP_NAME_RE.fullmatch(name):
        r.problem(
            "name",
            f"{name!r} must start with a lowercase letter, then lowercase letters, digits, '-' "
            "or '_', 1-31 characters (e.g. 'trainer', 'dnn_group')",
        )
    if "role" not in t:
        r.problem("role", "missing; use 'trainer' or 'dataprep'")
    role = r.choice(t, "role", Role, None)
    types_raw = r.get(t, "instance_types", list, [])
    types: list[str] = []
    if not types_raw:
        r.problem("instance_types", 'missing or empty; list one or more, e.g. ["g5.xlarge"]')
    for i, it in enumerate(types_raw):
        if not isinstance(it, str):
            r.problem(f"instance_types[{i}]", f"expected a string, got {it!r}")
            continue
        types.append(it)
        entry = instance_types.lookup(it)
        if entry is None:
            close = difflib.get_close_matches(it, list(instance_types.CATALOG), n=3)
            hint = f" (close: {', '.join(close)})" if close else ""
            r.problem(
                f"instance_types[{i}]",
                f"unknown instance type {it!r}{hint}; add it to training/instance_types.py "
                "or choose a listed one",
            )
        elif entry.burstable:
            r.problem(
                f"instance_types[{i}]",
                f"{it!r} is burstable (T family) and cannot run in a cluster placement group; "
                "choose a non-burstable type such as c6i.4xlarge",
            )
        elif role is Role.TRAINER and entry.gpus == 0:
            r.problem(
                f"instance_types[{i}]",
                f"{it!r} has no GPU; trainer groups need GPU types (e.g. g5.xlarge, p4d.24xlarge)",
            )
        elif role is Role.TRAINER and (unsupported := entry.image_problem()) is not None:
            # A GPU the image's CUDA wheels have no kernels for fails at its first CUDA call,
            # after the boot has been paid for (instance_types.MIN_COMPUTE_CAPABILITY).
            r.problem(
                f"instance_types[{i}]",
                f"{unsupported}; choose a type whose GPU the image supports (g4dn, g5, g6, g6e, "
                "p4d, p4de or p5), or build the image with CUDA 12.x wheels (PyTorch's CUDA "
                "12.8 and 12.9 builds still carry 7.0 kernels) and set "
                "training/instance_types.py IMAGE_CUDA_MAJOR to match",
            )
    if "count" not in t:
        r.problem("count", "missing; how many instances the group has (1 or more)")
    count = r.positive(t, "count", 1)
    market = r.choice(t, "market", Market, Market.SPOT)
    efa = r.choice(t, "efa", Efa, Efa.AUTO)
    known = [x for x in types if instance_types.lookup(x) is not None]
    if efa is Efa.ON:
        without = [x for x in known if not instance_types.CATALOG[x].supports_efa]
        if without:
            r.problem(
                "efa",
                f"'on' but {', '.join(without)} has no EFA; remove those types, choose EFA types "
                "(e.g. p4d.24xlarge, g5.8xlarge, c5n.18xlarge) or set efa = 'auto'",
            )
    if role is Role.TRAINER and known:
        gpu_counts = {instance_types.CATALOG[x].gpus for x in known}
        if len(gpu_counts) > 1:
            r.problem(
                "instance_types",
                "trainer types must have the same number of GPUs (ranks per instance must not "
                f"depend on which type Spot delivers); got {sorted(gpu_counts)}",
            )
    ppi_raw = r.get(t, "processes_per_instance", int, 0)
    ppi: int | None = None
    if "processes_per_instance" in t:
        if ppi_raw < 1:
            r.problem("processes_per_instance", f"must be at least 1, got {ppi_raw}")
        else:
            ppi = ppi_raw
    placement = r.choice(t, "placement", Placement, None)
    bounds: dict[str, int | None] = {}
    for key in ("min_count", "max_count"):
        bounds[key] = r.positive(t, key, 0) if key in t else None
        if bounds[key] is not None and role is Role.TRAINER:
            r.problem(
                key,
                "only dataprep groups are elastic; a trainer group has a fixed count (remove "
                f"{key})",
            )
    low = bounds["min_count"] if bounds["min_count"] is not None else count
    high = bounds["max_count"] if bounds["max_count"] is not None else count
    if not low <= count <= high:
        r.problem(
            "count",
            f"an elastic group starts at count, which must lie between min_count and max_count; "
            f"got min_count {low}, count {count}, max_count {high}",
        )
    if not name or role is None or not types or len(known) != len(types):
        return None
    return InstanceGroup(
        name=name,
        role=role,
        instance_types=tuple(types),
        count=count,
        market=market,
        efa=efa,
        processes_per_instance=ppi,
        placement=placement,
        min_count=bounds["min_count"],
        max_count=bounds["max_count"],
    )
