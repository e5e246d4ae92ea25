"""A trainer rank's progress as its launcher watches it for hangs, and its stacks on request.

Each rank run with ``--outcome-dir`` (the launcher's generations) writes, in that folder:

- ``progress-<RANK>.json``: ``{"rank", "pid", "step", "phase", "time", "step_s"}``: the wall
  time of its last progress, what it was doing (``PHASES``) and the median of its recent step
  times. Written atomically (a small file renamed into place) at each step, each evaluation
  batch and each change of phase, so it names the exact step a rank got stuck after. A data
  wait is not progress: a rank stuck on data (or in a collective, or anywhere else) stops
  writing.
- ``stacks-<RANK>.txt``: the Python stacks of every thread of the rank, appended by
  ``faulthandler`` each time the rank receives ``STACKS_SIGNAL``. faulthandler writes from its
  signal handler, in C, so a rank stuck in C code (a collective, a read) still answers; a
  process that is stopped (SIGSTOP) or in uninterruptible sleep (a wedged driver) does not.

``training.launcher.hang_watch`` reads both.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from training.common.files import write_atomically

STACKS_SIGNAL = signal.SIGUSR2
"""Asks a rank for its stacks (faulthandler appends them to ``stacks-<RANK>.txt``)."""
STEP_TIMES_KEPT = 64
"""The median step time is taken over this many recent steps."""
PHASES = ("start", "resumed", "train", "eval", "final-checkpoint", "export", "done")
"""What a rank says it is doing: started (before torch, the process group, the model), resumed
(its checkpoint loaded), a training step done, an evaluation batch done, its last checkpoint,
the model's export, and finished with all of them."""


def progress_path(folder: Path, rank: int) -> Path:
    return folder / f"progress-{rank}.json"


def stacks_path(folder: Path, rank: int) -> Path:
    return folder / f"stacks-{rank}.txt"


def clear_progress(folder: Path) -> None:
    """Remove a previous generation's progress and stacks files."""
    if folder.is_dir():
        for pattern in ("progress-*.json", "stacks-*.txt"):
            for p in folder.glob(pattern):
                p.unlink(missing_ok=True)


@dataclass(frozen=True)
class RankProgress:
    """One rank's last progress, as read back from its file."""

    rank: int
    pid: int
    step: int
    phase: str
    time: float
    """Epoch seconds of its last progress."""
    step_s: float | None
    """The median of its recent step times (None: fewer than two steps yet)."""


def read_progress(folder: Path) -> dict[int, RankProgress]:
    """Every rank's last progress in ``folder``, by rank (a torn or foreign file is skipped)."""
    found: dict[int, RankProgress] = {}
    for p in sorted(folder.glob("progress-*.json")) if folder.is_dir() else []:
        try:
            d = json.loads(p.read_text())
            step_s = d.get("step_s")
            got = RankProgress(
                rank=int(d["rank"]), pid=int(d["pid"]), step=int(d["step"]),
                phase=str(d["phase"]), time=float(d["time"]),
                step_s=float(step_s) if step_s is not None else None,
            )  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found[got.rank] = got
    return found


class ProgressWriter:
    """A rank's ``progress-<RANK>.json`` and its stacks on ``STACKS_SIGNAL`` (see the module
    docstring). With no folder it writes nothing (a run without a launcher watching it)."""

    def __init__(
        self, folder: Path | None, rank: int, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.folder = folder
        self.rank = rank
        self.clock = clock
        self._last_step: tuple[int, float] | None = None
        self._step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self._stacks: IO[Any] | None = None

    def install_stacks(self) -> ProgressWriter:
        """From now on ``STACKS_SIGNAL`` appends every thread's stack to ``stacks-<RANK>.txt``."""
        if self.folder is not None and self._stacks is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._stacks = open(stacks_path(self.folder, self.rank), "a")  # noqa: SIM115
            faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True)
        return self

    def close(self) -> None:
        if self._stacks is not None:
            faulthandler.unregister(STACKS_SIGNAL)
            with contextlib.suppress(OSError):
                self._stacks.close()
            self._stacks = None

    def beat(self, step: int, phase: str) -> None:
        """Progress: ``step`` reached in ``phase`` (one of ``PHASES``)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
        now = self.clock()
        if phase == "train":
            last = self._last_step
            if last is not None and step == last[0] + 1:
                self._step_times.append(now - last[1])
            self._last_step = (step, now)
        self._write(step, phase, now)

    @property
    def step_s(self) -> float | None:
        """The median of the recent step times (None: fewer than two steps yet)."""
        return statistics.median(self._step_times) if self._step_times else None

    def _write(self, step: int, phase: str, now: float) -> None:
        if self.folder is None:
            return
        body = {
            "rank": self.rank, "pid": os.getpid(), "step": step, "phase": phase, "time": now,
            "step_s": self.step_s,
        }  # fmt: skip
        with contextlib.suppress(OSError):  # progress is a hint: never a reason to fail a step
            write_atomically(progress_path(self.folder, self.rank), json.dumps(body))
