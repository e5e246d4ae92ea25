"""The job's budget (``job.max_hours`` / ``job.max_usd``): the accounting, the clock in the job
record, and the EC2 loop ending the job ``stopped`` with every group at 0 when the trainer stops
for it (moto for EC2, Auto Scaling and S3; a stand-in trainer that honours --max-seconds)."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from training.common.jobrecord import JobRecord
from training.common.names import ENV_BUDGET_DEADLINE
from training.common.outcome import EXIT_FINISHED, EXIT_STOPPED, Outcome
from training.costs.budget import Budget, job_started, parse_started
from training.launcher.backends import Backend
from training.launcher.ec2_job import Ec2Job
from training.launcher.group import GroupIdentity, GroupSource
from training.launcher.loop_settings import LoopSettings
from training.launcher.peers import Peers
from training.launcher.plan import LaunchPlan
from training.processes.roles import RoleCommand
from training.spec import ClusterSpec, Role, load_spec
from training.workstation.jobstart import start_job
from training.workstation.status import JobStatus, budget_line

from .conftest import FakeImds, ec2_job, one_of_each
from .test_launcher_ec2_job import REGION, URI, cluster, desired  # noqa: F401 (fixture)
from .test_launcher_jobstart import Recording

# 3.60 USD/h for the whole cluster: 0.001 USD a second.
PRICED = """
[job.prices]
usd_per_hour = { "g5.xlarge" = 3.6, "c6i.4xlarge" = 0.0 }
"""


# -- accounting -------------------------------------------------------------------------------


def test_usd_cap_is_price_times_hours() -> None:
    b = Budget(max_hours=None, max_usd=0.5, usd_per_hour=2.0)
    assert b.limit_s() == pytest.approx(900.0)  # 0.5 USD at 2 USD/h: a quarter of an hour
    assert b.spent_usd(450.0) == pytest.approx(0.25)
    assert b.remaining_s(450.0) == pytest.approx(450.0)
    assert not b.reached(899.0) and b.reached(900.0)
    assert b.remaining_s(1000.0) == 0.0  # never negative
    assert b.deadline(100.0) == pytest.approx(1000.0)


def test_the_first_cap_reached_wins() -> None:
    b = Budget(max_hours=0.1, max_usd=10.0, usd_per_hour=2.0)  # 360 s against 5 h
    assert b.limit_s() == pytest.approx(360.0)
    assert b.reason(360.0) == (
        "budget: max_hours 0.1 reached (0.2000 USD over 0.1000 h at 2.00 USD/h); "
        "continue with hetero job start --resume"
    )
    b = Budget(max_hours=1.0, max_usd=0.5, usd_per_hour=2.0)
    assert b.reason(900.0).startswith("budget: max_usd 0.5 reached (0.5000 USD over 0.2500 h")


def test_no_cap_and_a_free_cluster_never_stop() -> None:
    assert Budget(None, None, 5.0).remaining_s(1e9) is None
    assert not Budget(None, None, 5.0).capped
    assert Budget(None, 1.0, 0.0).limit_s() is None  # priced at 0: a USD cap is never reached
    assert Budget(None, None, 5.0).describe(3600.0) == (
        "5.00 USD over 1.00 h at 5.00 USD/h; no cap (job.max_usd, job.max_hours)"
    )
    assert Budget(2.0, 9.5, 5.0).describe(1800.0) == (
        "2.50 USD over 0.50 h at 5.00 USD/h; max_usd 9.5, max_hours 2"
    )


def test_budget_of_a_spec_uses_its_prices(tmp_path: Path) -> None:
    spec_path = tmp_path / "s.toml"
    spec_path.write_text(SPEC_WITH_CAP.replace("{cap}", "max_usd = 0.002"))
    b = Budget.of(load_spec(spec_path))
    assert (b.max_usd, b.max_hours, b.usd_per_hour) == (0.002, None, pytest.approx(3.6))
    assert b.limit_s() == pytest.approx(2.0)


def test_the_clock_is_the_pointer_start_else_the_record_first_write(tmp_path: Path) -> None:
    assert parse_started("2026-11-22T10:00:00Z") == pytest.approx(1795341600.0)
    assert parse_started(12.5) == 12.5 and parse_started(None) is None
    assert parse_started("yesterday") is None
    record = JobRecord(str(tmp_path / "ckpt"))
    assert record.started_at() is None
    assert job_started(record, None, now=100.0) == 100.0  # the first host writes it
    assert job_started(record, None, now=250.0) == 100.0  # a later host (a replacement) reads it
    assert record.started_at() == 100.0
    assert job_started(record, "2026-11-22T10:00:00Z", now=250.0) == pytest.approx(1795341600.0)


def test_a_job_record_may_end_stopped_and_keeps_its_first_outcome(tmp_path: Path) -> None:
    record = JobRecord(str(tmp_path / "ckpt"))
    first = record.end(Outcome.STOPPED, reason="budget: max_usd 1 reached", by="i-1")
    assert first["outcome"] == "stopped"
    assert record.end(Outcome.FINISHED, reason="later", by="i-2")["outcome"] == "stopped"


def test_status_shows_spend_against_the_cap_until_the_end(tmp_path: Path) -> None:
    spec_path = tmp_path / "s.toml"
    spec_path.write_text(SPEC_WITH_CAP.replace("{cap}", "max_usd = 10\nmax_hours = 4"))
    spec = load_spec(spec_path)
    record = JobRecord(str(tmp_path / "ckpt"))
    record.started(1000.0)
    running = JobStatus(cluster="one")
    assert budget_line(spec, running, record, now=1000.0 + 1800) == (
        "1.80 USD over 0.50 h at 3.60 USD/h from spec; max_usd 10, max_hours 4"
    )
    ended = JobStatus(cluster="one", outcome={"outcome": "stopped", "time": 1000.0 + 3600})
    assert budget_line(spec, ended, record, now=1e9).startswith("3.60 USD over 1.00 h")
    no_start = JobRecord(str(tmp_path / "other"))
    assert budget_line(spec, running, no_start) == "not started; max_usd 10, max_hours 4"


# -- the EC2 loop -----------------------------------------------------------------------------

SPEC_WITH_CAP = one_of_each("one") + "{cap}\n" + PRICED

# A trainer that honours the job's budget as the real one does (it stops at
# HETERO_BUDGET_DEADLINE, wall clock): it runs until then and stops "max-seconds" after a
# checkpoint, or finishes.
STANDIN = r"""
import json, os, pathlib, sys, time
outcome_dir, log = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
deadline = os.environ.get("HETERO_BUDGET_DEADLINE")
limit = None if deadline is None else float(deadline) - time.time()
with log.open("a") as f:
    f.write(("none" if limit is None else str(limit)) + "\n")
def outcome(kind, reason):
    outcome_dir.mkdir(parents=True, exist_ok=True)
    body = {"rank": 0, "outcome": kind, "step": 3, "checkpoint_step": 3, "reason": reason}
    (outcome_dir / "rank-0.json").write_text(json.dumps(body))
if limit is not None and limit < 5:
    time.sleep(max(0.0, limit))
    outcome("stopped", "max-seconds"); sys.exit(75)
outcome("finished", "steps"); sys.exit(0)
"""


def budget_job(
    cluster: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    imds: FakeImds,
    cap: str,
    trainers: int = 1,
) -> tuple[Ec2Job, Path]:
    spec_path = tmp_path / "capped.toml"
    text = SPEC_WITH_CAP.replace("{cap}", cap)
    spec_path.write_text(text.replace("count = 1", f"count = {trainers}", 1))
    spec = load_spec(spec_path)
    played = tmp_path / "played"
    identity = GroupIdentity(
        "trainer", GroupSource.EC2, host=cluster["ip"], instance_id=cluster["instance_id"],
        region=REGION, cluster="one",
    )  # fmt: skip

    def plan_for(found: Peers, port: int, outcome_dir: str) -> LaunchPlan:
        argv = (sys.executable, "-c", STANDIN, outcome_dir, str(played))
        return LaunchPlan(
            backend=Backend.EC2, identity=identity, role=Role.TRAINER, peers=found,
            commands=(("trainer", RoleCommand(argv, {})),),
        )  # fmt: skip

    settings = LoopSettings(
        restart_budget=0, restart_backoff_s=0.05, peer_timeout_s=10, poll_s=0.1,
        spot_poll_s=0.1, grace_s=10, imds_url=imds.url, imds_timeout_s=1.0, subreaper=False,
    )  # fmt: skip
    job = ec2_job(
        spec, identity=identity, settings=settings, plan_for=plan_for, environ={},
        run_dir=tmp_path / "run", ec2=cluster["ec2"], autoscaling=cluster["asg"],
        record=JobRecord(URI), asg_names=cluster["names"],
    )  # fmt: skip
    return job, played


def test_reaching_max_usd_ends_the_job_stopped_with_every_group_at_zero(
    cluster: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    fake_imds: FakeImds,
) -> None:
    # 0.002 USD at 3.6 USD/h: 2 s from the job's start.
    job, played = budget_job(cluster, tmp_path, fake_imds, "max_usd = 0.002")
    started = time.time()
    assert job.run() == EXIT_STOPPED
    limits = played.read_text().split()
    assert len(limits) == 1 and float(limits[0]) <= 2.0  # what was left of 2 s
    outcome = JobRecord(URI).outcome()
    assert outcome is not None and outcome["outcome"] == "stopped"
    assert outcome["reason"].startswith("budget: max_usd 0.002 reached (")
    assert outcome["reason"].endswith("continue with hetero job start --resume")
    assert desired(cluster) == {"one-trainer": 0, "one-dataprep": 0}
    record_start = JobRecord(URI).started_at()
    assert record_start is not None and abs(record_start - started) < 5


def test_a_job_whose_budget_is_spent_before_a_generation_runs_nothing(
    cluster: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    fake_imds: FakeImds,
) -> None:
    """A replacement host that starts after the budget ran out (the clock is the job's, not the
    host's) ends the job without starting the trainer."""
    JobRecord(URI).started(time.time() - 3600)  # an hour ago
    job, played = budget_job(cluster, tmp_path, fake_imds, "max_hours = 0.5")
    assert job.run() == EXIT_STOPPED
    assert not played.exists()
    outcome = JobRecord(URI).outcome()
    assert outcome is not None and outcome["reason"].startswith("budget: max_hours 0.5 reached")
    assert desired(cluster) == {"one-trainer": 0, "one-dataprep": 0}


def test_the_budget_running_out_while_a_trainer_waits_for_a_peer_ends_the_job_stopped(
    cluster: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    fake_imds: FakeImds,
) -> None:
    """A survivor waiting for a lost peer bills too: the budget ends the job ``stopped`` while
    it waits (the trainer group wants 2, one instance runs), not the peer timeout ``failed``."""
    job, played = budget_job(cluster, tmp_path, fake_imds, "max_usd = 0.0015", trainers=2)
    started = time.monotonic()
    assert job.run() == EXIT_STOPPED
    assert time.monotonic() - started < job.settings.peer_timeout_s
    assert not played.exists()  # no trainer ever started
    outcome = JobRecord(URI).outcome()
    assert outcome is not None and outcome["outcome"] == "stopped"
    assert outcome["reason"].startswith("budget: max_usd 0.0015 reached (")
    assert desired(cluster) == {"one-trainer": 0, "one-dataprep": 0}


def test_a_host_that_finds_the_job_stopped_exits_stopped(
    cluster: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    fake_imds: FakeImds,
) -> None:
    JobRecord(URI).end(Outcome.STOPPED, reason="budget: max_usd 1 reached", by="i-0")
    job, played = budget_job(cluster, tmp_path, fake_imds, "max_usd = 1")
    assert job.run() == EXIT_STOPPED
    assert not played.exists()
    assert JobRecord(URI).outcome()["reason"] == "budget: max_usd 1 reached"  # type: ignore[index]


def test_without_a_cap_the_trainer_gets_no_limit(
    cluster: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    fake_imds: FakeImds,
) -> None:
    job, played = budget_job(cluster, tmp_path, fake_imds, "")
    assert job.run() == EXIT_FINISHED
    assert played.read_text().split() == ["none"]
    assert JobRecord(URI).started_at() is None  # no clock kept without a cap
    assert ENV_BUDGET_DEADLINE == "HETERO_BUDGET_DEADLINE"


@pytest.mark.parametrize("cap", ["max_hours = 1", ""])
def test_a_capped_jobs_launcher_schedules_every_group_to_zero_and_its_end_deletes_it(
    cluster: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    fake_imds: FakeImds,
    cap: str,
) -> None:
    """The budget's backstop: with a cap, the launcher puts a scheduled action on every group
    (every size 0) after the job's deadline, once its launchers have had their grace and four
    heartbeats to end the job themselves, and the job's end deletes them after scaling to zero;
    without one, neither call is made."""
    started = time.time() - 10
    JobRecord(URI).started(started)
    job, _ = budget_job(cluster, tmp_path, fake_imds, cap)
    calls: list[tuple[str, str, dict[str, Any]]] = []
    job.autoscaling = Recording("autoscaling", cluster["asg"], calls)
    assert job.run() == EXIT_FINISHED
    backstop = [
        (op, params) for _, op, params in calls if "scheduled" in op
        or (op == "update_auto_scaling_group" and params["AutoScalingGroupName"] == "one-dataprep")
    ]  # fmt: skip
    if not cap:
        scaled = {
            "AutoScalingGroupName": "one-dataprep",
            "MinSize": 0,
            "MaxSize": 0,
            "DesiredCapacity": 0,
        }
        assert backstop == [("update_auto_scaling_group", scaled)]
        return
    puts = [params for op, params in backstop if op == "put_scheduled_update_group_action"]
    assert [p["AutoScalingGroupName"] for p in puts] == ["one-trainer", "one-dataprep"]
    for p in puts:
        assert p["ScheduledActionName"] == f"hetero-budget-deadline-{p['AutoScalingGroupName']}"
        assert (p["MinSize"], p["MaxSize"], p["DesiredCapacity"]) == (0, 0, 0)
        after = job.settings.grace_s + 4 * job.settings.heartbeat_s
        assert job.settings.backstop_after == after > 0
        assert p["StartTime"].timestamp() == pytest.approx(started + 3600 + after, abs=1e-3)
    assert [op for op, _ in backstop[2:]] == [
        "update_auto_scaling_group", "delete_scheduled_action", "delete_scheduled_action",
    ]  # fmt: skip
    left = cluster["asg"].describe_scheduled_actions()["ScheduledUpdateGroupActions"]
    assert left == []


# -- hetero job start --resume after a budget stop (moto: SSM, S3, Auto Scaling) ---------------


def test_resume_after_a_budget_stop_gives_the_new_job_its_own_clock(
    monkeypatch: pytest.MonkeyPatch, spec: ClusterSpec
) -> None:
    from .test_launcher_jobstart import NAME, NOW, OLD, deployed_groups, keys, sizes

    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    with mock_aws():
        ssm = boto3.client("ssm", region_name=REGION)
        s3 = boto3.client("s3", region_name=REGION)
        asg = boto3.client("autoscaling", region_name=REGION)
        ec2 = boto3.client("ec2", region_name=REGION)
        ssm.put_parameter(Name=NAME, Value=OLD.to_json(), Type="String")
        s3.create_bucket(Bucket="ckpt")
        old = JobRecord(OLD.checkpoint_uri, s3_client=s3)
        old.started(1000.0)
        old.end(Outcome.STOPPED, reason="budget: max_usd 1 reached", by="i-1")
        for key in ("step-4/a.distcp", "step-4/COMPLETE"):
            s3.put_object(Bucket="ckpt", Key=f"checkpoints/d-0123456789ab/{key}", Body=b"x")
        deployed_groups(ec2, asg, "vit-test", {"trainer": 2, "dataprep": 2})

        started = start_job(spec, ssm=ssm, autoscaling=asg, s3=s3, now=NOW, token="ab12")

        # Same checkpoints, a new job with its own start; the stopped outcome and the old clock
        # went to the history, so no host of the new job finds the job over or its budget spent.
        assert started.pointer.checkpoint_uri == OLD.checkpoint_uri
        assert started.pointer.resumed_from == OLD.job_id
        history = "checkpoints/d-0123456789ab/job-history/d-0123456789ab/"
        found = keys(s3)
        assert {history + "outcome.json", history + "started.json"} <= set(found)
        assert not [k for k in found if k.startswith("checkpoints/d-0123456789ab/job/")]
        new = JobRecord(started.pointer.checkpoint_uri, s3_client=s3)
        assert new.outcome() is None and new.started_at() is None
        assert job_started(new, started.pointer.started) == NOW.timestamp()
        assert new.started_at() is None  # the pointer's time is the clock: nothing written
        assert sizes(asg) == {"vit-test-trainer": (0, 2, 2), "vit-test-dataprep": (0, 2, 2)}


def test_job_start_may_give_the_resumed_job_a_cap_of_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A job its budget stopped resumes with more to spend, without a deploy (which would start
    a fresh job in a new folder): the caps go into the job pointer, every launcher's budget and
    `hetero status` read them there, and the spec's other cap stays."""
    from training.common.jobparam import JobWatch, read_job_pointer
    from training.workstation.jobstart import JobStartError, report

    from .test_launcher_jobstart import NOW, OLD, deployed_groups

    spec_path = tmp_path / "capped.toml"
    spec_path.write_text(SPEC_WITH_CAP.replace("{cap}", "max_usd = 1\nmax_hours = 4"))
    spec = load_spec(spec_path)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    with mock_aws():
        ssm = boto3.client("ssm", region_name=REGION)
        s3 = boto3.client("s3", region_name=REGION)
        asg = boto3.client("autoscaling", region_name=REGION)
        ssm.put_parameter(Name="/hetero/one/job", Value=OLD.to_json(), Type="String")
        s3.create_bucket(Bucket="ckpt")
        with pytest.raises(JobStartError, match=r"^--max-usd must be above 0, got 0$"):
            start_job(spec, ssm=ssm, autoscaling=asg, s3=s3, max_usd=0.0)
        assert read_job_pointer(ssm, "/hetero/one/job") == OLD  # nothing changed
        ec2 = boto3.client("ec2", region_name=REGION)
        deployed_groups(ec2, asg, "one", {g.name: g.count for g in spec.groups})
        started = start_job(
            spec, ssm=ssm, autoscaling=asg, s3=s3, now=NOW, token="ab12", max_usd=25.0
        )
        pointer = read_job_pointer(ssm, "/hetero/one/job")
        assert pointer == started.pointer
        assert (pointer.max_usd, pointer.max_hours) == (25.0, None)
        assert "budget: max_usd 25 (instead of the spec's)" in report(started, spec_path="s")
        # A host of the new job: its loop's budget is the pointer's cap and the spec's other.
        host = ec2_job(
            spec,
            identity=GroupIdentity("trainer", GroupSource.EC2, instance_id="i-1", cluster="one"),
            settings=LoopSettings(),
            plan_for=lambda *a: None,
            environ={},
            run_dir=tmp_path,
            ec2=None,
            autoscaling=None,
            record=None,
            asg_names=[],
            job_watch=JobWatch(ssm, "/hetero/one/job", pointer),
        )
        assert (host.budget.max_usd, host.budget.max_hours) == (25.0, 4.0)
        assert Budget.of(spec).max_usd == 1.0  # without the pointer, the spec's
        status = JobStatus(cluster="one", job=asdict(pointer))
        record = JobRecord(str(tmp_path / "ckpt"))
        assert budget_line(spec, status, record, now=NOW.timestamp() + 3600) == (
            "3.60 USD over 1.00 h at 3.60 USD/h from spec; max_usd 25, max_hours 4"
        )
