"""Shared fixtures: small synthetic specs and data servers on 127.0.0.1 (port 0)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from training.dataplane.server import create_server
from training.dataplane.sources import AugmentingBatchSource
from training.spec import DatasetSpec, Recipe

SPEC_TEMPLATE = """
name = "dataplane-test"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 2
[job]
batch_size = 8
augmentation = "standard"
[job.dataset]
source = "synthetic"
num_samples = {num_samples}
num_classes = 10
image_size = 32
[job.dataplane]
workers_per_server = 1
"""


def write_spec(path: Path, num_samples: int = 400) -> Path:
    path.write_text(SPEC_TEMPLATE.format(num_samples=num_samples))
    return path


@pytest.fixture
def spec_path(tmp_path: Path) -> Path:
    return write_spec(tmp_path / "spec.toml")


@pytest.fixture
def small_source() -> Iterator[AugmentingBatchSource]:
    """Synthetic 32 px images augmented in threads of the test process (fast to start)."""
    source = AugmentingBatchSource(
        DatasetSpec(num_samples=96, num_classes=10, image_size=32),
        recipe=Recipe.STANDARD,
        workers=2,
        processes=False,
    )
    yield source
    source.close()


@pytest.fixture
def server_address(small_source: AugmentingBatchSource) -> Iterator[str]:
    server, port = create_server(small_source, port=0)
    yield f"127.0.0.1:{port}"
    server.stop(0).wait()


@pytest.fixture
def channel(server_address: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server_address) as ch:
        yield ch


@pytest.fixture
def make_spec() -> Callable[[Path, int], Path]:
    """``write_spec`` for tests that need another dataset size."""
    return write_spec


@pytest.fixture
def two_servers() -> Iterator[list[str]]:
    """Two in-process data servers over the same 96-sample dataset."""
    sources, servers, addresses = [], [], []
    for _ in range(2):
        source = AugmentingBatchSource(
            DatasetSpec(num_samples=96, num_classes=10, image_size=32), workers=1, processes=False
        )
        server, port = create_server(source, port=0)
        sources.append(source)
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    yield addresses
    for server, source in zip(servers, sources, strict=True):
        server.stop(0).wait()
        source.close()
