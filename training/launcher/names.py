"""Tag keys and environment variable names the launcher shares with the CDK stacks.

The infrastructure side owns these names (``training/aws_tags.py``); they are re-exported here so
the launcher's modules import them from one place.
"""

from __future__ import annotations

CLUSTER_TAG = "hetero:cluster"
"""EC2 tag on every instance of a cluster: the spec's ``name``."""
GROUP_TAG = "hetero:group"
"""EC2 tag on every instance: its instance group's name."""

ENV_GROUP = "HETERO_GROUP"
"""This host's instance group (wins over every other source)."""
ENV_SPEC = "HETERO_SPEC"
"""Path of the cluster spec inside the image."""
ENV_CHECKPOINT_URI = "HETERO_CHECKPOINT_URI"
"""Where checkpoints go (``s3://...`` on EC2, ``/opt/ml/checkpoints`` on SageMaker)."""
ENV_ASG_NAMES = "HETERO_ASG_NAMES"
"""Comma-separated Auto Scaling group names of the cluster (scaled to zero at job end)."""
ENV_REGION = "AWS_REGION"
