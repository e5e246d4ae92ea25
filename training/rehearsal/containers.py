"""``hetero rehearse --image``: every emulated instance's launcher runs in a real container of its
role's image, started by the stack's own ``docker run`` line (``training.common.launch_line``,
which the user data writes into every launch template): its flags, mounts, environment, stop
timeout and command, with the parts only an EC2 host has stood in for (``STAND_INS``). The
rehearsal's emulators are reached as on a host: the containers share the host's network (the
line's ``--network host``), so each instance's IMDS emulator, moto and the S3 proxy answer on
loopback.

Every container carries the label ``hetero.rehearsal=<run id>`` and the rehearsal's marker
variables, so its processes are found whole (``GroupSimulator``) and a container left by a
rehearsal that was itself killed can be found and removed (``remove_labelled``).
"""

from __future__ import annotations

import contextlib
import os
import resource
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from training.common import call_log
from training.common.launch_line import (
    HOST_SPEC_DIR,
    LAUNCHER_RESTARTS,
    LaunchTarget,
    LogTarget,
    awslogs_flags,
    docker_run_line,
    env_flags,
    launcher_environment,
)
from training.common.names import ENV_INSTANCE_ID
from training.rehearsal.aws import ClusterNames

IMAGE_REPOSITORY = "hetero-train"
"""What ``make images`` tags: ``hetero-train:trainer`` and ``hetero-train:data-server``."""
ROLE_TAGS: Mapping[str, str] = {"trainer": "trainer", "dataprep": "data-server"}
"""The image tag (the Dockerfile target) each role's instances run, as the stack assigns them."""
LABEL = "hetero.rehearsal"
DOCKER_TIMEOUT_S = 60.0
CAP_SYS_RESOURCE = 24
"""linux/capability.h: what raising a hard resource limit takes."""
_RUN_ATTACHED = 'exec "$DOCKER" run '
_LOG_STAND_IN = LogTarget(region="rehearsal", log_group="rehearsal")

STAND_INS: Mapping[str, str] = {
    "--detach --restart": "attached, no restart policy: the container's output goes to the "
    "instance's launcher.log (awslogs on EC2), and a launcher that exits is an event, as in "
    "the process rehearsal",
    "--gpus all": "left out: the trainers run on the CPU",
    "--log-driver awslogs": "left out: no CloudWatch Logs (the output is in launcher.log)",
    "$HOST_SPEC_DIR:$HOST_SPEC_DIR:ro": "the deployed spec's host folder is the instance's "
    "folder of the rehearsal, mounted where the host's is",
    "--name hetero": "one name per instance and rehearsal (one host runs them all)",
    "--ulimit memlock=-1": "kept, unless this host's own hard limit is lower and this process "
    "may not raise it (no CAP_SYS_RESOURCE, as in some sandboxes): then that limit (EFA, the "
    "reason for it, is not rehearsed)",
}
"""What differs from the user data's line, and why (the rest is run as written)."""


class ImageMissing(Exception):
    """An image the rehearsal needs is not on this machine; the message says how to build it."""


def _may_raise_limits() -> bool:
    """Whether this process has CAP_SYS_RESOURCE (which a container's raised limit needs)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return True
    caps = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("CapEff:")), "0")
    return bool(int(caps, 16) & (1 << CAP_SYS_RESOURCE))


def image_for(repository: str, role: str) -> str:
    return f"{repository}:{ROLE_TAGS[role]}"


def check_images(docker: str, repository: str) -> None:
    """Raise ImageMissing naming each role's image that is not on this machine."""
    missing = []
    for role in ROLE_TAGS:
        image = image_for(repository, role)
        inspect = [docker, "image", "inspect", image]
        if subprocess.run(inspect, capture_output=True, timeout=DOCKER_TIMEOUT_S).returncode:
            missing.append(image)
    if missing:
        raise ImageMissing(
            f"no image {', '.join(missing)} on this machine: build both with `make images` "
            f"(containers/Dockerfile's targets, tagged {repository}:{ROLE_TAGS['trainer']} and "
            f"{repository}:{ROLE_TAGS['dataprep']})"
        )


@dataclass(frozen=True)
class ContainerLauncher:
    """Builds each instance's ``docker run`` and removes its container when it ends."""

    docker: str
    repository: str
    names: ClusterNames
    spec_text: str
    run_id: str
    out_dir: Path
    """Mounted at the same path: the sample logs the rehearsal audits are written there."""

    def image(self, role: str) -> str:
        return image_for(self.repository, role)

    def container_name(self, instance_id: str) -> str:
        return f"hetero-{self.run_id[:8]}-{instance_id}"

    def target(self, *, group: str, role: str) -> LaunchTarget:
        """What the stack tells the group's instances, with the rehearsal's names."""
        return LaunchTarget(
            cluster=self.names.cluster,
            group=group,
            trainer=role == "trainer",
            checkpoint_uri=self.names.checkpoint_uri,
            job_parameter=self.names.job_parameter or "",
            asg_names=tuple(self.names.asg_names.values()),
            region=self.names.region,
            lifecycle_hook=self.names.lifecycle_hook,
        )

    def line(self, *, group: str, role: str) -> str:
        """The user data's line for ``group``, stand-ins applied (each must be found)."""
        line = docker_run_line(self.target(group=group, role=role), _LOG_STAND_IN)
        replacements = [
            (f"docker run --detach --restart on-failure:{LAUNCHER_RESTARTS} ", _RUN_ATTACHED),
            ("--name hetero ", '--name "$CONTAINER" --label "$LABEL" '),
            ("$HOST_SPEC_DIR:$HOST_SPEC_DIR:ro", "$REHEARSAL_SPEC_DIR:$HOST_SPEC_DIR:ro"),
            (awslogs_flags(_LOG_STAND_IN, group), "$REHEARSAL_FLAGS "),
        ]
        if role == "trainer":
            replacements.append(("--gpus all ", ""))
        memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
        if memlock != resource.RLIM_INFINITY and not _may_raise_limits():
            replacements.append(("--ulimit memlock=-1 ", f"--ulimit memlock={memlock} "))
        for old, new in replacements:
            if old not in line:
                raise AssertionError(f"the user data's docker run line has no {old!r}: {line}")
            line = line.replace(old, new, 1)
        return line

    def argv(
        self,
        *,
        instance_id: str,
        group: str,
        role: str,
        folder: Path,
        rehearsal_env: Mapping[str, str],
        launcher_args: Sequence[str],
    ) -> list[str]:
        """``bash -c`` of the line, with the variables the user data's earlier steps set on a
        host (the spec written, no EFA device, the instance id from IMDS) and the rehearsal's
        own environment (the emulators' endpoints, its markers) as extra ``-e`` flags. The line's
        own variables must agree with the rehearsal's (same cluster, bucket, groups, region)."""
        spec_dir = folder / "deployed"
        spec_dir.mkdir(parents=True, exist_ok=True)
        (spec_dir / "cluster.toml").write_text(self.spec_text)
        shard_cache = folder / "shards"
        shard_cache.mkdir(exist_ok=True)
        line_env = launcher_environment(self.target(group=group, role=role))
        stack_keys = launcher_environment(self.target(group=group, role="trainer")).keys()
        extra = {}
        for key, value in rehearsal_env.items():
            if key == ENV_INSTANCE_ID or (key in line_env and line_env[key] == value):
                continue  # the line sets it, to the same value
            if key in stack_keys and key not in line_env:
                continue  # the stack does not tell this group (the termination hook: trainers)
            if key in line_env:
                raise AssertionError(
                    f"{key}: the user data sets {line_env[key]!r}, the rehearsal {value!r}"
                )
            extra[key] = value
        mounts = [self.out_dir]
        call_log_dir = os.environ.get(call_log.ENV_CALL_LOG)
        if call_log_dir:  # the rehearsal records the AWS calls: its instances' calls too
            extra[call_log.ENV_CALL_LOG] = call_log_dir
            mounts.append(Path(call_log_dir))
        flags = " ".join(
            [env_flags(extra), *(f"-v {shlex.quote(str(m))}:{shlex.quote(str(m))}" for m in mounts)]
        )
        variables = {
            "DOCKER": self.docker,
            "CONTAINER": self.container_name(instance_id),
            "LABEL": f"{LABEL}={self.run_id}",
            "HOST_SPEC_DIR": HOST_SPEC_DIR,
            "REHEARSAL_SPEC_DIR": str(spec_dir),
            "IMAGE": self.image(role),
            "EFA_DEVICES": "",
            "INSTANCE_ID": instance_id,
            "HOST_SHARD_CACHE": str(shard_cache),
        }
        prelude = "".join(f"{k}={shlex.quote(v)}\n" for k, v in variables.items())
        script = (
            prelude
            + self.line(group=group, role=role).replace("$REHEARSAL_FLAGS", flags)
            + "".join(f" {shlex.quote(a)}" for a in launcher_args)
        )
        return ["bash", "-c", script]

    def remove(self, instance_id: str) -> None:
        """SIGKILL the instance's container and remove it (the instance is gone)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                [self.docker, "rm", "--force", self.container_name(instance_id)],
                capture_output=True,
                timeout=DOCKER_TIMEOUT_S,
            )


def remove_labelled(docker: str, run_id: str | None = None, *, label: str = LABEL) -> list[str]:
    """Remove every container that carries ``label`` (a rehearsal's, by default; ``run_id``:
    that rehearsal's only); their ids."""
    label = label if run_id is None else f"{label}={run_id}"
    found = subprocess.run(
        [docker, "ps", "--all", "--quiet", "--filter", f"label={label}"],
        capture_output=True,
        text=True,
        timeout=DOCKER_TIMEOUT_S,
    ).stdout.split()
    if found:
        subprocess.run(
            [docker, "rm", "--force", *found], capture_output=True, timeout=DOCKER_TIMEOUT_S
        )
    return found


def docker_client() -> str:
    """The ``docker`` to use: ``$HETERO_DOCKER`` (scripts/with_docker.sh sets it), else PATH's."""
    chosen = os.environ.get("HETERO_DOCKER") or shutil.which("docker")
    if not chosen:
        raise ImageMissing("no docker client on PATH: install Docker (see `make images`)")
    return chosen
