"""The two stacks of a cluster, one per lifecycle.

``NetworkStack`` (VPC, endpoints, security groups) changes rarely; its interface endpoints bill
per AZ-hour while it exists (``training.network_cost``);
``ClusterStack`` (the two images, roles, bucket, one fleet per instance group) is what each job
changes.
Splitting them lets a new job redeploy the cluster without touching the network, and lets
``cdk destroy`` of a job leave nothing but what the user asked to keep.
"""

from __future__ import annotations

import logging
from pathlib import Path

import aws_cdk as cdk
from aws_cdk import aws_logs as logs
from constructs import Construct

from infra.cluster import (
    REPO_ROOT,
    CheckpointBucket,
    ClusterImage,
    InstanceRole,
    SageMakerExecutionRole,
    dataset_read_uri,
    grant_dataset_read,
    grant_prefix_read,
    init_read_uri,
)
from infra.dashboard import ClusterDashboard
from infra.init_asset import InitWeightsAsset
from infra.instance_group import InstanceGroupFleet
from infra.job import JobParameter
from infra.network import ClusterNetwork
from training.common.names import TAG_CLUSTER, asg_name
from training.common.timm_hub import is_timm_init
from training.spec import ClusterSpec

logger = logging.getLogger(__name__)


class NetworkStack(cdk.Stack):
    """VPC, endpoints and security groups of one cluster. Attribute: ``network``."""

    def __init__(self, scope: Construct, construct_id: str, *, spec: ClusterSpec) -> None:
        super().__init__(
            scope,
            construct_id,
            description=f"{spec.name}: network of the heterogeneous training cluster",
        )
        self.network = ClusterNetwork(
            self, "Network", availability_zone_index=spec.availability_zone_index
        )
        cdk.Tags.of(self).add(TAG_CLUSTER, spec.name)


class ClusterStack(cdk.Stack):
    """Everything one job runs on: images, bucket, logs, roles and a fleet per instance group
    (with a cluster placement group of its own where the group uses one). Attributes:
    ``image``, ``checkpoints``, ``log_group``, ``instance_role``, ``sagemaker_role``, ``fleets``
    (by group name), ``dashboard``, ``job``, ``init_weights`` (a ``timm:`` init's asset, else
    None)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        spec: ClusterSpec,
        spec_text: str,
        network: ClusterNetwork,
        build_context: Path = REPO_ROOT,
        destroy_checkpoints: bool = False,
    ) -> None:
        super().__init__(
            scope,
            construct_id,
            description=f"{spec.name}: heterogeneous Spot training cluster (starts the job)",
        )
        cdk.Tags.of(self).add(TAG_CLUSTER, spec.name)
        asg_names = [asg_name(spec.name, g.name) for g in spec.groups]

        self.image = ClusterImage(self, "Image", build_context=build_context)
        self.checkpoints = CheckpointBucket(
            self, "Checkpoints", destroy_on_delete=destroy_checkpoints
        )
        # No fixed name: a retained group keeps its name after `cdk destroy`, and a fixed name
        # would make the next deploy fail ("already exists"). CloudFormation names it
        # `<stack>-ContainerLogs...-<suffix>`; the LogGroupName output says which.
        self.log_group = logs.LogGroup(
            self,
            "ContainerLogs",
            retention=logs.RetentionDays.THREE_MONTHS,
            # Logs of a finished job stay readable after destroy unless checkpoints go too.
            removal_policy=(
                cdk.RemovalPolicy.DESTROY if destroy_checkpoints else cdk.RemovalPolicy.RETAIN
            ),
        )
        dataset = spec.job.dataset
        dataset_uri = dataset_read_uri(dataset)
        self.dataset_uri = dataset_uri
        self.instance_role = InstanceRole(
            self,
            "InstanceRole",
            cluster_name=spec.name,
            image=self.image,
            checkpoints=self.checkpoints,
            log_group=self.log_group,
            asg_names=asg_names,
        )
        if dataset_uri is not None:
            grant_dataset_read(self.instance_role.role, dataset_uri)
        # An s3:// init: the job a deploy starts reads it where it is (hetero job start and
        # sagemaker submit copy it into the checkpoint bucket instead: training/common/s3_init.py).
        self.init_read_uri = init_read_uri(spec.job.model.init)
        if self.init_read_uri is not None:
            grant_prefix_read(
                self.instance_role.role, self.init_read_uri, "InitWeights", listing=False
            )
        # A timm: init, resolved here (the instances have no internet route) and deployed as
        # an asset the instances read: infra/init_asset.py.
        self.init_weights: InitWeightsAsset | None = None
        if is_timm_init(spec.job.model.init):
            self.init_weights = InitWeightsAsset(
                self,
                "InitWeights",
                init=str(spec.job.model.init),
                reader=self.instance_role.role,
                source=str(spec.source),
            )
        # The current job (id, checkpoint folder): a changed spec deploys a fresh job.
        self.job = JobParameter(
            self,
            "Job",
            cluster_name=spec.name,
            spec_text=spec_text,
            checkpoint_base_uri=self.checkpoints.uri,
            init=self.init_weights.init if self.init_weights else None,
            init_uri=self.init_weights.uri if self.init_weights else None,
        )
        self.job.grant_read(self.instance_role.role)
        self.sagemaker_role = SageMakerExecutionRole(
            self,
            "SageMakerRole",
            cluster_name=spec.name,
            image=self.image,
            checkpoints=self.checkpoints,
            dataset_uri=dataset_uri,
        )
        self.fleets: dict[str, InstanceGroupFleet] = {}
        for group in spec.groups:
            self.fleets[group.name] = InstanceGroupFleet(
                self,
                f"Group-{group.name}",
                spec=spec,
                group=group,
                spec_text=spec_text,
                vpc=network.vpc,
                subnet=network.subnet,
                security_group=network.cluster_security_group,
                role=self.instance_role.role,
                image_uri=self.image.uri_for(group.role),  # each role its own image
                log_group=self.log_group,
                checkpoint_uri=self.checkpoints.uri,
                asg_names=asg_names,
            )
        # The trainer's metrics arrive as EMF log lines (training.trainer.emf): graphed here.
        self.dashboard = ClusterDashboard(
            self,
            "Dashboard",
            cluster_name=spec.name,
            trainer_asg_names=[self.fleets[spec.trainer_group.name].asg_name],
        )

        outputs = {
            "ImageUri": (
                self.image.image_uri,
                "trainer image (GPU: trainer groups; the image of hetero sagemaker submit's jobs)",
            ),
            "DataServerImageUri": (
                self.image.data_server_image_uri,
                "data-server image (CPU only: dataprep groups)",
            ),
            "CheckpointBucketName": (self.checkpoints.bucket.bucket_name, "checkpoint bucket"),
            "CheckpointUri": (self.checkpoints.uri, "where the trainer writes checkpoints"),
            "ModelUri": (
                f"{self.checkpoints.uri}<job folder>/model/",
                "where a finished job writes model.safetensors + config.json (its job folder: "
                "hetero job start and hetero status print it)",
            ),
            "LogGroupName": (self.log_group.log_group_name, "container logs of every instance"),
            "AutoScalingGroupNames": (",".join(asg_names), "Auto Scaling groups, one per group"),
            "InstanceGroupNames": (
                ",".join(g.name for g in spec.groups),
                "instance groups (also SageMaker instance group names)",
            ),
            "InstanceRoleArn": (self.instance_role.role.role_arn, "role of the EC2 instances"),
            "JobParameterName": (
                self.job.parameter_name,
                "SSM parameter naming the current job (hetero job start changes it)",
            ),
            "SageMakerRoleArn": (
                self.sagemaker_role.role.role_arn,
                "execution role for SageMaker training jobs",
            ),
            "SubnetId": (network.subnet.subnet_id, "the cluster's subnet (one AZ)"),
            "SecurityGroupId": (
                network.cluster_security_group.security_group_id,
                "the cluster security group",
            ),
            "PlacementGroupNames": (
                ",".join(
                    f"{name}={fleet.placement_group.placement_group_name}"
                    for name, fleet in self.fleets.items()
                    if fleet.placement_group is not None
                )
                or "none",
                "cluster placement groups, <group>=<placement group name> for each instance "
                "group that uses one; none: no group does",
            ),
            "DashboardName": (
                self.dashboard.dashboard.dashboard_name,
                "CloudWatch dashboard of the trainer's metrics",
            ),
        }
        for key, (value, description) in outputs.items():
            cdk.CfnOutput(self, key, value=value, description=description)
