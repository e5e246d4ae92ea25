"""``hetero spec check``: validate a cluster spec and print what it describes."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from training.common.s3_init import is_s3_init
from training.instance_types import PRICES_AS_OF, PRICES_REGION
from training.network_cost import network_cost_line
from training.prices import offline_prices, price_lines
from training.spec import PLACEMENT_WARNING_FIX, load_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["check"], help="check: validate and summarise")
    parser.add_argument("--spec", default="cluster.toml", help="cluster spec (TOML)")


def s3_init_line(init: str) -> str:
    """What happens to an ``s3://`` init (spec check asks AWS nothing: the URI as given)."""
    return (
        f"job.model.init {init} will be copied to <checkpoint prefix>/init/<sha256>/ when the "
        "job starts (hetero job start, hetero sagemaker submit: read with HeadObject, or "
        "ListObjectsV2 for a folder, then copied server-side with your credentials, once per "
        "version of it; an init under the checkpoint prefix is read where it is), and the job "
        "reads that copy; the job cdk deploy starts reads it where it is (the stack grants the "
        "instance role s3:GetObject on its folder)"
    )


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    init_line = None
    if is_s3_init(spec.job.model.init):
        init_line = s3_init_line(str(spec.job.model.init).strip())
    elif spec.job.model.init:
        # Local weights (and a timm: init, through the Hugging Face cache) are read now, so a
        # bad init fails here, before anything is deployed; an s3:// one is read where the job
        # starts (spec check asks AWS nothing). Deferred: torch and timm load only for such specs.
        from training.trainer.model import check_init

        weights = check_init(spec)  # SpecError: reported by training/cli.py like any problem
        if weights is not None and weights.hub is not None:
            init_line = (
                f"job.model.init {weights.hub.describe()}; hetero job start and hetero "
                "sagemaker submit stage it into the checkpoint bucket (init/<sha256>/), cdk "
                "deploy as a CDK asset, for instances without internet; hetero local reads it "
                "from the cache"
            )
    priced = offline_prices(spec)  # offline: spec check never asks AWS
    table = Table(title=f"{spec.name} ({spec.source})")
    for col in ("group", "role", "instance types", "count", "market", "EFA", "ranks", "max USD/h"):
        table.add_column(col)
    for g, price in zip(spec.groups, priced.prices, strict=True):
        table.add_row(
            g.name,
            g.role.value,
            ", ".join(g.instance_types),
            # An elastic group: where it starts, and the data-tier controller's min-max.
            f"{g.count} ({g.min_size}-{g.max_size})" if g.elastic else str(g.count),
            g.market.value,
            f"{g.efa.value} ({'yes' if g.use_efa else 'no'})",
            str(g.ranks_per_instance * g.count) if g.role.value == "trainer" else "-",
            f"{price.group_usd_per_hour:.2f}",
        )
    console = Console()
    console.print(table)
    job = spec.job
    console.print(
        f"model {job.model.name}, batch {job.batch_size}/rank x {spec.world_size} ranks, "
        f"{job.parallelism.strategy.value}, dataset {job.dataset.source.value}, "
        f"augmentation {job.augmentation.describe()}; cluster {spec.usd_per_hour():.2f} USD/h"
    )
    # A line of its own, not a column: the table already fills 80 columns.
    console.print(
        "placement: "
        + ", ".join(
            f"{g.name} {'cluster' if g.uses_cluster_placement else 'none'}" for g in spec.groups
        ),
        markup=False,
    )
    # What job.max_usd bounds, priced offline; `hetero job start` records the day's prices.
    console.print(
        f"prices at their most (what job.max_usd bounds; the catalogue's are {PRICES_REGION} "
        f"On-Demand list prices of {PRICES_AS_OF}, Spot = {job.prices.spot_price_ratio:g} x "
        "On-Demand; hetero job start records the day's prices from AWS instead):",
        markup=False,
    )
    for line in price_lines(priced.prices):
        console.print(f"  {line}", markup=False, highlight=False)
    console.print(
        "not in job.max_usd: EBS root volumes (billed per GB-month while they exist), data "
        "transfer, and the network stack's interface endpoints:",
        markup=False,
    )
    # The one cost that does not end with the job: the network stack's interface endpoints.
    console.print(network_cost_line(spec, args.spec), markup=False)
    if init_line is not None:
        console.print(init_line, markup=False, highlight=False, soft_wrap=True)  # a path
    # Advice, not errors: the spec is valid and deploys; the exit code stays 0.
    for g in spec.groups:
        if g.placement_warning:
            console.print(
                f"warning: {g.placement_warning}; {PLACEMENT_WARNING_FIX}",
                style="yellow",
                markup=False,
            )
    if spec.window_warning:
        console.print(f"warning: {spec.window_warning}", style="yellow", markup=False)
    return 0
