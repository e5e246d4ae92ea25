"""The image's record (``training.common.image``): the build's last step finds what AWS's EFA
installer put under /opt/amazon in either layout it has used, links the CUDA runtime beside the
plugin, writes the linker's path, and fails naming what it looked for; an image built without
the EFA stack says so, and the launcher's EFA check repeats it."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.common import image
from training.launcher import efa
from training.spec import Efa, InstanceGroup, Role


def installed(root: Path, plugin_lib: str) -> Path:
    """What the EFA installer leaves under ``root`` (/opt/amazon), the plugin in
    ``ofi-nccl/<plugin_lib>``; returns the CUDA runtime a wheel would have."""
    (root / "efa" / "bin").mkdir(parents=True)
    (root / "efa" / "bin" / "fi_info").touch()
    (root / "efa" / "lib").mkdir()
    (root / "efa" / "lib" / "libfabric.so.1").touch()
    plugin_dir = root / "ofi-nccl" / plugin_lib
    plugin_dir.mkdir(parents=True)
    (plugin_dir / "libnccl-net-ofi.so").touch()
    (plugin_dir / "libnccl-net.so").symlink_to("libnccl-net-ofi.so")
    runtime = root.parent / "site-packages" / "nvidia" / "cu13" / "lib" / "libcudart.so.13"
    runtime.parent.mkdir(parents=True)
    runtime.touch()
    return runtime


@pytest.mark.parametrize("plugin_lib", ["lib", "lib/x86_64-linux-gnu"])
def test_the_plugin_is_found_where_the_installer_put_it(tmp_path: Path, plugin_lib: str) -> None:
    root = tmp_path / "opt-amazon"
    runtime = installed(root, plugin_lib)
    files = image.find_efa(root, runtime)
    assert files == image.EfaFiles(
        fi_info=str(root / "efa" / "bin" / "fi_info"),
        plugin_dir=str(root / "ofi-nccl" / plugin_lib),
        libfabric_dir=str(root / "efa" / "lib"),
        cuda_runtime=str(runtime),
    )
    conf = tmp_path / "ld.so.conf.d" / "hetero-efa.conf"
    image.install_efa_paths(files, conf)
    link = root / "ofi-nccl" / plugin_lib / "libcudart.so"
    assert link.resolve() == runtime.resolve()
    assert conf.read_text() == f"{root / 'ofi-nccl' / plugin_lib}\n{root / 'efa' / 'lib'}\n"
    # What the launcher then checks passes on exactly these files.
    assert efa._plugin_problem(Path(files.plugin_dir)) is None


def test_a_missing_plugin_fails_the_build_naming_where_it_looked(tmp_path: Path) -> None:
    root = tmp_path / "opt-amazon"
    runtime = installed(root, "lib")
    for p in (root / "ofi-nccl" / "lib").iterdir():
        p.unlink()
    with pytest.raises(image.ImageBuildError) as raised:
        image.find_efa(root, runtime)
    assert str(raised.value) == (
        f"the aws-ofi-nccl plugin: no libnccl-net.so under {root / 'ofi-nccl'}; the EFA "
        "installer did not install it where this build looks (see its output above)"
    )


def test_a_wrong_cuda_runtime_fails_the_build_naming_the_build_argument(tmp_path: Path) -> None:
    root = tmp_path / "opt-amazon"
    installed(root, "lib")
    with pytest.raises(image.ImageBuildError, match="CUDA_RUNTIME_WHEEL_LIB in containers/"):
        image.find_efa(root, tmp_path / "nvidia" / "cu12" / "lib" / "libcudart.so.12")


def test_a_build_without_efa_records_what_it_left_out(tmp_path: Path) -> None:
    record = image.build_record(target="trainer", efa_installer="none", torch_from="cpu-index")
    assert record.efa is None
    assert record.left_out == (
        "the EFA user-space stack (EFA_INSTALLER=none): NCCL uses TCP sockets on every host",
    )
    data = image.build_record(target="data-server", efa_installer="aws", torch_from="pypi")
    assert data.efa is None and len(data.left_out) == 1 and "TORCH_FROM=pypi" in data.left_out[0]
    with pytest.raises(image.ImageBuildError, match="EFA_INSTALLER=nope: expected one of"):
        image.build_record(target="trainer", efa_installer="nope", torch_from="cpu-index")
    path = tmp_path / "image.json"
    path.write_text(record.to_json())
    assert image.read_record(path) == record
    assert image.read_record(tmp_path / "absent.json") is None


def test_the_launcher_names_an_image_built_without_efa(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = image.build_record(target="trainer", efa_installer="none", torch_from="cpu-index")
    path = tmp_path / "image.json"
    path.write_text(record.to_json())
    monkeypatch.setattr(image, "IMAGE_RECORD", path)
    sysfs = tmp_path / "sys"
    (sysfs / "rdmap16s27" / "device").mkdir(parents=True)
    devfs = tmp_path / "dev"
    devfs.mkdir()
    (devfs / "uverbs0").touch()
    found = efa.probe(sysfs=sysfs, devfs=devfs)
    assert found.fi_info is None and not found.usable
    group = InstanceGroup(
        name="trainer", role=Role.TRAINER, instance_types=("p4d.24xlarge",), count=1, efa=Efa.ON
    )
    with pytest.raises(efa.EfaUnavailable) as raised:
        efa.decide(group, found)
    assert str(raised.value) == (
        "group 'trainer' has efa = \"on\" but NCCL cannot use EFA on this host; missing: the "
        "image: this image was built without the EFA stack (the EFA user-space stack "
        "(EFA_INSTALLER=none): NCCL uses TCP sockets on every host); rebuild it where "
        "efa-installer.amazonaws.com can be reached, without EFA_INSTALLER=none (`cdk deploy` "
        "builds the full image)"
    )
