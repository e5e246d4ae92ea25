"""``hetero job start`` against moto (SSM, S3, Auto Scaling): the new pointer, the old record
moved aside or a fresh folder, the refusal while the job runs, and the exact requests in order."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aws_calls
import boto3
import pytest
from moto import mock_aws

from training.cli import main
from training.common.jobparam import GroupPrice, JobParameterNotFound, JobPointer, read_job_pointer
from training.costs.backstop import put_backstop
from training.prices import price_lines
from training.spec import ClusterSpec
from training.workstation.jobstart import JobStartError, group_sizes, start_job

REGION = "us-east-1"
ZONE = "us-east-1a"
"""The AZ of the deployed groups' subnet (the stack's: one subnet in the spec's AZ)."""
NAME = "/hetero/vit-test/job"
OLD = JobPointer("d-0123456789ab", "s3://ckpt/checkpoints/d-0123456789ab/")
NOW = datetime(2026, 11, 22, 10, 0, 0, tzinfo=UTC)
NEW_ID = "j-20261122T100000-ab12"
RECORD = {
    "job/outcome.json": b'{"outcome": "finished"}',
    "job/hosts/i-1.json": b'{"state": "job-finished"}',
    "job/leaving/i-2.json": b'{"reason": "spot"}',
}
CHECKPOINTS = {"step-4/a.distcp": b"shard", "step-4/COMPLETE": b""}
# The spec of tests/launcher/conftest.py priced offline (no ec2 or pricing client): each group
# at its count, the catalogue's On-Demand price of its one type x the spec's Spot ratio 0.35.
CATALOGUE_PRICES = (
    GroupPrice("trainer", "g5.12xlarge", "spot", 2, 5.672 * 0.35, "catalogue", "2026-07-20"),
    GroupPrice("dataprep", "c6i.4xlarge", "spot", 2, 0.68 * 0.35, "catalogue", "2026-07-20"),
)


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The deployed cluster after its job ended: pointer, record, checkpoints, groups at 0."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    with mock_aws():
        ssm = boto3.client("ssm", region_name=REGION)
        s3 = boto3.client("s3", region_name=REGION)
        asg = boto3.client("autoscaling", region_name=REGION)
        ec2 = boto3.client("ec2", region_name=REGION)
        ssm.put_parameter(Name=NAME, Value=OLD.to_json(), Type="String")
        s3.create_bucket(Bucket="ckpt")
        for key, body in {**RECORD, **CHECKPOINTS}.items():
            s3.put_object(Bucket="ckpt", Key=f"checkpoints/d-0123456789ab/{key}", Body=body)
        deployed_groups(ec2, asg, "vit-test", {"trainer": 2, "dataprep": 2})
        yield {"ssm": ssm, "s3": s3, "asg": asg}


def deployed_groups(ec2: Any, asg: Any, cluster: str, counts: dict[str, int]) -> None:
    """The stack's Auto Scaling groups of ``cluster`` (in moto) after a job ended: one per
    group, ``MaxSize`` its count (as the stack sets it), ``MinSize`` and desired 0."""
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    created = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24", AvailabilityZone=ZONE)
    subnet = created["Subnet"]["SubnetId"]
    ec2.create_launch_template(
        LaunchTemplateName=cluster,
        LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "c6i.xlarge"},
    )
    for group, count in counts.items():
        asg.create_auto_scaling_group(
            AutoScalingGroupName=f"{cluster}-{group}",
            LaunchTemplate={"LaunchTemplateName": cluster},
            MinSize=0, MaxSize=count, DesiredCapacity=0, VPCZoneIdentifier=subnet,
        )  # fmt: skip


def keys(s3: Any) -> dict[str, bytes]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="ckpt")
    found = [o["Key"] for page in pages for o in page.get("Contents", [])]
    return {k: s3.get_object(Bucket="ckpt", Key=k)["Body"].read() for k in found}


def sizes(asg: Any) -> dict[str, tuple[int, int, int]]:
    groups = asg.describe_auto_scaling_groups()["AutoScalingGroups"]
    return {
        g["AutoScalingGroupName"]: (g["MinSize"], g["MaxSize"], g["DesiredCapacity"])
        for g in groups
    }


def start(aws: dict[str, Any], spec: ClusterSpec, **kw: Any) -> Any:
    return start_job(
        spec, ssm=aws["ssm"], autoscaling=aws["asg"], s3=aws["s3"], now=NOW, token="ab12", **kw
    )


def test_resume_moves_the_record_aside_keeps_the_checkpoints_and_starts_the_groups(
    aws: dict[str, Any], spec: ClusterSpec
) -> None:
    started = start(aws, spec)
    new = JobPointer(
        NEW_ID, OLD.checkpoint_uri, "2026-11-22T10:00:00Z", OLD.job_id, prices=CATALOGUE_PRICES
    )
    assert started.pointer == new
    assert read_job_pointer(aws["ssm"], NAME) == new
    history = "checkpoints/d-0123456789ab/job-history/d-0123456789ab/"
    assert keys(aws["s3"]) == {
        **{f"checkpoints/d-0123456789ab/{k}": v for k, v in CHECKPOINTS.items()},
        **{history + k.removeprefix("job/"): v for k, v in RECORD.items()},
    }  # nothing left under job/: the new job starts with an empty record
    assert started.history_uri == f"s3://ckpt/{history}"
    assert sorted(started.moved) == sorted(
        f"s3://ckpt/{history}{k.removeprefix('job/')}" for k in RECORD
    )
    # The spec's counts: trainer 2, dataprep 2 (tests/launcher/conftest.py).
    assert sizes(aws["asg"]) == {"vit-test-trainer": (0, 2, 2), "vit-test-dataprep": (0, 2, 2)}


def test_fresh_gets_its_own_folder_and_leaves_the_old_job_alone(
    aws: dict[str, Any], spec: ClusterSpec
) -> None:
    before = keys(aws["s3"])
    started = start(aws, spec, fresh=True)
    new = JobPointer(
        NEW_ID,
        f"s3://ckpt/checkpoints/{NEW_ID}/",
        "2026-11-22T10:00:00Z",
        resumed_from=None,
        prices=CATALOGUE_PRICES,
    )
    assert started.pointer == new
    assert read_job_pointer(aws["ssm"], NAME) == new
    assert keys(aws["s3"]) == before  # the old job's record and checkpoints stay as they were
    assert (started.history_uri, started.moved) == (None, ())
    assert sizes(aws["asg"]) == {"vit-test-trainer": (0, 2, 2), "vit-test-dataprep": (0, 2, 2)}


def test_refuses_while_a_group_has_capacity_naming_it_and_changes_nothing(
    aws: dict[str, Any], spec: ClusterSpec
) -> None:
    aws["asg"].update_auto_scaling_group(AutoScalingGroupName="vit-test-trainer", DesiredCapacity=1)
    before = keys(aws["s3"])
    with pytest.raises(JobStartError) as e:
        start(aws, spec, spec_path="specs/vit.toml")
    assert str(e.value) == (
        "job d-0123456789ab is still running: vit-test-trainer has desired capacity 1 and 1 "
        "instance(s) in service.\n"
        "Let it end (its launchers scale every group to 0 when it finishes or fails; "
        "`hetero status --spec specs/vit.toml` shows it), or stop it:\n"
        "  aws autoscaling update-auto-scaling-group --auto-scaling-group-name vit-test-trainer "
        "--min-size 0 --desired-capacity 0\n"
        "then run this again. Or pass --force to start the new job now: the old job's hosts "
        "stop its role (the trainer checkpoints) and join the new job."
    )
    assert read_job_pointer(aws["ssm"], NAME) == OLD
    assert keys(aws["s3"]) == before
    assert sizes(aws["asg"]) == {"vit-test-trainer": (0, 2, 1), "vit-test-dataprep": (0, 2, 0)}


def test_force_starts_the_new_job_anyway(aws: dict[str, Any], spec: ClusterSpec) -> None:
    aws["asg"].update_auto_scaling_group(AutoScalingGroupName="vit-test-trainer", DesiredCapacity=1)
    started = start(aws, spec, force=True)
    assert read_job_pointer(aws["ssm"], NAME) == started.pointer
    assert started.pointer.job_id == NEW_ID
    assert sizes(aws["asg"]) == {"vit-test-trainer": (0, 2, 2), "vit-test-dataprep": (0, 2, 2)}


class Recording:
    """A client whose calls are appended, in order, to a shared list (then passed on)."""

    def __init__(self, service: str, client: Any, calls: list[tuple[str, str, dict[str, Any]]]):
        self._service, self._client, self._calls = service, client, calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name.startswith(("put_", "update_", "copy_", "delete_")):

            def call(**kw: Any) -> Any:
                self._calls.append((self._service, name, kw))
                return attr(**kw)

            return call
        return attr


def test_the_exact_writes_in_order_record_then_pointer_then_groups(
    aws: dict[str, Any], spec: ClusterSpec
) -> None:
    calls: list[tuple[str, str, dict[str, Any]]] = []
    start_job(
        spec,
        ssm=Recording("ssm", aws["ssm"], calls),
        autoscaling=Recording("autoscaling", aws["asg"], calls),
        s3=Recording("s3", aws["s3"], calls),
        now=NOW,
        token="ab12",
    )
    prefix = "checkpoints/d-0123456789ab/"
    copies = [c for c in calls if c[1] == "copy_object"]
    assert sorted(c[2]["Key"] for c in copies) == sorted(
        f"{prefix}job-history/d-0123456789ab/{k.removeprefix('job/')}" for k in RECORD
    )
    assert all(
        c[2]["CopySource"] == {"Bucket": "ckpt", "Key": c[2]["Key"].replace(
            "job-history/d-0123456789ab/", "job/")}
        for c in copies
    )  # fmt: skip
    pointer = JobPointer(
        NEW_ID, OLD.checkpoint_uri, "2026-11-22T10:00:00Z", OLD.job_id, prices=CATALOGUE_PRICES
    )
    assert calls[len(copies) :] == [
        (
            "s3",
            "delete_objects",
            {
                "Bucket": "ckpt",
                "Delete": {
                    "Objects": [{"Key": c[2]["CopySource"]["Key"]} for c in copies],
                    "Quiet": True,
                },
            },
        ),
        (
            "ssm",
            "put_parameter",
            {"Name": NAME, "Value": pointer.to_json(), "Type": "String", "Overwrite": True},
        ),
        *[
            (
                "autoscaling",
                "delete_scheduled_action",
                {"AutoScalingGroupName": g, "ScheduledActionName": f"hetero-budget-deadline-{g}"},
            )
            for g in ("vit-test-trainer", "vit-test-dataprep")
        ],
        (
            "autoscaling",
            "update_auto_scaling_group",
            {
                "AutoScalingGroupName": "vit-test-trainer",
                "MinSize": 0,
                "MaxSize": 2,
                "DesiredCapacity": 2,
            },
        ),
        (
            "autoscaling",
            "update_auto_scaling_group",
            {
                "AutoScalingGroupName": "vit-test-dataprep",
                "MinSize": 0,
                "MaxSize": 2,
                "DesiredCapacity": 2,
            },
        ),
    ]


def test_groups_the_budget_backstop_stopped_start_again_without_its_deadline(
    aws: dict[str, Any], spec: ClusterSpec
) -> None:
    """The earlier job's scheduled action ran (every group at 0/0/0) or is still pending on a
    group (its launchers could not end the job): the new job starts the groups at their sizes
    and deletes what is left, so the old deadline cannot stop it."""
    asg = aws["asg"]
    asg.update_auto_scaling_group(
        AutoScalingGroupName="vit-test-trainer", MinSize=0, MaxSize=0, DesiredCapacity=0
    )
    later = datetime(2027, 1, 1, tzinfo=UTC)
    put_backstop(asg, ["vit-test-dataprep"], later.timestamp(), now=NOW.timestamp())
    start(aws, spec)
    assert sizes(asg) == {"vit-test-trainer": (0, 2, 2), "vit-test-dataprep": (0, 2, 2)}
    assert (
        asg.describe_scheduled_actions(AutoScalingGroupName="vit-test-dataprep")[
            "ScheduledUpdateGroupActions"
        ]
        == []
    )


def test_no_parameter_means_deploy_first(aws: dict[str, Any], spec: ClusterSpec) -> None:
    aws["ssm"].delete_parameter(Name=NAME)
    with pytest.raises(JobParameterNotFound, match="deploy the cluster stack first"):
        start(aws, spec)
    assert sizes(aws["asg"])["vit-test-trainer"] == (0, 2, 0)


def test_a_spec_with_other_counts_than_the_deployed_one_is_refused(
    aws: dict[str, Any], spec_path: Path, spec: ClusterSpec
) -> None:
    aws["asg"].update_auto_scaling_group(AutoScalingGroupName="vit-test-dataprep", MaxSize=3)
    with pytest.raises(JobStartError) as e:
        start(aws, spec, spec_path=str(spec_path))
    assert str(e.value).startswith(
        f"{spec_path} is not the spec the stack was deployed with: "
        "vit-test-dataprep (MaxSize 3, spec count 2). Pass the deployed spec, or deploy"
    )
    assert read_job_pointer(aws["ssm"], NAME) == OLD


def test_the_command_prints_the_job_its_checkpoints_and_how_to_follow_it(
    aws: dict[str, Any],
    spec_path: Path,
    capsys: pytest.CaptureFixture[str],
    record_aws_calls: Callable[..., Path],
) -> None:
    record_aws_calls(aws_calls.Names(cluster="vit-test", checkpoint_bucket="ckpt"))
    assert main(["job", "start", "--spec", str(spec_path), "--fresh", "--region", REGION]) == 0
    pointer = read_job_pointer(aws["ssm"], NAME)
    assert pointer.job_id.startswith("j-") and pointer.job_id != OLD.job_id
    # Both groups are Spot: priced from DescribeSpotPriceHistory in the groups' AZ, which moto
    # answers with 0.00001 USD/h for every type it offers there.
    assert pointer.prices is not None
    recorded = [
        (p.group, p.instance_type, p.count, p.usd_per_hour, p.source) for p in pointer.prices
    ]
    assert recorded == [
        ("trainer", "g5.12xlarge", 2, 0.00001, "spot-price-history"),
        ("dataprep", "c6i.4xlarge", 2, 0.00001, "spot-price-history"),
    ]
    assert capsys.readouterr().out.splitlines() == [
        f"started job {pointer.job_id} (fresh, from step 0)",
        f"checkpoints: s3://ckpt/checkpoints/{pointer.job_id}/",
        "groups: vit-test-trainer 2, vit-test-dataprep 2",
        "prices, each group at its most (the job's budget):",
        *[f"  {line}" for line in price_lines(pointer.prices)],
        f"follow it: hetero status --spec {spec_path}",
    ]
    # Now the groups have capacity: a second start is refused (exit 1), the first job stays.
    assert main(["job", "start", "--spec", str(spec_path), "--region", REGION]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"hetero job start: job {pointer.job_id} is still running: ")
    assert read_job_pointer(aws["ssm"], NAME) == pointer


def test_the_job_id_format(aws: dict[str, Any], spec: ClusterSpec) -> None:
    started = start_job(spec, ssm=aws["ssm"], autoscaling=aws["asg"], s3=aws["s3"])
    assert re.fullmatch(r"j-\d{8}T\d{6}-[0-9a-f]{4}", started.pointer.job_id)
    assert json.loads(aws["ssm"].get_parameter(Name=NAME)["Parameter"]["Value"])["job_id"] == (
        started.pointer.job_id
    )


def test_an_elastic_dataprep_group_starts_at_count_within_its_min_and_max(
    aws: dict[str, Any], spec: ClusterSpec
) -> None:
    """The stack gives an elastic group MaxSize max_count (``infra/instance_group.py``): that is
    the deployed spec, and the job starts it at count between min_count and max_count."""
    dataprep = replace(spec.group("dataprep"), min_count=1, max_count=4)
    elastic = replace(
        spec, groups=tuple(dataprep if g.name == "dataprep" else g for g in spec.groups)
    )
    assert group_sizes(dataprep) == (1, 4, 2)
    assert group_sizes(spec.group("trainer")) == (0, 2, 2)
    # Deployed with the elastic spec: MaxSize is max_count. The fixed spec no longer matches.
    aws["asg"].update_auto_scaling_group(AutoScalingGroupName="vit-test-dataprep", MaxSize=4)
    with pytest.raises(JobStartError, match=r"vit-test-dataprep \(MaxSize 4, spec count 2\)"):
        start(aws, spec)
    started = start(aws, elastic)
    assert started.groups == (("vit-test-trainer", 2), ("vit-test-dataprep", 2))
    assert sizes(aws["asg"]) == {"vit-test-trainer": (0, 2, 2), "vit-test-dataprep": (1, 4, 2)}
