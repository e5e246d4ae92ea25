"""Job end on EC2: scale the cluster's Auto Scaling groups to zero so no instance keeps billing."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from training.launcher.names import ENV_ASG_NAMES

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
