"""The cluster stack: image, bucket, roles, and one fleet per instance group (with its own
cluster placement group where the group uses one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Match
from infra_support import (
    EFA_SPEC,
    ELASTIC_SPEC,
    MIXED_EFA_SPEC,
    SPOT_SPEC,
    BuiltApp,
    build,
    imported,
    network_ref,
)

from training.common.names import (
    CHECKPOINT_PREFIX,
    DEPLOYED_SPEC_PATH,
    ENV_ASG_NAMES,
    ENV_CHECKPOINT_URI,
    ENV_CLUSTER,
    ENV_GROUP,
    ENV_LIFECYCLE_HOOK,
    ENV_REGION,
    ENV_SPEC,
    LIFECYCLE_HOOK_NAME,
    TAG_CLUSTER,
    TAG_GROUP,
    TAG_ROLE,
    asg_name,
)

# Actions that support no resource-level permissions (AWS requires Resource "*").
STAR_ONLY_ACTIONS = {
    "ecr:GetAuthorizationToken",
    "ec2:DescribeInstances",
    "ec2:DescribeSpotPriceHistory",
    "autoscaling:DescribeAutoScalingInstances",
    "autoscaling:DescribeAutoScalingGroups",
    # The SSM agent's Session Manager actions (UpdateInstanceInformation's resource types are
    # optional; AWS's minimal Session Manager policy grants it on "*").
    "ssm:UpdateInstanceInformation",
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
    "cloudwatch:PutMetricData",
    "ec2:CreateNetworkInterface",
    "ec2:CreateNetworkInterfacePermission",
    "ec2:DeleteNetworkInterface",
    "ec2:DeleteNetworkInterfacePermission",
    "ec2:DescribeNetworkInterfaces",
    "ec2:DescribeVpcs",
    "ec2:DescribeDhcpOptions",
    "ec2:DescribeSubnets",
    "ec2:DescribeSecurityGroups",
}


@pytest.fixture(scope="module")
def spot(tmp_path_factory: pytest.TempPathFactory) -> BuiltApp:
    return build(tmp_path_factory.mktemp("spot"), SPOT_SPEC)


@pytest.fixture(scope="module")
def efa(tmp_path_factory: pytest.TempPathFactory) -> BuiltApp:
    return build(tmp_path_factory.mktemp("efa"), EFA_SPEC)


def _launch_template_data(built: BuiltApp, group: str) -> dict[str, Any]:
    fleet = built.stacks.cluster.fleets[group]
    cfn = fleet.launch_template.node.default_child
    assert isinstance(cfn, cdk.CfnResource)
    lid = built.stacks.cluster.get_logical_id(cfn)
    res = built.cluster.find_resources("AWS::EC2::LaunchTemplate")[lid]
    return dict(res["Properties"]["LaunchTemplateData"])


def _asg(built: BuiltApp, group: str) -> dict[str, Any]:
    name = asg_name(built.stacks.cluster.stack_name.removesuffix("-cluster"), group)
    found = built.cluster.find_resources(
        "AWS::AutoScaling::AutoScalingGroup", {"Properties": {"AutoScalingGroupName": name}}
    )
    assert len(found) == 1, f"no Auto Scaling group named {name}"
    return dict(next(iter(found.values()))["Properties"])


def _user_data(built: BuiltApp, group: str) -> str:
    raw = _launch_template_data(built, group)["UserData"]["Fn::Base64"]
    if isinstance(raw, str):
        return raw
    # Fn::Join of literal pieces and tokens (image URI, region): keep the literals.
    return "".join(p if isinstance(p, str) else json.dumps(p) for p in raw["Fn::Join"][1])


def _ssm_parameter_default(built: BuiltApp, image_id: dict[str, str]) -> str:
    params = built.cluster.to_json()["Parameters"]
    param = params[image_id["Ref"]]
    assert param["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"
    return str(param["Default"])


# ----------------------------------------------------------------------------- placement


def _placement(built: BuiltApp, group: str) -> object:
    """The Placement of the group's launch template(s), one value for all of them (None where
    absent)."""
    fleet = built.stacks.cluster.fleets[group]
    found = []
    for template in fleet.launch_templates.values():
        cfn = template.node.default_child
        assert isinstance(cfn, cdk.CfnResource)
        lid = built.stacks.cluster.get_logical_id(cfn)
        res = built.cluster.find_resources("AWS::EC2::LaunchTemplate")[lid]
        found.append(res["Properties"]["LaunchTemplateData"].get("Placement"))
    assert all(f == found[0] for f in found), found
    return found[0]


def _own_placement_group(built: BuiltApp, group: str) -> dict[str, Any]:
    """``{"GroupName": GetAtt}`` of the group's own cluster placement group."""
    pg = built.stacks.cluster.fleets[group].placement_group
    assert pg is not None, group
    cfn = pg.node.default_child
    assert isinstance(cfn, cdk.CfnResource)
    lid = built.stacks.cluster.get_logical_id(cfn)
    res = built.cluster.find_resources("AWS::EC2::PlacementGroup")[lid]
    assert res["Properties"]["Strategy"] == "cluster"
    return {"GroupName": {"Fn::GetAtt": [lid, "GroupName"]}}


def test_placement_groups_only_where_they_pay_one_per_group(spot: BuiltApp, efa: BuiltApp) -> None:
    # Spot spec: 2 trainers (cluster by default), 1 dataprep without EFA (none by default).
    assert len(spot.cluster.find_resources("AWS::EC2::PlacementGroup")) == 1
    assert _placement(spot, "trainer") == _own_placement_group(spot, "trainer")
    assert spot.stacks.cluster.fleets["dataprep"].placement_group is None
    assert _placement(spot, "dataprep") is None
    # EFA spec: both groups use EFA, so both get one, each its own (AWS: one instance type per
    # cluster placement group), never a shared one.
    assert len(efa.cluster.find_resources("AWS::EC2::PlacementGroup")) == 2
    gpu, cpu = (_own_placement_group(efa, g) for g in ("gpu", "cpu"))
    assert gpu != cpu
    assert (_placement(efa, "gpu"), _placement(efa, "cpu")) == (gpu, cpu)
    # Placement goes through the launch template only; the groups name none themselves.
    for built in (spot, efa):
        for group in built.stacks.cluster.fleets:
            assert "PlacementGroup" not in _asg(built, group), group


def test_the_spec_placement_setting_overrides_the_default(tmp_path: Path) -> None:
    spec = SPOT_SPEC.replace("count = 2\n", 'count = 2\nplacement = "none"\n').replace(
        'efa = "off"', 'efa = "off"\nplacement = "cluster"'
    )
    assert spec.count("placement") == 2
    built = build(tmp_path, spec)
    assert len(built.cluster.find_resources("AWS::EC2::PlacementGroup")) == 1
    assert built.stacks.cluster.fleets["trainer"].placement_group is None
    assert _placement(built, "trainer") is None
    dataprep = _own_placement_group(built, "dataprep")
    assert _placement(built, "dataprep") == dataprep
    assert built.cluster.to_json()["Outputs"]["PlacementGroupNames"]["Value"] == {
        "Fn::Join": ["", ["dataprep=", dataprep["GroupName"]]]
    }


def test_no_placement_group_where_no_group_uses_one(tmp_path: Path) -> None:
    # One trainer instance without EFA and a dataprep group: neither gains from one.
    built = build(tmp_path, SPOT_SPEC.replace("count = 2\n", "count = 1\n"))
    assert built.cluster.find_resources("AWS::EC2::PlacementGroup") == {}
    for group in ("trainer", "dataprep"):
        assert _placement(built, group) is None, group
    assert built.cluster.to_json()["Outputs"]["PlacementGroupNames"]["Value"] == "none"


def test_groups_launch_in_the_one_cluster_subnet_of_the_spec_az(spot: BuiltApp) -> None:
    network = spot.stacks.network.network
    subnet = network_ref(spot, network.subnet)
    for group in ("trainer", "dataprep"):
        subnets = _asg(spot, group)["VPCZoneIdentifier"]
        assert [imported(spot, s) for s in subnets] == [subnet], group
    # That subnet is in the AZ the spec chose (index 1): every group's instances go there, with
    # a placement group or without.
    lid = subnet["Ref"]  # type: ignore[index]
    az = spot.network.to_json()["Resources"][lid]["Properties"]["AvailabilityZone"]
    assert az == {"Fn::Select": [1, {"Fn::GetAZs": ""}]}


# ----------------------------------------------------------------------------- launch template


def test_launch_templates_require_imdsv2_and_expose_tags(spot: BuiltApp, efa: BuiltApp) -> None:
    for built in (spot, efa):
        for group in built.stacks.cluster.fleets:
            meta = _launch_template_data(built, group)["MetadataOptions"]
            assert meta["HttpTokens"] == "required", group
            assert meta["InstanceMetadataTags"] == "enabled", group


def test_an_os_shutdown_terminates_the_instance(spot: BuiltApp, efa: BuiltApp) -> None:
    """The boot's give-up point is ``shutdown -h now`` (no AWS CLI on the dataprep AMI): with
    InstanceInitiatedShutdownBehavior terminate the instance terminates (the default, stop, would
    leave it stopped in its group) and the Auto Scaling group replaces it. Every template of every
    group, EFA layouts included."""
    for built in (spot, efa):
        templates = built.cluster.find_resources("AWS::EC2::LaunchTemplate")
        assert templates
        for lid, res in templates.items():
            data = res["Properties"]["LaunchTemplateData"]
            assert data["InstanceInitiatedShutdownBehavior"] == "terminate", lid


def test_root_volume_encrypted_and_sized_by_role(spot: BuiltApp) -> None:
    sizes = {}
    for group in ("trainer", "dataprep"):
        mappings = _launch_template_data(spot, group)["BlockDeviceMappings"]
        assert len(mappings) == 1
        ebs = mappings[0]["Ebs"]
        assert ebs["Encrypted"] is True
        assert ebs["VolumeType"] == "gp3"
        sizes[group] = ebs["VolumeSize"]
    assert sizes["trainer"] >= 100 and sizes["dataprep"] >= 50


def test_the_dataprep_root_volume_holds_the_shard_cache_the_spec_asks_for(
    spot: BuiltApp, tmp_path: Path
) -> None:
    """The shard cache lives on the dataprep root volume: with `cache_gb` the volume grows by
    that much (GB to GiB, rounded up); the trainers' and a spec without a cache keep theirs."""
    text = SPOT_SPEC.replace(
        "[job]\nsteps = 100\n",
        '[job]\nsteps = 100\n[job.dataset]\nsource = "shards"\npath = "s3://d/imagenet/"\n'
        "cache_gb = 150\n",
    )
    assert text != SPOT_SPEC
    built = build(tmp_path, text)

    def sizes(b: BuiltApp) -> dict[str, int]:
        return {
            g: _launch_template_data(b, g)["BlockDeviceMappings"][0]["Ebs"]["VolumeSize"]
            for g in ("trainer", "dataprep")
        }

    assert sizes(spot) == {"trainer": 200, "dataprep": 100}
    assert sizes(built) == {"trainer": 200, "dataprep": 100 + 140}  # 150 GB = 139.7 GiB


def test_amis_come_from_public_ssm_parameters(spot: BuiltApp) -> None:
    trainer = _launch_template_data(spot, "trainer")["ImageId"]
    dataprep = _launch_template_data(spot, "dataprep")["ImageId"]
    # The public parameters AWS documents, written out (not the module's own constants): the
    # DLAMI's for GPU hosts, the ECS-optimised AL2023 AMI's for dataprep. A name AWS does not
    # publish would fail at deploy; `hetero preflight` checks they resolve in the account.
    # https://docs.aws.amazon.com/dlami/latest/devguide/find-dlami-id.html
    # https://docs.aws.amazon.com/AmazonECS/latest/developerguide/retrieve-ecs-optimized_AMI.html
    assert _ssm_parameter_default(spot, trainer) == (
        "/aws/service/deeplearning/ami/x86_64/"
        "base-oss-nvidia-driver-gpu-amazon-linux-2023/latest/ami-id"
    )
    assert _ssm_parameter_default(spot, dataprep) == (
        "/aws/service/ecs/optimized-ami/amazon-linux-2023/recommended/image_id"
    )


def test_non_efa_groups_carry_the_cluster_security_group(spot: BuiltApp) -> None:
    cluster_sg = network_ref(spot, spot.stacks.network.network.cluster_security_group, "GroupId")
    for group in ("trainer", "dataprep"):
        data = _launch_template_data(spot, group)
        assert "NetworkInterfaces" not in data
        assert [imported(spot, g) for g in data["SecurityGroupIds"]] == [cluster_sg], group


def _efa_layout(cards: int) -> list[dict[str, Any]]:
    """AWS's recommended layout for EFA types with several network cards
    (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html): an ENA primary
    interface on card 0 device 0, an EFA-only interface on card 0 device 1, and an EFA-only
    interface on device 0 of every further card. Written out here, not taken from infra/efa.py."""
    nics = [(0, 0, "interface"), (0, 1, "efa-only")]
    nics += [(card, 0, "efa-only") for card in range(1, cards)]
    return [
        {"NetworkCardIndex": c, "DeviceIndex": d, "InterfaceType": t, "DeleteOnTermination": True}
        for c, d, t in nics
    ]


def _without_groups(nics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in nic.items() if k != "Groups"} for nic in nics]


def test_efa_interfaces_follow_awss_layout_each_with_the_cluster_group(efa: BuiltApp) -> None:
    cluster_sg = network_ref(efa, efa.stacks.network.network.cluster_security_group, "GroupId")
    for group, cards in (("gpu", 4), ("cpu", 1)):  # p4d.24xlarge, c5n.18xlarge
        data = _launch_template_data(efa, group)
        assert "SecurityGroupIds" not in data, "EC2 refuses top-level groups with interfaces"
        assert "SecurityGroups" not in data
        nics = data["NetworkInterfaces"]
        assert _without_groups(nics) == _efa_layout(cards), group
        for nic in nics:  # this interface carries the cluster group, not any imported group
            assert [imported(efa, g) for g in nic["Groups"]] == [cluster_sg]
            assert "SubnetId" not in nic  # the Auto Scaling group chooses the subnet


def test_a_group_mixing_efa_layouts_gets_one_template_per_layout(tmp_path: Path) -> None:
    """p5 (32 cards) and p4d (4 cards) in one group: one launch template cannot describe both,
    so the p4d override names its own template."""
    built = build(tmp_path, MIXED_EFA_SPEC)
    fleet = built.stacks.cluster.fleets["dnn_group"]
    templates = built.cluster.find_resources("AWS::EC2::LaunchTemplate")
    lids = []
    for template in fleet.launch_templates.values():
        cfn = template.node.default_child
        assert isinstance(cfn, cdk.CfnResource)
        lids.append(built.stacks.cluster.get_logical_id(cfn))
    p5, p4d = lids
    nics = {lid: templates[lid]["Properties"]["LaunchTemplateData"]["NetworkInterfaces"]
            for lid in lids}  # fmt: skip
    assert _without_groups(nics[p5]) == _efa_layout(32)
    assert _without_groups(nics[p4d]) == _efa_layout(4)
    # Both templates put the group's instances into the group's one placement group.
    assert _placement(built, "dnn_group") == _own_placement_group(built, "dnn_group")
    policy = _asg(built, "dnn_group")["MixedInstancesPolicy"]["LaunchTemplate"]
    assert policy["LaunchTemplateSpecification"]["LaunchTemplateId"] == {"Ref": p5}
    assert policy["Overrides"] == [
        {"InstanceType": "p5.48xlarge"},
        {
            "InstanceType": "p4d.24xlarge",
            "LaunchTemplateSpecification": {
                "LaunchTemplateId": {"Ref": p4d},
                "Version": {"Fn::GetAtt": [p4d, "LatestVersionNumber"]},
            },
        },
    ]


def test_no_ingress_from_any_address_range(spot: BuiltApp, efa: BuiltApp) -> None:
    """Every way in is from a security group: no rule from 0.0.0.0/0 (or any CIDR, IPv4 or
    IPv6), on any port or protocol, in either stack."""
    for built in (spot, efa):
        for template in (built.network, built.cluster):
            rules = [
                r["Properties"]
                for r in template.find_resources("AWS::EC2::SecurityGroupIngress").values()
            ]
            for sg in template.find_resources("AWS::EC2::SecurityGroup").values():
                rules += sg["Properties"].get("SecurityGroupIngress", [])
            for rule in rules:
                assert not {"CidrIp", "CidrIpv6", "SourcePrefixListId"} & set(rule), rule
                assert "SourceSecurityGroupId" in rule, rule


def test_user_data_pulls_the_image_and_runs_the_launcher_as_the_group(spot: BuiltApp) -> None:
    for group, gpu in (("trainer", True), ("dataprep", False)):
        script = _user_data(spot, group)
        # The exact boot sequence runs as a script in test_infra_user_data.py; here: no AWS CLI
        # (neither AMI is documented to have it), the ECR credential helper instead.
        assert "aws " not in script and "docker login" not in script
        # Packages from Amazon Linux 2023's core repository only (`amazonlinux`): the exact
        # lines, and no other dnf call.
        lines = script.splitlines()
        only_al2023 = "dnf --disablerepo='*' --enablerepo=amazonlinux install -y"
        assert f"  retry {only_al2023} docker" in lines
        assert (
            "command -v docker-credential-ecr-login >/dev/null "
            f"|| retry {only_al2023} amazon-ecr-credential-helper"
        ) in lines
        assert script.count("dnf ") == script.count(only_al2023) == 2
        assert 'retry docker pull "$IMAGE"' in script
        assert f"launch --spec {DEPLOYED_SPEC_PATH} --group {group}" in script
        for env in (
            ENV_SPEC,
            ENV_GROUP,
            ENV_CLUSTER,
            ENV_CHECKPOINT_URI,
            ENV_ASG_NAMES,
            ENV_REGION,
        ):
            assert f"-e {env}=" in script, env
        assert f"-e {ENV_GROUP}={group} " in script
        assert f"-e {ENV_ASG_NAMES}=vit-spot-trainer,vit-spot-dataprep" in script
        assert "--log-driver awslogs" in script and "--log-opt awslogs-group=" in script
        assert ("--gpus all" in script) is gpu
        assert "--network host" in script
        # Docker brings a dead launcher back; the launcher retries the role itself.
        assert "docker run --detach --restart on-failure:5 --name hetero " in script
        # Only the trainer group has the termination hook the launcher completes.
        hook_env = f"-e {ENV_LIFECYCLE_HOOK}={LIFECYCLE_HOOK_NAME} "
        assert (hook_env in script) is gpu


def test_trainer_group_has_the_termination_hook_the_launcher_completes(spot: BuiltApp) -> None:
    hooks = spot.cluster.find_resources("AWS::AutoScaling::LifecycleHook")
    assert len(hooks) == 1, hooks
    props = next(iter(hooks.values()))["Properties"]
    trainer_asg = spot.stacks.cluster.fleets["trainer"].auto_scaling_group
    cfn_asg = trainer_asg.node.default_child
    assert isinstance(cfn_asg, cdk.CfnResource)
    assert props["AutoScalingGroupName"] == {"Ref": spot.stacks.cluster.get_logical_id(cfn_asg)}
    assert props["LifecycleHookName"] == LIFECYCLE_HOOK_NAME
    assert props["LifecycleTransition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
    assert props["DefaultResult"] == "CONTINUE"
    assert props["HeartbeatTimeout"] == 300
    assert "NotificationTargetARN" not in props  # the instance polls IMDS; no queue needed


# ----------------------------------------------------------------------------- Auto Scaling


def test_spot_groups_use_price_capacity_optimized_over_ordered_types(spot: BuiltApp) -> None:
    for group, types in (("trainer", ["g5.xlarge", "g6.xlarge"]), ("dataprep", ["c6i.4xlarge"])):
        asg = _asg(spot, group)
        policy = asg["MixedInstancesPolicy"]
        dist = policy["InstancesDistribution"]
        assert dist["SpotAllocationStrategy"] == "price-capacity-optimized"
        assert dist["OnDemandPercentageAboveBaseCapacity"] == 0
        assert dist["OnDemandBaseCapacity"] == 0
        overrides = policy["LaunchTemplate"]["Overrides"]
        assert [o["InstanceType"] for o in overrides] == types
        assert asg["CapacityRebalance"] is True


def test_on_demand_group_is_all_on_demand_in_order(efa: BuiltApp) -> None:
    asg = _asg(efa, "gpu")
    dist = asg["MixedInstancesPolicy"]["InstancesDistribution"]
    assert dist["OnDemandPercentageAboveBaseCapacity"] == 100
    assert dist["OnDemandAllocationStrategy"] == "prioritized"
    assert asg.get("CapacityRebalance") in (None, False)


def test_desired_capacity_is_the_spec_count(spot: BuiltApp, efa: BuiltApp) -> None:
    for built, group, count in ((spot, "trainer", 2), (spot, "dataprep", 1), (efa, "gpu", 2)):
        asg = _asg(built, group)
        assert (asg["DesiredCapacity"], asg["MaxSize"], asg["MinSize"]) == (
            str(count),
            str(count),
            "0",
        )


def test_an_elastic_dataprep_group_gets_the_spec_min_max_and_starts_at_count(
    tmp_path: Path, spot: BuiltApp
) -> None:
    """min_count/max_count bound the data-tier controller's SetDesiredCapacity; desired is
    count. The trainer group and every other property of the dataprep group are as without."""
    elastic = build(tmp_path, ELASTIC_SPEC)
    fleet = elastic.stacks.cluster.fleets["dataprep"]
    assert fleet.group.elastic and not spot.stacks.cluster.fleets["dataprep"].group.elastic
    dataprep = _asg(elastic, "dataprep")
    assert (dataprep["MinSize"], dataprep["MaxSize"], dataprep["DesiredCapacity"]) == (
        "1",
        "4",
        "2",
    )
    sizes = ("MinSize", "MaxSize", "DesiredCapacity")
    before = _asg(spot, "dataprep")
    assert {k: v for k, v in dataprep.items() if k not in sizes} == {
        k: v for k, v in before.items() if k not in sizes
    }
    assert _asg(elastic, "trainer") == _asg(spot, "trainer")
    # The instance role may already set the desired capacity of the cluster's groups.
    assert "autoscaling:SetDesiredCapacity" in json.dumps(
        elastic.cluster.find_resources("AWS::IAM::Policy")
    )


def test_a_changed_group_gets_the_spec_sizes_again(spot: BuiltApp, efa: BuiltApp) -> None:
    """CDK's default IgnoreUnmodifiedGroupSizeProperties would keep the 0 the launcher set at job
    end through a stack update; it is off on every group."""
    for built in (spot, efa):
        for group in built.stacks.cluster.fleets:
            fleet = built.stacks.cluster.fleets[group]
            cfn = fleet.auto_scaling_group.node.default_child
            assert isinstance(cfn, cdk.CfnResource)
            res = built.cluster.to_json()["Resources"][built.stacks.cluster.get_logical_id(cfn)]
            assert res["UpdatePolicy"] == {
                "AutoScalingScheduledAction": {"IgnoreUnmodifiedGroupSizeProperties": False}
            }, group


def test_container_logs_are_kept_without_a_fixed_name(spot: BuiltApp) -> None:
    """A retained log group with a fixed name makes the deploy after `cdk destroy` fail
    ("already exists"); CloudFormation names it, and the output says which it is."""
    cfn = spot.stacks.cluster.log_group.node.default_child
    assert isinstance(cfn, cdk.CfnResource)
    lid = spot.stacks.cluster.get_logical_id(cfn)
    res = spot.cluster.to_json()["Resources"][lid]
    assert "LogGroupName" not in res["Properties"]
    assert res["Properties"]["RetentionInDays"] == 90
    assert (res["DeletionPolicy"], res["UpdateReplacePolicy"]) == ("Retain", "Retain")
    outputs = spot.cluster.to_json()["Outputs"]
    assert outputs["LogGroupName"]["Value"] == {"Ref": lid}


def test_group_tags_propagate_to_instances(spot: BuiltApp) -> None:
    asg = _asg(spot, "dataprep")
    tags = {t["Key"]: (t["Value"], t["PropagateAtLaunch"]) for t in asg["Tags"]}
    assert tags[TAG_CLUSTER] == ("vit-spot", True)
    assert tags[TAG_GROUP] == ("dataprep", True)
    assert tags[TAG_ROLE] == ("dataprep", True)


# ----------------------------------------------------------------------------- bucket


def test_checkpoint_bucket_is_encrypted_versioned_private_and_retained(spot: BuiltApp) -> None:
    buckets = spot.cluster.find_resources("AWS::S3::Bucket")
    assert len(buckets) == 1
    bucket = next(iter(buckets.values()))
    props = bucket["Properties"]
    assert props["BucketEncryption"]["ServerSideEncryptionConfiguration"][0][
        "ServerSideEncryptionByDefault"
    ] == {"SSEAlgorithm": "AES256"}
    assert props["VersioningConfiguration"] == {"Status": "Enabled"}
    assert props["PublicAccessBlockConfiguration"] == {
        "BlockPublicAcls": True,
        "BlockPublicPolicy": True,
        "IgnorePublicAcls": True,
        "RestrictPublicBuckets": True,
    }
    rules = props["LifecycleConfiguration"]["Rules"]
    assert any(r.get("NoncurrentVersionExpiration", {}).get("NoncurrentDays") for r in rules)
    assert bucket["DeletionPolicy"] == "Retain"
    assert bucket["UpdateReplacePolicy"] == "Retain"
    spot.cluster.resource_count_is("Custom::S3AutoDeleteObjects", 0)


def test_bucket_policy_denies_requests_without_ssl(spot: BuiltApp) -> None:
    spot.cluster.has_resource_properties(
        "AWS::S3::BucketPolicy",
        {
            "PolicyDocument": {
                "Statement": Match.array_with(
                    [
                        Match.object_like(
                            {
                                "Effect": "Deny",
                                "Action": "s3:*",
                                "Principal": {"AWS": "*"},
                                "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                            }
                        )
                    ]
                )
            }
        },
    )


def test_destroy_checkpoints_opt_out_deletes_the_bucket(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    built = build(tmp_path_factory.mktemp("destroy"), SPOT_SPEC, destroy_checkpoints=True)
    bucket = next(iter(built.cluster.find_resources("AWS::S3::Bucket").values()))
    assert bucket["DeletionPolicy"] == "Delete"
    built.cluster.resource_count_is("Custom::S3AutoDeleteObjects", 1)


# ----------------------------------------------------------------------------- IAM


def _policy_statements(built: BuiltApp, role_attr: str) -> list[dict[str, Any]]:
    role = getattr(built.stacks.cluster, role_attr).role
    role_lid = built.stacks.cluster.get_logical_id(role.node.default_child)
    statements: list[dict[str, Any]] = []
    for res in built.cluster.find_resources("AWS::IAM::Policy").values():
        if {"Ref": role_lid} in res["Properties"]["Roles"]:
            statements += res["Properties"]["PolicyDocument"]["Statement"]
    assert statements, f"no policy attached to {role_attr}"
    return statements


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


@pytest.mark.parametrize("role_attr", ["instance_role", "sagemaker_role"])
def test_star_resources_only_for_actions_without_resource_permissions(
    spot: BuiltApp, role_attr: str
) -> None:
    for statement in _policy_statements(spot, role_attr):
        if "*" in _as_list(statement["Resource"]):
            actions = set(_as_list(statement["Action"]))
            assert actions <= STAR_ONLY_ACTIONS, statement


def test_instance_role_scope(spot: BuiltApp) -> None:
    statements = _policy_statements(spot, "instance_role")
    by_action: dict[str, dict[str, Any]] = {}
    for s in statements:
        for a in _as_list(s["Action"]):
            by_action[a] = s
    # Checkpoints: objects under the prefix only; listing conditioned on the prefix.
    put = by_action["s3:PutObject"]
    assert json.dumps(put["Resource"]).endswith(f'"/{CHECKPOINT_PREFIX}/*"]]}}')
    assert "s3:DeleteBucket" not in by_action and "s3:*" not in by_action
    listing = by_action["s3:ListBucket"]
    assert listing["Condition"]["StringLike"]["s3:prefix"] == [
        CHECKPOINT_PREFIX,
        f"{CHECKPOINT_PREFIX}/*",
    ]
    # Scaling: only this cluster's groups, by name and by tag.
    scale = by_action["autoscaling:UpdateAutoScalingGroup"]
    names = {json.dumps(r).rsplit("/", 1)[-1].rstrip('"]}') for r in _as_list(scale["Resource"])}
    assert names == {"vit-spot-trainer", "vit-spot-dataprep"}
    assert scale["Condition"] == {"StringEquals": {f"aws:ResourceTag/{TAG_CLUSTER}": "vit-spot"}}
    # The termination hook is completed on the same groups, under the same condition.
    assert by_action["autoscaling:CompleteLifecycleAction"] is scale
    # So is the replacement of an instance that holds an older spec than the deployed job's.
    assert by_action["autoscaling:TerminateInstanceInAutoScalingGroup"] is scale
    # And a launcher that cannot start its loop marks its own instance Unhealthy.
    assert by_action["autoscaling:SetInstanceHealth"] is scale
    # The budget's backstop: put on the same groups, deleted at job end.
    assert by_action["autoscaling:PutScheduledUpdateGroupAction"] is scale
    assert by_action["autoscaling:DeleteScheduledAction"] is scale
    # No PutMetricData: the trainer's metrics are EMF log events, which need logs:PutLogEvents
    # only. Peer discovery; image pull; logs.
    assert "cloudwatch:PutMetricData" not in by_action
    assert by_action["ec2:DescribeInstances"]["Resource"] == "*"
    # The data plane drops instances their Auto Scaling group is terminating.
    assert by_action["autoscaling:DescribeAutoScalingInstances"]["Resource"] == "*"
    # The data-tier controller reads its group's bounds and desired capacity.
    assert by_action["autoscaling:DescribeAutoScalingGroups"]["Resource"] == "*"
    assert "ecr:BatchGetImage" in by_action
    assert "logs:PutLogEvents" in by_action
    # No broad write to EC2 or IAM.
    assert not any(a.startswith(("iam:", "ec2:Run", "ec2:Terminate")) for a in by_action)


def test_roles_trust_their_services(spot: BuiltApp) -> None:
    for service in ("ec2.amazonaws.com", "sagemaker.amazonaws.com"):
        spot.cluster.has_resource_properties(
            "AWS::IAM::Role",
            {
                "AssumeRolePolicyDocument": {
                    "Statement": [
                        Match.object_like(
                            {"Action": "sts:AssumeRole", "Principal": {"Service": service}}
                        )
                    ]
                }
            },
        )


# ----------------------------------------------------------------------------- image, outputs


def test_two_image_assets_each_launch_template_names_the_one_for_its_role(
    spot: BuiltApp,
) -> None:
    """The trainer and data-server targets of containers/Dockerfile are two image assets; the
    trainer launch template pulls the trainer image and the dataprep one the CPU-only image,
    so a data server never pulls the CUDA wheels."""
    image = spot.stacks.cluster.image
    assert image.asset.image_uri and image.data_server_asset.image_uri  # deploy-time tokens
    assembly = spot.app.synth()
    assets_file = Path(assembly.directory) / f"{spot.stacks.cluster.artifact_id}.assets.json"
    assets = json.loads(assets_file.read_text())
    images = list(assets["dockerImages"].values())
    assert len(images) == 2
    tags: dict[str, str] = {}
    for asset in images:
        assert asset["source"]["dockerFile"] == "containers/Dockerfile"
        assert asset["source"]["platform"] == "linux/amd64"
        (destination,) = asset["destinations"].values()
        tags[asset["source"]["dockerBuildTarget"]] = destination["imageTag"]
    assert set(tags) == {"trainer", "data-server"}
    assert tags["trainer"] != tags["data-server"]
    templates = spot.cluster.find_resources("AWS::EC2::LaunchTemplate")
    for group, target in (("trainer", "trainer"), ("dataprep", "data-server")):
        cfn = spot.stacks.cluster.fleets[group].launch_template.node.default_child
        assert isinstance(cfn, cdk.CfnResource)
        user_data = json.dumps(
            templates[spot.stacks.cluster.get_logical_id(cfn)]["Properties"]["LaunchTemplateData"]
        )
        other = "data-server" if target == "trainer" else "trainer"
        assert f":{tags[target]}" in user_data, group
        assert tags[other] not in user_data, group
    # One repository (CDK's bootstrap one) holds both, so one pull grant covers both.
    stack = spot.stacks.cluster
    assert stack.resolve(image.asset.repository.repository_name) == stack.resolve(
        image.data_server_asset.repository.repository_name
    )


def test_outputs_for_users_and_the_sagemaker_backend(spot: BuiltApp) -> None:
    outputs = spot.cluster.to_json()["Outputs"]
    for key in (
        "ImageUri",
        "DataServerImageUri",
        "CheckpointBucketName",
        "CheckpointUri",
        "LogGroupName",
        "AutoScalingGroupNames",
        "InstanceGroupNames",
        "InstanceRoleArn",
        "SageMakerRoleArn",
        "SubnetId",
        "SecurityGroupId",
        "PlacementGroupNames",
    ):
        assert key in outputs, key
    # Only the trainer group has a cluster placement group: <group>=<its generated name>.
    trainer_pg = _own_placement_group(spot, "trainer")["GroupName"]
    assert outputs["PlacementGroupNames"]["Value"] == {"Fn::Join": ["", ["trainer=", trainer_pg]]}
    assert outputs["AutoScalingGroupNames"]["Value"] == "vit-spot-trainer,vit-spot-dataprep"
    # The model lands in model/ beside a job's checkpoints (training.trainer.export.MODEL_FOLDER).
    assert outputs["ModelUri"]["Value"] == {
        "Fn::Join": ["", ["s3://", {"Ref": ANY}, "/checkpoints/<job folder>/model/"]]
    }
    assert outputs["ModelUri"]["Value"]["Fn::Join"][1][1] == {
        "Ref": outputs["CheckpointUri"]["Value"]["Fn::Join"][1][1]["Ref"]
    }
