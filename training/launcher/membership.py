"""Elastic trainer membership on EC2: who trains in the next generation of the job.

A generation is one torchrun run over a fixed set of trainer hosts. When a host goes (Spot
interruption, Auto Scaling termination, a crash) or a replacement arrives, the hosts' launchers
start another generation from the newest complete checkpoint. Why a launcher loop rather than
torchrun's elastic agent: torchrun's c10d rendezvous restarts workers on membership change, but
the rendezvous endpoint lives on one host (a single point of failure when that host is the one
interrupted), and it cannot see that a host is about to leave. Here every host derives the same
membership on its own from the group's instances, so any host can disappear, the first one
included.

The members of a generation are the trainer group's instances that are

- ``running`` (``DescribeInstances`` by the cluster's tags),
- not in an Auto Scaling ``Terminating*`` lifecycle state (``DescribeAutoScalingInstances``;
  with a termination lifecycle hook the instance stays ``running`` in ``Terminating:Wait``), and
- not marked as leaving in the job record (a host that got a notice says so at once),

the first ``count`` of them by launch time, then private IP. While a replacement launches before
the at-risk instance is gone (Capacity Rebalancing), the group holds count + 1: the newest
instance waits on standby until a member leaves, so a running generation is never displaced.
The first member is the rendezvous host; the rendezvous port depends on the member list, so
hosts that (briefly) disagree never join the same rendezvous.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from training.common.hosts import list_cluster_instances, terminating_instances

log = logging.getLogger(__name__)

RENDEZVOUS_BASE_PORT = 29500
RENDEZVOUS_PORTS = 100
"""The rendezvous port is ``RENDEZVOUS_BASE_PORT + hash(members) % RENDEZVOUS_PORTS``."""


class MembershipTimeout(RuntimeError):
    """The trainer group did not reach its count of usable instances in time."""


@dataclass(frozen=True)
class Member:
    instance_id: str
    address: str


@dataclass(frozen=True)
class Membership:
    """One generation's trainer hosts, in node-rank order."""

    members: tuple[Member, ...]
    standby: tuple[Member, ...] = ()
    """Usable instances beyond the group's count (a replacement that arrived early)."""

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(m.address for m in self.members)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(m.instance_id for m in self.members)

    def index(self, instance_id: str) -> int | None:
        """This instance's node rank, or None when it is not a member (standby)."""
        return self.ids.index(instance_id) if instance_id in self.ids else None

    @property
    def rendezvous_port(self) -> int:
        digest = hashlib.sha256(",".join(self.ids).encode()).digest()
        return RENDEZVOUS_BASE_PORT + int.from_bytes(digest[:4], "big") % RENDEZVOUS_PORTS


def _age_key(instance: dict[str, Any]) -> tuple[str, int, str]:
    launched: Any = instance.get("LaunchTime")
    stamp = launched.isoformat() if hasattr(launched, "isoformat") else str(launched or "")
    try:
        ip = int(ipaddress.ip_address(instance.get("PrivateIpAddress") or "0.0.0.0"))
    except ValueError:
        ip = 0
    return (stamp, ip, instance.get("InstanceId", ""))


def current_membership(
    ec2: Any,
    autoscaling: Any | None,
    *,
    cluster: str,
    group: str,
    count: int,
    leaving: Callable[[], set[str]] = set,
    observe: Callable[[float, dict[str, list[dict[str, Any]]]], None] | None = None,
) -> Membership:
    """The usable trainer instances right now, as a membership (possibly short of ``count``).
    ``observe`` gets the time and the listing of the cluster's running instances (the host's
    census, for the job's bill: ``bill.Census.observe``)."""
    running = list_cluster_instances(ec2, cluster)
    if observe is not None:
        observe(time.time(), running)
    instances = sorted(running.get(group, []), key=_age_key)
    ids = [i["InstanceId"] for i in instances]
    gone = set(leaving())
    if autoscaling is not None and ids:
        gone |= terminating_instances(autoscaling, ids)
    usable = [
        Member(i["InstanceId"], i["PrivateIpAddress"])
        for i in instances
        if i["InstanceId"] not in gone and i.get("PrivateIpAddress")
    ]
    return Membership(tuple(usable[:count]), tuple(usable[count:]))


def wait_for_membership(
    current: Callable[[], Membership],
    *,
    count: int,
    own_instance_id: str,
    timeout_s: float,
    poll_s: float = 5.0,
    settle_s: float = 0.0,
    should_stop: Callable[[], bool] = lambda: False,
    sleep: Callable[[float], None] = time.sleep,
) -> Membership | None:
    """Poll ``current`` until the group has ``count`` members and this instance is one of them,
    and the membership has stayed the same for ``settle_s``; None if ``should_stop`` says so.
    Raises ``MembershipTimeout`` after ``timeout_s`` with what it saw last."""
    deadline = time.monotonic() + timeout_s
    stable_since: float | None = None
    last: Membership | None = None
    while True:
        if should_stop():
            return None
        m = current()
        now = time.monotonic()
        complete = len(m.members) == count and m.index(own_instance_id) is not None
        if m != last:
            stable_since = now
            last = m
            status = (
                f"{len(m.members)}/{count} trainer hosts "
                f"({', '.join(m.addresses) or 'none'})"
                + (f", standby {', '.join(s.address for s in m.standby)}" if m.standby else "")
            )
            log.info("membership: %s", status)
        if complete and stable_since is not None and now - stable_since >= settle_s:
            return m
        if now >= deadline:
            where = "on standby" if len(m.members) == count else "short of hosts"
            raise MembershipTimeout(
                f"the trainer group did not form in {timeout_s:g}s ({where}): "
                f"{len(m.members)}/{count} usable instances {list(m.addresses)}. Check the Auto "
                "Scaling group's activity (Spot capacity?) or raise --peer-timeout"
            )
        sleep(poll_s)
