"""Discovery sources: the ``--data-servers`` forms, a discovery file, SageMaker's resource
config; EC2 (moto) minus instances their Auto Scaling group is terminating (Stubber)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from training.dataplane.discovery import (
    DiscoveryError,
    Ec2Servers,
    FileServers,
    SageMakerServers,
    StaticServers,
    parse_discovery,
)
from training.spec import ClusterSpec, load_spec

REGION = "us-west-2"
AMI = "ami-12c6146b"  # one of moto's built-in images


@pytest.fixture
def spec(spec_path: Path) -> ClusterSpec:
    """Groups ``trainer`` (1) and ``dataprep`` (2, one server each on port 50051)."""
    return load_spec(spec_path)


def test_forms_of_data_servers(spec: ClusterSpec, tmp_path: Path) -> None:
    static = parse_discovery("10.0.0.5:50051, 10.0.0.6:50051,10.0.0.5:50051", spec)
    assert isinstance(static, StaticServers)
    assert static.addresses() == ["10.0.0.5:50051", "10.0.0.6:50051"]
    listing = parse_discovery(f"file:{tmp_path / 'servers.txt'}", spec)
    assert isinstance(listing, FileServers) and listing.path == tmp_path / "servers.txt"
    ec2 = parse_discovery("ec2:other-cluster", spec)
    assert isinstance(ec2, Ec2Servers) and ec2.cluster == "other-cluster"
    assert isinstance(parse_discovery("ec2", spec), Ec2Servers)
    assert parse_discovery("ec2", spec).cluster == spec.name  # type: ignore[attr-defined]
    sm = parse_discovery("sagemaker", spec)
    assert isinstance(sm, SageMakerServers)
    assert str(sm.path) == "/opt/ml/input/config/resourceconfig.json"
    loopback = parse_discovery("loopback", spec)
    assert loopback.addresses() == ["127.0.0.1:50051", "127.0.0.1:50052"]
    for bad in ("10.0.0.5", "host:99999", "ec3:x", "file:"):
        with pytest.raises(ValueError, match=r"host:port|file: needs a path") as err:
            parse_discovery(bad, spec)
        if bad != "file:":
            assert "ec2[:CLUSTER]" in str(err.value)


def test_file_is_read_again_on_every_call(tmp_path: Path) -> None:
    path = tmp_path / "servers.txt"
    source = FileServers(path)
    assert source.addresses() == []  # no file yet: no server
    path.write_text("# data servers\n127.0.0.1:5001\n\n127.0.0.1:5002  # second\n")
    assert source.addresses() == ["127.0.0.1:5001", "127.0.0.1:5002"]
    path.write_text("127.0.0.1:5003\n")
    assert source.addresses() == ["127.0.0.1:5003"]
    path.write_text("127.0.0.1:5003\nnot-an-address\n")
    with pytest.raises(DiscoveryError, match="line 2: 'not-an-address' is not host:port"):
        source.addresses()


def test_sagemaker_dataprep_hosts(spec: ClusterSpec, tmp_path: Path) -> None:
    path = tmp_path / "resourceconfig.json"
    source = SageMakerServers(spec, path)
    with pytest.raises(DiscoveryError, match="cannot read SageMaker's"):
        source.addresses()
    path.write_text(
        json.dumps(
            {
                "current_host": "algo-1",
                "current_group_name": "trainer",
                "instance_groups": [
                    {"instance_group_name": "trainer", "hosts": ["algo-1"]},
                    {"instance_group_name": "dataprep", "hosts": ["algo-10", "algo-2"]},
                ],
            }
        )
    )
    assert source.addresses() == ["algo-2:50051", "algo-10:50051"]


def _launch(client: Any, subnet: str, ip: str, group: str, cluster: str = "dataplane-test") -> str:
    tags = [{"Key": "hetero:cluster", "Value": cluster}, {"Key": "hetero:group", "Value": group}]
    reply = client.run_instances(
        ImageId=AMI,
        MinCount=1,
        MaxCount=1,
        InstanceType="c6i.4xlarge",
        SubnetId=subnet,
        PrivateIpAddress=ip,
        TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
    )
    return str(reply["Instances"][0]["InstanceId"])


def _lifecycle(states: dict[str, str]) -> dict[str, Any]:
    return {
        "AutoScalingInstances": [
            {
                "InstanceId": i,
                "AutoScalingGroupName": "dataplane-test-dataprep",
                "AvailabilityZone": f"{REGION}a",
                "LifecycleState": state,
                "HealthStatus": "HEALTHY",
                "ProtectedFromScaleIn": False,
            }
            for i, state in states.items()
        ]
    }


def test_ec2_running_dataprep_instances_not_being_terminated(spec: ClusterSpec) -> None:
    with mock_aws():
        ec2 = boto3.client("ec2", region_name=REGION)
        vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
        _launch(ec2, subnet, "10.0.0.40", "trainer")  # trainers serve no data
        _launch(ec2, subnet, "10.0.0.90", "dataprep", cluster="another-job")
        d_high = _launch(ec2, subnet, "10.0.0.52", "dataprep")
        d_low = _launch(ec2, subnet, "10.0.0.9", "dataprep")
        leaving = _launch(ec2, subnet, "10.0.0.51", "dataprep")
        autoscaling = boto3.client("autoscaling", region_name=REGION)
        with Stubber(autoscaling) as stub:
            # Sorted by private IP: 10.0.0.9, 10.0.0.51, 10.0.0.52.
            stub.add_response(
                "describe_auto_scaling_instances",
                _lifecycle({d_low: "InService", leaving: "Terminating:Wait", d_high: "InService"}),
                {"InstanceIds": [d_low, leaving, d_high]},
            )
            stub.add_response(
                "describe_auto_scaling_instances",
                _lifecycle({d_low: "InService", leaving: "Terminating:Wait"}),
                {"InstanceIds": [d_low, leaving]},
            )
            source = Ec2Servers(spec, ec2=ec2, autoscaling=autoscaling)
            assert source.addresses() == ["10.0.0.9:50051", "10.0.0.52:50051"]
            ec2.terminate_instances(InstanceIds=[d_high])  # no longer running
            assert source.addresses() == ["10.0.0.9:50051"]
            stub.assert_no_pending_responses()
        with Stubber(autoscaling) as stub:
            stub.add_client_error("describe_auto_scaling_instances", "AccessDenied", "no")
            with pytest.raises(DiscoveryError, match="AccessDenied"):
                source.addresses()
