"""The next step's first batch, taken from the input while the GPU still runs this step.

The trainer reads each step's loss and gradient norm on the host before it applies the step
(``training.trainer.nonfinite``): that read waits for the GPU to finish the step. Whatever the
host does between that read and the next step's first kernel leaves the GPU idle, and taking a
batch from the input is most of it. So the trainer takes the next step's first batch *before*
the read (``take_ahead``), while the GPU is still busy, and holds it.

Holding it changes nothing the loop or a checkpoint can see: ``state_dict`` and ``epoch`` are the
input's as they were before the held batch was taken (a checkpoint made now resumes at that
batch), ``next`` hands the held batch out first, and an ``EndOfData`` or ``DataInterrupted`` met
while taking ahead is raised by the ``next`` call it belongs to.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from training.data.batch import Batch
from training.trainer.stream import BatchStream, DataInterrupted, EndOfData


@dataclass(frozen=True)
class _Held:
    state: dict[str, Any]  # the input's position before this batch
    epoch: int  # the input's epoch before this batch
    batch: Batch | None
    error: DataInterrupted | EndOfData | None


class Lookahead:
    """A ``BatchStream``'s ``next``, ``state_dict`` and ``epoch`` with at most one batch held."""

    def __init__(self, stream: BatchStream) -> None:
        self.stream = stream
        self._held: _Held | None = None

    def take_ahead(self) -> float:
        """Take the next batch (or the end, or an interruption) now; the seconds it waited."""
        if self._held is not None:
            return 0.0
        state, epoch = self.stream.state_dict(), self.stream.epoch
        started = time.perf_counter()
        batch, error = None, None
        try:
            batch = self.stream.next()
        except (DataInterrupted, EndOfData) as e:
            error = e
        self._held = _Held(state, epoch, batch, error)
        return time.perf_counter() - started

    def next(self) -> Batch:
        held, self._held = self._held, None
        if held is None:
            return self.stream.next()
        if held.error is not None:
            raise held.error
        assert held.batch is not None
        return held.batch

    @property
    def epoch(self) -> int:
        return self._held.epoch if self._held is not None else self.stream.epoch

    def state_dict(self) -> dict[str, Any]:
        return self._held.state if self._held is not None else self.stream.state_dict()
