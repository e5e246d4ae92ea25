"""The job pointer on the instances: the launcher runs the pointer's job (its checkpoint URI
everywhere), a host whose job was superseded leaves it without ending it and starts again on
the new one (a real launcher process re-executing itself), and ``hetero status`` shows the job."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aws_calls
import boto3
import pytest
from moto import mock_aws
from moto.server import ThreadedMotoServer

from training.cli import main
from training.common.jobparam import JobPointer, JobWatch
from training.common.jobrecord import JobRecord
from training.launcher.ec2_job import EXIT_NEW_JOB

from . import test_launcher_ec2_job as ec2_loop
from .conftest import FakeImds
from .processes import run_watched
from .test_launcher_ec2_job import URI, desired, make_job
from .test_launcher_group import tag_imds
from .test_launcher_peers import launch

REPO = Path(__file__).resolve().parents[2]
cluster = ec2_loop.cluster  # the fixture: moto EC2, Auto Scaling and S3 for cluster "one"
OLD = JobPointer("d-0123456789ab", URI)
NEW = JobPointer("j-20261122T100000-ab12", URI, "2026-11-22T10:00:00Z", OLD.job_id)


@pytest.fixture(autouse=True)
def no_job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HETERO_GROUP", "HETERO_CHECKPOINT_URI", "HETERO_JOB_PARAMETER"):
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------ the launcher's EC2 path


def test_on_ec2_the_pointers_checkpoint_uri_wins_over_the_environment(
    spec_path: Path,
    tmp_path: Path,
    fake_imds: FakeImds,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level("INFO")
    # What the stack passes: the bucket's prefix, and the parameter that names the job.
    monkeypatch.setenv("HETERO_CHECKPOINT_URI", "s3://bucket/checkpoints/")
    monkeypatch.setenv("HETERO_JOB_PARAMETER", "/hetero/vit-test/job")
    pointer = JobPointer("j-20261122T100000-ab12", "s3://bucket/checkpoints/d-0123456789ab/")
    with mock_aws():
        boto3.client("ssm", region_name="us-west-2").put_parameter(
            Name="/hetero/vit-test/job", Value=pointer.to_json(), Type="String"
        )
        client = boto3.client("ec2", region_name="us-west-2")
        vpc = client.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnet = client.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
        launch((client, subnet), "10.0.0.40", "trainer")
        me = launch((client, subnet), "10.0.0.41", "trainer")
        tag_imds(fake_imds, "trainer")  # region us-west-2
        fake_imds.set("/latest/meta-data/instance-id", me)
        code = main(
            [
                "launch", "--spec", str(spec_path), "--resourceconfig", str(tmp_path / "no"),
                "--imds-url", fake_imds.url, "--dry-run",
            ]
        )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert (
        "--checkpoint-dir /tmp/hetero/checkpoints --outcome-dir runs/vit-test/outcome "
        "--checkpoint-s3-uri s3://bucket/checkpoints/d-0123456789ab/"
    ) in out
    assert "--checkpoint-s3-uri s3://bucket/checkpoints/ " not in out + " "
    assert "job j-20261122T100000-ab12, checkpoints s3://bucket/checkpoints/d-0123456789ab/" in (
        caplog.messages
    )


def test_on_ec2_a_missing_job_parameter_stops_with_exit_2(
    spec_path: Path,
    tmp_path: Path,
    fake_imds: FakeImds,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HETERO_JOB_PARAMETER", "/hetero/vit-test/job")
    with mock_aws():
        tag_imds(fake_imds, "trainer")
        code = main(
            [
                "launch", "--spec", str(spec_path), "--resourceconfig", str(tmp_path / "no"),
                "--imds-url", fake_imds.url, "--dry-run",
            ]
        )  # fmt: skip
    assert code == 2
    assert (
        "SSM parameter /hetero/vit-test/job does not exist: deploy the cluster stack first "
        "(npx cdk deploy --all -c spec=FILE), which creates it"
    ) in caplog.messages


# ------------------------------------------------------------------ the EC2 loop


def watched_job(
    cluster: dict[str, Any], tmp_path: Path, imds: FakeImds, plays: list[str], poll_s: float
) -> tuple[Any, Path, Any]:
    """``make_job``'s job, on job ``OLD`` read from moto's SSM."""
    ssm = boto3.client("ssm", region_name="us-east-1")
    ssm.put_parameter(Name="/hetero/one/job", Value=OLD.to_json(), Type="String")
    job, played = make_job(cluster, tmp_path, imds, plays)
    job.job_watch = JobWatch(ssm, "/hetero/one/job", OLD)
    job.settings = replace(job.settings, job_poll_s=poll_s)
    return job, played, ssm


def start_new_job_when(played: Path, ssm: Any, then: Path | None = None) -> threading.Thread:
    """Once the stand-in runs: write ``NEW`` into the parameter (then touch ``then``)."""

    def act() -> None:
        deadline = time.monotonic() + 15
        while not played.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        ssm.put_parameter(
            Name="/hetero/one/job", Value=NEW.to_json(), Type="String", Overwrite=True
        )
        if then is not None:
            then.parent.mkdir(parents=True, exist_ok=True)
            then.write_text("go on")

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


def test_a_job_superseded_before_a_generation_runs_nothing_and_ends_nothing(
    cluster: dict[str, Any],
    tmp_path: Path,
    fake_imds: FakeImds,
) -> None:
    job, played, ssm = watched_job(cluster, tmp_path, fake_imds, ["finished"], poll_s=60)
    ssm.put_parameter(Name="/hetero/one/job", Value=NEW.to_json(), Type="String", Overwrite=True)
    assert job.run() == EXIT_NEW_JOB
    assert not played.exists()
    assert JobRecord(URI).outcome() is None
    assert desired(cluster) == {"one-trainer": 1, "one-dataprep": 1}


def test_a_new_job_stops_the_running_generation_and_the_host_leaves_for_it(
    cluster: dict[str, Any],
    tmp_path: Path,
    fake_imds: FakeImds,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO")
    job, played, ssm = watched_job(cluster, tmp_path, fake_imds, ["wait"], poll_s=0.1)
    start_new_job_when(played, ssm)
    began = time.monotonic()
    assert job.run() == EXIT_NEW_JOB
    assert time.monotonic() - began < 15  # the stand-in would wait 20 s without the stop
    assert played.read_text() == "wait"  # one generation, not restarted
    # The stand-in got SIGTERM (what makes the real trainer checkpoint) and said "stopped".
    rank = json.loads((tmp_path / "run" / "outcome" / "rank-0.json").read_text())
    assert (rank["outcome"], rank["reason"]) == ("stopped", "SIGTERM")
    assert job.failures == 0 and job.generation == 1
    # The old job is not ended: no outcome beside the (shared) checkpoints, groups untouched.
    assert JobRecord(URI).outcome() is None
    assert desired(cluster) == {"one-trainer": 1, "one-dataprep": 1}
    assert (
        "job d-0123456789ab was superseded by job j-20261122T100000-ab12: "
        "leaving it for the new job"
    ) in caplog.messages


def test_an_old_job_that_finishes_after_a_new_one_started_does_not_end_the_new_one(
    cluster: dict[str, Any],
    tmp_path: Path,
    fake_imds: FakeImds,
) -> None:
    # No watch between boundaries (poll 60 s): the generation finishes, and the check before
    # the job end sees the new job.
    job, played, ssm = watched_job(cluster, tmp_path, fake_imds, ["finish-after-usr1"], 60)
    start_new_job_when(played, ssm, then=tmp_path / "run" / "proactive-checkpoint")
    assert job.run() == EXIT_NEW_JOB
    rank = json.loads((tmp_path / "run" / "outcome" / "rank-0.json").read_text())
    assert rank["outcome"] == "finished"
    assert JobRecord(URI).outcome() is None
    assert desired(cluster) == {"one-trainer": 1, "one-dataprep": 1}


# ------------------------------------------------------------------ a real launcher process


@pytest.fixture
def moto_server() -> Iterator[dict[str, str]]:
    """A moto server on 127.0.0.1 and the environment that points boto3 at it."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
        }
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_the_launcher_re_executes_itself_on_the_new_job(
    spec_path: Path,
    tmp_path: Path,
    fake_imds: FakeImds,
    moto_server: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in moto_server.items():
        monkeypatch.setenv(k, v)
    ec2 = boto3.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
    me = launch((ec2, subnet), "10.0.0.41", "trainer")  # 1 of the spec's 2 trainers: it waits
    s3, ssm = boto3.client("s3"), boto3.client("ssm")
    s3.create_bucket(Bucket="ckpt")
    from training.common.jobparam import deployed_job_id

    old_id = deployed_job_id(spec_path.read_text())  # the job a deploy of this spec started
    old = JobPointer(old_id, f"s3://ckpt/checkpoints/{old_id}/")
    new = JobPointer("j-20261122T100000-ab12", "s3://ckpt/checkpoints/j-20261122T100000-ab12/")
    ssm.put_parameter(Name="/hetero/vit-test/job", Value=old.to_json(), Type="String")
    # The new job is already over, so the re-executed launcher reads it and exits 0.
    s3.put_object(
        Bucket="ckpt",
        Key="checkpoints/j-20261122T100000-ab12/job/outcome.json",
        Body=json.dumps({"outcome": "finished", "reason": "test", "by": "i-x"}).encode(),
    )
    for path, value in {
        "/latest/meta-data/tags/instance/hetero:group": "trainer",
        "/latest/meta-data/tags/instance/hetero:cluster": "vit-test",
        "/latest/meta-data/instance-id": me,
        "/latest/meta-data/local-ipv4": "10.0.0.41",
        "/latest/meta-data/placement/region": "us-east-1",
    }.items():
        fake_imds.set(path, value)
    env = {
        **os.environ,
        "HETERO_CHECKPOINT_URI": "s3://ckpt/checkpoints/",
        "HETERO_JOB_PARAMETER": "/hetero/vit-test/job",
    }
    cmd = [
        sys.executable, "-m", "training.cli", "launch", "--spec", str(spec_path),
        "--resourceconfig", str(tmp_path / "no"), "--imds-url", fake_imds.url,
        "--poll", "0.2", "--job-poll", "0.2", "--spot-poll", "1", "--peer-timeout", "60",
        "--run-dir", str(tmp_path / "run"),
    ]  # fmt: skip

    def start_new_job(proc: Any, output: str) -> bool:
        if "membership: 1/2 trainer hosts" not in output:
            return False
        ssm.put_parameter(
            Name="/hetero/vit-test/job", Value=new.to_json(), Type="String", Overwrite=True
        )
        return True

    result = run_watched(cmd, cwd=REPO, timeout_s=90, env=env, act=start_new_job)
    out = result.output
    assert result.returncode == 0, out
    lines = [
        f"job {old_id}, checkpoints s3://ckpt/checkpoints/{old_id}/",
        f"job {old_id} was superseded by job j-20261122T100000-ab12: leaving it for the new job",
        "starting again on the new job: ",
        "job j-20261122T100000-ab12, checkpoints s3://ckpt/checkpoints/j-20261122T100000-ab12/",
        "the job is over (finished: test)",
    ]
    positions = [out.find(line) for line in lines]
    assert -1 not in positions and positions == sorted(positions), out
    # The same process went on (os.execv): the launcher never had a child of its own.
    assert result.descendants == {}, out


# ------------------------------------------------------------------ hetero status


def test_status_reads_the_record_where_the_pointer_says_and_shows_the_job(
    cluster: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    record_aws_calls: Callable[..., Path],
) -> None:
    from training.workstation.status import collect

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    ssm = boto3.client("ssm", region_name="us-east-1")
    s3 = boto3.client("s3", region_name="us-east-1")
    pointer = JobPointer(
        "j-20261122T100000-ab12", "s3://ckpt/checkpoints/one/j-20261122T100000-ab12/",
        "2026-11-22T10:00:00Z", "d-0123456789ab",
    )  # fmt: skip
    JobRecord(pointer.checkpoint_uri).set_host(cluster["instance_id"], state="running")
    JobRecord(URI).set_host(cluster["instance_id"], state="from the old job")
    kw: dict[str, Any] = {"ec2": cluster["ec2"], "autoscaling": cluster["asg"], "s3": s3}
    # No parameter (a stack from before the pointer): the default URI, no job, no error.
    before = collect(cluster["spec"], checkpoint_uri=None, ssm=ssm, default_uri=URI, **kw)
    assert (before.job, before.checkpoint_uri, before.errors) == (None, URI, [])
    assert before.hosts[cluster["instance_id"]]["state"] == "from the old job"
    ssm.put_parameter(Name="/hetero/one/job", Value=pointer.to_json(), Type="String")
    status = collect(cluster["spec"], checkpoint_uri=None, ssm=ssm, default_uri=URI, **kw)
    assert status.errors == []
    assert status.job == {
        "job_id": "j-20261122T100000-ab12",
        "checkpoint_uri": "s3://ckpt/checkpoints/one/j-20261122T100000-ab12/",
        "started": "2026-11-22T10:00:00Z",
        "resumed_from": "d-0123456789ab",
    }
    assert status.checkpoint_uri == pointer.checkpoint_uri
    assert status.hosts[cluster["instance_id"]]["state"] == "running"
    # The command: the job id in the JSON and in the table's first line.
    spec_file = tmp_path / "one.toml"  # written by the cluster fixture
    record_aws_calls(aws_calls.Names(cluster="one", checkpoint_bucket="ckpt"))
    assert main(["status", "--spec", str(spec_file), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["job"]["job_id"] == "j-20261122T100000-ab12"
    main(["status", "--spec", str(spec_file)])
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "one: job j-20261122T100000-ab12 running (no outcome recorded)"


# ------------------------------------------------------------------ the re-execution itself


def test_re_execution_runs_the_same_command_line_and_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from training.launcher import ec2_start

    calls: list[tuple[str, list[str], dict[str, str]]] = []

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        calls.append((path, argv, env))
        raise OSError("recorded, not executed")

    monkeypatch.setattr(ec2_start.os, "execve", execve)
    assert (
        ec2_start.restart_for_new_job({"HETERO_JOB_PARAMETER": "/hetero/one/job"}) == EXIT_NEW_JOB
    )
    assert calls == [
        (
            sys.executable,
            [sys.executable, *sys.orig_argv[1:]],
            {"HETERO_JOB_PARAMETER": "/hetero/one/job", "HETERO_LAUNCHER_JOB_SWITCHES": "1"},
        )
    ]
    # After MAX_JOB_SWITCHES re-executions it exits instead (Docker's policy takes over).
    calls.clear()
    at_limit = {"HETERO_LAUNCHER_JOB_SWITCHES": str(ec2_start.MAX_JOB_SWITCHES)}
    assert ec2_start.restart_for_new_job(at_limit) == EXIT_NEW_JOB
    assert calls == []


# ------------------------------------------------------------------ an instance with an older spec


def test_stale_spec_only_for_deploy_ids_that_are_not_this_spec() -> None:
    from training.common.jobparam import deployed_job_id, stale_spec

    mine = deployed_job_id("name = 'a'\n")
    assert stale_spec(JobPointer(mine, URI), "name = 'a'\n") is None
    # `hetero job start` ids run the deployed spec: nothing to compare with.
    assert stale_spec(NEW, "name = 'a'\n") is None
    assert stale_spec(JobPointer("d-0123456789ab", URI), "name = 'a'\n") == (
        "job d-0123456789ab was deployed with another spec than this instance's (which would "
        f"be job {mine}): this instance came from an earlier launch template"
    )


def _launch_in_cluster(
    cluster: dict[str, Any], fake_imds: FakeImds, tmp_path: Path, pointer: JobPointer, *extra: str
) -> int:
    boto3.client("ssm", region_name=ec2_loop.REGION).put_parameter(
        Name="/hetero/one/job", Value=pointer.to_json(), Type="String", Overwrite=True
    )
    for path, value in {
        "/latest/meta-data/tags/instance/hetero:group": "trainer",
        "/latest/meta-data/tags/instance/hetero:cluster": "one",
        "/latest/meta-data/instance-id": cluster["instance_id"],
        "/latest/meta-data/local-ipv4": cluster["ip"],
        "/latest/meta-data/placement/region": ec2_loop.REGION,
    }.items():
        fake_imds.set(path, value)
    return main(
        [
            "launch", "--spec", str(tmp_path / "one.toml"),
            "--resourceconfig", str(tmp_path / "no"), "--imds-url", fake_imds.url, *extra,
        ]
    )  # fmt: skip


def test_an_instance_with_an_older_spec_is_replaced_instead_of_joining(
    cluster: dict[str, Any],
    tmp_path: Path,
    fake_imds: FakeImds,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A deploy of a changed spec points at job d-<its hash>; an instance launched from the
    earlier template holds the old spec and must not mix it into that job: its group replaces it
    (desired capacity kept), and the launcher runs nothing."""
    monkeypatch.setenv("HETERO_JOB_PARAMETER", "/hetero/one/job")
    monkeypatch.setenv("AWS_DEFAULT_REGION", ec2_loop.REGION)
    asg = cluster["asg"]
    code = _launch_in_cluster(
        cluster, fake_imds, tmp_path, JobPointer("d-0123456789ab", "s3://ckpt/checkpoints/d/")
    )
    assert code == 75
    assert any("asking Auto Scaling to replace this instance" in m for m in caplog.messages)
    group = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["one-trainer"])
    group = group["AutoScalingGroups"][0]
    assert group["DesiredCapacity"] == 1  # kept: the group launches a replacement
    members = [i["InstanceId"] for i in group["Instances"]]
    assert cluster["instance_id"] not in members and len(members) == 1
    assert not (tmp_path / "run").exists()


def test_an_instance_with_the_deployed_spec_runs_the_deployed_job(
    cluster: dict[str, Any],
    tmp_path: Path,
    fake_imds: FakeImds,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from training.common.jobparam import deployed_job_id

    monkeypatch.setenv("HETERO_JOB_PARAMETER", "/hetero/one/job")
    monkeypatch.setenv("AWS_DEFAULT_REGION", ec2_loop.REGION)
    job_id = deployed_job_id((tmp_path / "one.toml").read_text())
    pointer = JobPointer(job_id, f"s3://ckpt/checkpoints/{job_id}/")
    assert _launch_in_cluster(cluster, fake_imds, tmp_path, pointer, "--dry-run") == 0
    assert f"--checkpoint-s3-uri s3://ckpt/checkpoints/{job_id}/" in capsys.readouterr().out
    group = cluster["asg"].describe_auto_scaling_groups(AutoScalingGroupNames=["one-trainer"])
    assert [i["InstanceId"] for i in group["AutoScalingGroups"][0]["Instances"]] == [
        cluster["instance_id"]
    ]
