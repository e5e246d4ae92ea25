"""Shared parts for the rehearsal tests: a small spec on disk, and the uninterrupted rehearsal of
specs/rehearsal.toml that the fault and budget rehearsals compare with (the moto server,
``aws``, is in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from made_once import made_once
from small_spec import small_spec_text

from .cli_run import STEPS, context, rehearse


@pytest.fixture
def small_spec(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(small_spec_text())
    return path


@pytest.fixture(scope="session")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the uninterrupted rehearsal of specs/rehearsal.toml, made once per `make
    test` (``made_once``): every test that compares with it, in either of its runs, reads the
    same one."""

    def make(folder: Path) -> None:
        proc, report = rehearse(folder / "rehearsal", "--no-baseline")
        assert proc.returncode == 0 and report["failed_invariants"] == [], context(proc)
        assert report["outcome"] == "finished" and report["final_step"] == STEPS, context(proc)

    return made_once("rehearsal-baseline", make, tmp_path_factory.mktemp("baseline")) / "rehearsal"
