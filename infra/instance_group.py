"""One instance group of the spec on EC2: a launch template and an Auto Scaling group."""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from aws_cdk import (
    Annotations,
    CfnAutoScalingScheduledAction,
    CfnUpdatePolicy,
    Duration,
    Stack,
    Tags,
)
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from constructs import Construct

from infra.efa import EfaLayout, efa_layouts
from infra.shard_cache import cache_bytes, root_volume_cache_gib, shard_cache_lines
from training.common.launch_line import (
    HOST_SPEC_DIR,
    LaunchTarget,
    LogTarget,
    docker_run_line,
)
from training.common.names import (
    DATAPREP_AMI_PARAMETER,
    LIFECYCLE_HOOK_NAME,
    TAG_CLUSTER,
    TAG_GROUP,
    TAG_ROLE,
    TRAINER_AMI_PARAMETER,
    asg_name,
    job_parameter_name,
)
from training.common.outcome import CONTAINER_STOP_TIMEOUT_S
from training.spec import ClusterSpec, InstanceGroup, Market, Role

logger = logging.getLogger(__name__)

# Public SSM parameters (resolved at deploy time, so synth needs no account).
# Trainers: the Deep Learning Base OSS Nvidia Driver AMI on AL2023 (NVIDIA driver, NVIDIA container
# toolkit, containerd, the EFA driver; the boot makes sure of Docker, see `user_data_script`).
# Dataprep: the ECS-optimised AL2023 AMI (Docker; no GPU stack). It is built on the *minimal*
# AL2023 AMI and adds only Docker, containerd, the ECS agent and a few utilities (package list:
# variables.pkr.hcl `packages_al2023` in github.com/aws/amazon-ecs-ami), so it has no AWS CLI.
# Neither image is logged in to ECR with the CLI: the user data installs the Amazon ECR credential
# helper from the AL2023 core repository (`DNF_INSTALL`; github.com/awslabs/amazon-ecr-credential-
# helper, section "Amazon Linux 2023") and Docker fetches registry credentials through it with the
# instance role.
# The parameter names live in training/common/names.py; `hetero preflight` checks they resolve.
AL2023_REPO = "amazonlinux"
"""The repository id of Amazon Linux 2023's core repository (the AL2023 repositories are
``amazonlinux``, ``kernel-livepatch``, ``amazonlinux-nvidia`` and ``amazonlinux-spal``:
https://docs.aws.amazon.com/linux/al2023/ug/repo-metadata-signing.html). Docker and the ECR
credential helper are both in it."""
DNF_INSTALL = f"dnf --disablerepo='*' --enablerepo={AL2023_REPO} install -y"
"""How the boot installs a package: from Amazon Linux 2023's core repository only (served from
Amazon S3, reached through the S3 gateway endpoint). An AMI may carry repositories that are not
Amazon Linux's own (the GPU AMI may carry NVIDIA's CUDA repository), which the private subnet has
no route to; with them enabled, fetching their metadata could fail or stall the install."""
ROOT_DEVICE = "/dev/xvda"
BOOT_ATTEMPTS = 6
"""Tries of each boot step that depends on the network (package install, image pull)."""
BOOT_RETRY_SECONDS = 20
"""Pause between two tries: the VPC endpoints and the instance role may need a moment."""
TERMINATION_HOOK_TIMEOUT = Duration.minutes(5)
"""How long an Auto Scaling termination waits for the trainer's checkpoint (the launcher
completes the lifecycle action sooner; at the timeout the termination goes on anyway)."""
# Root volume, GiB: the AMI's own snapshot (about 75 GiB for the DL base AMI, 30 for ECS) plus
# the role's image, compressed and unpacked (its Python packages: trainer 3.1 GB compressed and
# 5.9 GB unpacked, data server about 0.3 and 1.1 GB; README, "The two images"; the OS layers
# and the EFA stack on top) plus room for local checkpoint staging.
ROOT_VOLUME_GIB: Mapping[Role, int] = {Role.TRAINER: 200, Role.DATAPREP: 100}


def root_volume_gib(spec: ClusterSpec, group: InstanceGroup) -> int:
    """The group's root volume: its role's size, plus, on a dataprep group whose types do not
    all have an instance store volume that holds the spec's ``job.dataset.cache_gb``, room for
    that shard cache (``infra/shard_cache.py``, ``root_volume_cache_gib``)."""
    return ROOT_VOLUME_GIB[group.role] + root_volume_cache_gib(spec, group)


DOCKER_UNIT_DIR = "/etc/systemd/system/docker.service.d"
"""Drop-ins of ``docker.service`` (the user data adds its stop timeout there)."""
DOCKER_STOP_TIMEOUT_S = CONTAINER_STOP_TIMEOUT_S + 30
"""``TimeoutStopSec`` of ``docker.service``: the launcher container's stop timeout, plus the 5 s
dockerd adds to the longest container stop timeout at its own shutdown (moby/moby#22566) and
room for the daemon's own teardown."""
DOCKER_CONFIG_DIR = "/root/.docker"
"""Docker client configuration of the user data (root; cloud-init may leave HOME unset)."""


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
    """Shell lines that install the ECR credential helper, pull the image and run the launcher as
    ``group``. Each network step is retried (``BOOT_ATTEMPTS`` x ``BOOT_RETRY_SECONDS``) and the
    script stops with a message when one never succeeds, so a broken boot shows in the console log
    instead of a launcher that never started; any failure that ends the script (an exhausted
    retry, ``set -e``, ``docker run``) then runs ``shutdown -h now`` from an EXIT trap, which the
    launch template's ``InstanceInitiatedShutdownBehavior = terminate`` turns into a termination,
    so the Auto Scaling group launches a replacement.

    The spec reaches the instance here, at run time (never baked into the image): it is written to
    the host and mounted read-only into the container.
    """
    spec_b64 = base64.b64encode(spec_text.encode()).decode()
    target = LaunchTarget(
        cluster=spec.name,
        group=group.name,
        trainer=group.role is Role.TRAINER,
        checkpoint_uri=checkpoint_uri,
        job_parameter=job_parameter_name(spec.name),
        asg_names=tuple(asg_names),
        region=region,
        lifecycle_hook=LIFECYCLE_HOOK_NAME,
    )

    return [
        "set -euo pipefail",
        f"HOST_SPEC_DIR={HOST_SPEC_DIR}",
        f"DOCKER_UNIT_DIR={DOCKER_UNIT_DIR}",
        f"export DOCKER_CONFIG={DOCKER_CONFIG_DIR}",
        "retry() {",
        f"  for attempt in $(seq 1 {BOOT_ATTEMPTS}); do",
        '    "$@" && return 0',
        f'    echo "hetero boot: \\"$*\\" failed (attempt $attempt of {BOOT_ATTEMPTS})" >&2',
        f'    [ "$attempt" -lt {BOOT_ATTEMPTS} ] && sleep {BOOT_RETRY_SECONDS}',
        "  done",
        '  echo "hetero boot: giving up on \\"$*\\"; the launcher was not started" >&2',
        "  return 1",
        "}",
        # The give-up point: whatever ends this script with a failure (a step that never
        # succeeded, `set -e` on any other command, `docker run` itself) leaves the instance with
        # no launcher. Shut it down: the launch template's InstanceInitiatedShutdownBehavior is
        # terminate, so the instance terminates and its Auto Scaling group replaces it. No AWS
        # CLI needed (the dataprep AMI has none).
        "give_up() {",
        "  local rc=$?",
        '  [ "$rc" -eq 0 ] && return 0',
        '  echo "hetero boot: the boot failed (exit $rc); shutting down: this instance '
        'terminates and its group replaces it" >&2',
        "  shutdown -h now",
        "}",
        "trap give_up EXIT",
        "imds() {",
        "  local token",
        "  token=$(curl -sf -X PUT http://169.254.169.254/latest/api/token "
        '-H "X-aws-ec2-metadata-token-ttl-seconds: 60") || return 1',
        '  curl -sf -H "X-aws-ec2-metadata-token: $token" '
        '"http://169.254.169.254/latest/meta-data/$1"',
        "}",
        'mkdir -p "$HOST_SPEC_DIR"',
        f'echo {spec_b64} | base64 -d > "$HOST_SPEC_DIR/cluster.toml"',
        f"IMAGE={image_uri}",
        'REGISTRY="${IMAGE%%/*}"',
        # Docker: the ECS AMI ships it. The boot does not count on the DLAMI either way: the
        # package table of its release notes names the NVIDIA container toolkit and containerd
        # but says nothing of Docker. Where `docker` is on PATH this step does nothing; where it
        # is not, the boot installs it and registers the NVIDIA runtime for `--gpus`.
        "if ! command -v docker >/dev/null; then",
        f"  retry {DNF_INSTALL} docker",
        *(
            ["  nvidia-ctk runtime configure --runtime=docker"]
            if group.role is Role.TRAINER
            else []
        ),
        "fi",
        # Docker's stop must outlast the launcher container's: at a shutdown systemd stops
        # docker.service within its TimeoutStopSec (DefaultTimeoutStopSec, 90 s, unless the unit
        # sets one: https://www.freedesktop.org/software/systemd/man/latest/systemd.service.html#TimeoutStopSec=,
        # systemd-system.conf(5)), then SIGKILLs dockerd, which would cut short the container's
        # --stop-timeout (CONTAINER_STOP_TIMEOUT_S) and the checkpoint it waits for.
        'mkdir -p "$DOCKER_UNIT_DIR"',
        f"printf '[Service]\\nTimeoutStopSec={DOCKER_STOP_TIMEOUT_S}\\n' "
        '> "$DOCKER_UNIT_DIR/hetero-stop-timeout.conf"',
        "systemctl daemon-reload",
        "systemctl enable --now docker",
        # Registry login through the credential helper (neither AMI has the AWS CLI's
        # `ecr get-login-password` to rely on); packages come through the S3 gateway endpoint.
        "command -v docker-credential-ecr-login >/dev/null "
        f"|| retry {DNF_INSTALL} amazon-ecr-credential-helper",
        'mkdir -p "$DOCKER_CONFIG"',
        'printf \'{"credHelpers": {"%s": "ecr-login"}}\\n\' "$REGISTRY" '
        '> "$DOCKER_CONFIG/config.json"',
        'retry docker pull "$IMAGE"',
        *(shard_cache_lines(cache_bytes(spec)) if group.role is Role.DATAPREP else []),
        # EFA devices, when the instance has them (none on types without EFA).
        "EFA_DEVICES=$(for d in /dev/infiniband/uverbs*; do "
        '[ -e "$d" ] && printf -- "--device=%s " "$d"; done; true)',
        "INSTANCE_ID=$(retry imds instance-id)",
        # The launcher's container (training/common/launch_line.py: its flags, and why).
        docker_run_line(target, LogTarget(region=region, log_group=log_group_name)),
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
    so deploying starts the job. MinSize is 0 and MaxSize the count, except for an elastic
    dataprep group (``group.elastic``): MinSize ``min_size``, MaxSize ``max_size``.

    The group's instances go into a cluster placement group of its own where
    ``group.uses_cluster_placement``, else into none (both in the cluster's one subnet).

    Attributes: ``launch_template``, ``auto_scaling_group``, ``asg_name``, ``group``,
    ``placement_group`` (None without cluster placement).
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
        role: iam.IRole,
        image_uri: str,
        log_group: logs.ILogGroup,
        checkpoint_uri: str,
        asg_names: Sequence[str],
    ) -> None:
        super().__init__(scope, construct_id)
        self.group = group
        self.asg_name = asg_name(spec.name, group.name)
        user_data = ec2.UserData.for_linux()
        user_data.add_commands(
            *user_data_script(
                spec=spec,
                group=group,
                spec_text=spec_text,
                image_uri=image_uri,
                region=Stack.of(self).region,
                log_group_name=log_group.log_group_name,
                checkpoint_uri=checkpoint_uri,
                asg_names=asg_names,
            )
        )
        self.placement_group = self._placement_group(group)
        layouts = efa_layouts(group)
        self._make_launch_templates(spec, group, layouts, user_data, role, security_group)
        self.auto_scaling_group = self._make_auto_scaling_group(group, layouts, vpc, subnet)
        self._apply_sizes_on_update()
        if group.role is Role.TRAINER:
            self._checkpoint_on_termination()
        for key, value in (
            (TAG_CLUSTER, spec.name),
            (TAG_GROUP, group.name),
            (TAG_ROLE, group.role.value),
            ("Name", self.asg_name),
        ):
            Tags.of(self.auto_scaling_group).add(key, value, apply_to_launched_instances=True)
        logger.debug(
            "group %s: %s x %s (%s, EFA layouts %s)",
            group.name,
            f"{group.count} ({group.min_size}-{group.max_size})" if group.elastic else group.count,
            "/".join(group.instance_types),
            group.market.value,
            {layout.name: names for layout, names in layouts.items()} or "none",
        )

    def _placement_group(self, group: InstanceGroup) -> ec2.PlacementGroup | None:
        """A cluster placement group of the group's own, only where the spec's rule says it pays
        (``InstanceGroup.uses_cluster_placement``: multi-instance trainers, EFA groups)."""
        # Not one shared by every group: AWS recommends the same instance type for all instances
        # of a cluster placement group and a single launch request; more types or later launches
        # (Spot replacements, Capacity Rebalancing, another group's start) raise the chance of
        # an insufficient capacity error. https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/placement-strategies.html#placement-groups-cluster
        # Groups without one still launch into the cluster's one subnet, so in the same AZ.
        if not group.uses_cluster_placement:
            return None
        return ec2.PlacementGroup(
            self, "PlacementGroup", strategy=ec2.PlacementGroupStrategy.CLUSTER
        )

    def _make_launch_templates(
        self,
        spec: ClusterSpec,
        group: InstanceGroup,
        layouts: dict[EfaLayout, list[str]],
        user_data: ec2.UserData,
        role: iam.IRole,
        security_group: ec2.ISecurityGroup,
    ) -> None:
        """One launch template per EFA layout (infra/efa.py): types with different network-card
        counts (p4d: 4, p5: 32) cannot share one. Without EFA, one template whose security group
        sits on top; with EFA it goes on each interface (EC2 refuses both). Sets
        ``launch_templates`` and ``launch_template``, the policy's (the first layout's, that of
        the most preferred type, keeps the id "LaunchTemplate"; each further layout gets its own,
        named after it)."""
        ami_parameter = (
            TRAINER_AMI_PARAMETER if group.role is Role.TRAINER else DATAPREP_AMI_PARAMETER
        )
        machine_image = ec2.MachineImage.from_ssm_parameter(ami_parameter)

        def make_template(construct_id: str, layout: EfaLayout | None) -> ec2.LaunchTemplate:
            template = ec2.LaunchTemplate(
                self,
                construct_id,
                machine_image=machine_image,
                user_data=user_data,
                role=role,
                require_imdsv2=True,
                # A shutdown from the OS terminates the instance (the boot's give-up point):
                # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/Using_ChangingInstanceInitiatedShutdownBehavior.html
                instance_initiated_shutdown_behavior=ec2.InstanceInitiatedShutdownBehavior.TERMINATE,
                # 2 hops: processes in containers (bridge networking, e.g. docker's awslogs
                # helper or a user's debug container) reach IMDS as well as the host.
                http_put_response_hop_limit=2,
                instance_metadata_tags=True,
                block_devices=[
                    ec2.BlockDevice(
                        device_name=ROOT_DEVICE,
                        volume=ec2.BlockDeviceVolume.ebs(
                            root_volume_gib(spec, group),
                            encrypted=True,
                            volume_type=ec2.EbsDeviceVolumeType.GP3,
                            delete_on_termination=True,
                        ),
                    )
                ],
                placement_group=self.placement_group,
                security_group=None if layout is not None else security_group,
            )
            if layout is not None:
                cfn_template = template.node.default_child
                assert isinstance(cfn_template, ec2.CfnLaunchTemplate)
                cfn_template.add_property_override(
                    "LaunchTemplateData.NetworkInterfaces",
                    layout.network_interfaces(security_group.security_group_id),
                )
            return template

        ordered: list[EfaLayout | None] = [*layouts] or [None]
        self.launch_templates: dict[EfaLayout | None, ec2.LaunchTemplate] = {
            layout: make_template(
                "LaunchTemplate" if i == 0 or layout is None else f"LaunchTemplate{layout.name}",
                layout,
            )
            for i, layout in enumerate(ordered)
        }
        self.launch_template = self.launch_templates[ordered[0]]

    def _make_auto_scaling_group(
        self,
        group: InstanceGroup,
        layouts: dict[EfaLayout, list[str]],
        vpc: ec2.IVpc,
        subnet: ec2.ISubnet,
    ) -> autoscaling.AutoScalingGroup:
        """The group's Auto Scaling group: its mixed-instances policy over the group's types
        (each with its layout's template where that is not the policy's), its sizes, and the
        in-service metric for trainers."""
        template_of_type = {
            name: self.launch_templates[layout]
            for layout, names in layouts.items()
            for name in names
        }

        def override_template(name: str) -> ec2.LaunchTemplate | None:
            """The type's own template where its EFA layout is not the policy template's."""
            template = template_of_type.get(name)
            return None if template is None or template is self.launch_template else template

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
        fleet = autoscaling.AutoScalingGroup(
            self,
            "AutoScalingGroup",
            vpc=vpc,
            vpc_subnets=ec2.SubnetSelection(subnets=[subnet]),
            auto_scaling_group_name=self.asg_name,
            mixed_instances_policy=autoscaling.MixedInstancesPolicy(
                launch_template=self.launch_template,
                instances_distribution=distribution,
                launch_template_overrides=[
                    autoscaling.LaunchTemplateOverrides(
                        instance_type=ec2.InstanceType(t), launch_template=override_template(t)
                    )
                    for t in group.instance_types
                ],
            ),
            # Fixed groups: 0 to count (job end and ``hetero job start`` set MinSize 0 too).
            # An elastic dataprep group: the spec's min and max, which bound the data-tier
            # controller's SetDesiredCapacity (training/dataplane/autoscale.py); it starts at
            # count. Job end sets MinSize, MaxSize and DesiredCapacity to 0 (job_end.py).
            min_capacity=group.min_size if group.elastic else 0,
            max_capacity=group.max_size,
            desired_capacity=group.count,
            capacity_rebalance=group.market is Market.SPOT,
            # Instances in service, graphed on the dashboard (1-minute group metrics, no charge:
            # https://docs.aws.amazon.com/autoscaling/ec2/userguide/ec2-auto-scaling-metrics.html).
            group_metrics=(
                [autoscaling.GroupMetrics(autoscaling.GroupMetric.IN_SERVICE_INSTANCES)]
                if group.role is Role.TRAINER
                else None
            ),
        )
        # Intended: a deploy that changes the group sets it to the spec's count, which is how a
        # deployed job starts; the launcher scales it to zero when the job ends.
        Annotations.of(fleet).acknowledge_warning(
            "@aws-cdk/aws-autoscaling:desiredCapacitySet",
            "deploy starts the job: desired capacity is the spec's count on every deploy",
        )
        return fleet

    def _apply_sizes_on_update(self) -> None:
        """CDK's default UpdatePolicy sets IgnoreUnmodifiedGroupSizeProperties, so an update
        would keep the 0 the launcher left at job end. Off: an update of the group (a changed
        spec changes its launch template) applies the template's sizes again.
        https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/aws-attribute-updatepolicy.html"""
        cfn_asg = self.auto_scaling_group.node.default_child
        assert isinstance(cfn_asg, autoscaling.CfnAutoScalingGroup)
        cfn_asg.cfn_options.update_policy = CfnUpdatePolicy(
            auto_scaling_scheduled_action=CfnAutoScalingScheduledAction(
                ignore_unmodified_group_size_properties=False
            )
        )

    def _checkpoint_on_termination(self) -> None:
        """A trainer's termination hook. Capacity Rebalancing and scale-in terminate instances
        themselves, without a Spot notice: the hook keeps the instance in Terminating:Wait
        until the launcher has checkpointed (IMDS autoscaling/target-lifecycle-state says
        Terminated meanwhile).
        https://docs.aws.amazon.com/autoscaling/ec2/userguide/retrieving-target-lifecycle-state-through-imds.html"""
        self.auto_scaling_group.add_lifecycle_hook(
            "CheckpointOnTermination",
            lifecycle_hook_name=LIFECYCLE_HOOK_NAME,
            lifecycle_transition=autoscaling.LifecycleTransition.INSTANCE_TERMINATING,
            heartbeat_timeout=TERMINATION_HOOK_TIMEOUT,
            default_result=autoscaling.DefaultResult.CONTINUE,
        )
