"""The rehearsal's verdict (the invariants) and its summary table.

Invariants, each ``{"ok": bool, "detail": str}`` in ``rehearsal.json``:

- ``outcome``: the job record says what the scenario expects (``finished`` by default);
- ``not_timed_out``: the job ended before ``--timeout``;
- ``faults_applied``: every fault fired (none pending, none skipped);
- ``groups_at_zero``: every Auto Scaling group's desired capacity is 0 and no instance runs;
- ``no_processes_left``: no process the rehearsal started (or a descendant) was alive at the end;
- with launch faults (``boot-fail``, ``early-exit``): ``broken_instances_left_service``, every
  instance hit was terminated, and replaced by its group unless the job ended failed;
- when the scenario expects the job to finish: ``final_step`` (the sample logs reach the spec's
  step count), ``samples_exactly_once`` (no sample lost or repeated in any epoch, no step
  missing), ``steps_lost_bounded`` (steps redone after rollbacks at most ``expect.steps-lost-max``,
  by default one checkpoint interval per trainer instance lost: a notice is answered with a
  checkpoint, a hard loss, a launcher gone or a frozen host costs at most the steps since the
  last one) and, when there is a
  baseline, ``params_equal`` (bitwise-equal final parameters);
- with an elastic dataprep group (``data_tier``, ``training.rehearsal.datatier``):
  ``data_tier_consistent``, every desired capacity the group had before the job's end was one
  the data-tier controller asked for, in its order (no loss counted twice); not checked when the
  scenario sends that group a rebalance recommendation (Capacity Rebalancing raises its desired
  capacity for a while by itself).
- with a bill in the job's outcome (``bill``, ``training.rehearsal.bill_check``):
  ``bill_agrees``, every group's billed instance-seconds within 1 % of those the group simulator
  counted up to the job's end (so its USD at the recorded price): in full where 1 % of them is
  at least the half second per launch that EC2's ``LaunchTime`` (given to the second) leaves
  open, else apart from that rounding, which the rehearsal measures from moto's creation times;
  within the bill's own bound where its bracketed ends make that wider; not checked without a
  bill, or after a resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.rehearsal import bill_check
from training.rehearsal.faults import FaultKind, Scenario
from training.spec import ClusterSpec

_TRAINER_LOSS = (
    FaultKind.INTERRUPT,
    FaultKind.REBALANCE,
    FaultKind.KILL,
    FaultKind.KILL_IN_SAVE,
    FaultKind.KILL_TRAINER,
    FaultKind.HANG_TRAINER,
    FaultKind.KILL_LAUNCHER,
    FaultKind.HANG,
)


def steps_lost_bound(spec: ClusterSpec, scenario: Scenario) -> int:
    """The most steps the scenario may redo (see the module docstring)."""
    if scenario.expect.steps_lost_max is not None:
        return scenario.expect.steps_lost_max
    trainer = spec.trainer_group.name
    losses = sum(1 for f in scenario.faults if f.kind in _TRAINER_LOSS and f.group == trainer)
    return losses * spec.job.checkpoint.interval_steps


def _check(ok: bool, detail: str) -> dict[str, Any]:
    return {"ok": bool(ok), "detail": detail}


def invariants(
    facts: dict[str, Any], spec: ClusterSpec, scenario: Scenario, *, baseline: Path | None
) -> dict[str, dict[str, Any]]:
    expected = scenario.expect.outcome
    out: dict[str, dict[str, Any]] = {}
    outcome = facts.get("outcome")
    out["outcome"] = _check(outcome == expected, f"job record {outcome!r}, expected {expected!r}")
    out["not_timed_out"] = _check(not facts.get("timed_out"), str(facts.get("end_reason")))
    not_applied = [
        f["fault"] for f in facts.get("faults", []) if f["state"] in ("pending", "skipped")
    ]
    out["faults_applied"] = _check(
        not not_applied, "all fired" if not not_applied else f"not applied: {not_applied}"
    )
    # MaxSize too: with it at 0 nothing (an elastic group's controller still running, a user's
    # SetDesiredCapacity) launches an instance after the job's end (launcher/job_end.py).
    desired = facts.get("groups_desired_at_end", {})
    max_sizes = facts.get("groups_max_at_end", {})
    running = facts.get("instances_running_at_end", [])
    out["groups_at_zero"] = _check(
        all(v == 0 for v in [*desired.values(), *max_sizes.values()]) and not running,
        f"desired {desired}; MaxSize {max_sizes}; {len(running)} instance(s) running",
    )
    # The job's end deletes the budget's scheduled action (costs/backstop.py) from every group.
    actions = facts.get("scheduled_actions_at_end", [])
    out["no_scheduled_action_left"] = _check(
        not actions, f"{len(actions)} left: {[(a['group'], a['name']) for a in actions]}"
    )
    fates = facts.get("launch_faults", [])
    if fates:
        stuck = [
            f"{f['group']}:{f['index']} ({f['fault']})"
            for f in fates
            if f["left_service_s"] is None or (f["replaced_by"] is None and outcome != "failed")
        ]
        out["broken_instances_left_service"] = _check(
            not stuck,
            f"{len(fates)} instance(s) hit at launch, each terminated"
            + (" and replaced" if outcome != "failed" else " (replaced, or the job ended failed)")
            + f"; job record replaced/: {len(facts.get('replaced_in_record', []))}"
            if not stuck
            else f"still in service or never replaced: {stuck}",
        )
    tier = facts.get("data_tier")
    if tier is not None and not any(
        f.kind is FaultKind.REBALANCE and f.group == tier["group"] for f in scenario.faults
    ):
        out["data_tier_consistent"] = _check(
            tier["consistent"],
            f"{tier['asg']} desired {tier['desired_before_end']} before the end; the controller "
            f"asked for {tier['expected_desired']}",
        )
    bill = facts.get("bill") or {}
    if bill.get("checked"):
        out["bill_agrees"] = _check(bool(bill.get("ok")), bill_check.detail(bill))
    left = facts.get("processes_left", [])
    out["no_processes_left"] = _check(
        not left,
        "none" if not left else "; ".join(f"{p['pid']} {p['cmdline'][:80]}" for p in left[:5]),
    )
    if expected == "finished":
        total = spec.job.total_steps
        final = facts.get("final_step", 0)
        if total is not None:
            out["final_step"] = _check(
                final == total, f"sample logs end at step {final} of {total}"
            )
        epochs = facts.get("samples", [])
        bad = [
            f"epoch {e['epoch']}: {e['lost']} lost, {e['repeated']} repeated, "
            f"{e['unplanned']} unplanned"
            for e in epochs
            if e["lost"] or e["repeated"] or e["unplanned"]
        ]
        missing = facts.get("steps_missing", [])
        if not epochs:
            detail = f"no sample records in {facts.get('out_dir')}/samples"
        elif bad or missing:
            detail = "; ".join(bad + ([f"steps missing: {missing[:10]}"] if missing else []))
        else:
            detail = f"{len(epochs)} epoch(s), every planned sample exactly once"
        out["samples_exactly_once"] = _check(bool(epochs) and not bad and not missing, detail)
        bound = steps_lost_bound(spec, scenario)
        lost = facts.get("steps_lost", 0)
        out["steps_lost_bounded"] = _check(
            lost <= bound, f"{lost} step(s) redone after rollbacks; at most {bound} expected"
        )
    if baseline is not None and scenario.expect.expects_params_equal:
        cmp = facts.get("params_comparison") or {}
        out["params_equal"] = _check(
            bool(facts.get("params_equal_uninterrupted")),
            f"{cmp.get('tensors', 0)} tensors vs {baseline}"
            + (f"; differ: {cmp['differing'][:5]}" if cmp.get("differing") else "")
            + (f"; {cmp['error']}" if cmp.get("error") else ""),
        )
    return out


def _save_cut(fault: dict[str, Any]) -> str:
    """A kill-in-save fault's row: which write it cut, or why it did not fire."""
    if fault.get("cut_step") is None:
        return str(fault.get("detail") or fault.get("state"))
    return (
        f"cut the write of step {fault['cut_step']}; newest complete checkpoint at the kill: "
        f"{fault.get('newest_complete_at_kill')}"
    )


def render(facts: dict[str, Any]) -> None:
    """The summary table on the console (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"rehearsal {facts['scenario']['name']} ({facts['spec']['name']})")
    table.add_column("", style="bold")
    table.add_column("value")
    rows: list[tuple[str, str]] = [
        ("outcome", str(facts.get("outcome"))),
        ("ended", str(facts.get("end_reason"))),
        ("wall time", f"{facts.get('wall_seconds')} s"),
        ("faults", ", ".join(f["fault"] for f in facts.get("faults", [])) or "none"),
        ("final step", f"{facts.get('final_step')} of {facts['spec'].get('steps')}"),
        ("steps redone (lost)", str(facts.get("steps_lost"))),
        ("recovery seconds", str(facts.get("recovery_seconds") or "-")),
        ("replacement start to its first step (s)", _first_steps(facts)),
        ("resumed from steps", str(facts.get("resumed_from_steps") or "-")),
        ("replacements", str(len(facts.get("replacements", [])))),
        ("samples lost / epoch", str(facts.get("samples_lost"))),
        ("samples repeated / epoch", str(facts.get("samples_repeated"))),
        ("params equal baseline", str(facts.get("params_equal_uninterrupted"))),
        ("groups desired at end", str(facts.get("groups_desired_at_end"))),
        ("data tier", _data_tier(facts.get("data_tier"))),
        ("bill", bill_check.detail(facts.get("bill") or {"why": "none made"})),
        ("processes left", str(len(facts.get("processes_left", [])))),
    ]
    rows += [
        (f["fault"], _save_cut(f))
        for f in facts.get("faults", [])
        if f.get("kind") == FaultKind.KILL_IN_SAVE.value
    ]
    for k, v in rows:
        table.add_row(k, v)
    for name, check in facts.get("invariants", {}).items():
        mark = "[green]ok[/green]" if check["ok"] else "[red]FAILED[/red]"
        table.add_row(f"invariant {name}", f"{mark} {check['detail']}")
    console.print(table)
    verdict = "passed" if facts.get("ok") else "FAILED: " + ", ".join(facts["failed_invariants"])
    console.print(f"rehearsal {verdict}; report: {Path(facts['out_dir']) / 'rehearsal.json'}")


def _first_steps(facts: dict[str, Any]) -> str:
    seconds = [
        r["first_step_seconds"]
        for r in facts.get("replacements", [])
        if r.get("first_step_seconds") is not None
    ]
    return str(seconds) if seconds else "-"


def _data_tier(tier: dict[str, Any] | None) -> str:
    """The data-tier row: the controller's changes at their steps, and the servers' time."""
    if tier is None:
        return "fixed size"
    changes = [
        f"{d['from_count']}->{d['to_count']} at step {d['step']} ({d['t']:.0f} s)"
        for d in tier["decisions"]
        if d.get("acted") and d["to_count"] != d["from_count"]
    ]
    return (
        f"{tier['group']}: {', '.join(changes) or 'no change'}; "
        f"{tier['instances_launched']} instance(s), {tier['instance_seconds']:.0f} instance-s"
    )
