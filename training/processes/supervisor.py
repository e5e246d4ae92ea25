"""Child processes that never outlive the launcher.

Each child starts in its own session (so a terminal's Ctrl-C reaches only the launcher, which
decides what to forward), its descendants are remembered while it runs, and on the way out
anything still alive is terminated, then killed. On Linux the launcher can also become a child
subreaper, so grandchildren orphaned by a crashed parent (torchrun's workers run in sessions of
their own) are re-parented to it and still found.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

import psutil

log = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def exit_code_for_signal(signum: int) -> int:
    """The shell convention for 'stopped by signal N'."""
    return 128 + signum


def shell_code(returncode: int) -> int:
    """Popen's ``-N`` (ended by signal N) as the shell's ``128+N``; other codes unchanged."""
    return exit_code_for_signal(-returncode) if returncode < 0 else returncode


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    stop_workers: bool = False
    """Stop by signalling this process's direct children (torchrun's ranks), not its group."""
    descendants: dict[int, psutil.Process] = field(default_factory=dict)

    def send_stop(self, sig: int) -> None:
        """Deliver a stop signal: to the process group, or to the ranks under ``stop_workers``.

        torchrun answers SIGTERM by signalling each rank's whole process group (DataLoader
        workers included, which then die mid-batch). Signalling the ranks directly lets them
        checkpoint and exit "stopped" (75); torchrun then exits 1, and each rank's outcome file
        (``training.common.outcome``) tells the launcher that the ranks stopped rather than failed.
        """
        if self.stop_workers:
            try:
                ranks = psutil.Process(self.pid).children()
            except psutil.Error:
                ranks = []
            if ranks:
                for rank in ranks:
                    with contextlib.suppress(psutil.Error):
                        rank.send_signal(sig)
                return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()


class Supervisor:
    """Starts children and guarantees that none of them, nor their descendants, is left running.

    Use as a context manager: leaving the block stops every live child (SIGTERM, then SIGKILL
    after ``grace_s``). ``install_signal_handlers`` turns SIGINT/SIGTERM into an orderly stop;
    a second signal kills at once.
    """

    def __init__(self, *, grace_s: float = 30.0, subreaper: bool = False) -> None:
        self.grace_s = grace_s
        self.children: list[Child] = []
        self.stop_signal: int | None = None
        """The signal that asked this launcher to stop, if any."""
        self.stop_reason: str | None = None
        self._subreaper = become_subreaper() if subreaper else False
        # Children this process already had (a multiprocessing forkserver, another supervisor's
        # processes): never taken for orphans of ours when everything is killed.
        self._foreign: set[int] = (
            {p.pid for p in psutil.Process().children()} if self._subreaper else set()
        )
        self._previous_handlers: dict[int, Any] = {}
        self._kill_now = False
        self._terminated_at: float | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.shutdown(self.grace_s)
        finally:
            self.restore_signal_handlers()

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        stdout: IO[Any] | int | None = None,
        stderr: IO[Any] | int | None = None,
        stop_workers: bool = False,
    ) -> Child:
        """Start ``cmd`` in a new session; raises ``OSError`` if it cannot be executed.
        ``stop_workers``: see ``Child.send_stop`` (set it for torchrun)."""
        log.debug("starting %s: %s", name, " ".join(cmd))
        popen = subprocess.Popen(
            list(cmd),
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        child = Child(name, popen, stop_workers=stop_workers)
        self.children.append(child)
        return child

    def live(self) -> list[Child]:
        return [c for c in self.children if c.returncode is None]

    def ranks_started(self) -> bool:
        """Whether a live torchrun child (``stop_workers``) has started its ranks: torchrun starts
        them once its rendezvous has every node."""
        for child in self.live():
            if child.stop_workers:
                with contextlib.suppress(psutil.Error):
                    if psutil.Process(child.pid).children():
                        return True
        return False

    # -- signals -----------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGINT and SIGTERM stop the children (SIGTERM to each child's process group)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_signal is not None:
            # A second Ctrl-C: the user does not want to wait for checkpoints.
            self._kill_now = True
            return
        self.request_stop(signum, f"received {signal.Signals(signum).name}")

    def request_stop(self, signum: int, reason: str) -> None:
        """Ask every live child to stop (SIGTERM), remembering why; safe to call more than once."""
        if self.stop_signal is None:
            self.stop_signal = signum
            self.stop_reason = reason
        self.terminate_once()

    def kill_now(self, reason: str) -> None:
        """Kill every child at once, no grace: a hung role would never reach the point where
        it honours SIGTERM."""
        if self.stop_signal is None:
            self.stop_signal = signal.SIGKILL
            self.stop_reason = reason
        self._kill_now = True

    def terminate_once(self) -> None:
        """SIGTERM every live child, once: a second SIGTERM could cut a checkpoint short."""
        if self._terminated_at is None:
            self._terminated_at = time.monotonic()
            self.signal_children(signal.SIGTERM)

    def signal_children(self, sig: int) -> None:
        """Send ``sig`` to every live child (see ``Child.send_stop``)."""
        # Record the trees first: a parent that dies of this signal no longer shows its children.
        self.poll()
        for child in self.live():
            child.send_stop(sig)

    # -- waiting -----------------------------------------------------------------------------

    def poll(self) -> None:
        """Remember the current descendants of every child (so a dead parent hides nobody)."""
        for child in self.children:
            try:
                for proc in psutil.Process(child.pid).children(recursive=True):
                    child.descendants.setdefault(proc.pid, proc)
            except psutil.Error:
                pass

    def wait(self, child: Child, timeout_s: float | None = None, poll_s: float = 0.2) -> int | None:
        """Wait for ``child`` to exit; its exit code, or None on timeout, once the grace period
        after a stop has run out, or after a second stop signal (kill now)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            code = child.returncode
            if code is not None:
                return code
            if self._kill_now or self._grace_over():
                return None
            if deadline is not None and time.monotonic() >= deadline:
                return None
            self.poll()
            time.sleep(poll_s)

    def wait_all(self, timeout_s: float, poll_s: float = 0.2) -> bool:
        """Wait until every child has exited; False if some are alive after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.live():
            if self._kill_now or time.monotonic() >= deadline:
                return False
            self.poll()
            time.sleep(poll_s)
        return True

    def _grace_over(self) -> bool:
        return (
            self._terminated_at is not None
            and time.monotonic() - self._terminated_at >= self.grace_s
        )

    def run_until_done(self, poll_s: float = 0.2) -> list[int]:
        """Wait for every child. When one fails, or a stop is requested, the others get SIGTERM
        and ``grace_s`` to exit before everything is killed. Returns the exit codes in start
        order, shell style (128+N for a process ended by signal N)."""
        while self.live():
            self.poll()
            failed = [c for c in self.children if c.returncode not in (None, 0)]
            if failed and self._terminated_at is None:
                log.error(
                    "%s exited with code %s; stopping the rest",
                    failed[0].name,
                    failed[0].returncode,
                )
                self.terminate_once()
            if self._kill_now or self._grace_over():
                self.kill_all()
                break
            time.sleep(poll_s)
        return [shell_code(c.popen.wait()) for c in self.children]

    # -- ending ------------------------------------------------------------------------------

    def shutdown(self, grace_s: float) -> None:
        """Stop everything: SIGTERM to live children, wait ``grace_s``, then kill every remaining
        descendant. Returns once no process started through this supervisor is alive."""
        self.poll()
        if self.live():
            names = ", ".join(c.name for c in self.live())
            log.info("stopping %s (grace %.0fs)", names, grace_s)
            self.terminate_once()
            assert self._terminated_at is not None
            left = grace_s - (time.monotonic() - self._terminated_at)
            if not self.wait_all(max(0.0, left)):
                log.warning("killing %s", ", ".join(c.name for c in self.live()))
        self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL every child and every descendant still alive, and reap them."""
        self.poll()
        procs: dict[int, psutil.Process] = {}
        for child in self.children:
            procs.update(child.descendants)
        if self._subreaper:
            # Orphans re-parented to us are ours, unless this process had them before.
            for proc in psutil.Process().children():
                if proc.pid in self._foreign:
                    continue
                procs.setdefault(proc.pid, proc)
                with contextlib.suppress(psutil.Error):
                    for sub in proc.children(recursive=True):
                        procs.setdefault(sub.pid, sub)
        own = {c.pid for c in self.children}
        for child in self.children:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
        stragglers = [p for pid, p in procs.items() if pid not in own and _alive(p)]
        for proc in stragglers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        for child in self.children:
            child.popen.wait()
        # Waiting also reaps zombies that were re-parented to us.
        psutil.wait_procs([p for pid, p in procs.items() if pid not in own], timeout=5)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
