"""A launcher that cannot start its job loop takes its instance out of service, within the job's
budget of replacements; past it, the job ends failed with every group at zero.

Every Auto Scaling call is answered by botocore's Stubber (exact parameters, nothing else
called); the job record is a real one in a folder (the S3 backend is tested in
test_launcher_jobrecord.py). The last test goes through ``hetero launch`` itself with a job
pointer that does not exist, against moto's SSM and the fake IMDS.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.stub import Stubber

from training.common.jobrecord import JobRecord
from training.common.names import LIFECYCLE_HOOK_NAME
from training.common.outcome import EXIT_FAILED
from training.launcher import early_exit, launch
from training.launcher.peers import EXIT_PEERS

from .conftest import HOST_GROUPS, HOST_INSTANCE, FakeImds, as_deployed_host, one_of_each, stubbed

INSTANCE, GROUPS = HOST_INSTANCE, HOST_GROUPS
UNHEALTHY = {"InstanceId": INSTANCE, "HealthStatus": "Unhealthy", "ShouldRespectGracePeriod": False}


@pytest.fixture
def autoscaling() -> Iterator[tuple[Any, Stubber]]:
    yield from stubbed("autoscaling")


def leave(client: Any, record: JobRecord | None, **kw: Any) -> int:
    return early_exit.leave_service(
        "job pointer: /hetero/vit/job not found",
        2,
        instance_id=kw.pop("instance_id", INSTANCE),
        group="dataprep",
        record=record,
        autoscaling=client,
        asg_names=GROUPS,
        budget=kw.pop("budget", 3),
        sleep=lambda s: None,
        **kw,
    )


def test_set_unhealthy_is_the_exact_call(autoscaling: tuple[Any, Stubber]) -> None:
    client, stub = autoscaling
    stub.add_response("set_instance_health", {}, expected_params=UNHEALTHY)
    assert early_exit.set_unhealthy(client, INSTANCE) is True


def test_set_unhealthy_errors_are_logged_not_raised(autoscaling: tuple[Any, Stubber]) -> None:
    client, stub = autoscaling
    stub.add_client_error("set_instance_health", "AccessDenied", expected_params=UNHEALTHY)
    assert early_exit.set_unhealthy(client, INSTANCE) is False


def test_within_the_budget_the_instance_is_counted_and_marked_unhealthy(
    autoscaling: tuple[Any, Stubber], tmp_path: Path
) -> None:
    client, stub = autoscaling
    record = JobRecord(str(tmp_path))
    stub.add_response("set_instance_health", {}, expected_params=UNHEALTHY)
    assert leave(client, record) == 2  # the launcher's own code: Docker sees a failure
    replaced = record.replaced()
    assert list(replaced) == [INSTANCE]
    assert replaced[INSTANCE]["group"] == "dataprep"
    assert replaced[INSTANCE]["reason"] == "job pointer: /hetero/vit/job not found"
    assert record.outcome() is None


def test_a_restarted_launcher_on_the_same_instance_counts_once(
    autoscaling: tuple[Any, Stubber], tmp_path: Path
) -> None:
    """Docker restarts the launcher (on-failure:5) while the group replaces the instance: the
    count is per instance, so the restarts do not spend the job's budget."""
    client, stub = autoscaling
    record = JobRecord(str(tmp_path))
    for _ in range(3):
        stub.add_response("set_instance_health", {}, expected_params=UNHEALTHY)
        assert leave(client, record, budget=1) == 2
    assert list(record.replaced()) == [INSTANCE]
    assert record.outcome() is None


def test_past_the_budget_the_job_ends_failed_with_every_group_at_zero(
    autoscaling: tuple[Any, Stubber], tmp_path: Path
) -> None:
    client, stub = autoscaling
    record = JobRecord(str(tmp_path))
    for i in range(3):
        record.mark_replaced(f"i-earlier{i}", group="trainer", reason="efa")
    for name in GROUPS:  # end_job: every group to zero, and no SetInstanceHealth
        stub.add_response(
            "update_auto_scaling_group",
            {},
            expected_params={
                "AutoScalingGroupName": name,
                "MinSize": 0,
                "MaxSize": 0,
                "DesiredCapacity": 0,
            },
        )
    assert leave(client, record, budget=3) == EXIT_FAILED
    outcome = record.outcome()
    assert outcome is not None
    assert outcome["outcome"] == "failed"
    assert outcome["by"] == INSTANCE
    assert outcome["reason"] == (
        "4 instances never reached the launcher's job loop, past the budget of 3 "
        f"replacements; the last, {INSTANCE} (dataprep): job pointer: /hetero/vit/job not found"
    )
    assert len(record.replaced()) == 4


def test_at_the_budget_it_is_still_a_replacement(
    autoscaling: tuple[Any, Stubber], tmp_path: Path
) -> None:
    client, stub = autoscaling
    record = JobRecord(str(tmp_path))
    for i in range(2):
        record.mark_replaced(f"i-earlier{i}", group="trainer", reason="efa")
    stub.add_response("set_instance_health", {}, expected_params=UNHEALTHY)
    assert leave(client, record, budget=3) == 2  # the third of 3
    assert record.outcome() is None


def test_a_trainer_completes_its_own_termination_hook(
    autoscaling: tuple[Any, Stubber], tmp_path: Path
) -> None:
    """The unhealthy trainer's termination goes through the hetero-checkpoint hook; with no
    launcher left nobody else would complete it, and the instance would bill 300 s more."""
    client, stub = autoscaling
    stub.add_response("set_instance_health", {}, expected_params=UNHEALTHY)
    stub.add_response(
        "describe_auto_scaling_instances",
        {
            "AutoScalingInstances": [
                {
                    "InstanceId": INSTANCE,
                    "InstanceType": "g5.xlarge",
                    "AutoScalingGroupName": GROUPS[0],
                    "AvailabilityZone": "us-east-1a",
                    "LifecycleState": "Terminating:Wait",
                    "HealthStatus": "UNHEALTHY",
                    "ProtectedFromScaleIn": False,
                }
            ]
        },
        expected_params={"InstanceIds": [INSTANCE]},
    )
    stub.add_response(
        "complete_lifecycle_action",
        {},
        expected_params={
            "LifecycleHookName": LIFECYCLE_HOOK_NAME,
            "AutoScalingGroupName": GROUPS[0],
            "InstanceId": INSTANCE,
            "LifecycleActionResult": "CONTINUE",
        },
    )
    assert leave(client, JobRecord(str(tmp_path)), hook=LIFECYCLE_HOOK_NAME) == 2


def test_without_an_instance_id_nothing_is_called(autoscaling: tuple[Any, Stubber]) -> None:
    client, _ = autoscaling
    assert leave(client, None, instance_id=None) == 2  # the Stubber fails any call


def test_without_a_job_record_it_is_still_replaced(autoscaling: tuple[Any, Stubber]) -> None:
    client, stub = autoscaling
    stub.add_response("set_instance_health", {}, expected_params=UNHEALTHY)
    assert leave(client, None) == 2


SPEC = one_of_each("vit")


def test_launch_with_an_unreadable_job_pointer_takes_its_instance_out_of_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_imds: FakeImds
) -> None:
    """``hetero launch`` as the stack runs it (HETERO_ASG_NAMES, a job pointer), where the
    pointer does not exist: the launcher counts the instance in the job record and calls
    SetInstanceHealth on it, instead of exiting for Docker to restart it on the same host."""
    from moto import mock_aws

    spec = tmp_path / "cluster.toml"
    spec.write_text(SPEC)
    record_dir = tmp_path / "record"
    imds = fake_imds
    as_deployed_host(monkeypatch, imds, record_dir, job_parameter="/hetero/vit/job")
    calls: list[dict[str, Any]] = []

    def set_unhealthy(client: Any, instance_id: str) -> bool:
        calls.append({"instance_id": instance_id, "region": client.meta.region_name})
        return True

    monkeypatch.setattr(early_exit, "set_unhealthy", set_unhealthy)
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    args = parser.parse_args(
        ["--spec", str(spec), "--group", "dataprep", "--backend", "ec2", "--imds-url", imds.url]
    )
    with mock_aws():
        code = launch.run(args)
    assert code == launch.EXIT_CONFIG
    assert calls == [{"instance_id": INSTANCE, "region": "us-east-1"}]
    replaced = JobRecord(str(record_dir)).replaced()
    assert list(replaced) == [INSTANCE]
    assert replaced[INSTANCE]["group"] == "dataprep"
    assert replaced[INSTANCE]["reason"].startswith("job pointer: ")
    assert json.loads((record_dir / "job" / "replaced" / f"{INSTANCE}.json").read_text())


def test_with_imds_unreachable_the_boots_instance_id_takes_the_instance_out_of_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IMDS does not answer the launcher (it answered the boot, which passed the instance id on
    in HETERO_INSTANCE_ID): the launcher still names its instance, counts it and marks it
    Unhealthy, instead of exiting for Docker to restart it until the restarts run out."""
    import socket

    from moto import mock_aws

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    spec = tmp_path / "cluster.toml"
    spec.write_text(SPEC)
    record_dir = tmp_path / "record"
    for k, v in {
        "HETERO_ASG_NAMES": ",".join(GROUPS),
        "HETERO_CHECKPOINT_URI": str(record_dir),
        "HETERO_CLUSTER": "vit",
        "HETERO_INSTANCE_ID": INSTANCE,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HETERO_JOB_PARAMETER", raising=False)
    calls: list[str] = []
    monkeypatch.setattr(early_exit, "set_unhealthy", lambda c, i: calls.append(i) or True)
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    args = parser.parse_args(
        ["--spec", str(spec), "--group", "dataprep", "--backend", "ec2", "--imds-url", closed,
         "--imds-timeout", "0.2"]
    )  # fmt: skip
    with mock_aws():
        code = launch.run(args)
    assert code == EXIT_PEERS
    assert calls == [INSTANCE]
    replaced = JobRecord(str(record_dir)).replaced()
    assert list(replaced) == [INSTANCE] and replaced[INSTANCE]["reason"].startswith("IMDS: ")


def test_a_local_launch_never_touches_auto_scaling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HETERO_ASG_NAMES", raising=False)
    monkeypatch.setattr(early_exit, "leave_service", lambda *a, **k: pytest.fail("called"))
    spec = tmp_path / "cluster.toml"
    spec.write_text(SPEC)
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    args = parser.parse_args(["--spec", str(spec), "--group", "nope", "--backend", "local"])
    assert launch.run(args) == launch.EXIT_CONFIG


def test_without_a_region_the_launcher_exits_with_its_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Deployed (HETERO_ASG_NAMES) but no region anywhere and no IMDS: no Auto Scaling client
    can be made; the launcher logs it and exits with its own code instead of a traceback."""
    for k in ("AWS_DEFAULT_REGION", "AWS_REGION", "HETERO_JOB_PARAMETER"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("HETERO_ASG_NAMES", ",".join(GROUPS))
    monkeypatch.setattr(early_exit, "leave_service", lambda *a, **k: pytest.fail("called"))
    spec = tmp_path / "cluster.toml"
    spec.write_text(SPEC)
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    args = parser.parse_args(
        ["--spec", str(spec), "--group", "nope", "--backend", "ec2",
         "--imds-url", "http://127.0.0.1:9", "--imds-timeout", "0.2"]
    )  # fmt: skip
    assert launch.run(args) == launch.EXIT_CONFIG
    assert "no Auto Scaling client (You must specify a region.)" in caplog.text
