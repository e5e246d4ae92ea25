"""The Spot watcher stops a real child when IMDS announces an interruption; job end scales the
Auto Scaling groups to zero (moto)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from training.launcher.imds import ImdsClient, endpoint_from_env
from training.launcher.job_end import asg_names_from_env, scale_to_zero
from training.launcher.spot import (
    INSTANCE_ACTION_PATH,
    REBALANCE_PATH,
    TARGET_LIFECYCLE_PATH,
    SpotNotice,
    SpotWatcher,
)
from training.processes.supervisor import Supervisor

from .conftest import FakeImds

# A stand-in trainer: on SIGTERM it "checkpoints" (writes a file) and exits 0.
CHILD = """
import pathlib, signal, sys, time
def on_term(signum, frame):
    pathlib.Path(sys.argv[1]).write_text("checkpointed")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
pathlib.Path(sys.argv[2]).write_text("ready")
while True:
    time.sleep(0.05)
"""


def wait_for(path: Path, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("path", "body", "kind"),
    [
        (
            INSTANCE_ACTION_PATH,
            '{"action": "terminate", "time": "2026-11-21T16:00:00Z"}',
            "instance-action",
        ),
        (REBALANCE_PATH, '{"noticeTime": "2026-11-21T15:58:00Z"}', "rebalance"),
    ],
)  # fmt: skip
def test_notice_sends_sigterm_to_the_child(
    fake_imds: FakeImds, tmp_path: Path, path: str, body: str, kind: str
) -> None:
    marker, ready = tmp_path / "checkpoint", tmp_path / "ready"
    with Supervisor(grace_s=10) as sup:
        child = sup.start("trainer", [sys.executable, "-c", CHILD, str(marker), str(ready)])
        wait_for(ready)
        notices: list[SpotNotice] = []

        def on_notice(notice: SpotNotice) -> None:
            notices.append(notice)
            sup.request_stop(signal.SIGTERM, notice.describe())

        watcher = SpotWatcher(ImdsClient(fake_imds.url), on_notice, interval_s=0.1)
        watcher.start()
        time.sleep(0.5)
        assert child.returncode is None and not notices  # no notice yet: nothing happens
        fake_imds.set(path, body)
        assert sup.wait(child, timeout_s=10) == 0
        watcher.join(timeout=5)
    assert marker.read_text() == "checkpointed"
    assert [n.kind for n in notices] == [kind]
    assert sup.stop_signal == signal.SIGTERM
    assert "2026-11-21T1" in (sup.stop_reason or "")


def test_scale_to_zero_sets_min_max_and_desired(monkeypatch: pytest.MonkeyPatch) -> None:
    with mock_aws():
        ec2 = boto3.client("ec2", region_name="us-east-1")
        image = "ami-12c6146b"  # one of moto's built-in images
        asg = boto3.client("autoscaling", region_name="us-east-1")
        for name in ("vit-trainer", "vit-dataprep"):
            ec2.create_launch_template(
                LaunchTemplateName=name,
                LaunchTemplateData={"ImageId": image, "InstanceType": "c6i.4xlarge"},
            )
            asg.create_auto_scaling_group(
                AutoScalingGroupName=name,
                LaunchTemplate={"LaunchTemplateName": name},
                MinSize=2,
                MaxSize=4,
                DesiredCapacity=2,
                AvailabilityZones=["us-east-1a"],
            )
        names = asg_names_from_env({"HETERO_ASG_NAMES": "vit-trainer, vit-dataprep,"})
        assert names == ["vit-trainer", "vit-dataprep"]
        assert scale_to_zero(asg, names) == names
        groups = asg.describe_auto_scaling_groups(AutoScalingGroupNames=names)
        for g in groups["AutoScalingGroups"]:  # MaxSize too: nothing raises it after the job
            assert (g["MinSize"], g["MaxSize"], g["DesiredCapacity"]) == (0, 0, 0)


def test_scale_to_zero_tries_every_group_before_raising() -> None:
    calls: list[str] = []

    class FailingFirst:
        def update_auto_scaling_group(self, **kw: object) -> None:
            calls.append(str(kw["AutoScalingGroupName"]))
            if kw["AutoScalingGroupName"] == "a":
                raise RuntimeError("throttled")

    with pytest.raises(RuntimeError, match="throttled"):
        scale_to_zero(FailingFirst(), ["a", "b"])
    assert calls == ["a", "b"]


def test_auto_scaling_termination_stops_and_a_rebalance_only_checkpoints(
    fake_imds: FakeImds,
) -> None:
    stops: list[SpotNotice] = []
    checkpoints: list[SpotNotice] = []
    watcher = SpotWatcher(
        ImdsClient(fake_imds.url), stops.append, on_rebalance=checkpoints.append, interval_s=0.05
    )
    fake_imds.set(TARGET_LIFECYCLE_PATH, "InService")
    fake_imds.set(REBALANCE_PATH, '{"noticeTime": "2026-11-22T10:00:00Z"}')
    watcher.start()
    deadline = time.monotonic() + 5
    while not checkpoints and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # several more polls: the recommendation is reported once, no stop
    assert [n.kind for n in checkpoints] == ["rebalance"] and stops == []
    assert watcher.is_alive()
    fake_imds.set(TARGET_LIFECYCLE_PATH, "Terminated")
    watcher.join(timeout=5)
    assert not watcher.is_alive()
    assert [(n.kind, n.stops) for n in stops] == [("asg-termination", True)]
    assert "Auto Scaling termination" in stops[0].describe()


def test_imds_endpoint_comes_from_the_standard_variable() -> None:
    assert endpoint_from_env({}) == "http://169.254.169.254"
    assert (
        endpoint_from_env({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.9:8080"})
        == "http://127.0.0.9:8080"
    )
