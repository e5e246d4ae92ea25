"""Shared parts for the rehearsal tests: a small spec on disk (the moto server, ``aws``, is in
tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
