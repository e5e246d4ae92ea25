"""Shared parts for the rehearsal tests: a moto server in this process, a small spec on disk."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from training.rehearsal.aws import AwsEmulator

SMALL_SPEC = """
name = "tiny"

[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 2

[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 1

[job]
steps = 4
"""


@pytest.fixture
def small_spec(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(SMALL_SPEC)
    return path


@pytest.fixture
def aws() -> Iterator[AwsEmulator]:
    """A fresh moto server (EC2, Auto Scaling, S3) on 127.0.0.1."""
    emulator = AwsEmulator().start()
    try:
        yield emulator
    finally:
        emulator.stop()
