"""Names shared between processes: the CDK stacks (``infra/``), the launcher that runs on the
instances, the trainer and the data servers it starts, and ``hetero status``.

The stacks tag every instance and pass these environment variables to ``docker run``; the
launcher reads them back and passes its own to the trainer; files in a run folder are read by
another process than the one that writes them. Keeping each name in one module means no two
sides can drift.
"""

from __future__ import annotations

from typing import Final

TAG_CLUSTER: Final = "hetero:cluster"
"""Instance (and Auto Scaling group) tag: the spec's ``name``. Peers are found by this tag."""
TAG_GROUP: Final = "hetero:group"
"""Instance (and Auto Scaling group) tag: the instance group's ``name`` in the spec."""
TAG_ROLE: Final = "hetero:role"
"""Instance (and Auto Scaling group) tag: the group's role, ``trainer`` or ``dataprep``."""
MARKET_SPOT: Final = "spot"
MARKET_ON_DEMAND: Final = "on-demand"
"""The two EC2 markets, as the spec (``Market``), recorded prices and bills name them."""

ENV_SPEC: Final = "HETERO_SPEC"
"""Path, inside the container, of the cluster spec the stack was deployed with."""
ENV_CLUSTER: Final = "HETERO_CLUSTER"
"""The spec's ``name`` (same value as the ``hetero:cluster`` tag)."""
ENV_GROUP: Final = "HETERO_GROUP"
"""The instance group this instance belongs to (same value as the ``hetero:group`` tag)."""
ENV_CHECKPOINT_URI: Final = "HETERO_CHECKPOINT_URI"
"""``s3://bucket/prefix/``: where the trainer writes checkpoints (wins over the spec's
``job.checkpoint.dir``)."""
ENV_INIT_URI: Final = "HETERO_INIT_URI"
"""Where the trainer reads ``job.model.init``'s files instead of the spec's value: the copy of a
``timm:NAME.TAG`` init staged in S3 for instances without internet (``training.common.timm_hub``),
or of an ``s3://`` init in a bucket the roles cannot read (``training.common.s3_init``): the job
pointer's ``init_uri`` on EC2, the training job's environment on SageMaker."""
ENV_JOB_PARAMETER: Final = "HETERO_JOB_PARAMETER"
"""SSM parameter naming the current job (id and checkpoint URI); see ``job_parameter_name``."""
ENV_ASG_NAMES: Final = "HETERO_ASG_NAMES"
"""Comma-separated Auto Scaling group names of the cluster: scaled to zero at job end."""
ENV_LIFECYCLE_HOOK: Final = "HETERO_LIFECYCLE_HOOK"
"""Name of the groups' termination lifecycle hook: the launcher completes it after the
checkpoint that an Auto Scaling termination asked for."""
ENV_INSTANCE_ID: Final = "HETERO_INSTANCE_ID"
"""This instance's id, which the boot read from IMDS: a launcher that cannot reach IMDS later
can still name its instance to take it out of service (``early_exit``)."""
LIFECYCLE_HOOK_NAME: Final = "hetero-checkpoint"
"""The termination lifecycle hook's name on every group of the stack."""
ENV_SHARD_CACHE_DIR: Final = "HETERO_SHARD_CACHE_DIR"
"""Where a prepared dataset's shard cache goes when ``[job.dataset] cache_dir`` is unset: on a
dataprep instance, the host folder ``HOST_SHARD_CACHE_DIR`` (instance store where the type has
it), mounted into the container at the same path."""
HOST_SHARD_CACHE_DIR: Final = "/var/lib/hetero/shards"
"""The shard cache's folder on a dataprep host (and in its container)."""
ENV_REGION: Final = "AWS_DEFAULT_REGION"
"""The region (boto3 reads this variable)."""

ENV_BUDGET_DEADLINE: Final = "HETERO_BUDGET_DEADLINE"
"""Epoch seconds at which the job's budget runs out: the launcher (``training.costs.budget``)
sets it, the trainer stops with a checkpoint then (its ``--max-seconds`` defaults to what is left
of it)."""
ENV_LOADER_WORKERS: Final = "HETERO_LOADER_WORKERS"
"""At most this many data-loader worker processes per trainer rank (``training.data.loader``):
the launcher sets it when the host's ``/dev/shm`` is too small for one worker per core
(``training.launcher.host_checks``)."""
ENV_SAMPLE_LOG_DIR: Final = "HETERO_SAMPLE_LOG_DIR"
"""When set, each trainer rank appends the sample ids of every applied step to
``<dir>/rank-<RANK>.jsonl`` (``training.trainer.sample_log``; the rehearsal reads them)."""

LAST_EVAL_FILE: Final = "last_eval.json"
"""``<run_dir>/last_eval.json``: the last validation record and the targets reached so far
(trainer rank 0; replaced at every evaluation). The EC2 launcher's heartbeat reads it into the job
record, where ``hetero status`` finds it."""
SAGEMAKER_RESOURCECONFIG: Final = "/opt/ml/input/config/resourceconfig.json"
"""SageMaker's description of a training job's hosts and instance groups, on every host."""
SAGEMAKER_CHECKPOINT_DIR: Final = "/opt/ml/checkpoints"
"""The job's ``CheckpointConfig.LocalPath`` (the submission sets it), the trainer's checkpoint
folder on SageMaker (https://docs.aws.amazon.com/sagemaker/latest/dg/model-checkpoints.html)."""
SAGEMAKER_OUTPUT_DIR: Final = "/opt/ml/output/data"
"""The trainer's run folder on SageMaker (the output data folder of the page below)."""
SAGEMAKER_FAILURE_FILE: Final = "/opt/ml/output/failure"
"""Where a failing SageMaker training container writes why: SageMaker returns it as the job's
``FailureReason`` (https://docs.aws.amazon.com/sagemaker/latest/dg/your-algorithms-training-algo-output.html)."""

DEPLOYED_SPEC_PATH: Final = "/opt/hetero/deployed/cluster.toml"
"""Where the stack mounts the spec it was deployed with (``HETERO_SPEC`` points here on EC2)."""

CHECKPOINT_PREFIX: Final = "checkpoints"
"""Key prefix under the checkpoint bucket; the instance role may write only below it."""
METRICS_NAMESPACE: Final = "hetero"
"""CloudWatch metrics namespace of the trainer's embedded-metric-format lines."""
SAGEMAKER_JOB_PREFIX: Final = "sagemaker"
"""Key prefix (in the checkpoint bucket) of every SageMaker job's spec and output; the execution
role may write only there (and under ``checkpoints/``)."""
SAGEMAKER_SPEC_CHANNEL: Final = "spec"
"""Input channel that carries the spec; SageMaker puts File-mode channels at
``/opt/ml/input/data/<channel>/``."""

# Public SSM parameters that name the AMIs, resolved by CloudFormation at deploy time (the
# stacks) and checked by `hetero preflight`: the DLAMI for GPU hosts, the ECS-optimised AL2023
# AMI for dataprep hosts.
TRAINER_AMI_PARAMETER: Final = (
    "/aws/service/deeplearning/ami/x86_64/"
    "base-oss-nvidia-driver-gpu-amazon-linux-2023/latest/ami-id"
)
DATAPREP_AMI_PARAMETER: Final = (
    "/aws/service/ecs/optimized-ami/amazon-linux-2023/recommended/image_id"
)


def asg_name(cluster: str, group: str) -> str:
    """The Auto Scaling group name of ``group`` in cluster ``cluster`` (stable, so IAM can
    name it and the launcher can scale it without a lookup)."""
    return f"{cluster}-{group}"


def job_parameter_name(cluster: str) -> str:
    """The SSM parameter that points at the cluster's current job: ``/hetero/<cluster>/job``."""
    return f"/hetero/{cluster}/job"
