"""The settings of an EC2 host's generation loop (``ec2_job.Ec2Job``), from ``hetero launch``'s
command line (``default_settings``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from training.common.outcome import ROLE_STOP_GRACE_S
from training.costs.backstop import MIN_LEAD_S
from training.launcher.early_exit import REPLACEMENT_BUDGET
from training.launcher.hang_watch import HANG_AFTER_STEPS, HANG_FLOOR_S, STACKS_WAIT_S
from training.launcher.trainer_watch import NO_TRAINER_TIMEOUT_S

SILENT_HEARTBEATS = 8
"""Heartbeats without a write to the job record after which a host counts as silent: every
launcher writes at each heartbeat from a thread of its own, whatever its loop is doing (a
checkpoint upload, a generation's start), so only a launcher that is gone or frozen misses
eight in a row."""


@dataclass(frozen=True)
class LoopSettings:
    restart_budget: int = 3
    """Failed generations this host may retry before it ends the job as failed."""
    restart_backoff_s: float = 10.0
    """Wait before the first retry; doubled for each further failure (at most 120 s)."""
    peer_timeout_s: float = 900.0
    """How long to wait for the trainer group to reach its count (counts as one failure)."""
    poll_s: float = 5.0
    """Between membership and job-record checks."""
    spot_poll_s: float = 5.0
    grace_s: float = float(ROLE_STOP_GRACE_S)
    """After SIGTERM, how long the role gets to checkpoint and exit before it is killed."""
    imds_url: str = ""
    imds_timeout_s: float = 1.0
    heartbeat_s: float = 30.0
    """How often a running host puts its state and last metrics into the job record (and looks
    at what the watches look at: failed boots, trainers that are gone)."""
    no_trainer_timeout_s: float = NO_TRAINER_TIMEOUT_S
    """A data server ends the job as failed when no trainer host has written to the job record
    for this long (``trainer_watch``; checked at each heartbeat)."""
    replacement_budget: int = REPLACEMENT_BUDGET
    """Instances per job taken out of service before their job loop (a launcher that could not
    start it, a boot that gave up); one more ends the job failed (``early_exit``,
    ``boot_watch``)."""
    subreaper: bool = True
    """Adopt the role's orphaned descendants (Linux), so none outlives the launcher."""
    job_poll_s: float = 30.0
    """Between reads of the job pointer while the role runs or waits (with a ``JobWatch``)."""
    backstop_lead_s: float = MIN_LEAD_S
    """A budget backstop whose start is closer than this is not put (``backstop.put_backstop``)."""
    backstop_after_s: float | None = None
    """How long after the budget's deadline its scheduled action runs (``backstop``); None:
    ``backstop_after``'s default, after every launcher's own end of the job."""
    silent_after_s: float | None = None
    """A host whose launcher has not written to the job record for this long is silent and is
    taken out of its group (``silent_hosts``); None: ``SILENT_HEARTBEATS`` heartbeats."""
    hang_floor_s: float = HANG_FLOOR_S
    """A trainer generation with no progress on any of this host's ranks for this long (or
    ``hang_after_steps`` median step times, if longer) is hung (``hang_watch``)."""
    hang_after_steps: float = HANG_AFTER_STEPS
    stacks_wait_s: float = STACKS_WAIT_S
    """How long a hung host's ranks have to write their stacks once asked."""
    lifecycle_wait_s: float = 120.0
    """After this host ended the job (groups at zero): how long it waits for its own instance to
    reach Terminating:Wait, to complete the termination hook (``job_end.complete_own_termination``;
    polled every ``spot_poll_s``). The hook's heartbeat timeout (300 s) ends any wait left."""

    @property
    def silent_after(self) -> float:
        """``silent_after_s``, else ``SILENT_HEARTBEATS`` heartbeats (240 s at the default 30 s)."""
        if self.silent_after_s is not None:
            return self.silent_after_s
        return SILENT_HEARTBEATS * self.heartbeat_s

    @property
    def trainer_alive_s(self) -> float:
        """A trainer host that wrote to the job record this recently is alive (two heartbeats:
        one missed beat is not a death)."""
        return 2 * self.heartbeat_s

    @property
    def budget_grace_s(self) -> float:
        """After the budget's deadline, how long a live trainer has to save and end the job
        before the data servers end it (``tier_budget``)."""
        return self.grace_s + self.trainer_alive_s

    @property
    def backstop_after(self) -> float:
        """``backstop_after_s``, else past the data servers' end of the job: their grace to a
        live trainer and one heartbeat to notice it ran out, plus one to spare."""
        if self.backstop_after_s is not None:
            return self.backstop_after_s
        return self.budget_grace_s + 2 * self.heartbeat_s


def default_settings(args: Any) -> LoopSettings:
    return LoopSettings(
        restart_budget=args.restart_budget,
        restart_backoff_s=args.restart_backoff,
        peer_timeout_s=args.peer_timeout,
        poll_s=args.poll,
        spot_poll_s=args.spot_poll,
        grace_s=args.grace,
        imds_url=args.imds_url,
        imds_timeout_s=args.imds_timeout,
        job_poll_s=args.job_poll,
        no_trainer_timeout_s=args.no_trainer_timeout,
        heartbeat_s=args.heartbeat,
        replacement_budget=args.replacement_budget,
        backstop_lead_s=args.backstop_lead,
        backstop_after_s=args.backstop_after,
        silent_after_s=args.silent_after,
        hang_floor_s=args.hang_floor,
        hang_after_steps=args.hang_after_steps,
    )
