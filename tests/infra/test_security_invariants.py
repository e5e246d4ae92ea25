"""The security properties of the synthesized stacks, each test named after what it protects.

Asserted on the templates of three specs (the repository's default spec, an EFA spec with
p4d/c5n interfaces, and a spec whose SageMaker role and instance role also read an S3 dataset),
built in-process. Each assertion names the exact resource (by the logical id of the construct that
makes it) and the exact value, so a changed property fails here, not only a missing one.
``tests/infra/security_mutants.py`` breaks each property in a copy of ``infra/`` and checks that a
test below fails; docs/security.md is the prose version of this file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
import yaml
from infra_support import (
    DATASET_URI,
    EFA_SPEC,
    REPO_ROOT,
    SAGEMAKER_SPEC,
    BuiltApp,
    build,
    imported,
    network_ref,
)

from infra.cluster import dataset_location
from training.common.names import (
    SAGEMAKER_JOB_PREFIX,
    SAGEMAKER_SPEC_CHANNEL,
    TAG_CLUSTER,
)

SPECS = {
    "default": (REPO_ROOT / "cluster.toml").read_text(),
    "efa": EFA_SPEC,
    "sagemaker": SAGEMAKER_SPEC,
}

# Resource "*" is allowed only on these actions: the Service Authorization Reference lists no
# resource types for them, so IAM accepts no narrower Resource. Each entry says why the action is
# needed at all; "Scoped by" notes the condition that narrows it where one exists.
SAR = "https://docs.aws.amazon.com/service-authorization/latest/reference/list_"
EC2_DESCRIBE = f"EC2 Describe* actions have no resource types ({SAR}amazonec2.html)"
STAR_RESOURCE_ACTIONS: dict[str, str] = {
    # Image pulls: the registry login token is for the whole registry.
    "ecr:GetAuthorizationToken": f"no resource types ({SAR}amazonelasticcontainerregistry.html)",
    # Peer discovery.
    "ec2:DescribeInstances": EC2_DESCRIBE,
    # A deploy's job priced by its first host (training/costs/deploy_prices.py).
    "ec2:DescribeSpotPriceHistory": EC2_DESCRIBE,
    # Which peers their group is terminating; the data-tier controller's group.
    "autoscaling:DescribeAutoScalingInstances": f"no resource types ({SAR}amazonec2autoscaling"
    ".html)",
    "autoscaling:DescribeAutoScalingGroups": f"no resource types ({SAR}amazonec2autoscaling.html)",
    # The SSM agent's Session Manager channels.
    **{
        f"ssmmessages:{a}": f"no resource types ({SAR}amazonmessagegatewayservice.html)"
        for a in (
            "CreateControlChannel",
            "CreateDataChannel",
            "OpenControlChannel",
            "OpenDataChannel",
        )
    },
    # Optional resource types (instance, managed-instance), none required
    # (list_awssystemsmanager.html); AWS's minimal Session Manager policy grants it on "*"
    # (https://docs.aws.amazon.com/systems-manager/latest/userguide/getting-started-create-iam-instance-profile.html).
    "ssm:UpdateInstanceInformation": "the SSM agent registers its instance; AWS's minimal "
    "Session Manager policy grants it on *",
    # SageMaker job metrics; the cloudwatch:namespace condition scopes it instead.
    "cloudwatch:PutMetricData": f"no resource types ({SAR}amazoncloudwatch.html)",
    # SageMaker placing a job in the cluster subnet.
    "ec2:DescribeNetworkInterfaces": EC2_DESCRIBE,
    "ec2:DescribeVpcs": EC2_DESCRIBE,
    "ec2:DescribeDhcpOptions": EC2_DESCRIBE,
    "ec2:DescribeSubnets": EC2_DESCRIBE,
    "ec2:DescribeSecurityGroups": EC2_DESCRIBE,
}
# The one accepted exception. These ENI actions have resource types in the Service Authorization
# Reference (list_amazonec2.html): CreateNetworkInterface network-interface*, subnet* and
# security-group; CreateNetworkInterfacePermission and DeleteNetworkInterface network-interface*
# (with the ec2:Subnet and ec2:Vpc keys); DeleteNetworkInterfacePermission network-interface
# (optional). SageMaker's documented execution-role policy for training jobs in a VPC grants them
# on "*" (https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-roles.html, "CreateTrainingJob
# API: Execution Role Permissions"): SageMaker creates and deletes the job's interfaces itself.
# Narrowing them to the cluster subnet and security group needs a check against a real SageMaker
# job first; until then only the SageMaker role may hold them.
SAGEMAKER_ENI_ACTIONS = frozenset(
    {
        "ec2:CreateNetworkInterface",
        "ec2:CreateNetworkInterfacePermission",
        "ec2:DeleteNetworkInterface",
        "ec2:DeleteNetworkInterfacePermission",
    }
)

# Documented in infra/instance_group.py: 2 hops, so processes in containers on a bridge network
# reach IMDS as well as the host (the launcher itself runs with --network host).
IMDS_HOP_LIMIT = 2
# Documented in infra/network.py (flow logs, one month) and infra/stacks.py (container logs,
# three months, kept after destroy unless the checkpoints go too).
FLOW_LOG_RETENTION_DAYS = 30
CONTAINER_LOG_RETENTION_DAYS = 90
BOOTSTRAP_TEMPLATE = REPO_ROOT / "node_modules/aws-cdk/lib/api/bootstrap/bootstrap-template.yaml"
PARTITION = {"Ref": "AWS::Partition"}


@pytest.fixture(scope="module", params=sorted(SPECS))
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> BuiltApp:
    return build(tmp_path_factory.mktemp(request.param), SPECS[request.param])


# Helpers -----------------------------------------------------------------------------------------


def _lid(stack: cdk.Stack, construct: Any) -> str:
    child = construct.node.default_child
    assert isinstance(child, cdk.CfnResource)
    return stack.get_logical_id(child)


def _resources(template: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == kind}


def _templates(built: BuiltApp) -> dict[str, dict[str, Any]]:
    return {"network": built.network.to_json(), "cluster": built.cluster.to_json()}


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _canonical(statement: dict[str, Any]) -> str:
    """A statement with Action and Resource as sorted lists, as one comparable string."""
    s = dict(statement)
    s["Action"] = sorted(_as_list(s["Action"]))
    s["Resource"] = sorted(_as_list(s["Resource"]), key=lambda r: json.dumps(r, sort_keys=True))
    return json.dumps(s, sort_keys=True)


def _policy_documents(built: BuiltApp) -> list[tuple[str, dict[str, Any]]]:
    """(where, document) of every policy document in both templates: policies, inline role
    policies, managed policies, bucket policies, role trust policies."""
    docs: list[tuple[str, dict[str, Any]]] = []
    for name, template in _templates(built).items():
        for lid, res in template["Resources"].items():
            props = res.get("Properties", {})
            if "PolicyDocument" in props:
                docs.append((f"{name}/{lid}", props["PolicyDocument"]))
            if "AssumeRolePolicyDocument" in props:
                docs.append((f"{name}/{lid} trust", props["AssumeRolePolicyDocument"]))
            for inline in props.get("Policies", []):
                docs.append((f"{name}/{lid}/{inline['PolicyName']}", inline["PolicyDocument"]))
    return docs


def _role_statements(built: BuiltApp, role: Any) -> list[str]:
    """Canonical statements of every policy attached to ``role`` (CDK puts them in one)."""
    role_lid = _lid(built.stacks.cluster, role)
    template = built.cluster.to_json()
    statements: list[str] = []
    for res in _resources(template, "AWS::IAM::Policy").values():
        if {"Ref": role_lid} in res["Properties"]["Roles"]:
            statements += [_canonical(s) for s in res["Properties"]["PolicyDocument"]["Statement"]]
    assert not template["Resources"][role_lid]["Properties"].get("Policies"), "inline policies"
    return sorted(statements)


def _arn(service: str, resource: str) -> dict[str, Any]:
    return {
        "Fn::Join": [
            "",
            ["arn:", PARTITION, f":{service}:", {"Ref": "AWS::Region"}, ":",
             {"Ref": "AWS::AccountId"}, f":{resource}"],
        ]
    }  # fmt: skip


def _allow(actions: list[str], resource: Any, sid: str | None = None, **extra: Any) -> str:
    statement: dict[str, Any] = {"Action": actions, "Effect": "Allow", "Resource": resource}
    if sid:
        statement["Sid"] = sid
    statement.update(extra)
    return _canonical(statement)


def _common_grants(built: BuiltApp) -> list[str]:
    """What both roles share: pull this cluster's image, use the checkpoint prefix, and read
    the spec's S3 dataset where it has one."""
    cluster = built.stacks.cluster
    bucket_arn = {"Fn::GetAtt": [_lid(cluster, cluster.checkpoints.bucket), "Arn"]}
    repo = _arn(
        "ecr",
        "repository/",
    )
    repo["Fn::Join"][1] += [
        {"Fn::Sub": "cdk-hnb659fds-container-assets-${AWS::AccountId}-${AWS::Region}"}
    ]
    grants = [
        _allow(
            ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"],
            repo,
        ),
        _allow(["ecr:GetAuthorizationToken"], "*"),
        _allow(
            ["s3:AbortMultipartUpload", "s3:DeleteObject", "s3:GetObject", "s3:PutObject"],
            {"Fn::Join": ["", [bucket_arn, "/checkpoints/*"]]},
            "CheckpointObjects",
        ),
        _allow(
            ["s3:ListBucket"],
            bucket_arn,
            "CheckpointListing",
            Condition={"StringLike": {"s3:prefix": ["checkpoints", "checkpoints/*"]}},
        ),
    ]
    if cluster.dataset_uri is not None:
        assert cluster.dataset_uri == DATASET_URI
        bucket, prefix = dataset_location(DATASET_URI)
        dataset_bucket = {"Fn::Join": ["", ["arn:", PARTITION, f":s3:::{bucket}"]]}
        dataset_objects = {"Fn::Join": ["", ["arn:", PARTITION, f":s3:::{bucket}/{prefix}*"]]}
        grants += [
            _allow(["s3:GetObject"], dataset_objects, "DatasetObjects"),
            _allow(
                ["s3:ListBucket"],
                dataset_bucket,
                "DatasetListing",
                Condition={"StringLike": {"s3:prefix": [f"{prefix}*"]}},
            ),
        ]
    return grants


def _flow_log_role(network: Any) -> Any:
    """The role CDK makes for the VPC's flow log (``vpc.add_flow_log("FlowLog")``)."""
    flow_log = network.vpc.node.try_find_child("FlowLog")
    assert flow_log is not None, "the VPC has no flow log"
    return flow_log.node.find_child("IAMRole")


def _launch_templates(built: BuiltApp) -> dict[str, dict[str, Any]]:
    """Every launch template of every fleet, by logical id; and no launch template else."""
    cluster = built.stacks.cluster
    ours = {
        _lid(cluster, template)
        for fleet in cluster.fleets.values()
        for template in fleet.launch_templates.values()
    }
    found = _resources(built.cluster.to_json(), "AWS::EC2::LaunchTemplate")
    assert set(found) == ours
    return {lid: found[lid]["Properties"]["LaunchTemplateData"] for lid in sorted(ours)}


# Launch templates --------------------------------------------------------------------------------


def test_launch_templates_require_imdsv2_session_tokens(built: BuiltApp) -> None:
    """IMDSv1 (no token) is off: a request forged through an SSRF cannot read the role's
    credentials from the metadata service."""
    for lid, data in _launch_templates(built).items():
        assert data["MetadataOptions"]["HttpTokens"] == "required", lid
        # Not disabled either: the launcher reads its tags and Spot notices from IMDS.
        assert data["MetadataOptions"].get("HttpEndpoint", "enabled") == "enabled", lid


def test_launch_templates_limit_imds_to_two_hops(built: BuiltApp) -> None:
    for lid, data in _launch_templates(built).items():
        assert data["MetadataOptions"]["HttpPutResponseHopLimit"] == IMDS_HOP_LIMIT, lid


def test_launch_templates_enable_instance_metadata_tags(built: BuiltApp) -> None:
    for lid, data in _launch_templates(built).items():
        assert data["MetadataOptions"]["InstanceMetadataTags"] == "enabled", lid


def test_launch_templates_encrypt_every_block_device(built: BuiltApp) -> None:
    for lid, data in _launch_templates(built).items():
        devices = data["BlockDeviceMappings"]
        assert [d["DeviceName"] for d in devices] == ["/dev/xvda"], lid
        for device in devices:
            assert device["Ebs"]["Encrypted"] is True, (lid, device)


def test_instances_get_no_public_ip(built: BuiltApp) -> None:
    """No interface asks for a public address, and the one subnet never assigns one."""
    for lid, data in _launch_templates(built).items():
        for interface in data.get("NetworkInterfaces", []):
            assert interface.get("AssociatePublicIpAddress", False) is False, (lid, interface)
    network = built.stacks.network.network
    subnet_lid = _lid(built.stacks.network, network.subnet)
    subnet = built.network.to_json()["Resources"][subnet_lid]["Properties"]
    assert subnet["MapPublicIpOnLaunch"] is False
    for asg in _resources(built.cluster.to_json(), "AWS::AutoScaling::AutoScalingGroup").values():
        zones = asg["Properties"]["VPCZoneIdentifier"]
        assert [imported(built, z) for z in zones] == [{"Ref": subnet_lid}]


def test_instances_carry_only_the_cluster_security_group(built: BuiltApp) -> None:
    cluster_sg = network_ref(built, built.stacks.network.network.cluster_security_group, "GroupId")
    for lid, data in _launch_templates(built).items():
        interfaces = data.get("NetworkInterfaces")
        groups = [g for i in interfaces for g in i["Groups"]] if interfaces else None
        groups = groups or data["SecurityGroupIds"]
        assert {json.dumps(imported(built, g)) for g in groups} == {json.dumps(cluster_sg)}, lid


# Checkpoint bucket -------------------------------------------------------------------------------


def _bucket(built: BuiltApp) -> tuple[str, dict[str, Any]]:
    cluster = built.stacks.cluster
    lid = _lid(cluster, cluster.checkpoints.bucket)
    buckets = _resources(built.cluster.to_json(), "AWS::S3::Bucket")
    assert set(buckets) == {lid}, "the checkpoint bucket is the only bucket"
    assert not _resources(built.network.to_json(), "AWS::S3::Bucket")
    return lid, buckets[lid]


def test_checkpoint_bucket_refuses_requests_without_tls(built: BuiltApp) -> None:
    lid, _ = _bucket(built)
    policies = _resources(built.cluster.to_json(), "AWS::S3::BucketPolicy")
    [policy] = [p for p in policies.values() if p["Properties"]["Bucket"] == {"Ref": lid}]
    arn = {"Fn::GetAtt": [lid, "Arn"]}
    assert policy["Properties"]["PolicyDocument"]["Statement"] == [
        {
            "Action": "s3:*",
            "Condition": {"Bool": {"aws:SecureTransport": "false"}},
            "Effect": "Deny",
            "Principal": {"AWS": "*"},
            "Resource": [arn, {"Fn::Join": ["", [arn, "/*"]]}],
        }
    ]


def test_checkpoint_bucket_blocks_all_public_access(built: BuiltApp) -> None:
    _, bucket = _bucket(built)
    assert bucket["Properties"]["PublicAccessBlockConfiguration"] == {
        "BlockPublicAcls": True,
        "BlockPublicPolicy": True,
        "IgnorePublicAcls": True,
        "RestrictPublicBuckets": True,
    }
    # ACLs disabled: access is decided by IAM and the bucket policy only.
    assert bucket["Properties"]["OwnershipControls"] == {
        "Rules": [{"ObjectOwnership": "BucketOwnerEnforced"}]
    }


def test_checkpoint_bucket_keeps_versions_of_overwritten_checkpoints(built: BuiltApp) -> None:
    _, bucket = _bucket(built)
    assert bucket["Properties"]["VersioningConfiguration"] == {"Status": "Enabled"}
    # Old versions are kept 30 days, then expire (documented in infra/cluster.py).
    assert bucket["Properties"]["LifecycleConfiguration"] == {
        "Rules": [
            {
                "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 7},
                "Id": "expire-old-checkpoint-versions",
                "NoncurrentVersionExpiration": {"NoncurrentDays": 30},
                "Status": "Enabled",
            }
        ]
    }


def test_checkpoint_bucket_encrypts_at_rest_with_s3_managed_keys(built: BuiltApp) -> None:
    """SSE-S3 (AES256), decided over SSE-KMS: no key policy to manage or per-request KMS cost;
    both roles are the only principals that may read the objects anyway."""
    _, bucket = _bucket(built)
    assert bucket["Properties"]["BucketEncryption"] == {
        "ServerSideEncryptionConfiguration": [
            {"ServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}
        ]
    }


def test_checkpoint_bucket_is_retained_on_destroy(built: BuiltApp) -> None:
    _, bucket = _bucket(built)
    assert (bucket["DeletionPolicy"], bucket["UpdateReplacePolicy"]) == ("Retain", "Retain")


def test_checkpoint_bucket_goes_only_when_asked(tmp_path: Path) -> None:
    """``destroy_checkpoints``: the documented opt-in that deletes bucket and container logs."""
    gone = build(tmp_path, SPECS["default"], destroy_checkpoints=True)
    _, bucket = _bucket(gone)
    assert (bucket["DeletionPolicy"], bucket["UpdateReplacePolicy"]) == ("Delete", "Delete")


# Logs ---------------------------------------------------------------------------------------------


def _log_groups(built: BuiltApp) -> dict[str, dict[str, Any]]:
    """Every log group of both stacks by logical id: the flow logs' and the containers'."""
    flow = _lid(built.stacks.network, built.stacks.network.network.flow_log_group)
    containers = _lid(built.stacks.cluster, built.stacks.cluster.log_group)
    network = _resources(built.network.to_json(), "AWS::Logs::LogGroup")
    cluster = _resources(built.cluster.to_json(), "AWS::Logs::LogGroup")
    assert (set(network), set(cluster)) == ({flow}, {containers})
    return {"flow": network[flow], "containers": cluster[containers]}


def test_log_groups_expire_their_events(built: BuiltApp) -> None:
    groups = _log_groups(built)
    assert groups["flow"]["Properties"]["RetentionInDays"] == FLOW_LOG_RETENTION_DAYS
    assert groups["containers"]["Properties"]["RetentionInDays"] == CONTAINER_LOG_RETENTION_DAYS
    # Flow logs go with the network stack; a job's container logs stay after destroy.
    assert groups["flow"]["DeletionPolicy"] == "Delete"
    assert groups["containers"]["DeletionPolicy"] == "Retain"


def test_log_groups_use_cloudwatch_logs_default_encryption(built: BuiltApp) -> None:
    """The KMS decision: no customer managed key. CloudWatch Logs always encrypts log data at
    rest (https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/encrypt-log-data-kms.html);
    a key of our own would add a key policy and a per-call KMS cost, and every reader of these
    logs is in the same account."""
    for name, group in _log_groups(built).items():
        assert "KmsKeyId" not in group["Properties"], name


# Security groups ----------------------------------------------------------------------------------


def _ingress_rules(built: BuiltApp) -> list[tuple[str, dict[str, Any]]]:
    """Every ingress rule of both stacks: inline ones and standalone resources."""
    rules: list[tuple[str, dict[str, Any]]] = []
    for name, template in _templates(built).items():
        for lid, res in template["Resources"].items():
            if res["Type"] == "AWS::EC2::SecurityGroup":
                inline = res["Properties"].get("SecurityGroupIngress", [])
                rules += [(f"{name}/{lid}", r) for r in inline]
            elif res["Type"] == "AWS::EC2::SecurityGroupIngress":
                rules.append((f"{name}/{lid}", res["Properties"]))
    return rules


def test_no_ingress_from_any_address_range(built: BuiltApp) -> None:
    """Nothing is reachable from an IP range (0.0.0.0/0, the VPC CIDR or any other): every
    ingress rule names a security group as its source."""
    for where, rule in _ingress_rules(built):
        assert not {"CidrIp", "CidrIpv6", "SourcePrefixListId"} & set(rule), (where, rule)
        assert "SourceSecurityGroupId" in rule, (where, rule)


def test_only_cluster_members_reach_the_cluster_and_its_endpoints(built: BuiltApp) -> None:
    """Exactly two ingress rules: the cluster group from itself (all traffic: EFA, NCCL, the data
    plane's gRPC port), and the endpoint group from the cluster group (HTTPS)."""
    network = built.stacks.network.network
    cluster_sg = network_ref(built, network.cluster_security_group, "GroupId")
    endpoint_sg = network_ref(built, network.endpoint_security_group, "GroupId")
    rules = sorted((json.dumps(r, sort_keys=True) for _, r in _ingress_rules(built)))
    expected = [
        {
            "Description": "all traffic from the cluster",
            "GroupId": cluster_sg,
            "IpProtocol": "-1",
            "SourceSecurityGroupId": cluster_sg,
        },
        {
            "Description": "HTTPS from cluster instances",
            "FromPort": 443,
            "GroupId": endpoint_sg,
            "IpProtocol": "tcp",
            "SourceSecurityGroupId": cluster_sg,
            "ToPort": 443,
        },
    ]
    assert rules == sorted(json.dumps(r, sort_keys=True) for r in expected)


def test_egress_is_the_cluster_and_https_only(built: BuiltApp) -> None:
    """The cluster group sends to itself (all traffic) and HTTPS out, which the isolated subnet
    routes only to the endpoints and the S3 gateway; the endpoint group sends nothing (CDK's
    placeholder rule that matches no traffic)."""
    network = built.stacks.network.network
    template = built.network.to_json()
    cluster_lid = _lid(built.stacks.network, network.cluster_security_group)
    endpoint_lid = _lid(built.stacks.network, network.endpoint_security_group)
    groups = _resources(template, "AWS::EC2::SecurityGroup")
    assert set(groups) == {cluster_lid, endpoint_lid}
    assert not _resources(built.cluster.to_json(), "AWS::EC2::SecurityGroup")
    assert groups[cluster_lid]["Properties"]["SecurityGroupEgress"] == [
        {
            "CidrIp": "0.0.0.0/0",
            "Description": "HTTPS to VPC endpoints and the S3 gateway",
            "FromPort": 443,
            "IpProtocol": "tcp",
            "ToPort": 443,
        }
    ]
    assert groups[endpoint_lid]["Properties"]["SecurityGroupEgress"] == [
        {
            "CidrIp": "255.255.255.255/32",
            "Description": "Disallow all traffic",
            "FromPort": 252,
            "IpProtocol": "icmp",
            "ToPort": 86,
        }
    ]
    cluster_sg = {"Fn::GetAtt": [cluster_lid, "GroupId"]}
    egress_rules = _resources(template, "AWS::EC2::SecurityGroupEgress").values()
    egress = [r["Properties"] for r in egress_rules]
    assert egress == [
        {
            "Description": "all traffic to the cluster",
            "DestinationSecurityGroupId": cluster_sg,
            "GroupId": cluster_sg,
            "IpProtocol": "-1",
        }
    ]
    assert not _resources(built.cluster.to_json(), "AWS::EC2::SecurityGroupEgress")


def test_interface_endpoints_admit_only_the_endpoint_group(built: BuiltApp) -> None:
    network = built.stacks.network.network
    endpoint_sg = network_ref(built, network.endpoint_security_group, "GroupId")
    endpoints = _resources(built.network.to_json(), "AWS::EC2::VPCEndpoint")
    interfaces = [
        e for e in endpoints.values() if e["Properties"]["VpcEndpointType"] == "Interface"
    ]
    assert len(interfaces) == len(network.endpoints)
    for endpoint in interfaces:
        assert endpoint["Properties"]["SecurityGroupIds"] == [endpoint_sg]
        assert endpoint["Properties"]["PrivateDnsEnabled"] is True
    # No endpoint policy on any endpoint (the S3 gateway included): AWS's default applies.
    for endpoint in endpoints.values():
        assert "PolicyDocument" not in endpoint["Properties"]


# IAM ----------------------------------------------------------------------------------------------


def test_no_policy_allows_a_wildcard_action(built: BuiltApp) -> None:
    """No "*", "service:*" or "service:Prefix*" action in any Allow, and no NotAction or
    NotResource (which allow everything else) anywhere."""
    for where, doc in _policy_documents(built):
        for statement in doc["Statement"]:
            assert not {"NotAction", "NotResource", "NotPrincipal"} & set(statement), where
            if statement["Effect"] == "Allow":
                for action in _as_list(statement["Action"]):
                    assert "*" not in action, (where, action)


def test_resource_star_only_on_actions_without_resource_level_permissions(
    built: BuiltApp,
) -> None:
    sagemaker_role = {"Ref": _lid(built.stacks.cluster, built.stacks.cluster.sagemaker_role.role)}
    for where, doc in _policy_documents(built):
        attached = built.cluster.to_json()["Resources"].get(where.partition("/")[2], {})
        roles = attached.get("Properties", {}).get("Roles", [])
        for statement in doc["Statement"]:
            if statement["Effect"] != "Allow" or "Resource" not in statement:
                continue
            resources = _as_list(statement["Resource"])
            if "*" not in resources:
                # Scoped: no bare service-wide ARN such as arn:aws:s3:::* either.
                for resource in resources:
                    assert not (isinstance(resource, str) and resource.endswith(":*")), where
                continue
            assert resources == ["*"], where
            actions = set(_as_list(statement["Action"]))
            allowed = set(STAR_RESOURCE_ACTIONS)
            if where.startswith("cluster/") and roles == [sagemaker_role]:
                allowed |= SAGEMAKER_ENI_ACTIONS
            assert actions <= allowed, (where, sorted(actions - allowed))


def test_instance_role_may_do_only_what_the_launcher_needs(built: BuiltApp) -> None:
    cluster = built.stacks.cluster
    spec_name = cluster.node.id.removesuffix("-cluster")
    asg_names = sorted(fleet.asg_name for fleet in cluster.fleets.values())
    job_parameter = _lid(cluster, cluster.job.parameter)
    expected = [
        *_common_grants(built),
        _allow(
            ["logs:CreateLogStream", "logs:PutLogEvents"],
            {"Fn::GetAtt": [_lid(cluster, cluster.log_group), "Arn"]},
        ),
        _allow(
            [
                "autoscaling:DescribeAutoScalingGroups",
                "autoscaling:DescribeAutoScalingInstances",
                "ec2:DescribeInstances",
            ],
            "*",
            "PeerDiscovery",
        ),
        _allow(["ec2:DescribeSpotPriceHistory"], "*", "SpotPrices"),
        _allow(
            [
                "ssm:UpdateInstanceInformation",
                "ssmmessages:CreateControlChannel",
                "ssmmessages:CreateDataChannel",
                "ssmmessages:OpenControlChannel",
                "ssmmessages:OpenDataChannel",
            ],
            "*",
            "SessionManager",
        ),
        _allow(
            [
                "autoscaling:CompleteLifecycleAction",
                "autoscaling:DeleteScheduledAction",
                "autoscaling:PutScheduledUpdateGroupAction",
                "autoscaling:SetDesiredCapacity",
                "autoscaling:SetInstanceHealth",
                "autoscaling:TerminateInstanceInAutoScalingGroup",
                "autoscaling:UpdateAutoScalingGroup",
            ],
            [
                _arn("autoscaling", f"autoScalingGroup:*:autoScalingGroupName/{n}")
                for n in asg_names
            ],
            "ScaleOwnGroupsToZero",
            Condition={"StringEquals": {f"aws:ResourceTag/{TAG_CLUSTER}": spec_name}},
        ),
        _allow(
            ["ssm:GetParameter"],
            {"Fn::Join": ["", [*_arn("ssm", "parameter")["Fn::Join"][1], {"Ref": job_parameter}]]},
            "ReadJobPointer",
        ),
    ]
    assert _role_statements(built, cluster.instance_role.role) == sorted(expected)
    role = built.cluster.to_json()["Resources"][_lid(cluster, cluster.instance_role.role)]
    assert role["Properties"]["AssumeRolePolicyDocument"]["Statement"] == [
        {
            "Action": "sts:AssumeRole",
            "Effect": "Allow",
            "Principal": {"Service": "ec2.amazonaws.com"},
        }
    ]
    # No managed policy: AmazonSSMManagedInstanceCore would also allow ssm:GetParameter(s) on
    # every parameter of the account.
    assert "ManagedPolicyArns" not in role["Properties"]


def test_sagemaker_role_is_as_narrow_as_the_job(built: BuiltApp) -> None:
    cluster = built.stacks.cluster
    bucket_arn = {"Fn::GetAtt": [_lid(cluster, cluster.checkpoints.bucket), "Arn"]}
    job = SAGEMAKER_JOB_PREFIX
    expected = [
        *_common_grants(built),
        _allow(
            ["s3:PutObject"],
            {"Fn::Join": ["", [bucket_arn, f"/{job}/*"]]},
            "SageMakerJobOutput",
        ),
        _allow(
            ["s3:GetObject"],
            {"Fn::Join": ["", [bucket_arn, f"/{job}/*/{SAGEMAKER_SPEC_CHANNEL}/*"]]},
            "SageMakerJobSpec",
        ),
        _allow(
            ["s3:ListBucket"],
            bucket_arn,
            "SageMakerJobListing",
            Condition={"StringLike": {"s3:prefix": [job, f"{job}/*"]}},
        ),
        _allow(
            [
                "logs:CreateLogGroup",
                "logs:CreateLogStream",
                "logs:DescribeLogStreams",
                "logs:PutLogEvents",
            ],
            _arn("logs", "log-group:/aws/sagemaker/TrainingJobs:*"),
            "TrainingJobLogs",
        ),
        _allow(
            ["cloudwatch:PutMetricData"],
            "*",
            "SageMakerJobMetrics",
            Condition={
                "StringEquals": {
                    # SageMaker's alone: the trainer's metrics are EMF log events.
                    "cloudwatch:namespace": ["/aws/sagemaker/TrainingJobs"]
                }
            },
        ),
        _allow(
            sorted(
                SAGEMAKER_ENI_ACTIONS
                | {
                    "ec2:DescribeDhcpOptions",
                    "ec2:DescribeNetworkInterfaces",
                    "ec2:DescribeSecurityGroups",
                    "ec2:DescribeSubnets",
                    "ec2:DescribeVpcs",
                }
            ),
            "*",
            "VpcNetworkInterfaces",
        ),
    ]
    assert _role_statements(built, cluster.sagemaker_role.role) == sorted(expected)
    role = built.cluster.to_json()["Resources"][_lid(cluster, cluster.sagemaker_role.role)]
    assert role["Properties"]["AssumeRolePolicyDocument"]["Statement"] == [
        {
            "Action": "sts:AssumeRole",
            "Effect": "Allow",
            "Principal": {"Service": "sagemaker.amazonaws.com"},
        }
    ]
    assert "ManagedPolicyArns" not in role["Properties"]  # no AmazonSageMakerFullAccess


def test_only_the_stacks_own_roles_exist(built: BuiltApp) -> None:
    """Three roles (instances, SageMaker, flow logs), no users, groups or managed policies."""
    cluster, network = built.stacks.cluster, built.stacks.network.network
    roles = {
        "cluster": {
            _lid(cluster, cluster.instance_role.role),
            _lid(cluster, cluster.sagemaker_role.role),
        },
        "network": {_lid(built.stacks.network, _flow_log_role(network))},
    }
    for name, template in _templates(built).items():
        assert set(_resources(template, "AWS::IAM::Role")) == roles[name], name
        for kind in ("AWS::IAM::User", "AWS::IAM::Group", "AWS::IAM::ManagedPolicy"):
            assert not _resources(template, kind), (name, kind)


def test_flow_log_role_writes_only_the_flow_log_group(built: BuiltApp) -> None:
    flow = _lid(built.stacks.network, built.stacks.network.network.flow_log_group)
    policies = _resources(built.network.to_json(), "AWS::IAM::Policy")
    statements = [
        s for p in policies.values() for s in p["Properties"]["PolicyDocument"]["Statement"]
    ]
    assert statements == [
        {
            "Action": ["logs:CreateLogStream", "logs:DescribeLogStreams", "logs:PutLogEvents"],
            "Effect": "Allow",
            "Resource": {"Fn::GetAtt": [flow, "Arn"]},
        }
    ]


# ECR ----------------------------------------------------------------------------------------------


def test_no_own_image_repository_without_scan_on_push(built: BuiltApp) -> None:
    """The image goes to the CDK bootstrap's repository (not the project's own: cdk bootstrap
    creates it and every CDK app of the account and region shares it), so the stacks define
    none; one added later must scan on push."""
    for name, template in _templates(built).items():
        for lid, repo in _resources(template, "AWS::ECR::Repository").items():
            scanning = repo["Properties"].get("ImageScanningConfiguration", {})
            assert scanning.get("ScanOnPush") is True, (name, lid)
        assert not _resources(template, "AWS::ECR::Repository"), name


def test_image_repository_keeps_tags_immutable() -> None:
    """The pinned CDK CLI's bootstrap repository: a pushed tag (the asset's content hash) can
    never be pointed at other image bytes."""
    bootstrap = yaml.load(BOOTSTRAP_TEMPLATE.read_text(), Loader=_CfnLoader)
    repository = bootstrap["Resources"]["ContainerAssetsRepository"]
    assert repository["Type"] == "AWS::ECR::Repository"
    assert repository["Properties"]["ImageTagMutability"] == "IMMUTABLE"


class _CfnLoader(yaml.SafeLoader):
    """SafeLoader that reads CloudFormation's short tags (!Sub, !If, ...) as plain values."""


_CfnLoader.add_multi_constructor(
    "!",
    lambda loader, suffix, node: (
        loader.construct_scalar(node)
        if isinstance(node, yaml.ScalarNode)
        else loader.construct_sequence(node)
        if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node)
    ),
)


# VPC ----------------------------------------------------------------------------------------------


def test_vpc_has_no_route_to_the_internet(built: BuiltApp) -> None:
    """No internet or NAT gateway (the spec has no option that asks for one), no public
    addresses, peering or transit attachment, and no route beyond the VPC's own: the S3 gateway
    endpoint adds its prefix-list route itself."""
    for name, template in _templates(built).items():
        for kind in (
            "AWS::EC2::InternetGateway",
            "AWS::EC2::EgressOnlyInternetGateway",
            "AWS::EC2::VPCGatewayAttachment",
            "AWS::EC2::NatGateway",
            "AWS::EC2::EIP",
            "AWS::EC2::Route",
            "AWS::EC2::VPCPeeringConnection",
            "AWS::EC2::TransitGatewayAttachment",
            "AWS::EC2::VPNGateway",
        ):
            assert not _resources(template, kind), (name, kind)
    subnets = _resources(built.network.to_json(), "AWS::EC2::Subnet")
    assert list(subnets) == [_lid(built.stacks.network, built.stacks.network.network.subnet)]


def test_vpc_flow_logs_record_all_traffic(built: BuiltApp) -> None:
    network = built.stacks.network.network
    stack = built.stacks.network
    flow_logs = _resources(built.network.to_json(), "AWS::EC2::FlowLog")
    assert len(flow_logs) == 1, "one flow log, on the VPC"
    [flow_log] = flow_logs.values()
    role = _flow_log_role(network)
    props = dict(flow_log["Properties"])
    props.pop("Tags")
    assert props == {
        "DeliverLogsPermissionArn": {"Fn::GetAtt": [_lid(stack, role), "Arn"]},
        "LogDestinationType": "cloud-watch-logs",
        "LogGroupName": {"Ref": _lid(stack, network.flow_log_group)},
        "ResourceId": {"Ref": _lid(stack, network.vpc)},
        "ResourceType": "VPC",
        "TrafficType": "ALL",
    }
