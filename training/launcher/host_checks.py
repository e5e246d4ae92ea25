"""What a host must have for its role, checked once when the launcher starts, before any process
of the role runs:

- a trainer on EC2 or SageMaker: an NVIDIA driver no older than the image's CUDA wheels need
  (``driver_problem``; a too-old driver fails every CUDA call with "driver too old");
- a trainer with ``job.compile = true``: a C compiler and Python's headers, which Triton needs at
  run time to build its kernels' launcher (``compiler_problem``);
- every host: the size of ``/dev/shm``, logged; a trainer's data-loader workers are capped when
  it cannot hold one worker per core (``loader_env``).

A problem found here belongs to the image or the AMI, so every replacement instance would meet
it again: ``hetero launch`` ends the job ``failed`` with the problem as its reason (EC2:
``early_exit.leave_service`` with ``replaceable=False``; SageMaker: the failure file) instead of
letting Docker restart the launcher into the same failure.
"""

from __future__ import annotations

import importlib.metadata as metadata
import logging
import os
import re
import shutil
import sysconfig
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from training import instance_types
from training.common.names import ENV_LOADER_WORKERS
from training.launcher.backends import Place
from training.spec import ClusterSpec, InstanceGroup, Role

log = logging.getLogger(__name__)

DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
"""The loaded NVIDIA kernel module's version line ("NVRM version: ... Kernel Module ...
580.65.06 ..."); /proc is the host kernel's, so a container sees the host driver here."""
SHM_DIR = Path("/dev/shm")
CUDA_RUNTIME_WHEELS = (
    "nvidia-cuda-runtime",
    "nvidia-cuda-runtime-cu13",
    "nvidia-cuda-runtime-cu12",
)
"""The wheel that carries ``libcudart`` (its name for CUDA 13, and the ``-cuXX`` names); its major
version is the CUDA major the image's torch was built with. None installed: a CPU-only image."""
LOADER_PREFETCH = 2
"""Batches each data-loader worker keeps ready: ``DataLoader``'s ``prefetch_factor`` default
(https://docs.pytorch.org/docs/stable/data.html#torch.utils.data.DataLoader)."""
SHM_SHARE = 0.5
"""The share of ``/dev/shm`` the loaders' batches may take; the rest is left to NCCL's and
torch's own shared-memory use."""

_DRIVER_RE = re.compile(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)*)\s")


@dataclass(frozen=True)
class HostCheck:
    """What ``check_host`` found: ``problem`` (None when the role can start) and variables for
    the trainer's processes (``env``)."""

    problem: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)


def read_driver_version(path: Path = DRIVER_VERSION_FILE) -> str | None:
    """The NVIDIA driver version in ``path`` as written there, e.g. "580.65.06"; None without a
    driver (no file) or a line this does not recognise (logged)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    found = _DRIVER_RE.search(text)
    if found is None:
        log.warning("%s: no driver version in %r", path, text[:200])
        return None
    return found[1]


def wheel_cuda(names: tuple[str, ...] = CUDA_RUNTIME_WHEELS) -> tuple[str, str] | None:
    """(wheel, version) of the installed CUDA runtime wheel, e.g. ("nvidia-cuda-runtime",
    "13.2.86"); None in an image without CUDA wheels."""
    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def driver_problem(
    path: Path = DRIVER_VERSION_FILE, wheel: tuple[str, str] | None = None
) -> str | None:
    """Why this host's NVIDIA driver cannot run the image's CUDA wheels, or None (old enough, or
    nothing to compare: no driver visible, no CUDA wheels). Under CUDA minor version
    compatibility a CUDA ``major.x`` build runs on the ``instance_types.MIN_DRIVER_BRANCH``
    driver branch of its major and newer."""
    wheel = wheel or wheel_cuda()
    if wheel is None:
        return None
    name, version = wheel
    major = int(version.split(".")[0])
    floor = instance_types.MIN_DRIVER_BRANCH.get(major)
    driver = read_driver_version(path)
    if driver is None:
        log.warning(
            "no NVIDIA driver version in %s: the driver is not checked against the image's "
            "CUDA %d wheels (on a GPU host, is the container started with --gpus?)",
            path, major,
        )  # fmt: skip
        return None
    shown = driver
    if floor is None or int(driver.split(".")[0]) >= floor:
        log.info("NVIDIA driver %s, image CUDA %s (%s %s)", shown, major, name, version)
        return None
    return (
        f"this host's NVIDIA driver {shown} is older than the {floor} driver branch that the "
        f"image's CUDA {major} wheels ({name} {version}) need: CUDA {major}.x runs on driver "
        f"{floor} or newer (CUDA minor version compatibility, "
        "https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html), "
        "so every CUDA call would fail with 'driver too old'. Fix: run on an AMI whose driver "
        f"is {floor} or newer (the stack's Deep Learning Base OSS Nvidia Driver AMI, "
        "redeployed so that its launch templates resolve a current one), or build the image "
        "with CUDA wheels this driver supports (containers/constraints.txt)"
    )


def python_include_dir() -> Path:
    """Where Triton looks for ``Python.h``: the ``include`` path of the default install scheme
    (Debian's ``posix_local`` read as ``posix_prefix``, as ``triton.runtime.build`` does)."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def compiler_problem(
    environ: Mapping[str, str],
    *,
    which: Callable[[str], str | None] = shutil.which,
    include_dir: Path | None = None,
) -> str | None:
    """Why ``torch.compile`` would fail on its first step here, or None. Triton compiles a small
    C launcher for its kernels at run time, with ``$CC`` else ``gcc`` else ``clang`` and
    Python's headers (``triton/runtime/build.py``; "Failed to find C compiler. Please specify
    via CC environment variable", pytorch/pytorch#116696)."""
    cc = environ.get("CC")
    cc = which(cc) if cc else which("gcc") or which("clang")
    header = (include_dir or python_include_dir()) / "Python.h"
    missing = []
    if cc is None:
        missing.append("a C compiler ($CC, gcc or clang)")
    if not header.is_file():
        missing.append(f"Python's headers ({header})")
    if not missing:
        return None
    return (
        f"job.compile = true needs {' and '.join(missing)} at run time: Triton builds the "
        "launcher of every kernel torch.compile makes with them (pytorch/pytorch#116696), so "
        "the first step would fail. Fix: run the trainer image built from containers/Dockerfile "
        "(its trainer target installs gcc and python3-dev), or set job.compile = false"
    )


def shm_bytes(path: Path = SHM_DIR) -> int | None:
    """The size of the shared-memory file system at ``path``; None when there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def loader_worker_cap(spec: ClusterSpec, group: InstanceGroup, shm: int) -> int:
    """How many data-loader workers per rank ``shm`` bytes of ``/dev/shm`` hold: each worker
    keeps ``LOADER_PREFETCH`` batches of uint8 images there for its rank, and the ranks of the
    host share ``SHM_SHARE`` of it."""
    size = spec.job.dataset.image_size
    batch_bytes = spec.job.batch_size * 3 * size * size
    per_worker = LOADER_PREFETCH * batch_bytes * group.ranks_per_instance
    return int(shm * SHM_SHARE) // per_worker


def loader_env(
    spec: ClusterSpec, group: InstanceGroup, *, shm_dir: Path = SHM_DIR, cores: int | None = None
) -> dict[str, str]:
    """Log ``/dev/shm``'s size; for a trainer whose data loader would run one worker per core
    (``training.data.loader``) with more batches than it holds, ``HETERO_LOADER_WORKERS``."""
    shm = shm_bytes(shm_dir)
    if shm is None:
        log.warning("%s: no shared memory file system; data-loader workers cannot start", shm_dir)
        return {}
    log.info("%s: %d MiB of shared memory", shm_dir, shm // 2**20)
    if group.role is not Role.TRAINER:
        return {}
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    cap = loader_worker_cap(spec, group, shm)
    if cap >= cores:
        return {}
    log.warning(
        "%s has %d MiB: data-loader workers capped at %d per rank (of %d cores; each keeps %d "
        "batches of %d x %dpx images in it, %d ranks on this host). To use every core, give the "
        "container more shared memory (docker run --ipc host, as the stack's user data does, "
        "or --shm-size)",
        shm_dir, shm // 2**20, cap, cores, LOADER_PREFETCH, spec.job.batch_size,
        spec.job.dataset.image_size, group.ranks_per_instance,
    )  # fmt: skip
    return {ENV_LOADER_WORKERS: str(cap)}


def check_host(
    spec: ClusterSpec,
    group_name: str,
    place: Place,
    *,
    environ: Mapping[str, str],
    driver_file: Path = DRIVER_VERSION_FILE,
    shm_dir: Path = SHM_DIR,
) -> HostCheck:
    """The checks above for this host's group: the driver on EC2 and SageMaker trainers (a local
    run may be CPU-only), the compiler on every trainer with ``job.compile``, ``/dev/shm``
    everywhere. The first problem wins; the env applies only when there is none."""
    group = spec.group(group_name)
    if group.role is Role.TRAINER:
        if place.checks_driver and (problem := driver_problem(driver_file)) is not None:
            log.error("%s", problem)
            return HostCheck(problem)
        if spec.job.compile and (problem := compiler_problem(environ)) is not None:
            log.error("%s", problem)
            return HostCheck(problem)
    return HostCheck(env=loader_env(spec, group, shm_dir=shm_dir))
