"""Augmentation workers die with their data server, also when it is SIGKILLed.

A data server's workers are children of multiprocessing's forkserver, which is a child of the
server. Nothing tells them when the server is killed: the forkserver waits for its "alive" pipe
to close, but every worker holds a copy of that pipe, and the workers keep waiting for work. So
they all ran on as orphans (seen: forkserver, workers and resource tracker). The kernel's parent
death signal (Linux ``PR_SET_PDEATHSIG``) breaks the loop: the forkserver is SIGKILLed when the
server dies, and each worker when the forkserver dies.

``PR_SET_PDEATHSIG`` fires when the *thread* that started the process exits, so the forkserver
must be started by a thread that lives as long as the server (``start_guarded_forkserver`` from
the main thread); the forkserver forks every worker from its only thread.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys

log = logging.getLogger(__name__)

# The server's pid, for the forkserver it starts (set only while starting it); and the
# forkserver's pid, which the workers it forks inherit.
SERVER_PID_ENV = "HETERO_FORKSERVER_PARENT_PID"
FORKSERVER_PID_ENV = "HETERO_FORKSERVER_PID"
# Imported by the forkserver before it forks anything (see forkserver_guard.py).
_GUARD_MODULE = "training.dataplane.forkserver_guard"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits. Returns False where
    that is not available (not Linux) or the call failed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
            return False
    except (OSError, AttributeError) as e:
        log.warning("prctl(PR_SET_PDEATHSIG) is not available: %s", e)
        return False
    return True


def die_with_parent(expected_parent_pid: int | None) -> None:
    """From now on this process is SIGKILLed when its parent exits. If the parent has already
    exited (this process's parent is no longer ``expected_parent_pid``; None: unknown, not
    checked), this process exits at once: the signal would never come."""
    if not set_parent_death_signal(signal.SIGKILL):
        return
    # The parent may have died before the prctl call; then the signal will never be sent.
    if expected_parent_pid is not None and os.getppid() != expected_parent_pid:
        os._exit(1)


def _pid_from_env(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def guard_this_forkserver() -> None:
    """Run in the forkserver (its preload): die with the server that started it, and tell the
    workers it forks which pid their parent has (``forkserver_pid``)."""
    server_pid = _pid_from_env(SERVER_PID_ENV)
    if server_pid is None:  # not started by start_guarded_forkserver
        return
    os.environ.pop(SERVER_PID_ENV, None)
    die_with_parent(server_pid)
    os.environ[FORKSERVER_PID_ENV] = str(os.getpid())


def forkserver_pid() -> int | None:
    """In a process forked by a guarded forkserver: that forkserver's pid; otherwise None."""
    return _pid_from_env(FORKSERVER_PID_ENV)


def start_guarded_forkserver() -> None:
    """Start this process's multiprocessing forkserver (if it is not running yet) so that it dies
    with this process. Call it from a thread that lives as long as this process (the main
    thread): the kernel's signal follows the thread that started the forkserver."""
    multiprocessing.set_forkserver_preload(["__main__", _GUARD_MODULE])
    # The forkserver inherits the environment at its start; the variable tells it who to follow.
    previous = os.environ.get(SERVER_PID_ENV)
    os.environ[SERVER_PID_ENV] = str(os.getpid())
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if previous is None:
            os.environ.pop(SERVER_PID_ENV, None)
        else:
            os.environ[SERVER_PID_ENV] = previous


def init_worker_lifetime() -> None:
    """In a worker process (its pool initializer): die with the forkserver that forked it (and
    through it, with the data server)."""
    parent = forkserver_pid()
    # Not for this worker's own children (it has no forkserver of its own).
    os.environ.pop(FORKSERVER_PID_ENV, None)
    die_with_parent(parent)
