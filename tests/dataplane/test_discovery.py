"""Discovery sources: the ``--data-servers`` forms, a discovery file, SageMaker's resource
config. (EC2 discovery is tested beside the launcher's EC2 peers, on the same moto fixture:
``tests/launcher/test_launcher_peers.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.dataplane.discovery import (
    DiscoveryError,
    Ec2Servers,
    FileServers,
    SageMakerServers,
    StaticServers,
    parse_discovery,
)
from training.spec import ClusterSpec, load_spec


@pytest.fixture
def spec(spec_path: Path) -> ClusterSpec:
    """Groups ``trainer`` (1) and ``dataprep`` (2, one server each on port 50051)."""
    return load_spec(spec_path)


def test_forms_of_data_servers(spec: ClusterSpec, tmp_path: Path) -> None:
    static = parse_discovery("10.0.0.5:50051, 10.0.0.6:50051,10.0.0.5:50051", spec)
    assert isinstance(static, StaticServers)
    assert static.addresses() == ["10.0.0.5:50051", "10.0.0.6:50051"]
    listing = parse_discovery(f"file:{tmp_path / 'servers.txt'}", spec)
    assert isinstance(listing, FileServers) and listing.path == tmp_path / "servers.txt"
    ec2 = parse_discovery("ec2:other-cluster", spec)
    assert isinstance(ec2, Ec2Servers) and ec2.cluster == "other-cluster"
    assert isinstance(parse_discovery("ec2", spec), Ec2Servers)
    assert parse_discovery("ec2", spec).cluster == spec.name  # type: ignore[attr-defined]
    sm = parse_discovery("sagemaker", spec)
    assert isinstance(sm, SageMakerServers)
    assert str(sm.path) == "/opt/ml/input/config/resourceconfig.json"
    loopback = parse_discovery("loopback", spec)
    assert loopback.addresses() == ["127.0.0.1:50051", "127.0.0.1:50052"]
    for bad in ("10.0.0.5", "host:99999", "ec3:x", "file:"):
        with pytest.raises(ValueError, match=r"host:port|file: needs a path") as err:
            parse_discovery(bad, spec)
        if bad != "file:":
            assert "ec2[:CLUSTER]" in str(err.value)


def test_file_is_read_again_on_every_call(tmp_path: Path) -> None:
    path = tmp_path / "servers.txt"
    source = FileServers(path)
    assert source.addresses() == []  # no file yet: no server
    path.write_text("# data servers\n127.0.0.1:5001\n\n127.0.0.1:5002  # second\n")
    assert source.addresses() == ["127.0.0.1:5001", "127.0.0.1:5002"]
    path.write_text("127.0.0.1:5003\n")
    assert source.addresses() == ["127.0.0.1:5003"]
    path.write_text("127.0.0.1:5003\nnot-an-address\n")
    with pytest.raises(DiscoveryError, match="line 2: 'not-an-address' is not host:port"):
        source.addresses()


def test_sagemaker_dataprep_hosts(spec: ClusterSpec, tmp_path: Path) -> None:
    path = tmp_path / "resourceconfig.json"
    source = SageMakerServers(spec, path)
    with pytest.raises(DiscoveryError, match="cannot read SageMaker's"):
        source.addresses()
    path.write_text(
        json.dumps(
            {
                "current_host": "algo-1",
                "current_group_name": "trainer",
                "instance_groups": [
                    {"instance_group_name": "trainer", "hosts": ["algo-1"]},
                    {"instance_group_name": "dataprep", "hosts": ["algo-10", "algo-2"]},
                ],
            }
        )
    )
    assert source.addresses() == ["algo-2:50051", "algo-10:50051"]
