"""Job end on EC2: record the outcome and scale the cluster's Auto Scaling groups to zero so no
instance keeps billing; and the lifecycle-hook call that lets an Auto Scaling termination go on."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from training.launcher.jobrecord import JobRecord
from training.launcher.names import ENV_ASG_NAMES
from training.outcome import Outcome

log = logging.getLogger(__name__)


def asg_names_from_env(environ: Mapping[str, str]) -> list[str]:
    """The comma-separated ``HETERO_ASG_NAMES``, blanks dropped."""
    return [n.strip() for n in environ.get(ENV_ASG_NAMES, "").split(",") if n.strip()]


def scale_to_zero(autoscaling: Any, asg_names: Sequence[str]) -> list[str]:
    """Set MinSize and DesiredCapacity of every named group to 0; returns the names scaled.

    Every group is attempted even if one fails; the first failure is raised at the end, after
    the others have been scaled (a half-done job end still stops as much billing as it can).
    """
    scaled: list[str] = []
    errors: list[Exception] = []
    for name in asg_names:
        try:
            autoscaling.update_auto_scaling_group(
                AutoScalingGroupName=name, MinSize=0, DesiredCapacity=0
            )
        except Exception as e:  # botocore ClientError and friends: keep going, report below
            log.error("could not scale Auto Scaling group %s to zero: %s", name, e)
            errors.append(e)
            continue
        log.info("scaled Auto Scaling group %s to zero", name)
        scaled.append(name)
    if errors:
        raise errors[0]
    return scaled


def end_job(
    record: JobRecord | None,
    outcome: Outcome,
    *,
    reason: str,
    by: str,
    autoscaling: Any | None,
    asg_names: Sequence[str],
) -> None:
    """End the job for everyone: record the outcome first (a host starting later sees it and
    does not run), then scale every group to zero. Safe to call from several hosts: the first
    recorded outcome stays, and scaling to zero twice is harmless."""
    if record is not None:
        try:
            record.end(outcome, reason=reason, by=by)
        except Exception as e:  # Still stop the billing below.
            log.error("could not record the job's outcome in %s: %s", record.location, e)
    if not asg_names:
        log.warning(
            "the job is over (%s) but no Auto Scaling groups are named (set %s)",
            outcome.value,
            ENV_ASG_NAMES,
        )
        return
    if autoscaling is None:
        raise ValueError("an Auto Scaling client is needed to scale the groups to zero")
    scale_to_zero(autoscaling, asg_names)


def complete_lifecycle_action(autoscaling: Any, instance_id: str, hook_name: str) -> bool:
    """Tell Auto Scaling that this instance has finished its termination work (checkpoint
    saved), so the termination goes on now rather than at the hook's heartbeat timeout.
    Returns False (logged) when it could not: the hook's timeout then ends the wait."""
    try:
        found = autoscaling.describe_auto_scaling_instances(InstanceIds=[instance_id])
        groups = [i["AutoScalingGroupName"] for i in found.get("AutoScalingInstances", [])]
        if not groups:
            log.warning("instance %s is in no Auto Scaling group: no lifecycle action", instance_id)
            return False
        autoscaling.complete_lifecycle_action(
            LifecycleHookName=hook_name,
            AutoScalingGroupName=groups[0],
            InstanceId=instance_id,
            LifecycleActionResult="CONTINUE",
        )
    except Exception as e:  # The hook's heartbeat timeout still lets the termination proceed.
        log.warning("could not complete lifecycle action %s for %s: %s", hook_name, instance_id, e)
        return False
    log.info("completed lifecycle action %s for %s", hook_name, instance_id)
    return True
