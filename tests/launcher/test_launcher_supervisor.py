"""The supervisor: exit codes mirror the child's, and no descendant survives a stop, even one
whose parent died first or that lives in a session of its own."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import psutil

from training.processes.supervisor import Supervisor, shell_code

# Starts a grandchild in its own session that ignores SIGTERM, writes its pid, then sleeps.
PARENT = """
import subprocess, sys, time, pathlib
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
g = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
pathlib.Path(sys.argv[1]).write_text(str(g.pid))
if sys.argv[2] == "exit":
    sys.exit(0)  # orphan the grandchild
time.sleep(600)
"""


def wait_for(path: Path) -> int:
    deadline = time.monotonic() + 20
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return int(path.read_text())


def test_exit_code_mirrors_the_child() -> None:
    with Supervisor(grace_s=5) as sup:
        sup.start("ok", [sys.executable, "-c", "pass"])
        # A failing child stops the others: "bad" fails only after "ok" has surely exited, or
        # a slow start of "ok" (a loaded machine) gets it SIGTERM (143) instead of its own 0.
        sup.start("bad", [sys.executable, "-c", "import sys, time; time.sleep(1); sys.exit(3)"])
        assert sup.run_until_done() == [0, 3]
    assert shell_code(-signal.SIGKILL) == 137


def test_a_failing_child_stops_the_others() -> None:
    with Supervisor(grace_s=5) as sup:
        slow = sup.start("slow", [sys.executable, "-c", "import time; time.sleep(600)"])
        sup.start("bad", [sys.executable, "-c", "import sys; sys.exit(4)"])
        started = time.monotonic()
        codes = sup.run_until_done()
    assert codes == [128 + signal.SIGTERM, 4]
    assert slow.returncode is not None and time.monotonic() - started < 5


def test_stop_kills_a_grandchild_in_its_own_session(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with Supervisor(grace_s=1) as sup:
        child = sup.start("parent", [sys.executable, "-c", PARENT, str(pid_file), "stay"])
        grandchild = psutil.Process(wait_for(pid_file))
        sup.request_stop(signal.SIGTERM, "test")
        assert sup.wait(child, timeout_s=10) is not None
    # It ignored SIGTERM and was not in the child's process group: killed after the grace.
    assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE


def test_orphaned_grandchild_is_found_through_the_subreaper(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = (
        "import sys, time\n"
        "from training.processes.supervisor import Supervisor\n"
        "with Supervisor(grace_s=1, subreaper=True) as sup:\n"
        f"    c = sup.start('p', [sys.executable, '-c', {PARENT!r}, {str(pid_file)!r}, 'exit'])\n"
        "    sup.wait(c)\n"
        "    time.sleep(0.5)\n"
    )
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", script])
    grandchild = psutil.Process(wait_for(pid_file))
    assert proc.wait(timeout=30) == 0
    assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE


def test_children_the_process_had_before_are_not_taken_for_orphans() -> None:
    # A multiprocessing forkserver started earlier by the same process (e.g. a test session)
    # must survive the supervisor's clean-up; killing it broke every later forkserver user.
    script = (
        "import subprocess, sys\n"
        "from training.processes.supervisor import Supervisor\n"
        "before = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "with Supervisor(grace_s=1, subreaper=True) as sup:\n"
        "    c = sup.start('role', [sys.executable, '-c', 'pass'])\n"
        "    sup.wait(c)\n"
        "print('alive' if before.poll() is None else f'killed {before.returncode}')\n"
        "before.kill(); before.wait()\n"
    )
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "alive", out.stdout + out.stderr
