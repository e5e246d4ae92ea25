"""Shared parts for the rehearsal tests: a small spec on disk (the moto server, ``aws``, is in
tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from small_spec import small_spec_text


@pytest.fixture
def small_spec(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(small_spec_text())
    return path
