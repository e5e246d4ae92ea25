"""A data server's budget check (``tier_budget``): on a real job record in a folder, and in the
data server's launcher loop (``Ec2Job``) against moto."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from training.common.jobrecord import JobRecord
from training.common.outcome import EXIT_STOPPED
from training.costs.budget import Budget, JobClock
from training.launcher.tier_budget import TierBudgetWatch

from .conftest import FakeImds
from .test_launcher_ec2_job import URI, cluster, desired  # noqa: F401 (a fixture)
from .test_launcher_trainer_watch import Clock, _write, data_server_job

BUDGET = Budget(max_hours=0.01, max_usd=None, usd_per_hour=2.0)  # 36 s


def watch(record: JobRecord, started: float, now: Clock) -> TierBudgetWatch:
    clock = JobClock(BUDGET, record, lambda: None)
    record.started(started)  # started.json: the job's clock for every host
    return TierBudgetWatch(clock, record, {"trainer"}, live_s=60.0, grace_s=120.0, now=now)


def test_a_budget_not_yet_spent_ends_nothing(tmp_path: Path) -> None:
    record = JobRecord(str(tmp_path))
    assert watch(record, time.time() - 30.0, Clock(time.time())).check() is None


def test_spent_with_no_live_trainer_ends_the_job_at_once(tmp_path: Path) -> None:
    """The trainer host last wrote 61 s ago (live_s 60): nobody will stop the job but us."""
    record = JobRecord(str(tmp_path))
    now = time.time()
    _write(record, "i-t1", "trainer", now - 61.0)
    _write(record, "i-d1", "dataprep", now)  # a data server is no trainer
    reason = watch(record, now - 40.0, Clock(now)).check()
    assert reason is not None
    assert reason.startswith("budget: max_hours 0.01 reached (0.02")
    assert reason.endswith(" h at 2.00 USD/h); continue with hetero job start --resume")


def test_a_live_trainer_has_the_grace_to_save_then_the_data_server_ends_it(
    tmp_path: Path,
) -> None:
    now = time.time()
    early, late = JobRecord(str(tmp_path / "early")), JobRecord(str(tmp_path / "late"))
    for record in (early, late):
        _write(record, "i-t1", "trainer", now - 1.0)
    # 4 s past the deadline, the trainer wrote 1 s ago: it is saving; serve it.
    assert watch(early, now - 40.0, Clock(now)).check() is None
    # 121 s past the deadline (grace 120): the trainer had its time; still writing or not.
    reason = watch(late, now - 157.0, Clock(now)).check()
    assert reason is not None and reason.startswith("budget: max_hours 0.01 reached (")


def test_an_unreadable_record_waits_for_the_next_beat_within_the_grace(tmp_path: Path) -> None:
    class Broken(JobRecord):
        def hosts(self) -> dict[str, dict[str, object]]:
            raise OSError("S3 unreachable")

    now = time.time()
    assert watch(Broken(str(tmp_path / "a")), now - 40.0, Clock(now)).check() is None
    past_grace = watch(Broken(str(tmp_path / "b")), now - 157.0, Clock(now)).check()
    assert past_grace is not None


def test_no_cap_never_ends(tmp_path: Path) -> None:
    record = JobRecord(str(tmp_path))
    record.started(0.0)  # a job started long ago
    clock = JobClock(Budget(None, None, 2.0), record, lambda: None)
    tier = TierBudgetWatch(clock, record, {"trainer"}, live_s=1, grace_s=1)
    assert tier.check() is None


# -- in the data server's loop (moto's EC2, Auto Scaling and S3; a stand-in server process) ----


def test_a_data_server_alone_past_the_budget_ends_the_job_stopped(
    cluster: dict[str, Any],  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    fake_imds: FakeImds,
) -> None:
    """The budget ran out while no trainer host lives (the trainer group lost its instances):
    within a heartbeat the data server's launcher records ``stopped`` with the budget's reason,
    scales every group to zero, stops its server and exits with EXIT_STOPPED; the no-trainer
    watch (bound 600 s here) did not get to end it failed."""
    spec = cluster["spec"]
    spec = dataclasses.replace(spec, job=dataclasses.replace(spec.job, max_hours=0.01))
    record = JobRecord(URI)
    record.started(time.time() - 37.0)  # 1 s past max_hours 0.01
    # A trainer host's last write, 1 s ago: older than live_s (2 heartbeats, 0.2 s).
    record.set_host("i-trainer0", group="trainer", state="waiting-for-peers", time=time.time() - 1)
    job = data_server_job(cluster, tmp_path, fake_imds, spec=spec, no_trainer_timeout_s=600.0)
    started = time.monotonic()
    assert job.run() == EXIT_STOPPED
    assert time.monotonic() - started < 30
    outcome = JobRecord(URI).outcome()
    assert outcome is not None
    assert (outcome["outcome"], outcome["by"]) == ("stopped", "i-dataprep0")
    assert outcome["reason"].startswith("budget: max_hours 0.01 reached (")
    assert desired(cluster) == {"one-trainer": 0, "one-dataprep": 0}
    assert JobRecord(URI).hosts()["i-dataprep0"]["state"] == "job-stopped"
