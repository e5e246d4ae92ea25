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
import math
from pathlib import Path
from typing import Any

import pytest

from training.costs.budget import Budget
from training.rehearsal.instances import BACKSTOP_AFTER_S as DEFAULT_BACKSTOP_AFTER_S
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
# The continued jobs get budgets of their own, as a user continues a stopped job with a larger
# cap (`hetero job start --resume --max-usd`). The second and third jobs lose trainers at their
# launch with no capacity to replace them (capacity-gone) and run out WAIT_S after their start;
# the fourth gets about 50 minutes and finishes. (Its clock starts at `hetero job start`, before
# its instances boot; with the spec's 3 s a loaded machine's launchers found it spent before
# any trainer ran and the job stopped again without a step.)
WAIT_S = 20.0
RESUMED_MAX_USD = 1.0
# Each continued job's trainers, in launch order: the second job's are trainer:2 and 3, the
# third's 4 and 5. The second loses one (its survivor waits for a peer that cannot come), the
# third both (only the data servers run).
LOST = ["trainer:3@0s", "trainer:4@0s", "trainer:5@0s"]
# A launcher ends a spent job within a heartbeat (2 s in a rehearsal) of the deadline; one more
# beat for the record's write on a loaded machine.
WITHIN_S = 2 * 2.0 + 2.0


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


@pytest.mark.timeout(2 * TIMEOUT_S + 300)
def test_a_job_stopped_by_max_usd_resumes_with_job_start_and_finishes_as_if_uncapped(
    tmp_path: Path, baseline: Path
) -> None:
    """Three stops, each by the budget, then a finish: the trainers' own stop after a step (1);
    a survivor trainer waiting for a lost peer (2); only data servers left (3). Each is ended
    ``stopped`` by a launcher within a heartbeat of its deadline, before the backstop's time,
    with every group at 0 and nothing launched until the next `hetero job start --resume`."""
    uncapped = json.loads((baseline / "rehearsal.json").read_text())
    assert uncapped["outcome"] == "finished" and uncapped["stopped_jobs"] == []

    # The dataprep group is elastic (1 to 2) and starts at its maximum: the cap is reached with
    # the group at MaxSize, and the job's end must leave it where nothing launches again.
    at_max = tmp_path / "elastic-at-max.toml"
    text = ELASTIC_SPEC.read_text()
    assert "\ncount = 1 " in text and "\nmax_count = 2\n" in text
    at_max.write_text(text.replace("\ncount = 1 ", "\ncount = 2 ", 1))
    capped_spec = spec(tmp_path, "capped", f"max_usd = {MAX_USD}\n", source=at_max)
    usd_per_hour = load_spec(capped_spec).usd_per_hour()
    wait_usd = usd_per_hour * WAIT_S / 3600.0
    report = rehearse(
        capped_spec, tmp_path / "capped", "--baseline", str(baseline),
        "--resume-stopped", "3", "--resume-max-usd", f"{wait_usd},{wait_usd},{RESUMED_MAX_USD}",
        *(arg for lost in LOST for arg in ("--capacity-gone", lost)),
    )  # fmt: skip
    events = report["events"]
    runs = {e["instance"]: e["data"] for e in events if e["kind"] == "instance-launched"}
    stops = report["stopped_jobs"]
    assert len(stops) == 3, stops
    for stop in stops:
        assert stop["outcome"] == "stopped", stop
        assert stop["reason"].startswith("budget: max_usd "), stop
        assert stop["reason"].endswith("continue with hetero job start --resume")
    first, waiting, servers_only = stops
    # 1: the trainers' own check after a step; the step's checkpoint is what the rest resume.
    assert first["step"] == 1 and first["reason"].startswith(f"budget: max_usd {MAX_USD:g} ")
    assert runs[first["by"]]["group"] == "trainer"
    # 2 and 3: the launchers, each within a heartbeat of its job's deadline.
    job_starts = [e for e in events if e["kind"] == "job-start"]
    assert len(job_starts) == 3
    for stop, start in zip([waiting, servers_only], job_starts, strict=False):
        # The pointer's start is taken after this, and kept to the whole second
        # (``%Y-%m-%dT%H:%M:%SZ``): no earlier than this time's second.
        earliest = math.floor(start["data"]["started"]) + WAIT_S
        assert earliest <= stop["time"] <= start["wall"] + WAIT_S + WITHIN_S, (stop, start)
        assert stop["step"] == 1  # nothing trained: no trainer had its peers
    # 2: the survivor (trainer:2) was still there, waiting, when the job ended: its launcher
    # checks the budget in the peer wait, and the data servers' (tier_budget) see no live
    # trainer once it has not written for two heartbeats; whichever looks first ends the job.
    survivor = next(i for i, r in runs.items() if (r["group"], r["index"]) == ("trainer", 2))
    (gone,) = [
        e for e in events if e["kind"] == "instance-terminated" and e["instance"] == survivor
    ]
    assert gone["wall"] > waiting["time"], (gone, waiting)
    assert waiting["by"] == survivor or runs[waiting["by"]]["group"] == "dataprep", waiting
    # 3: no trainer at all: a data server's launcher.
    assert runs[servers_only["by"]]["group"] == "dataprep"
    faults = {f["fault"]: f for f in report["faults"]}
    lost_ids = [faults[f"capacity-gone {lost}"]["instance"] for lost in LOST]
    assert [(runs[i]["group"], runs[i]["index"]) for i in lost_ids] == [
        ("trainer", 3), ("trainer", 4), ("trainer", 5),
    ]  # fmt: skip
    # No trainer launched while its group had no capacity: each job's lost ones were not
    # replaced (Auto Scaling's launches refused), and capacity came back with each job's end.
    back = [e["data"] for e in events if e["kind"] == "capacity-back"]
    assert [(b["asg"], b["refused"] >= 1) for b in back] == [("rehearsal-trainer", True)] * 2

    # The continued job ran the real `hetero job start --resume` each time, read its new pointer
    # and resumed from the first job's checkpoint.
    for start, resumed in zip(job_starts, ["d-", "j-", "j-"], strict=True):
        assert f"(resumes job {resumed}" in start["message"], start  # a deploy's, then its own
        assert "record: moved to s3://" in start["message"]
    assert (
        f"budget: max_usd {RESUMED_MAX_USD:g} (instead of the spec's)" in job_starts[2]["message"]
    )
    assert report["resumed_from_steps"][-1] == 1
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
    # launched after a job's end: each stopped job's end set MaxSize to 0 with the desired
    # capacity, and no instance came until `hetero job start --resume` set the groups back
    # (MaxSize too: max_count); the last job's end set MaxSize to 0 again.
    outcomes = [e for e in events if e["kind"] == "outcome" and "stopped" in e["message"]]
    assert len(outcomes) == 3
    before_stop = [
        e["data"]
        for e in events
        if e["kind"] == "group-desired" and e["wall"] < outcomes[0]["wall"]
    ]
    assert [d["desired"] for d in before_stop if d["asg"] == "rehearsal-dataprep"] == [2]
    launched = [e for e in events if e["kind"] == "instance-launched"]
    for stopped, start in zip(outcomes, job_starts, strict=True):
        assert not [e for e in launched if stopped["wall"] <= e["wall"] < start["data"]["started"]]
    assert sorted(e["data"]["group"] for e in launched) == ["dataprep"] * 8 + ["trainer"] * 8
    assert (report["data_tier"]["start_count"], report["data_tier"]["max_count"]) == (2, 2)
    assert report["groups_max_at_end"] == {"rehearsal-trainer": 0, "rehearsal-dataprep": 0}
    assert report["invariants"]["groups_at_zero"]["ok"]

    # The budget's backstop (costs/backstop.py): each job's launchers gave each group an
    # action DEFAULT_BACKSTOP_AFTER_S past its deadline (the job's start plus its cap at the
    # cluster's price; the first job's start is its first host's), every group to 0. None ran:
    # the launchers ended the jobs first, and each job's end deleted them
    # (no_scheduled_action_left).
    actions = [e["data"] for e in events if e["kind"] == "scheduled-action"]
    caps_s = [WAIT_S, WAIT_S, RESUMED_MAX_USD / usd_per_hour * 3600.0]
    # Hosts that start a job together may each write its start (seconds apart: the last write
    # stays, JobRecord.started) and put the action for theirs: a group's action may be put
    # again for the same job, a few seconds later.
    assert len(actions) >= 2 * (1 + len(job_starts)), actions
    for start, cap_s in zip(job_starts, caps_s, strict=True):
        # The pointer's start is taken while the command runs (to the second).
        late = start["wall"] - start["data"]["started"] + 1
        deadline = start["data"]["started"] + cap_s
        after = [a["start"] - DEFAULT_BACKSTOP_AFTER_S - deadline for a in actions]
        mine = [a for a, d in zip(actions, after, strict=True) if -1 <= d <= late]
        groups = sorted({a["group"] for a in mine})
        assert groups == ["rehearsal-dataprep", "rehearsal-trainer"], (start, actions)
        for a in mine:
            assert a["name"] == f"hetero-budget-deadline-{a['group']}"
            assert (a["MinSize"], a["MaxSize"], a["DesiredCapacity"]) == (0, 0, 0)
    assert not [e for e in events if e["kind"] == "scheduled-action-run"]
    assert report["invariants"]["no_scheduled_action_left"]["ok"]


# The backstop with no launcher left (scenarios/no-launcher-left.toml): every launcher SIGKILLed
# 25 s into the rehearsal, the instances left running. The launchers put the backstop at their
# loop's start (under 4 s in, with the machine busy with other tests), long before their
# trainers' first step; the deadline is this long after the job's start, after the kills, so
# nothing but the scheduled actions can end the job (BACKSTOP_AFTER_S after the deadline).
NO_LAUNCHER = Path(__file__).parent / "scenarios" / "no-launcher-left.toml"
BACKSTOP_DEADLINE_S = 30.0
BACKSTOP_AFTER_S = 10.0  # no trainer is left to save


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
        spec_path, tmp_path / "rehearsal", "--no-baseline", "--scenario", str(NO_LAUNCHER),
        "--backstop-after", str(BACKSTOP_AFTER_S),
    )  # fmt: skip
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
    # The actions start BACKSTOP_AFTER_S after the deadline, which is BACKSTOP_DEADLINE_S after
    # the job's start (its first host's, before the kills 25 s in): after the kills.
    for a in put.values():  # the job's start: its first host's, after the rehearsal's start
        assert 0 < a["start"] - BACKSTOP_AFTER_S - first_kill <= BACKSTOP_DEADLINE_S, (
            a,
            first_kill,
        )
    for e in ran:  # by Auto Scaling alone: every launcher was gone by then
        assert e["data"]["start"] == put[e["data"]["group"]]["start"]
        assert 0 <= e["wall"] - e["data"]["start"] <= 3, e
        assert e["wall"] > max(k["wall"] for k in kills)
        sizes = (e["data"]["MinSize"], e["data"]["MaxSize"], e["data"]["DesiredCapacity"])
        assert sizes == (0, 0, 0)
    assert set(report["groups_desired_at_end"].values()) == {0}
    assert report["instances_running_at_end"] == []
    assert report["processes_left"] == []
    assert report["scheduled_actions_at_end"] == []
