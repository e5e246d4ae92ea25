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
- ``kill-in-save``: from the trigger on, watch the trainer instance's checkpoint staging folder
  (``<its TMPDIR>/hetero/checkpoints``) every few tens of milliseconds; as soon as a
  ``step-N.partial`` folder is there (a checkpoint write in progress), SIGKILL the whole tree,
  note N and the newest complete checkpoint in S3, then TerminateInstances. No write within
  ``save_watch_s`` (or the instance gone first): the fault is skipped, with the reason.
- ``crash``: from the trigger on, every trainer worker that runs on the instance is SIGKILLed
  (a trainer that keeps crashing: the launcher's restart budget runs out).
- ``capacity-gone``: the group's launches are held (``AwsEmulator.hold_launches``), then as
  ``kill``: no replacement launches until the job ends (``release_capacity``, called by the
  rehearsal before it continues a stopped job, and at the end).
- ``kill-data-server``: SIGKILL the ``hetero serve`` tree of a dataprep instance, then
  TerminateInstances.
- ``kill-trainer``: SIGKILL the instance's trainer workers once (a crashed rank: the launchers
  restart the generation; the restart budget starts over after each new checkpoint).
- ``kill-launcher``: SIGKILL the whole process tree and leave the instance running (a launcher
  gone for good): a live host takes it out of its group once it is silent in the job record
  (``launcher/silent_hosts.py``); with no live host left, only the budget's scheduled action
  (``costs/backstop.py``) ends it.
- ``hang``: SIGSTOP the whole process tree and leave the instance running (a frozen host):
  silent, as above.
- ``hang-trainer``: SIGSTOP the instance's trainer workers once, the launcher left running (stuck
  ranks): the launcher's hang watch takes their stacks and ends the generation
  (``launcher/hang_watch.py``).
- ``hang-data-server``: SIGSTOP the ``hetero serve`` process of a dataprep instance, its launcher
  left running: the launcher's health check finds it not answering and takes the host out
  (``launcher/server_watch.py``).
- ``s3-outage``: the S3 proxy resets every connection for the outage's seconds.

An instance fault names the INDEX-th instance of its group in launch order; it waits (pending)
until that instance has launched, and is skipped if the instance is already gone.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from training.common.steps import PARTIAL_SUFFIX, partial_name, step_of
from training.launcher.plan import checkpoint_staging_dir
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
from training.trainer.checkpoint_s3 import S3CheckpointStore

log = logging.getLogger(__name__)

REBALANCE_DELAY_S = 3.0
"""Seconds between the replacement's launch and the at-risk instance's move to Terminated."""
MAX_CRASH_KILLS = 50
KILL_TRAINER_WAIT_S = 60.0
"""``kill-trainer``: how long it waits for a trainer worker to run on the instance."""
SAVE_WATCH_S = 120.0
"""kill-in-save: how long to wait for a checkpoint write to start before giving up."""
SAVE_POLL_S = 0.025
"""kill-in-save: how often the staging folder is looked at (a tiny model's write is short)."""


def _pid_in(pids: set[int], proc: psutil.Process) -> bool:
    return proc.pid in pids


def partial_steps(staging: Path) -> list[int]:
    """Steps whose write is in progress in ``staging`` (``step-N.partial`` folders), sorted."""
    try:
        entries = list(staging.iterdir())
    except OSError:  # Not made yet (no save so far), or removed with its instance.
        return []
    names = [p.name for p in entries if p.name.endswith(PARTIAL_SUFFIX) and p.is_dir()]
    steps = (step_of(name.removesuffix(PARTIAL_SUFFIX)) for name in names)
    return sorted(n for n in steps if n is not None)


@dataclass(frozen=True)
class SaveWatch:
    """How a watch for a checkpoint write ended."""

    cut_step: int | None
    """The step being written when ``on_write`` ran (None: it never ran)."""
    reason: str
    waited_s: float


def watch_save(
    staging: Path,
    on_write: Callable[[int], None],
    *,
    timeout_s: float = SAVE_WATCH_S,
    poll_s: float = SAVE_POLL_S,
    stop_reason: Callable[[], str | None] = lambda: None,
) -> SaveWatch:
    """Look at ``staging`` every ``poll_s`` until a ``step-N.partial`` folder is there, then
    call ``on_write(N)`` (the newest N if several) at once. Gives up after ``timeout_s``, or
    when ``stop_reason()`` returns a reason (the instance is gone, the rehearsal stops)."""
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        steps = partial_steps(staging)
        if steps:
            on_write(steps[-1])
            return SaveWatch(
                steps[-1], f"{partial_name(steps[-1])} in {staging}", time.monotonic() - started
            )
        why = stop_reason()
        if why is not None:
            return SaveWatch(None, why, time.monotonic() - started)
        if time.monotonic() >= deadline:
            return SaveWatch(
                None,
                f"no checkpoint write started in {staging} within {timeout_s:g}s",
                time.monotonic() - started,
            )
        time.sleep(poll_s)


@dataclass
class FaultRecord:
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
    cut_step: int | None = None
    """kill-in-save: the step whose checkpoint write was cut (its ``step-N.partial``)."""
    newest_complete_at_kill: int | None = None
    """kill-in-save: the newest step with a ``COMPLETE`` marker in S3 right after the kill."""
    partial_at_kill: bool | None = None
    """kill-in-save: ``step-N.partial`` was still there once the tree was dead (the kill landed
    inside the write, not after it was renamed into place)."""
    watch_started_t: float | None = None
    """kill-in-save: when the watch began (``fired_t``, ``fired_wall`` and ``step_at_fire`` are
    the kill's)."""
    instances: list[str] = field(default_factory=list)
    """Launch faults: every instance the fault was applied to, in launch order."""

    def to_json(self) -> dict[str, Any]:
        keys = ["state", "instance", "fired_t", "fired_wall", "step_at_fire", "terminated_t"]
        keys += ["kills", "detail"]
        if self.fault.at_launch:
            keys.append("instances")
        if self.fault.kind is FaultKind.KILL_IN_SAVE:
            keys += ["cut_step", "newest_complete_at_kill", "partial_at_kill", "watch_started_t"]
        return {
            "fault": self.fault.describe(),
            "kind": self.fault.kind.value,
            **{k: copy.copy(getattr(self, k)) for k in keys},
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
        save_watch_s: float = SAVE_WATCH_S,
        save_poll_s: float = SAVE_POLL_S,
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
        self.save_watch_s = save_watch_s
        self.save_poll_s = save_poll_s
        self._stopped = threading.Event()
        self._helpers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._held: set[str] = set()
        """Auto Scaling groups whose launches a ``capacity-gone`` holds."""

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        while not self._stopped.is_set():
            step = self.steps.current_step()
            elapsed = self.events.elapsed()
            for rec in self.records:
                if (
                    rec.state == "pending"
                    and not rec.fault.at_launch  # the simulator applies them (``on_launch``)
                    and rec.fault.trigger.due(step, elapsed)
                ):
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

    def on_launch(self, group: str, index: int, instance_id: str) -> FaultKind | None:
        """The launch fault for the ``index``-th instance of ``group`` (None: it launches
        normally), recorded as applied; the simulator calls it for every instance it starts."""
        with self._lock:
            for rec in self.records:
                if rec.fault.at_launch and rec.fault.matches(group, index):
                    rec.state = "done"
                    rec.instance = rec.instance or instance_id
                    rec.instances.append(instance_id)
                    rec.kills += 1
                    if rec.fired_t is None:
                        rec.fired_t, rec.fired_wall = self.events.elapsed(), time.time()
                    rec.step_at_fire = self.steps.current_step()
                    self.events.add(
                        "fault", f"{rec.fault.describe()}: {group}:{index}", instance=instance_id
                    )
                    return rec.fault.kind
        return None

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
        self.release_capacity()

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
            FaultKind.KILL_IN_SAVE: self._kill_in_save,
            FaultKind.CRASH: self._crash,
            FaultKind.KILL_TRAINER: self._kill_trainer,
            FaultKind.CAPACITY_GONE: self._capacity_gone,
            FaultKind.KILL_DATA_SERVER: self._kill_data_server,
            FaultKind.KILL_LAUNCHER: self._kill_launcher,
            FaultKind.HANG: self._hang,
            FaultKind.HANG_TRAINER: self._hang_trainer,
            FaultKind.HANG_DATA_SERVER: self._hang_data_server,
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

    def _say(self, rec: FaultRecord, run: InstanceRun | None, text: str, **data: Any) -> None:
        """A ``fault`` event: the fault, then ``text``."""
        instance = run.instance_id if run is not None else None
        self.events.add("fault", f"{rec.fault.describe()}: {text}", instance=instance, **data)

    def _wait(self, seconds: float) -> bool:
        """Sleep ``seconds``; False when the rehearsal is stopping."""
        return not self._stopped.wait(max(0.0, seconds))

    def _terminate(self, rec: FaultRecord, run: InstanceRun, *, in_group: bool = False) -> None:
        if run.terminated:
            rec.detail = "the instance was already terminated (a scale-in, or the job's end)"
            return
        if in_group:
            self.aws.terminate_in_group(run.instance_id, decrement=True)
            how = "TerminateInstanceInAutoScalingGroup (decrement)"
        else:
            self.aws.terminate_instance(run.instance_id)
            how = "TerminateInstances"
        rec.terminated_t = self.events.elapsed()
        self._say(rec, run, how)

    def _interrupt(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None
        body = run.imds.set_spot_interruption(time.time() + self.notice_s)
        self._say(rec, run, f"Spot interruption notice {body} at step {rec.step_at_fire}")
        if self._wait(self.notice_s):
            self._terminate(rec, run)

    def _rebalance(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None and rec.fault.group is not None
        body = run.imds.set_rebalance_recommendation()
        asg = self.names.asg_names[rec.fault.group]
        desired = self.aws.desired_capacities(self.names).get(asg, 0)
        self._say(rec, run, f"rebalance recommendation {body} at step {rec.step_at_fire}")
        if desired == 0:
            rec.detail = "the group was already at 0"
            return
        # Capacity Rebalancing launches the replacement first, briefly above the group's
        # maximum (the stack's MaxSize is the count); the maximum is back once the at-risk
        # instance is gone.
        max_size = self.aws.max_size(asg)
        self.aws.set_max_size(asg, max(max_size, desired + 1))
        self.aws.set_desired_capacity(asg, desired + 1)
        self.events.add("fault", f"Capacity Rebalancing: {asg} desired {desired} -> {desired + 1}")
        try:
            self._rebalance_terminate(rec, run)
        finally:
            self.aws.set_max_size(asg, max_size)

    def _rebalance_terminate(self, rec: FaultRecord, run: InstanceRun) -> None:
        """The at-risk instance's end: the target lifecycle state, then its termination."""
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
        self._say(rec, run, f"SIGKILL {len(pids)} process(es) at step {rec.step_at_fire}")
        self._terminate(rec, run)

    def _capacity_gone(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None and rec.fault.group is not None
        asg = self.names.asg_names[rec.fault.group]
        with self._lock:
            self._held.add(asg)
        self.aws.hold_launches(asg)
        self._say(rec, run, f"{asg} finds no capacity from now until the job ends")
        self._kill(rec, run)

    def release_capacity(self) -> None:
        """Capacity is back for every group a ``capacity-gone`` held (the job ended): each
        launches what its desired capacity misses (none when the job's end set it to 0)."""
        with self._lock:
            held, self._held = sorted(self._held), set()
        for asg in held:
            self.aws.release_launches(asg)
            refused = self.aws.launches_refused.get(asg, 0)
            self.events.add(
                "capacity-back", f"{asg} finds capacity again ({refused} launch(es) refused)",
                asg=asg, refused=refused,
            )  # fmt: skip

    def _kill_launcher(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None
        pids = self.simulator.kill_tree(run)
        self._say(rec, run, f"SIGKILL {len(pids)} process(es) at step {rec.step_at_fire}; the "
                  "instance runs on")  # fmt: skip

    def _hang(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None
        self.simulator.freeze_tree(run)
        self._say(rec, run, f"SIGSTOP every process at step {rec.step_at_fire}; the instance runs "
                  "on, frozen")  # fmt: skip

    def _hang_trainer(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        """SIGSTOP the instance's trainer workers once (waiting, bounded, for one to run)."""
        assert run is not None
        deadline = time.monotonic() + KILL_TRAINER_WAIT_S
        while True:
            pids = self.simulator.freeze_matching(run, is_trainer_worker)
            if pids or run.terminated or time.monotonic() > deadline or not self._wait(0.1):
                break
        self._say(rec, run, f"SIGSTOP trainer worker(s) {pids} at step {rec.step_at_fire}; its "
                  "launcher runs on")  # fmt: skip

    def _hang_data_server(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None
        pids = self.simulator.freeze_matching(run, is_data_server)
        self._say(rec, run, f"SIGSTOP data server {pids} at step {rec.step_at_fire}; its launcher "
                  "runs on")  # fmt: skip

    def _kill_in_save(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None
        if run.tmpdir is None:
            raise RuntimeError(f"{run.instance_id} has no TMPDIR of its own to watch")
        staging = Path(checkpoint_staging_dir(run.tmpdir))
        rec.watch_started_t = rec.fired_t
        self._say(
            rec,
            run,
            f"watching {staging} for a checkpoint write from step {rec.step_at_fire} "
            f"(at most {self.save_watch_s:g}s)",
        )
        killed: list[int] = []

        def kill(step: int) -> None:
            self.simulator.freeze_tree(run)  # at once, so the kill lands inside the write
            killed.extend(self.simulator.kill_tree(run))
            rec.fired_t, rec.fired_wall = self.events.elapsed(), time.time()
            rec.step_at_fire = self.steps.current_step()
            # Before TerminateInstances: the simulator removes the TMPDIR with the instance.
            rec.partial_at_kill = (staging / partial_name(step)).is_dir()

        def stop_reason() -> str | None:
            if self._stopped.is_set():
                return "the rehearsal stopped first"
            if run.terminated:
                return "the instance was terminated first"
            return None

        watch = watch_save(
            staging,
            kill,
            timeout_s=self.save_watch_s,
            poll_s=self.save_poll_s,
            stop_reason=stop_reason,
        )
        if watch.cut_step is None:
            with self._lock:
                rec.state = "skipped"
            rec.detail = f"not fired: {watch.reason}"
            self.events.add(
                "fault-skipped", f"{rec.fault.describe()}: {rec.detail}", instance=run.instance_id
            )
            return
        rec.cut_step = watch.cut_step
        store = S3CheckpointStore(self.names.checkpoint_uri, client=self.aws.client("s3"))
        rec.newest_complete_at_kill = store.latest_complete()
        where = (
            f"inside the write of step {rec.cut_step}"
            if rec.partial_at_kill
            else f"just after the write of step {rec.cut_step} (renamed into place by then)"
        )
        rec.detail = (
            f"killed {where}; newest complete checkpoint in S3: {rec.newest_complete_at_kill}"
        )
        self._say(
            rec,
            run,
            f"SIGKILL {len(killed)} process(es) {watch.waited_s:.1f}s into the watch, "
            f"{where}; newest complete checkpoint in S3: step {rec.newest_complete_at_kill}",
            cut_step=rec.cut_step,
            newest_complete_at_kill=rec.newest_complete_at_kill,
            partial_at_kill=rec.partial_at_kill,
        )
        self._terminate(rec, run)

    def _kill_data_server(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None
        pids = self.simulator.kill_matching(run, is_data_server)
        self._say(rec, run, f"SIGKILL data server tree {pids} at step {rec.step_at_fire}")
        self._terminate(rec, run)

    def _kill_trainer(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        """SIGKILL the instance's trainer workers once (waiting, bounded, for one to run)."""
        assert run is not None
        deadline = time.monotonic() + KILL_TRAINER_WAIT_S
        while True:
            pids = self.simulator.kill_matching(run, is_trainer_worker)
            if pids or run.terminated or time.monotonic() > deadline or not self._wait(0.1):
                break
        rec.kills = len(pids)
        self._say(rec, run, f"SIGKILL trainer worker(s) {pids} at step {rec.step_at_fire}")

    def _crash(self, rec: FaultRecord, run: InstanceRun | None) -> None:
        assert run is not None
        self._say(
            rec, run, f"the trainer on this instance crashes from now on (step {rec.step_at_fire})"
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
        self._say(
            rec, run, f"S3 unreachable for {rec.fault.duration_s:g}s from step {rec.step_at_fire}"
        )
        try:
            self._wait(rec.fault.duration_s)
        finally:
            self.proxy.set_reachable(True)
            self.events.add("fault", "S3 reachable again")
