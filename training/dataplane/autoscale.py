"""The data tier sizes itself: a controller that decides how many data servers the trainer needs.

Inputs, every metric interval (``job.log_every`` steps): the trainer's data-wait share (averaged
over its ranks) and each serving data server's busy share (``ServerInfo.busy_s`` over
``uptime_s``, differenced between two looks: the share of its capacity it used meanwhile).

The rule (``DataTierController.observe``), over the medians of the last ``window`` intervals
(so one odd interval, such as the first batches of an epoch, decides nothing):

- **Grow** when the trainer waits for data more than the target share and the servers are busy
  (at least ``max_busy``): they are the bottleneck, so more of them help. A trainer that waits a
  share ``w`` of its time consumes ``1/(1-w)`` times what it gets, so the new count is
  ``ceil(n / (1 - w))`` (at least one more, at most ``max_count``). Waiting while the servers
  idle is not theirs to fix (a slow network, a slow client): no change, and the decision log
  says why.
- **Shrink** when the trainer waits less than half the target and the servers left would still
  be busy at most ``max_busy`` of their time: to ``max(min_count, ceil(n * busy / max_busy))``,
  once ``window`` looks in a row want fewer (slower down than up: when the demand drops, the
  looks in the middle of the drop do not set the count).
- **Hold** otherwise. While fewer servers serve than the count (one was lost or is leaving,
  and its group replaces it) the wait that causes is no reason to grow; a shrink is computed
  from the servers that serve, and on EC2 removes the leaving instance first
  (``AsgActuator``), so one loss is never counted twice. The gap between the two
  rules is the hysteresis: after a growth the busy share is high, so shrinking does not follow.
  After any change the controller waits for every server of the new count to serve and then
  ``cooldown_s`` before it decides again, and it forgets the intervals measured before the
  change.

Exactly one controller acts: the trainer's global rank 0 runs it (``Autoscaler``). A new rank 0
(the trainer restarted, or its host replaced) starts from the count the backend reports, so the
job does not depend on the host. Backends (``Actuator``): a file the local runner reads
(``hetero local``), the dataprep group's desired capacity (EC2, also in ``hetero rehearse``), or
nothing (SageMaker: the decision is logged, the count stays).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from training.common import aws
from training.common.files import write_atomically
from training.common.names import asg_name
from training.spec import ClusterSpec, InstanceGroup

log = logging.getLogger(__name__)

DECISIONS_FILE = "autoscale.jsonl"
"""Every decision, one JSON line each, in the trainer's run folder."""


@dataclass(frozen=True)
class Policy:
    """What the controller may do, from the spec (``policy_for``)."""

    group: str
    min_count: int
    max_count: int
    target_wait: float = 0.05
    max_busy: float = 0.75
    window: int = 3
    cooldown_s: float = 60.0
    settle_timeout_s: float = 600.0
    """After a change, how long the controller waits for the serving count to reach it (a
    launch that never comes, capacity EC2 cannot find) before it decides again anyway."""


def policy_for(spec: ClusterSpec) -> Policy | None:
    """The policy of the spec's elastic dataprep group, or None when no group is elastic."""
    elastic = [g for g in spec.dataprep_groups if g.elastic]
    if not elastic:
        return None
    if len(elastic) > 1:
        raise ValueError(
            f"{len(elastic)} elastic dataprep groups ({', '.join(g.name for g in elastic)}); "
            "make one elastic (the controller sizes one group)"
        )
    g: InstanceGroup = elastic[0]
    dp = spec.job.dataplane
    return Policy(
        group=g.name,
        min_count=g.min_size,
        max_count=g.max_size,
        target_wait=dp.autoscale_target_wait,
        max_busy=dp.autoscale_max_busy,
        window=dp.autoscale_window,
        cooldown_s=dp.autoscale_cooldown_s,
    )


@dataclass(frozen=True)
class Observation:
    """One metric interval: when, at which step, the trainer's data-wait share, how many
    servers serve and their mean busy share (None: not known this time)."""

    time: float
    step: int
    wait_share: float
    serving: int
    busy_share: float | None


@dataclass(frozen=True)
class Decision:
    """A change of the count (``to_count != from_count``) or a refusal worth logging, with its
    inputs."""

    time: float
    step: int
    from_count: int
    to_count: int
    reason: str
    wait_share: float
    busy_share: float | None
    serving: int
    acted: bool = True
    """False where the backend only reports (SageMaker) or the change failed."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DataTierController:
    """The decision rule (module docstring): pure, so it is tested without a cluster."""

    policy: Policy
    count: int
    """The count asked for last (the backend's at start)."""
    _window: deque[Observation] = field(default_factory=deque)
    _shrinks: deque[int] = field(default_factory=deque)
    """The count each of the last ``window`` looks would shrink to (``count``: no fewer)."""
    _changed_at: float | None = None
    _settled_at: float | None = None
    _short_since: float | None = None
    _last_refusal: str | None = None

    def __post_init__(self) -> None:
        self.count = min(max(self.count, self.policy.min_count), self.policy.max_count)
        self._window = deque(maxlen=self.policy.window)
        self._shrinks = deque(maxlen=self.policy.window)

    def observe(self, obs: Observation) -> Decision | None:
        """Take one interval; a ``Decision`` when the count should change (or a growth is
        refused for a reason worth logging once), else None."""
        p = self.policy
        if self._changed_at is not None:
            if self._settled_at is None:
                waited = obs.time - self._changed_at
                if obs.serving != self.count and waited < p.settle_timeout_s:
                    return None
                if obs.serving != self.count:
                    self._short_since = self._changed_at  # no second wait for the shortfall
                    log.warning(
                        "data-tier controller: %d server(s) serve %.0fs after asking for %d; "
                        "deciding again anyway", obs.serving, waited, self.count,
                    )  # fmt: skip
                self._settled_at = obs.time
                self._window.clear()
                self._shrinks.clear()
                return None
            if obs.time - self._settled_at < p.cooldown_s:
                self._window.clear()
                self._shrinks.clear()
                return None
        # Fewer serve than the count: a server was lost or is leaving (Spot, a crash) and its
        # group replaces it. The wait that causes is no demand for more (no growth meanwhile,
        # up to the settle timeout); a shrink goes on from the servers that do serve.
        if obs.serving < self.count:
            if self._short_since is None:
                self._short_since = obs.time
        else:
            self._short_since = None
        short = self._short_since is not None and obs.time - self._short_since < p.settle_timeout_s
        self._window.append(obs)
        if len(self._window) < p.window:
            return None
        wait = statistics.median(o.wait_share for o in self._window)
        known = [o.busy_share for o in self._window if o.busy_share is not None]
        busy = statistics.median(known) if known else None
        n = self.count
        if wait > p.target_wait:
            self._shrinks.append(n)  # a look that wants no fewer
            if short:
                return self._refusal(
                    obs, wait, busy,
                    f"{obs.serving} of {n} server(s) serve; waiting for the group to replace "
                    "the one(s) lost",
                )  # fmt: skip
            if n >= p.max_count:
                return self._refusal(obs, wait, busy, f"at max_count {p.max_count}")
            if busy is None or busy < p.max_busy:
                shown = "unknown" if busy is None else f"{busy:.0%}"
                return self._refusal(
                    obs, wait, busy, f"the servers are busy only {shown}: more would not help"
                )
            target = min(p.max_count, max(n + 1, math.ceil(n / max(1.0 - wait, 1e-3))))
            return self._change(
                obs, target, wait, busy,
                f"data-wait {wait:.1%} over the target {p.target_wait:.1%} with the servers "
                f"busy {busy:.0%}",
            )  # fmt: skip
        self._last_refusal = None
        target = n
        # The load is the busy share of the servers that serve (during a loss, fewer than n).
        serving = min(n, max(1, int(statistics.median(o.serving for o in self._window))))
        if wait < p.target_wait / 2 and n > p.min_count and busy is not None:
            target = max(p.min_count, math.ceil(serving * busy / p.max_busy))
        self._shrinks.append(target)
        if len(self._shrinks) == p.window and max(self._shrinks) < n:
            assert busy is not None
            return self._change(
                obs, target, wait, busy,
                f"data-wait {wait:.1%} under half the target {p.target_wait:.1%}; {target} "
                f"server(s) would be busy {serving * busy / target:.0%} (at most "
                f"{p.max_busy:.0%})",
            )  # fmt: skip
        return None

    def revert(self, count: int, now: float) -> None:
        """The change was not made (report-only backend, or it failed): keep ``count`` and
        start the cooldown from ``now``."""
        self.count = count
        self._changed_at = self._settled_at = now

    def _change(
        self, obs: Observation, target: int, wait: float, busy: float | None, reason: str
    ) -> Decision:
        decision = Decision(
            time=obs.time, step=obs.step, from_count=self.count, to_count=target,
            reason=reason, wait_share=wait, busy_share=busy, serving=obs.serving,
        )  # fmt: skip
        self.count = target
        self._changed_at, self._settled_at = obs.time, None
        self._window.clear()
        self._shrinks.clear()
        self._last_refusal = None
        return decision

    def _refusal(
        self, obs: Observation, wait: float, busy: float | None, why: str
    ) -> Decision | None:
        """A growth the rule would want but does not make; reported once per reason."""
        if why == self._last_refusal:
            return None
        self._last_refusal = why
        return Decision(
            time=obs.time, step=obs.step, from_count=self.count, to_count=self.count,
            reason=f"data-wait {wait:.1%} over the target, no change: {why}",
            wait_share=wait, busy_share=busy, serving=obs.serving, acted=False,
        )  # fmt: skip


# -- backends ------------------------------------------------------------------------------------


class Actuator(Protocol):
    """Where the count takes effect."""

    acts: bool
    """False for a backend that only reports (SageMaker)."""

    def current(self) -> int | None:
        """The count the backend runs now (None: unknown)."""
        ...

    def set(self, count: int) -> None:
        """Ask for ``count`` servers; raises on failure."""
        ...

    def describe(self) -> str: ...


class ReportOnly:
    """SageMaker: a job's instance groups are given when it is created (``CreateTrainingJob``);
    the controller does not change them, it logs what it would do."""

    acts = False

    def __init__(self, count: int) -> None:
        self._count = count

    def current(self) -> int | None:
        return self._count

    def set(self, count: int) -> None:
        pass

    def describe(self) -> str:
        return "report only (a SageMaker job keeps the instance groups it was created with)"


class FileActuator:
    """``hetero local``: the desired count as JSON (``{"count": N}``) in a file the local runner
    reads; written atomically."""

    acts = True

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def current(self) -> int | None:
        try:
            return int(json.loads(self.path.read_text())["count"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def set(self, count: int) -> None:
        write_desired(self.path, count)

    def describe(self) -> str:
        return f"local servers ({self.path})"


def write_desired(path: Path, count: int) -> None:
    write_atomically(path, json.dumps({"count": count}) + "\n")


def read_desired(path: Path) -> int | None:
    return FileActuator(path).current()


class AsgActuator:
    """EC2: the dataprep Auto Scaling group's desired capacity (``SetDesiredCapacity``, within
    the group's min and max, which the stack sets from ``min_count``/``max_count``)."""

    acts = True

    def __init__(
        self,
        asg_name: str,
        client: Any | None = None,
        leaving: Callable[[], set[str]] | None = None,
    ) -> None:
        self.asg_name = asg_name
        self._client = client
        self._leaving = leaving

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = aws.client("autoscaling")
        return self._client

    def current(self) -> int | None:
        groups = self.client.describe_auto_scaling_groups(AutoScalingGroupNames=[self.asg_name])
        found = groups.get("AutoScalingGroups", [])
        return int(found[0]["DesiredCapacity"]) if found else None

    def set(self, count: int) -> None:
        """Grow: ``SetDesiredCapacity``. Shrink: first the group's instances that said they are
        leaving (``leaving()``: a Spot notice, an Auto Scaling termination, in the job record)
        go, each with ``TerminateInstanceInAutoScalingGroup`` and
        ``ShouldDecrementDesiredCapacity``, so the loss already under way is the scale-in
        rather than a second one; then ``SetDesiredCapacity`` for the rest (Auto Scaling picks
        which)."""
        group = self.client.describe_auto_scaling_groups(AutoScalingGroupNames=[self.asg_name])
        found = group.get("AutoScalingGroups", [])
        desired = int(found[0]["DesiredCapacity"]) if found else count
        if count < desired and self._leaving is not None:
            members = [i["InstanceId"] for i in found[0].get("Instances", [])]
            for instance in [i for i in members if i in self._leaving()][: desired - count]:
                self.client.terminate_instance_in_auto_scaling_group(
                    InstanceId=instance, ShouldDecrementDesiredCapacity=True
                )
                desired -= 1
                log.info("data-tier controller: scale-in takes leaving instance %s", instance)
        if desired != count:
            self.client.set_desired_capacity(
                AutoScalingGroupName=self.asg_name, DesiredCapacity=count, HonorCooldown=False
            )

    def describe(self) -> str:
        return f"Auto Scaling group {self.asg_name}"


def asg_arg(spec: ClusterSpec, cluster: str) -> str:
    """The trainer's ``--autoscale`` on EC2: ``asg:NAME``, the elastic group's Auto Scaling
    group ("" without an elastic group)."""
    policy = policy_for(spec)
    return "" if policy is None else f"asg:{asg_name(cluster, policy.group)}"


def report_arg(spec: ClusterSpec) -> str:
    """The trainer's ``--autoscale`` where nothing can resize the data tier (SageMaker):
    ``report``, the decisions logged only ("" without an elastic group)."""
    return "" if policy_for(spec) is None else "report"


def file_arg(path: Path) -> str:
    """The trainer's ``--autoscale`` in ``hetero local``: ``file:PATH``, the desired count's
    file its runner reads."""
    return f"file:{path}"


def actuator_from_arg(
    value: str, start: int, leaving: Callable[[], set[str]] | None = None
) -> Actuator:
    """``--autoscale`` of the trainer as the functions above make it: ``file:PATH``,
    ``asg:NAME`` or ``report``; ``leaving``:
    the instances that said they are leaving (the job record's), for an ASG's scale-in."""
    kind, _, arg = value.partition(":")
    if kind == "file" and arg:
        return FileActuator(arg)
    if kind == "asg" and arg:
        return AsgActuator(arg, leaving=leaving)
    if kind == "report":
        return ReportOnly(start)
    raise ValueError(f"--autoscale {value!r}: use file:PATH, asg:NAME or report")


# -- the running controller ----------------------------------------------------------------------


ServerLoads = Callable[[], Mapping[str, tuple[float, float]]]
"""``{address: (busy_s, uptime_s)}`` of the serving data servers (cumulative, from GetInfo)."""


class Autoscaler:
    """Runs the controller beside the trainer's rank 0: ``observe(step, wait_share)`` queues an
    interval (never blocks the step); a thread looks at the servers' load, decides, acts and
    records. ``on_decision`` gets each decision (the job record, the metrics)."""

    def __init__(
        self,
        policy: Policy,
        actuator: Actuator,
        loads: ServerLoads,
        *,
        run_dir: Path | None = None,
        start_count: int,
        on_decision: Callable[[Decision], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        current = actuator.current()
        self.controller = DataTierController(policy, current if current else start_count)
        self.actuator = actuator
        self._loads = loads
        self._path = run_dir / DECISIONS_FILE if run_dir is not None else None
        self._on_decision = on_decision
        self._clock = clock
        self._previous: dict[str, tuple[float, float]] = {}
        self._queue: queue.Queue[tuple[int, float] | None] = queue.Queue(maxsize=64)
        self.decisions: list[Decision] = []
        self.serving = 0
        """Servers serving at the last look."""
        self._thread = threading.Thread(target=self._run, name="autoscale", daemon=True)
        self._thread.start()
        log.info(
            "data-tier controller: group %s, %d server(s) (min %d, max %d), target data-wait "
            "%.1f%%, through %s",
            policy.group, self.controller.count, policy.min_count, policy.max_count,
            policy.target_wait * 100, actuator.describe(),
        )  # fmt: skip

    @property
    def count(self) -> int:
        return self.controller.count

    def observe(self, step: int, wait_share: float) -> None:
        try:
            self._queue.put_nowait((step, wait_share))
        except queue.Full:
            log.warning("data-tier controller: behind; interval at step %d dropped", step)

    def close(self, timeout_s: float = 10.0) -> None:
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    def busy(self) -> tuple[int, float | None]:
        """(serving servers, their mean busy share since the last look)."""
        now = self._loads()
        shares = []
        for address, (busy_s, uptime_s) in now.items():
            before = self._previous.get(address)
            if before is not None and uptime_s > before[1]:
                shares.append(min(1.0, max(0.0, (busy_s - before[0]) / (uptime_s - before[1]))))
        self._previous = dict(now)
        return len(now), (sum(shares) / len(shares) if shares else None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, wait = item
            try:
                self._step(step, wait)
            except Exception:  # the controller must never take the trainer down
                log.exception("data-tier controller: interval at step %d failed", step)

    def _step(self, step: int, wait: float) -> None:
        serving, busy = self.busy()
        self.serving = serving
        obs = Observation(self._clock(), step, wait, serving, busy)
        decision = self.controller.observe(obs)
        if decision is None:
            return
        if decision.to_count != decision.from_count:
            if self.actuator.acts:
                try:
                    self.actuator.set(decision.to_count)
                except Exception as e:
                    log.error("data-tier controller: could not set %d: %s", decision.to_count, e)
                    self.controller.revert(decision.from_count, obs.time)
                    decision = dataclasses.replace(
                        decision, acted=False, reason=f"{decision.reason}; {e}"
                    )
            else:
                self.controller.revert(decision.from_count, obs.time)
                decision = dataclasses.replace(decision, acted=False)
        self.record(decision)

    def record(self, decision: Decision) -> None:
        self.decisions.append(decision)
        verb = "->" if decision.acted else "-> (not acted)"
        log.info(
            "data-tier controller at step %d: %d %s %d: %s",
            decision.step, decision.from_count, verb, decision.to_count, decision.reason,
        )  # fmt: skip
        if self._path is not None:
            with self._path.open("a") as f:
                f.write(json.dumps(decision.as_dict()) + "\n")
        if self._on_decision is not None:
            try:
                self._on_decision(decision)
            except Exception:
                log.exception("data-tier controller: recording a decision failed")


def read_decisions(path: Path) -> Sequence[dict[str, Any]]:
    """The decisions in a run folder's ``autoscale.jsonl`` (empty when there are none)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]
