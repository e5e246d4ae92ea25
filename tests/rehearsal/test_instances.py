"""The group simulator keeps one process tree per running moto instance: trees start with their
instance (on its IMDS), die whole with it, replacements get trees, a launcher that exits leaves
its instance running, and scaling to zero leaves nothing behind. A small stand-in plays the
launcher (the real one is exercised end to end in test_rehearse_e2e.py)."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from training.rehearsal.aws import AwsEmulator
from training.rehearsal.events import EventLog
from training.rehearsal.faults import FaultKind
from training.rehearsal.instances import (
    GroupSimulator,
    InstanceContext,
    InstanceRun,
    launcher_argv,
    launcher_env,
)
from training.spec import load_spec

# Reads its group from IMDS (as the launcher does), starts a grandchild, then a trainer keeps
# running and a dataprep "launcher" exits with code 7.
STAND_IN = r"""
import subprocess, sys, time, urllib.request
base = sys.argv[1]
token = urllib.request.urlopen(urllib.request.Request(
    base + "/latest/api/token", method="PUT",
    headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}), timeout=5).read().decode()
group = urllib.request.urlopen(urllib.request.Request(
    base + "/latest/meta-data/tags/instance/hetero:group",
    headers={"X-aws-ec2-metadata-token": token}), timeout=5).read().decode()
print("group", group, flush=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
if group == "dataprep":
    child.kill(); child.wait()
    sys.exit(7)
time.sleep(120)
"""


def stand_in(spec_path: Path, imds_url: str, extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-c", STAND_IN, imds_url]


def wait_for(what: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def tree_size(run: InstanceRun) -> int:
    return len(run.live_processes())


def simulator(aws: AwsEmulator, spec: Path, tmp_path: Path) -> tuple[GroupSimulator, EventLog]:
    """A simulator of ``spec``'s groups (provisioned in moto) running the stand-in launcher."""
    events = EventLog(echo=lambda line: None)
    ctx = InstanceContext(
        names=aws.provision(load_spec(spec)),
        moto_url=aws.endpoint_url,
        s3_url=aws.endpoint_url,
        sample_dir=tmp_path / "samples",
        run_id=uuid.uuid4().hex,
    )
    sim = GroupSimulator(
        aws=aws, ctx=ctx, spec_path=spec, out_dir=tmp_path, events=events, poll_s=0.2,
        command=stand_in,
    )  # fmt: skip
    return sim, events


def test_trees_follow_instances(aws: AwsEmulator, small_spec: Path, tmp_path: Path) -> None:
    sim, events = simulator(aws, small_spec, tmp_path)
    names = sim.ctx.names
    sim.start()
    try:
        wait_for(lambda: len(sim.runs()) == 3)
        t0, t1 = sim.instance("trainer", 0), sim.instance("trainer", 1)
        d0 = sim.instance("dataprep", 0)
        assert t0 and t1 and d0 and sim.instance("trainer", 2) is None
        wait_for(lambda: tree_size(t0) == 2 and tree_size(t1) == 2)
        assert "group trainer" in (t0.folder / "launcher.log").read_text()
        assert t0.tmpdir is not None and t0.tmpdir.is_dir() and len(str(t0.tmpdir)) < 40

        # A launcher that exits by itself: an event with its code, the instance stays.
        wait_for(lambda: d0.exit_code == 7)
        assert not d0.terminated
        assert [e.data["code"] for e in events.events("launcher-exited")] == [7]

        # Termination kills the whole tree; the group's replacement gets a tree of its own.
        doomed = t0.live_processes()
        aws.terminate_instance(t0.instance_id)
        wait_for(lambda: t0.terminated)
        assert t0.tmpdir is not None and not t0.tmpdir.exists()
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in doomed)
        wait_for(lambda: sim.instance("trainer", 2) is not None)
        replacement = sim.instance("trainer", 2)
        assert replacement is not None and replacement.private_ip != t0.private_ip
        wait_for(lambda: tree_size(replacement) == 2)

        # Scaling every group to zero terminates everything; nothing is left.
        for asg in names.asg_names.values():
            aws.client("autoscaling").update_auto_scaling_group(
                AutoScalingGroupName=asg, MinSize=0, DesiredCapacity=0
            )
        wait_for(lambda: not sim.live_runs())
        assert sim.processes_left() == []
    finally:
        sim.shutdown()
    kinds = [e.kind for e in events.events()]
    assert kinds.count("instance-launched") == 4 and kinds.count("instance-terminated") == 4
    # Launchers killed with their instance did not exit by themselves: no exit event.
    assert [e.data["code"] for e in events.events("launcher-exited")] == [7]
    assert t0.killed and t0.exit_code is None and not d0.killed


def test_launcher_command_and_environment(tmp_path: Path) -> None:
    from training.rehearsal.aws import ClusterNames

    argv = launcher_argv(tmp_path / "s.toml", "http://127.0.0.1:1234")
    assert argv[1:4] == ["-m", "training.cli", "launch"]
    assert argv[argv.index("--spot-poll") + 1] == "0.5"
    assert "--group" not in argv and "--imds-url" not in argv  # both found through IMDS / env
    names = ClusterNames(
        cluster="c",
        region="us-east-1",
        bucket="c-checkpoints",
        checkpoint_prefix="checkpoints/c/",
        asg_names={"trainer": "c-trainer", "dataprep": "c-dataprep"},
    )
    ctx = InstanceContext(names, "http://127.0.0.1:1", "http://127.0.0.1:2", tmp_path, "run")
    env = launcher_env(
        {"HETERO_GROUP": "trainer", "AWS_PROFILE": "prod", "PATH": "/bin"},
        ctx,
        imds_url="http://127.0.0.1:3",
        instance_id="i-1",
    )
    assert "HETERO_GROUP" not in env and "AWS_PROFILE" not in env and env["PATH"] == "/bin"
    assert env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] == "http://127.0.0.1:3"
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:1"
    assert env["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:2"
    assert env["AWS_ACCESS_KEY_ID"] == env["AWS_SECRET_ACCESS_KEY"] == "testing"
    assert env["HETERO_CHECKPOINT_URI"] == "s3://c-checkpoints/checkpoints/c/"
    assert env["HETERO_ASG_NAMES"] == "c-trainer,c-dataprep"
    assert env["HETERO_LIFECYCLE_HOOK"] == "hetero-checkpoint"
    assert env["HETERO_SAMPLE_LOG_DIR"] == str(tmp_path)
    assert env["HETERO_COLLECTIVE_TIMEOUT_S"] == "20"
    assert env["HETERO_CLUSTER"] == "c" and env["AWS_DEFAULT_REGION"] == "us-east-1"


def test_launch_faults_a_boot_that_gives_up_and_a_launcher_without_tags(
    aws: AwsEmulator, small_spec: Path, tmp_path: Path
) -> None:
    sim, events = simulator(aws, small_spec, tmp_path)
    hits: list[tuple[str, int, str]] = []

    def launch_fault(group: str, index: int, instance_id: str) -> FaultKind | None:
        hits.append((group, index, instance_id))
        if (group, index) == ("trainer", 0):
            return FaultKind.BOOT_FAIL
        return FaultKind.EARLY_EXIT if (group, index) == ("dataprep", 0) else None

    sim.launch_fault = launch_fault
    sim.start()
    try:
        wait_for(lambda: len(sim.runs()) >= 3)
        t0, d0 = sim.instance("trainer", 0), sim.instance("dataprep", 0)
        assert t0 is not None and d0 is not None
        # The failed boot: its stand-in exits 1 without a launcher, EC2 terminates the
        # instance as an OS shutdown, and the group launches a replacement that boots.
        wait_for(lambda: t0.terminated and sim.instance("trainer", 2) is not None)
        assert t0.exit_code == 1 and t0.shut_down and t0.launch_fault is FaultKind.BOOT_FAIL
        assert "hetero boot: giving up" in (t0.folder / "launcher.log").read_text()
        (reservation,) = aws.client("ec2").describe_instances(InstanceIds=[t0.instance_id])[
            "Reservations"
        ]
        assert reservation["Instances"][0]["StateReason"]["Code"] == (
            "Client.InstanceInitiatedShutdown"
        )
        t2 = sim.instance("trainer", 2)
        assert t2 is not None
        wait_for(lambda: "group trainer" in (t2.folder / "launcher.log").read_text())
        # The early exit: its metadata has no tags, so reading its group fails.
        wait_for(lambda: d0.exit_code is not None)
        assert d0.exit_code == 1 and not d0.terminated
        assert "HTTP Error 404" in (d0.folder / "launcher.log").read_text()
        # SetInstanceHealth Unhealthy (what the real launcher calls): Auto Scaling replaces it.
        aws.client("autoscaling").set_instance_health(
            InstanceId=d0.instance_id, HealthStatus="Unhealthy", ShouldRespectGracePeriod=False
        )
        wait_for(lambda: d0.terminated and sim.instance("dataprep", 1) is not None)
        assert [e.instance for e in events.events("unhealthy-replaced")] == [d0.instance_id]
    finally:
        sim.shutdown()
    assert [(g, i) for g, i, _ in hits] == [
        ("trainer", 0), ("trainer", 1), ("dataprep", 0), ("trainer", 2), ("dataprep", 1)
    ]  # fmt: skip
    assert [e.instance for e in events.events("boot-gave-up")] == [t0.instance_id]
