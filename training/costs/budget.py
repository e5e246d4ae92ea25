"""A job's budget: ``job.max_hours`` and ``job.max_usd`` against the time since the job started.

The clock lives where every host sees it, so a job whose hosts come and go (Spot replacements,
restarts) counts its whole time: the job pointer's ``started`` (``hetero job start`` writes it),
else ``started.json`` in the job record, written once by the first host of the job
(``JobRecord.started``). Spend is the price of the whole cluster at its most times the hours
since that start: every group at its most (``max_size`` instances, an elastic group's
``max_count``, of the dearest listed type in its market: ``training.prices``), priced when
``hetero job start`` ran and recorded in the job pointer (``JobPointer.prices``: Spot price
history and the Price List that day, the spec's ``[job.prices]``, the dated catalogue where AWS
gave none). A job whose pointer records no prices (the job a deploy started: the stack writes
its pointer without them) is priced by its first host, Spot from AWS, and the prices are
recorded in the job record (``deploy_prices``); where neither has them, from the spec and the
dated catalogue (``prices.offline_prices``), with a warning naming the catalogue's date. The
instances then cost at most that per hour while they run, so the cap bounds their spend; EBS
volumes, VPC endpoints and data transfer are not in it.

Each job has its own budget: ``hetero job start --resume`` starts a new job (its own id, its
own start time, the old record moved to ``job-history/``) that resumes the checkpoints with
``max_hours`` and ``max_usd`` to spend again, or the caps given to it
(``hetero job start --max-usd/--max-hours``, kept in the job pointer).

The launcher passes the time the budget runs out to the trainer (``HETERO_BUDGET_DEADLINE``,
epoch seconds; the trainer checks the wall clock against it after every step, so its own
start-up counts too), which stops with a durable checkpoint when it runs out; the launcher then
ends the job with the outcome ``stopped`` and a ``budget: ...`` reason, and every group goes
to 0 (``ec2_job.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from training.common.jobparam import GroupPrice, JobPointer
from training.common.names import ENV_BUDGET_DEADLINE
from training.instance_types import PRICES_AS_OF
from training.prices import SOURCE_CATALOGUE, offline_prices, sources_text
from training.spec import ClusterSpec

log = logging.getLogger(__name__)

REASON_PREFIX = "budget: "


@dataclass(frozen=True)
class Budget:
    max_hours: float | None
    max_usd: float | None
    usd_per_hour: float
    """The cluster at its most."""
    priced: str = ""
    """Where ``usd_per_hour`` comes from and when (``prices.sources_text``)."""
    prices: tuple[GroupPrice, ...] = ()
    """Each group's price at its most (what the job's bill is priced at, ``bill.py``)."""

    @classmethod
    def of(
        cls,
        spec: ClusterSpec,
        pointer: JobPointer | None = None,
        *,
        recorded: tuple[GroupPrice, ...] | None = None,
    ) -> Budget:
        """The spec's caps, each replaced by the job pointer's (``JobPointer.max_usd`` /
        ``max_hours``, set by ``hetero job start``) where the pointer has one; the price the
        pointer records, else the job record's (``recorded``: a deploy's job, priced by its
        first host, ``deploy_prices``), else the spec's and the catalogue's at its most
        (logged)."""
        hours, usd = (pointer.max_hours, pointer.max_usd) if pointer else (None, None)
        if pointer is not None and pointer.prices:
            prices = pointer.prices
        elif recorded:
            prices = recorded
        else:
            prices = offline_prices(spec).prices
            if any(p.source == SOURCE_CATALOGUE for p in prices):
                log.warning(
                    "job %s records no prices (neither its pointer, as `hetero job start` "
                    "writes them, nor its record, as a deploy's first host does): its budget "
                    "prices every group at its most from the offline catalogue of %s",
                    pointer.job_id if pointer else "(no job pointer)",
                    PRICES_AS_OF,
                )
        return cls(
            spec.job.max_hours if hours is None else hours,
            spec.job.max_usd if usd is None else usd,
            sum(p.group_usd_per_hour for p in prices),
            sources_text(prices),
            tuple(prices),
        )

    @property
    def _rate(self) -> str:
        """``3.60 USD/h``, and where the price comes from when known (``... from catalogue
        2026-07-20``)."""
        return f"{self.usd_per_hour:.2f} USD/h" + (f" from {self.priced}" if self.priced else "")

    @property
    def capped(self) -> bool:
        return self.max_hours is not None or self.max_usd is not None

    def limit_s(self) -> float | None:
        """Seconds from the job's start to the first cap reached; None without a cap."""
        limits = []
        if self.max_hours is not None:
            limits.append(self.max_hours * 3600.0)
        # A cluster priced at 0 never reaches a USD cap.
        if self.max_usd is not None and self.usd_per_hour > 0:
            limits.append(self.max_usd / self.usd_per_hour * 3600.0)
        return min(limits) if limits else None

    def spent_usd(self, elapsed_s: float) -> float:
        return self.usd_per_hour * max(0.0, elapsed_s) / 3600.0

    def deadline(self, started: float) -> float | None:
        """Epoch seconds at which the budget runs out for a job started at ``started``."""
        limit = self.limit_s()
        return None if limit is None else started + limit

    def remaining_s(self, elapsed_s: float) -> float | None:
        """Seconds left (never negative); None without a cap."""
        limit = self.limit_s()
        return None if limit is None else max(0.0, limit - elapsed_s)

    def reached(self, elapsed_s: float) -> bool:
        remaining = self.remaining_s(elapsed_s)
        return remaining is not None and remaining <= 0

    def reason(self, elapsed_s: float) -> str:
        """``budget: ...``: which cap, what was spent, over how long."""
        hours = max(0.0, elapsed_s) / 3600.0
        spent = self.spent_usd(elapsed_s)
        caps = []
        if self.max_usd is not None and self.usd_per_hour > 0 and spent >= self.max_usd - 1e-9:
            caps.append(f"max_usd {self.max_usd:g} reached")
        if self.max_hours is not None and hours >= self.max_hours - 1e-9:
            caps.append(f"max_hours {self.max_hours:g} reached")
        what = ", ".join(caps) or "cap reached"
        return (
            f"{REASON_PREFIX}{what} ({spent:.4f} USD over {hours:.4f} h at {self._rate}); "
            "continue with hetero job start --resume"
        )

    def describe(self, elapsed_s: float | None) -> str:
        """One line for ``hetero status``: spend so far against the caps."""
        caps = []
        if self.max_usd is not None:
            caps.append(f"max_usd {self.max_usd:g}")
        if self.max_hours is not None:
            caps.append(f"max_hours {self.max_hours:g}")
        cap = ", ".join(caps) if caps else "no cap (job.max_usd, job.max_hours)"
        if elapsed_s is None:
            return f"not started; {cap}"
        return (
            f"{self.spent_usd(elapsed_s):.2f} USD over {elapsed_s / 3600.0:.2f} h at "
            f"{self._rate}; {cap}"
        )


def parse_started(value: Any) -> float | None:
    """An epoch time from ``started``: ISO 8601 (the job pointer) or a number (the record)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value.strip():
        try:
            return datetime.fromisoformat(value.strip().replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def job_started(record: Any, pointer_started: str | None, *, now: float | None = None) -> float:
    """When the job started: the pointer's ``started`` when it has one, else the record's
    (written now by this host when the record has none yet)."""
    from_pointer = parse_started(pointer_started)
    if from_pointer is not None:
        return from_pointer
    return float(record.started(time.time() if now is None else now))


class JobClock:
    """A host's budget clock: ``budget`` against the time since the job started, which is asked
    once (``job_started``) and then kept."""

    def __init__(
        self, budget: Budget, record: Any | None, pointer_started: Callable[[], str | None]
    ) -> None:
        self.budget = budget
        self.record = record
        self.pointer_started = pointer_started
        """The job pointer's ``started`` (None: no pointer, or a deploy's job)."""
        self._started: float | None = None
        """The job's start (epoch seconds) for its budget, once known."""

    def job_start(self) -> float | None:
        """When the job started (``job_started``: the pointer's time, else the record's,
        written by the first host to ask), once known; None while it cannot be read (logged)."""
        if self._started is None:
            pointer_started = self.pointer_started()
            try:
                if self.record is None:
                    self._started = parse_started(pointer_started)
                else:
                    self._started = job_started(self.record, pointer_started)
            except Exception as e:  # S3 unreachable: try again next time.
                log.warning("could not read the job's start: %s", e)
                return None
        return self._started

    def elapsed(self) -> float | None:
        """Seconds since the job started; None without a cap, or when the start cannot be known
        (no job record and no pointer time: logged, no cap applies)."""
        if not self.budget.capped:
            return None
        started = self.job_start()
        if started is None:
            log.warning("the job's start is unknown (no job record): its budget is not kept")
            return None
        return time.time() - started

    def spent(self) -> bool:
        elapsed = self.elapsed()
        return elapsed is not None and self.budget.reached(elapsed)

    def trainer_env(self) -> dict[str, str]:
        """When the budget runs out (epoch seconds), for the trainer: its ``--max-seconds``
        defaults to what is left of it when it parses its arguments (torchrun's start counts)."""
        elapsed = self.elapsed()
        if elapsed is None or self._started is None:
            return {}
        deadline = self.budget.deadline(self._started)
        if deadline is None:
            return {}
        log.info(
            "budget: %s; the trainer may run until %.0f s from now",
            self.budget.describe(elapsed),
            deadline - time.time(),
        )
        return {ENV_BUDGET_DEADLINE: f"{deadline:.3f}"}
