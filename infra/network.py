"""The network a cluster runs in: private subnets only, VPC endpoints, flow logs, and the
security groups that let the cluster's instances talk to each other and to nothing else."""

from __future__ import annotations

import logging

from aws_cdk import Fn, RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_logs as logs
from constructs import Construct

logger = logging.getLogger(__name__)

# One interface endpoint per service something on the instances calls (what calls each, and why
# monitoring, sts and ec2messages are not here: training.network_cost.INTERFACE_ENDPOINTS, which
# also prices them; a synth test checks that both name the same services). Each one bills per
# AZ-hour while the network stack exists, jobs or none.
INTERFACE_ENDPOINTS: dict[str, ec2.InterfaceVpcEndpointAwsService] = {
    # Image pulls: the ECR credential helper (GetAuthorizationToken) and Docker's registry calls.
    "Ecr": ec2.InterfaceVpcEndpointAwsService.ECR,
    "EcrDocker": ec2.InterfaceVpcEndpointAwsService.ECR_DOCKER,
    # Docker's awslogs driver: container logs, and the trainer's metrics as EMF events in them.
    "Logs": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS,
    # The launcher reads the job pointer (ssm:GetParameter); the SSM agent registers.
    "Ssm": ec2.InterfaceVpcEndpointAwsService.SSM,
    # Session Manager (the only way onto an instance: no SSH) opens its channels here.
    "SsmMessages": ec2.InterfaceVpcEndpointAwsService.SSM_MESSAGES,
    # Peer discovery (ec2:DescribeInstances).
    "Ec2": ec2.InterfaceVpcEndpointAwsService.EC2,
    # Job end (groups to 0), lifecycle actions, DescribeAutoScalingInstances.
    "AutoScaling": ec2.InterfaceVpcEndpointAwsService.AUTOSCALING,
}


class ClusterNetwork(Construct):
    """A VPC with one private, isolated subnet in the AZ the spec chose.

    Attributes: ``vpc``, ``subnet`` (the one subnet every instance and endpoint uses),
    ``cluster_security_group`` (all traffic to and from itself, nothing else in),
    ``endpoint_security_group`` (HTTPS from the cluster group only), ``flow_log_group``,
    ``endpoints`` (interface endpoints by name) and ``s3_endpoint``.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        availability_zone_index: int,
        cidr: str = "10.42.0.0/16",
        subnet_mask: int = 20,
    ) -> None:
        super().__init__(scope, construct_id)
        # One AZ chosen by index: a cluster placement group lives in one AZ, and the index keeps
        # synth free of account lookups (Fn::GetAZs resolves at deploy time).
        az = Fn.select(availability_zone_index, Fn.get_azs())
        self.vpc = ec2.Vpc(
            self,
            "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(cidr),
            availability_zones=[az],
            nat_gateways=0,
            subnet_configuration=[
                ec2.SubnetConfiguration(
                    name="cluster",
                    subnet_type=ec2.SubnetType.PRIVATE_ISOLATED,
                    cidr_mask=subnet_mask,
                )
            ],
            restrict_default_security_group=False,
        )
        self.subnet: ec2.ISubnet = self.vpc.isolated_subnets[0]

        self.flow_log_group = logs.LogGroup(
            self,
            "FlowLogs",
            retention=logs.RetentionDays.ONE_MONTH,
            removal_policy=RemovalPolicy.DESTROY,
        )
        self.vpc.add_flow_log(
            "FlowLog",
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(self.flow_log_group),
            traffic_type=ec2.FlowLogTrafficType.ALL,
        )

        self.cluster_security_group = ec2.SecurityGroup(
            self,
            "ClusterSecurityGroup",
            vpc=self.vpc,
            description="Cluster instances: all traffic to and from members (EFA, NCCL, gRPC)",
            allow_all_outbound=False,
        )
        # EFA requires both an inbound and an outbound rule that reference the group itself.
        self.cluster_security_group.add_ingress_rule(
            self.cluster_security_group, ec2.Port.all_traffic(), "all traffic from the cluster"
        )
        self.cluster_security_group.add_egress_rule(
            self.cluster_security_group, ec2.Port.all_traffic(), "all traffic to the cluster"
        )
        # HTTPS out reaches only what the isolated subnet routes to: the interface endpoints and
        # the S3 gateway (its prefix-list id would need an account lookup at synth).
        self.cluster_security_group.add_egress_rule(
            ec2.Peer.any_ipv4(), ec2.Port.tcp(443), "HTTPS to VPC endpoints and the S3 gateway"
        )

        self.endpoint_security_group = ec2.SecurityGroup(
            self,
            "EndpointSecurityGroup",
            vpc=self.vpc,
            description="VPC interface endpoints: HTTPS from the cluster security group only",
            allow_all_outbound=False,
        )
        self.endpoint_security_group.add_ingress_rule(
            self.cluster_security_group, ec2.Port.tcp(443), "HTTPS from cluster instances"
        )

        subnets = ec2.SubnetSelection(subnets=[self.subnet])
        self.s3_endpoint = self.vpc.add_gateway_endpoint(
            "S3", service=ec2.GatewayVpcEndpointAwsService.S3, subnets=[subnets]
        )
        self.endpoints: dict[str, ec2.InterfaceVpcEndpoint] = {
            name: self.vpc.add_interface_endpoint(
                name,
                service=service,
                subnets=subnets,
                security_groups=[self.endpoint_security_group],
                private_dns_enabled=True,
                # open=False: no implicit rule for the whole VPC CIDR; only the cluster group.
                open=False,
            )
            for name, service in INTERFACE_ENDPOINTS.items()
        }
        logger.debug("network: %d interface endpoints", len(self.endpoints))
