"""What an image of ``containers/Dockerfile`` holds, as its own build found it: one record,
``/opt/hetero/image.json``, written by the build's last step and read by the launcher.

No path of an installer's output is assumed anywhere else. The EFA installer's aws-ofi-nccl
plugin has lived under ``lib/`` and under ``lib/x86_64-linux-gnu/`` depending on the release and
the distribution: the build looks for it (``find_efa``), links the CUDA runtime beside it, puts
its folders in the dynamic linker's search path (``/etc/ld.so.conf.d``, then ``ldconfig``) and
records where they are; the launcher's EFA check (``training.launcher.efa``) reads them back from
here. A build that leaves a part out (``EFA_INSTALLER=none``, ``TORCH_FROM=pypi``: `make images`
where AWS's or PyTorch's download sites cannot be reached) records that too, so an image always
says what it is.

Run at build time as ``python -m training.common.image record --target TARGET ...``; it fails,
naming what it looked for and where, when a part the build installed cannot be found.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from training.common.files import write_atomically

IMAGE_RECORD = Path("/opt/hetero/image.json")
"""Where the build writes the record (the launcher reads it from here)."""
EFA_ROOT = Path("/opt/amazon")
"""Where AWS's EFA installer puts libfabric (``efa/``) and aws-ofi-nccl (``ofi-nccl/``)."""
LD_CONF = Path("/etc/ld.so.conf.d/hetero-efa.conf")
"""The dynamic linker's search path for the EFA libraries (NCCL dlopen()s the plugin by name)."""
PLUGIN_LIBRARY = "libnccl-net.so"
"""What NCCL dlopen()s when ``NCCL_NET_PLUGIN`` is unset: the aws-ofi-nccl plugin."""
PLUGIN_CUDA_RUNTIME = "libcudart.so"
"""What the plugin dlopen()s (built with ``--enable-cudart-dynamic``): a link beside it to the
CUDA runtime wheel's library, since the wheels ship only the versioned name."""
LIBFABRIC = "libfabric.so.1"
EFA_INSTALLERS = ("aws", "none")
"""``aws``: AWS's EFA installer (the default, what `cdk deploy` builds); ``none``: left out."""
TORCH_SOURCES = ("cpu-index", "pypi")
"""The data server's torch: PyTorch's CPU index (the default) or PyPI's CUDA build."""


class ImageBuildError(Exception):
    """The build installed a part this step cannot find; the message names where it looked."""


@dataclass(frozen=True)
class EfaFiles:
    """The EFA user-space stack as the build found it."""

    fi_info: str
    plugin_dir: str
    """The folder of ``libnccl-net.so`` (and of the ``libcudart.so`` link the build made)."""
    libfabric_dir: str
    cuda_runtime: str
    """The CUDA runtime library the ``libcudart.so`` link points at."""


@dataclass(frozen=True)
class ImageRecord:
    target: str
    """``trainer`` or ``data-server``."""
    python: str
    """The image's Python, ``major.minor.micro``."""
    torch: str
    torch_cuda: str | None
    """The CUDA version torch was built for (None: a CPU build)."""
    efa: EfaFiles | None
    """None: the image has no EFA stack (``left_out`` says why)."""
    left_out: tuple[str, ...] = ()
    """What this build left out of what `cdk deploy` builds, each with the build argument."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def read_record(path: Path | None = None) -> ImageRecord | None:
    """The image's record (None: not an image of ``containers/Dockerfile``, e.g. a checkout)."""
    path = IMAGE_RECORD if path is None else path
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    efa = data.get("efa")
    return ImageRecord(
        target=data["target"],
        python=data["python"],
        torch=data["torch"],
        torch_cuda=data.get("torch_cuda"),
        efa=EfaFiles(**efa) if efa else None,
        left_out=tuple(data.get("left_out", ())),
    )


def _one(root: Path, name: str, what: str) -> Path:
    """The one file ``name`` under ``root`` (its shallowest, when links repeat it)."""
    found = sorted(root.rglob(name), key=lambda p: (len(p.parts), str(p))) if root.is_dir() else []
    if not found:
        raise ImageBuildError(
            f"{what}: no {name} under {root}; the EFA installer did not install it where this "
            "build looks (see its output above)"
        )
    return found[0]


def find_efa(root: Path, cuda_runtime: Path) -> EfaFiles:
    """Find the installer's ``fi_info``, libfabric and plugin under ``root`` and check the CUDA
    runtime the plugin will load. Raises ImageBuildError naming what is missing."""
    if not cuda_runtime.is_file():
        raise ImageBuildError(
            f"the CUDA runtime for the aws-ofi-nccl plugin: {cuda_runtime} does not exist; "
            "CUDA_RUNTIME_WHEEL_LIB in containers/Dockerfile must name the libcudart of the "
            "nvidia-cuda-runtime wheel pinned in containers/constraints.txt"
        )
    return EfaFiles(
        fi_info=str(_one(root / "efa", "fi_info", "libfabric's fi_info")),
        plugin_dir=str(_one(root / "ofi-nccl", PLUGIN_LIBRARY, "the aws-ofi-nccl plugin").parent),
        libfabric_dir=str(_one(root / "efa", LIBFABRIC, "libfabric").parent),
        cuda_runtime=str(cuda_runtime),
    )


def install_efa_paths(files: EfaFiles, ld_conf: Path = LD_CONF) -> None:
    """Link the CUDA runtime beside the plugin and put both library folders in the linker's
    search path (``ldconfig`` is run by ``record``)."""
    link = Path(files.plugin_dir) / PLUGIN_CUDA_RUNTIME
    link.unlink(missing_ok=True)
    link.symlink_to(files.cuda_runtime)
    ld_conf.parent.mkdir(parents=True, exist_ok=True)
    ld_conf.write_text(f"{files.plugin_dir}\n{files.libfabric_dir}\n")


def _torch() -> tuple[str, str | None]:
    import torch  # deferred: the launcher reads records without loading torch

    return torch.__version__, torch.version.cuda


def build_record(
    *,
    target: str,
    efa_installer: str,
    torch_from: str,
    efa_root: Path = EFA_ROOT,
    cuda_runtime_lib: str = "",
    ld_conf: Path = LD_CONF,
) -> ImageRecord:
    """What the build made, its EFA paths installed (``efa_installer == "aws"``)."""
    if efa_installer not in EFA_INSTALLERS:
        raise ImageBuildError(f"EFA_INSTALLER={efa_installer}: expected one of {EFA_INSTALLERS}")
    if torch_from not in TORCH_SOURCES:
        raise ImageBuildError(f"TORCH_FROM={torch_from}: expected one of {TORCH_SOURCES}")
    left_out: list[str] = []
    efa: EfaFiles | None = None
    if target == "trainer" and efa_installer == "aws":
        purelib = Path(sysconfig.get_path("purelib"))
        efa = find_efa(efa_root, purelib / cuda_runtime_lib)
        install_efa_paths(efa, ld_conf)
    elif target == "trainer":
        left_out.append(
            "the EFA user-space stack (EFA_INSTALLER=none): NCCL uses TCP sockets on every host"
        )
    if target == "data-server" and torch_from == "pypi":
        left_out.append(
            "PyTorch's CPU builds of torch and torchvision (TORCH_FROM=pypi): PyPI's CUDA build "
            "instead, the same versions with their CUDA wheels, several GB larger"
        )
    version, cuda = _torch()
    return ImageRecord(
        target=target,
        python=platform.python_version(),
        torch=version,
        torch_cuda=cuda,
        efa=efa,
        left_out=tuple(left_out),
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.common.image", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="find what the build installed and write the record")
    rec.add_argument("--target", required=True, choices=("trainer", "data-server"))
    rec.add_argument("--efa-installer", default="aws")
    rec.add_argument("--torch-from", default="cpu-index")
    rec.add_argument(
        "--cuda-runtime-lib",
        default="",
        help="the CUDA runtime library, relative to site-packages (trainer with EFA)",
    )
    rec.add_argument("--out", type=Path, default=IMAGE_RECORD)
    args = p.parse_args(argv)
    try:
        record = build_record(
            target=args.target,
            efa_installer=args.efa_installer,
            torch_from=args.torch_from,
            cuda_runtime_lib=args.cuda_runtime_lib,
        )
    except ImageBuildError as e:
        print(f"image record: {e}", file=sys.stderr)
        return 1
    if record.efa is not None:
        subprocess.run(["ldconfig"], check=True)
    write_atomically(args.out, record.to_json().encode())
    print(record.to_json(), end="")
    for part in record.left_out:
        print(f"image record: LEFT OUT {part}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
