"""Augmentation workers die with their data server, also when it is SIGKILLed (Linux)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from training.dataplane.processes import start_server_process

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only"
)


def _kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def test_sigkilled_server_takes_its_forkserver_and_workers_along(spec_path: Path) -> None:
    server = start_server_process(spec_path, workers=2)
    descendants: list[psutil.Process] = []
    try:
        descendants = psutil.Process(server.process.pid).children(recursive=True)
        cmdlines = [" ".join(p.cmdline()) for p in descendants]
        # The forkserver and its two workers (all three run the forkserver's command line).
        assert sum("multiprocessing.forkserver" in c for c in cmdlines) == 3, cmdlines
        server.process.send_signal(signal.SIGKILL)
        assert server.process.wait(timeout=10) == -signal.SIGKILL
        _, alive = psutil.wait_procs(descendants, timeout=10)
        assert not alive, "still running after the server was killed: " + ", ".join(
            f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in alive
        )
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
        _kill_all(descendants)


_CHILD = """
import sys, time
from training.dataplane.lifetime import die_with_parent
die_with_parent(int(sys.argv[1]))
print("guarded", flush=True)
time.sleep(60)
"""

# Starts _CHILD (its stdout is the same pipe) and prints the child's pid.
_PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_process_dies_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, _CHILD], stdout=subprocess.PIPE, text=True
    )
    child: psutil.Process | None = None
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        # The child prints once its parent death signal is set.
        assert parent.stdout.readline().strip() == "guarded"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        _, alive = psutil.wait_procs([child], timeout=10)
        assert not alive, "the child outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None:
            _kill_all([child])


def test_process_whose_parent_is_already_gone_exits_at_once() -> None:
    # The parent died before the signal was set (the race): the pid it expects is not its
    # parent's, so it must exit rather than wait for a signal that will never come.
    not_the_parent = 1
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(not_the_parent)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1 and "guarded" not in done.stdout
