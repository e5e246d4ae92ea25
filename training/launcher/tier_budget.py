"""A data server's budget check: the job's budget holds when no trainer is left to stop it.

A trainer stops itself at the budget's deadline with a durable checkpoint, and its launcher ends
the job ``stopped`` (``budget.py``). Data servers bill as well, and they may be all that runs:
the trainer group lost its instances and waits for replacements, or every trainer launcher is
gone. So each data server's launcher also checks the budget at every heartbeat:

- the budget is not spent: nothing to do;
- it is spent and a trainer host is alive (it wrote to the job record within ``live_s``): the
  trainer is saving its checkpoint; the data server serves it for ``grace_s`` after the deadline
  (the trainer's own grace to save, and its launcher's end of the job);
- it is spent and no trainer host is alive, or the grace is over: the data server ends the job
  ``stopped`` with the budget's reason (``job_end.end_job``: every group to zero), as a trainer
  would; ``hetero job start --resume`` continues from the last checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from training.common.jobrecord import JobRecord
from training.costs.budget import JobClock
from training.launcher.trainer_watch import last_trainer_write

log = logging.getLogger(__name__)


class TierBudgetWatch:
    """``check()`` returns the reason to end the job ``stopped`` (see the module docstring);
    None while the budget lasts, while a live trainer has its grace, and while the record
    cannot be read (the next heartbeat asks again)."""

    def __init__(
        self,
        clock: JobClock,
        record: JobRecord,
        trainer_groups: Collection[str],
        *,
        live_s: float,
        grace_s: float,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.record = record
        self.trainer_groups = frozenset(trainer_groups)
        self.live_s = live_s
        """A trainer host that wrote to the job record this recently is alive."""
        self.grace_s = grace_s
        """Seconds past the deadline a live trainer has to save and end the job itself."""
        self.now = now

    def check(self) -> str | None:
        elapsed = self.clock.elapsed()
        limit = self.clock.budget.limit_s()
        if elapsed is None or limit is None or elapsed < limit:
            return None
        reason = self.clock.budget.reason(elapsed)
        over_s = elapsed - limit
        if over_s >= self.grace_s:
            log.warning("budget spent %.0f s ago and no trainer ended the job", over_s)
            return reason
        last = last_trainer_write(self.record, self.trainer_groups)
        if last is None:
            return None
        newest, who = last
        if newest is not None and self.now() - newest < self.live_s:
            log.info("budget spent; trainer host %s is alive and saving: serving it", who)
            return None
        log.warning("budget spent and no live trainer host (the last wrote: %s)", who)
        return reason
