"""The verdict: each invariant fails on the fact it guards, and only on it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from training.rehearsal.faults import Expectations, Scenario, parse_instance_fault
from training.rehearsal.report import invariants, steps_lost_bound
from training.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
SPEC = load_spec(REPO / "specs" / "rehearsal.toml")
GOOD: dict[str, Any] = {
    "outcome": "finished",
    "timed_out": False,
    "end_reason": "every group at 0",
    "faults": [{"fault": "interrupt trainer:1@6", "state": "done"}],
    "groups_desired_at_end": {"rehearsal-trainer": 0, "rehearsal-dataprep": 0},
    "groups_max_at_end": {"rehearsal-trainer": 0, "rehearsal-dataprep": 0},
    "instances_running_at_end": [],
    "scheduled_actions_at_end": [],
    "processes_left": [],
    "final_step": SPEC.job.total_steps,
    "samples": [{"epoch": 0, "lost": 0, "repeated": 0, "unplanned": 0}],
    "steps_missing": [],
    "steps_lost": 2,
    "params_equal_uninterrupted": True,
    "params_comparison": {"tensors": 32, "differing": []},
}
SCENARIO = Scenario(faults=(parse_instance_fault("interrupt", "trainer:1@6"),))


def failed(facts: dict[str, Any], scenario: Scenario = SCENARIO) -> list[str]:
    checks = invariants(facts, SPEC, scenario, baseline=Path("/baseline"))
    return [k for k, v in checks.items() if not v["ok"]]


def test_a_good_run_passes_every_invariant() -> None:
    assert failed(GOOD) == []


@pytest.mark.parametrize(
    ("key", "value", "invariant"),
    [
        ("outcome", "unknown", "outcome"),
        ("timed_out", True, "not_timed_out"),
        ("faults", [{"fault": "x", "state": "pending"}], "faults_applied"),
        ("groups_desired_at_end", {"rehearsal-trainer": 1}, "groups_at_zero"),
        ("groups_max_at_end", {"rehearsal-dataprep": 2}, "groups_at_zero"),
        ("instances_running_at_end", ["i-1"], "groups_at_zero"),
        (
            "scheduled_actions_at_end",
            [
                {
                    "group": "rehearsal-trainer",
                    "name": "hetero-budget-deadline-rehearsal-trainer",
                    "start": 1.0,
                }
            ],
            "no_scheduled_action_left",
        ),
        ("processes_left", [{"pid": 1, "cmdline": "python"}], "no_processes_left"),
        ("final_step", 20, "final_step"),
        (
            "samples",
            [{"epoch": 0, "lost": 1, "repeated": 0, "unplanned": 0}],
            "samples_exactly_once",
        ),
        ("samples", [], "samples_exactly_once"),
        ("steps_missing", [3], "samples_exactly_once"),
        ("steps_lost", 5, "steps_lost_bounded"),
        ("params_equal_uninterrupted", False, "params_equal"),
    ],
)
def test_each_invariant_guards_its_fact(key: str, value: Any, invariant: str) -> None:
    facts = copy.deepcopy(GOOD)
    facts[key] = value
    assert failed(facts) == [invariant]


def test_an_expected_failure_passes_without_the_finished_checks() -> None:
    crash = Scenario(
        faults=(parse_instance_fault("crash", "trainer:0@3"),),
        expect=Expectations(outcome="failed"),
    )
    facts = {**copy.deepcopy(GOOD), "outcome": "failed", "final_step": 3, "samples": []}
    assert failed(facts, crash) == []
    assert failed({**facts, "outcome": "finished"}, crash) == ["outcome"]


def test_steps_lost_bound() -> None:
    interval = SPEC.job.checkpoint.interval_steps
    assert steps_lost_bound(SPEC, Scenario()) == 0
    assert steps_lost_bound(SPEC, SCENARIO) == interval
    two = Scenario(
        faults=(
            parse_instance_fault("kill", "trainer:0@3"),
            parse_instance_fault("kill", "dataprep:0@3"),  # no trainer rollback
            parse_instance_fault("rebalance", "trainer:1@9"),
        )
    )
    assert steps_lost_bound(SPEC, two) == 2 * interval
    cut = Scenario(faults=(parse_instance_fault("kill-in-save", "trainer:1@6"),))
    assert steps_lost_bound(SPEC, cut) == interval  # back to the checkpoint before the cut one
    assert steps_lost_bound(SPEC, Scenario(expect=Expectations(steps_lost_max=9))) == 9


def test_the_data_tier_invariant_guards_a_group_the_controller_did_not_size() -> None:
    tier = {
        "group": "dataprep",
        "asg": "rehearsal-dataprep",
        "desired_before_end": [1, 2, 0, 1],
        "expected_desired": [1, 2, 1],
        "consistent": False,
    }
    assert failed({**copy.deepcopy(GOOD), "data_tier": tier}) == ["data_tier_consistent"]
    assert failed({**copy.deepcopy(GOOD), "data_tier": {**tier, "consistent": True}}) == []
    assert failed({**copy.deepcopy(GOOD), "data_tier": None}) == []
    # Capacity Rebalancing moves that group's desired capacity by itself: not checked then.
    rebalance = Scenario(faults=(parse_instance_fault("rebalance", "dataprep:0@6"),))
    no_rollback = {**copy.deepcopy(GOOD), "steps_lost": 0}
    assert failed({**no_rollback, "data_tier": tier}, rebalance) == []
