"""`hetero rehearse --image`'s launch (training.rehearsal.containers), without Docker: the command
is the user data's own `docker run` line with exactly the named stand-ins, the rehearsal's names
must agree with what the stack would pass, and a missing image is named with how to build it.
(tests/images/test_image_rehearsal.py runs it for real.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from training.common.launch_line import LaunchTarget, LogTarget, docker_run_line
from training.rehearsal import containers
from training.rehearsal.aws import ClusterNames
from training.rehearsal.containers import (
    STAND_INS,
    ContainerLauncher,
    ImageMissing,
    check_images,
)

NAMES = ClusterNames(
    cluster="rehearsal",
    region="us-east-1",
    bucket="rehearsal-checkpoints",
    checkpoint_prefix="checkpoints/rehearsal/",
    asg_names={"trainer": "rehearsal-trainer", "dataprep": "rehearsal-dataprep"},
    job_parameter="/hetero/rehearsal/job",
)


def launcher(tmp_path: Path, docker: str = "/usr/bin/docker") -> ContainerLauncher:
    return ContainerLauncher(
        docker=docker,
        repository="hetero-train",
        names=NAMES,
        spec_text='name = "rehearsal"\n',
        run_id="0123456789abcdef",
        out_dir=tmp_path / "out",
    )


def user_data_line(role: str) -> str:
    """The stack's line for the group (what infra/instance_group.py writes)."""
    target = LaunchTarget(
        cluster="rehearsal", group=role, trainer=role == "trainer",
        checkpoint_uri="s3://rehearsal-checkpoints/checkpoints/rehearsal/",
        job_parameter="/hetero/rehearsal/job",
        asg_names=("rehearsal-trainer", "rehearsal-dataprep"), region="us-east-1",
        lifecycle_hook="hetero-checkpoint",
    )  # fmt: skip
    return docker_run_line(target, LogTarget(region="us-east-1", log_group="logs"))


@pytest.mark.parametrize("role", ["trainer", "dataprep"])
@pytest.mark.parametrize("may_raise_limits", [True, False])
def test_the_line_is_the_user_datas_with_only_the_stand_ins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, role: str, may_raise_limits: bool
) -> None:
    monkeypatch.setattr(containers, "_may_raise_limits", lambda: may_raise_limits)
    monkeypatch.setattr(containers.resource, "getrlimit", lambda _: (8388608, 8388608))
    expected = (
        user_data_line(role)
        .replace(
            "docker run --detach --restart on-failure:5 --name hetero ",
            'exec "$DOCKER" run --name "$CONTAINER" --label "$LABEL" ',
        )
        .replace("--gpus all ", "")
        .replace("$HOST_SPEC_DIR:$HOST_SPEC_DIR:ro", "$REHEARSAL_SPEC_DIR:$HOST_SPEC_DIR:ro")
    )
    expected = re.sub(r"--log-driver awslogs (--log-opt \S+ )+", "$REHEARSAL_FLAGS ", expected)
    if not may_raise_limits:
        expected = expected.replace("--ulimit memlock=-1 ", "--ulimit memlock=8388608 ")
    assert launcher(tmp_path).line(group=role, role=role) == expected
    assert "--stop-timeout 130 --network host --ipc host" in expected
    # Every stand-in is named in the report's list.
    assert {"--detach --restart", "--gpus all", "--log-driver awslogs"} <= set(STAND_INS)


def test_the_rehearsal_env_goes_in_and_the_stacks_own_names_must_agree(tmp_path: Path) -> None:
    made = launcher(tmp_path)
    folder = tmp_path / "out" / "instances" / "i-1"
    folder.mkdir(parents=True)
    env = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:5000",
        "HETERO_CLUSTER": "rehearsal",  # what the stack passes too: not repeated
        "HETERO_LIFECYCLE_HOOK": "hetero-checkpoint",  # the stack tells trainers only
        "HETERO_INSTANCE_ID": "i-1",  # the line's own $INSTANCE_ID
    }
    argv = made.argv(
        instance_id="i-1", group="dataprep", role="dataprep", folder=folder,
        rehearsal_env=env, launcher_args=["--poll", "1"],
    )  # fmt: skip
    assert argv[:2] == ["bash", "-c"]
    script = argv[2]
    assert (folder / "deployed" / "cluster.toml").read_text() == 'name = "rehearsal"\n'
    assert "-e AWS_ENDPOINT_URL=http://127.0.0.1:5000" in script
    assert script.count("HETERO_CLUSTER=") == 1 and "HETERO_LIFECYCLE_HOOK" not in script
    assert f"-v {tmp_path / 'out'}:{tmp_path / 'out'}" in script
    launch = "launch --spec /opt/hetero/deployed/cluster.toml --group dataprep --poll 1"
    assert script.endswith(launch)
    with pytest.raises(AssertionError, match="HETERO_CLUSTER: the user data sets 'rehearsal'"):
        made.argv(
            instance_id="i-1", group="dataprep", role="dataprep", folder=folder,
            rehearsal_env={"HETERO_CLUSTER": "other"}, launcher_args=[],
        )  # fmt: skip


def test_the_script_runs_the_docker_it_was_given(tmp_path: Path) -> None:
    """Run the script with a stand-in docker: it receives the line's words, expanded."""
    record = tmp_path / "argv.txt"
    fake = tmp_path / "docker"
    write = f"open({str(record)!r}, 'w').write('\\n'.join(sys.argv[1:]))"
    fake.write_text(f"#!{sys.executable}\nimport sys\n{write}\n")
    fake.chmod(0o755)
    made = launcher(tmp_path, docker=str(fake))
    folder = tmp_path / "out" / "instances" / "i-2"
    folder.mkdir(parents=True)
    argv = made.argv(
        instance_id="i-2", group="trainer", role="trainer", folder=folder,
        rehearsal_env={}, launcher_args=[],
    )  # fmt: skip
    subprocess.run(argv, check=True, timeout=30)
    words = record.read_text().split("\n")
    assert words[:3] == ["run", "--name", "hetero-01234567-i-2"]
    assert words[words.index("--label") + 1] == "hetero.rehearsal=0123456789abcdef"
    assert f"{folder / 'deployed'}:/opt/hetero/deployed:ro" in words
    assert "HETERO_INSTANCE_ID=i-2" in words and "--stop-timeout" in words
    assert words[-6:] == [
        "hetero-train:trainer", "launch", "--spec", "/opt/hetero/deployed/cluster.toml",
        "--group", "trainer",
    ]  # fmt: skip


def test_a_missing_image_says_how_to_build_it(tmp_path: Path) -> None:
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(ImageMissing) as raised:
        check_images(str(fake), "hetero-train")
    assert str(raised.value) == (
        "no image hetero-train:trainer, hetero-train:data-server on this machine: build both "
        "with `make images` (containers/Dockerfile's targets, tagged hetero-train:trainer and "
        "hetero-train:data-server)"
    )
