"""``hetero spec check``: validate a cluster spec and print what it describes."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from training.network_cost import network_cost_line
from training.spec import PLACEMENT_WARNING_FIX, load_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["check"], help="check: validate and summarise")
    parser.add_argument("--spec", default="cluster.toml", help="cluster spec (TOML)")


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    table = Table(title=f"{spec.name} ({spec.source})")
    for col in ("group", "role", "instance types", "count", "market", "EFA", "ranks", "USD/h"):
        table.add_column(col)
    for g in spec.groups:
        usd = g.count * spec.job.prices.hourly(g.instance_types[0], g.market)
        table.add_row(
            g.name,
            g.role.value,
            ", ".join(g.instance_types),
            # An elastic group: where it starts, and the data-tier controller's min-max.
            f"{g.count} ({g.min_size}-{g.max_size})" if g.elastic else str(g.count),
            g.market.value,
            f"{g.efa.value} ({'yes' if g.use_efa else 'no'})",
            str(g.ranks_per_instance * g.count) if g.role.value == "trainer" else "-",
            f"{usd:.2f}",
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
    # The one cost that does not end with the job: the network stack's interface endpoints.
    console.print(network_cost_line(spec, args.spec), markup=False)
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
