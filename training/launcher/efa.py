"""EFA on a trainer host: whether NCCL's traffic goes over it, decided once before torchrun starts.

The image carries the EFA user-space stack (``containers/Dockerfile``: libfabric with ``fi_info``
and the aws-ofi-nccl plugin, where AWS's installer put them under ``/opt/amazon``, as the build
found and recorded them in the image's record, ``training.common.image``). NCCL loads
the plugin on every host; where EFA does not work, NCCL falls back to TCP sockets without a
word. This module makes the choice visible in one log line and, for ``efa = "on"``, a
requirement that stops the host before torchrun (``training.common.outcome.EXIT_CONFIG``). It
checks:

- devices: EFA devices the kernel shows (``/sys/class/infiniband/*`` with the ``efa`` driver)
  and the ``/dev/infiniband/uverbs*`` nodes ``docker run --device`` passed into this container;
- provider: ``fi_info -p efa -t FI_EP_RDM``, the check AWS documents for an EFA install
  (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start-nccl.html, step 5), exits 0
  and lists the ``efa`` provider;
- plugin: the plugin library and the ``libcudart.so`` it dlopen()s (a link to the CUDA runtime
  wheel, made by the Dockerfile) exist: without the runtime the plugin cannot start.

The environment for the ranks sets only what the aws-ofi-nccl EFA cheat sheet still asks for
with the versions the image installs (libfabric 2.7, aws-ofi-nccl 1.22;
https://github.com/aws/aws-ofi-nccl/blob/master/doc/efa-env-var.md): nothing is required.
``FI_EFA_USE_DEVICE_RDMA`` ("do not set for libfabric>=1.18.0 and aws-ofi-nccl>=1.7.0"),
``FI_EFA_FORK_SAFE`` ("not needed anymore") and ``NCCL_PROTO=simple`` (aws-ofi-nccl<=1.5.0) are
left out. ``FI_PROVIDER=efa`` (listed for aws-ofi-nccl<=1.5.0) is set where EFA works: the
newer plugin picks ``efa`` by itself on EC2, so it changes nothing there but keeps libfabric
from any other provider and shows the decision in the ranks' environment. Without EFA no
``FI_*`` variable is set. Both ways ``NCCL_DEBUG=INFO`` with ``NCCL_DEBUG_SUBSYS=INIT,NET``
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html) makes NCCL log the network
it chose: ``NET/OFI Selected Provider is efa`` or ``NET/Socket``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from training.common.image import PLUGIN_CUDA_RUNTIME, PLUGIN_LIBRARY, EfaFiles, read_record
from training.spec import Efa, InstanceGroup

log = logging.getLogger(__name__)

EFA_SYSFS = Path("/sys/class/infiniband")
"""Where the kernel lists RDMA devices (the host's, also visible inside a container)."""
EFA_DEVFS = Path("/dev/infiniband")
"""Where ``docker run --device`` puts the verbs device nodes a process opens."""
FI_INFO_TIMEOUT_S = 20.0
"""``fi_info`` opens every device; seconds before it counts as failed."""

NCCL_NETWORK_LOG: Mapping[str, str] = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
EFA_ENV: Mapping[str, str] = {"FI_PROVIDER": "efa"}

_EFA_PROVIDER_LINE = re.compile(r"^\s*provider:\s*efa\s*$", re.MULTILINE)
_REBUILD = (
    "the image was not built from containers/Dockerfile (its EFA installer step); rebuild and "
    "push it (`cdk deploy` builds containers/Dockerfile)"
)
_LEFT_OUT = (
    "this image was built without the EFA stack ({why}); rebuild it where "
    "efa-installer.amazonaws.com can be reached, without EFA_INSTALLER=none (`cdk deploy` "
    "builds the full image)"
)


class EfaUnavailable(Exception):
    """The spec requires EFA (``efa = "on"``) and this host cannot use it; the message names
    what is missing and how to fix it."""


@dataclass(frozen=True)
class EfaProbe:
    """What this host and image offer for EFA."""

    devices: tuple[str, ...]
    """EFA devices the kernel lists (names under ``/sys/class/infiniband``)."""
    device_nodes: tuple[str, ...]
    """``uverbs*`` nodes under ``/dev/infiniband`` in this container."""
    fi_info: str | None
    """The ``fi_info`` found (None: the image has no EFA provider)."""
    provider_ok: bool
    """``fi_info -p efa -t FI_EP_RDM`` listed the efa provider."""
    provider: str
    """``efa`` when usable, else why not, for the log line."""
    plugin_problem: str | None = None
    """What is wrong with the aws-ofi-nccl plugin in the image (None: nothing)."""
    image_problem: str | None = None
    """Why the image has no EFA stack at all, from its record (None: it has one)."""

    @property
    def usable(self) -> bool:
        return bool(
            self.devices
            and self.device_nodes
            and self.provider_ok
            and self.plugin_problem is None
            and self.image_problem is None
        )

    def missing(self) -> list[str]:
        """What keeps EFA from NCCL, root causes first, each with its fix."""
        problems: list[str] = []
        if self.image_problem is not None:
            problems.append(f"the image: {self.image_problem}")
        elif self.fi_info is None:
            problems.append(f"the EFA provider: no fi_info in the image or on PATH: {_REBUILD}")
        if self.plugin_problem is not None and self.image_problem is None:
            problems.append(f"the aws-ofi-nccl plugin: {self.plugin_problem}")
        if not self.devices:
            problems.append(
                "EFA devices: the kernel lists none in /sys/class/infiniband: the launch "
                "template lacks EFA interfaces (infra/efa.py) or the instance type has none"
            )
        elif not self.device_nodes:
            problems.append(
                f"EFA device nodes: the host has {len(self.devices)} EFA device(s) but this "
                "container has no /dev/infiniband/uverbs*: `docker run` lacks "
                "--device=/dev/infiniband/uverbsN (the user data in infra/instance_group.py)"
            )
        elif self.fi_info is not None and not self.provider_ok:
            problems.append(
                f"the EFA provider: {self.provider}: the devices are there but libfabric cannot "
                "use them; check the host's EFA driver (the AMI) and `docker run --ulimit "
                "memlock=-1`"
            )
        return problems


@dataclass(frozen=True)
class EfaDecision:
    """Whether NCCL gets EFA on this host, and the variables torchrun's ranks get for it."""

    use_efa: bool
    env: Mapping[str, str] = field(default_factory=dict)
    summary: str = ""
    """The start-up log line (``EFA: ...``)."""


def probe(
    *,
    sysfs: Path | None = None,
    devfs: Path | None = None,
    search_path: str | None = None,
    plugin_dir: Path | None = None,
    timeout_s: float = FI_INFO_TIMEOUT_S,
) -> EfaProbe:
    """Look at the devices, run ``fi_info`` (bounded by ``timeout_s``) when there is a device
    to open, and check the plugin files. Where the EFA stack is, and whether the image has one,
    comes from the image's record (``training.common.image``, written by its build);
    ``search_path`` (default: the recorded ``fi_info``'s folder, then ``PATH``) and
    ``plugin_dir`` (default: the recorded one) stand in for it."""
    sysfs = EFA_SYSFS if sysfs is None else sysfs
    devfs = EFA_DEVFS if devfs is None else devfs
    files, image_problem = _image_efa()
    if plugin_dir is None:
        plugin_dir = Path(files.plugin_dir) if files else None
    if search_path is None:
        folders = [str(Path(files.fi_info).parent)] if files else []
        search_path = os.pathsep.join([*folders, os.environ.get("PATH", "")])
    devices = _efa_devices(sysfs)
    nodes = _device_nodes(devfs)
    fi_info = shutil.which("fi_info", path=search_path)
    if fi_info is None:
        provider_ok, provider = False, "not installed"
    elif not nodes:
        provider_ok, provider = False, "not checked: no EFA device in this container"
    else:
        provider_ok, provider = _run_fi_info(fi_info, timeout_s)
    plugin = _plugin_problem(plugin_dir) if plugin_dir else f"no plugin folder: {_REBUILD}"
    return EfaProbe(devices, nodes, fi_info, provider_ok, provider, plugin, image_problem)


def _image_efa() -> tuple[EfaFiles | None, str | None]:
    """The EFA files the image's build recorded, or why there are none (None, None: this is
    not an image, e.g. a checkout: the caller's paths decide)."""
    record = read_record()
    if record is None:
        return None, None
    if record.efa is None:
        return None, _LEFT_OUT.format(why="; ".join(record.left_out) or "none recorded")
    return record.efa, None


def decide(group: InstanceGroup, found: EfaProbe) -> EfaDecision:
    """The decision for a trainer of ``group`` on a host that offers ``found``. Raises
    EfaUnavailable when the group has ``efa = "on"`` and EFA cannot carry NCCL's traffic."""
    if found.usable:
        shown = ", ".join(found.devices[:4]) + (", ..." if len(found.devices) > 4 else "")
        return EfaDecision(
            True,
            {**EFA_ENV, **NCCL_NETWORK_LOG},
            f"EFA: {len(found.devices)} device(s) ({shown}), provider efa: NCCL uses EFA "
            "through aws-ofi-nccl (its log: 'NET/OFI Selected Provider is efa')",
        )
    missing = found.missing()
    if group.efa is Efa.ON:
        raise EfaUnavailable(
            f'group {group.name!r} has efa = "on" but NCCL cannot use EFA on this host; '
            "missing: " + "; ".join(missing)
        )
    counts = f"{len(found.devices)} device(s)"
    if len(found.device_nodes) != len(found.devices):
        counts += f", {len(found.device_nodes)} in this container"
    summary = (
        f"EFA: none ({counts}, provider {found.provider}): "
        "NCCL uses TCP sockets (its log: 'NET/Socket')"
    )
    if group.use_efa:  # the launch template was given EFA interfaces: say why they go unused
        summary += "; missing: " + "; ".join(missing)
    return EfaDecision(False, dict(NCCL_NETWORK_LOG), summary)


def trainer_network(group: InstanceGroup, found: EfaProbe | None = None) -> EfaDecision:
    """Decide for a trainer of ``group`` on this host (``found``: the host's ``probe()``,
    taken now when not given) and log the decision. ``efa = "off"`` probes nothing and sets no
    ``FI_*`` variable. Raises EfaUnavailable as ``decide`` does."""
    if group.efa is Efa.OFF:
        decision = EfaDecision(
            False,
            dict(NCCL_NETWORK_LOG),
            f'EFA: off (group {group.name!r} has efa = "off"): not checked, no FI_* set',
        )
    else:
        decision = decide(group, probe() if found is None else found)
    if decision.use_efa or not group.use_efa:
        log.info("%s", decision.summary)
    else:
        log.warning("%s", decision.summary)
    return decision


def _efa_devices(sysfs: Path) -> tuple[str, ...]:
    """Devices bound to the ``efa`` kernel driver (``rdmap*`` names where sysfs has no driver
    link, as in a minimal container)."""
    try:
        entries = sorted(sysfs.iterdir(), key=lambda p: p.name)
    except OSError:
        return ()
    found = []
    for entry in entries:
        driver = entry / "device" / "driver"
        try:
            name = driver.resolve(strict=True).name
        except OSError:
            name = ""
        if name == "efa" or (not name and entry.name.startswith("rdmap")):
            found.append(entry.name)
    return tuple(found)


def _device_nodes(devfs: Path) -> tuple[str, ...]:
    try:
        return tuple(sorted(p.name for p in devfs.glob("uverbs*")))
    except OSError:
        return ()


def _run_fi_info(fi_info: str, timeout_s: float) -> tuple[bool, str]:
    """(listed the efa provider, what to log). In a session of its own, so that a hung
    ``fi_info`` is killed with anything it started."""
    argv = [fi_info, "-p", "efa", "-t", "FI_EP_RDM"]
    try:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as e:
        return False, f"fi_info could not run: {e}"
    with proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return False, f"fi_info timed out after {timeout_s:g} s"
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (err + out).splitlines() if ln.strip()]
        return False, f"fi_info exit {proc.returncode}: {lines[-1][:200] if lines else ''}"
    if not _EFA_PROVIDER_LINE.search(out):
        return False, "fi_info listed no efa provider"
    return True, "efa"


def _plugin_problem(plugin_dir: Path) -> str | None:
    """What is wrong with the plugin files, and the fix; None when both are there."""
    plugin = plugin_dir / PLUGIN_LIBRARY
    if not plugin.exists():
        return f"{plugin} is missing: {_REBUILD}"
    runtime = plugin_dir / PLUGIN_CUDA_RUNTIME
    if not runtime.exists():  # exists() follows the link: a dangling link counts as missing
        target = f" (links to {os.readlink(runtime)})" if runtime.is_symlink() else ""
        return (
            f"{runtime}{target} does not exist, so the plugin cannot load the CUDA runtime: "
            "CUDA_RUNTIME_WHEEL_LIB in containers/Dockerfile must name the libcudart of the "
            "nvidia-cuda-runtime wheel in containers/constraints.txt; fix it and rebuild"
        )
    return None
