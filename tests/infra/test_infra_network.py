"""The network stack: private subnets only, endpoints, flow logs, security groups, no SSH."""

from __future__ import annotations

from typing import Any

import aws_cdk as cdk
import pytest
from infra_support import SPOT_SPEC, BuiltApp, build

from training.network_cost import INTERFACE_ENDPOINTS

# Exactly the services something on the instances calls: no monitoring (metrics travel as EMF in
# the logs), no sts (credentials come from IMDS), no ec2messages (the SSM agent uses
# ssmmessages).
EXPECTED_ENDPOINTS = {
    "ecr.api",
    "ecr.dkr",
    "logs",
    "ssm",
    "ssmmessages",
    "ec2",
    "autoscaling",
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> BuiltApp:
    return build(tmp_path_factory.mktemp("net"), SPOT_SPEC)


def _resources(built: BuiltApp, kind: str) -> dict[str, dict[str, Any]]:
    return built.network.find_resources(kind)


def _logical_id(built: BuiltApp, kind: str, description_start: str) -> str:
    for lid, res in _resources(built, kind).items():
        if res["Properties"].get("GroupDescription", "").startswith(description_start):
            return lid
    raise AssertionError(f"no {kind} whose description starts with {description_start!r}")


def test_vpc_has_private_isolated_subnet_in_the_spec_az_and_no_internet_path(
    built: BuiltApp,
) -> None:
    t = built.network
    t.resource_count_is("AWS::EC2::VPC", 1)
    t.resource_count_is("AWS::EC2::InternetGateway", 0)
    t.resource_count_is("AWS::EC2::NatGateway", 0)
    t.resource_count_is("AWS::EC2::Subnet", 1)
    # availability_zone_index = 1 in the spec: the second AZ of the region, no lookup.
    t.has_resource_properties(
        "AWS::EC2::Subnet",
        {
            "MapPublicIpOnLaunch": False,
            "AvailabilityZone": {"Fn::Select": [1, {"Fn::GetAZs": ""}]},
        },
    )


def test_s3_gateway_and_every_interface_endpoint_the_instances_need(built: BuiltApp) -> None:
    t = built.network
    t.has_resource_properties(
        "AWS::EC2::VPCEndpoint",
        {
            "VpcEndpointType": "Gateway",
            "ServiceName": {"Fn::Join": ["", ["com.amazonaws.", {"Ref": "AWS::Region"}, ".s3"]]},
        },
    )
    endpoint_sg = _logical_id(built, "AWS::EC2::SecurityGroup", "VPC interface endpoints")
    services = set()
    for res in _resources(built, "AWS::EC2::VPCEndpoint").values():
        props = res["Properties"]
        if props.get("VpcEndpointType") != "Interface":
            continue
        assert props["PrivateDnsEnabled"] is True
        assert props["SecurityGroupIds"] == [{"Fn::GetAtt": [endpoint_sg, "GroupId"]}]
        parts = props["ServiceName"]["Fn::Join"][1]
        services.add(parts[-1].lstrip("."))
    assert services == EXPECTED_ENDPOINTS
    t.resource_count_is("AWS::EC2::VPCEndpoint", len(EXPECTED_ENDPOINTS) + 1)
    # What hetero spec check prices is what the stack creates.
    assert set(INTERFACE_ENDPOINTS) == EXPECTED_ENDPOINTS


def test_flow_logs_capture_all_traffic(built: BuiltApp) -> None:
    built.network.has_resource_properties(
        "AWS::EC2::FlowLog",
        {"ResourceType": "VPC", "TrafficType": "ALL", "LogDestinationType": "cloud-watch-logs"},
    )
    built.network.has_resource_properties("AWS::Logs::LogGroup", {"RetentionInDays": 30})


def test_cluster_group_allows_all_traffic_to_and_from_itself_only(built: BuiltApp) -> None:
    t = built.network
    cluster_sg = _logical_id(built, "AWS::EC2::SecurityGroup", "Cluster instances")
    self_ref = {"Fn::GetAtt": [cluster_sg, "GroupId"]}
    t.has_resource_properties(
        "AWS::EC2::SecurityGroupIngress",
        {"IpProtocol": "-1", "GroupId": self_ref, "SourceSecurityGroupId": self_ref},
    )
    t.has_resource_properties(
        "AWS::EC2::SecurityGroupEgress",
        {"IpProtocol": "-1", "GroupId": self_ref, "DestinationSecurityGroupId": self_ref},
    )
    # Nothing else comes in: no inline ingress, and the only ingress resource on the cluster
    # group is the self rule.
    sg = _resources(built, "AWS::EC2::SecurityGroup")[cluster_sg]["Properties"]
    assert "SecurityGroupIngress" not in sg
    ingress_to_cluster = [
        r["Properties"]
        for r in _resources(built, "AWS::EC2::SecurityGroupIngress").values()
        if r["Properties"]["GroupId"] == self_ref
    ]
    assert len(ingress_to_cluster) == 1


def test_endpoint_group_reachable_only_from_cluster_group(built: BuiltApp) -> None:
    cluster_sg = _logical_id(built, "AWS::EC2::SecurityGroup", "Cluster instances")
    endpoint_sg = _logical_id(built, "AWS::EC2::SecurityGroup", "VPC interface endpoints")
    rules = [
        r["Properties"]
        for r in _resources(built, "AWS::EC2::SecurityGroupIngress").values()
        if r["Properties"]["GroupId"] == {"Fn::GetAtt": [endpoint_sg, "GroupId"]}
    ]
    assert len(rules) == 1, rules
    assert rules[0]["SourceSecurityGroupId"] == {"Fn::GetAtt": [cluster_sg, "GroupId"]}
    assert (rules[0]["IpProtocol"], rules[0]["FromPort"], rules[0]["ToPort"]) == ("tcp", 443, 443)
    props = _resources(built, "AWS::EC2::SecurityGroup")[endpoint_sg]["Properties"]
    assert "SecurityGroupIngress" not in props


def test_no_ssh_anywhere(built: BuiltApp) -> None:
    for template in (built.network, built.cluster):
        for kind in ("AWS::EC2::SecurityGroupIngress", "AWS::EC2::SecurityGroup"):
            for res in template.find_resources(kind).values():
                text = str(res["Properties"])
                assert "'FromPort': 22" not in text, res
        for res in template.find_resources("AWS::EC2::LaunchTemplate").values():
            assert "KeyName" not in res["Properties"]["LaunchTemplateData"]


def test_stacks_are_environment_agnostic(built: BuiltApp) -> None:
    # No account or region at synth: both resolve at deploy time (no lookups were possible).
    for stack in (built.stacks.network, built.stacks.cluster):
        assert stack.environment == "aws://unknown-account/unknown-region"
        assert cdk.Token.is_unresolved(stack.account)
        assert cdk.Token.is_unresolved(stack.region)
