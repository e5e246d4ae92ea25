"""Job end on EC2: record the outcome and scale the cluster's Auto Scaling groups to zero so no
instance keeps billing; and the lifecycle-hook call that lets an Auto Scaling termination go on,
both for a host that leaves and for each trainer's own termination after the job's end
(``complete_own_termination``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from botocore.exceptions import ClientError

from training.common.jobrecord import JobRecord
from training.common.names import ENV_ASG_NAMES
from training.common.outcome import Outcome
from training.costs.backstop import remove_backstop

log = logging.getLogger(__name__)


def asg_names_from_env(environ: Mapping[str, str]) -> list[str]:
    """The comma-separated ``HETERO_ASG_NAMES``, blanks dropped."""
    return [n.strip() for n in environ.get(ENV_ASG_NAMES, "").split(",") if n.strip()]


def scale_to_zero(autoscaling: Any, asg_names: Sequence[str]) -> list[str]:
    """Set MinSize, MaxSize and DesiredCapacity of every named group to 0; returns the names
    scaled. MaxSize too, so nothing raises a group again after its job (an elastic group's
    controller still running elsewhere): a desired capacity must be "less than or equal to the
    maximum size of the group"
    (https://docs.aws.amazon.com/autoscaling/ec2/APIReference/API_UpdateAutoScalingGroup.html).
    ``hetero job start`` sets the next job's sizes, and so does a deploy that updates the group
    (``infra/instance_group.py``: the update policy has CloudFormation apply the template's).

    Every group is attempted even if one fails; the first failure is raised at the end, after
    the others have been scaled (a half-done job end still stops as much billing as it can).
    """
    scaled: list[str] = []
    errors: list[Exception] = []
    for name in asg_names:
        try:
            autoscaling.update_auto_scaling_group(
                AutoScalingGroupName=name, MinSize=0, MaxSize=0, DesiredCapacity=0
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
    backstop: bool = False,
    bill: Callable[[], Mapping[str, Any] | None] | None = None,
) -> None:
    """End the job for everyone: record the outcome first (a host starting later sees it and
    does not run), with its ``bill`` (what the job cost until now, made only by the host that
    records the outcome: ``training.costs.bill``), then scale every group to zero
    and, for a job with a budget (``backstop``), delete the budget's scheduled action
    (``training.costs.backstop``). Safe to call from several hosts: the first recorded
    outcome stays, and scaling to zero twice is harmless."""
    if record is not None:
        try:
            record.end(outcome, reason=reason, by=by, bill=bill)
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
    try:
        scale_to_zero(autoscaling, asg_names)
    finally:
        if backstop:  # else it would stop a later job that has no budget at this one's deadline
            remove_backstop(autoscaling, asg_names)


def complete_lifecycle_action(
    autoscaling: Any, instance_id: str, hook_name: str, *, group: str | None = None
) -> bool:
    """Tell Auto Scaling that this instance has finished its termination work (checkpoint
    saved), so the termination goes on now rather than at the hook's heartbeat timeout.
    ``group`` is the instance's Auto Scaling group (looked up with DescribeAutoScalingInstances
    when not given). Returns False (logged, never raised) when it could not: a ValidationError
    means no lifecycle action is pending for the instance (none began, or it was completed
    already); the hook's timeout ends any wait that is left."""
    try:
        if group is None:
            found = autoscaling.describe_auto_scaling_instances(InstanceIds=[instance_id])
            groups = [i["AutoScalingGroupName"] for i in found.get("AutoScalingInstances", [])]
            if not groups:
                log.warning(
                    "instance %s is in no Auto Scaling group: no lifecycle action", instance_id
                )
                return False
            group = groups[0]
        autoscaling.complete_lifecycle_action(
            LifecycleHookName=hook_name,
            AutoScalingGroupName=group,
            InstanceId=instance_id,
            LifecycleActionResult="CONTINUE",
        )
    except Exception as e:  # The hook's heartbeat timeout still lets the termination proceed.
        if (
            isinstance(e, ClientError)
            and e.response.get("Error", {}).get("Code") == "ValidationError"
        ):
            log.info(
                "no pending lifecycle action %s for %s (already completed, or none): %s",
                hook_name, instance_id, e,
            )  # fmt: skip
        else:
            log.warning(
                "could not complete lifecycle action %s for %s: %s", hook_name, instance_id, e
            )
        return False
    log.info("completed lifecycle action %s for %s", hook_name, instance_id)
    return True


TERMINATING_WAIT = "Terminating:Wait"
"""The Auto Scaling lifecycle state in which a termination hook holds the instance."""
_PAST_THE_HOOK = frozenset({"Terminating:Proceed", "Terminated"})


def complete_own_termination(
    autoscaling: Any,
    instance_id: str,
    hook_name: str,
    *,
    target_state: Callable[[], str | None],
    timeout_s: float,
    poll_s: float,
    should_stop: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """After this host ended the job (its group scaled to zero): wait, at most ``timeout_s``,
    until Auto Scaling holds this instance in ``Terminating:Wait`` for the termination hook,
    then complete the lifecycle action with ``CONTINUE``, so the instance terminates now instead
    of billing until the hook's heartbeat timeout. The launcher exits right after the job's
    end, so nobody else would complete it.

    Terminating:Wait is seen either in DescribeAutoScalingInstances (``LifecycleState``, which
    also gives the group's name) or, from IMDS, ``autoscaling/target-lifecycle-state`` =
    ``Terminated`` (``target_state``; https://docs.aws.amazon.com/autoscaling/ec2/userguide/retrieving-target-lifecycle-state-through-imds.html).
    Returns True when the action was completed. Never raises: an instance no longer in a group
    or already past the hook needs nothing, errors are logged, and whatever is left the hook's
    timeout ends.
    """
    deadline = clock() + timeout_s
    while True:
        group: str | None = None
        state: str | None = None
        try:
            found = autoscaling.describe_auto_scaling_instances(InstanceIds=[instance_id])
            listed = found.get("AutoScalingInstances", [])
            if not listed:
                log.info(
                    "instance %s is in no Auto Scaling group (terminated already): "
                    "no lifecycle action to complete", instance_id,
                )  # fmt: skip
                return False
            group, state = listed[0]["AutoScalingGroupName"], listed[0].get("LifecycleState")
        except Exception as e:  # Throttling, a moment without the endpoint: poll again.
            log.warning("could not read this instance's Auto Scaling state: %s", e)
        if state in _PAST_THE_HOOK:
            log.info("instance %s is %s: no lifecycle action to complete", instance_id, state)
            return False
        try:
            target = target_state()
        except Exception as e:
            log.warning("could not read the target lifecycle state from IMDS: %s", e)
            target = None
        if state == TERMINATING_WAIT or (target or "").strip() == "Terminated":
            return complete_lifecycle_action(autoscaling, instance_id, hook_name, group=group)
        if should_stop() or clock() >= deadline:
            log.warning(
                "instance %s not in %s within %.0fs of the job's end (state %s): the hook's "
                "heartbeat timeout ends its termination wait",
                instance_id, TERMINATING_WAIT, timeout_s, state,
            )  # fmt: skip
            return False
        sleep(min(poll_s, max(0.0, deadline - clock())))
