"""The plan's outputs: a rich table, plan.csv, plan.json and plan.png, all with the price date.

The CSV and JSON hold the same rows as the table (JSON adds every intermediate figure); the plot
shows expected samples per dollar against time to train, or, with an accuracy target, expected
USD to target against hours to target, with the Pareto front marked.
"""

from __future__ import annotations

import csv
import io
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from training.planner.evaluate import Plan, PlanRow, pareto_front

COLUMNS = (
    "rank",
    "configuration",
    "dataprep",
    "samples_per_s_nominal",
    "samples_per_s_expected",
    "efficiency",
    "usd_per_hour",
    "samples_per_usd_nominal",
    "samples_per_usd_expected",
    "hours_to_train",
    "usd_to_train",
    "samples_to_target",
    "hours_to_target",
    "usd_to_target",
    "dataprep_vcpus_per_gpu",
    "network_bound",
    "checkpoint_every_steps",
    "placement_score",
    "availability_zone",
    "availability_zone_index",
    "throughput_source",
    "trainer_price_source",
    "dataprep_price_source",
    "notes",
)


def row_record(rank: int, r: PlanRow) -> dict[str, Any]:
    """One row's flat record (the CSV columns)."""
    placement = r.placement
    return {
        "rank": rank,
        "configuration": r.label,
        "dataprep": f"{r.dataprep.count} x {r.dataprep.instance_type} {r.dataprep.market.value}",
        "samples_per_s_nominal": round(r.nominal_samples_per_s, 2),
        "samples_per_s_expected": round(r.expected_samples_per_s, 2),
        "efficiency": round(r.preemption.efficiency, 5) if r.preemption else 1.0,
        "usd_per_hour": round(r.usd_per_hour, 4),
        "samples_per_usd_nominal": round(r.nominal_samples_per_usd, 1),
        "samples_per_usd_expected": round(r.expected_samples_per_usd, 1),
        "hours_to_train": None if r.hours_to_train is None else round(r.hours_to_train, 3),
        "usd_to_train": None if r.usd_to_train is None else round(r.usd_to_train, 2),
        "samples_to_target": r.samples_to_target,
        # Small targets cost cents and minutes: six decimals.
        "hours_to_target": None if r.hours_to_target is None else round(r.hours_to_target, 6),
        "usd_to_target": None if r.usd_to_target is None else round(r.usd_to_target, 6),
        "dataprep_vcpus_per_gpu": round(r.vcpus_per_gpu, 3),
        "network_bound": r.step.network_bound,
        "checkpoint_every_steps": r.interval_steps,
        "placement_score": placement.score if placement else None,
        "availability_zone": placement.zone if placement else None,
        "availability_zone_index": placement.zone_index if placement else None,
        "throughput_source": r.throughput.source,
        "trainer_price_source": r.trainer_price.source,
        "dataprep_price_source": r.dataprep.price.source,
        "notes": "; ".join(r.notes),
    }


def header_lines(plan: Plan) -> list[str]:
    w = plan.workload
    mode = "live" if plan.live else "offline"
    lines = [
        f"hetero plan, {plan.created.strftime('%Y-%m-%d %H:%M UTC')}, region {plan.region}, {mode}",
        f"model {w.model} ({w.params / 1e6:.1f} M params, {w.train_flops_per_sample / 1e9:.1f} "
        f"GFLOP/sample at {w.image_size} px), batch {w.batch_per_rank}/rank x "
        f"{w.grad_accum_steps} accumulation, {w.strategy.value}, {w.precision.value}, "
        f"augmentation {w.recipe}",
        f"samples to train: {w.samples_to_train if w.samples_to_train is not None else '-'} "
        f"({w.samples_note})",
    ]
    if plan.target is not None:
        lines.append(
            f"samples to target: {plan.target.samples:,}, {plan.target.description}; hours and "
            "USD to target at the expected samples/s"
        )
    lines += [f"prices: {s}" for s in plan.price_sources]
    lines.append(
        "placement scores: "
        + ("GetSpotPlacementScores, single AZ" if plan.live else "none (offline: not invented)")
    )
    return lines


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fmt_small(value: float | None) -> str:
    """Two decimals, or three significant digits below 1 (a small target costs cents)."""
    if value is None:
        return "-"
    return format(value, ",.2f") if value >= 1 else format(value, ".3g")


def ranked_by(plan: Plan) -> str:
    if plan.target is None:
        return "expected samples per dollar"
    return "expected USD to target"


def print_table(plan: Plan, console: Console | None = None) -> None:
    # Not a terminal (a pipe, a log file): wide enough that rows do not wrap.
    console = console or Console(width=None if sys.stdout.isatty() else 180)
    for line in header_lines(plan):
        console.print(Text(line))
    table = Table(title=f"ranked by {ranked_by(plan)}")
    with_target = plan.target is not None
    target_cols = ("USD to target", "h to target") if with_target else ()
    for col in (
        "#",
        "configuration",
        "dataprep",
        "samples/s",
        "expected",
        "USD/h",
        *target_cols,
        "samples/$",
        "expected samples/$",
        "hours",
        "USD",
        "vCPU/GPU",
        "ckpt steps",
        "score (AZ)",
    ):
        table.add_column(col, overflow="fold")
    front = pareto_front(plan.rows)
    for i, r in enumerate(plan.rows):
        placement = r.placement
        score = (
            f"{placement.score} ({placement.zone}, #{placement.zone_index})"
            if placement and placement.score is not None
            else "-"
        )
        name = r.label + (" *" if i in front else "") + (" [net]" if r.step.network_bound else "")
        table.add_row(
            str(i + 1),
            Text(name),
            Text(f"{r.dataprep.count} x {r.dataprep.instance_type}"),
            f"{r.nominal_samples_per_s:,.0f}",
            f"{r.expected_samples_per_s:,.0f}",
            f"{r.usd_per_hour:.3f}",
            *((_fmt_small(r.usd_to_target), _fmt_small(r.hours_to_target)) if with_target else ()),
            f"{r.nominal_samples_per_usd:,.0f}",
            f"{r.expected_samples_per_usd:,.0f}",
            _fmt(r.hours_to_train, ".2f"),
            _fmt(r.usd_to_train, ",.2f"),
            f"{r.vcpus_per_gpu:.1f}",
            str(r.interval_steps),
            score,
        )
    console.print(table)
    front_of = "hours vs USD to target" if with_target else "time to train vs samples per dollar"
    console.print(Text(f"* Pareto front ({front_of}); [net] network-bound"))
    # One line per distinct note, naming the rows it applies to (many rows share one).
    rows_of: dict[str, list[str]] = {}
    for i, r in enumerate(plan.rows):
        for note in r.notes:
            rows_of.setdefault(note, []).append(str(i + 1))
    for note, ranks in rows_of.items():
        console.print(Text(f"  #{', #'.join(ranks)}: {note}"))
    for e in plan.excluded:
        console.print(Text(f"excluded: {e.label}: {e.reason}"))
    for note in plan.notes:
        console.print(Text(f"note: {note}"))


def to_csv(plan: Plan) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[*COLUMNS, "excluded_reason", "plan_date"])
    writer.writeheader()
    date = plan.created.strftime("%Y-%m-%dT%H:%MZ")
    for i, r in enumerate(plan.rows):
        writer.writerow({**row_record(i + 1, r), "excluded_reason": "", "plan_date": date})
    for e in plan.excluded:
        writer.writerow({"configuration": e.label, "excluded_reason": e.reason, "plan_date": date})
    return out.getvalue()


def to_json(plan: Plan) -> dict[str, Any]:
    w = plan.workload
    front = pareto_front(plan.rows)
    rows = []
    for i, r in enumerate(plan.rows):
        record = row_record(i + 1, r)
        record["pareto"] = i in front
        record["gpus"] = r.gpus
        record["gpu_samples_per_s"] = r.throughput.samples_per_s
        record["step_s"] = {
            "compute": r.step.compute_s,
            "all_reduce_inter_node": r.step.inter_node_s,
            "all_reduce_intra_node": r.step.intra_node_s,
            "data": r.step.data_s,
            "step": r.step.step_s,
        }
        if r.preemption:
            p = r.preemption
            record["preemption"] = {
                "band": p.band,
                "interruptions_per_instance_month": p.rate_per_month,
                "mean_time_between_interruptions_s": p.mtbi_s,
                "checkpoint_s": p.checkpoint_s,
                "durable_lag_s": p.durable_lag_s,
                "recovery_s": p.recovery_s,
                "interval_s": p.interval_s,
            }
        rows.append(record)
    return {
        "created": plan.created.isoformat(),
        "region": plan.region,
        "live": plan.live,
        "price_sources": plan.price_sources,
        "ranked_by": "usd_to_target" if plan.target else "samples_per_usd_expected",
        "target": plan.target.record() if plan.target else None,
        "workload": {
            "model": w.model,
            "params": w.params,
            "train_flops_per_sample": w.train_flops_per_sample,
            "image_size": w.image_size,
            "batch_per_rank": w.batch_per_rank,
            "grad_accum_steps": w.grad_accum_steps,
            "strategy": w.strategy.value,
            "precision": w.precision.value,
            "augmentation": w.recipe,
            "samples_to_train": w.samples_to_train,
            "samples_note": w.samples_note,
        },
        "measured": {
            "augmentation": {
                k: {"images_per_vcpu": v[0], "at_px": v[1], "source": v[2]}
                for k, v in (
                    (recipe, plan.measured.augment_rate(recipe, w.image_size))
                    for recipe in plan.measured.augment_images_per_vcpu
                )
            },
            "checkpoint_s3_s": list(plan.measured.checkpoint_s3_s),
            "checkpoint_async_stall_s": list(plan.measured.checkpoint_async_stall_s),
        },
        "ranked": rows,
        "excluded": [{"configuration": e.label, "reason": e.reason} for e in plan.excluded],
        "notes": plan.notes,
    }


def plot(plan: Plan, path: Path) -> None:
    """Expected samples per dollar against time to train, or, with a target, expected USD to
    target against hours to target; the Pareto front joined and marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = plan.target
    known = all(r.hours_to_train is not None for r in plan.rows)

    def x_of(r: PlanRow) -> float:
        hours = r.hours_to_target if target else r.hours_to_train
        if hours is not None:
            return hours
        return 1e6 / r.expected_samples_per_s / 3600

    def y_of(r: PlanRow) -> float:
        if target:
            assert r.usd_to_target is not None
            return r.usd_to_target
        return r.expected_samples_per_usd

    fig, ax = plt.subplots(figsize=(9, 6))
    front = pareto_front(plan.rows)
    for i, r in enumerate(plan.rows):
        on = i in front
        ax.scatter(
            x_of(r),
            y_of(r),
            s=70 if on else 30,
            marker="o" if on else "x",
            color="tab:red" if on else "tab:gray",
        )
        ax.annotate(
            r.label,
            (x_of(r), y_of(r)),
            fontsize=7,
            xytext=(4, 3),
            textcoords="offset points",
        )
    pts = sorted((x_of(plan.rows[i]), y_of(plan.rows[i])) for i in front)
    if pts:
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], color="tab:red", lw=1, label="Pareto front"
        )
        ax.legend()
    ax.set_xscale("log")
    ax.margins(x=0.25, y=0.1)  # room for the labels at the edges
    title = (
        f"hetero plan {plan.created.strftime('%Y-%m-%d')} ({plan.region}, "
        f"{'live' if plan.live else 'offline'} prices)"
    )
    if target:
        ax.set_yscale("log")
        what = "best accuracy reached" if target.best else "target"
        ax.set_xlabel(f"expected hours to {what} ({target.samples:,} samples)")
        ax.set_ylabel(f"expected USD to {what}")
        title += "\n" + textwrap.fill(target.description, 110)
    else:
        ax.set_xlabel("hours to train" if known else "hours per million samples")
        ax.set_ylabel("expected samples per USD")
    ax.set_title(title, fontsize=9 if target else 10)
    ax.grid(True, which="both", alpha=0.3)
    fig.text(0.01, 0.01, "; ".join(plan.price_sources)[:180], fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(plan: Plan, out: Path) -> list[Path]:
    """plan.csv, plan.json and plan.png under ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "plan.csv", out / "plan.json", out / "plan.png"]
    paths[0].write_text(to_csv(plan))
    paths[1].write_text(json.dumps(to_json(plan), indent=2) + "\n")
    plot(plan, paths[2])
    return paths
