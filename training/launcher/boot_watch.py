"""Failed boots, counted by the launchers that did start, against the job's replacement budget.

A boot that gives up never starts a launcher, so it cannot count itself (the dataprep AMI has no
AWS CLI, and the image may be what failed). Its user data shuts the instance down from the OS
(``shutdown -h now`` in the EXIT trap); the launch template's InstanceInitiatedShutdownBehavior
``terminate`` makes EC2 terminate it, and its Auto Scaling group launches a replacement. EC2
records that end as the state reason ``Client.InstanceInitiatedShutdown`` ("The instance was shut
down from the operating system of the instance":
https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_StateReason.html), and
``DescribeInstances`` filters on it (``state-reason-code``:
https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeInstances.html) for as long
as it lists the terminated instance ("Terminated instances remain visible after termination (for
approximately one hour)":
https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_TerminateInstances.html).

Every launcher of the job looks at each heartbeat: the cluster's instances that ended that way and
launched after the job started (less ``LAUNCH_SLACK_S``: the first instances launch before the
first launcher writes the job's start) are written to the job record's ``replaced/``, the count a
launcher that cannot start its loop adds to (``early_exit``). Past the budget the job ends
``failed``. Nothing else on the instances ends that way: the job's own terminations (Spot, the
groups scaled to zero, ``SetInstanceHealth``) go through the EC2 and Auto Scaling APIs.

The limit: it counts while at least one launcher of the job runs. A job whose every boot fails
(e.g. an image that cannot be pulled) has nobody to count; ``docs/launcher.md`` says how that
shows and what stops it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from training.common.hosts import cluster_instances, tag
from training.common.jobrecord import JobRecord
from training.common.names import TAG_GROUP
from training.costs.bill import Census, sighting
from training.launcher.early_exit import past_budget

log = logging.getLogger(__name__)

INSTANCE_INITIATED_SHUTDOWN = "Client.InstanceInitiatedShutdown"
"""EC2's state reason for an instance shut down from its own operating system."""
LAUNCH_SLACK_S = 900.0
"""Instances launched up to this long before the job's recorded start still count as the job's
(a boot, a pull of the image and the launcher's start come before the first record write)."""
BOOT_REASON = "its boot gave up and shut the instance down (EC2: Client.InstanceInitiatedShutdown)"


@dataclass(frozen=True)
class FailedBoot:
    instance_id: str
    group: str | None
    launched: float
    """Launch time, epoch seconds."""
    instance: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The instance as DescribeInstances listed it (for the job's bill: ``bill.sighting``)."""


def failed_boots(ec2: Any, cluster: str, *, since: float) -> list[FailedBoot]:
    """The cluster's instances shut down from their own OS, launched at ``since`` or later,
    oldest first."""
    ended = cluster_instances(
        ec2,
        cluster,
        {"Name": "state-reason-code", "Values": [INSTANCE_INITIATED_SHUTDOWN]},
        {"Name": "instance-state-name", "Values": ["shutting-down", "terminated"]},
    )
    found = [
        FailedBoot(inst["InstanceId"], tag(inst, TAG_GROUP), inst["LaunchTime"].timestamp(), inst)
        for inst in ended
    ]
    return sorted(
        (b for b in found if b.launched >= since), key=lambda b: (b.launched, b.instance_id)
    )


class BootWatch:
    """``check()`` counts failed boots not counted yet and returns the reason to end the job once
    the job record's ``replaced/`` is past ``budget``; None otherwise (and while the job's start,
    EC2 or the record cannot be read: no decision without them). With a ``census`` (the host's,
    for the job's bill) each failed boot is added to it, gone when first seen shut down, and so
    is each other instance in ``replaced/`` (an early exit, ``early_exit``) once it is no longer
    running: either may end before any host saw it running."""

    def __init__(
        self,
        ec2: Any,
        cluster: str,
        record: JobRecord,
        *,
        budget: int,
        job_started: Callable[[], float | None],
        census: Census | None = None,
    ) -> None:
        self.census = census
        self.ec2 = ec2
        self.cluster = cluster
        self.record = record
        self.budget = budget
        self.job_started = job_started
        self._counted: set[str] = set()
        self._early_exits_seen: set[str] = set()
        """Early exits already added to the census as gone."""

    def check(self) -> str | None:
        started = self.job_started()
        if started is None:
            return None
        try:
            boots = failed_boots(self.ec2, self.cluster, since=started - LAUNCH_SLACK_S)
        except Exception as e:
            log.warning("could not list the cluster's failed boots: %s", e)
            return None
        if self.census is not None:
            now = time.time()
            for boot in boots:
                if (seen := sighting(boot.instance, group=boot.group, gone=now)) is not None:
                    self.census.add(seen)
            self._census_early_exits(self.census, {b.instance_id for b in boots}, now)
        new = [b for b in boots if b.instance_id not in self._counted]
        if not new:
            return None
        try:
            for boot in new:
                self.record.mark_replaced(boot.instance_id, group=boot.group, reason=BOOT_REASON)
                self._counted.add(boot.instance_id)
                log.warning(
                    "instance %s (%s): %s; counted in the job record's replaced/",
                    boot.instance_id, boot.group, BOOT_REASON,
                )  # fmt: skip
            replaced = self.record.replaced()
        except Exception as e:
            log.warning("could not count failed boots in %s: %s", self.record.location, e)
            return None
        last = new[-1]
        reason = past_budget(
            replaced, self.budget, last=last.instance_id, group=last.group, why=BOOT_REASON
        )
        if reason is None:
            log.info("replacements so far: %d of %d for this job", len(replaced), self.budget)
        return reason

    def _census_early_exits(self, census: Census, boots: set[str], now: float) -> None:
        """Add to ``census``, gone ``now``, each instance of ``replaced/`` that is not a failed
        boot and no longer runs (an early exit: its launcher, which wrote it there, could not
        start its loop, and its group replaced it), once. A read that fails is tried again at
        the next heartbeat."""
        try:
            ids = sorted(set(self.record.replaced()) - boots - self._early_exits_seen)
            if not ids:
                return
            ended = list(
                cluster_instances(
                    self.ec2, self.cluster,
                    {"Name": "instance-id", "Values": ids},
                    {"Name": "instance-state-name", "Values": ["shutting-down", "terminated"]},
                )
            )  # fmt: skip
        except Exception as e:
            log.warning("could not look up the job's early exits for its bill: %s", e)
            return
        for inst in ended:
            if (seen := sighting(inst, gone=now)) is not None:
                census.add(seen)
                self._early_exits_seen.add(seen.instance_id)
