"""After the job's end, each trainer completes the termination hook for its own instance.

moto does not implement CompleteLifecycleAction, so every Auto Scaling call here is answered by
botocore's Stubber, which asserts each request's exact parameters and that no other call is
made. Time is a fake clock: the bounded wait costs no wall time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from botocore.stub import Stubber

from training.common.names import LIFECYCLE_HOOK_NAME
from training.launcher.job_end import complete_lifecycle_action, complete_own_termination

from .conftest import stubbed

INSTANCE = "i-0123456789abcdef0"
GROUP = "vit-trainer"
COMPLETE = {
    "LifecycleHookName": LIFECYCLE_HOOK_NAME,
    "AutoScalingGroupName": GROUP,
    "InstanceId": INSTANCE,
    "LifecycleActionResult": "CONTINUE",
}


@pytest.fixture
def autoscaling() -> Iterator[tuple[Any, Stubber]]:
    yield from stubbed("autoscaling")


def expect_state(stub: Stubber, state: str | None) -> None:
    """DescribeAutoScalingInstances of this instance: in ``state``, or in no group (None)."""
    listed = (
        [
            {
                "InstanceId": INSTANCE,
                "InstanceType": "g5.xlarge",
                "AutoScalingGroupName": GROUP,
                "AvailabilityZone": "us-east-1a",
                "LifecycleState": state,
                "HealthStatus": "HEALTHY",
                "ProtectedFromScaleIn": False,
            }
        ]
        if state is not None
        else []
    )
    stub.add_response(
        "describe_auto_scaling_instances",
        {"AutoScalingInstances": listed},
        expected_params={"InstanceIds": [INSTANCE]},
    )


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def run(client: Any, target: list[str | None], *, timeout_s: float = 60.0) -> tuple[bool, FakeTime]:
    """``complete_own_termination`` with IMDS answering ``target`` in turn (last one repeats)."""
    time = FakeTime()
    answers = iter(target)
    last: list[str | None] = [None]

    def target_state() -> str | None:
        last[0] = next(answers, last[0])
        return last[0]

    done = complete_own_termination(
        client,
        INSTANCE,
        LIFECYCLE_HOOK_NAME,
        target_state=target_state,
        timeout_s=timeout_s,
        poll_s=5.0,
        clock=time.clock,
        sleep=time.sleep,
    )
    return done, time


def test_terminating_wait_completes_the_action_with_continue(
    autoscaling: tuple[Any, Stubber],
) -> None:
    client, stub = autoscaling
    expect_state(stub, "Terminating:Wait")
    stub.add_response("complete_lifecycle_action", {}, expected_params=COMPLETE)
    done, time = run(client, ["Terminated"])
    assert done is True and time.sleeps == []


def test_waits_in_service_until_the_scale_in_reaches_the_instance(
    autoscaling: tuple[Any, Stubber],
) -> None:
    client, stub = autoscaling
    expect_state(stub, "InService")
    expect_state(stub, "Terminating")
    expect_state(stub, "Terminating:Wait")
    stub.add_response("complete_lifecycle_action", {}, expected_params=COMPLETE)
    done, time = run(client, ["InService"])
    assert done is True and time.sleeps == [5.0, 5.0]


def test_the_imds_target_state_alone_is_enough(autoscaling: tuple[Any, Stubber]) -> None:
    """IMDS says Terminated before DescribeAutoScalingInstances shows Terminating:Wait."""
    client, stub = autoscaling
    expect_state(stub, "Terminating")
    stub.add_response("complete_lifecycle_action", {}, expected_params=COMPLETE)
    done, _ = run(client, ["Terminated"])
    assert done is True


def test_a_validation_error_is_logged_and_returns_false(
    autoscaling: tuple[Any, Stubber], caplog: pytest.LogCaptureFixture
) -> None:
    """No pending action (completed already, e.g. by the leaving path): not an error."""
    client, stub = autoscaling
    expect_state(stub, "Terminating:Wait")
    stub.add_client_error(
        "complete_lifecycle_action",
        service_error_code="ValidationError",
        service_message=f"No active Lifecycle Action found with instance ID {INSTANCE}",
        http_status_code=400,
        expected_params=COMPLETE,
    )
    with caplog.at_level("INFO", logger="training.launcher.job_end"):
        done, _ = run(client, ["Terminated"])
    assert done is False
    assert "no pending lifecycle action" in caplog.text


def test_an_instance_in_no_group_needs_nothing(autoscaling: tuple[Any, Stubber]) -> None:
    client, stub = autoscaling
    expect_state(stub, None)  # terminated already: no CompleteLifecycleAction queued
    done, time = run(client, [None])
    assert done is False and time.sleeps == []


def test_an_instance_past_the_hook_needs_nothing(autoscaling: tuple[Any, Stubber]) -> None:
    client, stub = autoscaling
    expect_state(stub, "Terminating:Proceed")
    done, _ = run(client, ["Terminated"])
    assert done is False


def test_the_wait_is_bounded(autoscaling: tuple[Any, Stubber]) -> None:
    client, stub = autoscaling
    for _ in range(4):  # t = 0, 5, 10, 15 (the deadline): never terminating
        expect_state(stub, "InService")
    done, time = run(client, ["InService"], timeout_s=15.0)
    assert done is False and time.now == 15.0


def test_describe_errors_are_polled_through(autoscaling: tuple[Any, Stubber]) -> None:
    client, stub = autoscaling
    stub.add_client_error(
        "describe_auto_scaling_instances",
        service_error_code="Throttling",
        http_status_code=400,
        expected_params={"InstanceIds": [INSTANCE]},
    )
    expect_state(stub, "Terminating:Wait")
    stub.add_response("complete_lifecycle_action", {}, expected_params=COMPLETE)
    done, _ = run(client, [None])
    assert done is True


def test_the_leaving_path_still_looks_the_group_up(autoscaling: tuple[Any, Stubber]) -> None:
    client, stub = autoscaling
    expect_state(stub, "Terminating:Wait")
    stub.add_response("complete_lifecycle_action", {}, expected_params=COMPLETE)
    assert complete_lifecycle_action(client, INSTANCE, LIFECYCLE_HOOK_NAME) is True
