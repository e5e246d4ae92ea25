"""The ``docker run`` that starts an instance's launcher: the contract between the stack's user
data (``infra/instance_group.py``, which writes this line into every launch template) and the
image (``containers/Dockerfile``). ``hetero rehearse --image`` runs the same line, with the parts
only an EC2 host has stood in for (``training.rehearsal.containers``).

The line is shell: it reads the variables the user data's earlier steps set: ``HOST_SPEC_DIR``,
``IMAGE``, ``EFA_DEVICES``, ``INSTANCE_ID`` and, on dataprep groups, ``HOST_SHARD_CACHE``.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from training.common.names import (
    DEPLOYED_SPEC_PATH,
    ENV_ASG_NAMES,
    ENV_CHECKPOINT_URI,
    ENV_CLUSTER,
    ENV_GROUP,
    ENV_INSTANCE_ID,
    ENV_JOB_PARAMETER,
    ENV_LIFECYCLE_HOOK,
    ENV_REGION,
    ENV_SHARD_CACHE_DIR,
    ENV_SPEC,
)
from training.common.outcome import CONTAINER_STOP_TIMEOUT_S

CONTAINER_NAME = "hetero"
LAUNCHER_RESTARTS = 5
"""Docker restarts of a launcher that exits non-zero (``docker run --restart on-failure:N``)."""
LOG_MODE = "non-blocking"
"""The awslogs driver's delivery mode. Docker's default, ``blocking``, makes a write to stdout
or stderr wait while the driver cannot send: a CloudWatch Logs throttle would stall the ranks
mid-step into a collective timeout. ``non-blocking`` puts lines in a per-container buffer and
drops them when it is full ("Dropping messages is often preferred to blocking the log-writing
process of an application": https://docs.docker.com/engine/logging/configure/, "Configure the
delivery mode of log messages from container to log driver")."""
LOG_BUFFER_SIZE = "16m"
"""``max-buffer-size`` of that buffer (Docker's default is ``1m``, 1 MB; same page): 16 MB of
host memory at most, a bounded cost next to the instance's GiBs, for room to ride out a
throttle instead of dropping lines at once."""
HOST_SPEC_DIR = str(PurePosixPath(DEPLOYED_SPEC_PATH).parent)
"""Where the user data writes the deployed spec on the host (mounted read-only at the same path)."""


@dataclass(frozen=True)
class LaunchTarget:
    """What one group's instances are told: the cluster's names and the group's own."""

    cluster: str
    group: str
    trainer: bool
    """A trainer group (GPUs, the termination hook); else a dataprep group."""
    checkpoint_uri: str
    job_parameter: str
    asg_names: Sequence[str]
    region: str
    lifecycle_hook: str


@dataclass(frozen=True)
class LogTarget:
    """Where the container's output goes: CloudWatch Logs through Docker's awslogs driver."""

    region: str
    log_group: str


def launcher_environment(target: LaunchTarget) -> dict[str, str]:
    """The container's environment (``-e``), the instance id aside (read from IMDS by the boot)."""
    env = {
        ENV_SPEC: DEPLOYED_SPEC_PATH,
        ENV_CLUSTER: target.cluster,
        ENV_GROUP: target.group,
        ENV_CHECKPOINT_URI: target.checkpoint_uri,
        ENV_JOB_PARAMETER: target.job_parameter,
        ENV_ASG_NAMES: ",".join(target.asg_names),
        ENV_REGION: target.region,
        "AWS_REGION": target.region,
    }
    if target.trainer:
        # The trainer group's termination hook: completed after the checkpoint it asks for.
        env[ENV_LIFECYCLE_HOOK] = target.lifecycle_hook
    return env


def docker_run_line(target: LaunchTarget, logs: LogTarget) -> str:
    """The user data's ``docker run`` of the launcher (one shell line)."""
    gpu_flags = "--gpus all " if target.trainer else ""
    cache = '"$HOST_SHARD_CACHE"'
    cache_flags = (  # the shard cache's host folder (infra/shard_cache.py), same path inside
        "" if target.trainer else f"-v {cache}:{cache} -e {ENV_SHARD_CACHE_DIR}={cache} "
    )
    # Host networking: NCCL, EFA and the data plane's gRPC port see the instance's address.
    # The launcher retries a failed role itself (restart budget); Docker restarts the launcher if
    # it dies, and the restarted one reads the job record before running. The trainer's EMF
    # lines need no log option: CloudWatch Logs extracts metrics from EMF events; the json/emf
    # header is optional
    # (https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/CloudWatch_Embedded_Metric_Format_Generation_PutLogEvents.html).
    # --stop-timeout: a stop without its own timeout (`docker stop`; the daemon's shutdown uses
    # each container's stop timeout too, moby/moby#22566) waits for the role's grace and the
    # launcher's own stop before SIGKILL (CONTAINER_STOP_TIMEOUT_S).
    return (
        f"docker run --detach --restart on-failure:{LAUNCHER_RESTARTS} --name {CONTAINER_NAME} "
        f"--stop-timeout {CONTAINER_STOP_TIMEOUT_S} "
        "--network host --ipc host "
        f"--ulimit memlock=-1 --ulimit stack=67108864 {gpu_flags}$EFA_DEVICES"
        '-v "$HOST_SPEC_DIR:$HOST_SPEC_DIR:ro" '
        f"{cache_flags}"
        f'{env_flags(launcher_environment(target))} -e {ENV_INSTANCE_ID}="$INSTANCE_ID" '
        f"{awslogs_flags(logs, target.group)}"
        f'"$IMAGE" launch --spec {DEPLOYED_SPEC_PATH} --group {target.group}'
    )


def awslogs_flags(logs: LogTarget, group: str) -> str:
    """The log driver part of the line (each instance's stream: ``GROUP/INSTANCE_ID``)."""
    return (
        "--log-driver awslogs "
        f"--log-opt awslogs-region={logs.region} "
        f"--log-opt awslogs-group={logs.log_group} "
        f'--log-opt awslogs-stream={group}/"$INSTANCE_ID" '
        f"--log-opt mode={LOG_MODE} --log-opt max-buffer-size={LOG_BUFFER_SIZE} "
    )


def env_flags(env: Mapping[str, str]) -> str:
    """``-e K=V`` flags, shell-quoted."""
    return " ".join(f"-e {k}={shlex.quote(v)}" for k, v in env.items())
