"""Fires each fault when its trigger comes (a training step, or seconds since the start).

- ``interrupt``: the instance's IMDS announces a Spot interruption (terminate, at now + notice);
  after the notice seconds the instance is terminated with EC2 TerminateInstances (its Auto
  Scaling group launches a replacement).
- ``rebalance``: IMDS publishes a rebalance recommendation; Capacity Rebalancing is emulated:
  the group's desired capacity goes up by one (a replacement launches while the group holds
  count + 1), a few seconds later the at-risk instance's ``target-lifecycle-state`` becomes
  ``Terminated``, the rehearsal waits (at most the notice seconds) for its launcher to exit,
  then TerminateInstanceInAutoScalingGroup with ShouldDecrementDesiredCapacity=True.
- ``kill``: SIGKILL the whole process tree, then TerminateInstances (a hard loss, replaced).
- ``crash``: from the trigger on, every trainer worker that runs on the instance is SIGKILLed
  (a trainer that keeps crashing: the launcher's restart budget runs out).
- ``kill-data-server``: SIGKILL the ``hetero serve`` tree of a dataprep instance, then
  TerminateInstances.
- ``s3-outage``: the S3 proxy resets every connection for the outage's seconds.

An instance fault names the INDEX-th instance of its group in launch order; it waits (pending)
until that instance has launched, and is skipped if the instance is already gone.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from training.rehearsal.aws import AwsEmulator, ClusterNames
from training.rehearsal.events import EventLog
from training.rehearsal.faults import Fault, FaultKind
from training.rehearsal.instances import (
    GroupSimulator,
    InstanceRun,
    is_data_server,
    is_trainer_worker,
)
from training.rehearsal.s3proxy import SwitchableProxy
from training.rehearsal.samples import StepWatcher

log = logging.getLogger(__name__)

REBALANCE_DELAY_S = 3.0
"""Seconds between the replacement's launch and the at-risk instance's move to Terminated."""
MAX_CRASH_KILLS = 50


def _pid_in(pids: set[int], proc: psutil.Process) -> bool:
    return proc.pid in pids


@dataclass
class FaultRecord:
    """What happened to one fault."""

    fault: Fault
    state: str = "pending"
    """``pending``, ``firing``, ``done`` or ``skipped``."""
    instance: str | None = None
    fired_t: float | None = None
    fired_wall: float | None = None
    """Wall time of the notice (or the kill, or the outage's start)."""
    step_at_fire: int | None = None
    terminated_t: float | None = None
    kills: int = 0
    detail: str = ""
    killed_pids: set[int] = field(default_factory=set)

    def to_json(self) -> dict[str, Any]:
        return {
            "fault": self.fault.describe(),
            "kind": self.fault.kind.value,
            "state": self.state,
            "instance": self.instance,
            "fired_t": self.fired_t,
            "fired_wall": self.fired_wall,
            "step_at_fire": self.step_at_fire,
            "terminated_t": self.terminated_t,
            "kills": self.kills,
            "detail": self.detail,
        }


class FaultInjector(threading.Thread):
    def __init__(
        self,
        faults: tuple[Fault, ...],
        *,
        simulator: GroupSimulator,
        aws: AwsEmulator,
        names: ClusterNames,
        proxy: SwitchableProxy,
        steps: StepWatcher,
        events: EventLog,
        notice_s: float,
        poll_s: float = 0.2,
        rebalance_delay_s: float = REBALANCE_DELAY_S,
    ) -> None:
        super().__init__(name="fault-injector", daemon=True)
        self.records = [FaultRecord(f) for f in faults]
        self.simulator = simulator
        self.aws = aws
        self.names = names
        self.proxy = proxy
        self.steps = steps
        self.events = events
        self.notice_s = notice_s
        self.poll_s = poll_s
        self.rebalance_delay_s = rebalance_delay_s
        self._stopped = threading.Event()
        self._helpers: list[threading.Thread] = []
        self._lock = threading.Lock()

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        while not self._stopped.is_set():
            step = self.steps.current_step()
            elapsed = self.events.elapsed()
            for rec in self.records:
                if rec.state == "pending" and rec.fault.trigger.due(step, elapsed):
                    self._fire(rec, step)
            self._crash_workers()
            self._stopped.wait(self.poll_s)

    def busy(self) -> bool:
        """A fault is still in progress (a notice running out, an outage, a rebalance; a crash
        fault keeps firing while its instance lives and does not count)."""
        with self._lock:
            return any(
                r.state == "firing" and r.fault.kind is not FaultKind.CRASH for r in self.records
            )

    def pending(self) -> list[FaultRecord]:
        return [r for r in self.records if r.state == "pending"]

    def stop(self) -> None:
        """Stop firing; helpers waiting out a notice give up; S3 comes back."""
        self._stopped.set()
        if self.is_alive():
            self.join(timeout=10)
        for t in self._helpers:
            t.join(timeout=15)
        self.proxy.set_reachable(True)

    # -- firing ------------------------------------------------------------------------------

    def _fire(self, rec: FaultRecord, step: int) -> None:
        f = rec.fault
        run: InstanceRun | None = None
        if f.kind is not FaultKind.S3_OUTAGE:
            assert f.group is not None and f.index is not None
            run = self.simulator.instance(f.group, f.index)
            if run is None:
                return  # not launched yet (a replacement's index): stays pending
            if run.terminated:
                rec.state = "skipped"
                rec.detail = f"{f.group}:{f.index} ({run.instance_id}) was already terminated"
                self.events.add("fault-skipped", f"{f.describe()}: {rec.detail}")
                return
            rec.instance = run.instance_id
        rec.state, rec.step_at_fire = "firing", step
        rec.fired_t, rec.fired_wall = self.events.elapsed(), time.time()
        action = {
            FaultKind.INTERRUPT: self._interrupt,
            FaultKind.REBALANCE: self._rebalance,
            FaultKind.KILL: self._kill,
            FaultKind.CRASH: self._crash,
            FaultKind.KILL_DATA_SERVER: self._kill_data_server,
            FaultKind.S3_OUTAGE: self._s3_outage,
        }[f.kind]
        t = threading.Thread(
            target=self._guarded, args=(action, rec, run), name=f"fault-{f.kind}", daemon=True
        )
        self._helpers.append(t)
        t.start()

    def _guarded(self, action: Any, rec: FaultRecord, run: InstanceRun | None) -> None:
        try:
            action(rec, run)
        except Exception as e:
            rec.detail = f"{type(e).__name__}: {e}"
            self.events.add("fault-error", f"{rec.fault.describe()}: {rec.detail}")
        finally:
            with self._lock:
                if rec.state == "firing" and rec.fault.kind is not FaultKind.CRASH:
                    rec.state = "done"

    def _wait(self, seconds: float) -> bool:
        """Sleep ``seconds``; False when the rehearsal is stopping."""
        return not self._stopped.wait(max(0.0, seconds))

    def _terminate(self, rec: FaultRecord, run: InstanceRun, *, in_group: bool = False) -> None:
        if run.terminated:
            rec.detail = "the instance was already terminated (job end?)"
            return
        if in_group:
            self.aws.terminate_in_group(run.instance_id, decrement=True)
            how = "TerminateInstanceInAutoScalingGroup (decrement)"
        else:
            self.aws.terminate_instance(run.instance_id)
            how = "TerminateInstances"
        rec.terminated_t = self.events.elapsed()
        self.events.add("fault", f"{rec.fault.describe()}: {how}", instance=run.instance_id)

    def _interrupt(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None
        body = run.imds.set_spot_interruption(time.time() + self.notice_s)
        self.events.add(
            "fault",
            f"{rec.fault.describe()}: Spot interruption notice {body} at step {rec.step_at_fire}",
            instance=run.instance_id,
        )
        if self._wait(self.notice_s):
            self._terminate(rec, run)

    def _rebalance(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None and rec.fault.group is not None
        body = run.imds.set_rebalance_recommendation()
        asg = self.names.asg_names[rec.fault.group]
        desired = self.aws.desired_capacities(self.names).get(asg, 0)
        self.events.add(
            "fault",
            f"{rec.fault.describe()}: rebalance recommendation {body} at step {rec.step_at_fire}",
            instance=run.instance_id,
        )
        if desired == 0:
            rec.detail = "the group was already at 0"
            return
        self.aws.set_desired_capacity(asg, desired + 1)
        self.events.add("fault", f"Capacity Rebalancing: {asg} desired {desired} -> {desired + 1}")
        if not self._wait(self.rebalance_delay_s):
            return
        run.imds.set_target_lifecycle_state("Terminated")
        self.events.add("fault", "target-lifecycle-state -> Terminated", instance=run.instance_id)
        deadline = time.monotonic() + self.notice_s
        while run.launcher_running and time.monotonic() < deadline:
            if not self._wait(0.2):
                return
        exited = "exited" if not run.launcher_running else "still running after the notice"
        self.events.add("fault", f"at-risk launcher {exited}", instance=run.instance_id)
        self._terminate(rec, run, in_group=True)

    def _kill(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None
        pids = self.simulator.kill_tree(run)
        self.events.add(
            "fault",
            f"{rec.fault.describe()}: SIGKILL {len(pids)} process(es) at step {rec.step_at_fire}",
            instance=run.instance_id,
        )
        self._terminate(rec, run)

    def _kill_data_server(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None
        pids = self.simulator.kill_matching(run, is_data_server)
        self.events.add(
            "fault",
            f"{rec.fault.describe()}: SIGKILL data server tree {pids} at step {rec.step_at_fire}",
            instance=run.instance_id,
        )
        self._terminate(rec, run)

    def _crash(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None
        self.events.add(
            "fault",
            f"{rec.fault.describe()}: the trainer on this instance crashes from now on "
            f"(step {rec.step_at_fire})",
            instance=run.instance_id,
        )
        # The injector's loop kills the workers from now on (see _crash_workers).

    def _crash_workers(self) -> None:
        """SIGKILL every trainer worker now running on an instance with a firing crash fault
        (called from the injector's loop only, so no worker is counted twice)."""
        for rec in self.records:
            if rec.fault.kind is not FaultKind.CRASH or rec.state != "firing":
                continue
            assert rec.fault.group is not None and rec.fault.index is not None
            run = self.simulator.instance(rec.fault.group, rec.fault.index)
            if run is None or run.terminated or rec.kills >= MAX_CRASH_KILLS:
                with self._lock:
                    rec.state = "done"
                continue
            workers = {
                p.pid
                for p in run.live_processes()
                if p.pid not in rec.killed_pids and is_trainer_worker(p)
            }
            if not workers:
                continue
            self.simulator.kill_matching(run, functools.partial(_pid_in, workers))
            for pid in sorted(workers):
                rec.killed_pids.add(pid)
                rec.kills += 1
                self.events.add(
                    "fault",
                    f"crash: SIGKILL trainer worker pid {pid} (kill {rec.kills})",
                    instance=run.instance_id,
                )

    def _s3_outage(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert rec.fault.duration_s is not None
        self.proxy.set_reachable(False)
        self.events.add(
            "fault",
            f"{rec.fault.describe()}: S3 unreachable for {rec.fault.duration_s:g}s "
            f"from step {rec.step_at_fire}",
        )
        try:
            self._wait(rec.fault.duration_s)
        finally:
            self.proxy.set_reachable(True)
            self.events.add("fault", "S3 reachable again")
