"""Group detection: each source in order, and the error that lists every source tried."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.launcher.group import GroupDetectionError, GroupSource, detect_group
from training.launcher.imds import ImdsClient
from training.spec import ClusterSpec

from .conftest import FakeImds

# SageMaker's documented resourceconfig.json for a heterogeneous job (two instance groups).
RESOURCECONFIG = {
    "current_host": "algo-3",
    "current_instance_type": "ml.c5.18xlarge",
    "current_group_name": "dataprep",
    "hosts": ["algo-1", "algo-2", "algo-3", "algo-4"],
    "instance_groups": [
        {
            "instance_group_name": "trainer",
            "instance_type": "ml.g5.12xlarge",
            "hosts": ["algo-2", "algo-1"],
        },
        {
            "instance_group_name": "dataprep",
            "instance_type": "ml.c5.18xlarge",
            "hosts": ["algo-4", "algo-3"],
        },
    ],
    "network_interface_name": "eth0",
}


def write_resourceconfig(tmp_path: Path, data: dict[str, object] = RESOURCECONFIG) -> Path:
    path = tmp_path / "resourceconfig.json"
    path.write_text(json.dumps(data))
    return path


def tag_imds(imds: FakeImds, group: str = "trainer") -> None:
    imds.set("/latest/meta-data/tags/instance/hetero:group", group)
    imds.set("/latest/meta-data/tags/instance/hetero:cluster", "vit-test")
    imds.set("/latest/meta-data/instance-id", "i-0123456789abcdef0")
    imds.set("/latest/meta-data/local-ipv4", "10.0.1.17")
    imds.set("/latest/meta-data/placement/region", "us-west-2")


def test_flag_wins_over_every_other_source(
    spec: ClusterSpec, tmp_path: Path, fake_imds: FakeImds
) -> None:
    tag_imds(fake_imds, "dataprep")
    ident = detect_group(
        spec,
        flag="trainer",
        environ={"HETERO_GROUP": "dataprep"},
        resourceconfig=write_resourceconfig(tmp_path),
        imds=ImdsClient(fake_imds.url),
    )
    assert (ident.group, ident.source) == ("trainer", GroupSource.FLAG)
    assert fake_imds.requests == []  # later sources are not even asked


def test_env_wins_over_sagemaker_and_imds(spec: ClusterSpec, tmp_path: Path) -> None:
    ident = detect_group(
        spec,
        environ={"HETERO_GROUP": "trainer"},
        resourceconfig=write_resourceconfig(tmp_path),
    )
    assert (ident.group, ident.source) == ("trainer", GroupSource.ENV)


def test_sagemaker_resourceconfig(spec: ClusterSpec, tmp_path: Path, fake_imds: FakeImds) -> None:
    ident = detect_group(
        spec,
        environ={},
        resourceconfig=write_resourceconfig(tmp_path),
        imds=ImdsClient(fake_imds.url),
    )
    assert (ident.group, ident.source, ident.host) == ("dataprep", GroupSource.SAGEMAKER, "algo-3")
    assert fake_imds.requests == []


def test_ec2_tags_through_imdsv2(spec: ClusterSpec, tmp_path: Path, fake_imds: FakeImds) -> None:
    tag_imds(fake_imds)
    ident = detect_group(
        spec,
        environ={},
        resourceconfig=tmp_path / "absent.json",
        imds=ImdsClient(fake_imds.url),
    )
    assert ident.group == "trainer"
    assert ident.source is GroupSource.EC2
    assert ident.instance_id == "i-0123456789abcdef0"
    assert ident.host == "10.0.1.17"
    assert ident.region == "us-west-2"
    assert ident.cluster == "vit-test"
    # IMDSv2: the token PUT comes first, once; every read is a GET with it.
    assert fake_imds.requests[0] == ("PUT", "/latest/api/token")
    assert [m for m, _ in fake_imds.requests].count("PUT") == 1


def test_fake_imds_refuses_reads_without_a_token(fake_imds: FakeImds) -> None:
    import urllib.error
    import urllib.request

    tag_imds(fake_imds)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(fake_imds.url + "/latest/meta-data/instance-id", timeout=2)
    assert e.value.code == 401


def test_every_source_failing_lists_what_was_tried(spec: ClusterSpec, tmp_path: Path) -> None:
    # An IMDS endpoint where nothing listens: a closed port on loopback.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    missing = tmp_path / "resourceconfig.json"
    with pytest.raises(GroupDetectionError) as e:
        detect_group(
            spec,
            environ={},
            resourceconfig=missing,
            imds=ImdsClient(f"http://127.0.0.1:{dead_port}", timeout_s=0.5),
        )
    message = str(e.value)
    assert len(e.value.attempts) == 4
    assert "--group flag: not given" in message
    assert "HETERO_GROUP: not set" in message
    assert f"{missing}: no such file" in message
    assert "IMDSv2" in message and "unreachable" in message
    assert "Pass --group NAME" in message


def test_imds_without_the_tag_explains_metadata_tags(
    spec: ClusterSpec, tmp_path: Path, fake_imds: FakeImds
) -> None:
    with pytest.raises(GroupDetectionError, match="instance metadata tags enabled"):
        detect_group(
            spec, environ={}, resourceconfig=tmp_path / "x.json", imds=ImdsClient(fake_imds.url)
        )


def test_homogeneous_sagemaker_job_is_explained(spec: ClusterSpec, tmp_path: Path) -> None:
    config = {"current_host": "algo-1", "hosts": ["algo-1"]}
    with pytest.raises(GroupDetectionError, match="has no current_group_name"):
        detect_group(spec, environ={}, resourceconfig=write_resourceconfig(tmp_path, config))


def test_a_group_the_spec_lacks_is_refused_by_name(spec: ClusterSpec, tmp_path: Path) -> None:
    with pytest.raises(GroupDetectionError, match=r"named group 'trainers'.*has only trainer"):
        detect_group(spec, environ={"HETERO_GROUP": "trainers"}, resourceconfig=tmp_path / "x")
