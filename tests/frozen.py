"""Freezing a test's process for real: SIGSTOP is queued by ``kill`` and takes effect when each
of the process's threads next runs, so a thread running on another core may still answer one
request after ``kill`` returned. ``freeze`` returns once every thread is stopped."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def thread_states(pid: int) -> list[str]:
    """The scheduler state of each thread of ``pid`` (``/proc/PID/task/*/stat``)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        states.append(stat.rsplit(")", 1)[1].split()[0])
    return states


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped (state ``T``)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while (states := thread_states(pid)) and any(s != "T" for s in states):
        if time.monotonic() >= deadline:
            raise AssertionError(f"process {pid} not stopped after {timeout_s}s: {states}")
        time.sleep(0.01)
