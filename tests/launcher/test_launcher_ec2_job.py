"""The EC2 generation loop with real child processes standing in for torchrun: each outcome
leads to the documented action (moto for EC2, Auto Scaling and S3; a real IMDSv2 server)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from training.common.jobrecord import JobRecord
from training.common.outcome import EXIT_DATA, EXIT_FAILED, EXIT_FINISHED, EXIT_STOPPED, Outcome
from training.launcher.backends import Backend
from training.launcher.ec2_job import Ec2Job
from training.launcher.group import GroupIdentity, GroupSource
from training.launcher.loop_settings import LoopSettings
from training.launcher.peers import Peers
from training.launcher.plan import LaunchPlan
from training.launcher.spot import REBALANCE_PATH, TARGET_LIFECYCLE_PATH
from training.processes.roles import RoleCommand
from training.spec import ClusterSpec, Role, load_spec

from .conftest import FakeImds, ec2_job, one_of_each

REGION = "us-east-1"
AMI = "ami-12c6146b"
URI = "s3://ckpt/checkpoints/one/"
SPEC = one_of_each("one")

# A stand-in for torchrun's rank: it plays the next behaviour listed in the script file
# (one per generation) and writes the outcome file the real trainer writes.
STANDIN = r"""
import json, pathlib, signal, sys, time
outcome_dir, script, log = (pathlib.Path(a) for a in sys.argv[1:4])
plays = script.read_text().split()
done = log.read_text().split() if log.exists() else []
mode = plays[min(len(done), len(plays) - 1)]
log.write_text(" ".join(done + [mode]))
def outcome(kind, reason, code=None):
    outcome_dir.mkdir(parents=True, exist_ok=True)
    body = {"rank": 0, "outcome": kind, "step": 3, "checkpoint_step": 3, "reason": reason,
            "exit_code": code}
    (outcome_dir / "rank-0.json").write_text(json.dumps(body))
def on_term(signum, frame):
    outcome("stopped", "SIGTERM"); sys.exit(75)
def on_usr1(signum, frame):
    outcome_dir.parent.mkdir(parents=True, exist_ok=True)
    (outcome_dir.parent / "proactive-checkpoint").write_text("saved")
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, on_usr1)
if mode == "finished":
    outcome("finished", "steps"); sys.exit(0)
if mode == "stopped":
    outcome("stopped", "peer"); sys.exit(75)
if mode == "crash":
    sys.exit(1)
if mode == "unreadable":  # past job.dataset.max_unreadable, as the trainer says it
    outcome("failed", "UnreadableDataError: 4 of the first 32 training samples are unreadable",
            EXIT_DATA)
    sys.exit(EXIT_DATA)
if mode in ("hang", "freeze"):  # progress as the trainer says it, then none
    sys.path.insert(0, str(pathlib.Path.cwd()))
    from training.common.progress import ProgressWriter
    progress = ProgressWriter(outcome_dir, 0).install_stacks()
    progress.beat(0, "start")
    progress.beat(3, "train")
    def stuck_in_a_collective():
        if mode == "freeze":
            import os
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
    stuck_in_a_collective()
if mode == "finish-after-usr1":
    deadline = time.monotonic() + 20
    marker = outcome_dir.parent / "proactive-checkpoint"
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    outcome("finished", "steps"); sys.exit(0)
deadline = time.monotonic() + 20   # "wait": until a signal
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(1)
""".replace("EXIT_DATA", str(EXIT_DATA))


TORCHRUN = "import subprocess, sys; sys.exit(1 if subprocess.run(sys.argv[1:]).returncode else 0)"


class RecordingAutoScaling:
    """moto's Auto Scaling client, plus CompleteLifecycleAction (moto lacks it) recorded."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.completed: list[dict[str, Any]] = []

    def complete_lifecycle_action(self, **kw: Any) -> dict[str, Any]:
        self.completed.append(kw)
        return {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class TerminatingAutoScaling(RecordingAutoScaling):
    """As Auto Scaling does with the termination hook: once the trainer group is at zero, its
    instance waits in Terminating:Wait (moto terminates it at once, hook or not).
    CompleteLifecycleAction is recorded, then answered with ``error`` when one is given."""

    def __init__(self, client: Any, error: Exception | None = None) -> None:
        super().__init__(client)
        self.error = error

    def describe_auto_scaling_instances(self, **kw: Any) -> dict[str, Any]:
        groups = self._client.describe_auto_scaling_groups(AutoScalingGroupNames=["one-trainer"])
        if groups["AutoScalingGroups"][0]["DesiredCapacity"]:
            return dict(self._client.describe_auto_scaling_instances(**kw))
        if self.completed:  # The action was completed (or tried): the instance is gone.
            return {"AutoScalingInstances": []}
        held = {"AutoScalingGroupName": "one-trainer", "LifecycleState": "Terminating:Wait"}
        return {"AutoScalingInstances": [{"InstanceId": i, **held} for i in kw["InstanceIds"]]}

    def complete_lifecycle_action(self, **kw: Any) -> dict[str, Any]:
        self.completed.append(kw)
        if self.error is not None:
            raise self.error
        return {}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with mock_aws():
        ec2 = boto3.client("ec2", region_name=REGION)
        asg = boto3.client("autoscaling", region_name=REGION)
        boto3.client("s3", region_name=REGION).create_bucket(Bucket="ckpt")
        vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(
            VpcId=vpc, CidrBlock="10.0.0.0/24", AvailabilityZone="us-east-1a"
        )
        subnet_id = subnet["Subnet"]["SubnetId"]
        names = []
        for group in ("trainer", "dataprep"):
            name = f"one-{group}"
            ec2.create_launch_template(
                LaunchTemplateName=name,
                LaunchTemplateData={"ImageId": AMI, "InstanceType": "c6i.xlarge"},
            )
            asg.create_auto_scaling_group(
                AutoScalingGroupName=name, LaunchTemplate={"LaunchTemplateName": name},
                MinSize=1, MaxSize=2, DesiredCapacity=1, VPCZoneIdentifier=subnet_id,
                Tags=[
                    {"Key": "hetero:cluster", "Value": "one", "PropagateAtLaunch": True},
                    {"Key": "hetero:group", "Value": group, "PropagateAtLaunch": True},
                ],
            )  # fmt: skip
            names.append(name)
        trainer = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["one-trainer"])
        iid = trainer["AutoScalingGroups"][0]["Instances"][0]["InstanceId"]
        inst = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]
        dataprep = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["one-dataprep"])
        data_iid = dataprep["AutoScalingGroups"][0]["Instances"][0]["InstanceId"]
        spec_path = tmp_path / "one.toml"
        spec_path.write_text(SPEC)
        yield {
            "ec2": ec2,
            "asg": RecordingAutoScaling(asg),
            "names": names,
            "instance_id": iid,
            "dataprep_instance_id": data_iid,
            "ip": inst["PrivateIpAddress"],
            "spec": load_spec(spec_path),
        }


def make_job(
    cluster: dict[str, Any],
    tmp_path: Path,
    imds: FakeImds,
    plays: list[str],
    budget: int = 2,
    **settings: Any,
) -> tuple[Ec2Job, Path]:
    spec: ClusterSpec = cluster["spec"]
    script, played = tmp_path / "script", tmp_path / "played"
    script.write_text(" ".join(plays))
    identity = GroupIdentity(
        "trainer", GroupSource.EC2, host=cluster["ip"], instance_id=cluster["instance_id"],
        region=REGION, cluster="one",
    )  # fmt: skip

    def plan_for(found: Peers, port: int, outcome_dir: str) -> LaunchPlan:
        rank = [sys.executable, "-c", STANDIN, outcome_dir, str(script), str(played)]
        # Like torchrun: a parent whose child is the rank (signals go to the ranks).
        argv = (sys.executable, "-c", TORCHRUN, *rank)
        return LaunchPlan(
            backend=Backend.EC2, identity=identity, role=Role.TRAINER, peers=found,
            commands=(("trainer", RoleCommand(argv, {})),),
        )  # fmt: skip

    settings = LoopSettings(
        restart_budget=budget, restart_backoff_s=0.05, peer_timeout_s=10, poll_s=0.1,
        spot_poll_s=0.1, grace_s=10, imds_url=imds.url, imds_timeout_s=1.0,
        subreaper=False,  # the test process must not adopt other tests' orphans
        **settings,
    )  # fmt: skip
    job = ec2_job(
        spec, identity=identity, settings=settings, plan_for=plan_for,
        environ={"HETERO_LIFECYCLE_HOOK": "hetero-checkpoint"}, run_dir=tmp_path / "run",
        ec2=cluster["ec2"], autoscaling=cluster["asg"], record=JobRecord(URI),
        asg_names=cluster["names"],
    )  # fmt: skip
    return job, played


def desired(cluster: dict[str, Any]) -> dict[str, int]:
    groups = cluster["asg"].describe_auto_scaling_groups(AutoScalingGroupNames=cluster["names"])
    return {g["AutoScalingGroupName"]: g["DesiredCapacity"] for g in groups["AutoScalingGroups"]}


def test_finished_records_the_outcome_and_scales_every_group_to_zero(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    job, played = make_job(cluster, tmp_path, fake_imds, ["finished"])
    assert job.run() == EXIT_FINISHED
    assert played.read_text() == "finished"
    outcome = JobRecord(URI).outcome()
    assert outcome is not None
    assert (outcome["outcome"], outcome["by"]) == ("finished", cluster["instance_id"])
    assert desired(cluster) == {"one-trainer": 0, "one-dataprep": 0}


COMPLETED_OWN_HOOK = {
    "LifecycleHookName": "hetero-checkpoint",
    "AutoScalingGroupName": "one-trainer",
    "LifecycleActionResult": "CONTINUE",
}


@pytest.mark.parametrize("plays", [["finished"], ["crash"]])
def test_job_end_completes_the_hook_for_its_own_termination(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds, plays: list[str]
) -> None:
    """Finished, or failed beyond the budget: the groups go to zero, Auto Scaling holds this
    trainer in Terminating:Wait, and the launcher completes the hook before it exits."""
    asg = cluster["asg"] = TerminatingAutoScaling(cluster["asg"]._client)
    job, _ = make_job(cluster, tmp_path, fake_imds, plays, budget=0)
    assert job.run() == (EXIT_FINISHED if plays == ["finished"] else EXIT_FAILED)
    assert desired(cluster) == {"one-trainer": 0, "one-dataprep": 0}
    assert asg.completed == [{**COMPLETED_OWN_HOOK, "InstanceId": cluster["instance_id"]}]


@pytest.mark.parametrize(
    "error",
    [
        ClientError(
            {"Error": {"Code": "ValidationError", "Message": "No active Lifecycle Action"}},
            "CompleteLifecycleAction",
        ),
        NotImplementedError("The complete_lifecycle_action action has not been implemented"),
    ],
    ids=["validation-error", "moto-not-implemented"],
)
def test_a_failed_completion_does_not_change_the_exit_code(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds, error: Exception
) -> None:
    asg = cluster["asg"] = TerminatingAutoScaling(cluster["asg"]._client, error)
    job, _ = make_job(cluster, tmp_path, fake_imds, ["finished"])
    assert job.run() == EXIT_FINISHED
    assert len(asg.completed) == 1


def test_with_moto_the_instance_is_gone_and_nothing_is_completed(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    """moto (the rehearsal's Auto Scaling) terminates at once: no wait, no call."""
    job, _ = make_job(cluster, tmp_path, fake_imds, ["finished"])
    started = time.monotonic()
    assert job.run() == EXIT_FINISHED
    assert cluster["asg"].completed == []
    assert time.monotonic() - started < 30


def test_a_peer_stop_re_forms_without_using_the_restart_budget(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    job, played = make_job(
        cluster, tmp_path, fake_imds, ["stopped", "stopped", "stopped", "finished"], budget=0
    )
    assert job.run() == EXIT_FINISHED
    assert played.read_text() == "stopped stopped stopped finished"
    assert job.failures == 0 and job.generation == 4


def test_crashes_beyond_the_budget_end_the_job_as_failed(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    job, played = make_job(cluster, tmp_path, fake_imds, ["crash"], budget=2)
    assert job.run() == EXIT_FAILED
    assert played.read_text() == "crash crash crash"  # the first run and 2 restarts
    outcome = JobRecord(URI).outcome()
    assert outcome is not None and outcome["outcome"] == "failed"
    assert "restart budget 2" in outcome["reason"]
    assert desired(cluster) == {"one-trainer": 0, "one-dataprep": 0}


def test_a_crash_within_the_budget_is_retried(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    job, played = make_job(cluster, tmp_path, fake_imds, ["crash", "finished"], budget=1)
    assert job.run() == EXIT_FINISHED
    assert played.read_text() == "crash finished" and job.failures == 1


def test_unreadable_data_ends_the_job_as_failed_without_a_restart(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    """A rank that exits ``EXIT_DATA`` (too many unreadable samples: a restart resumes the same
    list and fails again) ends the job at once, the budget untouched, its reason recorded."""
    job, played = make_job(cluster, tmp_path, fake_imds, ["unreadable", "finished"], budget=2)
    assert job.run() == EXIT_FAILED
    assert played.read_text() == "unreadable"  # no second generation
    assert job.failures == 0 and job.generation == 1
    outcome = JobRecord(URI).outcome()
    assert outcome is not None
    assert (outcome["outcome"], outcome["by"]) == ("failed", cluster["instance_id"])
    assert outcome["reason"] == (
        "UnreadableDataError: 4 of the first 32 training samples are unreadable (not retried: "
        "a restart would fail the same way)"
    )
    assert desired(cluster) == {"one-trainer": 0, "one-dataprep": 0}


def test_an_auto_scaling_termination_checkpoints_leaves_and_completes_the_hook(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    job, played = make_job(cluster, tmp_path, fake_imds, ["wait"])
    fake_imds.set(TARGET_LIFECYCLE_PATH, "InService")

    import threading

    def terminate_soon() -> None:
        deadline = time.monotonic() + 10
        while not played.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        fake_imds.set(TARGET_LIFECYCLE_PATH, "Terminated")

    threading.Thread(target=terminate_soon, daemon=True).start()
    assert job.run() == EXIT_STOPPED
    record = JobRecord(URI)
    assert record.leaving() == {cluster["instance_id"]}
    assert record.outcome() is None  # a host leaving never ends the job
    assert cluster["asg"].completed == [
        {
            "LifecycleHookName": "hetero-checkpoint",
            "AutoScalingGroupName": "one-trainer",
            "InstanceId": cluster["instance_id"],
            "LifecycleActionResult": "CONTINUE",
        }
    ]
    assert desired(cluster) == {"one-trainer": 1, "one-dataprep": 1}


def test_a_rebalance_recommendation_checkpoints_and_training_goes_on(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    job, _ = make_job(cluster, tmp_path, fake_imds, ["finish-after-usr1"])
    fake_imds.set(REBALANCE_PATH, '{"noticeTime": "2026-11-22T10:00:00Z"}')
    assert job.run() == EXIT_FINISHED
    assert (tmp_path / "run" / "proactive-checkpoint").read_text() == "saved"
    assert job.failures == 0 and job.generation == 1
    assert JobRecord(URI).leaving() == set()


def test_a_host_that_starts_after_the_job_ended_runs_nothing(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    from training.common.outcome import Outcome

    JobRecord(URI).end(Outcome.FINISHED, reason="training finished", by="i-other")
    for name in cluster["names"]:  # e.g. a deploy set the groups to their counts again
        cluster["asg"].set_desired_capacity(AutoScalingGroupName=name, DesiredCapacity=1)
    job, played = make_job(cluster, tmp_path, fake_imds, ["crash"])
    assert job.run() == EXIT_FINISHED
    assert not played.exists()
    # It does not keep billing: the groups go back to zero, and the first outcome stays.
    assert desired(cluster) == {"one-trainer": 0, "one-dataprep": 0}
    outcome = JobRecord(URI).outcome()
    assert outcome is not None
    assert (outcome["outcome"], outcome["by"]) == ("finished", "i-other")


def test_status_shows_groups_instances_outcome_metrics_and_newest_checkpoint(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    from training.workstation.status import collect

    s3 = boto3.client("s3", region_name=REGION)
    for key in ("step-4/a.distcp", "step-4/COMPLETE", "step-8/a.distcp"):  # step 8 is cut off
        s3.put_object(Bucket="ckpt", Key=f"checkpoints/one/{key}", Body=b"x")
    record = JobRecord(URI)
    record.set_host(cluster["instance_id"], state="running", metrics={"step": 7, "loss": 2.5})
    status = collect(
        cluster["spec"], checkpoint_uri=URI, ec2=cluster["ec2"], autoscaling=cluster["asg"], s3=s3
    )
    assert status.errors == []
    assert [(g["group"], g["desired"], g["in_service"]) for g in status.groups] == [
        ("trainer", 1, 1),
        ("dataprep", 1, 1),
    ]
    trainer = [i for i in status.instances if i["group"] == "trainer"]
    assert [(i["instance_id"], i["market"], i["az"]) for i in trainer] == [
        (cluster["instance_id"], "on-demand", "us-east-1a")
    ]
    assert status.outcome is None
    assert status.hosts[cluster["instance_id"]]["metrics"] == {"step": 7, "loss": 2.5}
    assert status.newest_checkpoint == "s3://ckpt/checkpoints/one/step-4/"
    assert status.model is None  # no model until a finished job writes one
    # After the job: the outcome and the groups at zero.
    job, _ = make_job(cluster, tmp_path, fake_imds, ["finished"])
    assert job.run() == EXIT_FINISHED
    after = collect(
        cluster["spec"], checkpoint_uri=URI, ec2=cluster["ec2"], autoscaling=cluster["asg"], s3=s3
    )
    assert after.outcome is not None and after.outcome["outcome"] == "finished"
    assert [g["desired"] for g in after.groups] == [0, 0]
    s3.put_object(Bucket="ckpt", Key="checkpoints/one/model/config.json", Body=b"{}")
    done = collect(
        cluster["spec"], checkpoint_uri=URI, ec2=cluster["ec2"], autoscaling=cluster["asg"], s3=s3
    )
    assert done.model == "s3://ckpt/checkpoints/one/model/"


def terminate_when_taken_out(imds: FakeImds, iid: str) -> None:
    """As Auto Scaling would after SetInstanceHealth Unhealthy: once the job record says the
    host was taken out, its target lifecycle state becomes Terminated (bounded: 40 s)."""
    import threading

    def terminate() -> None:
        deadline = time.monotonic() + 40
        while iid not in JobRecord(URI).evicted() and time.monotonic() < deadline:
            time.sleep(0.1)
        imds.set(TARGET_LIFECYCLE_PATH, "Terminated")

    threading.Thread(target=terminate, daemon=True).start()


HANG_SETTINGS = {"hang_floor_s": 1.0, "stacks_wait_s": 1.0, "heartbeat_s": 0.2}
"""A second without progress is a hang; a second for the stacks; a look every 0.2 s."""


def test_a_hung_generation_leaves_its_stacks_is_killed_and_the_job_goes_on(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    """The rank lives, stuck; its stacks (from faulthandler, inside time.sleep) go to the run
    folder and the job record, the generation is killed and counted as a failure. Hung twice
    with ranks that answered: this host waited on something else, it is not taken out."""
    job, played = make_job(
        cluster, tmp_path, fake_imds, ["hang", "hang", "finished"], budget=2, **HANG_SETTINGS
    )
    started = time.monotonic()
    assert job.run() == EXIT_FINISHED
    assert played.read_text() == "hang hang finished"
    assert job.failures == 2 and job.generation == 3
    assert time.monotonic() - started < 30
    iid = cluster["instance_id"]
    hangs = JobRecord(URI).hangs()
    assert sorted(hangs) == [f"{iid}-1", f"{iid}-2"]
    (rank,) = hangs[f"{iid}-1"]["ranks"]
    assert (rank["rank"], rank["step"], rank["phase"], rank["answered"]) == (0, 3, "train", True)
    assert "stuck_in_a_collective" in rank["stacks"]
    assert rank["process"] in ("sleeping", "running")
    assert hangs[f"{iid}-1"]["reason"].startswith("hung: no training progress for ")
    report = (tmp_path / "run" / "hangs" / "generation-2.txt").read_text()
    assert "rank 0 at step 3 (train): stacks written" in report
    assert "stuck_in_a_collective" in report
    assert JobRecord(URI).evicted() == {}


def test_a_host_frozen_in_two_generations_in_a_row_takes_itself_out(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    """A rank that cannot answer (SIGSTOPped) in two generations in a row: the host marks
    itself Unhealthy, is recorded as evicted and leaving, then leaves at its termination."""

    job, played = make_job(
        cluster, tmp_path, fake_imds, ["freeze", "freeze", "finished"], budget=2,
        **HANG_SETTINGS,
    )  # fmt: skip
    fake_imds.set(TARGET_LIFECYCLE_PATH, "InService")
    iid = cluster["instance_id"]
    terminate_when_taken_out(fake_imds, iid)
    assert job.run() == EXIT_STOPPED
    assert played.read_text() == "freeze freeze"
    record = JobRecord(URI)
    evicted = record.evicted()[iid]
    assert evicted["by"] == iid and evicted["group"] == "trainer"
    assert evicted["reason"].startswith("hung in generations 1 and 2, with rank(s) that did not")
    assert "rank 0 at step 3 (train): no stacks (process stopped)" in evicted["reason"]
    assert record.leaving() == {iid}
    health = cluster["asg"].describe_auto_scaling_instances(InstanceIds=[iid])
    assert health["AutoScalingInstances"][0]["HealthStatus"].upper() == "UNHEALTHY"
    assert job.failures == 1  # the first hang; the second took the host out instead
    assert cluster["asg"].completed == [{**COMPLETED_OWN_HOOK, "InstanceId": iid}]
    assert record.outcome() is None


# A data server stand-in: the standard health service, SERVING for a second, then what each test
# adds (sys.argv: the address, the outcome folder).
HEALTH_SERVER = r"""
import os, signal, sys, time
from concurrent import futures
from pathlib import Path
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from training.common.outcome import mark_server_stopped
from training.dataplane.rpc import SERVICE_NAME
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
servicer = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
server.add_insecure_port(sys.argv[1])
server.start()
time.sleep(1.0)
"""
FROZEN_SERVER = HEALTH_SERVER + "os.kill(os.getpid(), signal.SIGSTOP)\n"
"""SIGSTOPped by itself (alive, silent), as a wedged `hetero serve`."""
STOPPING_SERVER = HEALTH_SERVER + (
    "server.stop(0).wait()\n"
    "mark_server_stopped(Path(sys.argv[2]), int(sys.argv[1].rsplit(':', 1)[1]))\n"
    "time.sleep(5.0)\n"
)
"""Stopped on request as `hetero serve` stops after the job's Shutdown (its port closed,
``server-<PORT>.stopped`` written), then an exit that takes longer than the silent-host bound (a
slow teardown on a busy host), code 0."""


def dataprep_job(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds, server: str
) -> tuple[Ec2Job, str]:
    """The dataprep instance's job with one data server, ``server`` (a script above) at a free
    address, a silent-host bound of 3 s; the job and the address."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    identity = GroupIdentity(
        "dataprep", GroupSource.EC2, host="127.0.0.1", instance_id=cluster["dataprep_instance_id"],
        region=REGION, cluster="one",
    )  # fmt: skip

    def plan_for(found: Peers, port: int, outcome_dir: str) -> LaunchPlan:
        argv = (sys.executable, "-c", server, address, outcome_dir)
        return LaunchPlan(
            backend=Backend.EC2, identity=identity, role=Role.DATAPREP, peers=found,
            commands=(("data-server-0", RoleCommand(argv, {})),), serves=(address,),
        )  # fmt: skip

    settings = LoopSettings(
        restart_budget=2, restart_backoff_s=0.05, peer_timeout_s=20, poll_s=0.1,
        spot_poll_s=0.1, grace_s=5, imds_url=fake_imds.url, imds_timeout_s=1.0,
        subreaper=False, heartbeat_s=0.3, silent_after_s=3.0,
    )  # fmt: skip
    job = ec2_job(
        cluster["spec"], identity=identity, settings=settings, plan_for=plan_for,
        environ={"HETERO_LIFECYCLE_HOOK": "hetero-checkpoint"}, run_dir=tmp_path / "run",
        ec2=cluster["ec2"], autoscaling=cluster["asg"], record=JobRecord(URI),
        asg_names=cluster["names"],
    )  # fmt: skip
    fake_imds.set(TARGET_LIFECYCLE_PATH, "InService")
    return job, address


def test_a_data_server_that_stops_answering_is_taken_out_by_its_own_launcher(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    """Its launcher writes on (not silent), its server does not answer the health check for
    the silent-host bound: the generation is killed, the host marks itself Unhealthy, is
    recorded as evicted and leaving, and leaves at its termination."""
    job, address = dataprep_job(cluster, tmp_path, fake_imds, FROZEN_SERVER)
    iid = cluster["dataprep_instance_id"]
    terminate_when_taken_out(fake_imds, iid)
    started = time.monotonic()
    assert job.run() == EXIT_STOPPED
    assert time.monotonic() - started < 30
    record = JobRecord(URI)
    evicted = record.evicted()[iid]
    assert evicted["by"] == iid and evicted["group"] == "dataprep"
    assert evicted["reason"].startswith(
        f"not answering: data server {address} has not answered its health check for "
    ), evicted
    assert record.leaving() == {iid}
    health = cluster["asg"].describe_auto_scaling_instances(InstanceIds=[iid])
    assert health["AutoScalingInstances"][0]["HealthStatus"].upper() == "UNHEALTHY"
    assert job.generation == 1 and job.failures == 0
    assert cluster["asg"].completed == [
        {**COMPLETED_OWN_HOOK, "AutoScalingGroupName": "one-dataprep", "InstanceId": iid}
    ]


def test_a_data_server_stopped_on_request_is_not_taken_out_while_it_exits(
    cluster: dict[str, Any], tmp_path: Path, fake_imds: FakeImds
) -> None:
    """The job's Shutdown closes the server's port; its process then takes longer to exit than
    the silent-host bound. Its launcher does not take that silence for a fault: the server said
    it stopped (``server-<PORT>.stopped`` in the outcome folder), so nobody is taken out and the
    generation ends as the server's exit says."""
    job, _ = dataprep_job(cluster, tmp_path, fake_imds, STOPPING_SERVER)
    iid = cluster["dataprep_instance_id"]
    record = JobRecord(URI)
    stopped = tmp_path / "run"

    def end_the_job_once_the_server_stopped() -> None:  # as the trainers do after Shutdown
        deadline = time.monotonic() + 20
        while not list(stopped.rglob("server-*.stopped")) and time.monotonic() < deadline:
            time.sleep(0.05)
        record.end(Outcome.FINISHED, reason="training finished", by="i-trainer")

    ender = threading.Thread(target=end_the_job_once_the_server_stopped, daemon=True)
    ender.start()
    assert job.run() == EXIT_FINISHED
    ender.join(timeout=5)
    assert record.evicted() == {}
    health = cluster["asg"].describe_auto_scaling_instances(InstanceIds=[iid])
    assert health["AutoScalingInstances"][0]["HealthStatus"].upper() == "HEALTHY"
    assert record.host(iid)["state"] != "generation-failed", record.host(iid)
