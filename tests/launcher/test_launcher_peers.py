"""Peer discovery: EC2 DescribeInstances by the cluster's tags (moto), SageMaker hosts, loopback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from training.common.hosts import list_cluster_instances
from training.dataplane.discovery import DiscoveryError, Ec2Servers
from training.launcher.peers import PeerDiscoveryError, local_peers, sagemaker_peers
from training.spec import ClusterSpec

from .test_launcher_group import RESOURCECONFIG

REGION = "us-west-2"
# One of moto's built-in images (listing images instead takes seconds per call).
AMI = "ami-12c6146b"


@pytest.fixture
def ec2() -> Iterator[tuple[Any, str]]:
    """A mocked EC2 client and a subnet to launch into."""
    with mock_aws():
        client = boto3.client("ec2", region_name=REGION)
        vpc = client.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnet = client.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
        yield client, subnet


def launch(ec2: tuple[Any, str], ip: str, group: str | None, cluster: str = "vit-test") -> str:
    client, subnet = ec2
    tags = [{"Key": "hetero:cluster", "Value": cluster}]
    if group is not None:
        tags.append({"Key": "hetero:group", "Value": group})
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


def test_filters_by_cluster_and_state_and_sorts_by_address(
    ec2: tuple[Any, str], spec: ClusterSpec
) -> None:
    # Launched out of order; 10.0.0.9 < 10.0.0.30 < 10.0.0.200 numerically (not as strings).
    t_high = launch(ec2, "10.0.0.200", "trainer")
    t_low = launch(ec2, "10.0.0.9", "trainer")
    d_b = launch(ec2, "10.0.0.31", "dataprep")
    d_a = launch(ec2, "10.0.0.30", "dataprep")
    launch(ec2, "10.0.0.50", "trainer", cluster="another-cluster")
    launch(ec2, "10.0.0.60", None)  # no group tag: ignored
    stopped = launch(ec2, "10.0.0.5", "trainer")
    ec2[0].stop_instances(InstanceIds=[stopped])

    grouped = list_cluster_instances(ec2[0], "vit-test")
    assert {k: [i["InstanceId"] for i in v] for k, v in grouped.items()} == {
        "trainer": [t_low, t_high],
        "dataprep": [d_a, d_b],
    }


def test_sagemaker_hosts_from_resourceconfig(spec: ClusterSpec) -> None:
    peers = sagemaker_peers(spec, RESOURCECONFIG)
    assert peers.hosts == {"trainer": ("algo-1", "algo-2"), "dataprep": ("algo-3", "algo-4")}
    assert peers.self_index == 0  # algo-3 is the first dataprep host
    assert peers.data_servers == ("algo-3:50051", "algo-4:50051")
    as_trainer = dict(RESOURCECONFIG, current_host="algo-2", current_group_name="trainer")
    assert sagemaker_peers(spec, as_trainer).self_index == 1


def test_sagemaker_job_without_a_spec_group_is_refused(spec: ClusterSpec) -> None:
    config = dict(RESOURCECONFIG)
    config["instance_groups"] = [RESOURCECONFIG["instance_groups"][0]]  # type: ignore[index]
    with pytest.raises(PeerDiscoveryError, match="no instance group named 'dataprep'"):
        sagemaker_peers(spec, config)


def test_local_peers_are_loopback_ports(spec: ClusterSpec) -> None:
    peers = local_peers(spec, self_index=1)
    assert peers.trainer_hosts(spec) == ("127.0.0.1", "127.0.0.1")
    assert peers.data_servers == ("127.0.0.1:50051", "127.0.0.1:50052")
    assert peers.self_index == 1


def _lifecycle(states: dict[str, str]) -> dict[str, Any]:
    """A DescribeAutoScalingInstances reply giving each instance its lifecycle state."""
    return {
        "AutoScalingInstances": [
            {
                "InstanceId": i,
                "AutoScalingGroupName": "vit-test-dataprep",
                "AvailabilityZone": f"{REGION}a",
                "LifecycleState": state,
                "HealthStatus": "HEALTHY",
                "ProtectedFromScaleIn": False,
            }
            for i, state in states.items()
        ]
    }


def test_data_servers_on_ec2_running_dataprep_instances_not_being_terminated(
    ec2: tuple[Any, str], spec: ClusterSpec
) -> None:
    """The trainer's EC2 discovery of data servers (``Ec2Servers``): this cluster's running
    dataprep instances by private IP, minus one its Auto Scaling group is terminating (a
    termination lifecycle hook keeps it running meanwhile; Stubber gives its state)."""
    launch(ec2, "10.0.0.40", "trainer")  # trainers serve no data
    launch(ec2, "10.0.0.90", "dataprep", cluster="another-job")
    d_high = launch(ec2, "10.0.0.52", "dataprep")
    d_low = launch(ec2, "10.0.0.9", "dataprep")
    leaving = launch(ec2, "10.0.0.51", "dataprep")
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
        source = Ec2Servers(spec, ec2=ec2[0], autoscaling=autoscaling)
        assert source.addresses() == ["10.0.0.9:50051", "10.0.0.52:50051"]
        ec2[0].terminate_instances(InstanceIds=[d_high])  # no longer running
        assert source.addresses() == ["10.0.0.9:50051"]
        stub.assert_no_pending_responses()
    with Stubber(autoscaling) as stub:
        stub.add_client_error("describe_auto_scaling_instances", "AccessDenied", "no")
        with pytest.raises(DiscoveryError, match="AccessDenied"):
            source.addresses()
