"""What the network stack's interface endpoints are for, and what they cost while they exist.

``infra/network.py`` creates one interface endpoint per entry of ``INTERFACE_ENDPOINTS`` (a synth
test checks that the two lists are the same); ``hetero spec check`` and the docs print
``network_cost_line``. Kept out of ``infra/`` so the CLI needs no CDK.
"""

from __future__ import annotations

from typing import Final

from training.spec import ClusterSpec

INTERFACE_ENDPOINTS: Final[dict[str, str]] = {
    "ecr.api": "image pull: the ECR credential helper's GetAuthorizationToken",
    "ecr.dkr": "image pull: Docker's registry calls (the layers come from S3, gateway)",
    "logs": "container logs and the trainer's EMF metrics (Docker's awslogs driver)",
    "ssm": "the launcher reads the job pointer (ssm:GetParameter); the SSM agent registers",
    "ssmmessages": "Session Manager's session channels (no SSH anywhere)",
    "ec2": "peer discovery (ec2:DescribeInstances)",
    "autoscaling": "job end, lifecycle hooks and instance state (Auto Scaling API)",
}
"""Interface endpoint service (``com.amazonaws.<region>.<service>``) -> what on the instances
calls it. Not created: ``monitoring`` (nothing calls CloudWatch's API: metrics travel as EMF in
the logs), ``sts`` (boto3, the ECR credential helper and the SSM agent take the instance role's
credentials from IMDS, not STS), ``ec2messages`` (the SSM agent uses ``ssmmessages`` when it can
reach it; ``ec2messages`` is its fallback for Run Command, which nothing here uses)."""

USD_PER_ENDPOINT_AZ_HOUR: Final = 0.01
"""An interface endpoint's hourly price per Availability Zone in us-east-1: an estimate (the
rate we know of; the stored copy of https://aws.amazon.com/privatelink/pricing/ confirms the
billing rule, each hour the endpoint is provisioned in each AZ, a partial hour as a full hour,
until it is deleted, and 0.01 USD/GB processed for the first PB, but not the hourly figure)."""
PRICE_AS_OF: Final = "2026-11-25"
PRICE_REGION: Final = "us-east-1"
PRICING_URL: Final = "https://aws.amazon.com/privatelink/pricing/"
HOURS_PER_MONTH: Final = 730
"""AWS's pricing calculator month (365 * 24 / 12)."""
AVAILABILITY_ZONES: Final = 1
"""The network stack puts every endpoint in the one subnet of the spec's AZ."""


def network_usd_per_hour() -> float:
    """What the interface endpoints cost per hour while the network stack exists (the S3
    gateway endpoint, the VPC and the security groups cost nothing; data processed is extra)."""
    return len(INTERFACE_ENDPOINTS) * AVAILABILITY_ZONES * USD_PER_ENDPOINT_AZ_HOUR


def network_usd_per_month() -> float:
    return network_usd_per_hour() * HOURS_PER_MONTH


def network_cost_line(spec: ClusterSpec, spec_path: str) -> str:
    """One line for ``hetero spec check``: the network stack's standing cost and how to stop it
    (``cdk destroy --all`` removes the cluster stack, which depends on it, and then it; the
    checkpoints stay)."""
    return (
        f"network stack {spec.name}-network: {len(INTERFACE_ENDPOINTS)} interface endpoints x "
        f"{AVAILABILITY_ZONES} AZ x {USD_PER_ENDPOINT_AZ_HOUR:.2f} USD/h = "
        f"{network_usd_per_hour():.2f} USD/h, {network_usd_per_month():.2f} USD/month while it "
        f"exists, jobs or none (estimated {PRICE_REGION} rate, noted {PRICE_AS_OF}, "
        f"{PRICING_URL}; data processed extra); stop it: npx cdk destroy --all -c spec={spec_path}"
    )
