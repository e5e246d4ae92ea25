"""A data server's watch for trainers: on a real job record in a folder with a fake clock, and
in the data server's launcher loop (``Ec2Job``) against moto."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from training.common.jobrecord import JobRecord
from training.common.outcome import EXIT_FAILED
from training.launcher.backends import Backend
from training.launcher.ec2_job import Ec2Job
from training.launcher.group import GroupIdentity, GroupSource
from training.launcher.loop_settings import LoopSettings
from training.launcher.peers import Peers
from training.launcher.plan import LaunchPlan
from training.launcher.trainer_watch import NoTrainerWatch, newest_trainer_write
from training.processes.roles import RoleCommand
from training.spec import ClusterSpec, Role

from .conftest import FakeImds, ec2_job
from .test_launcher_ec2_job import REGION, URI, cluster, desired  # noqa: F401 (a fixture)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _write(record: JobRecord, instance_id: str, group: str, t: float) -> None:
    """A host's state as set_host writes it, with a chosen time instead of time.time()."""
    path = Path(record.location) / "job" / "hosts" / f"{instance_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"time": t, "instance_id": instance_id, "group": group}))


def test_newest_trainer_write_ignores_other_groups() -> None:
    hosts: dict[str, dict[str, Any]] = {
        "i-a": {"group": "trainer", "time": 10.0},
        "i-b": {"group": "dataprep", "time": 50.0},
        "i-c": {"group": "trainer", "time": 30.0},
        "i-d": {"group": "trainer"},
    }
    assert newest_trainer_write(hosts, {"trainer"}) == (30.0, "i-c")
    assert newest_trainer_write(hosts, {"other"}) == (None, None)


def test_no_trainer_ever_ends_after_the_timeout_from_the_start(tmp_path: Path) -> None:
    record = JobRecord(str(tmp_path))
    clock = Clock(1000.0)
    watch = NoTrainerWatch(record, {"trainer"}, timeout_s=600, clock=clock)
    _write(record, "i-data", "dataprep", 1000.0)  # a data server is no trainer
    clock.now = 1599.0
    assert watch.check() is None
    clock.now = 1600.0
    reason = watch.check()
    assert reason == (
        "no live trainer host for 600 s (job record hosts/: no trainer host wrote since this "
        "data server started); the data servers would serve nobody"
    )


def test_a_trainer_that_writes_keeps_the_job(tmp_path: Path) -> None:
    record = JobRecord(str(tmp_path))
    clock = Clock(1000.0)
    watch = NoTrainerWatch(record, {"trainer"}, timeout_s=600, clock=clock)
    _write(record, "i-t1", "trainer", 1500.0)
    clock.now = 2099.0
    assert watch.check() is None
    clock.now = 2100.0  # 600 s since the trainer's last write
    reason = watch.check()
    assert reason is not None and "the last trainer host to write was i-t1, 600 s ago" in reason


def test_a_trainer_record_older_than_the_start_counts_from_the_start(tmp_path: Path) -> None:
    """A data server that starts late (a replacement) gives trainers the whole timeout."""
    record = JobRecord(str(tmp_path))
    _write(record, "i-t1", "trainer", 100.0)
    clock = Clock(5000.0)
    watch = NoTrainerWatch(record, {"trainer"}, timeout_s=600, clock=clock)
    clock.now = 5599.0
    assert watch.check() is None
    clock.now = 5600.0
    reason = watch.check()
    assert reason is not None and "no trainer host wrote since this data server started" in reason


def test_an_unreadable_record_decides_nothing(tmp_path: Path) -> None:
    class Broken(JobRecord):
        def hosts(self) -> dict[str, dict[str, object]]:
            raise OSError("S3 unreachable")

    clock = Clock(0.0)
    watch = NoTrainerWatch(Broken(str(tmp_path)), {"trainer"}, timeout_s=1, clock=clock)
    clock.now = 100.0
    assert watch.check() is None


# -- in the data server's loop (moto's EC2, Auto Scaling and S3; a stand-in server process) ----

SERVER = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # a data server exits 0 on a stop
while True:
    time.sleep(0.05)
"""


def data_server_job(
    cluster: dict[str, Any],  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    fake_imds: FakeImds,
    *,
    spec: ClusterSpec,
    no_trainer_timeout_s: float,
) -> Ec2Job:
    """The data server's launcher loop on ``cluster``'s dataprep instance, its server a stand-in
    that exits 0 on SIGTERM, every watch beating every 0.1 s."""
    identity = GroupIdentity(
        "dataprep", GroupSource.EC2, host=cluster["ip"], instance_id="i-dataprep0",
        region=REGION, cluster="one",
    )  # fmt: skip

    def plan_for(found: Peers, port: int, outcome_dir: str) -> LaunchPlan:
        return LaunchPlan(
            backend=Backend.EC2, identity=identity, role=Role.DATAPREP, peers=found,
            commands=(("data-server", RoleCommand((sys.executable, "-c", SERVER), {})),),
        )  # fmt: skip

    settings = LoopSettings(
        restart_budget=1, restart_backoff_s=0.05, peer_timeout_s=10, poll_s=0.1,
        spot_poll_s=0.1, grace_s=10, imds_url=fake_imds.url, imds_timeout_s=1.0,
        subreaper=False, heartbeat_s=0.1, no_trainer_timeout_s=no_trainer_timeout_s,
    )  # fmt: skip
    return ec2_job(
        spec, identity=identity, settings=settings, plan_for=plan_for, environ={},
        run_dir=tmp_path / "run", ec2=cluster["ec2"], autoscaling=cluster["asg"],
        record=JobRecord(URI), asg_names=cluster["names"],
    )  # fmt: skip


def test_a_data_server_with_no_trainer_ends_the_job_failed(
    cluster: dict[str, Any],  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    fake_imds: FakeImds,
) -> None:
    """No trainer host ever writes to the job record: after the bound, the data server's
    launcher records ``failed`` with the reason, scales every group to zero, stops its server
    and exits 1."""
    job = data_server_job(
        cluster, tmp_path, fake_imds, spec=cluster["spec"], no_trainer_timeout_s=1.0
    )
    started = time.monotonic()
    assert job.run() == EXIT_FAILED
    assert time.monotonic() - started < 30
    outcome = JobRecord(URI).outcome()
    assert outcome is not None
    assert (outcome["outcome"], outcome["by"]) == ("failed", "i-dataprep0")
    assert outcome["reason"].startswith("no live trainer host for 1 s (job record hosts/: ")
    assert desired(cluster) == {"one-trainer": 0, "one-dataprep": 0}
