"""``hetero preflight``: every AWS call is answered by botocore's Stubber, which also asserts the
exact request parameters, so a test fails if a check asks AWS the wrong question."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aws_calls
import boto3
import pytest
from botocore.exceptions import NoCredentialsError
from botocore.stub import Stubber

from training import cli, preflight
from training.common import call_log
from training.common.names import DATAPREP_AMI_PARAMETER, TRAINER_AMI_PARAMETER
from training.preflight import Check, Clients, Status
from training.preflight import command as preflight_command
from training.spec import ClusterSpec, load_spec

REGION = "us-east-1"
ACCOUNT = "123456789012"

# Trainer: 2 Spot instances of g5.xlarge or g6.xlarge (4 vCPUs each) -> 8 vCPUs of G and VT Spot.
# Dataprep: 1 Spot c6i.4xlarge or c7i.4xlarge (16 vCPUs) -> 16 vCPUs of Standard Spot.
SPEC = """
name = "vit-pre"
availability_zone_index = 1

[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge", "g6.xlarge"]
count = 2
market = "spot"

[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge", "c7i.4xlarge"]
count = 1
market = "spot"
efa = "off"

[job]
steps = 10
"""
TYPES = ["g5.xlarge", "g6.xlarge", "c6i.4xlarge", "c7i.4xlarge"]
VCPUS = {"g5.xlarge": 4, "g6.xlarge": 4, "c6i.4xlarge": 16, "c7i.4xlarge": 16}
# Returned out of name order on purpose: the index must follow name order (Fn::GetAZs).
ZONES = [("us-east-1c", "use1-az4"), ("us-east-1a", "use1-az6"), ("us-east-1b", "use1-az1")]
G_SPOT, STANDARD_SPOT = "L-3819A6DF", "L-34B43A08"
PLACEMENT_WARN = "cluster placement (trainer)"
"""The one WARN of SPEC that needs no AWS call: two trainer types in one cluster placement group."""


@dataclass
class Stubs:
    ec2: Stubber
    service_quotas: Stubber
    ssm: Stubber
    cloudformation: Stubber
    sts: Stubber
    clients: Clients

    def all(self) -> list[Stubber]:
        return [self.ec2, self.service_quotas, self.ssm, self.cloudformation, self.sts]


@pytest.fixture
def spec_path(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(SPEC)
    return path


@pytest.fixture
def spec(spec_path: Path) -> ClusterSpec:
    return load_spec(spec_path)


@pytest.fixture
def stubs() -> Iterator[Stubs]:
    session = boto3.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION
    )
    clients = Clients(
        ec2=session.client("ec2"),
        service_quotas=session.client("service-quotas"),
        ssm=session.client("ssm"),
        cloudformation=session.client("cloudformation"),
        sts=session.client("sts"),
    )
    s = Stubs(
        Stubber(clients.ec2),
        Stubber(clients.service_quotas),
        Stubber(clients.ssm),
        Stubber(clients.cloudformation),
        Stubber(clients.sts),
        clients,
    )
    for stub in s.all():
        stub.activate()
    yield s
    for stub in s.all():
        stub.deactivate()


def expect_all(
    s: Stubs,
    *,
    quotas: dict[str, float] | None = None,
    default_subnet_azs: tuple[str, ...] = ("us-east-1a", "us-east-1b", "us-east-1c"),
    chosen: str = "us-east-1b",
    offered: tuple[str, ...] = tuple(TYPES),
    trainer_scores: dict[str, int] | None = None,
    deny_trainer_scores: bool = False,
    invalid_parameters: tuple[str, ...] = (),
    stack_status: str | None = "UPDATE_COMPLETE",
    bootstrap_version: str = "21",
    zone_known: bool = True,
    missing_quota: str | None = None,
) -> None:
    """Queue every call of one preflight run, each with its exact expected request."""
    s.sts.add_response(
        "get_caller_identity",
        {"Account": ACCOUNT, "Arn": f"arn:aws:iam::{ACCOUNT}:user/dev", "UserId": "AIDAEXAMPLE"},
        {},
    )
    s.ec2.add_response(
        "describe_instance_types",
        {
            "InstanceTypes": [
                {"InstanceType": t, "VCpuInfo": {"DefaultVCpus": VCPUS[t]}} for t in TYPES
            ]
        },
        {"InstanceTypes": TYPES},
    )
    values = {G_SPOT: 64.0, STANDARD_SPOT: 640.0, **(quotas or {})}
    for code in (G_SPOT, STANDARD_SPOT):  # the order groups first need them
        if code == missing_quota:
            s.service_quotas.add_client_error(
                "get_service_quota",
                service_error_code="NoSuchResourceException",
                service_message="The request failed because the specified quota does not exist.",
                http_status_code=400,
                expected_params={"ServiceCode": "ec2", "QuotaCode": code},
            )
            continue
        s.service_quotas.add_response(
            "get_service_quota",
            {"Quota": {"ServiceCode": "ec2", "QuotaCode": code, "Value": values[code]}},
            {"ServiceCode": "ec2", "QuotaCode": code},
        )
    s.ec2.add_response(
        "describe_availability_zones",
        {
            "AvailabilityZones": [
                {
                    "ZoneName": name,
                    "ZoneId": zid,
                    "State": "available",
                    "ZoneType": "availability-zone",
                    "OptInStatus": "opt-in-not-required",
                    "RegionName": REGION,
                }
                for name, zid in ZONES
            ]
        },
        {
            "Filters": [
                {"Name": "zone-type", "Values": ["availability-zone"]},
                {"Name": "opt-in-status", "Values": ["opt-in-not-required", "opted-in"]},
            ]
        },
    )
    s.ec2.add_response(
        "describe_subnets",
        {
            "Subnets": [
                {"SubnetId": f"subnet-{i}", "AvailabilityZone": az, "DefaultForAz": True}
                for i, az in enumerate(default_subnet_azs)
            ]
        },
        {"Filters": [{"Name": "default-for-az", "Values": ["true"]}]},
    )
    if zone_known:
        expect_zone_calls(s, chosen, offered, trainer_scores, deny_trainer_scores)
    names = [TRAINER_AMI_PARAMETER, DATAPREP_AMI_PARAMETER]
    s.ssm.add_response(
        "get_parameters",
        {
            "Parameters": [
                {"Name": n, "Value": f"ami-0{i}", "Type": "String"}
                for i, n in enumerate(names)
                if n not in invalid_parameters
            ],
            # AWS leaves the key out when every name resolves (the shape needs 1+ entries).
            **({"InvalidParameters": list(invalid_parameters)} if invalid_parameters else {}),
        },
        {"Names": names},
    )
    if stack_status is None:
        s.cloudformation.add_client_error(
            "describe_stacks",
            service_error_code="ValidationError",
            service_message="Stack with id CDKToolkit does not exist",
            http_status_code=400,
            expected_params={"StackName": "CDKToolkit"},
        )
        return
    s.cloudformation.add_response(
        "describe_stacks",
        {
            "Stacks": [
                {
                    "StackName": "CDKToolkit",
                    "CreationTime": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
                    "StackStatus": stack_status,
                }
            ]
        },
        {"StackName": "CDKToolkit"},
    )
    s.ssm.add_response(
        "get_parameter",
        {
            "Parameter": {
                "Name": preflight.CDK_BOOTSTRAP_VERSION_PARAMETER,
                "Value": bootstrap_version,
            }
        },
        {"Name": "/cdk-bootstrap/hnb659fds/version"},
    )


def expect_zone_calls(
    s: Stubs,
    chosen: str,
    offered: tuple[str, ...],
    trainer_scores: dict[str, int] | None,
    deny_trainer_scores: bool,
) -> None:
    """The offering request for the chosen AZ, then one placement-score request per Spot group."""
    s.ec2.add_response(
        "describe_instance_type_offerings",
        {
            "InstanceTypeOfferings": [
                {"InstanceType": t, "LocationType": "availability-zone", "Location": chosen}
                for t in offered
            ]
        },
        {
            "LocationType": "availability-zone",
            "Filters": [
                {"Name": "location", "Values": [chosen]},
                {"Name": "instance-type", "Values": TYPES},
            ],
        },
    )
    trainer_request = {
        "InstanceTypes": ["g5.xlarge", "g6.xlarge"],
        "TargetCapacity": 2,
        "TargetCapacityUnitType": "units",
        "SingleAvailabilityZone": True,
        "RegionNames": [REGION],
    }
    if deny_trainer_scores:
        s.ec2.add_client_error(
            "get_spot_placement_scores",
            service_error_code="UnauthorizedOperation",
            service_message="You are not authorized to perform this operation.",
            http_status_code=403,
            expected_params=trainer_request,
        )
    else:
        scores = trainer_scores or {"use1-az6": 9, "use1-az1": 8, "use1-az4": 5}
        s.ec2.add_response(
            "get_spot_placement_scores",
            {
                "SpotPlacementScores": [
                    {"Region": REGION, "AvailabilityZoneId": z, "Score": v}
                    for z, v in scores.items()
                ]
            },
            trainer_request,
        )
    s.ec2.add_response(
        "get_spot_placement_scores",
        {"SpotPlacementScores": [{"Region": REGION, "AvailabilityZoneId": "use1-az1", "Score": 7}]},
        {
            "InstanceTypes": ["c6i.4xlarge", "c7i.4xlarge"],
            "TargetCapacity": 1,
            "TargetCapacityUnitType": "units",
            "SingleAvailabilityZone": True,
            "RegionNames": [REGION],
        },
    )


def run(spec: ClusterSpec, s: Stubs) -> dict[str, Check]:
    rows = preflight.run_checks(spec, s.clients, REGION)
    for stub in s.all():
        stub.assert_no_pending_responses()
    by_name = {r.name: r for r in rows}
    assert len(by_name) == len(rows), "row names must be unique"
    return by_name


def test_all_pass(spec: ClusterSpec, stubs: Stubs) -> None:
    expect_all(stubs)
    rows = run(spec, stubs)
    assert list(rows) == [
        "AWS credentials",
        "vCPU quota L-3819A6DF",
        "vCPU quota L-34B43A08",
        "availability zone",
        "offered in us-east-1b (trainer)",
        "offered in us-east-1b (dataprep)",
        "Spot placement score (trainer)",
        "Spot placement score (dataprep)",
        "AMI parameter (trainer)",
        "AMI parameter (dataprep)",
        "CDK bootstrap stack",
        "CDK bootstrap version",
        PLACEMENT_WARN,  # dataprep uses no placement group: no row
    ]
    # Every AWS check passes; the spec's two trainer types in one cluster placement group warn.
    assert [n for n, r in rows.items() if r.status is not Status.PASS] == [PLACEMENT_WARN]
    assert rows["availability zone"].detail.startswith("index 1 -> us-east-1b (use1-az1)")
    g = rows["vCPU quota L-3819A6DF"].detail
    assert g.startswith("All G and VT Spot Instance Requests: needs 8 vCPUs")
    assert "quota 64" in g and "Current usage is not known" in g
    assert "needs 16 vCPUs" in rows["vCPU quota L-34B43A08"].detail
    assert rows["Spot placement score (trainer)"].detail.startswith("8/10 in us-east-1b")
    assert "best: us-east-1a (index 0, score 9)" in rows["Spot placement score (trainer)"].detail


def test_spot_quota_too_low_names_code_and_vcpus(spec: ClusterSpec, stubs: Stubs) -> None:
    expect_all(stubs, quotas={G_SPOT: 4.0})
    rows = run(spec, stubs)
    g = rows["vCPU quota L-3819A6DF"]
    assert g.status is Status.FAIL
    assert "quota 4" in g.detail and "needs 8 vCPUs" in g.detail
    assert g.fix.startswith(
        "request an increase of quota L-3819A6DF (All G and VT Spot Instance Requests) to at "
        "least 8 vCPUs"
    )
    assert "--quota-code L-3819A6DF --desired-value 8 --region us-east-1" in g.fix
    assert rows["vCPU quota L-34B43A08"].status is Status.PASS
    assert [r.name for r in rows.values() if r.status is not Status.PASS] == [
        g.name,
        PLACEMENT_WARN,
    ]


def test_unknown_quota_code_fails_naming_the_table(spec: ClusterSpec, stubs: Stubs) -> None:
    expect_all(stubs, missing_quota=STANDARD_SPOT)
    rows = run(spec, stubs)
    row = rows["vCPU quota L-34B43A08"]
    assert row.status is Status.FAIL
    assert row.detail.startswith("NoSuchResourceException on GetServiceQuota")
    assert row.fix == (
        "find the All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests quota in the "
        "Service Quotas console for us-east-1 (EC2) and correct its code in "
        "training/preflight/quotas.py QUOTA_CLASSES"
    )


def test_az_index_follows_default_subnets_and_name_order(spec: ClusterSpec, stubs: Stubs) -> None:
    # Fn::GetAZs lists only AZs with a default subnet: [a, c], so index 1 is us-east-1c.
    expect_all(stubs, default_subnet_azs=("us-east-1c", "us-east-1a"), chosen="us-east-1c")
    rows = run(spec, stubs)
    assert rows["availability zone"].detail == (
        "index 1 -> us-east-1c (use1-az4); Fn::GetAZs order: 0: us-east-1a, 1: us-east-1c"
    )
    # The placement row now judges use1-az4 (score 5), and the best zone has index 0.
    trainer = rows["Spot placement score (trainer)"]
    assert trainer.status is Status.PASS
    assert trainer.detail.startswith("5/10 in us-east-1c")


def test_az_index_out_of_range_fails_and_skips_zone_checks(stubs: Stubs, tmp_path: Path) -> None:
    path = tmp_path / "far.toml"
    path.write_text(SPEC.replace("availability_zone_index = 1", "availability_zone_index = 3"))
    spec = load_spec(path)
    expect_all(stubs, zone_known=False)  # no offering or placement requests follow
    rows = run(spec, stubs)
    az = rows["availability zone"]
    assert az.status is Status.FAIL
    assert "availability_zone_index = 3" in az.detail and "lists 3 zone(s)" in az.detail
    assert az.fix == f"set availability_zone_index to 0..2 in {path}"
    assert rows["offerings and Spot placement"].status is Status.FAIL


def test_offerings_one_missing_warns_all_missing_fails(spec: ClusterSpec, stubs: Stubs) -> None:
    expect_all(stubs, offered=("g5.xlarge",))  # no g6.xlarge, no c6i/c7i
    rows = run(spec, stubs)
    trainer = rows["offered in us-east-1b (trainer)"]
    assert trainer.status is Status.WARN
    assert trainer.detail.startswith("not offered: g6.xlarge; offered: g5.xlarge")
    dataprep = rows["offered in us-east-1b (dataprep)"]
    assert dataprep.status is Status.FAIL
    assert dataprep.detail == "none of c6i.4xlarge, c7i.4xlarge is offered in us-east-1b"
    assert "availability_zone_index" in dataprep.fix


def test_ami_parameter_that_does_not_resolve_fails(spec: ClusterSpec, stubs: Stubs) -> None:
    expect_all(stubs, invalid_parameters=(DATAPREP_AMI_PARAMETER,))
    rows = run(spec, stubs)
    assert rows["AMI parameter (trainer)"].status is Status.PASS
    bad = rows["AMI parameter (dataprep)"]
    assert bad.status is Status.FAIL
    assert bad.detail == f"{DATAPREP_AMI_PARAMETER} does not resolve in us-east-1"


def test_low_placement_score_names_better_az_index(spec: ClusterSpec, stubs: Stubs) -> None:
    expect_all(stubs, trainer_scores={"use1-az1": 2, "use1-az4": 9, "use1-az6": 6})
    rows = run(spec, stubs)
    low = rows["Spot placement score (trainer)"]
    assert low.status is Status.WARN
    assert low.detail.startswith("2/10 in us-east-1b for 2 x g5.xlarge/g6.xlarge")
    assert low.fix.startswith("set availability_zone_index = 2 in ")
    assert "(us-east-1c, score 9); group 'trainer' lists 2 type(s)" in low.fix
    assert low.fix.endswith("always scores fewer than three low: add types with the same GPU count")
    assert rows["Spot placement score (dataprep)"].status is Status.PASS


def test_no_bootstrap_stack_says_cdk_bootstrap(spec: ClusterSpec, stubs: Stubs) -> None:
    expect_all(stubs, stack_status=None)  # and no version lookup follows
    rows = run(spec, stubs)
    boot = rows["CDK bootstrap stack"]
    assert boot.status is Status.FAIL
    assert (
        boot.fix
        == f"run `npx cdk bootstrap aws://{ACCOUNT}/us-east-1` (once per account and region)"
    )
    assert "CDK bootstrap version" not in rows


@pytest.mark.parametrize(
    ("status", "version", "stack_ok", "version_ok"),
    [
        ("ROLLBACK_COMPLETE", "21", False, True),
        ("UPDATE_ROLLBACK_COMPLETE", "21", True, True),
        ("CREATE_COMPLETE", "5", True, False),
    ],
)
def test_bootstrap_stack_state_and_version(
    spec: ClusterSpec, stubs: Stubs, status: str, version: str, stack_ok: bool, version_ok: bool
) -> None:
    expect_all(stubs, stack_status=status, bootstrap_version=version)
    rows = run(spec, stubs)
    assert (rows["CDK bootstrap stack"].status is Status.PASS) is stack_ok
    assert (rows["CDK bootstrap version"].status is Status.PASS) is version_ok
    if not version_ok:
        assert rows["CDK bootstrap version"].detail == (
            "/cdk-bootstrap/hnb659fds/version = 5 (templates need >= 6)"
        )


def test_access_denied_becomes_fail_naming_the_action(spec: ClusterSpec, stubs: Stubs) -> None:
    expect_all(stubs, deny_trainer_scores=True)
    rows = run(spec, stubs)
    denied = rows["Spot placement score (trainer)"]
    assert denied.status is Status.FAIL
    assert denied.detail.startswith("UnauthorizedOperation on GetSpotPlacementScores")
    assert denied.fix == (
        "allow ec2:GetSpotPlacementScores to the identity running preflight "
        "(an IAM policy statement)"
    )
    # Only that check failed; the dataprep group's score was still asked for and passed.
    assert [r.name for r in rows.values() if r.status is not Status.PASS] == [
        denied.name,
        PLACEMENT_WARN,
    ]


def test_no_credentials_is_one_fail_row_not_a_traceback(spec: ClusterSpec) -> None:
    class NoCredsSts:
        def get_caller_identity(self) -> dict[str, Any]:
            raise NoCredentialsError()

    clients = Clients(
        ec2=None, service_quotas=None, ssm=None, cloudformation=None, sts=NoCredsSts()
    )
    rows = preflight.run_checks(spec, clients, REGION)
    assert [(r.name, r.status) for r in rows] == [("AWS credentials", Status.FAIL)]
    assert rows[0].fix.startswith("configure AWS credentials")


def test_cluster_placement_warns_on_several_types(tmp_path: Path) -> None:
    """Spec only, no AWS call: a WARN row for a cluster-placement group with several types, a
    PASS row for one with one type, no row for a group without a placement group."""
    path = tmp_path / "placement.toml"
    path.write_text(
        SPEC.replace(
            'efa = "off"', 'efa = "off"\nplacement = "cluster"'
        ).replace(  # dataprep: 2 types
            '["g5.xlarge", "g6.xlarge"]', '["g5.xlarge"]'
        )  # trainer: 1 type
    )
    rows = preflight.check_cluster_placement(load_spec(path))
    assert [(r.name, r.status) for r in rows] == [
        ("cluster placement (trainer)", Status.PASS),
        ("cluster placement (dataprep)", Status.WARN),
    ]
    assert rows[0].detail == "g5.xlarge only: one instance type, as AWS advises"
    assert rows[1].detail == (
        "group 'dataprep' uses a cluster placement group with 2 instance types "
        "(c6i.4xlarge, c7i.4xlarge); AWS recommends the same instance type for all instances "
        "in a cluster placement group: more than one type raises the chance of an "
        "insufficient capacity error (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/"
        "placement-strategies.html#placement-groups-cluster)"
    )
    assert rows[1].fix == (
        f"list one instance type in the group, or set placement = 'none' on it in {path}"
    )
    # placement = "none" on both: nothing to check.
    path.write_text(SPEC.replace('market = "spot"', 'market = "spot"\nplacement = "none"'))
    assert preflight.check_cluster_placement(load_spec(path)) == []


def test_quota_classes_and_vcpu_needs(tmp_path: Path) -> None:
    assert preflight.quota_class("g5.xlarge") is preflight.QUOTA_CLASSES["g"]
    assert preflight.quota_class("vt1.3xlarge") is preflight.QUOTA_CLASSES["g"]
    assert preflight.quota_class("p4d.24xlarge") is preflight.QUOTA_CLASSES["p"]
    assert preflight.quota_class("inf2.xlarge") is preflight.QUOTA_CLASSES["inf"]
    assert preflight.quota_class("trn1.32xlarge") is preflight.QUOTA_CLASSES["trn"]
    assert preflight.quota_class("dl1.24xlarge") is preflight.QUOTA_CLASSES["dl"]
    assert preflight.quota_class("hpc7g.16xlarge") is preflight.QUOTA_CLASSES["hpc"]
    assert preflight.quota_class("x2idn.32xlarge") is preflight.QUOTA_CLASSES["x"]
    assert preflight.quota_class("c6i.4xlarge") is preflight.QUOTA_CLASSES["standard"]
    assert preflight.quota_class("z1d.large") is preflight.QUOTA_CLASSES["standard"]
    assert preflight.quota_class("mac2.metal") is None
    # On-Demand trainers with types of two sizes: count x the largest, under the On-Demand code.
    path = tmp_path / "od.toml"
    path.write_text(
        SPEC.replace('["g5.xlarge", "g6.xlarge"]', '["g5.xlarge", "g5.2xlarge"]')
        .replace("count = 2", "count = 3")
        .replace('market = "spot"', 'market = "on-demand"', 1)
    )
    needs, problems = preflight.vcpu_needs(
        load_spec(path), {"g5.xlarge": 4, "g5.2xlarge": 8, "c6i.4xlarge": 16, "c7i.4xlarge": 16}
    )
    assert problems == []
    assert [(n.code, n.quota_name, n.vcpus) for n in needs] == [
        ("L-DB2E81BA", "Running On-Demand G and VT instances", 24),
        ("L-34B43A08", "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests", 16),
    ]


def test_an_elastic_group_needs_the_vcpus_of_its_max(tmp_path: Path) -> None:
    """The data-tier controller may grow an elastic dataprep group to max_count: the quota
    check counts that, and says so."""
    path = tmp_path / "elastic.toml"
    path.write_text(
        SPEC.replace(
            'instance_types = ["c6i.4xlarge", "c7i.4xlarge"]\ncount = 1\n',
            'instance_types = ["c6i.4xlarge", "c7i.4xlarge"]\ncount = 2\nmin_count = 1\n'
            "max_count = 5\n",
        )
    )
    needs, problems = preflight.vcpu_needs(load_spec(path), VCPUS)
    assert problems == []
    [standard] = [n for n in needs if n.code == STANDARD_SPOT]
    assert standard.vcpus == 5 * 16
    assert standard.parts == [
        "dataprep 5 (elastic 1-5, at most) x 16 (largest of: c6i.4xlarge 16, c7i.4xlarge 16)"
    ]


def test_cli_prints_table_and_exit_code(
    spec_path: Path,
    stubs: Stubs,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    record_aws_calls: Callable[..., Path],
) -> None:
    record_aws_calls(aws_calls.Names(cluster=load_spec(spec_path).name))
    for field in dataclasses.fields(stubs.clients):
        client = getattr(stubs.clients, field.name)
        call_log.attach(client)
    monkeypatch.setenv("COLUMNS", "1000")  # one line per row: no cell wraps
    seen: list[str | None] = []

    def fake_build_clients(region: str) -> Clients:
        seen.append(region)
        return stubs.clients

    monkeypatch.setattr(preflight_command, "build_clients", fake_build_clients)
    expect_all(stubs)
    assert cli.main(["preflight", "--spec", str(spec_path), "--region", REGION]) == 0
    out = capsys.readouterr().out
    assert seen == [REGION]
    assert "hetero preflight" in out
    assert "12 passed, 1 warning(s), 0 failed" in out
    line = next(x for x in out.splitlines() if "vCPU quota L-3819A6DF" in x)
    assert "PASS" in line and "needs 8 vCPUs" in line

    expect_all(stubs, quotas={STANDARD_SPOT: 5.0})
    assert cli.main(["preflight", "--spec", str(spec_path), "--region", REGION]) == 1
    out = capsys.readouterr().out
    assert "11 passed, 1 warning(s), 1 failed" in out
    line = next(x for x in out.splitlines() if "vCPU quota L-34B43A08" in x)
    assert "FAIL" in line and "--quota-code L-34B43A08 --desired-value 16" in line


def test_cli_without_credentials_prints_the_fix(
    spec_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class NoCredsSts:
        def get_caller_identity(self) -> dict[str, Any]:
            raise NoCredentialsError()

    monkeypatch.setenv("COLUMNS", "1000")
    monkeypatch.setattr(
        preflight_command,
        "build_clients",
        lambda region: Clients(
            ec2=None, service_quotas=None, ssm=None, cloudformation=None, sts=NoCredsSts()
        ),
    )
    assert cli.main(["preflight", "--spec", str(spec_path), "--region", REGION]) == 1
    out = capsys.readouterr().out
    # Printed as text, not parsed as rich markup (the fix holds "[/AWS_SESSION_TOKEN]").
    line = next(x for x in out.splitlines() if "AWS credentials" in x)
    assert "FAIL" in line and "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY[/AWS_SESSION_TOKEN]" in line
    assert "0 passed, 0 warning(s), 1 failed" in out
