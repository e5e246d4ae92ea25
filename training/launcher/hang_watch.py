"""A trainer generation that hangs: its ranks alive, no progress. Diagnosed, then ended.

Each rank writes its progress into the launcher's outcome folder (``training.common.progress``:
a step, an evaluation batch, a change of phase). At each heartbeat of a trainer generation whose
ranks run, ``HangWatch.check`` asks: has any of this host's ranks made progress within
``limit_s``, the larger of ``after_steps`` times the ranks' median step time and ``floor_s``
(twice that before the generation's first step)? (Counted from the ranks' own start at the
earliest; a rank that has not written yet counts from there too.) A collective that waits for a
peer, a data wait that never ends, a wedged driver: the process lives, torchrun sees nothing
wrong, and the generation would wait for ever.

When none has, the host is hung. Before anything is stopped, every rank is asked for its Python
stacks (``STACKS_SIGNAL``: faulthandler writes them even from inside C code); a rank that does
not answer within ``stacks_wait_s`` is frozen (stopped, or in uninterruptible sleep: its
process state says which). The ``Hang`` (each rank's step, phase, silence, process state and
stacks) is what ``ec2_job`` records, in the run folder and the job record, before the generation
ends (every rank killed: a hung rank would never reach the step boundary where a stop is
honoured) and counts as a failure. A host that hangs again in its next generation with a rank
that does not answer is the one taken out of its group; a host whose ranks all answered was
waiting on something else (a peer in a collective, the data tier), which its stacks name.

``floor_s`` (``HANG_FLOOR_S``) is longer than the trainer's own longest bounded wait, the
checkpoint group's (600 s), so a wait the trainer would end itself is left to it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from training.common.files import write_atomically
from training.common.jobrecord import JobRecord
from training.common.progress import STACKS_SIGNAL, RankProgress, read_progress, stacks_path
from training.launcher.rank_signals import catches

log = logging.getLogger(__name__)

HANG_AFTER_STEPS = 20.0
"""A host is hung after this many median step times without progress (at least ``floor_s``)."""
HANG_FLOOR_S = 900.0
"""The least silence that counts as a hang (``hetero launch --hang-floor``)."""
STACKS_WAIT_S = 10.0
"""How long each rank has to write its stacks once asked."""
STARTING_PHASES = ("start", "resumed")
"""Phases before a generation's first step or evaluation batch."""
STACKS_KEPT_CHARS = 16_000
"""Each rank's stacks kept in the report (the end: the newest dump)."""


@dataclass(frozen=True)
class RankHang:
    """One rank of a hung host, as found."""

    pid: int
    rank: int | None
    """None: the process never wrote its progress (it hung before its start)."""
    step: int | None
    phase: str | None
    silent_s: float
    process: str
    """psutil's state of the process: ``sleeping``, ``running``, ``stopped``, ``disk-sleep``..."""
    asked: bool
    """It was sent ``STACKS_SIGNAL`` (not before it handles it: the signal would end it)."""
    answered: bool
    """It wrote its stacks when asked."""
    stacks: str

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}"
        at = f" at step {self.step} ({self.phase})" if self.step is not None else ""
        if self.answered:
            answer = "stacks written"
        elif self.asked:
            answer = f"no stacks (process {self.process})"
        else:
            answer = f"not asked for stacks: no handler for the signal (process {self.process})"
        return f"{who}{at}: {answer}"


@dataclass(frozen=True)
class Hang:
    """A hung host's ranks, found in ``generation``."""

    generation: int
    silent_s: float
    limit_s: float
    ranks: tuple[RankHang, ...]
    time: float

    @property
    def frozen(self) -> list[RankHang]:
        """The ranks that did not answer the request for their stacks."""
        return [r for r in self.ranks if not r.answered]

    def reason(self) -> str:
        ranks = "; ".join(r.describe() for r in self.ranks)
        return (
            f"hung: no training progress for {self.silent_s:.0f} s (limit {self.limit_s:.0f} s); "
            f"{ranks}"
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "reason": self.reason()}

    def text(self) -> str:
        """The report a person reads: the reason, then each rank's stacks."""
        parts = [self.reason(), ""]
        for r in self.ranks:
            parts += [f"== {r.describe()}", r.stacks or "(none)", ""]
        return "\n".join(parts)


class HangWatch:
    """``check(pids)`` returns a ``Hang`` once this host's ranks (``pids``) are past the limit
    without progress, after asking them for their stacks; None otherwise. Once per generation:
    the first ``Hang`` found is kept in ``found``."""

    def __init__(
        self,
        folder: Path,
        *,
        generation: int,
        after_steps: float = HANG_AFTER_STEPS,
        floor_s: float = HANG_FLOOR_S,
        stacks_wait_s: float = STACKS_WAIT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.folder = folder
        self.generation = generation
        self.after_steps = after_steps
        self.floor_s = floor_s
        self.stacks_wait_s = stacks_wait_s
        self.clock = clock
        self.ranks_since: float | None = None
        """When the ranks were first seen running (the silence counts from there at most)."""
        self.found: Hang | None = None

    def limit_s(self, progress: dict[int, RankProgress]) -> float:
        """The silence that is a hang: ``floor_s`` or ``after_steps`` median step times, the
        larger; twice that while no rank has made a step or an evaluation batch yet (a start
        imports torch, joins the process group, builds the model, downloads the checkpoint and
        waits for its first batch, all of it slower than a step)."""
        step_s = max((p.step_s for p in progress.values() if p.step_s is not None), default=0.0)
        limit = max(self.after_steps * step_s, self.floor_s)
        started = any(p.phase not in STARTING_PHASES for p in progress.values())
        return limit if started else 2 * limit

    def check(self, pids: Sequence[int]) -> Hang | None:
        """``pids``: this host's ranks running now (torchrun's children; none: no judgement)."""
        if self.found is not None or not pids:
            return None
        now = self.clock()
        if self.ranks_since is None:
            self.ranks_since = now
        progress = {p.pid: p for p in read_progress(self.folder).values() if p.pid in pids}
        newest = max((p.time for p in progress.values()), default=self.ranks_since)
        silent_s = now - max(newest, self.ranks_since)
        limit_s = self.limit_s({p.rank: p for p in progress.values()})
        if silent_s < limit_s:
            return None
        log.error(
            "no training progress on this host for %.0f s (limit %.0f s): asking its %d rank(s) "
            "for their stacks", silent_s, limit_s, len(pids),
        )  # fmt: skip
        ranks = self._diagnose(pids, progress, now)
        self.found = Hang(self.generation, silent_s, limit_s, tuple(ranks), now)
        return self.found

    def _diagnose(
        self, pids: Sequence[int], progress: dict[int, RankProgress], now: float
    ) -> list[RankHang]:
        """Ask every rank that handles ``STACKS_SIGNAL`` for its stacks; wait for the answers."""
        asked: dict[int, tuple[Path, int]] = {}
        for pid in pids:
            p = progress.get(pid)
            if p is None or not catches(pid, STACKS_SIGNAL):
                continue  # before its handler, the signal would end the rank
            path = stacks_path(self.folder, p.rank)
            asked[pid] = (path, _size(path))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, STACKS_SIGNAL)
        deadline = time.monotonic() + self.stacks_wait_s
        while time.monotonic() < deadline and any(
            _size(path) <= size for path, size in asked.values()
        ):
            time.sleep(0.1)
        ranks = [self._rank(pid, progress.get(pid), asked.get(pid), now) for pid in pids]
        return sorted(ranks, key=lambda r: (r.rank is None, r.rank or 0, r.pid))

    def _rank(
        self, pid: int, p: RankProgress | None, asked: tuple[Path, int] | None, now: float
    ) -> RankHang:
        """What was found of the rank ``pid`` (``asked``: its stacks file and its size before)."""
        stacks = _read_from(*asked) if asked is not None else ""
        since = p.time if p is not None else self.ranks_since or now
        return RankHang(
            pid=pid, rank=p.rank if p else None, step=p.step if p else None,
            phase=p.phase if p else None, silent_s=now - since, process=_state(pid),
            asked=asked is not None, answered=bool(stacks), stacks=stacks,
        )  # fmt: skip


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    """What ``path`` gained after ``offset`` (the end, ``STACKS_KEPT_CHARS`` at most)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return text[-STACKS_KEPT_CHARS:].strip()


def _state(pid: int) -> str:
    try:
        return str(psutil.Process(pid).status())
    except psutil.Error:
        return "gone"


def save_hang(hang: Hang, run_dir: Path, record: JobRecord | None, instance_id: str) -> None:
    """Keep ``hang`` where people look: ``hangs/generation-<N>.txt`` (and ``.json``) in the run
    folder, and ``hangs/<instance-id>-<N>.json`` in the job record (each logged on failure: the
    generation ends all the same)."""
    folder = run_dir / "hangs"
    name = f"generation-{hang.generation}"
    try:
        write_atomically(folder / f"{name}.txt", hang.text())
        write_atomically(folder / f"{name}.json", json.dumps(hang.to_json(), indent=1))
    except OSError as e:
        log.warning("could not write the hang's report into %s: %s", folder, e)
    else:
        log.error("%s (stacks: %s)", hang.reason(), folder / f"{name}.txt")
    if record is not None:
        try:
            record.mark_hung(instance_id, hang.generation, hang.to_json())
        except Exception as e:  # S3 unreachable: the run folder keeps it
            log.warning("could not record the hang in the job record: %s", e)
