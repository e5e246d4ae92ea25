"""Signals the training loop acts on at a step boundary, and the one collective that makes every
rank act on the same step.

- SIGTERM (Spot interruption, Auto Scaling termination, forwarded by the launcher) and SIGINT:
  checkpoint at the next step boundary and stop (``training.common.outcome.EXIT_STOPPED``).
- SIGUSR1 (a rebalance recommendation: this instance is at elevated risk of interruption):
  checkpoint at the next step boundary and keep training.

Ranks may receive a signal at different steps, so once per step they all-reduce (MAX) a few
flags on a CPU (gloo) group: stop, void (this step must not be applied), checkpoint now,
"my background save is still busy" (its MAX is true while any rank's is), "my loss or
gradient norm is not finite" (no rank applies the step: ``training.trainer.nonfinite``) and "my
batches held unreadable samples" (every rank then learns their names:
``training.trainer.unreadable``). One small collective per step, and no rank leaves a collective
the others are still in.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
CHECKPOINT_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class StepFlags:
    """What every rank agreed on at one step boundary (the same on every rank)."""

    stop: bool
    """Some rank was asked to stop: checkpoint and stop at this step."""
    void: bool
    """Some rank has no data for this step: no rank applies it."""
    checkpoint_now: bool
    """Some rank was asked for a checkpoint (SIGUSR1): every rank saves this step."""
    saves_done: bool
    """No rank has background checkpoint work in flight."""
    nonfinite: bool = False
    """Some rank's loss or gradient norm is not finite: no rank applies this step."""
    unreadable: bool = False
    """Some rank met unreadable samples since the last step: every rank shares them now."""


class StopSignal:
    """Records SIGTERM/SIGINT (stop) and SIGUSR1 (checkpoint now); ``agree()`` tells every rank
    what any rank got, over ``group`` (None: the default group, which must then be a CPU/gloo
    one)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self._event = threading.Event()
        self._signum: int | None = None
        self._group = group
        self._previous: dict[int, object] = {}
        # Counters, not a flag: a request that arrives while the ranks agree on an earlier one
        # is not lost.
        self._checkpoint_requests = 0
        self._checkpoint_served = 0

    def install(self) -> StopSignal:
        """Handle SIGTERM, SIGINT and SIGUSR1 in this (main) thread from now on."""
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._previous[CHECKPOINT_SIGNAL] = signal.signal(CHECKPOINT_SIGNAL, self._checkpoint)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before ``install``."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: the loop decides when it is safe to stop.
        if not self._event.is_set():
            self._signum = signum
            self._event.set()

    def _checkpoint(self, signum: int, frame: FrameType | None) -> None:
        self._checkpoint_requests += 1

    @property
    def local(self) -> bool:
        """True once this process got a stop signal (no communication)."""
        return self._event.is_set()

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The CPU group the ranks agree over (None: the default group)."""
        return self._group

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self._signum).name if self._signum is not None else None

    def request(self) -> None:
        """Ask for a stop as if a signal had arrived (used for ``--max-seconds``)."""
        self._event.set()

    def agree(
        self,
        void: bool = False,
        save_busy: bool = False,
        nonfinite: bool = False,
        unreadable: bool = False,
    ) -> StepFlags:
        """The flags of every rank combined, the same on every rank (one collective).
        ``void``: this rank has no data for this step; ``save_busy``: this rank's background
        checkpoint work has not finished; ``nonfinite``: this rank's loss or gradient norm is
        not finite; ``unreadable``: this rank met unreadable samples not yet shared."""
        requests = self._checkpoint_requests
        wants_checkpoint = requests > self._checkpoint_served
        local = (self.local, void, wants_checkpoint, save_busy, nonfinite, unreadable)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flags = torch.tensor([int(v) for v in local], dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
            stop, any_void, checkpoint, busy, bad, skipped = (bool(v) for v in flags.tolist())
        else:
            stop, any_void, checkpoint, busy, bad, skipped = local
        if checkpoint:
            # Served by the save every rank now makes, whoever asked for it.
            self._checkpoint_served = requests
        if stop and not self.local:
            log.info("another rank is stopping: stopping at this step too")
        return StepFlags(
            stop=stop, void=any_void, checkpoint_now=checkpoint, saves_done=not busy,
            nonfinite=bad, unreadable=skipped,
        )  # fmt: skip
