"""Hosts that EC2 lists as running but that have stopped working: found from the job record,
taken out of their group by a live host.

Every launcher writes its state to the job record (``hosts/<instance-id>.json``, with the time)
at each heartbeat from a thread of its own (``Ec2Watches``), whatever its loop is doing. A host
of the cluster that EC2 lists ``running``, that has written there before, that has not said it
is leaving, and whose last write is older than ``silent_after_s`` is silent: its launcher is
gone (its container ended after Docker's last restart, an out-of-memory kill) or the host is
frozen. EC2 and Auto Scaling see nothing wrong with it, so nothing else would ever replace it,
and a trainer generation would keep waiting for it.

- Trainer membership leaves a silent host out at once (``silent_ids``, beside the leaving
  hosts), so the survivors re-form without it, as after a Spot loss.
- A live host takes it out of its group: ``SetInstanceHealth Unhealthy``, so the group
  terminates and replaces it (``early_exit.set_unhealthy``), and ``evicted/<instance-id>.json``
  in the job record with the reason and who acted. The live hosts, in instance-id order, act
  one after another: the first ``silent_after_s`` after the silent host's last write, each
  next one ``stagger_s`` later if the host is still there (acting twice does no harm).
- A host whose last state is a final one (``FINAL_STATES``) stopped writing on purpose.
- Only a host whose own writes have succeeded for ``silent_after_s`` judges the others: after
  an S3 outage every host looks silent to every other until each has written again.

So a silent host bills at most ``silent_after_s`` (plus ``stagger_s`` per live host that is
itself gone) after its last write, then the group's termination.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from training.common.hosts import tag
from training.common.names import TAG_GROUP
from training.launcher.early_exit import set_unhealthy
from training.launcher.host_record import HostRecord

log = logging.getLogger(__name__)

FINAL_STATES = ("left", "job-", "generation-finished")
"""States a launcher writes last on purpose (``ec2_job``): it left (a notice), it ended the job,
or its role finished (a data server after the trainer's Shutdown RPC, just before the trainers
end the job): such a host stops writing and is not silent."""


@dataclass(frozen=True)
class SilentHost:
    instance_id: str
    group: str | None
    last_write: float
    """Epoch seconds of its last write to the job record."""
    state: str | None
    """What it last said it was doing."""

    def reason(self, now: float) -> str:
        return (
            f"silent: no write to the job record for {now - self.last_write:.0f} s (last state "
            f"{self.state or 'unknown'}) while EC2 lists it running"
        )


def find_silent(
    running: Mapping[str, list[dict[str, Any]]],
    hosts: Mapping[str, Mapping[str, Any]],
    *,
    now: float,
    silent_after_s: float,
    gone: set[str],
    own: str,
) -> tuple[list[SilentHost], list[str]]:
    """(the silent hosts, oldest write first; the live hosts' ids, sorted) among the running
    instances of the cluster (``running``: by group, as ``hosts.list_cluster_instances``),
    this host and the ``gone`` ones (leaving, already taken out) aside. A host that never wrote
    is neither: its launcher has not started yet (a boot that fails is ``boot_watch``'s)."""
    silent: list[SilentHost] = []
    live: list[str] = [own]
    for instances in running.values():
        for instance in instances:
            instance_id = instance.get("InstanceId", "")
            state = hosts.get(instance_id) or {}
            written = state.get("time")
            if instance_id in ("", own) or instance_id in gone:
                continue
            if not isinstance(written, int | float):
                continue  # never wrote: not started yet
            if str(state.get("state", "")).startswith(FINAL_STATES):
                continue  # its launcher's last write on purpose: it left, or its part ended
            if now - float(written) <= silent_after_s:
                live.append(instance_id)
                continue
            group = tag(instance, TAG_GROUP) or state.get("group")
            silent.append(SilentHost(instance_id, group, float(written), state.get("state")))
    return sorted(silent, key=lambda s: (s.last_write, s.instance_id)), sorted(live)


class SilentHostWatch:
    """``check(running)`` finds the silent hosts and takes out those due for this host;
    ``silent_ids()`` is what the last check found (for trainer membership)."""

    def __init__(
        self,
        host: HostRecord,
        autoscaling: Any,
        *,
        silent_after_s: float,
        stagger_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.host = host
        self.autoscaling = autoscaling
        self.silent_after_s = silent_after_s
        self.stagger_s = stagger_s
        self.clock = clock
        self._silent: frozenset[str] = frozenset()
        self.taken_out: list[str] = []
        """The instances this host took out, in order."""

    def silent_ids(self) -> set[str]:
        return set(self._silent)

    def check(self, running: Mapping[str, list[dict[str, Any]]]) -> list[SilentHost]:
        """Find the silent hosts now and take out the ones due; the silent hosts found (none
        while this host's own writes have not succeeded for ``silent_after_s``, or the job
        record cannot be read)."""
        record = self.host.record
        now = self.clock()
        since = self.host.writing_since
        if record is None or since is None or now - since < self.silent_after_s:
            return []
        try:
            hosts = record.hosts()
            gone = set(record.leaving()) | set(record.evicted())
        except Exception as e:  # S3 unreachable: no judgement without the record
            log.warning("could not read the job record's hosts: %s", e)
            return []
        silent, live = find_silent(
            running, hosts, now=now, silent_after_s=self.silent_after_s, gone=gone,
            own=self.host.instance_id,
        )  # fmt: skip
        self._silent = frozenset(s.instance_id for s in silent)
        turn = live.index(self.host.instance_id)
        for found in silent:
            due = found.last_write + self.silent_after_s + turn * self.stagger_s
            if now >= due:
                self._take_out(found, now)
        return silent

    def _take_out(self, found: SilentHost, now: float) -> None:
        reason = found.reason(now)
        log.warning(
            "host %s (%s) is %s: taking it out of its group", found.instance_id, found.group,
            reason,
        )  # fmt: skip
        if not set_unhealthy(self.autoscaling, found.instance_id):
            return
        self.taken_out.append(found.instance_id)
        assert self.host.record is not None
        try:
            self.host.record.mark_evicted(
                found.instance_id, group=found.group, reason=reason, by=self.host.instance_id
            )
        except Exception as e:  # Its group replaces it all the same.
            log.warning("could not record the eviction of %s: %s", found.instance_id, e)
