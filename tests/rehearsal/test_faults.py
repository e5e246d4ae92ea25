"""Fault flags and scenario files: good input parses, bad input names the accepted form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.rehearsal.faults import (
    INSTANCE_FORM,
    LAUNCH_FORM,
    OUTAGE_FORM,
    Fault,
    FaultKind,
    FaultSyntaxError,
    Trigger,
    check_against_spec,
    load_scenario,
    parse_instance_fault,
    parse_outage,
)
from training.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("kind", "text", "expected"),
    [
        ("interrupt", "trainer:0@10", Fault(FaultKind.INTERRUPT, Trigger(step=10), "trainer", 0)),
        ("kill", "dataprep:1@30s", Fault(FaultKind.KILL, Trigger(seconds=30.0), "dataprep", 1)),
        (
            "rebalance",
            " trainer:2@2.5s ",
            Fault(FaultKind.REBALANCE, Trigger(seconds=2.5), "trainer", 2),
        ),
        ("crash", "trainer:1@0", Fault(FaultKind.CRASH, Trigger(step=0), "trainer", 1)),
        (
            "kill-in-save",
            "trainer:1@6",
            Fault(FaultKind.KILL_IN_SAVE, Trigger(step=6), "trainer", 1),
        ),
        (
            "kill_in_save",
            "trainer:2@40s",
            Fault(FaultKind.KILL_IN_SAVE, Trigger(seconds=40.0), "trainer", 2),
        ),
        (
            "kill-data-server",
            "dataprep:0@5",
            Fault(FaultKind.KILL_DATA_SERVER, Trigger(step=5), "dataprep", 0),
        ),
        (
            "capacity-gone",
            "trainer:3@0s",
            Fault(FaultKind.CAPACITY_GONE, Trigger(seconds=0.0), "trainer", 3),
        ),
        (
            "kill-launcher",
            "dataprep:1@20s",
            Fault(FaultKind.KILL_LAUNCHER, Trigger(seconds=20.0), "dataprep", 1),
        ),
    ],
)
def test_instance_faults_parse(kind: str, text: str, expected: Fault) -> None:
    assert parse_instance_fault(kind, text) == expected


@pytest.mark.parametrize(
    "text", ["trainer@10", "trainer:0", "trainer:x@10", "Trainer:0@10", "trainer:0@1.5", "0@10", ""]
)
def test_bad_instance_faults_name_the_form(text: str) -> None:
    with pytest.raises(FaultSyntaxError) as e:
        parse_instance_fault("interrupt", text)
    assert "--interrupt" in str(e.value)
    assert INSTANCE_FORM in str(e.value) or "whole number" in str(e.value)


@pytest.mark.parametrize("text", ["trainer:1", "trainer@6", "trainer:1@6.5", "trainer:-1@6", "8"])
def test_bad_kill_in_save_names_its_flag_and_the_form(text: str) -> None:
    with pytest.raises(FaultSyntaxError) as e:
        parse_instance_fault("kill-in-save", text)
    assert f"--kill-in-save {text!r}" in str(e.value)
    assert INSTANCE_FORM in str(e.value)


def test_outages_parse_and_bad_ones_name_the_form() -> None:
    assert parse_outage("20:8") == Fault(FaultKind.S3_OUTAGE, Trigger(step=20), duration_s=8.0)
    assert parse_outage("45s:2.5").trigger == Trigger(seconds=45.0)
    for bad in ("20", "20:", ":8", "a:8", "20:-1"):
        with pytest.raises(FaultSyntaxError, match="--s3-outage") as e:
            parse_outage(bad)
        assert OUTAGE_FORM in str(e.value)
    with pytest.raises(FaultSyntaxError, match="more than 0"):
        parse_outage("20:0")


def test_unknown_kind_lists_the_kinds() -> None:
    with pytest.raises(FaultSyntaxError, match="interrupt, rebalance, kill, crash"):
        parse_instance_fault("explode", "trainer:0@1")  # type: ignore[arg-type]


def test_describe_round_trips() -> None:
    for kind, text in [("interrupt", "trainer:0@10"), ("kill", "dataprep:1@30s")]:
        assert parse_instance_fault(kind, text).describe() == f"{kind} {text}"
    assert parse_outage("20:8").describe() == "s3-outage 20:8"


def test_scenario_files_toml_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "spot.toml"
    toml.write_text(
        'name = "spot"\ninterrupt = ["trainer:1@10"]\nkill_data_server = "dataprep:0@12"\n'
        's3-outage = ["20:5"]\nnotice-seconds = 5\n[expect]\noutcome = "finished"\n'
        "steps-lost-max = 4\n"
    )
    s = load_scenario(toml)
    assert s.name == "spot" and s.notice_seconds == 5.0
    assert [f.describe() for f in s.faults] == [
        "interrupt trainer:1@10",
        "kill-data-server dataprep:0@12",
        "s3-outage 20:5",
    ]
    assert s.expect.expects_params_equal and s.expect.steps_lost_max == 4

    kis = tmp_path / "cut.toml"
    kis.write_text('kill-in-save = "trainer:1@6"\n')
    s = load_scenario(kis)
    assert [f.describe() for f in s.faults] == ["kill-in-save trainer:1@6"]
    assert s.faults[0].kind is FaultKind.KILL_IN_SAVE

    js = tmp_path / "crash.json"
    js.write_text(json.dumps({"crash": ["trainer:0@3"], "expect": {"outcome": "failed"}}))
    s = load_scenario(js)
    assert s.name == "crash" and s.faults[0].kind is FaultKind.CRASH
    assert s.expect.outcome == "failed" and not s.expect.expects_params_equal

    budget = tmp_path / "budget.toml"
    budget.write_text('[expect]\noutcome = "stopped"\n')
    s = load_scenario(budget)
    assert s.expect.outcome == "stopped" and not s.expect.expects_params_equal

    gone = tmp_path / "gone.toml"
    gone.write_text('kill-launcher = ["trainer:0@20s"]\n[expect]\noutcome = "none"\n')
    s = load_scenario(gone)
    assert [f.describe() for f in s.faults] == ["kill-launcher trainer:0@20s"]
    assert s.expect.outcome == "none" and not s.expect.expects_params_equal


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('interrupt = ["trainer:0"]', "GROUP:INDEX@STEP"),
        ("interrupt = 3", "must be a string or a list"),
        ('explode = ["trainer:0@1"]', "unknown fault kind"),
        ('[expect]\noutcome = "maybe"', "'finished', 'failed', 'stopped' .* or 'none'"),
        ("[expect]\nspeed = 1", "unknown expect key"),
        ("notice-seconds = -1", "notice-seconds"),
        ("[expect]\nsteps-lost-max = -1", "steps-lost-max"),
        ("interrupt = [", "not valid TOML"),
    ],
)
def test_bad_scenarios_say_what_is_wrong(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(body + "\n")
    with pytest.raises(FaultSyntaxError, match=message):
        load_scenario(path)


def test_faults_are_checked_against_the_spec() -> None:
    spec = load_spec(REPO / "specs" / "rehearsal.toml")
    ok = [parse_instance_fault("interrupt", "trainer:0@1"), parse_outage("3:1")]
    assert check_against_spec(ok, spec) == []
    bad = [
        parse_instance_fault("interrupt", "gpu:0@1"),
        parse_instance_fault("crash", "dataprep:0@1"),
        parse_instance_fault("kill-data-server", "trainer:0@1"),
        parse_instance_fault("kill-in-save", "dataprep:0@6"),
    ]
    problems = check_against_spec(bad, spec)
    assert len(problems) == 4
    assert "no group 'gpu'" in problems[0]
    assert "crash needs a trainer group" in problems[1]
    assert "kill-data-server needs a dataprep group" in problems[2]
    assert "kill-in-save needs a trainer group, 'dataprep' is not" in problems[3]
    assert check_against_spec([parse_instance_fault("kill-in-save", "trainer:1@6")], spec) == []


def test_the_cli_refuses_bad_faults_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from training.cli import main

    spec = str(REPO / "specs" / "rehearsal.toml")
    out = str(tmp_path / "out")
    assert main(["rehearse", "--spec", spec, "--out", out, "--interrupt", "trainer@3"]) == 2
    assert INSTANCE_FORM in capsys.readouterr().err
    assert main(["rehearse", "--spec", spec, "--out", out, "--s3-outage", "3"]) == 2
    assert OUTAGE_FORM in capsys.readouterr().err
    assert main(["rehearse", "--spec", spec, "--out", out, "--crash", "dataprep:0@3"]) == 2
    assert "crash needs a trainer group" in capsys.readouterr().err
    assert main(["rehearse", "--spec", spec, "--out", out, "--kill-in-save", "trainer:1"]) == 2
    assert f"--kill-in-save 'trainer:1': expected {INSTANCE_FORM}" in capsys.readouterr().err
    assert main(["rehearse", "--spec", spec, "--out", out, "--kill-in-save", "dataprep:0@6"]) == 2
    assert "kill-in-save needs a trainer group" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("kind", "text", "expected"),
    [
        ("boot-fail", "trainer:1", Fault(FaultKind.BOOT_FAIL, Trigger(step=0), "trainer", 1)),
        ("early_exit", "dataprep:*", Fault(FaultKind.EARLY_EXIT, Trigger(step=0), "dataprep")),
    ],
)
def test_launch_faults_parse_an_instance_or_every_instance(
    kind: str, text: str, expected: Fault
) -> None:
    fault = parse_instance_fault(kind, text)
    assert fault == expected and fault.at_launch
    assert fault.describe() == f"{expected.kind.value} {text}"
    assert fault.matches(text.split(":")[0], 1)
    assert fault.matches("dataprep", 7) is (expected.index is None)
    assert not fault.matches("other", 1)


@pytest.mark.parametrize("text", ["trainer:1@5", "trainer", "trainer:**", "trainer:-1", ""])
def test_bad_launch_faults_name_the_form(text: str) -> None:
    with pytest.raises(FaultSyntaxError) as e:
        parse_instance_fault("boot-fail", text)
    assert str(e.value) == f"--boot-fail {text!r}: expected {LAUNCH_FORM}"


def test_a_scenario_file_lists_launch_faults(tmp_path: Path) -> None:
    path = tmp_path / "boots.toml"
    path.write_text('boot-fail = ["trainer:1"]\nearly-exit = "dataprep:*"\n[expect]\n')
    scenario = load_scenario(path)
    assert [f.describe() for f in scenario.faults] == [
        "boot-fail trainer:1",
        "early-exit dataprep:*",
    ]
    spec = load_spec(REPO / "specs" / "rehearsal.toml")
    assert check_against_spec(scenario.faults, spec) == []
    problems = check_against_spec([parse_instance_fault("early-exit", "gpu:*")], spec)
    assert problems == ["early-exit gpu:*: the spec has no group 'gpu' (it has trainer, dataprep)"]
