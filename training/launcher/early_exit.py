"""A launcher that cannot start its job loop on EC2 takes its instance out of service.

Before the loop (group detection, EFA with ``efa = "on"``, the job pointer, IMDS) a failure is
the instance's, not the job's: a restart of the container on the same instance (Docker's
``--restart on-failure:5``) would meet it again, and after the last restart the instance would
sit InService with no launcher, billing. Instead the launcher

1. counts the instance in the job record (``job/replaced/<instance-id>.json``, beside the
   checkpoints, so every host sees every count; one object per instance, so Docker's restarts of
   the same launcher do not count twice);
2. past the budget (more instances than ``replacement_budget``, default
   ``REPLACEMENT_BUDGET``), ends the job ``failed`` with the reason (``job_end.end_job``: every
   group to zero), since replacing instances that all fail the same way only bills;
3. otherwise marks its own instance ``Unhealthy`` with Auto Scaling ``SetInstanceHealth``
   (``ShouldRespectGracePeriod=False``): the group terminates it and launches a replacement
   (https://docs.aws.amazon.com/autoscaling/ec2/APIReference/API_SetInstanceHealth.html);
4. in either case, with a termination hook (the trainer group), completes the lifecycle action
   for its own termination (``job_end.complete_own_termination``), so the instance does not wait
   out the hook's heartbeat.

A failure every replacement would meet the same way (``replaceable=False``: the host checks of
``host_checks``, e.g. an NVIDIA driver older than the image's CUDA wheels need, which comes
with the launch template's AMI) ends the job ``failed`` at once, with that failure as its
reason, instead of spending the budget on instances that cannot work.

Only where the stack deployed the launcher (``HETERO_ASG_NAMES`` is set): local runs and
SageMaker never touch Auto Scaling. Without its instance id (IMDS unreachable) the launcher cannot
name its instance: it logs that and exits as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from training.common.aws import client
from training.common.jobrecord import JobRecord
from training.common.outcome import EXIT_FAILED, Outcome
from training.launcher import job_end

log = logging.getLogger(__name__)

REPLACEMENT_BUDGET = 3
"""Instances per job that may be taken out of service for a launcher that could not start its
loop (``hetero launch --replacement-budget``); one more ends the job ``failed``."""


def past_budget(
    replaced: Mapping[str, Any], budget: int, *, last: str, group: str | None, why: str
) -> str | None:
    """The reason to end the job when the instances taken out of service (``replaced``: the job
    record's ``replaced/``, early exits and failed boots alike) are more than ``budget``; else
    None. ``last`` is the instance counted last, ``why`` what happened to it."""
    if len(replaced) <= budget:
        return None
    return (
        f"{len(replaced)} instances never reached the launcher's job loop, past the budget "
        f"of {budget} replacements; the last, {last} ({group or 'group unknown'}): {why}"
    )


def deployed(environ: Mapping[str, str]) -> bool:
    """Whether the stack deployed this launcher (it names the cluster's Auto Scaling groups)."""
    return bool(job_end.asg_names_from_env(environ))


def set_unhealthy(autoscaling: Any, instance_id: str) -> bool:
    """Mark ``instance_id`` Unhealthy so its Auto Scaling group terminates and replaces it now
    (not after the group's health check grace period). Returns False, logged, on an error."""
    try:
        autoscaling.set_instance_health(
            InstanceId=instance_id, HealthStatus="Unhealthy", ShouldRespectGracePeriod=False
        )
    except Exception as e:  # Nothing else to do from here; the log says what to fix.
        log.error("could not mark instance %s Unhealthy: %s; terminate it by hand", instance_id, e)
        return False
    log.info("marked instance %s Unhealthy: its Auto Scaling group replaces it", instance_id)
    return True


def leave_service(
    why: str,
    code: int,
    *,
    instance_id: str | None,
    group: str | None,
    record: JobRecord | None,
    autoscaling: Any | None,
    asg_names: Sequence[str],
    budget: int = REPLACEMENT_BUDGET,
    replaceable: bool = True,
    hook: str | None = None,
    target_state: Callable[[], str | None] = lambda: None,
    lifecycle_wait_s: float = 120.0,
    poll_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """This launcher could not start its job loop (``why``; it would exit ``code``): count the
    instance, then end the job ``failed`` past the budget, else have the group replace the
    instance; with ``replaceable=False`` end the job ``failed`` with ``why`` at once (a
    replacement would fail the same way). Returns the exit code: ``EXIT_FAILED`` when it ended
    the job, else ``code``."""
    log.error("the launcher cannot start its job loop: %s", why)
    if not instance_id and replaceable:
        log.error(
            "without this instance's id (IMDS) it cannot take the instance out of service; "
            "Docker restarts the launcher (--restart on-failure)"
        )
        return code
    if autoscaling is None:
        autoscaling = client("autoscaling")
    replaced: dict[str, dict[str, Any]] | None = None
    if record is not None and replaceable and instance_id:
        try:
            record.mark_replaced(instance_id, group=group, reason=why)
            replaced = record.replaced()
        except Exception as e:  # Still take the instance out of service below.
            log.error("could not count this replacement in %s: %s", record.location, e)
    ended = False
    if not replaceable:
        reason: str | None = (
            f"{why} (instance {instance_id or 'unknown'}, {group or 'group unknown'})"
        )
    elif replaced is not None and instance_id:
        reason = past_budget(replaced, budget, last=instance_id, group=group, why=why)
    else:
        reason = None
    if reason is not None:
        log.error("%s: ending the job as failed", reason)
        try:
            job_end.end_job(
                record,
                Outcome.FAILED,
                reason=reason,
                by=instance_id or f"an instance of {group or 'an unknown group'}",
                autoscaling=autoscaling,
                asg_names=asg_names,
            )
            ended = True
        except Exception as e:  # Fall back to replacing this one instance.
            log.error("could not end the job: %s", e)
    if not ended:
        if replaced is not None:
            log.info(
                "replacement %d of %d for this job (job record replaced/)", len(replaced), budget
            )
        if not instance_id or not set_unhealthy(autoscaling, instance_id):
            return code
    if hook and instance_id:
        job_end.complete_own_termination(
            autoscaling,
            instance_id,
            hook,
            target_state=target_state,
            timeout_s=lifecycle_wait_s,
            poll_s=poll_s,
            clock=clock,
            sleep=sleep,
        )
    return EXIT_FAILED if ended else code
