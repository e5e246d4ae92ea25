"""A rank's progress file and its stacks on request (training.common.progress), and the hang
watch that reads them (training.launcher.hang_watch), with real processes: one stuck in a
sleep (it answers with its stacks), one stopped (it cannot), one that never said anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from frozen import freeze

from training.common.progress import ProgressWriter, progress_path, read_progress
from training.launcher.hang_watch import HangWatch

REPO = Path(__file__).resolve().parents[2]
RANK = r"""
import sys, time
from pathlib import Path
from training.common.progress import ProgressWriter
progress = ProgressWriter(Path(sys.argv[1]), int(sys.argv[2])).install_stacks()
progress.beat(0, "start")
progress.beat(7, "train")
def waiting_for_a_peer():
    print("ready", flush=True)
    time.sleep(120)
waiting_for_a_peer()
"""


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Rank 3: its progress at step 7, then stuck in ``waiting_for_a_peer``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK, str(tmp_path), "3"], cwd=REPO, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_stuck_rank_answers_with_its_stacks(rank: subprocess.Popen[str], tmp_path: Path) -> None:
    watch = HangWatch(tmp_path, generation=4, floor_s=0.5, stacks_wait_s=5.0)
    assert watch.check([rank.pid]) is None  # just written: not yet
    time.sleep(0.6)
    hang = watch.check([rank.pid])
    assert hang is not None and hang.generation == 4 and hang.frozen == []
    (found,) = hang.ranks
    assert (found.rank, found.pid, found.step, found.phase) == (3, rank.pid, 7, "train")
    assert found.answered and found.process == "sleeping"
    assert "in waiting_for_a_peer" in found.stacks and "thread 0x" in found.stacks
    assert hang.reason().startswith("hung: no training progress for ")
    assert "rank 3 at step 7 (train): stacks written" in hang.reason()
    assert rank.poll() is None  # asked, not killed: the launcher decides
    assert watch.check([rank.pid]) is None  # once per generation


def test_a_stopped_rank_cannot_answer(rank: subprocess.Popen[str], tmp_path: Path) -> None:
    freeze(rank.pid)
    watch = HangWatch(tmp_path, generation=1, floor_s=0.0, stacks_wait_s=0.5)
    hang = watch.check([rank.pid])
    assert hang is not None
    assert [(r.rank, r.asked, r.answered, r.process, r.stacks) for r in hang.frozen] == [
        (3, True, False, "stopped", "")
    ]
    assert "rank 3 at step 7 (train): no stacks (process stopped)" in hang.reason()


def test_the_limit_is_the_larger_of_the_floor_and_k_median_steps(
    rank: subprocess.Popen[str], tmp_path: Path
) -> None:
    body = json.loads(progress_path(tmp_path, 3).read_text())
    body["step_s"] = 0.2
    progress_path(tmp_path, 3).write_text(json.dumps(body))
    watch = HangWatch(tmp_path, generation=1, after_steps=5, floor_s=0.3, stacks_wait_s=0.5)
    assert watch.limit_s(read_progress(tmp_path)) == pytest.approx(1.0)
    assert watch.check([rank.pid]) is None  # the ranks seen running: the silence counts from now
    time.sleep(0.5)
    assert watch.check([rank.pid]) is None  # past the floor, within five median steps
    time.sleep(0.6)
    assert watch.check([rank.pid]) is not None


def test_a_process_that_never_wrote_is_not_signalled(tmp_path: Path) -> None:
    """Before its handler is installed, the stacks signal would end the rank: not sent. And
    before any step, the limit is twice the floor (a start is slower than a step)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = HangWatch(tmp_path, generation=1, floor_s=0.2, stacks_wait_s=0.3)
        assert watch.limit_s({}) == pytest.approx(0.4)
        assert watch.check([proc.pid]) is None  # the silence counts from the ranks' start
        time.sleep(0.25)
        assert watch.check([proc.pid]) is None  # past the floor, not twice it
        time.sleep(0.25)
        hang = watch.check([proc.pid])
        assert hang is not None
        (found,) = hang.ranks
        assert (found.rank, found.asked, found.answered) == (None, False, False)
        assert f"pid {proc.pid}: not asked for stacks: no handler for the signal" in hang.reason()
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_progress_is_written_at_each_step_with_the_median_step_time(tmp_path: Path) -> None:
    now = [100.0]
    writer = ProgressWriter(tmp_path, 2, clock=lambda: now[0])
    writer.beat(0, "resumed")
    assert read_progress(tmp_path)[2].step_s is None
    for step in range(1, 5):
        now[0] += 0.25
        writer.beat(step, "train")
    got = read_progress(tmp_path)[2]
    assert (got.step, got.phase, got.time) == (4, "train", 101.0)
    now[0] += 1.0
    writer.beat(5, "train")
    got = read_progress(tmp_path)[2]
    assert (got.step, got.time, got.pid) == (5, 102.0, os.getpid())
    assert got.step_s == pytest.approx(0.25)  # the median: one 1 s step among 0.25 s ones
    writer.beat(5, "eval")
    assert read_progress(tmp_path)[2].phase == "eval"
    with pytest.raises(ValueError, match="unknown phase 'waiting'"):
        writer.beat(5, "waiting")
