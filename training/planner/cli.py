"""``hetero plan``: choose the cluster by expected samples per dollar under preemption.

Writes OUT/plan.csv, OUT/plan.json and OUT/plan.png and prints the ranked table. With an
accuracy target (its samples given, or read from a finished run's summary.json), every row also
gets the expected hours and USD to reach it, and rows rank by that USD. Live prices
and Spot placement scores are used where AWS credentials exist (read-only calls:
pricing:GetProducts, ec2:DescribeSpotPriceHistory, ec2:GetSpotPlacementScores,
ec2:DescribeAvailabilityZones, ec2:DescribeSubnets); otherwise, or with --offline, the dated
offline tables, and no placement scores. Exit code 0, or 2 with a message for what to fix.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.common.aws import client
from training.common.s3 import is_s3_uri
from training.data.manifest import load_manifest
from training.planner import report, specfile
from training.planner.candidates import Candidate, candidates, check_region
from training.planner.errors import PlanError
from training.planner.evaluate import DataprepPolicy, Plan, rank, spot_score_groups
from training.planner.facts import Facts
from training.planner.placement import Placement, best_placement, zones
from training.planner.prices import PriceBook, live_on_demand, live_spot
from training.planner.results import RESULTS_DIR, load_measured
from training.planner.target import Target, from_run, from_samples
from training.planner.workload import DatasetRead, dataset_read_of, workload_from_spec
from training.prices import pricing_client
from training.spec import ClusterSpec, DatasetSource, Efa, Market, load_spec

log = logging.getLogger(__name__)

DEFAULT_REGION = "us-east-1"
"""Where no region is given or configured: the region of the offline price table."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", default="cluster.toml", help="cluster spec (TOML)")
    parser.add_argument("--out", default="runs/plan", help="folder for plan.csv/.json/.png")
    parser.add_argument(
        "--offline", action="store_true", help="no AWS calls: offline prices, no placement scores"
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="CONFIG",
        help="configurations 'N x TYPE [spot|on-demand]' (optionally '+ M x CPU_TYPE [market]' "
        "for a fixed dataprep group); default: the spec's trainer types x counts 1, 2, 4 x both "
        "markets",
    )
    parser.add_argument(
        "--region", help=f"AWS region (default: AWS_REGION / profile, else {DEFAULT_REGION})"
    )
    parser.add_argument(
        "--samples", type=int, help="samples to train (default: from the spec's steps or epochs)"
    )
    parser.add_argument("--write-spec", metavar="FILE", help="write the winner into a spec copy")
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--samples-to-target",
        type=int,
        metavar="N",
        help="training samples needed to reach the target accuracy: adds expected hours and USD "
        "to target, and ranks by that USD",
    )
    target.add_argument(
        "--from-run",
        metavar="PATH",
        help="read the samples to target from a finished run's summary.json (or its folder)",
    )
    parser.add_argument(
        "--target",
        type=float,
        metavar="T",
        help="with --from-run: the accuracy target to use (default: the highest reached)",
    )
    parser.add_argument(
        "--results", default=str(RESULTS_DIR), help="benchmark results folder (measured figures)"
    )


def known_regions() -> set[str]:
    """Every region of every partition botocore knows for EC2 (offline: its endpoint data)."""
    import boto3

    session = boto3.Session()
    return {
        r
        for partition in session.get_available_partitions()
        for r in session.get_available_regions("ec2", partition_name=partition)
    }


def dataprep_policy(spec: ClusterSpec, facts: Facts) -> DataprepPolicy:
    """CPU types and market for the dataprep group: the spec's dataprep types first, then the
    planner's list; the market and EFA requirement of the spec's first dataprep group."""
    groups = spec.dataprep_groups
    types = [t for g in groups for t in g.instance_types] + list(facts.dataprep_types)
    return DataprepPolicy(
        types=tuple(dict.fromkeys(types)),
        market=groups[0].market if groups else Market.SPOT,
        efa_required=any(g.efa is Efa.ON for g in groups),
        group_name=groups[0].name if groups else "dataprep",
    )


def gather_live(
    ec2: Any,
    pricing: Any,
    found: Sequence[Candidate],
    policy: DataprepPolicy,
    prices: PriceBook,
    facts: Facts,
    region: str,
    now: datetime.datetime,
) -> tuple[dict[tuple[int, int], Placement], list[str]]:
    """Fill ``prices`` with live prices and score every Spot trainer group; notes for what fell
    back to offline data."""
    notes: list[str] = []
    zone_list, why = zones(ec2)
    if why:
        notes.append(f"no placement scores: {why}")
    placements: dict[tuple[int, int], Placement] = {}
    if zone_list:
        for key, types in spot_score_groups(found, facts).items():
            placements[key] = best_placement(ec2, types, key[1], region, zone_list)

    spot: list[str] = []
    on_demand: list[str] = []
    for c in found:
        for g in (c.trainer, c.dataprep):
            if g is not None:
                (spot if g.market is Market.SPOT else on_demand).append(g.instance_type)
    if not all(c.dataprep for c in found):
        (spot if policy.market is Market.SPOT else on_demand).extend(policy.types)
    spot_prices, spot_notes = live_spot(ec2, dict.fromkeys(spot), region, now)
    od_prices, od_notes = live_on_demand(pricing, dict.fromkeys(on_demand), region, now.date())
    prices.spot_live.update(spot_prices)
    prices.on_demand_live.update(od_prices)
    return placements, [*notes, *spot_notes, *od_notes]


def read_prepared_dataset(
    spec: ClusterSpec, *, offline: bool, notes: list[str]
) -> DatasetRead | None:
    """A prepared dataset's size from its manifest (local, or in S3 unless offline); None, with
    a note, when it cannot be read: the plan then leaves the S3 reads out."""
    dataset = spec.job.dataset
    if dataset.source is not DatasetSource.SHARDS or not dataset.path:
        return None
    if offline and is_s3_uri(dataset.path):
        notes.append(
            f"the prepared dataset's manifest ({dataset.path}) is in S3 and the plan is offline: "
            "its reads from S3 are left out"
        )
        return None

    try:
        manifest, _, _ = load_manifest(dataset.path, expected_sha256=dataset.manifest_sha256)
    except ValueError as e:
        notes.append(f"{e}: the dataset's reads from S3 are left out")
        return None
    return dataset_read_of(spec, manifest)


def make_plan(
    spec: ClusterSpec,
    compare: Sequence[str] | None,
    *,
    region: str,
    results_dir: Path = RESULTS_DIR,
    samples: int | None = None,
    ec2: Any = None,
    pricing: Any = None,
    now: datetime.datetime | None = None,
    facts: Facts | None = None,
    notes: Sequence[str] = (),
    target: Target | None = None,
    dataset_read: DatasetRead | None = None,
) -> Plan:
    """The ranked plan; live prices and scores when ``ec2`` and ``pricing`` clients are given;
    ranked by expected USD to ``target`` when one is given."""
    now = now or datetime.datetime.now(datetime.UTC)
    facts = facts or Facts()
    workload = workload_from_spec(spec, samples, dataset_read)
    found = candidates(spec, compare)
    policy = dataprep_policy(spec, facts)
    measured = load_measured(results_dir)
    prices = PriceBook(spec.job.prices, facts.catalog, region=region)
    all_notes = list(notes)
    placements = None
    live = ec2 is not None and pricing is not None
    if live:
        placements, live_notes = gather_live(
            ec2, pricing, found, policy, prices, facts, region, now
        )
        all_notes += live_notes
    rows, excluded = rank(
        found,
        workload,
        facts,
        measured,
        prices,
        policy,
        placements,
        trainer_efa_required=spec.trainer_group.efa is Efa.ON,
        samples_to_target=target.samples if target else None,
    )
    return Plan(
        rows=rows,
        excluded=excluded,
        workload=workload,
        region=region,
        live=live,
        price_sources=prices.sources(),
        created=now,
        measured=measured,
        prices=prices,
        dataprep_policy=policy,
        facts=facts,
        notes=all_notes,
        target=target,
    )


def accuracy_target(args: argparse.Namespace) -> Target | None:
    """The target from --samples-to-target or --from-run [--target], if either is given."""
    if args.target is not None and args.from_run is None:
        raise PlanError(
            "--target needs --from-run RUN/summary.json (the run's summary says how many samples "
            "reached it); to give the samples yourself, use --samples-to-target N"
        )
    if args.samples_to_target is not None:
        return from_samples(args.samples_to_target)
    if args.from_run is not None:
        return from_run(Path(args.from_run), args.target)
    return None


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except PlanError as e:
        print(f"hetero plan: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.samples is not None and args.samples < 1:
        raise PlanError(f"--samples must be at least 1, got {args.samples}")
    target = accuracy_target(args)
    spec = load_spec(args.spec)
    ec2 = pricing = None
    notes: list[str] = []
    region = args.region
    if args.offline:
        region = region or DEFAULT_REGION
    else:
        import boto3  # Deferred: only to resolve the configured region and credentials.

        session = boto3.Session(region_name=region)
        region = region or session.region_name or DEFAULT_REGION
        if session.get_credentials() is None:
            notes.append(
                "no AWS credentials found: offline prices and no placement scores (configure "
                "credentials for live ones, or pass --offline)"
            )
        else:
            ec2 = client("ec2", region=region)
            pricing = pricing_client()
    check_region(region, known_regions())
    dataset_read = read_prepared_dataset(spec, offline=args.offline or ec2 is None, notes=notes)
    plan = make_plan(
        spec,
        args.compare,
        region=region,
        results_dir=Path(args.results),
        samples=args.samples,
        ec2=ec2,
        pricing=pricing,
        notes=notes,
        target=target,
        dataset_read=dataset_read,
    )
    report.print_table(plan)
    paths = report.write_outputs(plan, Path(args.out))
    print("wrote " + ", ".join(str(p) for p in paths))
    if args.write_spec:
        specfile.write_spec(Path(args.spec), Path(args.write_spec), spec, plan)
        print(f"wrote {args.write_spec} (check it: hetero spec check --spec {args.write_spec})")
    return 0
