"""The restart budget of an EC2 host's generation loop: failures without progress.

A long job meets transient failures (a crashed rank, a lost collective) now and then; a budget
that counted every failure of the job would end a 300-hour run at its fourth, however much it
trained in between. So it counts failures since the job last made progress: a checkpoint
completed since the previous failure starts the count over. A crash loop (every generation
fails before its next checkpoint) still spends it in bounded time, and the job ends ``failed``
naming the last failure.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RestartBudget:
    allowed: int
    """Failures without progress that are retried; one more ends the job."""
    failures: int = 0
    """Failures counted since the last progress."""
    checkpoint_at_failure: int | None = None
    """The newest complete checkpoint step when the last failure was counted."""

    def count(self, newest_checkpoint: int | None) -> int | None:
        """Count a failure, ``newest_checkpoint`` being the job's newest complete checkpoint
        step now (None: unknown). Returns the step that started the count over, if one did."""
        progress = (
            self.failures > 0
            and newest_checkpoint is not None
            and self.checkpoint_at_failure is not None
            and newest_checkpoint > self.checkpoint_at_failure
        )
        since = self.checkpoint_at_failure
        if progress:
            self.failures = 0
        if newest_checkpoint is not None:
            self.checkpoint_at_failure = newest_checkpoint
        self.failures += 1
        return since if progress else None

    @property
    def spent(self) -> bool:
        return self.failures > self.allowed
