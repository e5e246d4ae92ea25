"""Tag keys and environment variable names the launcher shares with the CDK stacks.

The infrastructure side owns them (``training/aws_tags.py``); this module gives the launcher's
modules the names they use, under the launcher's own spelling.
"""

from __future__ import annotations

from training.aws_tags import (
    ENV_ASG_NAMES,
    ENV_CHECKPOINT_URI,
    ENV_CLUSTER,
    ENV_GROUP,
    ENV_INSTANCE_ID,
    ENV_LIFECYCLE_HOOK,
    ENV_REGION,
    ENV_SPEC,
    TAG_CLUSTER,
    TAG_GROUP,
)

CLUSTER_TAG = TAG_CLUSTER
GROUP_TAG = TAG_GROUP

__all__ = [
    "CLUSTER_TAG",
    "ENV_ASG_NAMES",
    "ENV_CHECKPOINT_URI",
    "ENV_CLUSTER",
    "ENV_GROUP",
    "ENV_INSTANCE_ID",
    "ENV_LIFECYCLE_HOOK",
    "ENV_REGION",
    "ENV_SPEC",
    "GROUP_TAG",
]
