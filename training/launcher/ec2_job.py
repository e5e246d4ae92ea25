"""The launcher's loop on an EC2 instance: run this host's role in generations until the job is
over, so that interruptions, replacements and crashes need nobody to log in.

Each pass:

1. If the job record says the job is over, stop (a replacement that arrives after the end, or a
   host whose peer ended the job, runs nothing).
2. Trainer hosts agree on a membership (``membership.py``): the first ``count`` usable trainer
   instances; a host outside it waits on standby. Data servers need no membership.
3. Run the role under supervision while the Spot watch runs (``spot.py``). An interruption
   notice or an Auto Scaling termination marks this host as leaving in the job record at once,
   then stops the role (the trainer checkpoints at the next step boundary, durably in S3, and
   exits "stopped"); a rebalance recommendation sends SIGUSR1, a checkpoint without a stop.
4. Act on how it ended (``training.outcome``):

   - this host was told to go: complete the lifecycle action (Auto Scaling termination) and
     exit ``EXIT_STOPPED``; the others carry on without it;
   - finished: end the job (``job_end.end_job``: outcome recorded, every group scaled to zero);
     any host that sees the finish does it, so the job ends even if the first host is gone;
   - stopped because a peer stopped, or failed while the membership changed (a peer vanished):
     start the next generation at once; this costs no restart;
   - failed otherwise (a crash, peers that never came): count it against the restart budget
     and retry after an exponential backoff; beyond the budget, end the job as failed.

5. After a host ended the job (its group, like every group, scaled to zero), and with a
   termination hook (``HETERO_LIFECYCLE_HOOK``, the trainer group): wait, bounded, until Auto
   Scaling holds this instance in Terminating:Wait and complete the lifecycle action, so it
   does not bill until the hook's heartbeat timeout (``job_end.complete_own_termination``).

With a job pointer (``jobparam.JobWatch``: the launcher was started with
``HETERO_JOB_PARAMETER``), every pass first reads the pointer again, and a thread reads it every
``job_poll_s`` while the role runs or waits for peers. When another job was started
(``hetero job start --force`` while this host still ran), the role is stopped (SIGTERM: the
trainer checkpoints and exits "stopped"), the old job is neither ended nor scaled to zero (that
would stop the new one), and ``run`` returns ``EXIT_NEW_JOB``: the launcher then starts again
on the new job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from training.launcher import job_end, roles
from training.launcher.boot_watch import BootWatch
from training.launcher.budget import ENV_DEADLINE, Budget, job_started, parse_started
from training.launcher.early_exit import REPLACEMENT_BUDGET
from training.launcher.group import GroupIdentity
from training.launcher.imds import ImdsClient
from training.launcher.jobparam import JobPointer, JobWatch
from training.launcher.jobrecord import JobRecord
from training.launcher.membership import (
    Membership,
    MembershipTimeout,
    current_membership,
    wait_for_membership,
)
from training.launcher.names import ENV_CHECKPOINT_URI, ENV_LIFECYCLE_HOOK
from training.launcher.peers import Peers
from training.launcher.spot import (
    ASG_TERMINATION,
    TARGET_LIFECYCLE_PATH,
    SpotNotice,
    SpotWatcher,
)
from training.launcher.supervisor import Supervisor, exit_code_for_signal
from training.launcher.trainer_watch import NO_TRAINER_TIMEOUT_S, NoTrainerWatch
from training.outcome import (
    EXIT_FAILED,
    EXIT_FINISHED,
    EXIT_STOPPED,
    Outcome,
    clear_outcomes,
    read_host_outcome,
)
from training.spec import ClusterSpec, Role

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 60
"""How long trainer hosts wait for each other in torchrun's rendezvous."""
MAX_BACKOFF_S = 120.0
EXIT_NEW_JOB = 76
"""``Ec2Job.run``: another job was started; this host left the old one (never a process's exit
code unless re-executing the launcher failed: then Docker's restart policy starts it again)."""


@dataclass(frozen=True)
class LoopSettings:
    restart_budget: int = 3
    """Failed generations this host may retry before it ends the job as failed."""
    restart_backoff_s: float = 10.0
    """Wait before the first retry; doubled for each further failure (at most 120 s)."""
    peer_timeout_s: float = 900.0
    """How long to wait for the trainer group to reach its count (counts as one failure)."""
    poll_s: float = 5.0
    """Between membership and job-record checks."""
    spot_poll_s: float = 5.0
    grace_s: float = 90.0
    imds_url: str = ""
    imds_timeout_s: float = 1.0
    heartbeat_s: float = 30.0
    """How often a running host puts its state and last metrics into the job record (and looks
    at what the watches look at: failed boots, trainers that are gone)."""
    no_trainer_timeout_s: float = NO_TRAINER_TIMEOUT_S
    """A data server ends the job as failed when no trainer host has written to the job record
    for this long (``trainer_watch``; checked at each heartbeat)."""
    replacement_budget: int = REPLACEMENT_BUDGET
    """Instances per job taken out of service before their job loop (a launcher that could not
    start it, a boot that gave up); one more ends the job failed (``early_exit``,
    ``boot_watch``)."""
    subreaper: bool = True
    """Adopt the role's orphaned descendants (Linux), so none outlives the launcher."""
    job_poll_s: float = 30.0
    """Between reads of the job pointer while the role runs or waits (with a ``JobWatch``)."""
    lifecycle_wait_s: float = 120.0
    """After this host ended the job (groups at zero): how long it waits for its own instance to
    reach Terminating:Wait, to complete the termination hook (``job_end.complete_own_termination``;
    polled every ``spot_poll_s``). The hook's heartbeat timeout (300 s) ends any wait left."""


@dataclass
class GenerationResult:
    outcome: Outcome
    reason: str


@dataclass
class _Signals:
    """What arrived from outside while the loop runs: a notice (watch thread) or a signal."""

    notice: SpotNotice | None = None
    signum: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    supervisor: Supervisor | None = None
    checkpoint_requests: int = 0
    superseded: JobPointer | None = None
    """The newer job's pointer, once one was started (``hetero job start``)."""

    @property
    def leaving(self) -> bool:
        return self.notice is not None or self.signum is not None


class Ec2Job:
    """One EC2 host's part of the job (see the module docstring)."""

    def __init__(
        self,
        spec: ClusterSpec,
        *,
        identity: GroupIdentity,
        settings: LoopSettings,
        plan_for: Callable[[Peers, int, str], Any],
        environ: Mapping[str, str],
        run_dir: Path,
        ec2: Any,
        autoscaling: Any,
        record: JobRecord | None,
        asg_names: list[str],
        job_watch: JobWatch | None = None,
    ) -> None:
        self.spec = spec
        self.identity = identity
        self.instance_id = identity.instance_id or "unknown"
        self.group = spec.group(identity.group)
        self.settings = settings
        self.plan_for = plan_for
        """(peers, rendezvous port, outcome dir) -> a ``LaunchPlan`` for one generation."""
        self.environ = environ
        self.run_dir = run_dir
        self.ec2 = ec2
        self.autoscaling = autoscaling
        self.record = record
        self.asg_names = asg_names
        self.job_watch = job_watch
        """Reads the job pointer (None: no pointer, the job never changes under this host)."""
        self.hook = environ.get(ENV_LIFECYCLE_HOOK, "").strip()
        self.signals = _Signals()
        trainer_groups = [g.name for g in spec.groups if g.role is Role.TRAINER]
        self.trainer_watch = (
            NoTrainerWatch(record, trainer_groups, timeout_s=settings.no_trainer_timeout_s)
            if record is not None and self.group.role is not Role.TRAINER and trainer_groups
            else None
        )
        self.boot_watch = (
            BootWatch(
                ec2,
                identity.cluster or spec.name,
                record,
                budget=settings.replacement_budget,
                job_started=self._job_start,
            )
            if record is not None
            else None
        )
        self.watch_ended: str | None = None
        """Why a watch of this host ended the job (no live trainer host, failed boots past the
        budget), once one did."""
        self.failures = 0
        self.generation = 0
        self.ended_job = False
        """True once this host ended the job (outcome recorded, every group scaled to zero)."""
        self.budget = Budget.of(spec, job_watch.pointer if job_watch else None)
        self._started: float | None = None
        """The job's start (epoch seconds) for its budget, once known."""

    # -- outside events ----------------------------------------------------------------------

    def _on_notice(self, notice: SpotNotice) -> None:
        with self.signals.lock:
            if self.signals.notice is None:
                self.signals.notice = notice
            sup = self.signals.supervisor
        # Say so first: the other hosts re-form without this one while it checkpoints.
        self._mark_leaving(notice.describe())
        if sup is not None:
            sup.request_stop(signal.SIGTERM, notice.describe())

    def _on_rebalance(self, notice: SpotNotice) -> None:
        if self.group.role is not Role.TRAINER:
            return  # A data server has nothing to save.
        with self.signals.lock:
            self.signals.checkpoint_requests += 1
        self._set_host(state="rebalance-checkpoint", notice=notice.describe())
        self._deliver_checkpoint_request()

    def _deliver_checkpoint_request(self) -> bool:
        """SIGUSR1 to every rank once all of them handle it (before its handler is installed,
        SIGUSR1 would kill a rank); False while it is still pending."""
        with self.signals.lock:
            sup = self.signals.supervisor
            if not self.signals.checkpoint_requests or sup is None:
                return False
            ranks = [r for c in sup.live() for r in _children(c.pid)]
            if not ranks or not all(_catches(r, signal.SIGUSR1) for r in ranks):
                return False
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)  # checkpoint at the next step, go on
            self.signals.checkpoint_requests = 0
        log.info("asked %d rank(s) for a checkpoint", len(ranks))
        return True

    def _deliver_pending(self, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            if self.signals.checkpoint_requests:
                self._deliver_checkpoint_request()

    def _new_job_started(self) -> bool:
        """Read the job pointer now; True once it names another job than this host's."""
        if self.job_watch is None:
            return False
        if self.signals.superseded is None:
            newer = self.job_watch.newer()
            if newer is not None:
                with self.signals.lock:
                    self.signals.superseded = newer
        return self.signals.superseded is not None

    def _watch_job(self, done: threading.Event) -> None:
        """While the loop runs: stop the role as soon as another job was started."""
        while not done.wait(self.settings.job_poll_s):
            if self._new_job_started():
                with self.signals.lock:
                    sup = self.signals.supervisor
                if sup is not None:
                    sup.request_stop(signal.SIGTERM, self._superseded_reason())
                return

    def _superseded_reason(self) -> str:
        new = self.signals.superseded
        old = self.job_watch.pointer.job_id if self.job_watch else "?"
        return f"job {old} was superseded by job {new.job_id if new else '?'}"

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        with self.signals.lock:
            if self.signals.signum is None:
                self.signals.signum = signum
            sup = self.signals.supervisor
        if sup is not None:
            sup.request_stop(signum, f"received {signal.Signals(signum).name}")

    def _mark_leaving(self, reason: str) -> None:
        if self.record is None:
            return
        try:
            self.record.mark_leaving(self.instance_id, reason)
        except Exception as e:  # The others still see the instance go from EC2.
            log.error("could not mark this host as leaving in the job record: %s", e)

    def _set_host(self, **state: Any) -> None:
        if self.record is None:
            return
        try:
            self.record.set_host(
                self.instance_id,
                group=self.group.name,
                address=self.identity.host,
                generation=self.generation,
                failures=self.failures,
                **state,
            )
        except Exception as e:  # Status only: never fatal.
            log.warning("could not update the job record: %s", e)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        imds = ImdsClient(self.settings.imds_url, timeout_s=self.settings.imds_timeout_s)
        watcher = SpotWatcher(
            imds,
            self._on_notice,
            on_rebalance=self._on_rebalance,
            interval_s=self.settings.spot_poll_s,
        )
        watcher.start()
        done = threading.Event()
        deliverer = threading.Thread(
            target=self._deliver_pending, args=(done,), name="checkpoint-requests", daemon=True
        )
        deliverer.start()
        if self.job_watch is not None:
            threading.Thread(
                target=self._watch_job, args=(done,), name="job-watch", daemon=True
            ).start()
        try:
            code = self._loop()
            done.set()
            watcher.stop()  # From here a Terminated target state is this job end's own.
            if self.ended_job and self.hook:
                self._complete_own_termination(imds)
            return code
        finally:
            done.set()
            watcher.stop()
            for s, h in previous.items():
                signal.signal(s, h)

    def _job_over(self) -> dict[str, Any] | None:
        if self.record is None:
            return None
        try:
            return self.record.outcome()
        except Exception as e:
            log.warning("could not read the job record: %s", e)
            return None

    def _loop(self) -> int:
        while True:
            if self._new_job_started():  # Every generation boundary reads the pointer.
                return self._next_job()
            ended = self._job_over()
            if ended is not None:
                log.info("the job is over (%s: %s)", ended.get("outcome"), ended.get("reason"))
                try:
                    over = Outcome(str(ended.get("outcome")))
                except ValueError:
                    over = Outcome.FAILED
                # This instance may have started after the end (a deploy that set the groups to
                # their counts again without a new job): end it again so nothing keeps billing.
                # Harmless when the job just ended: the first outcome stays, and scaling to
                # zero twice changes nothing.
                self._end(over, f"the job was already over ({ended.get('reason')})")
                return over.exit_code
            if self.signals.leaving:
                return self._leave()
            membership: Membership | None = None
            if self.group.role is Role.TRAINER:
                try:
                    membership = self._wait_for_membership()
                except MembershipTimeout as e:
                    code = self._failed(str(e))
                    if code is not None:
                        return code
                    continue
                if membership is None:  # Stopped, the job ended or a new one began while waiting.
                    continue
            trainer = self.group.role is Role.TRAINER
            if trainer and self._budget_spent():
                return self._end_for_budget()
            self.generation += 1
            result = self._run_generation(membership)
            if self.watch_ended is not None:
                return EXIT_FAILED
            if self.signals.leaving:
                if (
                    result.outcome is Outcome.FINISHED
                    and trainer
                    and self._end(Outcome.FINISHED, "training finished")
                ):
                    return EXIT_FINISHED
                return self._leave()
            if result.outcome is Outcome.FINISHED:
                if trainer and not self._end(Outcome.FINISHED, "training finished"):
                    return self._next_job()
                # A data server ends after the trainer's Shutdown RPC; the trainers end the job.
                return EXIT_FINISHED
            if result.outcome is Outcome.STOPPED:
                if trainer and self._budget_spent():  # the trainer's --max-seconds: the budget
                    return self._end_for_budget()
                log.info("generation %d stopped (a peer is leaving): re-forming", self.generation)
                continue
            if membership is not None and self._membership_changed(membership):
                log.warning(
                    "generation %d failed and a member is gone: re-forming (no restart used)",
                    self.generation,
                )
                continue
            code = self._failed(result.reason)
            if code is not None:
                return code

    def _wait_for_membership(self) -> Membership | None:
        count = self.group.count
        self._set_host(state="waiting-for-peers")
        return wait_for_membership(
            self.current_membership,
            count=count,
            own_instance_id=self.instance_id,
            timeout_s=self.settings.peer_timeout_s,
            poll_s=self.settings.poll_s,
            should_stop=lambda: (
                self.signals.leaving
                or self.signals.superseded is not None
                or self._job_over() is not None
            ),
        )

    def _leaving(self) -> set[str]:
        if self.record is None:
            return set()
        try:
            return self.record.leaving()
        except Exception as e:  # S3 unreachable: EC2's own view still applies.
            log.warning("could not read the leaving hosts from the job record: %s", e)
            return set()

    def current_membership(self) -> Membership:
        return current_membership(
            self.ec2,
            self.autoscaling,
            cluster=self.identity.cluster or self.spec.name,
            group=self.group.name,
            count=self.group.count,
            leaving=self._leaving,
        )

    def _membership_changed(self, membership: Membership) -> bool:
        try:
            return self.current_membership().members != membership.members
        except Exception as e:
            log.warning("could not list the trainer group again: %s", e)
            return False

    @property
    def outcome_dir(self) -> Path:
        return self.run_dir / "outcome"

    def plan(self, membership: Membership | None) -> Any:
        """The role's plan for a generation over ``membership`` (None: a data server, which
        needs no peers): this host's node rank, the members' rendezvous host and port."""
        if membership is None:
            host = (self.identity.host or "",)
            return self.plan_for(
                Peers({self.group.name: host}, (), 0), roles.RENDEZVOUS_PORT, str(self.outcome_dir)
            )
        index = membership.index(self.instance_id)
        if index is None:
            raise ValueError(f"instance {self.instance_id} is not a member of {membership.ids}")
        found = Peers({self.group.name: membership.addresses}, (), index)
        return self.plan_for(found, membership.rendezvous_port, str(self.outcome_dir))

    def _run_generation(self, membership: Membership | None) -> GenerationResult:
        outcome_dir = self.outcome_dir
        clear_outcomes(outcome_dir)
        plan = self.plan(membership)
        if membership is not None:
            log.info(
                "generation %d: node %d of %d, rendezvous %s:%d",
                self.generation, plan.peers.self_index, len(membership.members),
                membership.addresses[0], membership.rendezvous_port,
            )  # fmt: skip
        members = list(membership.ids) if membership else None
        self._set_host(state="running", members=members)
        beat = threading.Event()
        heartbeat = threading.Thread(
            target=self._heartbeat, args=(beat, members), name="heartbeat", daemon=True
        )
        heartbeat.start()
        with Supervisor(grace_s=self.settings.grace_s, subreaper=self.settings.subreaper) as sup:
            with self.signals.lock:
                self.signals.supervisor = sup
            try:
                budget_env = self._budget_env() if plan.role is Role.TRAINER else {}
                for name, cmd in plan.commands:
                    sup.start(
                        name,
                        cmd.argv,
                        env={**self.environ, **cmd.env, **budget_env},
                        stop_workers=plan.role is Role.TRAINER,
                    )
                if self.signals.leaving:  # A notice between the check and the start.
                    sup.request_stop(signal.SIGTERM, "leaving")
                elif self.signals.superseded is not None:  # Likewise, a new job.
                    sup.request_stop(signal.SIGTERM, self._superseded_reason())
                codes = sup.run_until_done()
            finally:
                beat.set()
                with self.signals.lock:
                    self.signals.supervisor = None
        for (name, _), code in zip(plan.commands, codes, strict=True):
            log.info("generation %d: %s exited with code %d", self.generation, name, code)
        if plan.role is Role.TRAINER:
            outcome, ranks = read_host_outcome(outcome_dir, self.group.ranks_per_instance)
            reasons = sorted({r.reason for r in ranks}) or [f"exit codes {codes}"]
            reason = ", ".join(reasons)
        else:
            # A data server exits 0 after the Shutdown RPC (the job finished) or a stop.
            if any(c != 0 for c in codes):
                outcome = Outcome.FAILED
            elif self.signals.leaving or self.signals.superseded is not None:
                outcome = Outcome.STOPPED
            else:
                outcome = Outcome.FINISHED
            reason = f"exit codes {codes}"
        self._set_host(state=f"generation-{outcome.value}", reason=reason)
        return GenerationResult(outcome, reason)

    def _heartbeat(self, done: threading.Event, members: list[str] | None) -> None:
        """While the role runs: this host's state and the trainer's last metrics line."""
        while not done.wait(self.settings.heartbeat_s):
            self._set_host(state="running", members=members, metrics=_last_metrics(self.run_dir))
            if self._watches_end_job():
                return

    def _watches_end_job(self) -> bool:
        """Failed boots past the replacement budget (``boot_watch``, every host) or, on a data
        server, no live trainer host for the bounded time (``trainer_watch``) end the job as
        failed, every group to zero, and stop this host's role."""
        if self.watch_ended is not None:
            return False
        reason = self.boot_watch.check() if self.boot_watch is not None else None
        if reason is None and self.trainer_watch is not None:
            reason = self.trainer_watch.check()
        if reason is None:
            return False
        log.error("%s: ending the job", reason)
        if not self._end(Outcome.FAILED, reason):
            return False  # another job began: its own watches start over
        self.watch_ended = reason
        with self.signals.lock:
            sup = self.signals.supervisor
        if sup is not None:
            sup.request_stop(signal.SIGTERM, reason)
        return True

    # -- budget ------------------------------------------------------------------------------

    def _job_start(self) -> float | None:
        """When the job started (``budget.job_started``: the pointer's time, else the record's,
        written by the first host to ask), once known; None while it cannot be read (logged)."""
        if self._started is None:
            pointer_started = self.job_watch.pointer.started if self.job_watch else None
            try:
                if self.record is None:
                    self._started = parse_started(pointer_started)
                else:
                    self._started = job_started(self.record, pointer_started)
            except Exception as e:  # S3 unreachable: try again next time.
                log.warning("could not read the job's start: %s", e)
                return None
        return self._started

    def _budget_elapsed(self) -> float | None:
        """Seconds since the job started; None without a cap, or when the start cannot be known
        (no job record and no pointer time: logged, no cap applies)."""
        if not self.budget.capped:
            return None
        started = self._job_start()
        if started is None:
            log.warning("the job's start is unknown (no job record): its budget is not kept")
            return None
        return time.time() - started

    def _budget_spent(self) -> bool:
        elapsed = self._budget_elapsed()
        return elapsed is not None and self.budget.reached(elapsed)

    def _budget_env(self) -> dict[str, str]:
        """When the budget runs out (epoch seconds), for the trainer: its ``--max-seconds``
        defaults to what is left of it when it parses its arguments (torchrun's start counts)."""
        elapsed = self._budget_elapsed()
        if elapsed is None or self._started is None:
            return {}
        deadline = self.budget.deadline(self._started)
        if deadline is None:
            return {}
        log.info(
            "budget: %s; the trainer may run until %.0f s from now",
            self.budget.describe(elapsed),
            deadline - time.time(),
        )
        return {ENV_DEADLINE: f"{deadline:.3f}"}

    def _end_for_budget(self) -> int:
        """The budget is spent (the trainer checkpointed when it stopped): end the job as
        ``stopped`` with the reason, every group to 0; ``hetero job start --resume`` goes on."""
        elapsed = self._budget_elapsed() or 0.0
        reason = self.budget.reason(elapsed)
        log.warning("%s: ending the job", reason)
        if not self._end(Outcome.STOPPED, reason):
            return self._next_job()
        return EXIT_STOPPED

    # -- endings -----------------------------------------------------------------------------

    def _failed(self, reason: str) -> int | None:
        """Count a failure; the exit code when the budget is spent (the job is then ended),
        else None after the backoff."""
        self.failures += 1
        budget = self.settings.restart_budget
        if self.failures > budget:
            msg = f"failed {self.failures} times (restart budget {budget}); last: {reason}"
            log.error("%s: ending the job", msg)
            if not self._end(Outcome.FAILED, msg):
                return self._next_job()
            return EXIT_FAILED
        wait = min(self.settings.restart_backoff_s * 2 ** (self.failures - 1), MAX_BACKOFF_S)
        log.warning(
            "failure %d of %d allowed (%s): retrying in %.0fs", self.failures, budget, reason, wait
        )
        self._set_host(state="backoff", reason=reason)
        deadline = time.monotonic() + wait
        while (
            time.monotonic() < deadline
            and not self.signals.leaving
            and self.signals.superseded is None
        ):
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return None

    def _end(self, outcome: Outcome, reason: str) -> bool:
        """End the job for everyone; False, doing nothing, when another job was started since:
        the old job's end would land in the record beside the new job's checkpoints (a resumed
        job shares them) and scale the new job's groups to zero."""
        if self._new_job_started():
            log.warning("%s: not ending it (%s)", self._superseded_reason(), reason)
            return False
        try:
            job_end.end_job(
                self.record,
                outcome,
                reason=reason,
                by=self.instance_id,
                autoscaling=self.autoscaling,
                asg_names=self.asg_names,
            )
        except Exception as e:
            log.error("could not end the job: %s", e)
        else:
            self.ended_job = bool(self.asg_names)  # without groups nothing was scaled to zero
        self._set_host(state=f"job-{outcome.value}", reason=reason)
        return True

    def _complete_own_termination(self, imds: ImdsClient) -> None:
        """The groups are at zero: complete the termination hook for this instance once Auto
        Scaling holds it in Terminating:Wait, so it stops billing now rather than at the hook's
        heartbeat timeout (the launcher exits next: nobody else would). Never changes the exit
        code; a signal (e.g. ``docker stop``) ends the wait."""
        job_end.complete_own_termination(
            self.autoscaling,
            self.instance_id,
            self.hook,
            target_state=lambda: imds.get(TARGET_LIFECYCLE_PATH),
            timeout_s=self.settings.lifecycle_wait_s,
            poll_s=self.settings.spot_poll_s,
            should_stop=lambda: self.signals.signum is not None,
        )

    def _next_job(self) -> int:
        """Leave the old job (its role is stopped by now) for the new one."""
        log.info("%s: leaving it for the new job", self._superseded_reason())
        return EXIT_NEW_JOB

    def _leave(self) -> int:
        notice = self.signals.notice
        if notice is not None:
            if notice.kind == ASG_TERMINATION and self.hook:
                job_end.complete_lifecycle_action(self.autoscaling, self.instance_id, self.hook)
            self._set_host(state="left", reason=notice.describe())
            log.info("leaving the job: %s", notice.describe())
            return EXIT_STOPPED
        signum = self.signals.signum or signal.SIGTERM
        self._set_host(state="left", reason=signal.Signals(signum).name)
        return exit_code_for_signal(signum)


LAST_EVAL_FILE = "last_eval.json"
"""``training.trainer.metrics.LAST_EVAL_FILE`` (the launcher does not import the trainer)."""


def _last_metrics(run_dir: Path) -> dict[str, Any] | None:
    """The trainer's last interval record in ``metrics.jsonl`` (rank 0's host only) with, under
    ``"eval"``, its last validation record (``last_eval.json``: top-1, top-5, loss, the EMA's,
    ``targets_reached``), or None when there is neither."""
    value: dict[str, Any] | None = None
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):  # Validation records have their own file: skip them here.
        try:
            record = json.loads(line)
        except ValueError:
            continue  # the tail's first line, cut
        if isinstance(record, dict) and record.get("kind") != "eval":
            value = record
            break
    try:
        last_eval = json.loads((run_dir / LAST_EVAL_FILE).read_text())
    except (OSError, ValueError):
        last_eval = None
    if isinstance(last_eval, dict):
        value = {**(value or {}), "eval": last_eval}
    return value


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (torchrun's ranks)."""
    try:
        return [p.pid for p in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def _catches(pid: int, sig: int) -> bool:
    """True when process ``pid`` has a handler for ``sig`` (Linux: SigCgt in /proc status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def record_location(environ: Mapping[str, str], spec: ClusterSpec) -> str | None:
    """Where the job record lives: beside the checkpoints (``HETERO_CHECKPOINT_URI``, else the
    spec's checkpoint folder)."""
    return environ.get(ENV_CHECKPOINT_URI, "").strip() or spec.job.checkpoint.dir or None


def default_settings(args: Any) -> LoopSettings:
    return LoopSettings(
        restart_budget=args.restart_budget,
        restart_backoff_s=args.restart_backoff,
        peer_timeout_s=args.peer_timeout,
        poll_s=args.poll,
        spot_poll_s=args.spot_poll,
        grace_s=args.grace,
        imds_url=args.imds_url,
        imds_timeout_s=args.imds_timeout,
        job_poll_s=args.job_poll,
        no_trainer_timeout_s=args.no_trainer_timeout,
        heartbeat_s=args.heartbeat,
        replacement_budget=args.replacement_budget,
    )
