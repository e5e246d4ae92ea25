"""The rehearsal's data-tier facts: the desired capacity the group had against the one the
controller asked for (``consistent``), and the servers' time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.rehearsal.datatier import (
    DesiredWatch,
    before_end,
    data_tier_facts,
    expected_desired,
    last_job,
)
from training.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
ELASTIC = load_spec(REPO / "specs" / "rehearsal-elastic.toml")
FIXED = load_spec(REPO / "specs" / "rehearsal.toml")
ASGS = {"trainer": "rehearsal-trainer", "dataprep": "rehearsal-dataprep"}
START = 1000.0


def decision(step: int, frm: int, to: int, *, acted: bool = True) -> dict[str, Any]:
    return {"time": START + step, "step": step, "from_count": frm, "to_count": to, "acted": acted}


DECISIONS = [decision(3, 1, 2), decision(9, 2, 2, acted=False), decision(18, 2, 1)]


def watched(*values: int) -> DesiredWatch:
    watch = DesiredWatch()
    for t, v in enumerate(values):
        watch.observe(float(t), {"rehearsal-dataprep": v, "rehearsal-trainer": 2})
    return watch


def facts(watch: DesiredWatch, instances: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out = data_tier_facts(
        ELASTIC, ASGS, DECISIONS, watch, instances or [], started_wall=START, ended_t=100.0
    )
    assert out is not None
    return out


def test_the_watch_keeps_each_change_once() -> None:
    watch = DesiredWatch()
    assert watch.observe(0.0, {"a": 1}) == [("a", 1, None)]
    assert watch.observe(0.5, {"a": 1}) == []
    assert watch.observe(1.0, {"a": 2}) == [("a", 2, 1)]
    assert watch.history == {"a": [(0.0, 1), (1.0, 2)]}


def test_what_the_controller_asked_for() -> None:
    # A refusal (not acted) changes nothing.
    assert expected_desired(1, DECISIONS) == [1, 2, 1]
    assert before_end([1, 2, 1, 0]) == [1, 2, 1]


def test_a_continued_job_is_compared_from_its_own_start() -> None:
    # A stopped job's end took the group to 0; `hetero job start --resume` set it back.
    assert last_job([1, 2, 0, 1, 2, 1, 0], 1) == [1, 2, 1, 0]
    assert last_job([2, 0, 2, 0, 2, 1], 2) == [2, 1]
    assert last_job([1, 2, 1, 0], 0) == [1, 2, 1, 0]
    assert last_job([1, 2], 1) == []  # no job end seen: nothing of a later job to compare
    # The report compares the last job's desired capacities with its controller's decisions.
    watch = watched(1, 2, 0, 1, 1, 2, 2, 1, 0)
    tier = data_tier_facts(
        ELASTIC, ASGS, DECISIONS, watch, [], started_wall=START, ended_t=100.0, jobs_resumed=1
    )
    assert tier is not None and tier["consistent"] is True
    assert tier["desired_before_end"] == [1, 2, 1]
    assert facts(watch)["consistent"] is False  # read as one job, the stop looks inconsistent


def test_the_group_that_followed_the_controller_is_consistent() -> None:
    tier = facts(watched(1, 1, 2, 2, 1, 0, 0))
    assert tier["consistent"] is True
    assert tier["changes"] == [[1, 2], [2, 1]]
    assert [d["t"] for d in tier["decisions"]] == [3.0, 9.0, 18.0]
    assert (tier["min_count"], tier["max_count"], tier["start_count"]) == (1, 2, 1)


def test_a_loss_counted_twice_is_not_consistent() -> None:
    # An interruption taken as one more removal: the group goes under what was asked.
    assert facts(watched(1, 2, 0, 1, 0))["consistent"] is False
    assert facts(watched(1, 2, 1, 0, 0))["consistent"] is True
    # Its replacement kept on top of the scale-in: over what was asked.
    assert facts(watched(1, 2, 1, 2, 0))["consistent"] is False
    # A scale-in that never happened.
    assert facts(watched(1, 2, 0))["consistent"] is False


def test_instance_seconds_count_until_termination_or_the_end() -> None:
    rows = [
        {"group": "dataprep", "instance": "i-1", "launched_t": 2.0, "terminated_t": 50.0},
        {"group": "dataprep", "instance": "i-2", "launched_t": 20.0, "terminated_t": None},
        {"group": "trainer", "instance": "i-3", "launched_t": 2.0, "terminated_t": 90.0},
    ]
    tier = facts(watched(1, 2, 1, 0), rows)
    assert tier["instances_launched"] == 2
    assert tier["instance_seconds"] == 48.0 + 80.0


def test_no_entry_without_an_elastic_group() -> None:
    assert (
        data_tier_facts(FIXED, ASGS, [], DesiredWatch(), [], started_wall=START, ended_t=1.0)
        is None
    )


def test_the_elastic_spec_trains_as_the_fixed_one_so_a_baseline_compares() -> None:
    """``training_digest`` leaves out how many data servers serve (the dataprep groups' sizes,
    the controller's settings), and nothing the parameters depend on."""
    from dataclasses import replace

    from training.rehearsal.rehearse import training_digest

    assert training_digest(ELASTIC) == training_digest(FIXED)
    assert training_digest(replace(FIXED, job=replace(FIXED.job, lr=2e-3))) != training_digest(
        FIXED
    )
    trainer, dataprep = FIXED.groups
    fewer_ranks = replace(FIXED, groups=(replace(trainer, count=1), dataprep))
    assert training_digest(fewer_ranks) != training_digest(FIXED)
    other_seed = replace(FIXED, job=replace(FIXED.job, seed=1))
    assert training_digest(other_seed) != training_digest(FIXED)
