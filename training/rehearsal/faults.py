"""The faults a rehearsal injects, parsed from flags or a scenario file (TOML or JSON).

Instance faults are written ``GROUP:INDEX@STEP`` or ``GROUP:INDEX@Ns``: the INDEX-th instance of
the group in launch order (0 .. count-1 are the group's original instances; count, count+1, ...
are the replacements in the order they launch), when training reaches step STEP, or N seconds
after the rehearsal started. An S3 outage is ``STEP:SECONDS`` or ``Ns:SECONDS``. A launch fault
(``boot-fail``, ``early-exit``) is ``GROUP:INDEX`` or ``GROUP:*`` (every instance of the group,
replacements included): it applies from the instance's launch.

A scenario file holds the same lists under the flag names, plus optional expectations::

    name = "one-spot-interruption"
    interrupt = ["trainer:1@10"]
    capacity-gone = ["trainer:0@12"]
    s3-outage = ["20:5"]
    boot-fail = ["dataprep:0"]
    notice-seconds = 15
    [expect]
    outcome = "finished"      # or "failed" (a trainer that keeps crashing), "stopped" (budget),
                              # "none" (no launcher left to record one: kill-launcher)
    params-equal = true       # default: true when the expected outcome is "finished"
    steps-lost-max = 4        # default: one checkpoint interval per trainer instance lost
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from training.spec import ClusterSpec, Role


class FaultKind(StrEnum):
    INTERRUPT = "interrupt"
    """Spot interruption notice in IMDS, then (after the notice seconds) TerminateInstances."""
    REBALANCE = "rebalance"
    """Rebalance recommendation, then Capacity Rebalancing: a replacement first, then the
    at-risk instance is moved to ``Terminated`` and terminated."""
    KILL = "kill"
    """SIGKILL the instance's whole process tree and terminate it (a hard loss)."""
    CRASH = "crash"
    """SIGKILL the trainer worker on the instance every time it runs, from STEP on."""
    KILL_TRAINER = "kill-trainer"
    """SIGKILL the trainer worker on the instance once, at STEP (a rank that crashes now and
    then: the launcher restarts the generation from the newest checkpoint)."""
    KILL_IN_SAVE = "kill-in-save"
    """From STEP on, watch a trainer instance's checkpoint staging folder; as soon as a write is
    in progress there (a ``step-N.partial`` folder), SIGKILL its whole process tree and
    terminate it (a hard loss in the middle of a checkpoint write)."""
    KILL_LAUNCHER = "kill-launcher"
    """SIGKILL the instance's whole process tree and leave the instance running: its launcher
    gone for good (Docker's restarts spent, a hung host), so nothing on it ends the job."""
    HANG = "hang"
    """SIGSTOP every process of the instance and leave it running: a frozen host (a wedged
    driver, a host that stopped scheduling), silent in the job record while EC2 lists it."""
    HANG_TRAINER = "hang-trainer"
    """SIGSTOP the trainer workers of the instance once, at STEP, and nothing else: ranks alive
    and stuck (a wedged driver, a rank stuck in a collective), while the launcher writes on. Its
    hang watch takes their stacks and ends the generation (``launcher/hang_watch.py``)."""
    HANG_DATA_SERVER = "hang-data-server"
    """SIGSTOP the ``hetero serve`` process of a dataprep instance, its launcher left running: a
    data server alive and silent. Its launcher's health check finds it not answering and takes
    the host out of its group (``launcher/server_watch.py``)."""
    CAPACITY_GONE = "capacity-gone"
    """SIGKILL the instance's whole process tree and terminate it, and from then until the job
    ends its group finds no capacity (its launches fail, as with ``InsufficientInstanceCapacity``
    when a Spot pool is reclaimed): no replacement comes. The next job (``--resume-stopped``)
    launches as usual."""
    KILL_DATA_SERVER = "kill-data-server"
    """SIGKILL the ``hetero serve`` tree of a dataprep instance and terminate the instance."""
    S3_OUTAGE = "s3-outage"
    """S3 unreachable from the instances for SECONDS."""
    BOOT_FAIL = "boot-fail"
    """At launch: the instance's boot gives up (the user data's retries run out), so no launcher
    starts; the OS shuts the instance down, EC2 terminates it (InstanceInitiatedShutdownBehavior
    ``terminate``) and its group launches a replacement."""
    EARLY_EXIT = "early-exit"
    """At launch: the launcher exits before its job loop. The instance's metadata carries no
    tags (as with instance metadata tags off), so the launcher cannot find its group."""


LAUNCH_KINDS = frozenset({FaultKind.BOOT_FAIL, FaultKind.EARLY_EXIT})
"""Faults that apply to an instance from its launch (``GROUP:INDEX`` or ``GROUP:*``, no time)."""


INSTANCE_FORM = "GROUP:INDEX@STEP or GROUP:INDEX@Ns (e.g. trainer:0@10, dataprep:1@30s)"
LAUNCH_FORM = "GROUP:INDEX or GROUP:* (every instance of the group, replacements included)"
OUTAGE_FORM = "STEP:SECONDS or Ns:SECONDS (e.g. 20:8, 45s:10)"
_INSTANCE_RE = re.compile(r"^(?P<group>[a-z][a-z0-9-]*):(?P<index>\d+)@(?P<when>\d+(?:\.\d+)?s?)$")
_LAUNCH_RE = re.compile(r"^(?P<group>[a-z][a-z0-9-]*):(?P<index>\d+|\*)$")
_OUTAGE_RE = re.compile(r"^(?P<when>\d+(?:\.\d+)?s?):(?P<seconds>\d+(?:\.\d+)?)$")


class FaultSyntaxError(ValueError):
    """A fault or scenario could not be read; the message names the accepted form."""


@dataclass(frozen=True)
class Trigger:
    """When a fault fires: at a training step, or at a time since the rehearsal started."""

    step: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if (self.step is None) == (self.seconds is None):
            raise ValueError("a trigger is a step or a time, exactly one of them")

    def describe(self) -> str:
        return f"step {self.step}" if self.step is not None else f"{self.seconds:g}s"

    def due(self, step: int, elapsed_s: float) -> bool:
        if self.step is not None:
            return step >= self.step
        assert self.seconds is not None
        return elapsed_s >= self.seconds


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    trigger: Trigger
    group: str | None = None
    """Instance faults: the instance group's name."""
    index: int | None = None
    """Instance faults: the instance's position in its group's launch order (launch faults:
    None for every instance of the group)."""
    duration_s: float | None = None
    """S3 outage: how long S3 stays unreachable."""

    @property
    def at_launch(self) -> bool:
        return self.kind in LAUNCH_KINDS

    def matches(self, group: str, index: int) -> bool:
        """A launch fault's target: this instance of the group (or every one)."""
        return self.group == group and (self.index is None or self.index == index)

    def describe(self) -> str:
        if self.at_launch:
            return f"{self.kind.value} {self.group}:{'*' if self.index is None else self.index}"
        when = self.trigger.describe().removeprefix("step ")
        if self.kind is FaultKind.S3_OUTAGE:
            return f"{self.kind.value} {when}:{self.duration_s:g}"
        return f"{self.kind.value} {self.group}:{self.index}@{when}"


NO_OUTCOME = "none"
"""The rehearsal's outcome when the job record has none."""
OUTCOMES = ("finished", "failed", "stopped", NO_OUTCOME)
"""What ``expect.outcome`` may be (``Expectations.outcome``)."""


@dataclass(frozen=True)
class Expectations:
    """What the scenario should end with; the rehearsal fails when it ends otherwise."""

    outcome: str = "finished"
    """The job record's outcome: ``finished``, ``failed`` or ``stopped`` (``job.max_usd`` /
    ``job.max_hours`` reached), or ``none``: the job record has none (every launcher was gone
    before it could record one; the budget's scheduled action took the groups to zero)."""
    params_equal: bool | None = None
    """Final parameters equal to an uninterrupted run's (None: expected when finished)."""
    steps_lost_max: int | None = None
    """Most steps the job may redo (None: a checkpoint interval per trainer instance lost)."""

    @property
    def expects_params_equal(self) -> bool:
        return self.outcome == "finished" if self.params_equal is None else self.params_equal


@dataclass(frozen=True)
class Scenario:
    name: str = "custom"
    faults: tuple[Fault, ...] = ()
    expect: Expectations = field(default_factory=Expectations)
    notice_seconds: float | None = None
    """From the scenario file; the ``--notice-seconds`` flag wins."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "faults": [f.describe() for f in self.faults],
            "expect": {
                "outcome": self.expect.outcome,
                "params_equal": self.expect.expects_params_equal,
                "steps_lost_max": self.expect.steps_lost_max,
            },
        }


def _parse_when(text: str, what: str, form: str) -> Trigger:
    if text.endswith("s"):
        return Trigger(seconds=float(text[:-1]))
    if "." in text:
        raise FaultSyntaxError(f"{what}: a step is a whole number, got {text!r}; expected {form}")
    return Trigger(step=int(text))


def parse_instance_fault(kind: FaultKind | str, text: str) -> Fault:
    """``GROUP:INDEX@STEP`` or ``GROUP:INDEX@Ns`` for ``kind``; ``FaultSyntaxError`` otherwise."""
    kind = _kind(kind)
    if kind is FaultKind.S3_OUTAGE:
        return parse_outage(text)
    if kind in LAUNCH_KINDS:
        return parse_launch_fault(kind, text)
    m = _INSTANCE_RE.match(text.strip())
    if m is None:
        raise FaultSyntaxError(f"--{kind.value} {text!r}: expected {INSTANCE_FORM}")
    trigger = _parse_when(m["when"], f"--{kind.value} {text!r}", INSTANCE_FORM)
    return Fault(kind, trigger, group=m["group"], index=int(m["index"]))


def parse_launch_fault(kind: FaultKind, text: str) -> Fault:
    """``GROUP:INDEX`` or ``GROUP:*`` for a launch fault; ``FaultSyntaxError`` otherwise."""
    m = _LAUNCH_RE.match(text.strip())
    if m is None:
        raise FaultSyntaxError(f"--{kind.value} {text!r}: expected {LAUNCH_FORM}")
    index = None if m["index"] == "*" else int(m["index"])
    return Fault(kind, Trigger(step=0), group=m["group"], index=index)


def parse_outage(text: str) -> Fault:
    """``STEP:SECONDS`` or ``Ns:SECONDS``; ``FaultSyntaxError`` otherwise."""
    m = _OUTAGE_RE.match(text.strip())
    if m is None:
        raise FaultSyntaxError(f"--s3-outage {text!r}: expected {OUTAGE_FORM}")
    trigger = _parse_when(m["when"], f"--s3-outage {text!r}", OUTAGE_FORM)
    seconds = float(m["seconds"])
    if seconds <= 0:
        raise FaultSyntaxError(f"--s3-outage {text!r}: the outage must last more than 0 seconds")
    return Fault(FaultKind.S3_OUTAGE, trigger, duration_s=seconds)


def parse_faults(by_kind: Mapping[str, Iterable[str]]) -> tuple[Fault, ...]:
    """Every fault of ``{kind: [text, ...]}`` (kinds spelt like the flags, ``_`` or ``-``)."""
    return tuple(parse_instance_fault(_kind(k), t) for k, texts in by_kind.items() for t in texts)


def _kind(key: str) -> FaultKind:
    try:
        return FaultKind(key.replace("_", "-"))
    except ValueError:
        valid = ", ".join(k.value for k in FaultKind)
        raise FaultSyntaxError(f"unknown fault kind {key!r}; the kinds are: {valid}") from None


_SCENARIO_KEYS = {"name", "expect", "notice-seconds", "description"}


def load_scenario(path: str | Path) -> Scenario:
    """A scenario from a ``.toml`` or ``.json`` file (format in the module docstring)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise FaultSyntaxError(f"scenario {p}: {e}") from e
    try:
        data: Any = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        kind = "JSON" if p.suffix == ".json" else "TOML"
        raise FaultSyntaxError(f"scenario {p}: not valid {kind}: {e}") from e
    if not isinstance(data, dict):
        raise FaultSyntaxError(f"scenario {p}: expected a table/object at the top")
    return scenario_from_mapping(data, source=str(p))


def scenario_from_mapping(data: Mapping[str, Any], source: str = "scenario") -> Scenario:
    by_kind: dict[str, list[str]] = {}
    for key, value in data.items():
        norm = key.replace("_", "-")
        if norm in _SCENARIO_KEYS:
            continue
        kind = _kind(norm)
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            form = {FaultKind.S3_OUTAGE: OUTAGE_FORM}.get(
                kind, LAUNCH_FORM if kind in LAUNCH_KINDS else INSTANCE_FORM
            )
            raise FaultSyntaxError(f"{source}: {key} must be a string or a list of {form}")
        by_kind.setdefault(kind.value, []).extend(values)
    expect_raw = data.get("expect", {})
    if not isinstance(expect_raw, dict):
        raise FaultSyntaxError(f"{source}: expect must be a table (outcome, params-equal)")
    expect = {k.replace("_", "-"): v for k, v in expect_raw.items()}
    unknown = set(expect) - {"outcome", "params-equal", "steps-lost-max"}
    if unknown:
        raise FaultSyntaxError(
            f"{source}: unknown expect key(s) {sorted(unknown)}; use outcome, params-equal, "
            "steps-lost-max"
        )
    outcome = expect.get("outcome", "finished")
    if outcome not in OUTCOMES:
        raise FaultSyntaxError(
            f"{source}: expect.outcome must be 'finished', 'failed', 'stopped' (the budget) or "
            "'none' (no launcher left to record one)"
        )
    params_equal = expect.get("params-equal")
    if params_equal is not None and not isinstance(params_equal, bool):
        raise FaultSyntaxError(f"{source}: expect.params-equal must be true or false")
    steps_lost_max = expect.get("steps-lost-max")
    if steps_lost_max is not None and (
        not isinstance(steps_lost_max, int)
        or isinstance(steps_lost_max, bool)
        or steps_lost_max < 0
    ):
        raise FaultSyntaxError(f"{source}: expect.steps-lost-max must be a whole number >= 0")
    notice = data.get("notice-seconds", data.get("notice_seconds"))
    if notice is not None and (not isinstance(notice, int | float) or notice < 0):
        raise FaultSyntaxError(f"{source}: notice-seconds must be a number >= 0")
    name = data.get("name", Path(source).stem)
    return Scenario(
        name=str(name),
        faults=parse_faults(by_kind),
        expect=Expectations(
            outcome=outcome, params_equal=params_equal, steps_lost_max=steps_lost_max
        ),
        notice_seconds=float(notice) if notice is not None else None,
    )


def merge(scenario: Scenario, extra: Sequence[Fault]) -> Scenario:
    """The scenario with the flags' faults added."""
    return replace(scenario, faults=(*scenario.faults, *extra)) if extra else scenario


def check_against_spec(faults: Sequence[Fault], spec: ClusterSpec) -> list[str]:
    """Problems of ``faults`` for ``spec`` (unknown group, a role that cannot take the fault)."""
    problems: list[str] = []
    groups = {g.name: g for g in spec.groups}
    for f in faults:
        if f.kind is FaultKind.S3_OUTAGE:
            continue
        group = groups.get(f.group or "")
        if group is None:
            problems.append(
                f"{f.describe()}: the spec has no group {f.group!r} (it has {', '.join(groups)})"
            )
            continue
        trainer_only = (FaultKind.CRASH, FaultKind.KILL_IN_SAVE, FaultKind.HANG_TRAINER)
        if f.kind in trainer_only and group.role is not Role.TRAINER:
            problems.append(
                f"{f.describe()}: {f.kind.value} needs a trainer group, {f.group!r} is not"
            )
        data_only = (FaultKind.KILL_DATA_SERVER, FaultKind.HANG_DATA_SERVER)
        if f.kind in data_only and group.role is not Role.DATAPREP:
            problems.append(
                f"{f.describe()}: {f.kind.value} needs a dataprep group, {f.group!r} is not"
            )
    return problems
