"""The launcher's loop on an EC2 instance: run this host's role in generations until the job is
over, so that interruptions, replacements and crashes need nobody to log in.

Each pass:

1. If the job record says the job is over, stop (a replacement that arrives after the end, or a
   host whose peer ended the job, runs nothing).
2. Trainer hosts agree on a membership (``membership.py``): the first ``count`` usable trainer
   instances (not leaving, not silent: ``silent_hosts``); a host outside it waits on standby.
   Data servers need no membership.
3. Run the role under supervision while the Spot watch runs (``spot.py``). An interruption
   notice or an Auto Scaling termination marks this host as leaving in the job record at once,
   then stops the role (the trainer checkpoints at the next step boundary, durably in S3, and
   exits "stopped"); a rebalance recommendation sends SIGUSR1, a checkpoint without a stop.
4. Act on how it ended (``training.common.outcome``):

   - this host was told to go: complete the lifecycle action (Auto Scaling termination) and
     exit ``EXIT_STOPPED``; the others carry on without it;
   - finished: end the job (``job_end.end_job``: outcome recorded, every group scaled to zero);
     any host that sees the finish does it, so the job ends even if the first host is gone;
   - stopped because a peer stopped, or failed while the membership changed (a peer vanished):
     start the next generation at once; this costs no restart;
   - failed in a way no restart can fix (a rank exited ``EXIT_DATA``: more training samples
     unreadable than ``job.dataset.max_unreadable`` allows, and a restart resumes the same list
     from the checkpoint): end the job as failed at once, with the rank's reason;
   - failed otherwise (a crash, peers that never came): count it against the restart budget
     (``restart_budget``: failures since the job's last new checkpoint) and retry after an
     exponential backoff; beyond the budget, end the job as failed.

5. After a host ended the job (its group, like every group, scaled to zero), and with a
   termination hook (``HETERO_LIFECYCLE_HOOK``, the trainer group): wait, bounded, until Auto
   Scaling holds this instance in Terminating:Wait and complete the lifecycle action, so it
   does not bill until the hook's heartbeat timeout (``job_end.complete_own_termination``).

With a job pointer (``jobparam.JobWatch``, from ``HETERO_JOB_PARAMETER``), every pass first
reads the pointer again, and a thread reads it every ``job_poll_s`` while the role runs or waits
for peers. When another job was started (``hetero job start --force`` while this host ran), the
role is stopped (SIGTERM: the trainer checkpoints and exits "stopped"), the old job is neither
ended nor scaled to zero (that would stop the new one), and ``run`` returns ``EXIT_NEW_JOB``:
the launcher then starts again on the new job.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from training.common.jobparam import JobWatch
from training.common.jobrecord import JobRecord
from training.common.names import ENV_LIFECYCLE_HOOK
from training.common.outcome import (
    EXIT_FAILED,
    EXIT_FINISHED,
    EXIT_STOPPED,
    Outcome,
    not_retried,
    server_stopped,
)
from training.common.s3 import is_s3_uri
from training.costs import backstop
from training.costs.budget import Budget, JobClock
from training.costs.deploy_prices import deploy_job_prices
from training.launcher import job_end
from training.launcher.early_exit import set_unhealthy
from training.launcher.ec2_watches import Ec2Watches
from training.launcher.group import GroupIdentity
from training.launcher.hang_watch import Hang, HangWatch, save_hang
from training.launcher.host_record import HostRecord
from training.launcher.imds import ImdsClient
from training.launcher.loop_settings import LoopSettings
from training.launcher.membership import (
    Membership,
    MembershipTimeout,
    current_membership,
    wait_for_membership,
)
from training.launcher.peers import Peers
from training.launcher.rank_signals import Signals
from training.launcher.restart_budget import RestartBudget
from training.launcher.server_watch import ServerWatch
from training.launcher.spot import ASG_TERMINATION, TARGET_LIFECYCLE_PATH
from training.processes import roles
from training.processes.supervised import run_role
from training.processes.supervisor import Supervisor, exit_code_for_signal
from training.spec import ClusterSpec, Role
from training.trainer.checkpoint_s3 import S3CheckpointStore

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 120.0
EXIT_NEW_JOB = 76
"""``Ec2Job.run``: another job was started; this host left the old one (never a process's exit
code unless re-executing the launcher failed: then Docker's restart policy starts it again)."""


@dataclass
class GenerationResult:
    outcome: Outcome
    reason: str
    hang: Hang | None = None
    """The generation hung and was killed (``hang_watch``)."""
    unanswered: str | None = None
    """A data server of this host did not answer and the generation was killed
    (``server_watch``): why."""
    for_good: str | None = None
    """A rank failed in a way no restart can fix (``outcome.not_retried``): its reason."""


@dataclass(frozen=True)
class JobAws:
    """What a host's job loop acts on in AWS: its EC2 and Auto Scaling clients, the job record
    (None: the job keeps none), and the cluster's Auto Scaling groups (every group's name, for
    the job's end and the budget's backstop)."""

    ec2: Any
    autoscaling: Any
    record: JobRecord | None
    asg_names: list[str]


def job_clock(
    spec: ClusterSpec, identity: GroupIdentity, aws: JobAws, job_watch: JobWatch | None
) -> JobClock:
    """The job's budget clock: the budget priced from the job pointer, else from what a deploy's
    job recorded (its first host prices it, Spot from AWS: ``deploy_job_prices``), else from
    the spec and the dated catalogue; the job's start from the pointer, else the record."""
    pointer = job_watch.pointer if job_watch else None
    recorded = deploy_job_prices(
        spec, pointer, aws.record, ec2=aws.ec2,
        zone=identity.availability_zone, region=identity.region,
    )  # fmt: skip
    budget = Budget.of(spec, pointer, recorded=recorded)
    return JobClock(budget, aws.record, lambda: job_watch.pointer.started if job_watch else None)


class Ec2Job:
    """One EC2 host's part of the job (see the module docstring). Its collaborators are made
    by the caller (``ec2_start``): the AWS it acts on and the budget's clock (``job_clock``)."""

    def __init__(
        self,
        spec: ClusterSpec,
        *,
        identity: GroupIdentity,
        settings: LoopSettings,
        plan_for: Callable[[Peers, int, str], Any],
        environ: Mapping[str, str],
        run_dir: Path,
        aws: JobAws,
        clock: JobClock,
        job_watch: JobWatch | None = None,
    ) -> None:
        self.identity = identity
        self.instance_id = identity.instance_id or "unknown"
        self.group = spec.group(identity.group)
        self.settings = settings
        self.plan_for = plan_for
        """(peers, rendezvous port, outcome dir) -> a ``LaunchPlan`` for one generation."""
        self.environ = environ
        self.run_dir = run_dir
        self.outcome_dir = run_dir / "outcome"
        self.autoscaling = aws.autoscaling
        self.record = aws.record
        self.asg_names = aws.asg_names
        self.job_watch = job_watch
        """Reads the job pointer (None: no pointer, the job never changes under this host)."""
        self.hook = environ.get(ENV_LIFECYCLE_HOOK, "").strip()
        self.signals = Signals()
        self.restarts = RestartBudget(settings.restart_budget)
        self.generation = 0
        self.hung_in: int | None = None
        """The last generation of this host that hung."""
        self.host = HostRecord(
            aws.record,
            self.instance_id,
            group=self.group.name,
            address=identity.host,
            counters=lambda: {"generation": self.generation, "failures": self.failures},
        )
        self.ended_job = False
        """True once this host ended the job (outcome recorded, every group scaled to zero)."""
        self.backstop_put = False  # the budget's scheduled action (``backstop.put_for_job``)
        self.budget = clock.budget
        self.clock = clock
        cluster = identity.cluster or spec.name
        self.watches = Ec2Watches(
            self.signals,
            self.host,
            spec=spec,
            group=self.group,
            cluster=cluster,
            ec2=aws.ec2,
            autoscaling=aws.autoscaling,
            settings=settings,
            run_dir=run_dir,
            clock=self.clock,
            end=self._end,
        )
        self.current_membership = partial(
            current_membership, aws.ec2, aws.autoscaling, cluster=cluster,
            group=self.group.name, count=self.group.count, leaving=self._gone,
            observe=self.host.census.observe,
        )  # fmt: skip
        """The trainer group's usable instances now (``membership.current_membership``)."""

    @property
    def failures(self) -> int:
        """Failures counted against the restart budget (since the job's last progress)."""
        return self.restarts.failures

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        on_signal = self.signals.on_signal
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        imds = ImdsClient(self.settings.imds_url, timeout_s=self.settings.imds_timeout_s)
        self.watches.start(imds, self.settings, self.job_watch)
        try:
            code = self._loop()
            self.watches.stop()  # From here a Terminated target state is this job end's own.
            if self.ended_job and self.hook:
                self._complete_own_termination(imds)
            return code
        finally:
            self.watches.stop()
            for s, h in previous.items():
                signal.signal(s, h)

    def _loop(self) -> int:
        while True:
            if self.watches.new_job_started():  # Every generation boundary reads the pointer.
                return self._next_job()
            ended = self.host.outcome()
            if ended is not None:
                log.info("the job is over (%s: %s)", ended.get("outcome"), ended.get("reason"))
                over = next((o for o in Outcome if o.value == ended.get("outcome")), Outcome.FAILED)
                # A host started after the end (a deploy that set the groups again without a new
                # job) ends it again so nothing bills; harmless twice (the first outcome stays).
                self._end(over, f"the job was already over ({ended.get('reason')})")
                return over.exit_code
            if self.signals.leaving:
                return self._leave()
            self.backstop_put = self.backstop_put or backstop.put_for_job(
                self.autoscaling, self.asg_names, self.clock,
                after_s=self.settings.backstop_after, lead_s=self.settings.backstop_lead_s,
            )  # fmt: skip
            trainer = self.group.role is Role.TRAINER
            # Before and in the peer wait (survivors bill too): no trainer runs, nothing to save.
            if trainer and self.clock.spent():
                return self._end_for_budget()
            membership: Membership | None = None
            if trainer:
                try:
                    membership = self._wait_for_membership()
                except MembershipTimeout as e:
                    code = self._failed(str(e))
                    if code is not None:
                        return code
                    continue
                if membership is None:  # stopped, ended, superseded or out of budget meanwhile
                    continue
            self.generation += 1
            result = self._run_generation(membership)
            if self.watches.ended is not None:
                return self.watches.ended.exit_code
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
                if trainer and self.clock.spent():  # the trainer's --max-seconds: the budget
                    return self._end_for_budget()
                log.info("generation %d stopped (a peer is leaving): re-forming", self.generation)
                continue
            if result.for_good is not None:
                return self._fail_for_good(result.for_good)
            if membership is not None and self._membership_changed(membership):
                log.warning(
                    "generation %d failed and a member is gone: re-forming (no restart used)",
                    self.generation,
                )
                continue
            taken_out_for = result.unanswered or (
                self._hung_again(result.hang) if result.hang is not None else None
            )
            if taken_out_for is not None:
                code = self._take_self_out(taken_out_for)
                if code is not None:
                    return code
            code = self._failed(result.reason)
            if code is not None:
                return code

    def _wait_for_membership(self) -> Membership | None:
        count = self.group.count
        self.host.set(state="waiting-for-peers")
        return wait_for_membership(
            self.current_membership,
            count=count,
            own_instance_id=self.instance_id,
            timeout_s=self.settings.peer_timeout_s,
            poll_s=self.settings.poll_s,
            should_stop=lambda: (
                self.signals.stopping or self.host.outcome() is not None or self.clock.spent()
            ),
        )

    def _gone(self) -> set[str]:
        """Hosts that are not to be members: leaving (a notice), or silent (``silent_hosts``)."""
        return self.host.leaving() | self.watches.silent.silent_ids()

    def _membership_changed(self, membership: Membership) -> bool:
        try:
            return self.current_membership().members != membership.members
        except Exception as e:
            log.warning("could not list the trainer group again: %s", e)
            return False

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
        plan = self.plan(membership)
        if membership is not None:
            log.info(
                "generation %d: node %d of %d, rendezvous %s:%d",
                self.generation, plan.peers.self_index, len(membership.members),
                membership.addresses[0], membership.rendezvous_port,
            )  # fmt: skip
        members = list(membership.ids) if membership else None
        self.host.set(state="running", members=members)
        trainer = plan.role is Role.TRAINER
        hang = self._hang_watch() if trainer else None
        with (
            ServerWatch(
                plan.serves,
                bound_s=self.settings.silent_after,
                stopped=lambda address: server_stopped(self.outcome_dir, address),
            ) as servers,
            Supervisor(grace_s=self.settings.grace_s, subreaper=self.settings.subreaper) as sup,
            self.watches.heartbeat(self.settings.heartbeat_s, members, hang or servers),
            self.signals.attached(sup),
        ):
            ended = run_role(
                sup,
                plan.commands,
                env={**self.environ, **(self.clock.trainer_env() if trainer else {})},
                outcome_dir=self.outcome_dir,
                trainer_ranks=self.group.ranks_per_instance if trainer else None,
                wait=lambda _: self.signals.wait(sup, self.watches.superseded_reason),
                label=f"generation {self.generation}: ",
            )
        codes = ended.codes
        if ended.outcome is not None:
            outcome = ended.outcome
            reason = ", ".join(sorted({r.reason for r in ended.ranks}) or [f"exit codes {codes}"])
        else:  # A data server exits 0 after the Shutdown RPC (the job finished) or a stop.
            failed, stopped = any(c != 0 for c in codes), self.signals.stopping
            outcome = Outcome.FAILED if failed else Outcome.STOPPED if stopped else Outcome.FINISHED
            reason = f"exit codes {codes}"
        found = hang.found if hang is not None else None
        if found is not None:
            outcome, reason = Outcome.FAILED, found.reason()
            save_hang(found, self.run_dir, self.record, self.instance_id)
        # The watch's verdict counts when it ended the server (killed: a non-zero code); a server
        # that exited 0 as the verdict came finished on its own.
        not_answering = servers.found if any(c != 0 for c in codes) else None
        if not_answering is not None:
            outcome, reason = Outcome.FAILED, not_answering
        if self.watches.ended is None:  # else the job's end (``_end``) is this host's last state
            self.host.set(state=f"generation-{outcome.value}", reason=reason)
        final = not_retried(ended.ranks) if outcome is Outcome.FAILED else None
        for_good = final.reason if final is not None else None
        return GenerationResult(outcome, reason, found, not_answering, for_good)

    # -- hangs -------------------------------------------------------------------------------

    def _hang_watch(self) -> HangWatch:
        s = self.settings
        return HangWatch(
            self.outcome_dir, generation=self.generation, after_steps=s.hang_after_steps,
            floor_s=s.hang_floor_s, stacks_wait_s=s.stacks_wait_s,
        )  # fmt: skip

    def _hung_again(self, hang: Hang) -> str | None:
        """Why to take this host out, when it hung in its previous generation too and a rank of
        its own did not answer this time: this host is the one that hangs, not a peer it waited
        on. None otherwise."""
        again = self.hung_in == hang.generation - 1
        self.hung_in = hang.generation
        if not (again and hang.frozen):
            return None
        return (
            f"hung in generations {hang.generation - 1} and {hang.generation}, with rank(s) that "
            f"did not answer ({'; '.join(r.describe() for r in hang.frozen)})"
        )

    def _take_self_out(self, reason: str) -> int | None:
        """Leave the group for a replacement (hung twice, or a data server that does not
        answer): SetInstanceHealth Unhealthy on this instance, ``evicted/`` and ``leaving/`` in
        the job record (the others re-form without it at once), then wait for the termination
        as after a notice. None when Auto Scaling cannot be told: the generation's end then
        counts as a failure."""
        log.error("%s: taking this host out of its group", reason)
        if not set_unhealthy(self.autoscaling, self.instance_id):
            return None
        if self.record is not None:
            try:
                self.record.mark_evicted(
                    self.instance_id, group=self.group.name, reason=reason, by=self.instance_id
                )
            except Exception as e:  # Its group replaces it all the same.
                log.warning("could not record this host's eviction: %s", e)
        self.host.mark_leaving(reason)
        self.host.set(state="taken-out", reason=reason)
        deadline = time.monotonic() + self.settings.peer_timeout_s
        while not self.signals.leaving and time.monotonic() < deadline:
            if self.host.outcome() is not None or self.watches.new_job_started():
                break
            time.sleep(self.settings.poll_s)
        if self.signals.leaving:  # the termination, as Auto Scaling sends it
            return self._leave()
        log.error("this host was taken out but not terminated: exiting")
        return EXIT_FAILED

    # -- endings -----------------------------------------------------------------------------

    def _end_for_budget(self) -> int:
        """The budget is spent (the trainer checkpointed when it stopped): end the job as
        ``stopped`` with the reason, every group to 0; ``hetero job start --resume`` goes on."""
        elapsed = self.clock.elapsed() or 0.0
        reason = self.budget.reason(elapsed)
        log.warning("%s: ending the job", reason)
        if not self._end(Outcome.STOPPED, reason):
            return self._next_job()
        return EXIT_STOPPED

    def _fail_for_good(self, reason: str) -> int:
        """End the job ``failed`` at once, spending no restart: each one would fail the same way
        (``outcome.NOT_RETRIED``)."""
        msg = f"{reason} (not retried: a restart would fail the same way)"
        log.error("%s: ending the job", msg)
        if not self._end(Outcome.FAILED, msg):
            return self._next_job()
        return EXIT_FAILED

    def _failed(self, reason: str) -> int | None:
        """Count a failure; the exit code when the budget is spent (the job is then ended),
        else None after the backoff. The budget counts failures without progress: a checkpoint
        completed since the last failure starts it over."""
        since = self.restarts.count(self._newest_checkpoint())
        if since is not None:
            log.info(
                "checkpoint step %d completed since the last failure (at step %d): the restart "
                "budget starts over", self.restarts.checkpoint_at_failure, since,
            )  # fmt: skip
        budget = self.settings.restart_budget
        if self.restarts.spent:
            msg = (
                f"failed {self.failures} times with no new checkpoint in between (restart "
                f"budget {budget}); last: {reason}"
            )
            log.error("%s: ending the job", msg)
            if not self._end(Outcome.FAILED, msg):
                return self._next_job()
            return EXIT_FAILED
        wait = min(self.settings.restart_backoff_s * 2 ** (self.failures - 1), MAX_BACKOFF_S)
        log.warning(
            "failure %d of %d allowed (%s): retrying in %.0fs", self.failures, budget, reason, wait
        )
        self.host.set(state="backoff", reason=reason)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not self.signals.stopping:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return None

    def _newest_checkpoint(self) -> int | None:
        """The job's newest complete checkpoint step beside its record in S3, 0 when it has none
        yet (None: no record in S3, or S3 could not be read: logged)."""
        if self.record is None or not is_s3_uri(self.record.location):
            return None
        try:
            return S3CheckpointStore(self.record.location).latest_complete() or 0
        except Exception as e:
            log.warning("could not list the job's checkpoints: %s", e)
            return None

    def _end(self, outcome: Outcome, reason: str) -> bool:
        """End the job for everyone; False, doing nothing, when another job was started since:
        the old job's end would land in the record beside the new job's checkpoints (a resumed
        job shares them) and scale the new job's groups to zero."""
        if self.watches.new_job_started():
            log.warning("%s: not ending it (%s)", self.watches.superseded_reason(), reason)
            return False
        try:
            job_end.end_job(
                self.record, outcome, reason=reason, by=self.instance_id,
                autoscaling=self.autoscaling, asg_names=self.asg_names,
                backstop=self.budget.capped, bill=self.watches.bill,  # the outcome's bill
            )  # fmt: skip
        except Exception as e:
            log.error("could not end the job: %s", e)
        else:
            self.ended_job = bool(self.asg_names)  # without groups nothing was scaled to zero
        self.host.set(state=f"job-{outcome.value}", reason=reason)
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
        log.info("%s: leaving it for the new job", self.watches.superseded_reason())
        return EXIT_NEW_JOB

    def _leave(self) -> int:
        notice = self.signals.notice
        if notice is not None:
            if notice.kind == ASG_TERMINATION and self.hook:
                job_end.complete_lifecycle_action(self.autoscaling, self.instance_id, self.hook)
            self.host.set(state="left", reason=notice.describe())
            log.info("leaving the job: %s", notice.describe())
            return EXIT_STOPPED
        signum = self.signals.signum or signal.SIGTERM
        self.host.set(state="left", reason=signal.Signals(signum).name)
        return exit_code_for_signal(signum)
