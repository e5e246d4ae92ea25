"""moto set up as the cluster stack would: groups, tags, lifecycle hook, bucket, instances on
loopback addresses; and the Auto Scaling behaviour the rehearsal relies on."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from training.common.names import TAG_CLUSTER, TAG_GROUP, TAG_ROLE, asg_name
from training.costs.backstop import action_name, put_backstop, remove_backstop
from training.prices import offline_prices, price_groups
from training.rehearsal.aws import LIFECYCLE_HOOK, AwsEmulator, subnet_cidr
from training.spec import load_spec


def running_in(aws: AwsEmulator, group: str) -> list[str]:
    """The running instances of the small spec's ``group``, in launch order."""
    return [
        i.instance_id for i in aws.instances("tiny") if i.group == group and i.state == "running"
    ]


def test_provision_creates_groups_tags_hook_and_bucket(aws: AwsEmulator, small_spec: Path) -> None:
    spec = load_spec(small_spec)
    names = aws.provision(spec)
    assert names.asg_names == {"trainer": asg_name("tiny", "trainer"), "dataprep": "tiny-dataprep"}
    assert names.checkpoint_uri == "s3://tiny-checkpoints/checkpoints/tiny/"
    assert names.job_record_key == "checkpoints/tiny/job/outcome.json"

    autoscaling = aws.client("autoscaling")
    groups = {
        g["AutoScalingGroupName"]: g
        for g in autoscaling.describe_auto_scaling_groups()["AutoScalingGroups"]
    }
    assert set(groups) == {"tiny-trainer", "tiny-dataprep"}
    trainer = groups["tiny-trainer"]
    assert (trainer["MinSize"], trainer["DesiredCapacity"]) == (2, 2)
    tags = {t["Key"]: (t["Value"], t["PropagateAtLaunch"]) for t in trainer["Tags"]}
    assert tags[TAG_CLUSTER] == ("tiny", True)
    assert tags[TAG_GROUP] == ("trainer", True)
    assert tags[TAG_ROLE] == ("trainer", True)
    hooks = autoscaling.describe_lifecycle_hooks(AutoScalingGroupName="tiny-trainer")
    (hook,) = hooks["LifecycleHooks"]
    assert hook["LifecycleHookName"] == LIFECYCLE_HOOK
    assert hook["LifecycleTransition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
    assert aws.client("s3").head_bucket(Bucket="tiny-checkpoints")
    # The job record's reader (training.common.s3.read_object): missing, then there.
    assert aws.read_object("tiny-checkpoints", names.job_record_key) is None
    aws.client("s3").put_object(Bucket="tiny-checkpoints", Key=names.job_record_key, Body=b"{}")
    assert aws.read_object("tiny-checkpoints", names.job_record_key) == b"{}"

    instances = aws.instances("tiny")
    assert sorted((i.group, i.role) for i in instances) == [
        ("dataprep", "dataprep"),
        ("trainer", "trainer"),
        ("trainer", "trainer"),
    ]
    for inst in instances:
        assert inst.state == "running"
        ip = ipaddress.ip_address(inst.private_ip)
        assert ip.is_loopback and ip in ipaddress.ip_network(aws.subnet)
    assert len({i.private_ip for i in instances}) == 3


def test_groups_replace_terminated_instances_and_scale_to_zero(
    aws: AwsEmulator, small_spec: Path
) -> None:
    names = aws.provision(load_spec(small_spec))

    def running(group: str) -> list[str]:
        return running_in(aws, group)

    first, second = running("trainer")
    aws.terminate_instance(first)  # EC2 TerminateInstances: replaced
    after = running("trainer")
    assert first not in after and second in after and len(after) == 2

    aws.terminate_in_group(second, decrement=False)  # replaced too
    assert len(running("trainer")) == 2 and second not in running("trainer")

    assert aws.max_size(names.asg_names["trainer"]) == 2  # MaxSize = count, as the stack
    aws.set_max_size(names.asg_names["trainer"], 3)  # Capacity Rebalancing goes over it
    aws.set_desired_capacity(names.asg_names["trainer"], 3)  # Capacity Rebalancing's extra
    assert len(running("trainer")) == 3
    aws.terminate_in_group(running("trainer")[0], decrement=True)  # not replaced
    assert len(running("trainer")) == 2
    assert aws.desired_capacities(names)["tiny-trainer"] == 2

    autoscaling = aws.client("autoscaling")
    for asg in names.asg_names.values():
        autoscaling.update_auto_scaling_group(
            AutoScalingGroupName=asg, MinSize=0, DesiredCapacity=0
        )
    assert running("trainer") == [] and running("dataprep") == []
    assert aws.desired_capacities(names) == {"tiny-trainer": 0, "tiny-dataprep": 0}


def test_a_group_without_capacity_launches_nothing_until_capacity_is_back(
    aws: AwsEmulator, small_spec: Path
) -> None:
    names = aws.provision(load_spec(small_spec))
    trainer = names.asg_names["trainer"]

    def running(group: str) -> list[str]:
        return running_in(aws, group)

    first, second = running("trainer")
    aws.hold_launches(trainer)
    aws.terminate_instance(first)  # lost: no replacement
    assert running("trainer") == [second]
    aws.set_desired_capacity(trainer, 3)  # no more either
    assert running("trainer") == [second]
    assert aws.desired_capacities(names)[trainer] == 3
    assert aws.launches_refused == {trainer: 3}
    dataprep_first = running("dataprep")
    aws.terminate_instance(dataprep_first[0])  # another group is not held: replaced
    assert len(running("dataprep")) == 1 and running("dataprep") != dataprep_first
    assert aws.launches_refused == {trainer: 3}

    aws.release_launches(trainer)  # capacity is back: the group launches what it misses
    now = running("trainer")
    assert second in now and len(now) == 3
    aws.release_launches(trainer)  # nothing held: nothing more
    assert running("trainer") == now

    # Held until the job's end: the groups go to 0, and when capacity is back nothing launches.
    aws.hold_launches(trainer)
    aws.terminate_instance(now[0])
    aws.client("autoscaling").update_auto_scaling_group(
        AutoScalingGroupName=trainer, MinSize=0, MaxSize=0, DesiredCapacity=0
    )
    assert running("trainer") == []
    aws.release_launches(trainer)
    assert running("trainer") == [] and aws.launches_refused[trainer] == 1


def test_spot_prices_are_the_specs_catalogue_estimate_dated_now(
    aws: AwsEmulator, small_spec: Path
) -> None:
    """moto answers 0.00001 USD/h for every type; the emulator answers what the spec's offline
    prices estimate, so a job priced from AWS there gets the budget the catalogue gives."""
    spec = load_spec(small_spec)
    aws.provision(spec)
    zone = f"{aws.region}a"
    priced = price_groups(
        spec, ec2=aws.client("ec2"), pricing=None, zones={g.name: [zone] for g in spec.groups},
        region=aws.region,
    )  # fmt: skip
    assert priced.warnings == ()  # every group is Spot, and EC2 priced each
    assert {p.source for p in priced.prices} == {"spot-price-history"}
    offline = offline_prices(spec).prices
    assert [(p.group, p.count, p.instance_type) for p in priced.prices] == [
        (p.group, p.count, p.instance_type) for p in offline
    ]
    for live, catalogue in zip(priced.prices, offline, strict=True):
        assert live.usd_per_hour == pytest.approx(catalogue.usd_per_hour, abs=1e-6)
        assert live.usd_per_hour > 0.01  # not moto's 0.00001
    # Stopped, the emulator leaves moto as it found it: another moto in this process (a test's
    # mock_aws) answers moto's own price again.
    aws.stop()
    with mock_aws():
        ec2 = boto3.client("ec2", region_name=aws.region)
        history = ec2.describe_spot_price_history(InstanceTypes=["g5.xlarge"])
        assert {p["SpotPrice"] for p in history["SpotPriceHistory"]} == {"0.00001"}


def test_reset_starts_from_nothing(aws: AwsEmulator, small_spec: Path) -> None:
    aws.provision(load_spec(small_spec))
    aws.reset()
    assert aws.instances("tiny") == []
    names = aws.provision(load_spec(small_spec))  # the same names again: no conflict
    assert len(aws.instances(names.cluster)) == 3


def test_an_os_shutdown_terminates_with_its_state_reason_and_is_replaced(
    aws: AwsEmulator, small_spec: Path
) -> None:
    aws.provision(load_spec(small_spec))
    first, second = (i.instance_id for i in aws.instances("tiny") if i.group == "trainer")
    aws.shut_down_from_os(first)
    aws.terminate_instance(second)
    reasons = {
        inst["InstanceId"]: inst["StateReason"]["Code"]
        for r in aws.client("ec2").describe_instances(InstanceIds=[first, second])["Reservations"]
        for inst in r["Instances"]
    }
    assert reasons == {
        first: "Client.InstanceInitiatedShutdown",
        second: "Client.UserInitiatedShutdown",
    }
    running = [i for i in aws.instances("tiny") if i.group == "trainer" and i.state == "running"]
    assert len(running) == 2 and {first, second}.isdisjoint(i.instance_id for i in running)


def test_an_instance_marked_unhealthy_is_replaced(aws: AwsEmulator, small_spec: Path) -> None:
    names = aws.provision(load_spec(small_spec))
    trainers = [i.instance_id for i in aws.instances("tiny") if i.group == "trainer"]
    assert aws.replace_unhealthy(names) == []
    aws.client("autoscaling").set_instance_health(
        InstanceId=trainers[1], HealthStatus="Unhealthy", ShouldRespectGracePeriod=False
    )
    assert aws.replace_unhealthy(names) == [trainers[1]]
    running = [i.instance_id for i in aws.instances("tiny") if i.state == "running"]
    assert trainers[0] in running and trainers[1] not in running and len(running) == 3
    assert aws.replace_unhealthy(names) == []  # once


def test_the_budget_backstop_is_put_replaced_run_at_its_time_and_removed(
    aws: AwsEmulator, small_spec: Path
) -> None:
    """The launcher's scheduled action (``backstop``) on moto's Auto Scaling, and the emulator
    running it as Auto Scaling does: every group to 0/0/0 at the deadline, then gone."""
    names = aws.provision(load_spec(small_spec))
    autoscaling = aws.client("autoscaling")
    groups = list(names.asg_names.values())
    now = 1_900_000_000.0
    assert put_backstop(autoscaling, groups, now + 30, now=now) == []  # too close: AWS refuses
    assert aws.scheduled_actions(names) == []
    assert put_backstop(autoscaling, groups, now + 3600, now=now) == groups
    # A resumed job's launchers put it again: the same action, at the new deadline.
    assert put_backstop(autoscaling, groups, now + 7200.5, now=now) == groups
    expected = [
        {"group": g, "name": action_name(g), "start": now + 7200.5, "MinSize": 0, "MaxSize": 0,
         "DesiredCapacity": 0}
        for g in groups
    ]  # fmt: skip
    actions = aws.scheduled_actions(names)
    assert actions == expected
    assert aws.run_scheduled_actions(actions, now=now + 7200) == []  # not yet
    assert aws.desired_capacities(names) == {"tiny-trainer": 2, "tiny-dataprep": 1}
    assert aws.run_scheduled_actions(actions, now=now + 7201) == expected
    assert aws.desired_capacities(names) == {"tiny-trainer": 0, "tiny-dataprep": 0}
    assert {aws.max_size(g) for g in groups} == {0}
    assert [i.instance_id for i in aws.instances("tiny") if i.state == "running"] == []
    assert aws.scheduled_actions(names) == []  # a one-time action is gone once it ran

    # The job's end deletes it; a group without one is no error.
    put_backstop(autoscaling, groups, now + 3600, now=now)
    assert remove_backstop(autoscaling, groups) == groups
    assert aws.scheduled_actions(names) == []
    assert remove_backstop(autoscaling, groups) == []


def test_each_emulator_draws_a_loopback_subnet_of_its_own() -> None:
    """Two rehearsals at once (the suite runs several) must not share their instances' addresses:
    their data servers bind the same port with SO_REUSEPORT and would take each other's calls."""
    assert subnet_cidr(7) == "127.0.7.0/24"
    with pytest.raises(ValueError, match=r"subnet octet 0 is not in 1\.\.254"):
        subnet_cidr(0)
    drawn = {subnet_cidr() for _ in range(50)}
    assert len(drawn) > 10 and all(ipaddress.ip_network(s).subnet_of(
        ipaddress.ip_network("127.0.0.0/16")) for s in drawn)  # fmt: skip
    assert AwsEmulator(subnet="127.0.9.0/24").subnet == "127.0.9.0/24"
