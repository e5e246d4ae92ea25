"""Every check in table order (``run_checks``) and the ``hetero preflight`` command."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from training.common.aws import client
from training.preflight.account import (
    check_ami_parameters,
    check_cdk_bootstrap,
    check_credentials,
)
from training.preflight.core import AWS_ERRORS, Check, Status, _guarded, failure
from training.preflight.quotas import check_vcpu_quotas
from training.preflight.zones import (
    check_availability_zone,
    check_cluster_placement,
    check_offerings,
    check_placement_scores,
    cloudformation_azs,
)
from training.spec import ClusterSpec, load_spec


@dataclass(frozen=True)
class Clients:
    ec2: Any
    service_quotas: Any
    ssm: Any
    cloudformation: Any
    sts: Any


def build_clients(region: str) -> Clients:
    """The clients for ``region`` (each honours ``AWS_ENDPOINT_URL`` as boto3 does)."""
    return Clients(
        ec2=client("ec2", region=region),
        service_quotas=client("service-quotas", region=region),
        ssm=client("ssm", region=region),
        cloudformation=client("cloudformation", region=region),
        sts=client("sts", region=region),
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", default="cluster.toml", help="cluster spec (TOML)")
    parser.add_argument(
        "--region", help="AWS region to check (default: AWS_REGION / the profile's region)"
    )


def render(rows: Iterable[Check]) -> None:
    # Deferred, as is boto3 in run: importing the package (the planner reuses its helpers, the
    # CLI reads add_arguments) loads neither rich nor boto3.
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
    import boto3  # Deferred, as is rich in render: only to resolve the configured region.

    spec = load_spec(args.spec)
    region = boto3.Session(region_name=args.region).region_name
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
        rows = run_checks(spec, build_clients(region), region)
    render(rows)
    return 1 if any(r.status is Status.FAIL for r in rows) else 0
