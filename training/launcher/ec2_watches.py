"""The threads that watch an EC2 host's surroundings while ``ec2_job.Ec2Job`` runs its loop.

- The Spot watch (``spot.SpotWatcher``): an interruption notice or an Auto Scaling termination
  marks this host as leaving in the job record at once, then stops the role; a rebalance
  recommendation asks the trainer's ranks for a checkpoint (``rank_signals``).
- Checkpoint requests: delivered once every rank handles SIGUSR1 (``Signals.deliver_pending``).
- The job pointer (with a ``jobparam.JobWatch``): a newer job stops the role.
- The heartbeat, while a generation runs: a look at the cluster's running instances (the
  host's census, ``bill.Census``), this host's state and the trainer's last metrics into the job
  record, then the watches that end the job: failed (``boot_watch``, ``trainer_watch``) or, on a
  data server, stopped by the budget (``tier_budget``); ``last_metrics`` reads the trainer's
  last metrics in its run folder for it. On a trainer, a generation with no progress for the
  hang limit is killed once its ranks' stacks are taken (``hang_watch``).
- Liveness, for the launcher's whole loop: this host's state written again at each heartbeat
  (``HostRecord.refresh``, the others' sign that it is alive), then a look for silent hosts,
  which the live ones take out of their groups (``silent_hosts``).
- The job's bill (``bill``), made by the host that records the job's outcome.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from training.common.hosts import list_cluster_instances
from training.common.jobparam import JobWatch
from training.common.names import LAST_EVAL_FILE
from training.common.outcome import Outcome
from training.costs.bill import job_bill
from training.costs.budget import JobClock, parse_started
from training.launcher.boot_watch import BootWatch
from training.launcher.hang_watch import HangWatch
from training.launcher.host_record import HostRecord
from training.launcher.imds import ImdsClient
from training.launcher.loop_settings import LoopSettings
from training.launcher.rank_signals import Signals
from training.launcher.server_watch import ServerWatch
from training.launcher.silent_hosts import SilentHostWatch
from training.launcher.spot import SpotNotice, SpotWatcher
from training.launcher.tier_budget import TierBudgetWatch
from training.launcher.trainer_watch import NoTrainerWatch
from training.spec import ClusterSpec, InstanceGroup, Role

log = logging.getLogger(__name__)


class Ec2Watches:
    """This host's watches (see the module docstring): ``start`` and ``stop`` bracket the loop,
    ``heartbeat`` a generation."""

    def __init__(
        self,
        signals: Signals,
        host: HostRecord,
        *,
        spec: ClusterSpec,
        group: InstanceGroup,
        cluster: str,
        ec2: Any,
        autoscaling: Any,
        settings: LoopSettings,
        run_dir: Path,
        clock: JobClock,
        end: Callable[[Outcome, str], bool],
    ) -> None:
        self.signals = signals
        self.host = host
        self.trainer = group.role is Role.TRAINER
        self.run_dir = run_dir
        self.ec2 = ec2
        self.cluster = cluster
        self.clock = clock
        self.end = end
        """Ends the job for everyone; False, ending nothing, when another job began."""
        self.checks: list[tuple[Outcome, BootWatch | NoTrainerWatch | TierBudgetWatch]] = []
        """Asked in turn at each heartbeat, with a job record, each with the outcome it ends the
        job with: failed boots past the replacement budget (every host); on a data server, the
        budget spent with no trainer to stop it, and no live trainer host. The first wins."""
        if host.record is not None:
            record, budget = host.record, settings.replacement_budget
            boots = BootWatch(
                ec2, cluster, record, budget=budget, job_started=clock.job_start,
                census=host.census,
            )  # fmt: skip
            self.checks.append((Outcome.FAILED, boots))
            trainers = [g.name for g in spec.groups if g.role is Role.TRAINER]
            if not self.trainer and trainers:
                tier_budget = TierBudgetWatch(
                    clock, record, trainers, live_s=settings.trainer_alive_s,
                    grace_s=settings.budget_grace_s,
                )  # fmt: skip
                timeout_s = settings.no_trainer_timeout_s
                self.checks.append((Outcome.STOPPED, tier_budget))
                self.checks.append(
                    (Outcome.FAILED, NoTrainerWatch(record, trainers, timeout_s=timeout_s))
                )
        self.ended: Outcome | None = None
        """How a watch of this host ended the job (failed boots past the budget, no live trainer
        host: failed; the budget spent: stopped), once one did."""
        self.job_watch: JobWatch | None = None
        """Reads the job pointer (None: no pointer, the job never changes under this host)."""
        self._done = threading.Event()
        self._spot: SpotWatcher | None = None
        self._last_look: tuple[float, Mapping[str, list[dict[str, Any]]]] | None = None
        """When the last successful ``look`` was made (monotonic), and what it listed."""
        self.silent = SilentHostWatch(
            host, autoscaling, silent_after_s=settings.silent_after,
            stagger_s=settings.silent_after / 2,
        )  # fmt: skip
        """The cluster's silent hosts (``silent_hosts``), looked for at each liveness beat."""

    def start(self, imds: ImdsClient, settings: LoopSettings, job_watch: JobWatch | None) -> None:
        """The Spot watch and the checkpoint requests; with ``job_watch``, a read of the job
        pointer every ``settings.job_poll_s``."""
        self.job_watch = job_watch
        self._done = threading.Event()
        self._spot = SpotWatcher(
            imds, self.on_notice, on_rebalance=self.on_rebalance, interval_s=settings.spot_poll_s
        )
        self._spot.start()
        threading.Thread(
            target=self.signals.deliver_pending,
            args=(self._done,),
            name="checkpoint-requests",
            daemon=True,
        ).start()
        if job_watch is not None:
            threading.Thread(
                target=self._watch_job, args=(settings.job_poll_s,), name="job-watch", daemon=True
            ).start()
        if self.host.record is not None:
            threading.Thread(
                target=self._live, args=(settings.heartbeat_s,), name="liveness", daemon=True
            ).start()

    def stop(self) -> None:
        self._done.set()
        if self._spot is not None:
            self._spot.stop()

    def new_job_started(self) -> bool:
        """Read the job pointer now; True once it names another job than this host's."""
        if self.job_watch is None:
            return False
        if self.signals.superseded is None:
            newer = self.job_watch.newer()
            if newer is not None:
                with self.signals.lock:
                    self.signals.superseded = newer
        return self.signals.superseded is not None

    def superseded_reason(self) -> str:
        new = self.signals.superseded
        old = self.job_watch.pointer.job_id if self.job_watch else "?"
        return f"job {old} was superseded by job {new.job_id if new else '?'}"

    # -- the Spot watch's callbacks ----------------------------------------------------------

    def on_notice(self, notice: SpotNotice) -> None:
        with self.signals.lock:
            if self.signals.notice is None:
                self.signals.notice = notice
            sup = self.signals.supervisor
        # Say so first: the other hosts re-form without this one while it checkpoints.
        self.host.mark_leaving(notice.describe())
        if sup is not None:
            sup.request_stop(signal.SIGTERM, notice.describe())

    def on_rebalance(self, notice: SpotNotice) -> None:
        if not self.trainer:
            return  # A data server has nothing to save.
        with self.signals.lock:
            self.signals.checkpoint_requests += 1
        self.host.set(state="rebalance-checkpoint", notice=notice.describe())
        self.signals.deliver_checkpoint_request()

    # -- threads -----------------------------------------------------------------------------

    def _watch_job(self, poll_s: float) -> None:
        """While the loop runs: stop the role as soon as another job was started."""
        while not self._done.wait(poll_s):
            if self.new_job_started():
                self.signals.stop(signal.SIGTERM, self.superseded_reason())
                return

    def _live(self, every_s: float) -> None:
        """While the loop runs: this host's state again when its last write is a heartbeat old,
        then, while the job is not over, the silent hosts (taken out when due)."""
        while not self._done.wait(every_s):
            self.host.refresh(every_s)
            if self.host.outcome() is not None:
                continue  # the job is over: its end takes every instance away
            running = self.look(reuse_s=every_s)
            if running is not None:
                self.silent.check(running)

    @contextlib.contextmanager
    def heartbeat(
        self, every_s: float, members: list[str] | None, watch: HangWatch | ServerWatch | None
    ) -> Iterator[None]:
        """While the block runs a generation: its beats, every ``every_s``, each with a look at
        ``watch``: a trainer's hang (``hang_watch``), a data server's health (``server_watch``)."""
        done = threading.Event()
        threading.Thread(
            target=self._beat, args=(done, every_s, members, watch), name="heartbeat", daemon=True
        ).start()
        try:
            yield
        finally:
            done.set()

    def _beat(
        self,
        done: threading.Event,
        every_s: float,
        members: list[str] | None,
        watch: HangWatch | ServerWatch | None,
    ) -> None:
        """While the role runs: a look at the cluster's instances (the census), this host's
        state and the trainer's last metrics line; a generation whose rendezvous waits for a
        member that no longer runs is stopped, and one that hangs (``hang_watch``: once its
        ranks' stacks are taken) or whose data server does not answer (``server_watch``) is
        killed."""
        while not done.wait(every_s):
            running = self.look()
            self.host.set(state="running", members=members, metrics=last_metrics(self.run_dir))
            if self.end_if_due():
                return
            if isinstance(watch, HangWatch):
                found = watch.check(self.signals.rank_pids())
                reason = found.reason() if found is not None else None
            else:
                reason = watch.check() if watch is not None else None
            if reason is not None:
                self.signals.kill_generation(reason)
                return
            # A trainer generation whose rendezvous waits for a member that is gone ends now
            # (not on a failed look: EC2 could not be asked).
            if (
                members
                and running is not None
                and stop_if_a_member_cannot_join(self.signals, running, members)
            ):
                return

    def look(self, reuse_s: float = 0.0) -> Mapping[str, list[dict[str, Any]]] | None:
        """List the cluster's running instances into this host's census, now; the listing, or
        None when EC2 could not be asked (logged: the next look makes up for it). ``reuse_s``:
        a listing that another look made that recently serves instead (the liveness beat and a
        generation's heartbeat do not both ask EC2 each heartbeat)."""
        last = self._last_look
        if last is not None and time.monotonic() - last[0] < reuse_s:
            return last[1]
        try:
            running = list_cluster_instances(self.ec2, self.cluster)
        except Exception as e:  # botocore's errors: the census waits for the next look
            log.warning("could not list the cluster's instances for the job's bill: %s", e)
            return None
        self.host.census.observe(time.time(), running)
        self._last_look = (time.monotonic(), running)
        return running

    def bill(self) -> dict[str, Any] | None:
        """What the job cost until now, its end (``bill.job_bill``: every host's census in the
        job record, this host's, and a look at what runs now), at the prices its budget uses;
        None when the job record cannot be read (logged: the outcome is recorded without it).
        Its end is taken last, after the reads, as close as can be to the scale to zero."""
        record = self.host.record
        if record is None:
            return None
        try:
            hosts = record.hosts()
            running = self.look()
            since = parse_started(self.clock.pointer_started())
            prices = self.clock.budget.prices
            bill = job_bill(
                hosts, prices, until=time.time(), since=since, running=running,
                own=self.host.census,
            )  # fmt: skip
        except Exception as e:  # S3 or EC2 unreachable: the outcome matters more
            log.warning("could not make the job's bill: %s", e)
            return None
        log.info(
            "the job's bill: %.4f USD for %.0f instance-s (± %.0f)",
            bill.usd, bill.instance_seconds, bill.uncertain_s,
        )  # fmt: skip
        return bill.to_json()

    def end_if_due(self) -> bool:
        """Failed boots past the replacement budget (``boot_watch``, every host) end the job as
        failed; on a data server, the budget spent with no trainer to stop it (``tier_budget``)
        ends it stopped, and no live trainer host for the bounded time (``trainer_watch``)
        failed: every group to zero, and this host's role stopped."""
        if self.ended is not None:
            return False
        asked = ((outcome, watch.check()) for outcome, watch in self.checks)  # in turn, lazily
        due = next(((outcome, reason) for outcome, reason in asked if reason is not None), None)
        if due is None:
            return False
        outcome, reason = due
        log.error("%s: ending the job (%s)", reason, outcome.value)
        if not self.end(outcome, reason):
            return False  # another job began: its own watches start over
        self.ended = outcome
        self.signals.stop(signal.SIGTERM, reason)
        return True


def stop_if_a_member_cannot_join(
    signals: Signals, running: Mapping[str, list[dict[str, Any]]], members: list[str]
) -> bool:
    """Before torchrun has started its ranks, its rendezvous waits for every member, up to the
    rendezvous timeout. A member that no longer runs (``running``: the cluster's listing; its
    boot gave up, it was lost) will never join: stop the generation now (True), and the job loop
    re-forms without it, using no restart. Once the ranks run, a lost member is the collectives'
    to notice, as before."""
    with signals.lock:
        sup = signals.supervisor
    if sup is None or sup.ranks_started():
        return False
    listed = {i.get("InstanceId") for instances in running.values() for i in instances}
    gone = [m for m in members if m not in listed]
    if not gone:
        return False
    log.warning(
        "member(s) %s of this generation no longer run and its rendezvous is still waiting "
        "for them: stopping it to re-form now",
        ", ".join(gone),
    )
    signals.stop(signal.SIGTERM, f"member(s) {', '.join(gone)} gone before the rendezvous")
    return True


def last_metrics(run_dir: Path) -> dict[str, Any] | None:
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
