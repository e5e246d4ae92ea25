"""The rehearsal's check of the job's bill (``training.rehearsal.bill_check``): the billed
instance-seconds per group against the group simulator's count, within 1 %, and the report's
``bill_agrees`` invariant; and the emulator lists a Spot group's instances as EC2 does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from training.rehearsal.aws import AwsEmulator
from training.rehearsal.bill_check import TOLERANCE, bill_facts, detail
from training.rehearsal.faults import Scenario
from training.rehearsal.report import invariants
from training.spec import load_spec

REPO = Path(__file__).resolve().parents[2]

# The simulator's rows (seconds since the rehearsal's start, at wall time WALL; moto's exact
# creation and termination times where known) and the bill (epoch seconds).
WALL = 1_800_000_000.0
ROWS = [
    {"instance": "i-t0", "group": "trainer", "launched_t": 1.2, "terminated_t": 101.3,
     "ec2_launched_t": 1.0, "ec2_terminated_t": 101.0},
    {"instance": "i-t1", "group": "trainer", "launched_t": 1.2, "terminated_t": 51.4,
     "ec2_launched_t": 1.0, "ec2_terminated_t": 51.0},
    {"instance": "i-t2", "group": "trainer", "launched_t": 55.0, "terminated_t": None},
    {"instance": "i-d0", "group": "dataprep", "launched_t": 1.0, "terminated_t": 101.0},
]  # fmt: skip
"""The simulator: trainer 100 + 50 + (110 - 55) = 205 s, dataprep 100 s."""


def bill(starts: dict[str, float], seconds: dict[str, float]) -> dict[str, Any]:
    groups = {"i-t0": "trainer", "i-t1": "trainer", "i-t2": "trainer", "i-d0": "dataprep"}
    return {
        "since": None,
        "uncertain_s": 3.0,
        "lines": [
            {"group": "trainer", "market": "spot", "usd_per_hour": 0.36},
            {"group": "dataprep", "market": "spot", "usd_per_hour": 0.18},
        ],
        "instances": {
            i: {"group": groups[i], "start": WALL + starts[i], "end": WALL + starts[i] + s}
            for i, s in seconds.items()
        },
    }


STARTS = {"i-t0": 1.0, "i-t1": 1.0, "i-t2": 55.0, "i-d0": 1.0}


def test_a_group_that_ran_long_enough_agrees_in_full_within_one_percent() -> None:
    seconds = {"i-t0": 100.5, "i-t1": 50.0, "i-t2": 55.0, "i-d0": 99.2}
    facts = bill_facts(bill(STARTS, seconds), ROWS, ended_t=110.0, started_wall=WALL)
    assert facts["ok"] and facts["checked"]
    trainer, dataprep = facts["groups"]["trainer"], facts["groups"]["dataprep"]
    assert (trainer["simulator_s"], trainer["bill_s"]) == (205.0, 205.5)
    assert trainer["checked_in_full"]  # 3 launches: 1.5 s, under 1 % of 205 s
    assert trainer["difference_share"] == pytest.approx(0.5 / 205, abs=1e-5)
    assert trainer["simulator_usd"] == pytest.approx(205 * 0.36 / 3600, abs=1e-6)
    assert dataprep["difference_share"] == pytest.approx(-0.008)
    assert facts["largest_instance_differences_s"][0] == ["i-d0", -0.8]
    assert detail(facts) == (
        "dataprep 99.2 instance-s billed, 100.0 counted (-0.80 %); trainer 205.5 instance-s "
        "billed, 205.0 counted (+0.24 %); tolerance 1 %, the bill's own bound ± 3.0 instance-s"
    )


def test_a_group_off_by_more_fails_and_a_missing_instance_shows() -> None:
    seconds = {"i-t0": 100.0, "i-t1": 50.0, "i-d0": 100.0}
    facts = bill_facts(bill(STARTS, seconds), ROWS, ended_t=110.0, started_wall=WALL)
    assert not facts["ok"] and not facts["groups"]["trainer"]["ok"]
    assert facts["groups"]["trainer"]["difference_share"] < -TOLERANCE
    assert facts["missing_from_bill"] == ["i-t2"]
    spec = load_spec(REPO / "specs" / "rehearsal.toml")
    checks = invariants({"bill": facts}, spec, Scenario(), baseline=None)
    assert not checks["bill_agrees"]["ok"]
    assert "trainer 150.0 instance-s billed, 205.0 counted" in checks["bill_agrees"]["detail"]


def test_short_instances_agree_apart_from_the_launch_second() -> None:
    """Two 40-s instances launched 0.02 s into a second: the bill starts them at its middle,
    0.48 s late each, 2.4 % of the group; half a second per launch is over 1 % of 80 s, so the
    group is checked apart from that rounding, which moto's creation times measure."""
    rows = [
        {"instance": f"i-{n}", "group": "trainer", "launched_t": 0.3, "terminated_t": 40.5,
         "ec2_launched_t": 0.02, "ec2_terminated_t": 40.02}
        for n in (0, 1)
    ]  # fmt: skip
    short = {
        "since": None,
        "uncertain_s": 1.0,
        "lines": [{"group": "trainer", "market": "spot", "usd_per_hour": 0.36}],
        "instances": {
            f"i-{n}": {"group": "trainer", "start": WALL + 0.5, "end": WALL + 40.01} for n in (0, 1)
        },
    }
    facts = bill_facts(short, rows, ended_t=41.0, started_wall=WALL)
    trainer = facts["groups"]["trainer"]
    assert not trainer["checked_in_full"] and trainer["launch_resolution_s"] == 1.0
    assert trainer["difference_share"] == pytest.approx(-0.98 / 80)
    assert trainer["launch_rounding_s"] == pytest.approx(0.96)
    assert trainer["difference_apart_from_rounding_share"] == pytest.approx(-0.02 / 80)
    assert facts["ok"]
    assert "(-1.23 %, -0.03 % apart from LaunchTime's second (+0.96 s; its ± 1 s" in detail(facts)
    # Off by more than the rounding explains: it fails all the same.
    short["instances"]["i-1"]["end"] = WALL + 38.0
    assert not bill_facts(short, rows, ended_t=41.0, started_wall=WALL)["ok"]


def test_boots_the_bill_could_only_bracket_are_held_to_its_own_bound() -> None:
    """Two boots that gave up after 1.5 s, first seen shut down 3.5 s after their launch: the
    bill puts each one's end in the middle of that bracket, ± 1.5 s; the simulator's count stops
    at the bill's end (the job's), the instances' 0.5 s after it is reported apart."""
    rows = [
        {"instance": f"i-{n}", "group": "trainer", "launched_t": 1.2, "terminated_t": 3.0,
         "ec2_launched_t": 1.0, "ec2_terminated_t": 2.5}
        for n in (0, 1)
    ] + [
        {"instance": "i-d", "group": "dataprep", "launched_t": 1.2, "terminated_t": 30.9,
         "ec2_launched_t": 1.0, "ec2_terminated_t": 30.5}
    ]  # fmt: skip
    boots = {
        "since": None,
        "until": WALL + 30.0,
        "uncertain_s": 4.0,
        "lines": [{"group": "trainer", "market": "spot", "usd_per_hour": 0.36}],
        "instances": {
            **{
                f"i-{n}": {"group": "trainer", "start": WALL + 1.5, "end": WALL + 3.0,
                           "uncertain_s": 2.0}
                for n in (0, 1)
            },
            "i-d": {"group": "dataprep", "start": WALL + 1.5, "end": WALL + 30.0,
                    "uncertain_s": 0.5},
        },
    }  # fmt: skip
    facts = bill_facts(boots, rows, ended_t=40.0, started_wall=WALL)
    trainer, dataprep = facts["groups"]["trainer"], facts["groups"]["dataprep"]
    assert (trainer["bill_s"], trainer["simulator_s"]) == (3.0, 3.0)  # the middles: exact here
    assert dataprep["simulator_s"] == 29.0 and dataprep["after_end_s"] == 0.5
    assert dataprep["difference_apart_from_rounding_share"] == pytest.approx(0.0)
    assert facts["ok"]
    boots["instances"]["i-0"]["end"] = WALL + 4.4  # 1.4 s late: 47 % over, within its ± 1.5 s
    late = bill_facts(boots, rows, ended_t=40.0, started_wall=WALL)
    assert late["ok"] and late["groups"]["trainer"]["over_tolerance_within_bound"]
    assert "over 1 %, within the bill's own bound on its ends, ± 3.00 s" in detail(late)
    boots["instances"]["i-1"]["end"] = WALL + 4.4
    boots["instances"]["i-0"]["end"] = WALL + 6.0  # off by more than the bill says it can be
    assert not bill_facts(boots, rows, ended_t=40.0, started_wall=WALL)["ok"]


def test_without_a_bill_or_after_a_resume_nothing_is_checked() -> None:
    spec = load_spec(REPO / "specs" / "rehearsal.toml")
    for facts in (
        bill_facts(None, ROWS, ended_t=110.0, started_wall=WALL),
        bill_facts(
            bill(STARTS, {"i-t0": 100.0}), ROWS, ended_t=110.0, started_wall=WALL, resumed=True
        ),
    ):
        assert not facts["checked"]
        assert "bill_agrees" not in invariants({"bill": facts}, spec, Scenario(), baseline=None)
    assert detail(bill_facts(None, ROWS, ended_t=1.0, started_wall=WALL)) == (
        "not checked: the job's outcome records no bill"
    )


def test_a_spot_groups_instances_are_listed_as_spot(aws: AwsEmulator, tmp_path: Path) -> None:
    path = tmp_path / "spec.toml"
    spot = 'instance_types = ["c6i.4xlarge"]\ncount = 2\nmarket = "spot"'
    text = (REPO / "specs" / "rehearsal.toml").read_text()
    assert spot in text
    path.write_text(text.replace(spot, spot.replace('"spot"', '"on-demand"')))
    aws.provision(load_spec(path))
    aws.instances("rehearsal")  # the simulator's look marks them
    pages = aws.client("ec2").get_paginator("describe_instances").paginate()
    listed = [i for p in pages for r in p["Reservations"] for i in r["Instances"]]
    markets = sorted(
        (next(t["Value"] for t in i["Tags"] if t["Key"] == "hetero:group"),
         i.get("InstanceLifecycle", "on-demand"))
        for i in listed
    )  # fmt: skip
    assert markets == [
        ("dataprep", "on-demand"), ("dataprep", "on-demand"), ("trainer", "spot"),
        ("trainer", "spot"),
    ]  # fmt: skip
