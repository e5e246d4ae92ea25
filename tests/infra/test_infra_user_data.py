"""The user data as a script: the launch template's user data, taken from the synthesized
template, runs under bash with stand-in `dnf`, `docker`, `curl`, `aws`, `sleep` and `shutdown` on
PATH. The tests assert the exact command sequence, the retries, the failure when a step never
succeeds (ending in ``shutdown -h now``, which the launch template turns into a termination) and
the restart policy the launcher runs under.

Only the lines that name host paths are rewritten before running: where the spec and Docker's
configuration go (``HOST_SPEC_DIR=``, ``export DOCKER_CONFIG=``) and, on dataprep hosts, the shard
cache's folder and what the boot reads to choose its volume (``HOST_SHARD_CACHE=``, ``SYS_BLOCK=``,
``PROC_MOUNTS=``), so the test writes and reads under its own folder: a fake sysfs of NVMe
volumes (model and size) and a fake mounts table. The instance store tests of specs with
``cache_gb`` take the script from ``user_data_script`` itself (the function the launch template's
user data comes from) rather than synthesizing a stack per spec."""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from infra_support import SPOT_SPEC, BuiltApp, build

from infra.instance_group import user_data_script
from training.common import aws
from training.common.outcome import CONTAINER_STOP_TIMEOUT_S, LAUNCHER_STOP_S, ROLE_STOP_GRACE_S
from training.launcher import launch
from training.launcher.loop_settings import LoopSettings
from training.spec import parse_spec

REGION = "eu-west-1"
ACCOUNT = "111122223333"
BUCKET = "vit-spot-checkpoints-bucket"
LOG_GROUP = "vit-spot-cluster-ContainerLogs-abc"
REGISTRY = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com"
INSTANCE_ID = "i-0123456789abcdef0"

# One stand-in for every host command: it appends [name, argv] to $STUB_LOG and fails the first
# $STUB_FAIL_<NAME> calls of that name ($STUB_FAIL_DOCKER_RUN: every `docker run`). curl answers
# IMDS's token and instance-id requests.
# The exact dnf argv: Amazon Linux 2023's core repository only (its id, ``amazonlinux``:
# https://docs.aws.amazon.com/linux/al2023/ug/repo-metadata-signing.html), never another repository
# an AMI carries (NVIDIA's on the GPU AMI), which the isolated subnet cannot reach.
DNF_ONLY_AL2023 = ["--disablerepo=*", "--enablerepo=amazonlinux", "install", "-y"]
DNF_DOCKER = [*DNF_ONLY_AL2023, "docker"]
DNF_HELPER = [*DNF_ONLY_AL2023, "amazon-ecr-credential-helper"]

STUB = f"""#!{sys.executable}
import json, os, sys
DNF_DOCKER = {DNF_DOCKER!r}
name = os.path.basename(sys.argv[0])
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps([name, sys.argv[1:]]) + "\\n")
counter = os.path.join(os.environ["STUB_DIR"], name + ".calls")
calls = int(open(counter).read()) + 1 if os.path.exists(counter) else 1
open(counter, "w").write(str(calls))
if name == "docker" and sys.argv[1:2] == ["run"] and os.environ.get("STUB_FAIL_DOCKER_RUN"):
    sys.exit("docker: stand-in failure of docker run")
if calls <= int(os.environ.get("STUB_FAIL_" + name.upper(), "0")):
    print(name + ": stand-in failure " + str(calls), file=sys.stderr)
    sys.exit(1)
if name == "dnf" and sys.argv[1:] == DNF_DOCKER:
    # "installs" Docker: the stand-in docker appears on PATH
    me = open(sys.argv[0]).read()
    path = os.path.join(os.path.dirname(sys.argv[0]), "docker")
    open(path, "w").write(me)
    os.chmod(path, 0o755)
if name == "curl":
    print("TOKEN" if "PUT" in sys.argv else "{INSTANCE_ID}", end="")
if name == "aws":
    sys.exit("the AMIs have no AWS CLI: the user data must not call aws")
"""


def _resolve(value: Any, logical_ids: dict[str, str]) -> str:
    """Render one template value the way CloudFormation would, with this test's account."""
    if isinstance(value, str):
        return value
    if "Fn::Join" in value:
        sep, parts = value["Fn::Join"]
        return str(sep).join(_resolve(p, logical_ids) for p in parts)
    if "Fn::Sub" in value:
        pseudo = {
            "AWS::Region": REGION,
            "AWS::AccountId": ACCOUNT,
            "AWS::URLSuffix": "amazonaws.com",
        }
        return re.sub(r"\$\{([^}]+)\}", lambda m: pseudo[m[1]], value["Fn::Sub"])
    if "Ref" in value:
        return {"AWS::Region": REGION, "AWS::AccountId": ACCOUNT}.get(
            value["Ref"], logical_ids.get(value["Ref"], value["Ref"])
        )
    raise AssertionError(f"unexpected token in user data: {value}")


@pytest.fixture(scope="module")
def spot(tmp_path_factory: pytest.TempPathFactory) -> BuiltApp:
    return build(tmp_path_factory.mktemp("userdata"), SPOT_SPEC)


def _script(built: BuiltApp, group: str) -> str:
    cluster = built.stacks.cluster
    fleet = cluster.fleets[group]
    cfn = fleet.launch_template.node.default_child
    assert isinstance(cfn, cdk.CfnResource)
    data = built.cluster.find_resources("AWS::EC2::LaunchTemplate")[cluster.get_logical_id(cfn)]
    raw = data["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]
    log_cfn = cluster.log_group.node.default_child
    bucket_cfn = cluster.checkpoints.bucket.node.default_child
    assert isinstance(log_cfn, cdk.CfnResource) and isinstance(bucket_cfn, cdk.CfnResource)
    ids = {cluster.get_logical_id(log_cfn): LOG_GROUP, cluster.get_logical_id(bucket_cfn): BUCKET}
    return _resolve(raw, ids)


class Boot:
    """Runs a user data script in a temporary host layout with the stand-ins on PATH."""

    def __init__(
        self,
        tmp: Path,
        script: str,
        *,
        docker_installed: bool = True,
        nvme: Mapping[str, str] | None = None,
        sizes: Mapping[str, int] | None = None,
        mounted: Sequence[str] = (),
    ) -> None:
        """``nvme``: the host's NVMe disks, name to model as sysfs gives it (padded);
        ``sizes``: their sizes in bytes (written as sysfs does, in 512-byte sectors; a disk
        without one has no ``size`` file); ``mounted``: the disks the mounts table lists."""
        self.tmp = tmp
        self.spec_dir = tmp / "host" / "deployed"
        self.docker_config = tmp / "host" / "docker"
        self.shard_cache = tmp / "host" / "shards"
        self.docker_unit_dir = tmp / "host" / "docker.service.d"
        self.sys_block = tmp / "sys" / "block"
        for disk, model in (nvme or {}).items():
            (self.sys_block / disk / "device").mkdir(parents=True)
            (self.sys_block / disk / "device" / "model").write_text(model)
        for disk, size in (sizes or {}).items():
            assert size % 512 == 0, size
            (self.sys_block / disk / "size").write_text(f"{size // 512}\n")
        self.sys_block.mkdir(parents=True, exist_ok=True)
        self.proc_mounts = tmp / "proc" / "mounts"
        self.proc_mounts.parent.mkdir()
        self.proc_mounts.write_text(
            "".join(f"/dev/{disk} /data/{disk} xfs rw,noatime 0 0\n" for disk in mounted)
            + "/dev/nvme0n1p1 / xfs rw,noatime 0 0\n"
        )
        lines = script.splitlines()
        assert "HOST_SPEC_DIR=/opt/hetero/deployed" in lines
        assert "export DOCKER_CONFIG=/root/.docker" in lines
        self.script = (
            script.replace("HOST_SPEC_DIR=/opt/hetero/deployed", f"HOST_SPEC_DIR={self.spec_dir}")
            .replace(
                "export DOCKER_CONFIG=/root/.docker", f"export DOCKER_CONFIG={self.docker_config}"
            )
            .replace(
                "HOST_SHARD_CACHE=/var/lib/hetero/shards", f"HOST_SHARD_CACHE={self.shard_cache}"
            )
            .replace("SYS_BLOCK=/sys/block", f"SYS_BLOCK={self.sys_block}")
            .replace(
                "DOCKER_UNIT_DIR=/etc/systemd/system/docker.service.d",
                f"DOCKER_UNIT_DIR={self.docker_unit_dir}",
            )
            .replace("PROC_MOUNTS=/proc/mounts", f"PROC_MOUNTS={self.proc_mounts}")
        )
        self.bin = tmp / "bin"
        self.bin.mkdir()
        for name in (
            "dnf", "docker", "curl", "aws", "sleep", "systemctl", "nvidia-ctk", "shutdown",
            "mkfs.xfs", "mount",
        ):  # fmt: skip
            (self.bin / name).write_text(STUB)
            (self.bin / name).chmod(0o755)
        if not docker_installed:
            (self.bin / "docker").unlink()
        # The host's own tools, but never a real Docker: on a machine that has one, a boot
        # "without Docker" would find it and pull from a registry.
        self.system_bin = tmp / "system-bin"
        self.system_bin.mkdir()
        for folder in (Path("/usr/bin"), Path("/bin")):
            for tool in folder.iterdir():
                link = self.system_bin / tool.name
                if not tool.name.startswith("docker") and not link.exists():
                    link.symlink_to(tool)
        self.log = tmp / "calls.jsonl"

    def run(self, **fail: int) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": f"{self.bin}{os.pathsep}{self.system_bin}",
            "STUB_LOG": str(self.log),
            "STUB_DIR": str(self.tmp),
            **{f"STUB_FAIL_{name.upper()}": str(n) for name, n in fail.items()},
        }
        path = self.tmp / "user-data.sh"
        path.write_text(self.script)
        return subprocess.run(
            ["bash", str(path)], env=env, capture_output=True, text=True, timeout=60
        )

    def calls(self) -> list[tuple[str, list[str]]]:
        if not self.log.exists():
            return []
        return [tuple(json.loads(line)) for line in self.log.read_text().splitlines()]  # type: ignore[misc]


def _image(built: BuiltApp, group: str = "dataprep") -> str:
    """The image ``group`` runs: the trainer's, or the CPU-only data-server image."""
    images = built.stacks.cluster.image
    uri = images.image_uri if group == "trainer" else images.data_server_image_uri
    image = _resolve(built.stacks.cluster.resolve(uri), {})
    assert image.startswith(f"{REGISTRY}/cdk-hnb659fds-container-assets-{ACCOUNT}-{REGION}:")
    return image


def _expected_run(image: str, group: str, trainer: bool, boot: Boot) -> list[str]:
    env = [
        "HETERO_SPEC=/opt/hetero/deployed/cluster.toml",
        "HETERO_CLUSTER=vit-spot",
        f"HETERO_GROUP={group}",
        f"HETERO_CHECKPOINT_URI=s3://{BUCKET}/checkpoints/",
        "HETERO_JOB_PARAMETER=/hetero/vit-spot/job",
        "HETERO_ASG_NAMES=vit-spot-trainer,vit-spot-dataprep",
        f"AWS_DEFAULT_REGION={REGION}",
        f"AWS_REGION={REGION}",
    ]
    if trainer:
        env.append("HETERO_LIFECYCLE_HOOK=hetero-checkpoint")
    env.append(f"HETERO_INSTANCE_ID={INSTANCE_ID}")  # as the boot read it from IMDS
    return [
        "run", "--detach", "--restart", "on-failure:5", "--name", "hetero",
        "--stop-timeout", "130",  # the launcher's grace (90 s) + its own stop (40 s)
        "--network", "host", "--ipc", "host",
        "--ulimit", "memlock=-1", "--ulimit", "stack=67108864",
        *(["--gpus", "all"] if trainer else []),
        "-v", f"{boot.spec_dir}:{boot.spec_dir}:ro",
        # dataprep: the shard cache's host folder, at the same path, named to the launcher
        *([] if trainer else [
            "-v", f"{boot.shard_cache}:{boot.shard_cache}",
            "-e", f"HETERO_SHARD_CACHE_DIR={boot.shard_cache}",
        ]),
        *[arg for pair in (("-e", e) for e in env) for arg in pair],
        "--log-driver", "awslogs",
        "--log-opt", f"awslogs-region={REGION}",
        "--log-opt", f"awslogs-group={LOG_GROUP}",
        "--log-opt", f"awslogs-stream={group}/{INSTANCE_ID}",
        # a CloudWatch Logs throttle drops lines past a 16 MB buffer, never blocks a rank
        "--log-opt", "mode=non-blocking", "--log-opt", "max-buffer-size=16m",
        image, "launch", "--spec", "/opt/hetero/deployed/cluster.toml", "--group", group,
    ]  # fmt: skip


@pytest.mark.parametrize(("group", "trainer"), [("trainer", True), ("dataprep", False)])
def test_boot_installs_the_credential_helper_pulls_and_runs_the_launcher(
    spot: BuiltApp, tmp_path: Path, group: str, trainer: bool
) -> None:
    boot = Boot(tmp_path, _script(spot, group))
    result = boot.run()
    assert result.returncode == 0, result.stderr
    image = _image(spot, group)
    run = _expected_run(image, group, trainer, boot)
    assert boot.calls() == [
        ("systemctl", ["daemon-reload"]),
        ("systemctl", ["enable", "--now", "docker"]),
        ("dnf", DNF_HELPER),
        ("docker", ["pull", image]),
        ("curl", ["-sf", "-X", "PUT", "http://169.254.169.254/latest/api/token",
                  "-H", "X-aws-ec2-metadata-token-ttl-seconds: 60"]),
        ("curl", ["-sf", "-H", "X-aws-ec2-metadata-token: TOKEN",
                  "http://169.254.169.254/latest/meta-data/instance-id"]),
        ("docker", run),
    ]  # fmt: skip
    # docker.service may take longer to stop than the launcher's container (systemd's default
    # stop timeout, 90 s, is less than --stop-timeout 130), and the drop-in came before the
    # daemon-reload that loads it.
    drop_in = (boot.docker_unit_dir / "hetero-stop-timeout.conf").read_text()
    assert drop_in == f"[Service]\nTimeoutStopSec={CONTAINER_STOP_TIMEOUT_S + 30}\n"
    assert int(run[run.index("--stop-timeout") + 1]) + 5 < CONTAINER_STOP_TIMEOUT_S + 30
    # Docker asks the credential helper for this registry: no `aws ecr get-login-password`.
    config = json.loads((boot.docker_config / "config.json").read_text())
    assert config == {"credHelpers": {REGISTRY: "ecr-login"}}
    # The spec arrives at run time, byte for byte.
    assert (boot.spec_dir / "cluster.toml").read_text() == SPOT_SPEC


def test_network_steps_are_retried_until_they_succeed(spot: BuiltApp, tmp_path: Path) -> None:
    boot = Boot(tmp_path, _script(spot, "dataprep"))
    result = boot.run(docker=2, curl=1)
    assert result.returncode == 0, result.stderr
    names = [(name, argv[0]) for name, argv in boot.calls()]
    assert names == [
        ("systemctl", "daemon-reload"),
        ("systemctl", "enable"),
        ("dnf", "--disablerepo=*"),
        ("docker", "pull"), ("sleep", "20"),
        ("docker", "pull"), ("sleep", "20"),
        ("docker", "pull"),
        ("curl", "-sf"), ("sleep", "20"),  # the token request failed once
        ("curl", "-sf"), ("curl", "-sf"),
        ("docker", "run"),
    ]  # fmt: skip
    assert 'hetero boot: "docker pull' in result.stderr and "(attempt 2 of 6)" in result.stderr


def test_a_step_that_never_succeeds_stops_the_boot_with_a_message(
    spot: BuiltApp, tmp_path: Path
) -> None:
    boot = Boot(tmp_path, _script(spot, "dataprep"))
    result = boot.run(dnf=99)
    assert result.returncode != 0
    calls = boot.calls()
    assert calls == [
        ("systemctl", ["daemon-reload"]),
        ("systemctl", ["enable", "--now", "docker"]),
    ] + [
        ("dnf", DNF_HELPER), ("sleep", ["20"])
    ] * 5 + [("dnf", DNF_HELPER), ("shutdown", ["-h", "now"])]  # fmt: skip
    assert not [c for c in calls if c[0] == "docker"]  # no pull, no launcher without the helper
    assert (
        'giving up on "dnf --disablerepo=* --enablerepo=amazonlinux install -y '
        'amazon-ecr-credential-helper"'
    ) in result.stderr
    # The give-up point takes the instance out of service: the OS shutdown terminates it (the
    # launch template's shutdown behaviour) and the group replaces it. No AWS CLI involved.
    assert "shutting down: this instance terminates and its group replaces it" in result.stderr


@pytest.mark.parametrize(("group", "trainer"), [("trainer", True), ("dataprep", False)])
def test_a_failed_docker_run_shuts_the_instance_down(
    spot: BuiltApp, tmp_path: Path, group: str, trainer: bool
) -> None:
    """`docker run` is not retried: when it fails, `set -e` ends the script and the EXIT trap
    shuts the instance down, after exactly the boot's commands."""
    boot = Boot(tmp_path, _script(spot, group))
    result = boot.run(docker=1, docker_run=1)  # the pull fails once (retried), then the run
    assert result.returncode != 0
    image = _image(spot, group)
    run = _expected_run(image, group, trainer, boot)
    assert boot.calls() == [
        ("systemctl", ["daemon-reload"]),
        ("systemctl", ["enable", "--now", "docker"]),
        ("dnf", DNF_HELPER),
        ("docker", ["pull", image]),
        ("sleep", ["20"]),
        ("docker", ["pull", image]),
        ("curl", ["-sf", "-X", "PUT", "http://169.254.169.254/latest/api/token",
                  "-H", "X-aws-ec2-metadata-token-ttl-seconds: 60"]),
        ("curl", ["-sf", "-H", "X-aws-ec2-metadata-token: TOKEN",
                  "http://169.254.169.254/latest/meta-data/instance-id"]),
        ("docker", run),
        ("shutdown", ["-h", "now"]),
    ]  # fmt: skip
    assert "the boot failed (exit 1)" in result.stderr


def test_a_boot_that_succeeds_does_not_shut_down(spot: BuiltApp, tmp_path: Path) -> None:
    boot = Boot(tmp_path, _script(spot, "dataprep"))
    assert boot.run().returncode == 0
    assert "shutdown" not in [name for name, _ in boot.calls()]


def test_user_data_decodes_in_the_launch_template(spot: BuiltApp) -> None:
    """The spec travels base64-encoded in the script; it must decode to the spec exactly."""
    script = _script(spot, "trainer")
    encoded = re.search(r"^echo (\S+) \| base64 -d", script, re.MULTILINE)
    assert encoded is not None
    assert base64.b64decode(encoded[1]).decode() == SPOT_SPEC


@pytest.mark.parametrize(("group", "trainer"), [("trainer", True), ("dataprep", False)])
def test_docker_is_installed_when_the_ami_lacks_it(
    spot: BuiltApp, tmp_path: Path, group: str, trainer: bool
) -> None:
    """The DLAMI's release notes do not list Docker: the boot installs it (and, on GPU hosts,
    registers the NVIDIA runtime that `--gpus all` needs) before anything uses it."""
    boot = Boot(tmp_path, _script(spot, group), docker_installed=False)
    result = boot.run(dnf=1)
    assert result.returncode == 0, result.stderr
    first = [(name, argv) for name, argv in boot.calls()][:6]
    assert (
        first
        == [
            ("dnf", DNF_DOCKER),  # failed once: retried
            ("sleep", ["20"]),
            ("dnf", DNF_DOCKER),
            *([("nvidia-ctk", ["runtime", "configure", "--runtime=docker"])] if trainer else []),
            ("systemctl", ["daemon-reload"]),
            ("systemctl", ["enable", "--now", "docker"]),
            *([] if trainer else [("dnf", DNF_HELPER)]),
        ][:6]
    )
    assert boot.calls()[-1][1][0] == "run"


# sysfs pads an NVMe model to the field's 40 characters.
EBS_MODEL = f"{'Amazon Elastic Block Store':<40}\n"
INSTANCE_STORE_MODEL = f"{'Amazon EC2 NVMe Instance Storage':<40}\n"


def test_dataprep_puts_the_shard_cache_on_instance_store(spot: BuiltApp, tmp_path: Path) -> None:
    """A type with NVMe instance store: the boot formats the first such volume (not the EBS root
    volume, whichever name the driver gave it) and mounts it on the cache folder the launcher
    gets, before the launcher starts."""
    nvme = {"nvme0n1": INSTANCE_STORE_MODEL, "nvme1n1": EBS_MODEL, "nvme2n1": INSTANCE_STORE_MODEL}
    boot = Boot(tmp_path, _script(spot, "dataprep"), nvme=nvme)
    result = boot.run()
    assert result.returncode == 0, result.stderr
    calls = boot.calls()
    pull = calls.index(("docker", ["pull", _image(spot)]))
    assert calls[pull + 1 : pull + 3] == [
        ("mkfs.xfs", ["-f", "-K", "/dev/nvme0n1"]),
        ("mount", ["-o", "noatime", "/dev/nvme0n1", str(boot.shard_cache)]),
    ]
    assert [name for name, _ in calls].count("mkfs.xfs") == 1  # one volume is enough
    assert calls[-1] == ("docker", _expected_run(_image(spot), "dataprep", False, boot))
    assert "the shard cache is on instance store /dev/nvme0n1" in result.stdout


def test_without_instance_store_the_cache_is_on_the_root_volume(
    spot: BuiltApp, tmp_path: Path
) -> None:
    boot = Boot(tmp_path, _script(spot, "dataprep"), nvme={"nvme0n1": EBS_MODEL})
    result = boot.run()
    assert result.returncode == 0, result.stderr
    names = [name for name, _ in boot.calls()]
    assert "mkfs.xfs" not in names and "mount" not in names
    assert boot.shard_cache.is_dir()  # the folder the container mounts exists
    assert boot.calls()[-1] == ("docker", _expected_run(_image(spot), "dataprep", False, boot))
    assert (
        "no instance store volume is free; the shard cache is on the root volume" in result.stdout
    )


def test_a_failed_format_leaves_the_cache_on_the_root_volume(
    spot: BuiltApp, tmp_path: Path
) -> None:
    """The cache is an optimisation: a volume that cannot be formatted must not stop the boot
    (which would shut the instance down)."""
    boot = Boot(tmp_path, _script(spot, "dataprep"), nvme={"nvme1n1": INSTANCE_STORE_MODEL})
    result = boot.run(**{"mkfs.xfs": 1})
    assert result.returncode == 0, result.stderr
    names = [name for name, _ in boot.calls()]
    assert "mount" not in names and "shutdown" not in names
    assert boot.calls()[-1] == ("docker", _expected_run(_image(spot), "dataprep", False, boot))
    assert "could not format or mount instance store /dev/nvme1n1" in result.stderr


def test_trainers_leave_instance_store_alone(spot: BuiltApp, tmp_path: Path) -> None:
    """The data servers read the shards; the trainer's boot neither formats nor mounts anything
    (a trainer that augments on its own host caches shards in its container's temporary
    folder, on the root volume)."""
    boot = Boot(tmp_path, _script(spot, "trainer"), nvme={"nvme1n1": INSTANCE_STORE_MODEL})
    assert boot.run().returncode == 0
    names = [name for name, _ in boot.calls()]
    assert "mkfs.xfs" not in names and "mount" not in names


# Volume sizes as AWS lists them (training/instance_types.py): one c6id.2xlarge volume (474 GB),
# one c6id.4xlarge volume (950 GB).
GB = 10**9
SMALL_STORE = 474 * GB
BIG_STORE = 950 * GB
CACHE_SPEC = SPOT_SPEC.replace(
    "[job]\nsteps = 100\n",
    '[job]\nsteps = 100\n[job.dataset]\nsource = "shards"\npath = "s3://d/imagenet/"\n',
)
IMAGE = f"{REGISTRY}/hetero:test"


def _dataprep_script(cache_gb: float | None) -> str:
    """The dataprep group's user data for ``SPOT_SPEC`` reading shards, with ``cache_gb``."""
    text = CACHE_SPEC + (f"cache_gb = {cache_gb}\n" if cache_gb is not None else "")
    spec = parse_spec(tomllib.loads(text))
    assert spec.job.dataset.cache_gb == cache_gb
    return "\n".join(
        user_data_script(
            spec=spec,
            group=spec.group("dataprep"),
            spec_text=text,
            image_uri=IMAGE,
            region=REGION,
            log_group_name=LOG_GROUP,
            checkpoint_uri=f"s3://{BUCKET}/checkpoints/",
            asg_names=["vit-spot-trainer", "vit-spot-dataprep"],
        )
    )


@pytest.mark.parametrize(
    ("cache_gb", "nvme", "sizes", "mounted", "chosen", "skipped"),
    [
        pytest.param(
            500,
            {
                "nvme0n1": EBS_MODEL,
                "nvme1n1": INSTANCE_STORE_MODEL,
                "nvme2n1": INSTANCE_STORE_MODEL,
            },
            {"nvme0n1": 100 * GB, "nvme1n1": SMALL_STORE, "nvme2n1": BIG_STORE},
            (),
            "nvme2n1",
            ("nvme1n1",),
            id="the first volume that holds the cache, past a smaller one",
        ),
        pytest.param(
            500,
            {"nvme0n1": EBS_MODEL, "nvme1n1": INSTANCE_STORE_MODEL},
            {"nvme0n1": 2000 * GB, "nvme1n1": SMALL_STORE},
            (),
            None,
            ("nvme1n1",),
            id="every instance store volume too small (a bigger EBS volume is not one)",
        ),
        pytest.param(
            500,
            {"nvme1n1": INSTANCE_STORE_MODEL, "nvme2n1": INSTANCE_STORE_MODEL},
            {"nvme1n1": BIG_STORE, "nvme2n1": BIG_STORE},
            ("nvme1n1",),
            "nvme2n1",
            (),
            id="a volume already mounted is left alone",
        ),
        pytest.param(
            500,
            {"nvme1n1": INSTANCE_STORE_MODEL},
            {"nvme1n1": 500 * GB},
            (),
            "nvme1n1",
            (),
            id="exactly cache_gb is enough",
        ),
        pytest.param(
            500,
            {"nvme1n1": INSTANCE_STORE_MODEL},
            {"nvme1n1": 500 * GB - 512},
            (),
            None,
            ("nvme1n1",),
            id="one sector short is not",
        ),
        pytest.param(
            None,
            {"nvme1n1": INSTANCE_STORE_MODEL},
            {"nvme1n1": SMALL_STORE},
            (),
            "nvme1n1",
            (),
            id="no cache_gb: any instance store volume",
        ),
    ],
)
def test_instance_store_holds_the_cache_only_when_big_enough(
    tmp_path: Path,
    cache_gb: float | None,
    nvme: dict[str, str],
    sizes: dict[str, int],
    mounted: tuple[str, ...],
    chosen: str | None,
    skipped: tuple[str, ...],
) -> None:
    """An explicit ``cache_gb`` is a cap the cache fills (``shard_source.py``): a volume smaller
    than it would run out of space, so the boot passes it over, and with none big enough the
    cache stays on the root volume (which the stack grew for it: ``root_volume_gib``)."""
    boot = Boot(tmp_path, _dataprep_script(cache_gb), nvme=nvme, sizes=sizes, mounted=mounted)
    result = boot.run()
    assert result.returncode == 0, result.stderr
    calls = boot.calls()
    disk_calls = [(name, argv) for name, argv in calls if name in ("mkfs.xfs", "mount")]
    if chosen is None:
        assert disk_calls == []
        assert (
            "hetero boot: no instance store volume of at least 500000000000 bytes (cache_gb 500) "
            "is free; the shard cache is on the root volume"
        ) in result.stdout.splitlines()
    else:
        assert disk_calls == [
            ("mkfs.xfs", ["-f", "-K", f"/dev/{chosen}"]),
            ("mount", ["-o", "noatime", f"/dev/{chosen}", str(boot.shard_cache)]),
        ]
        assert f"hetero boot: the shard cache is on instance store /dev/{chosen}" in result.stdout
    # Each instance store volume passed over for its size is named, with both sizes.
    assert [line for line in result.stderr.splitlines() if "not used for the cache" in line] == [
        f"hetero boot: instance store /dev/{disk} has {sizes[disk]} bytes, less than the shard "
        "cache asks for (cache_gb 500: 500000000000 bytes); not used for the cache"
        for disk in skipped
    ]
    assert calls[-1] == ("docker", _expected_run(IMAGE, "dataprep", False, boot))


@pytest.mark.parametrize("group", ["trainer", "dataprep"])
def test_a_stop_outlasts_the_launchers_grace_and_logs_never_block(
    spot: BuiltApp, tmp_path: Path, group: str
) -> None:
    """Docker sends SIGKILL ``--stop-timeout`` seconds after SIGTERM (10 s when unset:
    https://docs.docker.com/reference/cli/docker/container/stop/); it must outlast the grace
    the launcher gives its role to checkpoint (``hetero launch --grace``'s default) plus the
    launcher's own last write, one AWS call at its client's bound. The awslogs driver must not
    block a rank's write to stdout when CloudWatch Logs throttles."""
    boot = Boot(tmp_path, _script(spot, group))
    assert boot.run().returncode == 0
    run = boot.calls()[-1][1]
    assert run[0] == "run"
    stop_timeout = int(run[run.index("--stop-timeout") + 1])
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    grace = parser.parse_args([]).grace
    assert grace == ROLE_STOP_GRACE_S == LoopSettings().grace_s
    assert stop_timeout == CONTAINER_STOP_TIMEOUT_S == grace + LAUNCHER_STOP_S
    assert stop_timeout > grace
    assert LAUNCHER_STOP_S >= aws.MAX_ATTEMPTS * (aws.CONNECT_TIMEOUT_S + aws.READ_TIMEOUT_S)
    log_opts = [run[i + 1] for i, arg in enumerate(run) if arg == "--log-opt"]
    assert "mode=non-blocking" in log_opts
    (buffer,) = [o for o in log_opts if o.startswith("max-buffer-size=")]
    assert buffer == "max-buffer-size=16m"  # bounded, 16x Docker's 1m default
