"""The data-tier controller's rule (``training.dataplane.autoscale``) and its backends.

The rule is fed intervals as the trainer's rank 0 would: each test names the data-wait share and
the servers' busy share, and asserts the exact decisions (from, to) and when none is made."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from training.dataplane.autoscale import (
    AsgActuator,
    Autoscaler,
    DataTierController,
    FileActuator,
    Observation,
    Policy,
    ReportOnly,
    actuator_from_arg,
    file_arg,
    policy_for,
    read_decisions,
)
from training.spec import parse_spec

POLICY = Policy(
    group="dataprep", min_count=1, max_count=6, target_wait=0.05, max_busy=0.75, window=3,
    cooldown_s=30.0, settle_timeout_s=300.0,
)  # fmt: skip


class Feed:
    """Intervals 10 s apart into one controller; ``run`` returns the decisions as tuples."""

    def __init__(self, controller: DataTierController) -> None:
        self.c = controller
        self.t = 0.0
        self.step = 0

    def run(
        self, n: int, wait: float, busy: float | None, serving: int | None = None
    ) -> list[tuple[int, int, bool]]:
        out = []
        for _ in range(n):
            self.t += 10.0
            self.step += 10
            obs = Observation(
                self.t, self.step, wait, self.c.count if serving is None else serving, busy
            )
            d = self.c.observe(obs)
            if d is not None:
                out.append((d.from_count, d.to_count, d.acted))
        return out


def test_grows_by_what_the_wait_says_then_waits_for_the_servers_and_the_cooldown() -> None:
    feed = Feed(DataTierController(POLICY, count=1))
    # Two intervals are not a window: nothing yet. The third: waiting half the time with the
    # one server saturated means the trainer wants twice what it gets.
    assert feed.run(2, wait=0.5, busy=1.0) == []
    assert feed.run(1, wait=0.5, busy=1.0) == [(1, 2, True)]
    # The new server is not serving yet: nothing is decided however long the wait.
    assert feed.run(5, wait=0.5, busy=1.0, serving=1) == []
    # It serves: 30 s of cooldown (3 intervals), then a fresh window of 3.
    assert feed.run(1, wait=0.2, busy=1.0) == []  # settled now
    assert feed.run(2, wait=0.2, busy=1.0) == []  # 10 s and 20 s: cooldown
    assert feed.run(2, wait=0.2, busy=1.0) == []  # 30 s on: the window fills
    assert feed.run(1, wait=0.2, busy=1.0) == [(2, 3, True)]  # ceil(2 / 0.8) = 3


def test_one_slow_interval_does_not_decide() -> None:
    feed = Feed(DataTierController(POLICY, count=2))
    assert feed.run(2, wait=0.01, busy=0.9) == []
    assert feed.run(1, wait=0.6, busy=0.9) == []  # the median is 1%
    assert feed.run(1, wait=0.01, busy=0.9) == []
    # Nor does one idle interval (the first batches of an epoch) make it shrink.
    assert feed.run(1, wait=0.0, busy=0.05) == []
    assert feed.run(3, wait=0.0, busy=0.9) == []


def test_waiting_while_the_servers_idle_is_reported_once_and_changes_nothing() -> None:
    c = DataTierController(POLICY, count=2)
    feed = Feed(c)
    assert feed.run(3, wait=0.3, busy=0.2) == [(2, 2, False)]
    assert feed.run(10, wait=0.3, busy=0.2) == []  # the same reason is not repeated
    assert c.count == 2
    assert feed.run(3, wait=0.3, busy=None) == [(2, 2, False)]  # another reason: unknown load


def test_never_beyond_max_count_and_says_so() -> None:
    c = DataTierController(POLICY, count=4)
    feed = Feed(c)
    assert feed.run(3, wait=0.9, busy=1.0) == [(4, 6, True)]  # ceil(4 / 0.1) = 40, capped
    feed.run(1, wait=0.9, busy=1.0)  # settled
    decisions = feed.run(6, wait=0.9, busy=1.0)
    assert decisions == [(6, 6, False)] and c.count == 6


def test_shrinks_to_what_keeps_the_servers_left_under_max_busy_never_below_min() -> None:
    feed = Feed(DataTierController(POLICY, count=5))
    # ceil(5 x 0.3 / 0.75) = 2 servers would be busy 75%: the window fills (3 looks), then
    # three looks in a row must want it.
    assert feed.run(4, wait=0.0, busy=0.3) == []
    assert feed.run(1, wait=0.0, busy=0.3) == [(5, 2, True)]
    feed.run(1, wait=0.0, busy=0.3)  # settled
    feed.run(2, wait=0.0, busy=0.3)  # cooldown
    assert feed.run(4, wait=0.0, busy=0.1) == []
    assert feed.run(1, wait=0.0, busy=0.1) == [(2, 1, True)]
    feed.run(1, wait=0.0, busy=0.1)
    feed.run(2, wait=0.0, busy=0.1)
    assert feed.run(9, wait=0.0, busy=0.01) == []  # at min_count


def test_a_drop_in_demand_shrinks_once_to_where_it_settles() -> None:
    """The trainer slows down: the looks in the middle of the change want a little fewer, the
    ones after it far fewer; the controller goes down once, when three looks in a row want
    fewer, to what the last wants."""
    feed = Feed(DataTierController(POLICY, count=4))
    assert feed.run(3, wait=0.0, busy=0.9) == []  # wants 5 (ceil(4 x 0.9 / 0.75)): no fewer
    assert feed.run(1, wait=0.0, busy=0.5) == []  # median 0.9
    assert feed.run(1, wait=0.0, busy=0.1) == []  # median 0.5: wants 3
    assert feed.run(1, wait=0.0, busy=0.1) == []  # median 0.1: wants 1; two looks want fewer
    assert feed.run(1, wait=0.0, busy=0.1) == [(4, 1, True)]  # three: to what the last wants


def test_hysteresis_no_shrink_after_a_growth_that_just_fits() -> None:
    """After growing, the wait is under the target but the servers are busy: neither rule
    fires (the band between them), however long it runs."""
    feed = Feed(DataTierController(POLICY, count=3))
    assert feed.run(100, wait=0.02, busy=0.9) == []  # under half the target, but busy
    assert feed.run(100, wait=0.04, busy=0.3) == []  # idle servers, but not under half


def test_a_lost_server_is_no_reason_to_grow_and_a_shrink_counts_it_once() -> None:
    """One of three servers is lost (its group replaces it): the wait that causes does not grow
    the group (said once); when the demand is low, the shrink is computed from the two that
    serve, not from three (which would keep one server too many)."""
    c = DataTierController(POLICY, count=3)
    feed = Feed(c)
    assert feed.run(5, wait=0.4, busy=1.0, serving=2) == [(3, 3, False)]
    assert c.count == 3
    # ceil(2 x 0.3 / 0.75) = 1, where the count would say ceil(3 x 0.3 / 0.75) = 2.
    assert feed.run(3, wait=0.0, busy=0.3, serving=2) == []
    assert feed.run(1, wait=0.0, busy=0.3, serving=2) == [(3, 1, True)]


def test_a_change_that_never_arrives_is_given_up_after_the_settle_timeout() -> None:
    feed = Feed(DataTierController(POLICY, count=1))
    assert feed.run(3, wait=0.5, busy=1.0) == [(1, 2, True)]
    assert feed.run(29, wait=0.5, busy=1.0, serving=1) == []  # 290 s
    # 300 s: settled anyway; cooldown and window, then it decides from what it sees.
    assert feed.run(7, wait=0.5, busy=1.0, serving=1) == [(2, 4, True)]


def test_policy_from_the_spec() -> None:
    spec = parse_spec(_spec("min_count = 1\nmax_count = 5", "autoscale_target_wait = 0.1"))
    p = policy_for(spec)
    assert p == Policy(
        group="dataprep", min_count=1, max_count=5, target_wait=0.1, max_busy=0.75, window=3,
        cooldown_s=60.0,
    )  # fmt: skip
    assert policy_for(parse_spec(_spec("", ""))) is None  # a fixed count: no controller


def _spec(bounds: str, dataplane: str) -> dict[str, Any]:
    import tomllib

    return tomllib.loads(
        f"""
name = "elastic"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 2
{bounds}
[job.dataplane]
{dataplane}
"""
    )


def test_only_dataprep_groups_are_elastic_and_count_lies_between() -> None:
    from training.spec import SpecError

    text = _spec("min_count = 3\nmax_count = 4", "")
    with pytest.raises(SpecError) as e:
        parse_spec(text)
    assert e.value.problems == [
        "groups[1].count: an elastic group starts at count, which must lie between min_count "
        "and max_count; got min_count 3, count 2, max_count 4"
    ]
    text["groups"][0]["max_count"] = 2
    text["groups"][1]["min_count"] = 1
    with pytest.raises(SpecError) as e:
        parse_spec(text)
    assert e.value.problems == [
        "groups[0].max_count: only dataprep groups are elastic; a trainer group has a fixed "
        "count (remove max_count)"
    ]


# -- the running controller ------------------------------------------------------------------


class Loads:
    """Servers' cumulative (busy_s, uptime_s) as GetInfo reports them: each look finds them
    10 s older and ``busy`` of that time busy (so the test does not race the thread)."""

    def __init__(self, servers: int, busy: float) -> None:
        self.busy = busy
        self.values = {f"127.0.0.1:{5000 + i}": (0.0, 0.0) for i in range(servers)}

    def __call__(self) -> dict[str, tuple[float, float]]:
        self.values = {a: (b + self.busy * 10, u + 10) for a, (b, u) in self.values.items()}
        return dict(self.values)


def _feed(scaler: Autoscaler, n: int, wait: float) -> None:
    for i in range(n):
        scaler.observe(i, wait)
    scaler.close()


def test_the_autoscaler_writes_the_local_count_and_records_every_decision(
    tmp_path: Path,
) -> None:
    desired = tmp_path / "desired.json"
    FileActuator(desired).set(1)  # the local runner's start
    loads = Loads(1, busy=1.0)
    recorded: list[dict[str, Any]] = []
    clock = iter(range(0, 10_000, 10))
    scaler = Autoscaler(
        POLICY, FileActuator(desired), loads, run_dir=tmp_path, start_count=1,
        on_decision=lambda d: recorded.append(d.as_dict()), clock=lambda: float(next(clock)),
    )  # fmt: skip
    # The first look has no earlier one to difference: busy unknown (window needs 3 known).
    _feed(scaler, 5, wait=0.5)
    assert json.loads(desired.read_text()) == {"count": 2}
    assert [(d["from_count"], d["to_count"], d["acted"]) for d in recorded] == [(1, 2, True)]
    on_disk = read_decisions(tmp_path / "autoscale.jsonl")
    assert on_disk == recorded
    assert on_disk[0]["wait_share"] == pytest.approx(0.5)
    assert on_disk[0]["busy_share"] == pytest.approx(1.0)
    assert on_disk[0]["serving"] == 1


def test_report_only_changes_nothing_and_says_so(tmp_path: Path) -> None:
    loads = Loads(2, busy=1.0)
    clock = iter(range(0, 10_000, 10))
    scaler = Autoscaler(
        POLICY, ReportOnly(2), loads, run_dir=tmp_path, start_count=2,
        clock=lambda: float(next(clock)),
    )  # fmt: skip
    _feed(scaler, 5, wait=0.5)
    assert [(d.from_count, d.to_count, d.acted) for d in scaler.decisions] == [(2, 4, False)]
    assert scaler.count == 2


def test_a_failed_change_is_recorded_and_the_count_kept(tmp_path: Path) -> None:
    class Broken(FileActuator):
        def set(self, count: int) -> None:
            raise RuntimeError("AccessDenied")

    loads = Loads(1, busy=1.0)
    clock = iter(range(0, 10_000, 10))
    scaler = Autoscaler(
        POLICY, Broken(tmp_path / "d.json"), loads, start_count=1,
        clock=lambda: float(next(clock)),
    )  # fmt: skip
    _feed(scaler, 5, wait=0.5)
    [d] = scaler.decisions
    assert (d.from_count, d.to_count, d.acted) == (1, 2, False)
    assert d.reason.endswith("; AccessDenied") and scaler.count == 1


@contextlib.contextmanager
def elastic_group(desired: int) -> Iterator[Any]:
    """Moto's EC2 and Auto Scaling with the group ``elastic-dataprep`` (min 1, max 5) at
    ``desired`` instances; yields the Auto Scaling client."""
    with mock_aws():
        ec2 = boto3.client("ec2", region_name="eu-west-1")
        asg = boto3.client("autoscaling", region_name="eu-west-1")
        vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
        ec2.create_launch_template(
            LaunchTemplateName="elastic",
            LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "c6i.xlarge"},
        )
        asg.create_auto_scaling_group(
            AutoScalingGroupName="elastic-dataprep",
            LaunchTemplate={"LaunchTemplateName": "elastic"},
            MinSize=1, MaxSize=5, DesiredCapacity=desired, VPCZoneIdentifier=subnet,
        )  # fmt: skip
        yield asg


def test_the_asg_backend_sets_and_reads_the_desired_capacity() -> None:
    with elastic_group(desired=2) as asg:
        actuator = AsgActuator("elastic-dataprep", client=asg)
        assert actuator.current() == 2
        actuator.set(4)
        group = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["elastic-dataprep"])
        assert group["AutoScalingGroups"][0]["DesiredCapacity"] == 4
        assert actuator.current() == 4


def test_the_asg_scale_in_takes_the_leaving_instance_first() -> None:
    """A Spot notice already takes one instance away: the scale-in terminates that one (and
    decrements the desired count), so Auto Scaling does not pick a healthy one besides."""
    with elastic_group(desired=3) as asg:

        def members() -> list[str]:
            g = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["elastic-dataprep"])
            return [i["InstanceId"] for i in g["AutoScalingGroups"][0]["Instances"]]

        # Left to itself, moto's scale-in removes the first listed: the last is the one a
        # plain SetDesiredCapacity would keep.
        first, second, leaving = members()
        actuator = AsgActuator("elastic-dataprep", client=asg, leaving=lambda: {leaving})
        actuator.set(2)
        assert members() == [first, second] and actuator.current() == 2
        actuator.set(3)  # growing terminates nothing
        assert members()[:2] == [first, second] and actuator.current() == 3
        actuator.set(1)  # nobody leaving now: Auto Scaling picks
        assert len(members()) == 1 and actuator.current() == 1


def test_the_backend_argument() -> None:
    assert isinstance(actuator_from_arg("file:/tmp/x.json", 1), FileActuator)
    a = actuator_from_arg("asg:c-dataprep", 1)
    assert isinstance(a, AsgActuator) and a.asg_name == "c-dataprep"
    r = actuator_from_arg("report", 3)
    assert isinstance(r, ReportOnly) and r.current() == 3
    with pytest.raises(ValueError, match="use file:PATH, asg:NAME or report"):
        actuator_from_arg("asg:", 1)


def test_each_launcher_backend_names_its_actuator(tmp_path: Path) -> None:
    from training.launcher.backends import PLACES, Backend
    from training.launcher.group import GroupIdentity, GroupSource
    from training.processes.roles import trainer_command

    elastic = parse_spec(_spec("min_count = 1\nmax_count = 5", ""))
    fixed = parse_spec(_spec("", ""))
    identity = GroupIdentity("trainer", GroupSource.EC2, cluster="my-cluster")
    named = {b: PLACES[b].autoscale(elastic, identity) for b in Backend}
    assert named == {
        Backend.EC2: "asg:my-cluster-dataprep",
        Backend.SAGEMAKER: "report",
        Backend.LOCAL: "",  # hetero local names its file
    }
    assert {PLACES[b].autoscale(fixed, identity) for b in Backend} == {""}  # a fixed count
    # Each value the trainer's parser reads back as the actuator it names.
    asg = actuator_from_arg(named[Backend.EC2], 1)
    assert isinstance(asg, AsgActuator) and asg.asg_name == "my-cluster-dataprep"
    assert isinstance(actuator_from_arg(named[Backend.SAGEMAKER], 2), ReportOnly)
    desired = actuator_from_arg(file_arg(tmp_path / "desired.json"), 1)
    assert isinstance(desired, FileActuator) and desired.path == tmp_path / "desired.json"
    cmd = trainer_command(
        elastic, spec_path="s.toml", run_dir="r", trainer_hosts=("127.0.0.1",), node_rank=0,
        autoscale="asg:my-cluster-dataprep",
    )  # fmt: skip
    assert cmd.argv[-2:] == ("--autoscale", "asg:my-cluster-dataprep")
    plain = trainer_command(
        elastic, spec_path="s.toml", run_dir="r", trainer_hosts=("127.0.0.1",), node_rank=0
    )
    assert "--autoscale" not in plain.argv
