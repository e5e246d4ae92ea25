"""The instance catalogue's CPU types with NVMe instance store: exact entries (the figures of the
sources ``training/instance_types.py`` cites), and a spec can use them for its data servers."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from training import instance_types
from training.instance_types import InstanceType
from training.spec import Efa, Role, SpecError, parse_spec
from training.spec.schema import DatasetSource

# name, vCPUs, memory GiB, On-Demand USD/h (us-east-1, 2026-07-20), volumes x GB each.
PINNED = [
    ("c6id.4xlarge", 16, 32, 0.8064, 1, 950),
    ("c6id.8xlarge", 32, 64, 1.6128, 1, 1900),
    ("c6id.32xlarge", 128, 256, 6.4512, 4, 1900),
    ("c5d.18xlarge", 72, 144, 3.456, 2, 900),
    ("m6id.4xlarge", 16, 64, 0.9492, 1, 950),
]


@pytest.mark.parametrize(("name", "vcpus", "memory", "usd", "volumes", "gb"), PINNED)
def test_instance_store_types_are_catalogued_exactly(
    name: str, vcpus: int, memory: int, usd: float, volumes: int, gb: int
) -> None:
    t = instance_types.lookup(name)
    assert t is not None
    assert (t.vcpus, t.memory_gib, t.gpus, t.gpu_model, t.on_demand_usd_per_hour) == (
        vcpus,
        memory,
        0,
        None,
        usd,
    )
    assert (t.instance_store_volumes, t.instance_store_volume_gb) == (volumes, gb)
    assert t.instance_store_volume_bytes == gb * 10**9


def test_only_c6id_32xlarge_of_them_has_efa() -> None:
    """EFA on c6id.32xlarge (one network card, like c6i.32xlarge); none on the others."""
    store = [t for t in instance_types.CATALOG.values() if t.instance_store_volumes]
    assert {t.name for t in store if t.supports_efa} == {"c6id.32xlarge"}
    assert instance_types.CATALOG["c6id.32xlarge"].efa_network_cards == 1


def test_types_without_instance_store_say_so() -> None:
    for name in ("c6i.8xlarge", "c5.9xlarge", "g5.xlarge", "p4d.24xlarge"):
        t = instance_types.CATALOG[name]
        assert (t.instance_store_volumes, t.instance_store_volume_gb) == (0, 0), name
    # A volume count and a size come together.
    for t in instance_types.CATALOG.values():
        assert (t.instance_store_volumes == 0) == (t.instance_store_volume_gb == 0), t.name


def test_the_catalogue_stays_positional_for_older_entries() -> None:
    """Entries without instance store need not name the new fields."""
    t = InstanceType("x.cpu", 4, 8, 0, None, 0, 0.1)
    assert (t.instance_store_volumes, t.instance_store_volume_bytes) == (0, 0)


DOC: dict[str, Any] = {
    "name": "t",
    "groups": [
        {
            "name": "trainer",
            "role": "trainer",
            "instance_types": ["g5.xlarge"],
            "count": 1,
            "market": "on-demand",
        },
        {
            "name": "dataprep",
            "role": "dataprep",
            "instance_types": ["c6id.8xlarge", "c6id.4xlarge", "c5d.9xlarge", "m6id.4xlarge"],
            "count": 2,
            "market": "on-demand",
        },
    ],
    "job": {
        "steps": 10,
        "dataset": {"source": "shards", "path": "s3://d/imagenet/", "cache_gb": 900},
    },
}


def test_a_spec_takes_a_dataprep_group_of_instance_store_types() -> None:
    spec = parse_spec(copy.deepcopy(DOC))
    group = spec.group("dataprep")
    assert group.role is Role.DATAPREP
    assert group.instance_types == ("c6id.8xlarge", "c6id.4xlarge", "c5d.9xlarge", "m6id.4xlarge")
    assert spec.job.dataset.source is DatasetSource.SHARDS and spec.job.dataset.cache_gb == 900
    # The catalogue prices them (On-Demand) where the spec gives no price.
    assert spec.usd_per_hour() == pytest.approx(1.006 + 2 * 1.6128)


def test_efa_on_is_accepted_on_c6id_32xlarge_and_refused_on_c6id_8xlarge() -> None:
    doc = copy.deepcopy(DOC)
    doc["groups"][1].update(instance_types=["c6id.32xlarge"], efa="on")
    assert parse_spec(doc).group("dataprep").efa is Efa.ON
    doc["groups"][1].update(instance_types=["c6id.8xlarge"])
    with pytest.raises(SpecError) as info:
        parse_spec(doc)
    assert any("efa: 'on' but c6id.8xlarge has no EFA" in p for p in info.value.problems)


# -------------------------------------------------------------------- GPUs the image supports

# NVIDIA's compute capabilities (https://developer.nvidia.com/cuda-gpus, V100 on the legacy
# page; A10G is AWS's A10).
COMPUTE_CAPABILITY = {
    "H100": (9, 0),
    "A100": (8, 0),
    "A100-80GB": (8, 0),
    "L40S": (8, 9),
    "L4": (8, 9),
    "A10G": (8, 6),
    "T4": (7, 5),
    "V100": (7, 0),
}
REPO = Path(__file__).resolve().parents[1]


def test_every_gpu_type_has_its_compute_capability_and_cpu_types_none() -> None:
    for t in instance_types.CATALOG.values():
        if t.gpus:
            assert t.compute_capability == COMPUTE_CAPABILITY[str(t.gpu_model)], t.name
        else:
            assert t.compute_capability is None, t.name
    # Older positional entries (e.g. the planner tests' own catalogues) still work.
    assert InstanceType("g.x", 8, 32, 1, "X", 0, 1.0).compute_capability is None


def test_the_catalogues_cuda_major_is_the_pinned_wheels() -> None:
    """IMAGE_CUDA_MAJOR is what the spec check judges GPUs by: the image's CUDA runtime wheel."""
    pins = dict(
        line.split("==", 1)
        for line in (REPO / "containers" / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert int(pins["nvidia-cuda-runtime"].split(".")[0]) == instance_types.IMAGE_CUDA_MAJOR
    assert instance_types.IMAGE_CUDA_MAJOR in instance_types.MIN_COMPUTE_CAPABILITY
    assert instance_types.IMAGE_CUDA_MAJOR in instance_types.MIN_DRIVER_BRANCH


@pytest.mark.parametrize("name", ["p3.2xlarge", "p3.8xlarge", "p3.16xlarge", "p3dn.24xlarge"])
def test_a_v100_trainer_is_refused_with_the_fix(name: str) -> None:
    doc = copy.deepcopy(DOC)
    doc["groups"][0]["instance_types"] = [name]
    with pytest.raises(SpecError) as info:
        parse_spec(doc)
    (problem,) = info.value.problems
    assert problem == (
        f"groups[0].instance_types[0]: {name} has V100 GPUs (compute capability 7.0); the "
        "image's CUDA 13 wheels (containers/constraints.txt) have kernels only for 7.5 and "
        "newer, so the job would fail at its first CUDA call; choose a type whose GPU the image "
        "supports (g4dn, g5, g6, g6e, p4d, p4de or p5), or build the image with CUDA 12.x wheels "
        "(PyTorch's CUDA 12.8 and 12.9 builds still carry 7.0 kernels) and set "
        "training/instance_types.py IMAGE_CUDA_MAJOR to match"
    )


def test_spec_check_refuses_a_p3_trainer_and_names_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from training import cli

    spec = tmp_path / "p3.toml"
    spec.write_text(
        'name = "v100"\n[[groups]]\nname = "trainer"\nrole = "trainer"\n'
        'instance_types = ["g5.xlarge", "p3.2xlarge"]\ncount = 1\n[job]\nsteps = 10\n'
    )
    assert cli.main(["spec", "check", "--spec", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "groups[0].instance_types[1]: p3.2xlarge has V100 GPUs (compute capability 7.0)" in err
    assert "choose a type whose GPU the image supports (g4dn, g5, g6, g6e, p4d, p4de or p5)" in err
    assert "instance_types[0]" not in err  # g5.xlarge, beside it, is fine


@pytest.mark.parametrize("name", ["g4dn.xlarge", "g5.xlarge", "g6.xlarge", "p4d.24xlarge"])
def test_gpus_from_turing_on_are_accepted(name: str) -> None:
    doc = copy.deepcopy(DOC)
    doc["groups"][0]["instance_types"] = [name]
    assert parse_spec(doc).trainer_group.instance_types == (name,)


def test_a_cpu_data_server_type_needs_no_compute_capability() -> None:
    assert instance_types.CATALOG["c6i.4xlarge"].image_problem() is None
