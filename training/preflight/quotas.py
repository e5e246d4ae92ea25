"""vCPU quotas: the spec's vCPUs per Service Quotas code, against the account's quota."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError

from training.preflight.core import (
    AWS_ERRORS,
    Check,
    Status,
    _code,
    _pages,
    _spec_types,
    failure,
)
from training.spec import ClusterSpec, Market


@dataclass(frozen=True)
class QuotaClass:
    """One EC2 vCPU quota class: the instance families that share a Spot and an On-Demand
    quota (Service Quotas, service code ``ec2``)."""

    name: str
    on_demand_code: str
    spot_code: str | None
    """None where AWS lists no Spot quota for the class (its types are not sold as Spot)."""

    def code(self, market: Market) -> str | None:
        return self.spot_code if market is Market.SPOT else self.on_demand_code

    def quota_name(self, market: Market) -> str:
        if market is Market.SPOT:
            return f"All {self.name} Spot Instance Requests"
        return f"Running On-Demand {self.name} instances"


# Quota codes as AWS lists them: On-Demand https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/
# ec2-on-demand-instances.html#ec2-on-demand-instances-limits, Spot https://docs.aws.amazon.com/
# AWSEC2/latest/UserGuide/using-spot-limits.html (HPC and High Memory have no Spot quota).
QUOTA_CLASSES: dict[str, QuotaClass] = {
    "standard": QuotaClass("Standard (A, C, D, H, I, M, R, T, Z)", "L-1216C47A", "L-34B43A08"),
    "g": QuotaClass("G and VT", "L-DB2E81BA", "L-3819A6DF"),
    "p": QuotaClass("P", "L-417A185B", "L-7212CCBC"),
    "inf": QuotaClass("Inf", "L-1945791B", "L-B5D1601B"),
    "trn": QuotaClass("Trn", "L-2C3B7624", "L-6B0D517C"),
    "x": QuotaClass("X", "L-7295265B", "L-E3A00192"),
    "f": QuotaClass("F", "L-74FC7D96", "L-88CF9481"),
    "dl": QuotaClass("DL", "L-6E869C2A", "L-85EED4F7"),
    "hpc": QuotaClass("HPC", "L-F7808C92", None),
    "high-memory": QuotaClass("High Memory", "L-43DA4232", None),
}
# Family prefix (the letters before the generation digit) -> class, where it is not Standard.
# Checked before the first-letter rule: "inf", "dl", "hpc", "trn" start with Standard letters.
_FAMILY_CLASS: dict[str, str] = {
    "g": "g",
    "gr": "g",
    "vt": "g",
    "p": "p",
    "inf": "inf",
    "trn": "trn",
    "x": "x",
    "f": "f",
    "dl": "dl",
    "hpc": "hpc",
    "u": "high-memory",
}
_NOT_QUOTA_CLASSED = {"mac"}  # Mac instances run on Dedicated Hosts (host quotas, not vCPUs).


def quota_class(instance_type: str) -> QuotaClass | None:
    """The vCPU quota class of ``instance_type`` (e.g. g5.xlarge -> G and VT), or None."""
    match = re.match(r"[a-z]+", instance_type)
    prefix = match.group(0) if match else ""
    if prefix in _FAMILY_CLASS:
        return QUOTA_CLASSES[_FAMILY_CLASS[prefix]]
    if prefix and prefix not in _NOT_QUOTA_CLASSED and prefix[0] in "acdhimrtz":
        return QUOTA_CLASSES["standard"]
    return None


@dataclass
class QuotaNeed:
    """vCPUs the spec may run under one quota code, and which groups need them."""

    code: str
    quota_name: str
    vcpus: int = 0
    parts: list[str] = field(default_factory=list)


def vcpu_needs(
    spec: ClusterSpec, vcpus_by_type: dict[str, int]
) -> tuple[list[QuotaNeed], list[Check]]:
    """vCPUs needed per quota code, in the order groups first need them, and a FAIL for each
    type whose class has no quota for its group's market.

    A group may get any of its types, so it needs ``count x`` the largest vCPU count among its
    types; a group whose types span two classes needs that for each class it spans (it could
    get all its instances from either). An elastic group counts its ``max_size``: the data-tier
    controller may grow it that far.
    """
    needs: dict[str, QuotaNeed] = {}
    problems: list[Check] = []
    for group in spec.groups:
        by_code: dict[str, list[str]] = {}
        for t in group.instance_types:
            cls = quota_class(t)
            code = cls.code(group.market) if cls else None
            if cls is None or code is None:
                what = f"class {cls.name}" if cls else "no known vCPU quota class"
                problems.append(
                    Check(
                        f"vCPU quota ({group.name}, {t})",
                        Status.FAIL,
                        f"{t} ({what}) has no {group.market.value} vCPU quota in "
                        "training/preflight/quotas.py QUOTA_CLASSES",
                        f"remove {t} from group '{group.name}' or change the group's market; "
                        "if AWS sells it that way, add its quota code to QUOTA_CLASSES",
                    )
                )
                continue
            by_code.setdefault(code, []).append(t)
            needs.setdefault(code, QuotaNeed(code, cls.quota_name(group.market)))
        for code, types in by_code.items():
            per_instance = max(vcpus_by_type[t] for t in types)
            needs[code].vcpus += group.max_size * per_instance
            listed = ", ".join(f"{t} {vcpus_by_type[t]}" for t in types)
            size = (
                f"{group.max_size} (elastic {group.min_size}-{group.max_size}, at most)"
                if group.elastic
                else str(group.count)
            )
            needs[code].parts.append(f"{group.name} {size} x {per_instance} (largest of: {listed})")
    return list(needs.values()), problems


def describe_vcpus(ec2: Any, instance_types: Sequence[str]) -> dict[str, int]:
    """Default vCPUs per instance type, from one DescribeInstanceTypes request (paged)."""
    out: dict[str, int] = {}
    for page in _pages(ec2.describe_instance_types, InstanceTypes=list(instance_types)):
        for it in page.get("InstanceTypes", []):
            out[it["InstanceType"]] = int(it["VCpuInfo"]["DefaultVCpus"])
    return out


def check_vcpu_quotas(spec: ClusterSpec, ec2: Any, service_quotas: Any, region: str) -> list[Check]:
    """One row per quota code the spec uses: needed vCPUs against the quota's value."""
    types = _spec_types(spec)
    try:
        vcpus = describe_vcpus(ec2, types)
    except AWS_ERRORS as e:
        return [failure("vCPU quotas", e)]
    missing = [t for t in types if t not in vcpus]
    if missing:
        return [
            Check(
                "vCPU quotas",
                Status.FAIL,
                f"DescribeInstanceTypes in {region} returned no data for {', '.join(missing)}",
                "remove those types from the spec or choose a region that offers them",
            )
        ]
    needs, rows = vcpu_needs(spec, vcpus)
    for need in needs:
        name = f"vCPU quota {need.code}"
        try:
            quota = service_quotas.get_service_quota(ServiceCode="ec2", QuotaCode=need.code)
        except ClientError as e:
            row = failure(name, e)
            if _code(e) == "NoSuchResourceException":
                # The code is not a quota of this region (or AWS retired it).
                row = Check(
                    name,
                    Status.FAIL,
                    row.detail,
                    f"find the {need.quota_name} quota in the Service Quotas console for "
                    f"{region} (EC2) and correct its code in "
                    "training/preflight/quotas.py QUOTA_CLASSES",
                )
            rows.append(row)
            continue
        except AWS_ERRORS as e:
            rows.append(failure(name, e))
            continue
        value = float(quota["Quota"]["Value"])
        detail = (
            f"{need.quota_name}: needs {need.vcpus} vCPUs ({'; '.join(need.parts)}), "
            f"quota {value:g}. Current usage is not known to this check: other instances and "
            "open Spot requests in the region count against the same quota"
        )
        if value >= need.vcpus:
            rows.append(Check(name, Status.PASS, detail))
        else:
            rows.append(
                Check(
                    name,
                    Status.FAIL,
                    detail,
                    f"request an increase of quota {need.code} ({need.quota_name}) to at least "
                    f"{need.vcpus} vCPUs plus what else runs there: aws service-quotas "
                    f"request-service-quota-increase --service-code ec2 --quota-code {need.code} "
                    f"--desired-value {need.vcpus} --region {region}",
                )
            )
    return rows
