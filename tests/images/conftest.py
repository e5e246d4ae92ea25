"""The built images in real containers (`make image-test`, after `make images`): a Docker that
answers, both images present, and every container a test starts removed when it ends (and, at
the start, any a killed earlier run left)."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from training.rehearsal.containers import (
    IMAGE_REPOSITORY,
    LABEL,
    ROLE_TAGS,
    ImageMissing,
    check_images,
    docker_client,
    remove_labelled,
)

TEST_LABEL = "hetero.image-test"
TRAINER_IMAGE = f"{IMAGE_REPOSITORY}:{ROLE_TAGS['trainer']}"
DATA_SERVER_IMAGE = f"{IMAGE_REPOSITORY}:{ROLE_TAGS['dataprep']}"
_WHY = (
    "`make image-test` runs these tests through scripts/with_docker.sh, which installs (under CI) "
    "and starts Docker and builds the images first (`make images`); HETERO_SKIP_IMAGE_TESTS=1 "
    "skips them"
)


@pytest.fixture(scope="session")
def docker() -> Iterator[str]:
    """The Docker client, with a daemon that answers and both images; the containers of killed
    runs removed."""
    try:
        client = docker_client()
    except ImageMissing as e:
        pytest.fail(f"{e}: {_WHY}")
    info = subprocess.run([client, "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        pytest.fail(f"Docker does not answer ({info.stderr.strip()[-300:]}): {_WHY}")
    for label in (TEST_LABEL, LABEL):
        remove_labelled(client, label=label)
    try:
        check_images(client, IMAGE_REPOSITORY)
    except ImageMissing as e:
        pytest.fail(f"{e} ({_WHY})")
    yield client
    for label in (TEST_LABEL, LABEL):
        remove_labelled(client, label=label)


@dataclass
class Containers:
    """Starts containers for one test (on the host network, as the launch template does) and
    removes them all at its end."""

    docker: str
    started: list[str] = field(default_factory=list)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def start(
        self,
        name: str,
        image: str,
        args: Sequence[str] = (),
        *,
        flags: Sequence[str] = (),
        mounts: Sequence[Path] = (),
        env: dict[str, str] | None = None,
    ) -> str:
        """``docker run --detach`` with ``mounts`` at the same paths; the container's name."""
        full = f"hetero-test-{self.run_id}-{name}"
        argv = [
            self.docker, "run", "--detach", "--name", full, "--label", f"{TEST_LABEL}=1",
            "--network", "host", "--ipc", "host", *flags,
        ]  # fmt: skip
        for mount in mounts:
            argv += ["-v", f"{mount}:{mount}"]
        for key, value in (env or {}).items():
            argv += ["-e", f"{key}={value}"]
        subprocess.run([*argv, image, *args], check=True, capture_output=True, timeout=120)
        self.started.append(full)
        return full

    def stop(self, name: str) -> float:
        """A plain ``docker stop`` (the container's own stop timeout); the seconds it took."""
        started = time.monotonic()
        subprocess.run([self.docker, "stop", name], check=True, capture_output=True, timeout=600)
        return time.monotonic() - started

    def logs(self, name: str) -> str:
        out = subprocess.run(
            [self.docker, "logs", name], capture_output=True, text=True, timeout=60
        )
        return out.stdout + out.stderr

    def wait(self, name: str, timeout_s: float) -> int:
        """The container's exit code once it has exited (fails, with its log, past the bound)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state(name)
            if state["Status"] == "exited":
                return int(state["ExitCode"])
            time.sleep(0.5)
        pytest.fail(f"{name} still runs after {timeout_s:g} s:\n{self.logs(name)[-4000:]}")

    def state(self, name: str) -> dict[str, object]:
        out = subprocess.run(
            [self.docker, "inspect", "--format", "{{json .State}}", name],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return dict(json.loads(out.stdout))

    def wait_for_log(self, name: str, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.logs(name):
            if time.monotonic() > deadline or self.state(name)["Status"] == "exited":
                pytest.fail(f"no {text!r} in {name}'s log:\n{self.logs(name)[-4000:]}")
            time.sleep(0.5)

    def remove_all(self) -> None:
        if self.started:
            subprocess.run(
                [self.docker, "rm", "--force", *self.started], capture_output=True, timeout=120
            )


@pytest.fixture
def containers(docker: str) -> Iterator[Containers]:
    made = Containers(docker)
    try:
        yield made
    finally:
        made.remove_all()
