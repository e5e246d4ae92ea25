"""``hetero preflight``: check an AWS account and region before ``cdk deploy`` spends anything.

What a deploy of the spec needs and what would stop it only after minutes of CloudFormation
(or leave Auto Scaling groups retrying forever) is checked up front with the user's credentials,
read-only:

1. vCPU quotas (Service Quotas), Spot and On-Demand, per instance family class;
2. the AZ that ``availability_zone_index`` selects, and that every group's types are offered there;
3. the public SSM parameters that name the AMIs resolve in the region;
4. the Spot placement score of that AZ for each Spot group (advisory);
5. the CDK bootstrap stack exists and is recent enough for the synthesized templates;
6. each group that uses a cluster placement group lists one instance type, as AWS advises
   (advisory, from the spec alone: no AWS call).

Each check is a function of boto3 clients that returns ``Check`` rows; any AWS error becomes that
check's FAIL with its error code and the fix (for a missing permission: the IAM action), never a
traceback. Exit code: 0 when nothing failed (warnings allowed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError
from botocore.parsers import ResponseParserError

from training.aws_tags import DATAPREP_AMI_PARAMETER, TRAINER_AMI_PARAMETER
from training.spec import (
    PLACEMENT_WARNING_FIX,
    ClusterSpec,
    InstanceGroup,
    Market,
    Role,
    load_spec,
)

log = logging.getLogger(__name__)


CDK_BOOTSTRAP_STACK = "CDKToolkit"
# The default bootstrap qualifier (cdk.json sets no "@aws-cdk/core:bootstrapQualifier"). Every
# synthesized template carries a CheckBootstrapVersion rule that reads this parameter and refuses
# versions 1-5 ("CDK bootstrap stack version 6 required"), as `npx cdk synth` of this app shows.
CDK_BOOTSTRAP_VERSION_PARAMETER = "/cdk-bootstrap/hnb659fds/version"
CDK_MIN_BOOTSTRAP_VERSION = 6

LOW_PLACEMENT_SCORE = 3
"""A Spot placement score at or below this (scale 1-10) is a warning."""
_MAX_PAGES = 20
"""Bound on NextToken pages per call (the requests here are small: a page or two at most)."""

# IAM action per API operation this module calls: named in the fix when a call is denied.
IAM_ACTIONS: dict[str, str] = {
    "GetCallerIdentity": "sts:GetCallerIdentity",
    "DescribeInstanceTypes": "ec2:DescribeInstanceTypes",
    "GetServiceQuota": "servicequotas:GetServiceQuota",
    "DescribeAvailabilityZones": "ec2:DescribeAvailabilityZones",
    "DescribeSubnets": "ec2:DescribeSubnets",
    "DescribeInstanceTypeOfferings": "ec2:DescribeInstanceTypeOfferings",
    "GetSpotPlacementScores": "ec2:GetSpotPlacementScores",
    "GetParameters": "ssm:GetParameters",
    "GetParameter": "ssm:GetParameter",
    "DescribeStacks": "cloudformation:DescribeStacks",
}
AWS_ERRORS = (ClientError, BotoCoreError, ResponseParserError)
"""What a call can raise when AWS (or the endpoint) says no or answers garbage; each becomes a
FAIL row. ResponseParserError is not a BotoCoreError."""
_ACCESS_DENIED = {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation"}
_BAD_CREDENTIALS = {
    "AuthFailure",
    "ExpiredToken",
    "ExpiredTokenException",
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "UnrecognizedClientException",
}
_CREDENTIALS_FIX = (
    "configure AWS credentials for the target account: AWS_PROFILE=... (aws configure / "
    "aws sso login) or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY[/AWS_SESSION_TOKEN]"
)


class Status(StrEnum):
    PASS = "PASS"
    WARN = "WARN"
    """Advisory: the deploy can go on, but may be slow to get capacity or miss a type."""
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    """One row of the preflight table."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    """What to do about a FAIL or WARN (empty for PASS)."""


# --------------------------------------------------------------------------------------------
# vCPU quotas.


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
                        "training/preflight.py QUOTA_CLASSES",
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
                    f"{region} (EC2) and correct its code in training/preflight.py QUOTA_CLASSES",
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


# --------------------------------------------------------------------------------------------
# The availability zone and what it offers.


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


# --------------------------------------------------------------------------------------------
# AMI parameters and the CDK bootstrap stack.


def check_ami_parameters(spec: ClusterSpec, ssm: Any, region: str) -> list[Check]:
    """The public AMI parameters the spec's roles use resolve in the region (one row each)."""
    wanted = {Role.TRAINER: TRAINER_AMI_PARAMETER, Role.DATAPREP: DATAPREP_AMI_PARAMETER}
    roles = [r for r in (Role.TRAINER, Role.DATAPREP) if any(g.role is r for g in spec.groups)]
    names = [wanted[r] for r in roles]
    try:
        reply = ssm.get_parameters(Names=names)
    except AWS_ERRORS as e:
        return [failure("AMI parameters", e)]
    values = {p["Name"]: p.get("Value", "") for p in reply.get("Parameters", [])}
    invalid = set(reply.get("InvalidParameters", []))
    rows = []
    for role, param in zip(roles, names, strict=True):
        name = f"AMI parameter ({role.value})"
        if param in values and param not in invalid:
            rows.append(Check(name, Status.PASS, f"{param} = {values[param]}"))
        else:
            rows.append(
                Check(
                    name,
                    Status.FAIL,
                    f"{param} does not resolve in {region}",
                    f"choose a region where the public parameter exists (aws ssm get-parameters "
                    f"--names {param} --region REGION), or change the parameter in "
                    "training/preflight.py and infra",
                )
            )
    return rows


def check_cdk_bootstrap(cloudformation: Any, ssm: Any, account: str, region: str) -> list[Check]:
    """The CDKToolkit stack exists in a usable state, and its version is one the templates
    accept."""
    bootstrap = f"npx cdk bootstrap aws://{account}/{region}"
    rows: list[Check] = []
    try:
        stacks = cloudformation.describe_stacks(StackName=CDK_BOOTSTRAP_STACK).get("Stacks", [])
        status = stacks[0]["StackStatus"] if stacks else "NONE"
    except ClientError as e:
        if _code(e) == "ValidationError" and "does not exist" in str(e):
            status = "NONE"
        else:
            return [failure("CDK bootstrap stack", e)]
    except (BotoCoreError, ResponseParserError) as e:
        return [failure("CDK bootstrap stack", e)]
    if status == "NONE":
        return [
            Check(
                "CDK bootstrap stack",
                Status.FAIL,
                f"no {CDK_BOOTSTRAP_STACK} stack in {account}/{region}",
                f"run `{bootstrap}` (once per account and region)",
            )
        ]
    if status in ("DELETE_COMPLETE", "ROLLBACK_COMPLETE"):
        rows.append(
            Check(
                "CDK bootstrap stack",
                Status.FAIL,
                f"{CDK_BOOTSTRAP_STACK} is {status} (unusable)",
                f"aws cloudformation delete-stack --stack-name {CDK_BOOTSTRAP_STACK} "
                f"--region {region}, then `{bootstrap}`",
            )
        )
    elif not status.endswith("_COMPLETE"):
        rows.append(
            Check(
                "CDK bootstrap stack",
                Status.FAIL,
                f"{CDK_BOOTSTRAP_STACK} is {status}",
                "wait for the stack operation to finish"
                if status.endswith("_IN_PROGRESS")
                else f"see its events in the CloudFormation console, then `{bootstrap}`",
            )
        )
    else:
        rows.append(Check("CDK bootstrap stack", Status.PASS, f"{CDK_BOOTSTRAP_STACK} {status}"))

    name = "CDK bootstrap version"
    try:
        raw = ssm.get_parameter(Name=CDK_BOOTSTRAP_VERSION_PARAMETER)["Parameter"]["Value"]
    except ClientError as e:
        if _code(e) == "ParameterNotFound":
            rows.append(
                Check(
                    name,
                    Status.FAIL,
                    f"{CDK_BOOTSTRAP_VERSION_PARAMETER} does not exist",
                    f"run `{bootstrap}` (the stack was bootstrapped with a custom qualifier or "
                    "is incomplete)",
                )
            )
        else:
            rows.append(failure(name, e))
        return rows
    except (BotoCoreError, ResponseParserError) as e:
        rows.append(failure(name, e))
        return rows
    version = int(raw) if str(raw).isdigit() else -1
    detail = f"{CDK_BOOTSTRAP_VERSION_PARAMETER} = {raw} (templates need >= "
    detail += f"{CDK_MIN_BOOTSTRAP_VERSION})"
    if version >= CDK_MIN_BOOTSTRAP_VERSION:
        rows.append(Check(name, Status.PASS, detail))
    else:
        rows.append(
            Check(name, Status.FAIL, detail, f"run `{bootstrap}` with this repo's pinned CLI")
        )
    return rows


def check_credentials(sts: Any) -> tuple[Check, str | None]:
    """Who the checks run as; without working credentials no other check can run."""
    try:
        me = sts.get_caller_identity()
    except AWS_ERRORS as e:
        return failure("AWS credentials", e), None
    account = str(me["Account"])
    return Check("AWS credentials", Status.PASS, f"{me['Arn']} (account {account})"), account


# --------------------------------------------------------------------------------------------
# All of it.


@dataclass(frozen=True)
class Clients:
    ec2: Any
    service_quotas: Any
    ssm: Any
    cloudformation: Any
    sts: Any


def build_clients(session: Any) -> Clients:
    """Clients of one boto3 session (each honours ``AWS_ENDPOINT_URL`` as boto3 does)."""
    return Clients(
        ec2=session.client("ec2"),
        service_quotas=session.client("service-quotas"),
        ssm=session.client("ssm"),
        cloudformation=session.client("cloudformation"),
        sts=session.client("sts"),
    )


def run_checks(spec: ClusterSpec, clients: Clients, region: str) -> list[Check]:
    """Every check, in table order. Never raises for an AWS error: it becomes a FAIL row."""
    who, account = check_credentials(clients.sts)
    if account is None:
        return [who]
    rows = [who]
    rows += check_vcpu_quotas(spec, clients.ec2, clients.service_quotas, region)
    try:
        zones = cloudformation_azs(clients.ec2)
    except AWS_ERRORS as e:
        rows.append(failure("availability zone", e))
        zones = []
    else:
        rows.append(check_availability_zone(spec, zones, region))
    if spec.availability_zone_index < len(zones):
        zone = zones[spec.availability_zone_index]
        rows += _guarded(
            f"offered in {zone.name}", lambda: check_offerings(spec, clients.ec2, zone)
        )
        rows += check_placement_scores(spec, clients.ec2, region, zones, zone)
    else:
        rows.append(
            Check(
                "offerings and Spot placement",
                Status.FAIL,
                "not checked: the availability zone is unknown (see 'availability zone')",
                "fix the availability zone row first",
            )
        )
    rows += check_ami_parameters(spec, clients.ssm, region)
    rows += check_cdk_bootstrap(clients.cloudformation, clients.ssm, account, region)
    rows += check_cluster_placement(spec)
    return rows


def failure(name: str, error: Exception) -> Check:
    """A FAIL row for an AWS error: its code and message, and what to do about it."""
    if isinstance(error, NoCredentialsError):
        return Check(name, Status.FAIL, "NoCredentials: no AWS credentials found", _CREDENTIALS_FIX)
    if isinstance(error, NoRegionError):
        return Check(name, Status.FAIL, "NoRegion: no region", "pass --region or set AWS_REGION")
    if isinstance(error, ClientError):
        code = _code(error)
        message = error.response.get("Error", {}).get("Message", "")
        action = IAM_ACTIONS.get(error.operation_name, error.operation_name)
        detail = f"{code} on {error.operation_name}: {message}"
        if code in _ACCESS_DENIED:
            fix = f"allow {action} to the identity running preflight (an IAM policy statement)"
        elif code in _BAD_CREDENTIALS:
            fix = _CREDENTIALS_FIX
        else:
            fix = f"fix what the error says, then run preflight again (the call: {action})"
        return Check(name, Status.FAIL, detail, fix)
    # No usable answer at all (endpoint unreachable or not AWS, bad configuration).
    return Check(
        name,
        Status.FAIL,
        f"{type(error).__name__}: {error}",
        "check the network, the region and AWS_ENDPOINT_URL",
    )


def _guarded(name: str, fn: Callable[[], list[Check]]) -> list[Check]:
    try:
        return fn()
    except AWS_ERRORS as e:
        return [failure(name, e)]


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", "Unknown"))


def _spec_types(spec: ClusterSpec) -> list[str]:
    """Every instance type of the spec, once, in spec order."""
    return list(dict.fromkeys(t for g in spec.groups for t in g.instance_types))


def _pages(call: Callable[..., dict[str, Any]], **kwargs: Any) -> Iterator[dict[str, Any]]:
    """Pages of a NextToken-paged call, bounded to ``_MAX_PAGES``."""
    token: str | None = None
    for _ in range(_MAX_PAGES):
        page = call(**kwargs, **({"NextToken": token} if token else {}))
        yield page
        token = page.get("NextToken")
        if not token:
            return
    log.warning("stopped after %d pages of %s", _MAX_PAGES, getattr(call, "__name__", call))


# --------------------------------------------------------------------------------------------
# The command.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", default="cluster.toml", help="cluster spec (TOML)")
    parser.add_argument(
        "--region", help="AWS region to check (default: AWS_REGION / the profile's region)"
    )


def render(rows: Iterable[Check]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    style = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red"}
    table = Table("check", "result", "detail", "fix", title="hetero preflight")
    rows = list(rows)
    for r in rows:
        # Text, not markup: AWS messages and fixes may hold brackets ("[/AWS_SESSION_TOKEN]").
        table.add_row(
            Text(r.name), Text(r.status.value, style=style[r.status]), Text(r.detail), Text(r.fix)
        )
    console = Console()
    console.print(table)
    counts = {s: sum(1 for r in rows if r.status is s) for s in Status}
    console.print(
        f"{counts[Status.PASS]} passed, {counts[Status.WARN]} warning(s), "
        f"{counts[Status.FAIL]} failed"
    )


def run(args: argparse.Namespace) -> int:
    import boto3

    spec = load_spec(args.spec)
    session = boto3.Session(region_name=args.region)
    region = session.region_name
    if not region:
        rows = [
            Check(
                "region",
                Status.FAIL,
                "no region given and none configured",
                "pass --region (e.g. us-east-1) or set AWS_REGION",
            )
        ]
    else:
        rows = run_checks(spec, build_clients(session), region)
    render(rows)
    return 1 if any(r.status is Status.FAIL for r in rows) else 0
