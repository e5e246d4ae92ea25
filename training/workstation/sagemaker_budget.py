"""A SageMaker job's budget: ``job.max_hours`` and ``job.max_usd`` kept by SageMaker itself.

``hetero sagemaker submit`` turns the spec's caps into the job's
``StoppingCondition.MaxRuntimeInSeconds``, the time SageMaker lets the job run, so no launcher
has to watch the clock: the smallest of

- ``--max-run`` (SageMaker's own default, 1 day, when not given);
- ``job.max_hours`` x 3600;
- ``job.max_usd`` / the job's price per hour x 3600, where the price is every instance group's
  ``count`` x SageMaker's On-Demand training rate of its ``ml.*`` type in the job's region, read
  from the Price List API (``prices.sagemaker_training_price``). A SageMaker group has a fixed
  count of one type, so that is the job at its most; managed Spot bills fewer seconds than it
  trains (AWS's saving: 1 - ``BillableTimeInSeconds`` / ``TrainingTimeInSeconds``,
  https://docs.aws.amazon.com/sagemaker/latest/dg/model-managed-spot-training.html), so the
  figure bounds a Spot job too.

Seconds are rounded down. With managed Spot, ``MaxRuntimeInSeconds`` counts the time the job
trains, not the time it waits for Spot capacity (``MaxWaitTimeInSeconds``, which is not billed).

When SageMaker's price cannot be read (no ``pricing:GetProducts``, no connection, or the Price
List lists none for the type in the region), a spec with ``job.max_usd`` is refused: the
project's offline catalogue holds EC2's rates, which are not SageMaker's, so no figure it has
would bound what SageMaker bills. The refusal names the fixes.

At the limit SageMaker sends the containers SIGTERM and ends the job 120 seconds later
(https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_StoppingCondition.html); the
launcher forwards it and the trainer saves a checkpoint at its next step boundary within
``hetero launch --grace`` (90 s). The job ends ``Stopped`` with the secondary status
``MaxRuntimeExceeded``
(https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_DescribeTrainingJob.html), and
``hetero sagemaker submit --resume <job>`` continues it from that checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from training.common.jobparam import GroupPrice
from training.common.names import MARKET_ON_DEMAND
from training.prices import SOURCE_PRICE_LIST, price_lines, sagemaker_training_price

STOP_WINDOW_S = 120
"""What SageMaker gives the containers between SIGTERM and the job's end (StoppingCondition)."""


class PriceError(RuntimeError):
    """SageMaker's price of a type could not be read; the message says why and what to do."""


@dataclass(frozen=True)
class RuntimeLimit:
    """The job's ``MaxRuntimeInSeconds`` and how it was decided."""

    seconds: int
    source: str
    """What set it: ``--max-run``, ``job.max_hours = 4``, ``job.max_usd = 40``."""
    lines: tuple[str, ...]
    """The plan's lines: the prices (when read), the limit and what each cap allows."""

    @property
    def from_max_run(self) -> bool:
        return self.source == "--max-run"


def price_job(
    groups: Sequence[Mapping[str, Any]],
    *,
    pricing: Any,
    region: str,
    max_usd: float,
    now: datetime | None = None,
) -> tuple[GroupPrice, ...]:
    """Each SageMaker instance group (``CreateTrainingJob``'s ``InstanceGroups``) at SageMaker's
    On-Demand training rate in ``region``, read now; ``PriceError`` naming the type, why, and
    the fixes when the Price List does not give one."""
    stamp = f"{(now or datetime.now(UTC)).astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"
    rates: dict[str, float] = {}
    for ml_type in dict.fromkeys(g["InstanceType"] for g in groups):
        try:
            usd = sagemaker_training_price(pricing, ml_type, region)
        except Exception as e:  # botocore's errors (AccessDenied, no connection), a bad answer
            raise PriceError(_refusal(ml_type, region, max_usd, str(e))) from e
        if usd is None:
            why = "the Price List API lists no SageMaker training price for it"
            raise PriceError(_refusal(ml_type, region, max_usd, why))
        rates[ml_type] = usd
    return tuple(
        GroupPrice(
            group=g["InstanceGroupName"],
            instance_type=g["InstanceType"],
            market=MARKET_ON_DEMAND,
            count=int(g["InstanceCount"]),
            usd_per_hour=rates[g["InstanceType"]],
            source=SOURCE_PRICE_LIST,
            as_of=stamp,
        )
        for g in groups
    )


def runtime_limit(
    *,
    max_run_s: int,
    max_hours: float | None,
    max_usd: float | None,
    prices: Sequence[GroupPrice] = (),
    managed_spot: bool = False,
) -> RuntimeLimit:
    """``MaxRuntimeInSeconds``: the smallest of ``--max-run`` and what each cap allows (a cap
    wins a tie). ``prices``: the job's, needed for ``max_usd``; a cap that allows less than a
    second is ``ValueError`` (the message names it)."""
    allows: list[tuple[str, int, str]] = []  # (source, seconds, why)
    lines: list[str] = []
    if max_usd is not None:
        if not prices:
            raise ValueError("job.max_usd needs the job's SageMaker prices")
        usd_per_hour = sum(p.group_usd_per_hour for p in prices)
        spot = "; managed Spot bills no more" if managed_spot else ""
        lines += [
            f"prices: SageMaker training, On-Demand, from the Price List API{spot}",
            *(f"  {line}" for line in price_lines(prices)),
        ]
        allows.append(
            (
                f"job.max_usd = {max_usd:g}",
                math.floor(max_usd / usd_per_hour * 3600.0),
                f"{max_usd:g} USD at {usd_per_hour:.4f} USD/h",
            )
        )
    if max_hours is not None:
        allows.append((f"job.max_hours = {max_hours:g}", math.floor(max_hours * 3600.0), ""))
    for source, seconds, _ in allows:
        if seconds < 1:
            raise ValueError(
                f"{source} allows less than a second of training; raise it (or remove it)"
            )
    allows.append(("--max-run", max_run_s, ""))
    source, seconds, why = min(allows, key=lambda a: a[1])  # min keeps the first on a tie
    others = [f"{s} allows {n} s" for s, n, _ in allows if s != source]
    reason = f"set by {source}" + (f" ({why})" if why else "")
    lines.append(
        f"stopping: MaxRuntimeInSeconds {seconds} ({seconds / 3600.0:.4f} h), {reason}"
        + (f"; {', '.join(others)}" if others else "")
    )
    if len(allows) == 1:
        lines.append("  the spec sets no job.max_usd or job.max_hours")
    if max_usd is not None:
        at_most = sum(p.group_usd_per_hour for p in prices) * seconds / 3600.0
        lines.append(
            f"  at most {at_most:.2f} USD of instance time by then; the stop adds up to "
            f"{STOP_WINDOW_S} s (SageMaker's SIGTERM window, for the checkpoint)"
        )
    return RuntimeLimit(seconds, source, tuple(lines))


def _refusal(ml_type: str, region: str, max_usd: float, why: str) -> str:
    return (
        f"job.max_usd = {max_usd:g} needs SageMaker's price of {ml_type} in {region}, which the "
        f"Price List API did not give ({why}); hetero keeps no SageMaker prices offline (its "
        "catalogue holds EC2's rates, which are not SageMaker's, so they would not bound the "
        "bill). Allow pricing:GetProducts to this identity (the user policy in "
        "docs/security.md has it) and submit again, or cap the job by time instead "
        "(job.max_hours, or --max-run without job.max_usd)"
    )
