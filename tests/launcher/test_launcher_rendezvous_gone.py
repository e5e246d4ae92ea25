"""A generation whose rendezvous waits for a member that no longer runs (its boot gave up, it was
lost) is stopped at the next heartbeat, so the loop re-forms without it instead of waiting out
torchrun's rendezvous timeout; once torchrun has started its ranks, nothing changes."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import psutil

from training.launcher.ec2_watches import stop_if_a_member_cannot_join
from training.launcher.rank_signals import Signals
from training.processes.supervisor import Supervisor

from .test_launcher_supervisor import wait_for

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
# torchrun after its rendezvous: it has started a rank (its child), which writes its pid.
WITH_RANK = """
import pathlib, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path(sys.argv[1]).write_text(str(rank.pid))
time.sleep(600)
"""
RUNNING = {"trainer": [{"InstanceId": "i-a"}], "dataprep": [{"InstanceId": "i-d"}]}


def test_a_gone_member_stops_a_generation_still_in_its_rendezvous() -> None:
    signals = Signals()
    with Supervisor(grace_s=5) as sup, signals.attached(sup):
        torchrun = sup.start("trainer", SLEEP, stop_workers=True)
        assert not sup.ranks_started()
        # Every member runs: the rendezvous may still complete.
        assert not stop_if_a_member_cannot_join(signals, RUNNING, ["i-a"])
        assert torchrun.returncode is None
        # i-b no longer runs (not in the listing): stopped, at once.
        started = time.monotonic()
        assert stop_if_a_member_cannot_join(signals, RUNNING, ["i-a", "i-b"])
        assert sup.run_until_done() == [128 + signal.SIGTERM]
    assert time.monotonic() - started < 5
    assert sup.stop_reason == "member(s) i-b gone before the rendezvous"


def test_once_the_ranks_run_a_gone_member_is_left_to_the_collectives(tmp_path: Path) -> None:
    signals = Signals()
    with Supervisor(grace_s=5) as sup, signals.attached(sup):
        other = sup.start("other", [sys.executable, "-c", WITH_RANK, str(tmp_path / "o")])
        wait_for(tmp_path / "o")
        # Only torchrun's children count (stop_workers): this child's do not.
        assert not sup.ranks_started()
        torchrun = sup.start("trainer", [sys.executable, "-c", WITH_RANK, str(tmp_path / "t")],
                             stop_workers=True)  # fmt: skip
        rank = psutil.Process(wait_for(tmp_path / "t"))
        assert sup.ranks_started()
        assert not stop_if_a_member_cannot_join(signals, RUNNING, ["i-a", "i-b"])
        assert torchrun.returncode is None and rank.is_running() and other.returncode is None
        sup.request_stop(signal.SIGTERM, "test over")
        sup.run_until_done()


def test_between_generations_nothing_is_stopped() -> None:
    assert not stop_if_a_member_cannot_join(Signals(), RUNNING, ["i-a", "i-b"])
