"""The mutation check (tests/infra/security_mutants.py) under the suite: every security mutant of
the construct code is killed by an assertion of tests/infra/test_security_invariants.py, and a
harmless edit, in the same run, is not.

About a minute on 2 cores: two worker processes, each starting the CDK's jsii runtime once and
running the invariant module on one copy of the tree after another."""

from __future__ import annotations

from pathlib import Path

import pytest
import security_mutants
from security_mutants import MUTANTS, Mutant


def test_every_mutant_edits_the_code_as_it_is(tmp_path: Path) -> None:
    """Each edit's text is in the code exactly once (fast: a refactor shows here first)."""
    security_mutants.copy_tree(tmp_path)
    for mutant in MUTANTS:
        for edit in mutant.edits:
            assert (tmp_path / edit.path).read_text().count(edit.old) == 1, (mutant.name, edit)


def test_an_edit_that_no_longer_matches_stops_the_check(tmp_path: Path) -> None:
    security_mutants.copy_tree(tmp_path)
    stale = Mutant("stale", security_mutants._edit("infra/network.py", "no such code", "x"))
    with pytest.raises(SystemExit, match=r"occurs 0 times in infra/network\.py"):
        security_mutants.apply(stale, tmp_path)


# The check can fail: an edit that changes no property (a comment) kills no test, and the run
# reports it as survived rather than killed. It runs with the mutants (one jsii start-up each).
HARMLESS = Mutant(
    "comment only",
    security_mutants._edit("infra/network.py", "# EFA requires both", "# EFA needs both"),
)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, security_mutants.Outcome]:
    ran, _ = security_mutants.run([*MUTANTS, HARMLESS], jobs=2)
    assert [o.name for o in ran] == [m.name for m in [*MUTANTS, HARMLESS]]
    return {o.name: o for o in ran}


def test_every_security_mutant_is_killed(
    outcomes: dict[str, security_mutants.Outcome], capsys: pytest.CaptureFixture[str]
) -> None:
    mutants = [outcomes[m.name] for m in MUTANTS]
    with capsys.disabled():
        print("\n" + security_mutants.table(mutants))
    survivors = {o.name: o.killed_by for o in mutants if not o.killed}
    assert survivors == {}
    assert len(mutants) == len(MUTANTS)


def test_a_harmless_edit_survives(outcomes: dict[str, security_mutants.Outcome]) -> None:
    outcome = outcomes[HARMLESS.name]
    assert (outcome.killed, outcome.killed_by) == (False, "survived: every invariant test passed")
