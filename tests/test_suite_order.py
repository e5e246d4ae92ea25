"""`make test`'s order (tests/conftest.py's ``SLOW_FIRST``) names tests by their file and name:
a renamed test or file would silently fall to the back of the run, and the run would end with a
long test alone on one core. Each entry must name a test that exists."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import SLOW_FIRST, slow_rank

REPO = Path(__file__).resolve().parents[1]


def names_of_tests(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
    ]


@pytest.mark.parametrize("entry", SLOW_FIRST)
def test_every_entry_names_a_test_that_exists(entry: str) -> None:
    file, _, name = entry.partition("::")
    assert (REPO / file).is_file(), f"{file} is not a test file: update SLOW_FIRST"
    names = names_of_tests(REPO / file)
    assert names and any(n.startswith(name) for n in names), (entry, names)


def test_the_baseline_maker_comes_first_and_the_others_wait_behind_tests_that_need_none() -> None:
    """The first test of the silent-host rehearsals makes the baseline; the other worker's first
    tests (the third and fourth handed out) need none."""
    first = "tests/rehearsal/test_rehearse_silent.py::test_launchers_gone_for_good_are_taken_out"
    assert slow_rank(first) == 0
    assert slow_rank("tests/trainer/test_learns_real_images.py::test_x") == 2
    assert slow_rank("tests/rehearsal/test_rehearse_e2e.py::test_x") > slow_rank(
        "tests/infra/test_security_mutants.py::test_x"
    )
    assert slow_rank("tests/data/test_batch.py::test_x") == len(SLOW_FIRST)
