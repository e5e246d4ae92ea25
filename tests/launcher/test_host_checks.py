"""What a host must have before its role starts (``training.launcher.host_checks``): an NVIDIA
driver the image's CUDA wheels run on, what Triton needs when ``job.compile`` is on, and
``/dev/shm`` for the data loader. The last tests go through ``hetero launch`` itself: a trainer
on a host whose driver is too old (a stand-in ``/proc/driver/nvidia/version``) ends the job
``failed`` with the reason, on EC2 (the job record, every group to zero) and on SageMaker (the
failure file), instead of a launcher that Docker restarts into the same failure."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import pytest

from training.common.jobparam import JobPointer
from training.common.jobrecord import JobRecord
from training.common.names import ENV_LOADER_WORKERS
from training.common.outcome import EXIT_FAILED, EXIT_STOPPED
from training.data.loader import default_workers
from training.launcher import host_checks, job_end, launch
from training.launcher.backends import PLACES, Backend
from training.spec import parse_spec

from .conftest import HOST_GROUPS, HOST_INSTANCE, FakeImds, as_deployed_host, one_of_each

# The version line of the two kernel modules NVIDIA ships (proprietary, open).
PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {v}  Sun May 12 19:39:15 UTC 2024\n"
    "GCC version:  gcc version 11.4.1 20230605 (Red Hat 11.4.1-2) (GCC)\n"
)
OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {v}  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Tue Jul 15 19:37:02 UTC 2025\n"
    "GCC version:  gcc version 11.5.0 20240719 (Red Hat 11.5.0-5) (GCC)\n"
)
CUDA13 = ("nvidia-cuda-runtime", "13.2.86")


def driver_file(tmp_path: Path, version: str, template: str = PROPRIETARY) -> Path:
    path = tmp_path / "proc" / "driver" / "nvidia" / "version"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(template.format(v=version))
    return path


# -------------------------------------------------------------------------------- the driver


@pytest.mark.parametrize("template", [PROPRIETARY, OPEN])
def test_the_driver_version_is_read_from_either_module(tmp_path: Path, template: str) -> None:
    path = driver_file(tmp_path, "580.65.06", template)
    assert host_checks.read_driver_version(path) == "580.65.06"
    assert host_checks.read_driver_version(tmp_path / "none") is None


def test_a_driver_older_than_the_wheels_need_is_a_problem_that_names_the_fix(
    tmp_path: Path,
) -> None:
    problem = host_checks.driver_problem(driver_file(tmp_path, "570.172.08"), CUDA13)
    assert problem is not None
    assert problem.startswith(
        "this host's NVIDIA driver 570.172.08 is older than the 580 driver branch that the "
        "image's CUDA 13 wheels (nvidia-cuda-runtime 13.2.86) need"
    )
    assert "'driver too old'" in problem
    assert "minor-version-compatibility" in problem
    assert "Fix: run on an AMI whose driver is 580 or newer" in problem


@pytest.mark.parametrize("version", ["580.65.06", "595.91.07"])
def test_a_driver_of_the_branch_or_newer_is_fine(tmp_path: Path, version: str) -> None:
    assert host_checks.driver_problem(driver_file(tmp_path, version), CUDA13) is None


def test_cuda_12_wheels_run_on_an_older_branch(tmp_path: Path) -> None:
    path = driver_file(tmp_path, "535.183.01")
    assert host_checks.driver_problem(path, ("nvidia-cuda-runtime-cu12", "12.8.90")) is None
    assert host_checks.driver_problem(path, CUDA13) is not None


def test_without_a_driver_or_cuda_wheels_nothing_is_compared(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No version file: no GPU visible (a CPU rehearsal host; `--gpus` missing shows in the
    log). No CUDA runtime wheel: the CPU-only data-server image."""
    with caplog.at_level(logging.WARNING):
        assert host_checks.driver_problem(tmp_path / "none", CUDA13) is None
    assert "is the container started with --gpus?" in caplog.text
    assert host_checks.wheel_cuda(("no-such-wheel",)) is None


def test_the_image_pins_a_cuda_runtime_wheel_the_check_knows() -> None:
    """The test environment installs the image's pins: the check finds their CUDA major."""
    found = host_checks.wheel_cuda()
    assert found is not None and found[0] == "nvidia-cuda-runtime"
    assert found[1].startswith("13.")


# ---------------------------------------------------------------------------- compile (Triton)


def test_compile_needs_a_c_compiler_and_pythons_headers(tmp_path: Path) -> None:
    headers = tmp_path / "include"
    headers.mkdir()
    (headers / "Python.h").write_text("")
    gcc = {"gcc": "/usr/bin/gcc"}
    assert host_checks.compiler_problem({}, which=gcc.get, include_dir=headers) is None
    problem = host_checks.compiler_problem({}, which={}.get, include_dir=headers)
    assert problem == (
        "job.compile = true needs a C compiler ($CC, gcc or clang) at run time: Triton builds "
        "the launcher of every kernel torch.compile makes with them (pytorch/pytorch#116696), "
        "so the first step would fail. Fix: run the trainer image built from "
        "containers/Dockerfile (its trainer target installs gcc and python3-dev), or set "
        "job.compile = false"
    )
    no_headers = host_checks.compiler_problem({}, which=gcc.get, include_dir=tmp_path)
    assert no_headers is not None
    assert no_headers.startswith(f"job.compile = true needs Python's headers ({tmp_path}/")
    # $CC wins, as in Triton, and must exist.
    assert host_checks.compiler_problem(
        {"CC": "/opt/cc"}, which={"/opt/cc": "/opt/cc"}.get, include_dir=headers
    ) is None  # fmt: skip
    assert host_checks.compiler_problem(
        {"CC": "/opt/missing-cc"}, which=gcc.get, include_dir=headers
    ) is not None  # fmt: skip


def test_the_compile_check_looks_where_triton_does() -> None:
    import sysconfig

    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme
    assert host_checks.python_include_dir() == Path(sysconfig.get_paths(scheme=scheme)["include"])


# ------------------------------------------------------------------------------------ /dev/shm

SPEC = parse_spec(
    {
        "name": "t",
        "groups": [
            {"name": "trainer", "role": "trainer", "instance_types": ["g5.12xlarge"], "count": 1},
            {"name": "dataprep", "role": "dataprep", "instance_types": ["c6i.4xlarge"], "count": 1},
        ],
        "job": {"steps": 10, "batch_size": 64},
    }
)
# One batch: 64 x 3 x 224 x 224 uint8 = 9,633,792 bytes; a worker keeps 2; 4 ranks per host.
PER_WORKER = 2 * 64 * 3 * 224 * 224 * 4


def test_the_worker_cap_is_what_half_of_dev_shm_holds() -> None:
    trainer = SPEC.trainer_group
    assert trainer.ranks_per_instance == 4
    assert host_checks.loader_worker_cap(SPEC, trainer, 64 * 2**20) == 0  # Docker's 64m default
    assert host_checks.loader_worker_cap(SPEC, trainer, 2 * PER_WORKER * 3) == 3


def test_a_small_dev_shm_caps_the_trainers_workers_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(host_checks, "shm_bytes", lambda path: 2 * PER_WORKER * 3)
    with caplog.at_level(logging.INFO):
        env = host_checks.loader_env(SPEC, SPEC.trainer_group, cores=48)
    assert env == {ENV_LOADER_WORKERS: "3"}
    assert "data-loader workers capped at 3 per rank (of 48 cores" in caplog.text
    assert "docker run --ipc host" in caplog.text
    # Big enough for a worker per core: nothing to cap, the size is still logged.
    monkeypatch.setattr(host_checks, "shm_bytes", lambda path: 2 * PER_WORKER * 48)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert host_checks.loader_env(SPEC, SPEC.trainer_group, cores=48) == {}
    assert "MiB of shared memory" in caplog.text
    # Data servers: logged only.
    monkeypatch.setattr(host_checks, "shm_bytes", lambda path: 64 * 2**20)
    assert host_checks.loader_env(SPEC, SPEC.group("dataprep"), cores=16) == {}


def test_the_real_dev_shm_is_measured(tmp_path: Path) -> None:
    assert (host_checks.shm_bytes(tmp_path) or 0) > 0
    assert host_checks.shm_bytes(tmp_path / "none") is None


def test_the_loader_takes_the_cap() -> None:
    import os

    cores = len(os.sched_getaffinity(0))
    assert default_workers({}) == cores
    assert default_workers({ENV_LOADER_WORKERS: "0"}) == 0
    assert default_workers({ENV_LOADER_WORKERS: str(cores + 5)}) == cores


def test_check_host_gives_the_trainer_the_cap_and_checks_drivers_off_local_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_checks, "shm_bytes", lambda path: 0)
    old = driver_file(tmp_path, "550.54.15")
    local = host_checks.check_host(
        SPEC, "trainer", PLACES[Backend.LOCAL], environ={}, driver_file=old
    )
    assert local.problem is None and local.env == {ENV_LOADER_WORKERS: "0"}
    ec2 = host_checks.check_host(SPEC, "trainer", PLACES[Backend.EC2], environ={}, driver_file=old)
    assert ec2.problem is not None and "driver 550.54.15" in ec2.problem and not ec2.env
    data = host_checks.check_host(
        SPEC, "dataprep", PLACES[Backend.EC2], environ={}, driver_file=old
    )
    assert data.problem is None and not data.env


# ------------------------------------------------------------------------ through hetero launch

INSTANCE, GROUPS = HOST_INSTANCE, HOST_GROUPS


def _args(spec: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    return parser.parse_args(["--spec", str(spec), "--group", "trainer", *extra])


@pytest.fixture
def deployed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_imds: FakeImds
) -> dict[str, Any]:
    """A trainer as the stack runs it on EC2 (HETERO_ASG_NAMES, a checkpoint folder), with
    scaling to zero recorded instead of sent."""
    spec = tmp_path / "cluster.toml"
    spec.write_text(one_of_each("vit"))
    record_dir = tmp_path / "record"
    as_deployed_host(monkeypatch, fake_imds, record_dir)
    monkeypatch.delenv("HETERO_JOB_PARAMETER", raising=False)
    monkeypatch.delenv("HETERO_LIFECYCLE_HOOK", raising=False)
    scaled: list[list[str]] = []
    monkeypatch.setattr(job_end, "scale_to_zero", lambda c, names: scaled.append(list(names)))
    return {"spec": spec, "record": JobRecord(str(record_dir)), "imds": fake_imds, "scaled": scaled}


def test_on_ec2_a_driver_too_old_ends_the_job_failed_with_the_reason(
    tmp_path: Path, deployed: dict[str, Any]
) -> None:
    from moto import mock_aws

    old = driver_file(tmp_path, "570.172.08")
    args = _args(deployed["spec"], "--backend", "ec2", "--imds-url", deployed["imds"].url,
                 "--driver-version-file", str(old))  # fmt: skip
    with mock_aws():
        code = launch.run(args)
    assert code == EXIT_FAILED
    outcome = deployed["record"].outcome()
    assert outcome is not None and outcome["outcome"] == "failed" and outcome["by"] == INSTANCE
    assert outcome["reason"].startswith(
        "this host's NVIDIA driver 570.172.08 is older than the 580 driver branch that the "
        "image's CUDA 13 wheels (nvidia-cuda-runtime "
    )
    assert outcome["reason"].endswith(f"(instance {INSTANCE}, trainer)")
    assert deployed["scaled"] == [GROUPS]  # every group to zero: nothing bills on
    # Not a replacement: every instance of the launch template has the same AMI.
    assert deployed["record"].replaced() == {}


def test_on_ec2_a_host_with_an_older_spec_is_replaced_before_its_driver_is_judged(
    tmp_path: Path, deployed: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance left from an earlier deploy (an older launch template, perhaps an older AMI)
    does not end the job that new instances run: it is replaced, as any stale host is."""
    import boto3
    from moto import mock_aws

    old = driver_file(tmp_path, "570.172.08")
    monkeypatch.setenv("HETERO_JOB_PARAMETER", "/hetero/vit/job")
    args = _args(deployed["spec"], "--backend", "ec2", "--imds-url", deployed["imds"].url,
                 "--driver-version-file", str(old))  # fmt: skip
    with mock_aws():
        boto3.client("ssm", region_name="us-east-1").put_parameter(
            Name="/hetero/vit/job",
            Value=JobPointer("d-0123456789ab", "s3://bucket/checkpoints/d-0123456789ab/").to_json(),
            Type="String",
        )
        code = launch.run(args)
    assert code == EXIT_STOPPED
    assert deployed["record"].outcome() is None and deployed["scaled"] == []


def test_on_ec2_a_good_driver_goes_on_to_the_job(
    tmp_path: Path, deployed: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def run_ec2(spec: Any, args: Any, identity: Any, imds: Any, efa_env: Any, host: Any) -> int:
        seen["host"] = host
        return 0

    monkeypatch.setattr(launch, "run_ec2", run_ec2)
    new = driver_file(tmp_path, "595.91.07")
    args = _args(deployed["spec"], "--backend", "ec2", "--imds-url", deployed["imds"].url,
                 "--driver-version-file", str(new))  # fmt: skip
    assert launch.run(args) == 0
    assert seen["host"].problem is None


def test_on_sagemaker_a_driver_too_old_fails_the_job_with_the_reason(tmp_path: Path) -> None:
    spec = tmp_path / "cluster.toml"
    spec.write_text(one_of_each("vit"))
    failure = tmp_path / "opt" / "ml" / "output" / "failure"
    args = _args(spec, "--backend", "sagemaker", "--failure-file", str(failure),
                 "--driver-version-file", str(driver_file(tmp_path, "535.183.01")))  # fmt: skip
    assert launch.run(args) == EXIT_FAILED
    reason = failure.read_text()
    assert reason.startswith("this host's NVIDIA driver 535.183.01 is older than the 580 ")
    assert reason.endswith("(containers/constraints.txt)\n")


def test_on_sagemaker_compile_without_a_compiler_fails_before_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = tmp_path / "cluster.toml"
    spec.write_text(one_of_each("vit") + "compile = true\n")
    monkeypatch.setenv("CC", str(tmp_path / "no-cc"))
    failure = tmp_path / "failure"
    args = _args(spec, "--backend", "sagemaker", "--failure-file", str(failure),
                 "--driver-version-file", str(driver_file(tmp_path, "595.91.07")))  # fmt: skip
    assert launch.run(args) == EXIT_FAILED
    assert failure.read_text().startswith("job.compile = true needs a C compiler")
