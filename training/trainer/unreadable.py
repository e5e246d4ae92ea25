"""The training samples a job could not read, by name: counted the same on every rank, kept in
the checkpoint, listed in the summary, and past ``job.dataset.max_unreadable`` the end of the job.

The data path leaves a sample it cannot read or decode out of its batch and says which
(``Batch.skipped``: its name and the reason, ``training.data.batch.Unreadable``). Each rank keeps
what its batches skipped; at the next step boundary the per-step flag all-reduce tells every
rank that some rank met one (``StepFlags.unreadable``), and only then do the ranks exchange the
records (one ``all_gather_object`` on the flags' CPU group), so every rank holds the same list,
at the same step. That list is what the checkpoint keeps (``Checkpointer.train_state``), what the
summary lists, and what is judged: once ``JUDGED_AFTER`` samples (or the first epoch, if
shorter) have been met, a share of unreadable samples above ``max_share`` raises
``UnreadableDataError`` on every rank at the same step, naming the first of them.

A sample is counted once however many epochs meet it (by name); the share is taken over the
samples met so far, so after the first epoch it only falls.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from training.data.batch import Batch, Unreadable

log = logging.getLogger(__name__)

FIELD = "job.dataset.max_unreadable"
JUDGED_AFTER = 1000
"""Samples met before the share is judged (fewer, the first epoch's, in a smaller dataset)."""
LISTED = 1000
"""Unreadable samples the summary lists by name (the count is always whole)."""
NAMED_IN_ERROR = 20
IN_RECORD = 3
"""Names each metrics interval carries (the summary has them all, up to ``LISTED``)."""


class UnreadableDataError(RuntimeError):
    """Too large a share of the training samples is unreadable; the job stops (outcome
    ``failed``). Raised on every rank at the same step."""


class UnreadableSamples:
    """The job's unreadable training samples (``names``: name -> reason, the same on every rank
    after each ``share``), and the judgement of their share."""

    def __init__(self, max_share: float, *, epoch_samples: int | None = None) -> None:
        self.max_share = max_share
        self.judged_after = min(JUDGED_AFTER, epoch_samples or JUDGED_AFTER)
        self.names: dict[str, str] = {}
        self._pending: list[Unreadable] = []

    def met(self, batch: Batch) -> None:
        """Note what ``batch`` (one of this rank's) left out."""
        self._pending.extend(batch.skipped)

    @property
    def pending(self) -> bool:
        """This rank met unreadable samples that the others have not heard of."""
        return bool(self._pending)

    def share(self, world_size: int, group: dist.ProcessGroup | None = None) -> None:
        """Every rank's pending records to every rank (call on all ranks at once, when the
        step's flags say some rank has some)."""
        mine = [(u.name, u.reason) for u in self._pending]
        self._pending.clear()
        gathered: list[Any] = [mine]
        if world_size > 1:
            gathered = [None] * world_size
            dist.all_gather_object(gathered, mine, group=group)
        for part in gathered:
            for name, reason in part:
                if name not in self.names:  # the first reason shared stays
                    self.names[name] = reason
                    log.warning("unreadable training sample, left out: %s (%s)", name, reason)

    def judge(self, samples_met: int) -> None:
        """Raise ``UnreadableDataError`` when, ``samples_met`` training samples in, more than
        ``max_share`` of them were unreadable (the same on every rank: the names are shared,
        the count is the step's)."""
        if samples_met < self.judged_after or not self.names:
            return
        share = len(self.names) / samples_met
        if share <= self.max_share:
            return
        named = "; ".join(f"{n} ({r})" for n, r in list(self.names.items())[:NAMED_IN_ERROR])
        more = len(self.names) - NAMED_IN_ERROR
        raise UnreadableDataError(
            f"{len(self.names)} of the first {samples_met} training samples are unreadable "
            f"({share:.1%}; {FIELD} = {self.max_share:g}): {named}"
            + (f"; and {more} more" if more > 0 else "")
            + ". Remove or fix those files (`hetero dataset prep` lists every one and leaves "
            f"them out of its shards), or raise {FIELD}"
        )

    def record_fields(self) -> dict[str, Any]:
        """What each metrics interval carries (``metrics.jsonl``, EMF, TensorBoard, the host's
        last metrics that ``hetero status`` shows): the count, and the first few names."""
        fields: dict[str, Any] = {"unreadable_samples": len(self.names)}
        if self.names:
            fields["unreadable_first"] = list(self.names)[:IN_RECORD]
        return fields

    def summary(self) -> dict[str, Any]:
        """What the job's summary says: the count, and the first ``LISTED`` by name."""
        listed = list(self.names.items())[:LISTED]
        return {
            "count": len(self.names),
            "samples": [{"name": n, "reason": r} for n, r in listed],
        }

    def state_dict(self) -> dict[str, Any]:
        return {"names": [[n, r] for n, r in self.names.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.names = {str(n): str(r) for n, r in state.get("names", [])}
