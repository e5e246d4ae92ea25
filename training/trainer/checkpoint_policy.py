"""When the trainer saves a checkpoint, in the foreground or in the background, and what a failed
save means. Every method is called by every rank at the same step (the decisions rest on the
step number and on flags the ranks agreed on), so the collectives inside the ``Checkpointer``
always line up.

- **Periodic saves** every ``interval_steps`` steps. A periodic save that fails (S3 unreachable,
  a full disk) logs ``checkpoint step N NOT saved: ...`` and training goes on; the step's marker
  is never written, so it is never loaded. The next attempt comes ``min(interval_steps, 10)``
  steps after the failure was noticed (or at the next interval step, if that is sooner).
- **A checkpoint request** (SIGUSR1, a rebalance recommendation) saves the step every rank
  agreed on, then training goes on.
- **Background saves** (``async_save``): the state is copied to host memory (training does not
  apply another optimizer step before the copy is done), DCP writes it on a thread, and with S3
  each host then uploads on a thread. The step counts as saved only when every rank's work is
  done: the ranks learn that in the per-step flags (``StepFlags.saves_done``) and complete it
  together. One background save at a time: a save that comes due while one is in flight waits
  for it.
- **The last save of a run** (a graceful stop, the end of the job) waits for a background save
  in flight, then saves the current step in the foreground unless it is already saved, retrying
  with backoff (1, 2, 4, ... 15 s) for up to ``final_retry_s``; rank 0 decides when to give up,
  so every rank gives up together.

``checkpoint_step`` is the newest step whose marker is written (or the step the run resumed
from): it never names a step whose save failed. ``records`` holds, per save, the time the
training loop spent on it (the stall).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from torch import nn
from torch.optim import Optimizer

from training.trainer.checkpoint import Checkpointer, CheckpointStorageError, PendingSave
from training.trainer.signals import StepFlags

log = logging.getLogger(__name__)

RETRY_AFTER_STEPS = 10
"""A failed periodic save is tried again this many steps later (or at the next interval)."""
_MAX_BACKOFF_S = 15.0


@dataclass
class SaveRecord:
    """One save as the training loop saw it."""

    step: int
    mode: str
    """``sync`` (the loop waits for the write) or ``async`` (the loop waits for the copy)."""
    reason: str
    """``interval``, ``retry``, ``requested`` (SIGUSR1) or ``final``."""
    stall_s: float = 0.0
    """Time the training loop spent on this save (all its phases together)."""
    saved: bool | None = None
    """True once complete, False if it failed, None while in flight."""
    error: str | None = None


class CheckpointPolicy:
    """Decides when to save and carries background saves to completion (see the module doc)."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        *,
        interval_steps: int,
        async_save: bool,
        final_retry_s: float,
    ) -> None:
        self.checkpointer = checkpointer
        self.interval_steps = interval_steps
        self.async_save = async_save
        self.final_retry_s = final_retry_s
        self.checkpoint_step: int | None = None
        """The newest complete checkpoint: saved by this run, or the one it resumed from."""
        self.checkpoint_time: float | None = None
        """When ``checkpoint_step`` became durable (Unix seconds): this rank's clock when this
        run completed it, or the marker's time of the checkpoint it resumed from."""
        self.records: list[SaveRecord] = []
        self.final_save_s: float | None = None
        """From the start of the last save of the run (stop or end) to a durable checkpoint."""
        self._pending: PendingSave | None = None
        self._pending_record: SaveRecord | None = None
        self._retry_at: int | None = None

    # -- queries (local, no communication) ----------------------------------------------------

    @property
    def busy(self) -> bool:
        """This rank's background save work is still running."""
        return self._pending is not None and self._pending.busy

    @property
    def in_flight(self) -> int | None:
        """The step of the background save in flight, if any."""
        return self._pending.step if self._pending is not None else None

    def due(self, step: int) -> bool:
        return step % self.interval_steps == 0 or step == self._retry_at

    def resumed(self, step: int, completed_at: float | None = None) -> None:
        """The run resumed from the complete checkpoint of ``step``, marked complete at
        ``completed_at`` (Unix seconds; None if unknown)."""
        self.checkpoint_step = step
        self.checkpoint_time = completed_at

    def checkpoint_age_s(self, now: float | None = None) -> float | None:
        """Seconds from the newest durable checkpoint to ``now`` (default: the wall clock);
        None when there is none or its time is unknown. Never negative (hosts' clocks may
        differ slightly)."""
        if self.checkpoint_time is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.checkpoint_time)

    # -- the training loop's calls ----------------------------------------------------------

    def before_update(self) -> float:
        """Wait until a background save has copied the state (the optimizer may then change
        it); returns the seconds waited."""
        if self._pending is None:
            return 0.0
        t0 = time.perf_counter()
        self._pending.wait_staged()
        return self._charge(time.perf_counter() - t0)

    def at_step(
        self,
        step: int,
        flags: StepFlags,
        model: nn.Module,
        optimizer: Optimizer,
        data_state: Any,
    ) -> float:
        """After optimizer step ``step`` (not a stop): complete a background save that every
        rank has finished, then save if asked to or due. Returns the seconds spent (stall)."""
        t0 = time.perf_counter()
        if self._pending is not None and flags.saves_done:
            self._advance(step)
        if flags.checkpoint_now:
            log.info("checkpoint requested (rebalance recommendation): saving step %d", step)
            self._save(step, model, optimizer, data_state, reason="requested")
        elif self.due(step):
            reason = "interval" if step % self.interval_steps == 0 else "retry"
            self._save(step, model, optimizer, data_state, reason=reason)
        return time.perf_counter() - t0

    def finish(
        self, step: int, model: nn.Module, optimizer: Optimizer, data_state: Any
    ) -> str | None:
        """The last save of the run: make ``step`` durable. Returns None when it is (or when
        nothing was ever trained), else the error of the last attempt."""
        t0 = time.perf_counter()
        try:
            self._drain(step)
            if self.checkpoint_step == step or (step == 0 and self.checkpoint_step is None):
                return None
            return self._save_with_retries(step, model, optimizer, data_state)
        finally:
            self.final_save_s = time.perf_counter() - t0

    def summary(self) -> dict[str, Any]:
        stalls = [r.stall_s for r in self.records]
        return {
            "mode": "async" if self.async_save else "sync",
            "checkpoint_step": self.checkpoint_step,
            "saved_steps": [r.step for r in self.records if r.saved],
            "failed_steps": [r.step for r in self.records if r.saved is False],
            "stall_s_max": max(stalls) if stalls else None,
            "stall_s_mean": sum(stalls) / len(stalls) if stalls else None,
            "final_save_s": self.final_save_s,
            "saves": [asdict(r) for r in self.records],
        }

    # -- internals ---------------------------------------------------------------------------

    def _charge(self, seconds: float) -> float:
        if self._pending_record is not None:
            self._pending_record.stall_s += seconds
        return seconds

    def _save(
        self,
        step: int,
        model: nn.Module,
        optimizer: Optimizer,
        data_state: Any,
        *,
        reason: str,
    ) -> None:
        if self._pending is not None:
            if self._pending.step == step:
                return  # Already being saved (a request at the step of an interval save).
            self._drain(step)  # One background save at a time.
        record = SaveRecord(step, "async" if self.async_save else "sync", reason)
        self.records.append(record)
        t0 = time.perf_counter()
        pending = None
        try:
            if self.async_save:
                pending = self.checkpointer.start_async(step, model, optimizer, data_state)
            else:
                self.checkpointer.save(step, model, optimizer, data_state)
        except CheckpointStorageError as e:
            record.stall_s += time.perf_counter() - t0
            self._failed(record, e, now=step)
            return
        record.stall_s += time.perf_counter() - t0
        if pending is None:
            self._done(record)  # Saved (or already complete: resumed at this step).
        else:
            self._pending, self._pending_record = pending, record

    def _advance(self, now: int) -> None:
        """Every rank's background work of the current phase is done: take the next phase."""
        pending, record = self._pending, self._pending_record
        assert pending is not None and record is not None
        t0 = time.perf_counter()
        try:
            complete = self.checkpointer.advance(pending) is not None
        except CheckpointStorageError as e:
            record.stall_s += time.perf_counter() - t0
            self._pending = self._pending_record = None
            self._failed(record, e, now=now)
            return
        record.stall_s += time.perf_counter() - t0
        if complete:
            self._pending = self._pending_record = None
            self._done(record)

    def _drain(self, now: int) -> None:
        """Wait for the background save in flight and complete it (every rank calls this at
        the same step, so no flag is needed to agree)."""
        while self._pending is not None:
            record = self._pending_record
            t0 = time.perf_counter()
            self._pending.wait()
            if record is not None:
                record.stall_s += time.perf_counter() - t0
            self._advance(now)

    def _done(self, record: SaveRecord) -> None:
        record.saved = True
        self.checkpoint_step = record.step
        self.checkpoint_time = time.time()
        self._retry_at = None
        log.info(
            "checkpoint step %d complete (%s, %s): the training loop stalled %.3fs for it",
            record.step, record.mode, record.reason, record.stall_s,
        )  # fmt: skip

    def _failed(self, record: SaveRecord, error: CheckpointStorageError, *, now: int) -> None:
        record.saved, record.error = False, str(error)
        self._retry_at = now + min(self.interval_steps, RETRY_AFTER_STEPS)
        if record.reason == "final":
            return  # The caller retries and reports.
        log.warning(
            "checkpoint step %d NOT saved: %s. Training goes on; next attempt at step %d",
            record.step, error, min(self._retry_at, _next_multiple(now, self.interval_steps)),
        )  # fmt: skip

    def _save_with_retries(
        self, step: int, model: nn.Module, optimizer: Optimizer, data_state: Any
    ) -> str | None:
        deadline = time.monotonic() + self.final_retry_s  # Read on rank 0 only.
        backoff = 1.0
        while True:
            record = SaveRecord(step, "sync", "final")
            self.records.append(record)
            t0 = time.perf_counter()
            try:
                self.checkpointer.save(step, model, optimizer, data_state)
            except CheckpointStorageError as e:
                record.stall_s += time.perf_counter() - t0
                self._failed(record, e, now=step)
                error = str(e)
            else:
                record.stall_s += time.perf_counter() - t0
                self._done(record)
                return None
            give_up = self.checkpointer.from_rank0(
                partial(_past, deadline, backoff), "deciding whether to retry"
            )
            if give_up:
                log.error(
                    "checkpoint step %d NOT saved after retrying for %.0fs: %s",
                    step, self.final_retry_s, error,
                )  # fmt: skip
                return error
            log.warning(
                "checkpoint step %d NOT saved (%s); retrying in %.0fs", step, error, backoff
            )
            time.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)


def _next_multiple(step: int, interval: int) -> int:
    return (step // interval + 1) * interval


def _past(deadline: float, wait_s: float) -> bool:
    """Whether waiting ``wait_s`` more would pass ``deadline`` (a monotonic time)."""
    return time.monotonic() + wait_s > deadline
