"""What reaches an EC2 host's role from outside while ``ec2_job`` runs it: a stop (an
interruption notice, a signal to the launcher, a newer job, a watch that ended the job) goes to
the supervisor of the running generation; a checkpoint request (a rebalance recommendation)
goes to the trainer's ranks as SIGUSR1, once every rank handles it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import psutil

from training.common.jobparam import JobPointer
from training.launcher.spot import SpotNotice
from training.processes.supervisor import Supervisor

log = logging.getLogger(__name__)


@dataclass
class Signals:
    """What arrived from outside while the loop runs: a notice (watch thread) or a signal."""

    notice: SpotNotice | None = None
    signum: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    supervisor: Supervisor | None = None
    checkpoint_requests: int = 0
    superseded: JobPointer | None = None
    """The newer job's pointer, once one was started (``hetero job start``)."""

    @property
    def leaving(self) -> bool:
        return self.notice is not None or self.signum is not None

    @property
    def stopping(self) -> bool:
        """Leaving, or the job was superseded: nothing more may start."""
        return self.leaving or self.superseded is not None

    @contextlib.contextmanager
    def attached(self, sup: Supervisor) -> Iterator[Supervisor]:
        """While the block runs a generation under ``sup``, stops go to it."""
        with self.lock:
            self.supervisor = sup
        try:
            yield sup
        finally:
            with self.lock:
                self.supervisor = None

    def wait(self, sup: Supervisor, superseded: Callable[[], str]) -> list[int]:
        """The generation's processes are started under ``sup``: stop them at once if this host
        is leaving or its job was superseded (``superseded`` says why) meanwhile; wait for them
        to end (``Supervisor.run_until_done``)."""
        if self.leaving:  # A notice between the check and the start.
            sup.request_stop(signal.SIGTERM, "leaving")
        elif self.superseded is not None:  # Likewise, a new job.
            sup.request_stop(signal.SIGTERM, superseded())
        return sup.run_until_done()

    def stop(self, signum: int, reason: str) -> None:
        """Stop the running generation, if one runs (between generations the loop looks at
        what arrived before it starts the next)."""
        with self.lock:
            sup = self.supervisor
        if sup is not None:
            sup.request_stop(signum, reason)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The launcher's SIGTERM and SIGINT handler."""
        with self.lock:
            if self.signum is None:
                self.signum = signum
        self.stop(signum, f"received {signal.Signals(signum).name}")

    def deliver_checkpoint_request(self) -> bool:
        """SIGUSR1 to every rank once all of them handle it (before its handler is installed,
        SIGUSR1 would kill a rank); False while it is still pending."""
        with self.lock:
            sup = self.supervisor
            if not self.checkpoint_requests or sup is None:
                return False
            ranks = [r for c in sup.live() for r in _children(c.pid)]
            if not ranks or not all(catches(r, signal.SIGUSR1) for r in ranks):
                return False
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)  # checkpoint at the next step, go on
            self.checkpoint_requests = 0
        log.info("asked %d rank(s) for a checkpoint", len(ranks))
        return True

    def rank_pids(self) -> list[int]:
        """The running generation's ranks: the children of its torchrun (none between
        generations, or before torchrun has started them)."""
        with self.lock:
            sup = self.supervisor
        if sup is None:
            return []
        return [r for c in sup.live() if c.stop_workers for r in _children(c.pid)]

    def kill_generation(self, reason: str) -> None:
        """Kill the running generation's processes at once (``Supervisor.kill_now``)."""
        with self.lock:
            sup = self.supervisor
        if sup is not None:
            sup.kill_now(reason)

    def deliver_pending(self, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            if self.checkpoint_requests:
                self.deliver_checkpoint_request()


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (torchrun's ranks)."""
    try:
        return [p.pid for p in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def catches(pid: int, sig: int) -> bool:
    """True when process ``pid`` has a handler for ``sig`` (Linux: SigCgt in /proc status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False
