"""EFA at a trainer's start-up (``training.launcher.efa``): fake device roots, a fake ``fi_info``
and fake plugin files stand in for the host and the image. Checked: the exact variables
torchrun's ranks get with and without EFA (no ``FI_*`` without it), the one log line that says
which network NCCL uses, ``efa = "on"`` stopping the launcher with the config exit code and a
message that names what is missing and the fix, and the wiring through ``hetero launch``."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from training.cli import main
from training.common import image
from training.common.outcome import EXIT_CONFIG
from training.launcher import efa
from training.spec import Efa, InstanceGroup, Role

from .conftest import FakeImds
from .test_launcher_group import RESOURCECONFIG, tag_imds
from .test_launcher_peers import launch

EFA_ENV = {"FI_PROVIDER": "efa", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
SOCKETS_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}

FI_INFO_EFA = """\
provider: efa
    fabric: efa
    domain: rdmap16s27-rdm
    version: 122.0
    type: FI_EP_RDM
    protocol: FI_PROTO_EFA
"""


class FakeHost:
    """Device roots, a ``fi_info`` and the plugin folder under ``root``; ``record`` holds the
    arguments of each ``fi_info`` call (one line per call)."""

    def __init__(self, root: Path) -> None:
        self.sysfs = root / "sys-class-infiniband"
        self.devfs = root / "dev-infiniband"
        self.bin = root / "bin"
        self.plugin_dir = root / "ofi-nccl-lib"
        self.record = root / "fi_info-calls.jsonl"
        for d in (self.sysfs, self.devfs, self.bin, self.plugin_dir):
            d.mkdir(parents=True)
        self.drivers = root / "drivers"

    def device(self, name: str, driver: str | None = "efa") -> None:
        """A verbs device in sysfs; ``driver``: the kernel driver its ``device/driver`` links to
        (None: no link, as where sysfs is minimal)."""
        (self.sysfs / name / "device").mkdir(parents=True)
        if driver is not None:
            (self.drivers / driver).mkdir(parents=True, exist_ok=True)
            (self.sysfs / name / "device" / "driver").symlink_to(self.drivers / driver)

    def nodes(self, count: int) -> None:
        for i in range(count):
            (self.devfs / f"uverbs{i}").touch()

    def fi_info(
        self, *, exit_code: int = 0, stdout: str = FI_INFO_EFA, stderr: str = "", sleep_s: float = 0
    ) -> None:
        """A ``fi_info`` that records its arguments, prints ``stdout`` and ``stderr`` and exits
        with ``exit_code`` after ``sleep_s``."""
        script = self.bin / "fi_info"
        script.write_text(
            "#!/bin/sh\n"
            f"echo \"$*\" >> '{self.record}'\n"
            f"sleep {sleep_s}\n"
            f"cat <<'OUT'\n{stdout}OUT\n"
            f"printf '%s' '{stderr}' >&2\n"
            f"exit {exit_code}\n"
        )
        script.chmod(0o755)

    def plugin(self, *, cuda_runtime: bool = True) -> None:
        """The plugin library and the libcudart.so link the Dockerfile makes (to a file that
        exists, or not)."""
        (self.plugin_dir / "libnccl-net.so").touch()
        target = self.plugin_dir.parent / "wheel" / "libcudart.so.13"
        if cuda_runtime:
            target.parent.mkdir(exist_ok=True)
            target.touch()
        (self.plugin_dir / "libcudart.so").symlink_to(target)

    def calls(self) -> list[list[str]]:
        if not self.record.exists():
            return []
        return [line.split() for line in self.record.read_text().splitlines()]

    def probe(self, timeout_s: float = efa.FI_INFO_TIMEOUT_S) -> efa.EfaProbe:
        return efa.probe(
            sysfs=self.sysfs,
            devfs=self.devfs,
            search_path=str(self.bin),
            plugin_dir=self.plugin_dir,
            timeout_s=timeout_s,
        )

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make this the host the launcher itself probes (the module's default paths)."""
        monkeypatch.setattr(efa, "EFA_SYSFS", self.sysfs)
        monkeypatch.setattr(efa, "EFA_DEVFS", self.devfs)
        record = self.bin.parent / "image.json"
        files = image.EfaFiles(
            fi_info=str(self.bin / "fi_info"),
            plugin_dir=str(self.plugin_dir),
            libfabric_dir=str(self.bin.parent / "lib"),
            cuda_runtime=str(self.plugin_dir.parent / "wheel" / "libcudart.so.13"),
        )
        built = image.ImageRecord("trainer", "3.11.2", "2.15.0", "13.2", files)
        record.write_text(built.to_json())
        monkeypatch.setattr(image, "IMAGE_RECORD", record)
        monkeypatch.setenv("PATH", f"{self.bin}:/usr/bin:/bin")  # the fake fi_info comes first


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    return FakeHost(tmp_path / "host")


def p4d_with_efa(host: FakeHost) -> None:
    """A p4d.24xlarge as the launch template and user data make it: 4 EFA devices, all passed
    into the container, and the image's EFA stack."""
    for name in ("rdmap16s27", "rdmap32s27", "rdmap144s27", "rdmap160s27"):
        host.device(name)
    host.nodes(4)
    host.fi_info()
    host.plugin()


def group(efa_mode: Efa, types: tuple[str, ...] = ("p4d.24xlarge",)) -> InstanceGroup:
    return InstanceGroup("trainer", Role.TRAINER, types, count=2, efa=efa_mode)


# -- the probe -------------------------------------------------------------------------------


def test_probe_counts_only_efa_devices_and_runs_the_documented_fi_info(host: FakeHost) -> None:
    host.device("rdmap16s27")  # the efa driver
    host.device("rdmap32s27", driver=None)  # EFA's naming where sysfs has no driver link
    host.device("mlx5_0", driver="mlx5_core")  # an RDMA device, not EFA
    host.device("efa_1")  # named otherwise, bound to efa
    host.nodes(3)
    host.fi_info()
    host.plugin()
    found = host.probe()
    assert found == efa.EfaProbe(
        devices=("efa_1", "rdmap16s27", "rdmap32s27"),
        device_nodes=("uverbs0", "uverbs1", "uverbs2"),
        fi_info=str(host.bin / "fi_info"),
        provider_ok=True,
        provider="efa",
        plugin_problem=None,
    )
    assert found.usable and found.missing() == []
    assert host.calls() == [["-p", "efa", "-t", "FI_EP_RDM"]]


def test_fi_info_that_lists_no_efa_provider_is_not_efa(host: FakeHost) -> None:
    p4d_with_efa(host)
    (host.bin / "fi_info").unlink()
    host.fi_info(stdout="provider: tcp\n    fabric: 10.0.0.0/24\n")
    found = host.probe()
    assert (found.provider_ok, found.provider) == (False, "fi_info listed no efa provider")


def test_fi_info_is_bounded_in_time(host: FakeHost) -> None:
    p4d_with_efa(host)
    (host.bin / "fi_info").unlink()
    host.fi_info(sleep_s=30)
    started = time.monotonic()
    found = host.probe(timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert (found.provider_ok, found.provider) == (False, "fi_info timed out after 0.5 s")


# -- the decision: EFA ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", [Efa.ON, Efa.AUTO])
def test_with_devices_and_provider_the_ranks_get_exactly_the_efa_env(
    host: FakeHost, mode: Efa, caplog: pytest.LogCaptureFixture
) -> None:
    p4d_with_efa(host)
    with caplog.at_level(logging.INFO, logger="training.launcher.efa"):
        decision = efa.trainer_network(group(mode), host.probe())
    assert decision.use_efa
    assert dict(decision.env) == EFA_ENV
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.INFO,
            "EFA: 4 device(s) (rdmap144s27, rdmap160s27, rdmap16s27, rdmap32s27), provider "
            "efa: NCCL uses EFA through aws-ofi-nccl (its log: 'NET/OFI Selected Provider is "
            "efa')",
        )
    ]


# -- the decision: no EFA, efa = "auto" ----------------------------------------------------


def test_auto_without_devices_sets_no_fi_variable_and_says_sockets(
    host: FakeHost, caplog: pytest.LogCaptureFixture
) -> None:
    host.fi_info()
    host.plugin()
    with caplog.at_level(logging.INFO, logger="training.launcher.efa"):
        decision = efa.trainer_network(group(Efa.AUTO), host.probe())
    assert not decision.use_efa
    assert dict(decision.env) == SOCKETS_ENV
    assert not [k for k in decision.env if k.startswith("FI_")]
    assert host.calls() == []  # nothing for fi_info to open: not run
    # The group's types have EFA, so the launch template had EFA interfaces: a warning, why.
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            "EFA: none (0 device(s), provider not checked: no EFA device in this container): "
            "NCCL uses TCP sockets (its log: 'NET/Socket'); missing: EFA devices: the kernel "
            "lists none in /sys/class/infiniband: the launch template lacks EFA interfaces "
            "(infra/efa.py) or the instance type has none",
        )
    ]


def test_auto_on_a_type_without_efa_logs_sockets_as_plain_information(
    host: FakeHost, caplog: pytest.LogCaptureFixture
) -> None:
    host.fi_info()
    host.plugin()
    with caplog.at_level(logging.INFO, logger="training.launcher.efa"):
        decision = efa.trainer_network(group(Efa.AUTO, ("g5.xlarge",)), host.probe())
    assert dict(decision.env) == SOCKETS_ENV
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.INFO,
            "EFA: none (0 device(s), provider not checked: no EFA device in this container): "
            "NCCL uses TCP sockets (its log: 'NET/Socket')",
        )
    ]


def test_auto_with_a_failing_provider_goes_on_with_sockets(host: FakeHost) -> None:
    p4d_with_efa(host)
    (host.bin / "fi_info").unlink()
    host.fi_info(exit_code=1, stdout="", stderr="fi_getinfo: -61 (No data available)")
    decision = efa.trainer_network(group(Efa.AUTO), host.probe())
    assert dict(decision.env) == SOCKETS_ENV
    assert decision.summary.startswith(
        "EFA: none (4 device(s), provider fi_info exit 1: fi_getinfo: -61 (No data "
        "available)): NCCL uses TCP sockets"
    )


def test_off_probes_nothing_and_sets_no_fi_variable(host: FakeHost) -> None:
    p4d_with_efa(host)
    decision = efa.trainer_network(group(Efa.OFF))
    assert (decision.use_efa, dict(decision.env)) == (False, SOCKETS_ENV)
    assert decision.summary == (
        "EFA: off (group 'trainer' has efa = \"off\"): not checked, no FI_* set"
    )
    assert host.calls() == []


# -- the decision: no EFA, efa = "on" ------------------------------------------------------


def test_on_without_the_provider_in_the_image_names_the_image(host: FakeHost) -> None:
    for name in ("rdmap16s27", "rdmap32s27"):
        host.device(name)
    host.nodes(2)
    with pytest.raises(efa.EfaUnavailable) as raised:
        efa.trainer_network(group(Efa.ON), host.probe())
    assert str(raised.value) == (
        "group 'trainer' has efa = \"on\" but NCCL cannot use EFA on this host; missing: "
        "the EFA provider: no fi_info in the image or on PATH: the image was not built "
        "from containers/Dockerfile (its EFA installer step); rebuild and push it (`cdk "
        "deploy` builds containers/Dockerfile); the aws-ofi-nccl plugin: "
        f"{host.plugin_dir / 'libnccl-net.so'} is missing: the image was not built from "
        "containers/Dockerfile (its EFA installer step); rebuild and push it (`cdk deploy` "
        "builds containers/Dockerfile)"
    )


def test_on_with_host_devices_not_passed_into_the_container_names_docker_run(
    host: FakeHost,
) -> None:
    p4d_with_efa(host)
    for node in host.devfs.iterdir():
        node.unlink()
    with pytest.raises(efa.EfaUnavailable, match="missing: EFA device nodes: ") as raised:
        efa.trainer_network(group(Efa.ON), host.probe())
    assert str(raised.value).endswith(
        "the host has 4 EFA device(s) but this container has no /dev/infiniband/uverbs*: "
        "`docker run` lacks --device=/dev/infiniband/uverbsN (the user data in "
        "infra/instance_group.py)"
    )
    assert host.calls() == []


def test_on_without_devices_names_the_launch_template(host: FakeHost) -> None:
    host.fi_info()
    host.plugin()
    with pytest.raises(efa.EfaUnavailable) as raised:
        efa.trainer_network(group(Efa.ON), host.probe())
    assert str(raised.value) == (
        "group 'trainer' has efa = \"on\" but NCCL cannot use EFA on this host; missing: EFA "
        "devices: the kernel lists none in /sys/class/infiniband: the launch template lacks "
        "EFA interfaces (infra/efa.py) or the instance type has none"
    )


def test_on_with_a_dangling_cuda_runtime_link_names_the_dockerfile_arg(host: FakeHost) -> None:
    for name in ("rdmap16s27",):
        host.device(name)
    host.nodes(1)
    host.fi_info()
    host.plugin(cuda_runtime=False)
    with pytest.raises(efa.EfaUnavailable) as raised:
        efa.trainer_network(group(Efa.ON), host.probe())
    link = host.plugin_dir / "libcudart.so"
    assert str(raised.value).endswith(
        f"missing: the aws-ofi-nccl plugin: {link} (links to "
        f"{host.plugin_dir.parent / 'wheel' / 'libcudart.so.13'}) does not exist, so the "
        "plugin cannot load the CUDA runtime: CUDA_RUNTIME_WHEEL_LIB in containers/Dockerfile "
        "must name the libcudart of the nvidia-cuda-runtime wheel in containers/constraints.txt; "
        "fix it and rebuild"
    )


# -- wired into `hetero launch` ------------------------------------------------------------

SPEC = """
name = "vit-test"

[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.12xlarge"]
count = 2
efa = "{efa}"

[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 2

[job]
steps = 10

[job.dataplane]
port = 50051
"""


def write_spec(tmp_path: Path, efa_mode: str) -> Path:
    path = tmp_path / f"efa-{efa_mode}.toml"
    path.write_text(SPEC.format(efa=efa_mode))
    return path


def sagemaker_trainer(tmp_path: Path) -> Path:
    config = dict(RESOURCECONFIG, current_host="algo-2", current_group_name="trainer")
    path = tmp_path / "resourceconfig.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(autouse=True)
def no_group_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HETERO_GROUP", "HETERO_CHECKPOINT_URI"):
        monkeypatch.delenv(name, raising=False)


def test_launch_on_sagemaker_gives_torchrun_the_efa_env(
    host: FakeHost,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    p4d_with_efa(host)
    host.install(monkeypatch)
    spec = write_spec(tmp_path, "on")
    rc = sagemaker_trainer(tmp_path)
    assert main(["launch", "--spec", str(spec), "--resourceconfig", str(rc), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "trainer: NCCL_SOCKET_IFNAME=eth0 FI_PROVIDER=efa NCCL_DEBUG=INFO "
        "NCCL_DEBUG_SUBSYS=INIT,NET "
    )
    assert host.calls() == [["-p", "efa", "-t", "FI_EP_RDM"]]


def test_launch_with_efa_on_and_no_device_exits_with_the_config_code_before_torchrun(
    host: FakeHost,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    host.fi_info()
    host.plugin()
    host.install(monkeypatch)
    spec = write_spec(tmp_path, "on")
    rc = sagemaker_trainer(tmp_path)
    code = main(["launch", "--spec", str(spec), "--resourceconfig", str(rc), "--dry-run"])
    assert code == EXIT_CONFIG == 2
    assert capsys.readouterr().out == ""  # no plan: torchrun would never start
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "group 'trainer' has efa = \"on\" but NCCL cannot use EFA on this host; missing: EFA "
        "devices: the kernel lists none in /sys/class/infiniband: the launch template lacks "
        "EFA interfaces (infra/efa.py) or the instance type has none"
    ]


def test_launch_with_efa_auto_and_no_device_runs_on_sockets(
    host: FakeHost,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    host.install(monkeypatch)
    spec = write_spec(tmp_path, "auto")
    rc = sagemaker_trainer(tmp_path)
    assert main(["launch", "--spec", str(spec), "--resourceconfig", str(rc), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trainer: NCCL_SOCKET_IFNAME=eth0 NCCL_DEBUG=INFO ")
    assert "FI_" not in out


def test_launch_on_ec2_gives_every_generation_the_efa_env(
    host: FakeHost,
    tmp_path: Path,
    fake_imds: FakeImds,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    p4d_with_efa(host)
    host.install(monkeypatch)
    spec = write_spec(tmp_path, "on")
    with mock_aws():
        client = boto3.client("ec2", region_name="us-west-2")
        vpc = client.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnet = client.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
        launch((client, subnet), "10.0.0.40", "trainer")
        me = launch((client, subnet), "10.0.0.41", "trainer")
        tag_imds(fake_imds, "trainer")
        fake_imds.set("/latest/meta-data/instance-id", me)
        code = main(
            [
                "launch", "--spec", str(spec), "--resourceconfig", str(tmp_path / "no"),
                "--imds-url", fake_imds.url, "--dry-run",
            ]
        )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "trainer: AWS_DEFAULT_REGION=us-west-2 FI_PROVIDER=efa NCCL_DEBUG=INFO "
        "NCCL_DEBUG_SUBSYS=INIT,NET "
    )


def test_local_backend_does_not_probe_efa(
    host: FakeHost,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    host.install(monkeypatch)  # no device: efa = "on" would stop an EC2 or SageMaker trainer
    spec = write_spec(tmp_path, "on")
    argv = ["launch", "--spec", str(spec), "--backend", "local", "--group", "trainer"]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trainer: ") and "FI_" not in out and "NCCL_DEBUG" not in out
    assert host.calls() == []
