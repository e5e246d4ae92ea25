"""The budget's backstop: a scheduled action on every group of the job that sets MinSize, MaxSize
and DesiredCapacity to 0 shortly after the budget's deadline, so the cap holds when no launcher
is left to end the job (every one killed, hung, or gone with its instance). Auto Scaling runs it
whatever the instances do; a termination lifecycle hook still gives a running trainer its time
to save.

It runs ``after_s`` past the deadline (``LoopSettings.backstop_after``: a live trainer's grace
to save and end the job, then a heartbeat for the data servers to end it, ``tier_budget``), not
at the deadline itself: a launcher that is there ends the job first, with the ``stopped``
outcome and its budget reason in the job record and a checkpoint, which ``hetero job start
--resume`` continues. Run at the deadline, the scale-in would race the launchers: a host told
to leave by its group's termination leaves without recording an outcome.

Every launcher puts it once it knows the job's start (``PutScheduledUpdateGroupAction`` creates
or updates the action of that name: hosts that put it again change nothing, and the launchers
of a new job, ``hetero job start --resume`` included, move it to that job's deadline); the host
that ends the job deletes it (``job_end.end_job``). AWS refuses a start time in the past
(https://docs.aws.amazon.com/autoscaling/ec2/APIReference/API_PutScheduledUpdateGroupAction.html),
so a start less than ``MIN_LEAD_S`` away is not put: the launchers end such a job themselves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import ClientError

from training.costs.budget import JobClock

log = logging.getLogger(__name__)

ACTION_PREFIX = "hetero-budget-deadline-"
"""Each group's scheduled action is this and the group's name (one per group: a new job's
replaces it; named apart although AWS scopes names to their group, as moto, which the
rehearsal runs on, keys them by name alone)."""
MIN_LEAD_S = 60.0
"""An action whose start is closer than this is not put (AWS refuses start times in the
past)."""


def action_name(asg_name: str) -> str:
    """The backstop's scheduled action on the group ``asg_name``."""
    return ACTION_PREFIX + asg_name


def put_backstop(
    autoscaling: Any,
    asg_names: Sequence[str],
    at: float,
    *,
    now: float | None = None,
    lead_s: float = MIN_LEAD_S,
) -> list[str]:
    """Schedule every named group to 0 at ``at`` (epoch seconds); returns the groups scheduled
    (none when ``at`` is under ``lead_s`` away). An error stops it: the caller puts them all
    again later (``put_for_job``), which changes nothing where one is."""
    now = time.time() if now is None else now
    if at - now < lead_s:
        log.info("budget backstop %.0f s away: no scheduled action (the launchers end the job)",
                 at - now)  # fmt: skip
        return []
    start = datetime.fromtimestamp(at, UTC)
    for name in asg_names:
        autoscaling.put_scheduled_update_group_action(
            AutoScalingGroupName=name, ScheduledActionName=action_name(name), StartTime=start,
            MinSize=0, MaxSize=0, DesiredCapacity=0,
        )  # fmt: skip
    log.info("budget backstop: %s to 0 at %s", ", ".join(asg_names), start.isoformat())
    return list(asg_names)


def put_for_job(
    autoscaling: Any,
    asg_names: Sequence[str],
    clock: JobClock,
    *,
    after_s: float,
    lead_s: float = MIN_LEAD_S,
) -> bool:
    """``put_backstop`` ``after_s`` past the deadline of ``clock``'s budget for the job's start
    (``clock.job_start()``, asked only for a capped job: it may write the job's start); True
    once that is done or there is nothing to do (no group, no cap), False to try again later
    (the start unknown yet, or AWS failed: logged)."""
    if not asg_names or not clock.budget.capped:
        return True
    started = clock.job_start()
    if started is None:
        return False
    deadline = clock.budget.deadline(started)
    if deadline is not None:
        try:
            put_backstop(autoscaling, asg_names, deadline + after_s, lead_s=lead_s)
        except Exception as e:
            log.warning("the budget's scheduled action is not in place yet: %s", e)
            return False
    return True


def remove_backstop(autoscaling: Any, asg_names: Sequence[str]) -> list[str]:
    """Delete the backstop from every named group (the job is over); returns the groups it was
    deleted from. A group without one is skipped; other errors are logged, never raised (the
    job is over either way)."""
    removed: list[str] = []
    for name in asg_names:
        try:
            autoscaling.delete_scheduled_action(
                AutoScalingGroupName=name, ScheduledActionName=action_name(name)
            )
        except Exception as e:  # botocore ClientError and friends
            if not _not_found(e):
                log.error("could not delete the budget's scheduled action of %s: %s", name, e)
            continue
        removed.append(name)
    return removed


def _not_found(error: Exception) -> bool:
    """Auto Scaling's answer to deleting a scheduled action that is not there."""
    if not isinstance(error, ClientError):
        return False
    detail = error.response.get("Error", {})
    return (
        detail.get("Code") == "ValidationError" and "not found" in detail.get("Message", "").lower()
    )
