"""The job record: what every host of a job must agree on, kept beside the checkpoints.

Under ``<checkpoint URI>/job/`` (S3 on AWS, a folder otherwise):

- ``outcome.json``: ``{"outcome": "finished" | "failed" | "stopped", "reason", "by", "time",
  "bill"}``, written once by the host that ends the job (``stopped``: the budget ran out, see
  ``budget.py``; ``hetero job start --resume`` continues it; ``bill``: what the job cost,
  ``training.costs.bill``, where the host could make it). Its presence means the job is
  over: a host that starts or restarts afterwards does not run the role again.
- ``started.json``: ``{"started": <epoch seconds>}``, the job's start for its budget when the job
  pointer has none (a deploy's job), written by the first host that needs it.
- ``prices.json``: ``{"prices": [...]}``, each group's price at its most (as the pointer's
  ``prices``) when the job pointer has none (a deploy's job), priced from AWS by the first host
  that needs them (``training.costs.deploy_prices``).
- ``leaving/<instance-id>.json``: a host that got an interruption notice or an Auto Scaling
  termination says so here first, so the others re-form the job without it while it is still
  running (EC2 keeps it ``running`` until the termination).
- ``evicted/<instance-id>.json``: a host taken out of its group, with the reason and who acted:
  one that went silent (its launcher stopped writing ``hosts/``), by a live host
  (``training.launcher.silent_hosts``), or one whose ranks hung in two generations in a row
  without answering, by itself (``training.launcher.ec2_job``).
- ``hangs/<instance-id>-<generation>.json``: a trainer host whose ranks made no progress for the
  hang limit, as its launcher found it (``training.launcher.hang_watch.Hang``: each rank's step,
  phase, process state and stacks), before it ended that generation.
- ``hosts/<instance-id>.json``: each host's latest state (``hetero status`` shows them), with
  its census of the cluster's instances under ``instances`` (the bill's seconds).
- ``autoscale/<milliseconds>-<step>.json``: each decision of the data-tier controller
  (``training.dataplane.autoscale``, on the trainer's rank 0, for an elastic dataprep group),
  as its ``Decision.as_dict()``: ``time``, ``step``, ``from_count``, ``to_count``, ``reason``,
  ``wait_share``, ``busy_share``, ``serving``, ``acted``. The name is the decision's time in
  milliseconds, zero-padded to ``DECISION_TIME_DIGITS`` digits, so names sort by time
  (``hetero status`` shows the newest).

Each object has one writer (or, for the outcome, writers that agree), so S3's last-writer-wins
is enough: no locking.

A missing object reads as missing whether S3 answers 404 or 403
(``training.common.s3.read_object``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from training.common.folder import open_folder
from training.common.outcome import Outcome

log = logging.getLogger(__name__)

PREFIX = "job/"
DECISIONS = "autoscale/"
"""The data-tier controller's decisions, under ``PREFIX``."""
DECISION_TIME_DIGITS = 15
"""Zero-padding of a decision's milliseconds: 15 digits last until the year 33658."""


class JobRecord:
    """Read and write the job record under ``location`` (``s3://...`` or a folder path)."""

    def __init__(self, location: str, *, s3_client: Any | None = None) -> None:
        self.location = location.rstrip("/") + "/"
        self._store = open_folder(location, s3_client=s3_client)

    def _get_json(self, key: str) -> dict[str, Any] | None:
        body = self._store.read(PREFIX + key)
        if body is None:
            return None
        try:
            value = json.loads(body)
        except ValueError:
            log.warning("job record %s%s%s is not JSON: ignored", self.location, PREFIX, key)
            return None
        return value if isinstance(value, dict) else None

    def _put_json(self, key: str, value: Mapping[str, Any]) -> None:
        self._store.write(PREFIX + key, json.dumps({"time": time.time(), **value}).encode())

    # -- outcome -----------------------------------------------------------------------------

    def outcome(self) -> dict[str, Any] | None:
        """The job's final outcome, or None while the job is not over."""
        return self._get_json("outcome.json")

    def end(
        self,
        outcome: Outcome,
        *,
        reason: str,
        by: str,
        bill: Callable[[], Mapping[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        """Record the job's end (``finished``, ``failed``, or ``stopped`` by its budget) and,
        with ``bill`` (what the job cost until now, ``training.costs.bill``), its bill; a job
        already ended keeps its first outcome, which is returned. The bill is made first: the
        outcome's time is then the bill's end, as close as can be to the groups' scale to zero
        that follows; a host that ended the job meanwhile (and scaled the groups, which this
        bill may have seen as instances gone) keeps its outcome."""
        current = self.outcome()
        if current is not None:
            return current
        cost = bill() if bill is not None else None
        if cost is not None and (current := self.outcome()) is not None:
            return current
        now = float(cost["until"]) if cost is not None and "until" in cost else time.time()
        value: dict[str, Any] = {"outcome": outcome.value, "reason": reason, "by": by, "time": now}
        if cost is not None:
            value["bill"] = dict(cost)
        self._put_json("outcome.json", value)
        log.info("job record: outcome %s (%s)", outcome.value, reason)
        return value

    def started(self, now: float) -> float:
        """The job's start for its budget: ``started.json``'s, else ``now``, written there.
        Hosts that start together may both write; their times differ by seconds and the last
        write stays for everyone after."""
        current = self.started_at()
        if current is not None:
            return current
        self._put_json("started.json", {"started": now})
        return now

    def started_at(self) -> float | None:
        """``started.json``'s time, or None when no host has written it (read only)."""
        current = self._get_json("started.json")
        value = current.get("started") if current else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        return None

    def prices(self) -> Any:
        """``prices.json``'s prices as written (None: no host has written them)."""
        current = self._get_json("prices.json")
        return current.get("prices") if current else None

    def record_prices(self, prices: Any) -> None:
        """The job's prices (``jobparam.prices_to_json``). Hosts that start together may both
        write; the last write stays for everyone after."""
        self._put_json("prices.json", {"prices": prices})

    # -- hosts -------------------------------------------------------------------------------

    def mark_leaving(self, instance_id: str, reason: str) -> None:
        """This host is about to go (interruption notice, Auto Scaling termination)."""
        self._put_json(
            f"leaving/{instance_id}.json", {"instance_id": instance_id, "reason": reason}
        )

    def leaving(self) -> set[str]:
        """Instance ids that said they are leaving."""
        names = (k.rsplit("/", 1)[-1] for k in self._store.names(PREFIX + "leaving/"))
        return {n.removesuffix(".json") for n in names if n.endswith(".json")}

    def mark_replaced(self, instance_id: str, *, group: str | None, reason: str) -> None:
        """This instance could not start the launcher's job loop and leaves its group
        (``early_exit``); one object per instance, so a restarted launcher counts once."""
        self._put_json(
            f"replaced/{instance_id}.json",
            {"instance_id": instance_id, "group": group, "reason": reason},
        )

    def replaced(self) -> dict[str, dict[str, Any]]:
        """The instances taken out of service so far, by id (the job's replacement count)."""
        return self._by_instance("replaced/")

    def _by_instance(self, folder: str) -> dict[str, dict[str, Any]]:
        """The ``<instance-id>.json`` objects under ``folder``, by id."""
        out: dict[str, dict[str, Any]] = {}
        for key in self._store.names(PREFIX + folder):
            name = key[len(PREFIX) :]
            if name.endswith(".json"):
                out[name[len(folder) : -len(".json")]] = self._get_json(name) or {}
        return out

    def mark_evicted(self, instance_id: str, *, group: str | None, reason: str, by: str) -> None:
        """``by`` took ``instance_id`` out of its group (silent, or hung: ``reason``); one object
        per instance (two hosts that both act write the same fact)."""
        self._put_json(
            f"evicted/{instance_id}.json",
            {"instance_id": instance_id, "group": group, "reason": reason, "by": by},
        )

    def evicted(self) -> dict[str, dict[str, Any]]:
        """The hosts taken out so far, by id."""
        return self._by_instance("evicted/")

    def mark_hung(self, instance_id: str, generation: int, hang: Mapping[str, Any]) -> None:
        """This host's ranks hung in its ``generation`` (``hang_watch.Hang.to_json``)."""
        self._put_json(
            f"hangs/{instance_id}-{generation}.json", {"instance_id": instance_id, **hang}
        )

    def hangs(self) -> dict[str, dict[str, Any]]:
        """Every hang recorded, by ``<instance-id>-<generation>``."""
        return self._by_instance("hangs/")

    def host(self, instance_id: str) -> dict[str, Any] | None:
        """One host's latest state (None: it wrote none)."""
        return self._get_json(f"hosts/{instance_id}.json")

    def set_host(self, instance_id: str, **state: Any) -> None:
        """This host's latest state (group, address, generation, step, outcome...)."""
        self._put_json(f"hosts/{instance_id}.json", {"instance_id": instance_id, **state})

    # -- data tier ---------------------------------------------------------------------------

    def add_decision(self, decision: Mapping[str, Any]) -> None:
        """One decision of the data-tier controller (its one writer): ``autoscale/<time in
        milliseconds, zero-padded>-<step>.json``, the decision as given."""
        millis = round(float(decision["time"]) * 1000)
        key = f"{DECISIONS}{millis:0{DECISION_TIME_DIGITS}d}-{int(decision['step'])}.json"
        self._put_json(key, decision)

    def decisions(self, limit: int = 5) -> list[dict[str, Any]]:
        """The newest ``limit`` decisions, oldest first (none: an empty list)."""
        if limit <= 0:
            return []
        found: list[tuple[tuple[int, int], str]] = []
        for key in self._store.names(PREFIX + DECISIONS):
            name = key[len(PREFIX) :]
            millis, _, step = name[len(DECISIONS) :].removesuffix(".json").partition("-")
            if name.endswith(".json") and millis.isdigit() and step.isdigit():
                found.append(((int(millis), int(step)), name))
        values = (self._get_json(name) for _, name in sorted(found)[-limit:])
        return [v for v in values if v is not None]

    def hosts(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for key in self._store.names(PREFIX + "hosts/"):
            name = key[len(PREFIX) :]
            value = self._get_json(name)
            if value is not None:
                out[str(value.get("instance_id", name))] = value
        return out
