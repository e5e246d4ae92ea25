"""Elastic trainer membership (moto EC2, Auto Scaling lifecycle states through botocore's
Stubber) and the job record (moto S3 and a folder)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from training.common.jobrecord import JobRecord
from training.common.outcome import Outcome
from training.launcher.membership import (
    Member,
    Membership,
    MembershipTimeout,
    current_membership,
    wait_for_membership,
)

from .test_launcher_peers import REGION, ec2, launch  # noqa: F401  (ec2 is a fixture)


def _lifecycle(states: dict[str, str]) -> Any:
    """An Auto Scaling client whose DescribeAutoScalingInstances answers ``states``."""
    client = boto3.client(
        "autoscaling", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x"
    )
    stub = Stubber(client)
    stub.add_response(
        "describe_auto_scaling_instances",
        {
            "AutoScalingInstances": [
                {
                    "InstanceId": iid,
                    "InstanceType": "g5.xlarge",
                    "AutoScalingGroupName": "vit-test-trainer",
                    "AvailabilityZone": "us-west-2a",
                    "LifecycleState": state,
                    "HealthStatus": "HEALTHY",
                    "ProtectedFromScaleIn": False,
                }
                for iid, state in states.items()
            ]
        },
        {"InstanceIds": list(states)},
    )
    stub.activate()
    return client


def test_members_exclude_terminating_and_leaving_hosts(ec2: tuple[Any, str]) -> None:  # noqa: F811
    a = launch(ec2, "10.0.0.10", "trainer")
    b = launch(ec2, "10.0.0.11", "trainer")
    c = launch(ec2, "10.0.0.12", "trainer")
    d = launch(ec2, "10.0.0.13", "trainer")
    launch(ec2, "10.0.0.20", "dataprep")
    autoscaling = _lifecycle(
        {a: "InService", b: "Terminating:Wait", c: "InService", d: "InService"}
    )
    m = current_membership(
        ec2[0], autoscaling, cluster="vit-test", group="trainer", count=2, leaving=lambda: {c}
    )
    # b is in Terminating:Wait (lifecycle hook), c said it is leaving: a and d train.
    assert m.members == (Member(a, "10.0.0.10"), Member(d, "10.0.0.13"))
    assert m.standby == ()
    assert m.index(d) == 1 and m.index(b) is None


def test_a_replacement_that_arrives_early_waits_on_standby(ec2: tuple[Any, str]) -> None:  # noqa: F811
    # The replacement got a lower address than a running member; it still waits: older
    # instances come first, so a running generation is never displaced.
    a = launch(ec2, "10.0.0.30", "trainer")
    b = launch(ec2, "10.0.0.31", "trainer")
    instances = ec2[0].describe_instances()["Reservations"]
    assert len(instances) == 2
    import moto.ec2.models as models

    # Make the later launch unambiguous (moto stamps launch times to the second).
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=5)
    replacement = launch(ec2, "10.0.0.5", "trainer")
    backend = models.ec2_backends["123456789012"][REGION]
    backend.get_instance(replacement).launch_time = later
    m = current_membership(ec2[0], None, cluster="vit-test", group="trainer", count=2)
    assert m.ids == (a, b)
    assert [s.instance_id for s in m.standby] == [replacement]
    # When a member leaves, the standby instance joins.
    m2 = current_membership(
        ec2[0], None, cluster="vit-test", group="trainer", count=2, leaving=lambda: {a}
    )
    assert m2.ids == (b, replacement)


def test_rendezvous_port_follows_the_member_list() -> None:
    one = Membership((Member("i-1", "10.0.0.1"), Member("i-2", "10.0.0.2")))
    same = Membership((Member("i-1", "10.0.0.1"), Member("i-2", "10.0.0.2")))
    other = Membership((Member("i-1", "10.0.0.1"), Member("i-3", "10.0.0.3")))
    assert one.rendezvous_port == same.rendezvous_port
    assert 29500 <= one.rendezvous_port < 29600
    ports = {
        Membership((Member("i-1", "a"), Member(f"i-{n}", "b"))).rendezvous_port
        for n in range(2, 40)
    }
    assert len(ports) > 20  # spread, so disagreeing hosts rarely share a port
    assert other.ids != one.ids


def test_wait_returns_once_complete_and_times_out_naming_what_it_saw() -> None:
    short = Membership((Member("i-1", "10.0.0.1"),))
    full = Membership((Member("i-1", "10.0.0.1"), Member("i-2", "10.0.0.2")))
    seen = iter([short, short, full])
    sleeps: list[float] = []
    m = wait_for_membership(
        lambda: next(seen), count=2, own_instance_id="i-2", timeout_s=60, poll_s=2,
        sleep=sleeps.append,
    )  # fmt: skip
    assert m == full and sleeps == [2, 2]
    with pytest.raises(
        MembershipTimeout, match=r"short of hosts\): 1/2 usable instances \['10.0.0.1'\]"
    ):
        wait_for_membership(
            lambda: short, count=2, own_instance_id="i-1", timeout_s=0.05, poll_s=0.01
        )
    with pytest.raises(MembershipTimeout, match="on standby"):
        wait_for_membership(
            lambda: full, count=2, own_instance_id="i-9", timeout_s=0.05, poll_s=0.01
        )
    assert (
        wait_for_membership(
            lambda: short, count=2, own_instance_id="i-1", timeout_s=60, should_stop=lambda: True
        )
        is None
    )


@pytest.mark.parametrize("where", ["s3", "folder"])
def test_job_record_first_outcome_wins_and_lists_hosts(where: str, tmp_path: Path) -> None:
    with mock_aws():
        if where == "s3":
            boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="ckpt")
            location = "s3://ckpt/checkpoints/vit-test/"
        else:
            location = str(tmp_path / "checkpoints")
        record = JobRecord(location)
        assert record.outcome() is None and record.leaving() == set()
        record.mark_leaving("i-2", "Spot interruption notice")
        record.set_host("i-1", group="trainer", state="running")
        record.set_host("i-2", group="trainer", state="left")
        first = record.end(Outcome.FINISHED, reason="training finished", by="i-1")
        again = record.end(Outcome.FAILED, reason="late failure", by="i-3")
        assert again == first
        got = JobRecord(location).outcome()
        assert got is not None
        assert (got["outcome"], got["reason"], got["by"]) == (
            "finished",
            "training finished",
            "i-1",
        )
        assert record.leaving() == {"i-2"}
        assert {k: v["state"] for k, v in record.hosts().items()} == {
            "i-1": "running",
            "i-2": "left",
        }
        # A later end (a budget stop included) never replaces the first outcome.
        assert record.end(Outcome.STOPPED, reason="x", by="i-1")["outcome"] == "finished"
        if where == "s3":
            keys = [
                o["Key"]
                for o in boto3.client("s3", region_name="us-east-1").list_objects_v2(Bucket="ckpt")[
                    "Contents"
                ]
            ]
            assert "checkpoints/vit-test/job/outcome.json" in keys
            assert "checkpoints/vit-test/job/leaving/i-2.json" in keys
