"""One instance group of the spec on EC2: a launch template and an Auto Scaling group."""

from __future__ import annotations

import base64
import logging
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from aws_cdk import Annotations, Duration, Stack, Tags
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from constructs import Construct

from training import aws_tags
from training.spec import ClusterSpec, InstanceGroup, Market, Role

logger = logging.getLogger(__name__)

# Public SSM parameters (resolved at deploy time, so synth needs no account). Trainers: the
# Deep Learning Base AMI (NVIDIA driver, container toolkit, Docker and the EFA driver);
# dataprep: the ECS-optimised AL2023 AMI (Docker, no GPU stack). Both ship the AWS CLI and
# the SSM agent, and neither needs the internet to start the container.
TRAINER_AMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/"
    "base-oss-nvidia-driver-gpu-amazon-linux-2023/latest/ami-id"
)
DATAPREP_AMI_PARAMETER = "/aws/service/ecs/optimized-ami/amazon-linux-2023/recommended/image_id"
ROOT_DEVICE = "/dev/xvda"
LAUNCHER_RESTARTS = 5
"""Docker restarts of a launcher that exits non-zero (``docker run --restart on-failure:N``)."""
TERMINATION_HOOK_TIMEOUT = Duration.minutes(5)
"""How long an Auto Scaling termination waits for the trainer's checkpoint (the launcher
completes the lifecycle action sooner; at the timeout the termination goes on anyway)."""
# Root volume, GiB: the AMI's own snapshot (about 75 GiB for the DL base AMI, 30 for ECS) plus
# the image (about 10 GiB compressed, 20+ unpacked) plus room for local checkpoint staging.
ROOT_VOLUME_GIB: Mapping[Role, int] = {Role.TRAINER: 200, Role.DATAPREP: 100}


def user_data_script(
    *,
    spec: ClusterSpec,
    group: InstanceGroup,
    spec_text: str,
    image_uri: str,
    region: str,
    log_group_name: str,
    checkpoint_uri: str,
    asg_names: Sequence[str],
) -> list[str]:
    """Shell lines that log in to ECR, pull the image and run the launcher as ``group``.

    The deployed spec is written to the host and mounted read-only into the container, so the
    launcher runs the spec this stack was deployed with, not only the one baked in the image.
    """
    spec_b64 = base64.b64encode(spec_text.encode()).decode()
    host_spec_dir = "/opt/hetero/deployed"
    env = {
        aws_tags.ENV_SPEC: aws_tags.DEPLOYED_SPEC_PATH,
        aws_tags.ENV_CLUSTER: spec.name,
        aws_tags.ENV_GROUP: group.name,
        aws_tags.ENV_CHECKPOINT_URI: checkpoint_uri,
        aws_tags.ENV_ASG_NAMES: ",".join(asg_names),
        aws_tags.ENV_REGION: region,
        "AWS_REGION": region,
    }
    if group.role is Role.TRAINER:
        # The trainer group's termination hook: completed after the checkpoint it asks for.
        env[aws_tags.ENV_LIFECYCLE_HOOK] = aws_tags.LIFECYCLE_HOOK_NAME
    env_flags = " ".join(f"-e {k}={shlex.quote(v)}" for k, v in env.items())
    gpu_flags = "--gpus all " if group.role is Role.TRAINER else ""
    return [
        "set -euo pipefail",
        f"mkdir -p {host_spec_dir}",
        f"echo {spec_b64} | base64 -d > {host_spec_dir}/cluster.toml",
        f"IMAGE={image_uri}",
        'REGISTRY="${IMAGE%%/*}"',
        # The image is pulled through the ECR endpoints; retry while they come up.
        "for attempt in 1 2 3 4 5 6; do",
        f"  aws ecr get-login-password --region {region} "
        '| docker login --username AWS --password-stdin "$REGISTRY" '
        '&& docker pull "$IMAGE" && break',
        '  echo "image pull failed (attempt $attempt); retrying" >&2; sleep 20',
        "done",
        # EFA devices, when the instance has them (none on types without EFA).
        "EFA_DEVICES=$(for d in /dev/infiniband/uverbs*; do "
        '[ -e "$d" ] && printf -- "--device=%s " "$d"; done; true)',
        "INSTANCE_ID=$(TOKEN=$(curl -sX PUT http://169.254.169.254/latest/api/token "
        '-H "X-aws-ec2-metadata-token-ttl-seconds: 60") && curl -s '
        '-H "X-aws-ec2-metadata-token: $TOKEN" '
        "http://169.254.169.254/latest/meta-data/instance-id)",
        # Host networking: NCCL, EFA and the data plane's gRPC port see the instance's address.
        # The launcher retries a failed role itself (restart budget); Docker restarts the
        # launcher if it dies, and the restarted one reads the job record before running.
        f"docker run --detach --restart on-failure:{LAUNCHER_RESTARTS} --name hetero "
        "--network host --ipc host "
        f"--ulimit memlock=-1 --ulimit stack=67108864 {gpu_flags}$EFA_DEVICES"
        f"-v {host_spec_dir}:{host_spec_dir}:ro {env_flags} "
        "--log-driver awslogs "
        f"--log-opt awslogs-region={region} "
        f"--log-opt awslogs-group={log_group_name} "
        f'--log-opt awslogs-stream={group.name}/"$INSTANCE_ID" '
        f'"$IMAGE" launch --spec {aws_tags.DEPLOYED_SPEC_PATH} --group {group.name}',
    ]


def efa_network_interfaces(count: int, security_group_id: str) -> list[dict[str, Any]]:
    """Launch-template network interfaces: one EFA interface per network card.

    The first is the primary interface (device index 0); the others use device index 1 on
    their own cards. Each carries the cluster security group (the template then must not have
    top-level security groups: EC2 refuses both).
    """
    if count < 1:
        raise ValueError(f"EFA needs at least one network card, got {count}")
    return [
        {
            "DeviceIndex": 0 if card == 0 else 1,
            "NetworkCardIndex": card,
            "InterfaceType": "efa",
            "Groups": [security_group_id],
            "DeleteOnTermination": True,
        }
        for card in range(count)
    ]


class InstanceGroupFleet(Construct):
    """The launch template and Auto Scaling group of one instance group.

    Spot groups get a mixed-instances policy over the group's ordered types with
    price-capacity-optimized allocation and capacity rebalancing; On-Demand groups use the same
    policy at 100% On-Demand, taking the types in order. Desired capacity is the spec's count,
    so deploying starts the job.

    Attributes: ``launch_template``, ``auto_scaling_group``, ``asg_name``, ``group``.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        spec: ClusterSpec,
        group: InstanceGroup,
        spec_text: str,
        vpc: ec2.IVpc,
        subnet: ec2.ISubnet,
        security_group: ec2.ISecurityGroup,
        placement_group: ec2.IPlacementGroup,
        role: iam.IRole,
        image_uri: str,
        log_group: logs.ILogGroup,
        checkpoint_uri: str,
        asg_names: Sequence[str],
    ) -> None:
        super().__init__(scope, construct_id)
        self.group = group
        self.asg_name = aws_tags.asg_name(spec.name, group.name)
        stack = Stack.of(self)

        user_data = ec2.UserData.for_linux()
        user_data.add_commands(
            *user_data_script(
                spec=spec,
                group=group,
                spec_text=spec_text,
                image_uri=image_uri,
                region=stack.region,
                log_group_name=log_group.log_group_name,
                checkpoint_uri=checkpoint_uri,
                asg_names=asg_names,
            )
        )
        ami_parameter = (
            TRAINER_AMI_PARAMETER if group.role is Role.TRAINER else DATAPREP_AMI_PARAMETER
        )
        use_efa = group.use_efa
        self.launch_template = ec2.LaunchTemplate(
            self,
            "LaunchTemplate",
            machine_image=ec2.MachineImage.from_ssm_parameter(ami_parameter),
            user_data=user_data,
            role=role,
            require_imdsv2=True,
            # 2 hops: processes in containers (bridge networking, e.g. docker's awslogs helper
            # or a user's debug container) reach IMDS as well as the host.
            http_put_response_hop_limit=2,
            instance_metadata_tags=True,
            block_devices=[
                ec2.BlockDevice(
                    device_name=ROOT_DEVICE,
                    volume=ec2.BlockDeviceVolume.ebs(
                        ROOT_VOLUME_GIB[group.role],
                        encrypted=True,
                        volume_type=ec2.EbsDeviceVolumeType.GP3,
                        delete_on_termination=True,
                    ),
                )
            ],
            placement_group=placement_group,
            # With EFA the security group goes on each network interface instead.
            security_group=None if use_efa else security_group,
        )
        if use_efa:
            cfn_template = self.launch_template.node.default_child
            assert isinstance(cfn_template, ec2.CfnLaunchTemplate)
            cfn_template.add_property_override(
                "LaunchTemplateData.NetworkInterfaces",
                efa_network_interfaces(group.efa_network_cards, security_group.security_group_id),
            )

        if group.market is Market.SPOT:
            distribution = autoscaling.InstancesDistribution(
                on_demand_base_capacity=0,
                on_demand_percentage_above_base_capacity=0,
                spot_allocation_strategy=autoscaling.SpotAllocationStrategy.PRICE_CAPACITY_OPTIMIZED,
            )
        else:
            distribution = autoscaling.InstancesDistribution(
                on_demand_base_capacity=0,
                on_demand_percentage_above_base_capacity=100,
                on_demand_allocation_strategy=autoscaling.OnDemandAllocationStrategy.PRIORITIZED,
            )
        self.auto_scaling_group = autoscaling.AutoScalingGroup(
            self,
            "AutoScalingGroup",
            vpc=vpc,
            vpc_subnets=ec2.SubnetSelection(subnets=[subnet]),
            auto_scaling_group_name=self.asg_name,
            mixed_instances_policy=autoscaling.MixedInstancesPolicy(
                launch_template=self.launch_template,
                instances_distribution=distribution,
                launch_template_overrides=[
                    autoscaling.LaunchTemplateOverrides(instance_type=ec2.InstanceType(t))
                    for t in group.instance_types
                ],
            ),
            min_capacity=0,
            max_capacity=group.count,
            desired_capacity=group.count,
            capacity_rebalance=group.market is Market.SPOT,
        )
        # Intended: deploying (or redeploying) sets the group to the spec's count, which is
        # how a job starts; the launcher scales it to zero when the job ends.
        Annotations.of(self.auto_scaling_group).acknowledge_warning(
            "@aws-cdk/aws-autoscaling:desiredCapacitySet",
            "deploy starts the job: desired capacity is the spec's count on every deploy",
        )
        if group.role is Role.TRAINER:
            # Capacity Rebalancing and scale-in terminate instances themselves, without a Spot
            # notice: the hook keeps the instance in Terminating:Wait until the launcher has
            # checkpointed (IMDS autoscaling/target-lifecycle-state says Terminated meanwhile).
            # https://docs.aws.amazon.com/autoscaling/ec2/userguide/retrieving-target-lifecycle-state-through-imds.html
            self.auto_scaling_group.add_lifecycle_hook(
                "CheckpointOnTermination",
                lifecycle_hook_name=aws_tags.LIFECYCLE_HOOK_NAME,
                lifecycle_transition=autoscaling.LifecycleTransition.INSTANCE_TERMINATING,
                heartbeat_timeout=TERMINATION_HOOK_TIMEOUT,
                default_result=autoscaling.DefaultResult.CONTINUE,
            )
        for key, value in (
            (aws_tags.TAG_CLUSTER, spec.name),
            (aws_tags.TAG_GROUP, group.name),
            (aws_tags.TAG_ROLE, group.role.value),
            ("Name", self.asg_name),
        ):
            Tags.of(self.auto_scaling_group).add(key, value, apply_to_launched_instances=True)
        logger.debug(
            "group %s: %s x %s (%s, EFA cards %d)",
            group.name,
            group.count,
            "/".join(group.instance_types),
            group.market.value,
            group.efa_network_cards,
        )
