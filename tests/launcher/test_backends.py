"""Each place ``hetero launch`` runs in answers the launcher's questions itself
(training/launcher/backends.py): which place a host is in, where its runs and checkpoints go,
where the trainer finds its data servers and what resizes the data tier, where a data server
listens, where an unfit host says why; and no module outside it branches on the backend."""

from __future__ import annotations

import ast
import json
import tomllib
from pathlib import Path

import pytest

from training.common.names import SAGEMAKER_CHECKPOINT_DIR, SAGEMAKER_OUTPUT_DIR
from training.launcher.backends import PLACES, Backend, asks_imds, choose_place
from training.launcher.group import GroupIdentity, GroupSource
from training.launcher.imds import ImdsClient
from training.spec import ClusterSpec, parse_spec

from .conftest import CLUSTER_TOML, FakeImds

REPO = Path(__file__).resolve().parents[2]
ELASTIC = CLUSTER_TOML.replace(
    "count = 2\n\n[job]", "count = 2\nmin_count = 1\nmax_count = 4\n\n[job]"
)
EC2_HOST = GroupIdentity(
    "dataprep", GroupSource.EC2, host="10.0.1.17", region="us-west-2", cluster="vit-prod"
)
FLAG_HOST = GroupIdentity("trainer", GroupSource.FLAG)


def test_a_requested_backend_is_that_place_whatever_the_host_shows(
    tmp_path: Path, fake_imds: FakeImds
) -> None:
    config = tmp_path / "resourceconfig.json"
    config.write_text("{}")
    imds = ImdsClient(fake_imds.url)
    for backend in Backend:
        assert choose_place(backend.value, EC2_HOST, config, imds) is PLACES[backend]
    assert fake_imds.requests == []
    assert [b for b in ("auto", *Backend) if asks_imds(b)] == ["auto", Backend.EC2]


def test_auto_follows_the_group_source_then_the_resource_config_then_imds(
    tmp_path: Path, fake_imds: FakeImds
) -> None:
    config = tmp_path / "resourceconfig.json"
    imds = ImdsClient(fake_imds.url, timeout_s=1.0)
    sagemaker_host = GroupIdentity("trainer", GroupSource.SAGEMAKER, host="algo-1")
    assert choose_place("auto", sagemaker_host, config, imds).name is Backend.SAGEMAKER
    assert choose_place("auto", EC2_HOST, config, imds).name is Backend.EC2
    assert fake_imds.requests == []
    # A group given by flag: IMDS silent and no resource config -> local.
    assert choose_place("auto", FLAG_HOST, config, imds).name is Backend.LOCAL
    fake_imds.set("/latest/meta-data/instance-id", "i-0123456789abcdef0")
    assert choose_place("auto", FLAG_HOST, config, imds).name is Backend.EC2
    config.write_text("{}")  # the resource config is looked at before IMDS
    assert choose_place("auto", FLAG_HOST, config, imds).name is Backend.SAGEMAKER


def answers(spec: ClusterSpec, identity: GroupIdentity) -> dict[Backend, tuple[object, ...]]:
    found = PLACES[Backend.LOCAL].find_peers(spec, Path("/nonexistent"), host_index=1)[0]
    group = spec.group("dataprep")
    return {
        b: (
            p.run_dir(spec),
            p.checkpoint_dir(),
            p.server_host(identity),
            p.server_port(spec, group, found),
            p.data_servers(spec, identity, found),
            p.autoscale(spec, identity),
            p.checks_driver,
            p.uses_efa,
            p.runs_generations,
        )
        for b, p in PLACES.items()
    }


def test_each_place_answers_for_itself() -> None:
    spec = parse_spec(tomllib.loads(ELASTIC))
    loopback = ("127.0.0.1:50051", "127.0.0.1:50052")
    assert answers(spec, EC2_HOST) == {
        # Loopback: the second dataprep host's servers start after the first one's.
        Backend.LOCAL: (
            "runs/vit-test", None, "127.0.0.1", 50052, loopback, "", False, False, False
        ),
        Backend.EC2: (
            "runs/vit-test", None, "10.0.1.17", 50051, ("ec2:vit-prod",),
            "asg:vit-prod-dataprep", True, True, True,
        ),
        Backend.SAGEMAKER: (
            SAGEMAKER_OUTPUT_DIR, SAGEMAKER_CHECKPOINT_DIR, "0.0.0.0", 50051, loopback,
            "report", True, True, False,
        ),
    }  # fmt: skip
    # Without the cluster tag, EC2 names the spec's cluster; without an address, every one.
    untagged = answers(spec, GroupIdentity("dataprep", GroupSource.EC2))[Backend.EC2]
    assert untagged[2:6] == ("0.0.0.0", 50051, ("ec2:vit-test",), "asg:vit-test-dataprep")


def test_sagemaker_finds_its_peers_and_interface_in_the_resource_config(tmp_path: Path) -> None:
    spec = parse_spec(tomllib.loads(CLUSTER_TOML))
    config = tmp_path / "resourceconfig.json"
    config.write_text(
        json.dumps({
            "current_host": "algo-3", "current_group_name": "dataprep",
            "hosts": ["algo-1", "algo-2", "algo-3", "algo-4"],
            "instance_groups": [
                {"instance_group_name": "trainer", "hosts": ["algo-1", "algo-2"]},
                {"instance_group_name": "dataprep", "hosts": ["algo-3", "algo-4"]},
            ],
            "network_interface_name": "eth7",
        })
    )  # fmt: skip
    found, interface = PLACES[Backend.SAGEMAKER].find_peers(spec, config, host_index=0)
    assert (found.hosts["dataprep"], found.self_index, interface) == (
        ("algo-3", "algo-4"),
        0,
        "eth7",
    )
    local, none = PLACES[Backend.LOCAL].find_peers(spec, config, host_index=1)
    assert (local.hosts["trainer"], local.self_index, none) == (("127.0.0.1",) * 2, 1, None)
    with pytest.raises(NotImplementedError, match="ec2 backend finds its peers"):
        PLACES[Backend.EC2].find_peers(spec, config, host_index=0)


def test_only_sagemaker_writes_why_a_host_cannot_run(tmp_path: Path) -> None:
    for backend, place in PLACES.items():
        place.record_unfit("the driver is too old", tmp_path / backend.value)
    assert [p.name for p in tmp_path.iterdir()] == ["sagemaker"]
    assert (tmp_path / "sagemaker").read_text() == "the driver is too old\n"


def test_no_module_outside_the_backends_branches_on_one() -> None:
    """A comparison with a ``Backend`` member anywhere else is the ``if`` chain the places
    replace."""
    found = []
    for path in sorted((REPO / "training").rglob("*.py")):
        if path.name == "backends.py" and path.parent.name == "launcher":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    if (
                        isinstance(side, ast.Attribute)
                        and isinstance(side.value, ast.Name)
                        and side.value.id == "Backend"
                    ):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []
