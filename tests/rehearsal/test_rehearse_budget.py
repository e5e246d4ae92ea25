"""``hetero rehearse`` of a job that reaches ``job.max_usd``, then ``hetero job start --resume``:
the real launcher, trainer and data servers on emulated instances, the real ``hetero job start``
against the emulated AWS (the SSM job pointer, the groups, the job record moved to
``job-history/``).

The capped job stops with a durable checkpoint, its record says ``stopped`` with a
``budget: ...`` reason and every group goes to 0; the resumed job (a new job, with its own
clock) picks up from that checkpoint and finishes, with parameters bit-for-bit equal to an
uncapped run's (the rehearsal baseline the fault rehearsals share) and every sample exactly
once. Nothing is left running."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from training.launcher.budget import Budget
from training.spec import load_spec

from .cli_run import REPO, SPEC, STEPS, TIMEOUT_S, context
from .cli_run import rehearse as run_rehearsal

# Every rehearsal records its AWS calls (rehearse() checks them against tests/aws_calls.json).
pytestmark = pytest.mark.aws_calls
ELASTIC_SPEC = REPO / "specs" / "rehearsal-elastic.toml"
# specs/rehearsal.toml prices the cluster at 1.18 USD/h: 0.001 USD is about 3 s from the job's
# start, which the trainers' start-up (torch, the model, the rendezvous) outlasts: each job's
# trainers are given a millisecond and stop after their first step, with a checkpoint, whatever
# the machine's speed; the step that is the job's last still runs, and that job finishes.
MAX_USD = 0.001
# The continued job gets its own budget, as a user continues a stopped job with a larger cap
# (`hetero job start --resume --max-usd`): about 50 minutes. Its clock starts at `hetero job
# start`, before its instances boot; with the spec's 3 s, a loaded machine's launchers found it
# spent before any trainer ran and the job stopped again without a step.
RESUMED_MAX_USD = 1.0


def spec(
    tmp_path: Path, name: str, extra: str = "", steps: int = STEPS, source: Path = SPEC
) -> Path:
    """``source`` (specs/rehearsal.toml) with ``extra`` job keys and ``steps`` steps."""
    text = source.read_text()
    assert "\nseed = 0\n" in text and f"\nsteps = {STEPS} " in text
    text = text.replace(f"\nsteps = {STEPS} ", f"\nsteps = {steps} ", 1)
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace("\nseed = 0\n", f"\nseed = 0\n{extra}", 1))
    return path


def rehearse(spec_path: Path, out: Path, *args: str) -> dict[str, Any]:
    proc, report = run_rehearsal(out, *args, spec=spec_path)
    assert proc.returncode == 0 and report["failed_invariants"] == [], context(proc)
    return report


@pytest.mark.timeout(2 * TIMEOUT_S + 200)
def test_a_job_stopped_by_max_usd_resumes_with_job_start_and_finishes_as_if_uncapped(
    tmp_path: Path, baseline: Path
) -> None:
    uncapped = json.loads((baseline / "rehearsal.json").read_text())
    assert uncapped["outcome"] == "finished" and uncapped["stopped_jobs"] == []

    # The dataprep group is elastic (1 to 2) and starts at its maximum: the cap is reached with
    # the group at MaxSize, and the job's end must leave it where nothing launches again.
    at_max = tmp_path / "elastic-at-max.toml"
    text = ELASTIC_SPEC.read_text()
    assert "\ncount = 1 " in text and "\nmax_count = 2\n" in text
    at_max.write_text(text.replace("\ncount = 1 ", "\ncount = 2 ", 1))
    capped_spec = spec(tmp_path, "capped", f"max_usd = {MAX_USD}\n", source=at_max)
    report = rehearse(
        capped_spec, tmp_path / "capped", "--baseline", str(baseline),
        "--resume-stopped", "1", "--resume-max-usd", str(RESUMED_MAX_USD),
    )  # fmt: skip
    stopped = report["stopped_jobs"]
    assert len(stopped) == 1, stopped  # the first job stops after step 1, the second finishes
    (first,) = stopped
    assert first["outcome"] == "stopped" and first["step"] == 1
    assert first["reason"].startswith(f"budget: max_usd {MAX_USD:g} reached (")
    assert first["reason"].endswith("continue with hetero job start --resume")
    # The resumed job ran the real `hetero job start --resume`, read its new pointer and resumed
    # from the stopped job's checkpoint.
    (start,) = [e for e in report["events"] if e["kind"] == "job-start"]
    assert "(resumes job d-" in start["message"] and "record: moved to s3://" in start["message"]
    assert f"budget: max_usd {RESUMED_MAX_USD:g} (instead of the spec's)" in start["message"]
    assert report["resumed_from_steps"] == [1]
    assert report["outcome"] == "finished"
    assert report["job_record"]["reason"] == "training finished"
    assert report["final_step"] == STEPS
    assert all(e["lost"] == 0 and e["repeated"] == 0 for e in report["samples"])
    assert report["params_equal_uninterrupted"] is True, report["params_comparison"]
    assert report["invariants"]["params_equal"]["ok"]
    assert set(report["groups_desired_at_end"].values()) == {0}
    assert report["instances_running_at_end"] == []
    assert report["processes_left"] == []

    # Issue 27: the elastic group was at its maximum when the cap was reached, and nothing
    # launched after the job's end: the stopped job's end set MaxSize to 0 with the desired
    # capacity, and no instance came until `hetero job start --resume` set the groups back
    # (MaxSize too: max_count); the continued job's end set MaxSize to 0 again.
    events = report["events"]
    (stop,) = [e for e in events if e["kind"] == "outcome" and "stopped" in e["message"]]
    before_stop = [
        e["data"] for e in events if e["kind"] == "group-desired" and e["wall"] < stop["wall"]
    ]
    assert [d["desired"] for d in before_stop if d["asg"] == "rehearsal-dataprep"] == [2]
    launched = [e for e in events if e["kind"] == "instance-launched"]
    assert not [e for e in launched if stop["wall"] <= e["wall"] < start["data"]["started"]]
    assert sorted(e["data"]["group"] for e in launched) == ["dataprep"] * 4 + ["trainer"] * 4
    assert (report["data_tier"]["start_count"], report["data_tier"]["max_count"]) == (2, 2)
    assert report["groups_max_at_end"] == {"rehearsal-trainer": 0, "rehearsal-dataprep": 0}
    assert report["invariants"]["groups_at_zero"]["ok"]

    # The budget's backstop (launcher/backstop.py): the first job's deadline (3 s) was too close
    # to schedule; the continued job's launchers gave each group an action at its deadline (the
    # job's start, to the second, plus RESUMED_MAX_USD at the cluster's price), every group to
    # 0; none ran, and the job's end deleted them (no_scheduled_action_left). The pointer's
    # start is taken when `hetero job start` runs, before its event is logged.
    actions = [e["data"] for e in report["events"] if e["kind"] == "scheduled-action"]
    hours = RESUMED_MAX_USD / load_spec(capped_spec).usd_per_hour()
    assert sorted(a["group"] for a in actions) == ["rehearsal-dataprep", "rehearsal-trainer"]
    for a in actions:
        assert a["name"] == f"hetero-budget-deadline-{a['group']}"
        assert (a["MinSize"], a["MaxSize"], a["DesiredCapacity"]) == (0, 0, 0)
        assert start["wall"] - 30 <= a["start"] - hours * 3600 <= start["wall"] + 1, (a, start)
    assert not [e for e in report["events"] if e["kind"] == "scheduled-action-run"]
    assert report["invariants"]["no_scheduled_action_left"]["ok"]


# The backstop with no launcher left (scenarios/no-launcher-left.toml): every launcher SIGKILLed
# 15 s into the rehearsal, the instances left running. The launchers put the backstop at their
# loop's start (under 4 s in, with the machine busy with other tests), long before their
# trainers' first step; the deadline is this long after the job's start, so nothing but the
# scheduled actions can end the job.
NO_LAUNCHER = Path(__file__).parent / "scenarios" / "no-launcher-left.toml"
BACKSTOP_DEADLINE_S = 30.0


@pytest.mark.timeout(TIMEOUT_S + 200)
def test_with_every_launcher_gone_the_scheduled_actions_take_every_group_to_zero(
    tmp_path: Path,
) -> None:
    usd_per_hour = Budget.of(load_spec(spec(tmp_path, "priced"))).usd_per_hour
    spec_path = spec(
        tmp_path, "nolauncher", f"max_usd = {usd_per_hour * BACKSTOP_DEADLINE_S / 3600.0}\n",
        steps=2,
    )  # fmt: skip
    report = rehearse(
        spec_path, tmp_path / "rehearsal", "--no-baseline", "--scenario", str(NO_LAUNCHER)
    )
    assert report["outcome"] == "none" and report["job_record"] is None
    assert [f["state"] for f in report["faults"]] == ["done"] * 4
    kills = [e for e in report["events"] if e["kind"] == "fault" and "runs on" in e["message"]]
    assert len(kills) == 4
    events = report["events"]
    put = {e["data"]["group"]: e["data"] for e in events if e["kind"] == "scheduled-action"}
    first_kill = min(k["wall"] for k in kills)
    assert all(e["wall"] < first_kill for e in events if e["kind"] == "scheduled-action")
    ran = [e for e in report["events"] if e["kind"] == "scheduled-action-run"]
    assert sorted(put) == sorted(e["data"]["group"] for e in ran) == [
        "rehearsal-dataprep", "rehearsal-trainer",
    ]  # fmt: skip
    for e in ran:  # at the deadline, by Auto Scaling alone: every launcher was gone by then
        assert e["data"]["start"] == put[e["data"]["group"]]["start"]
        assert 0 <= e["wall"] - e["data"]["start"] <= 3, e
        assert e["wall"] > max(k["wall"] for k in kills)
        sizes = (e["data"]["MinSize"], e["data"]["MaxSize"], e["data"]["DesiredCapacity"])
        assert sizes == (0, 0, 0)
    assert set(report["groups_desired_at_end"].values()) == {0}
    assert report["instances_running_at_end"] == []
    assert report["processes_left"] == []
    assert report["scheduled_actions_at_end"] == []
