"""An EC2 host's reads and writes of the job record (``training.common.jobrecord``) from its
loop: none is fatal (a failure is logged; EC2's own view still applies), and without a record
(no checkpoint location) each does nothing."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from training.common.jobrecord import JobRecord
from training.costs.bill import Census

log = logging.getLogger(__name__)


class HostRecord:
    """This host's part of the job record: its state (with the loop's ``counters``: generation,
    failures, and its ``census`` of the cluster's instances, for the job's bill), its leaving;
    and the job's outcome and leaving hosts as read from it."""

    def __init__(
        self,
        record: JobRecord | None,
        instance_id: str,
        *,
        group: str,
        address: str | None,
        counters: Callable[[], Mapping[str, int]],
    ) -> None:
        self.record = record
        self.instance_id = instance_id
        self.group = group
        self.address = address
        self.counters = counters
        self.census = Census()
        """What this host saw of the cluster's instances (``bill.Census``), written with its
        state; a launcher that Docker restarted takes up what it wrote before."""
        self._restored = False
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {}
        self._written: float | None = None
        self.writing_since: float | None = None
        """Since when every write of this host's state has succeeded (None: the last failed, or
        none was made): only a host that has been writing judges others silent."""

    def outcome(self) -> dict[str, Any] | None:
        if self.record is None:
            return None
        try:
            return self.record.outcome()
        except Exception as e:
            log.warning("could not read the job record: %s", e)
            return None

    def leaving(self) -> set[str]:
        if self.record is None:
            return set()
        try:
            return self.record.leaving()
        except Exception as e:  # S3 unreachable: EC2's own view still applies.
            log.warning("could not read the leaving hosts from the job record: %s", e)
            return set()

    def mark_leaving(self, reason: str) -> None:
        if self.record is None:
            return
        try:
            self.record.mark_leaving(self.instance_id, reason)
        except Exception as e:  # The others still see the instance go from EC2.
            log.error("could not mark this host as leaving in the job record: %s", e)

    def set(self, **state: Any) -> None:
        """Write this host's state (with the time: the others' sign that it is alive)."""
        if self.record is None:
            return
        with self._lock:
            self._state = dict(state)
            self._write()

    def refresh(self, every_s: float) -> None:
        """Write the last state again when the last write is ``every_s`` old: the liveness
        beat, whatever the loop is doing."""
        if self.record is None:
            return
        with self._lock:
            if self._written is None or time.monotonic() - self._written >= every_s:
                self._write()

    def _write(self) -> None:
        assert self.record is not None
        try:
            if not self._restored:
                self.census.load((self.record.host(self.instance_id) or {}).get("instances"))
                self._restored = True
            self.record.set_host(
                self.instance_id,
                group=self.group,
                address=self.address,
                **self.counters(),
                **self._state,
                instances=self.census.to_json(),
            )
        except Exception as e:  # Status only: never fatal.
            self.writing_since = None
            log.warning("could not update the job record: %s", e)
            return
        self._written = time.monotonic()
        if self.writing_since is None:
            self.writing_since = time.time()
