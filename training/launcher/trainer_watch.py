"""A data server's watch for trainers: with none alive for a bounded time, the job ends failed.

Data servers wait for trainers; trainers that never come (every trainer boot gives up and its
replacement too, every trainer launcher fails before its loop) would leave them serving nothing,
billing, forever. Every trainer host writes its state to the job record
(``hosts/<instance-id>.json``, with the time of the write) when it waits for peers, at each
generation and every 30 s while it trains. A data server's launcher reads those records: when no
trainer host has written for ``timeout_s`` (counted from the data server's own start at the
earliest), no trainer is alive, and the job ends ``failed`` with the reason
(``job_end.end_job``: every group to zero).

The default, ``NO_TRAINER_TIMEOUT_S``, is longer than a trainer's longest silence: its wait for
peers (``--peer-timeout``, 900 s) after its ``waiting-for-peers`` write, plus a replacement's
boot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from training.common.jobrecord import JobRecord

log = logging.getLogger(__name__)

NO_TRAINER_TIMEOUT_S = 1800.0
"""Seconds without any trainer host's write to the job record before a data server ends the job
(``hetero launch --no-trainer-timeout``)."""


def newest_trainer_write(
    hosts: dict[str, dict[str, Any]], trainer_groups: Collection[str]
) -> tuple[float | None, str | None]:
    """The newest ``time`` written by a host of ``trainer_groups``, and that host's id."""
    writes = [
        (float(state["time"]), instance_id)
        for instance_id, state in hosts.items()
        if state.get("group") in trainer_groups and isinstance(state.get("time"), int | float)
    ]
    newest = max(writes, key=lambda w: w[0], default=None)  # the first of equals
    return newest if newest is not None else (None, None)


def last_trainer_write(
    record: JobRecord, trainer_groups: Collection[str]
) -> tuple[float | None, str | None] | None:
    """``newest_trainer_write`` of the job record's hosts; None (logged) when the record cannot
    be read: no decision without it."""
    try:
        hosts = record.hosts()
    except Exception as e:
        log.warning("could not read the job record's hosts: %s", e)
        return None
    return newest_trainer_write(hosts, trainer_groups)


class NoTrainerWatch:
    """``check()`` returns the reason to end the job once no trainer host has written to the job
    record for ``timeout_s``; None otherwise (and while the record cannot be read)."""

    def __init__(
        self,
        record: JobRecord,
        trainer_groups: Collection[str],
        *,
        timeout_s: float = NO_TRAINER_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.record = record
        self.trainer_groups = frozenset(trainer_groups)
        self.timeout_s = timeout_s
        self.clock = clock
        self.started = clock()

    def check(self) -> str | None:
        last = last_trainer_write(self.record, self.trainer_groups)
        if last is None:
            return None
        newest, who = last
        since = max(self.started, newest) if newest is not None else self.started
        silent = self.clock() - since
        if silent < self.timeout_s:
            return None
        seen = (
            f"the last trainer host to write was {who}, {silent:.0f} s ago"
            if newest is not None and newest >= self.started
            else "no trainer host wrote since this data server started"
        )
        return (
            f"no live trainer host for {self.timeout_s:.0f} s (job record hosts/: {seen}); "
            "the data servers would serve nobody"
        )
