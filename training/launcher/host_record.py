"""An EC2 host's reads and writes of the job record (``training.common.jobrecord``) from its
loop: none is fatal (a failure is logged; EC2's own view still applies), and without a record
(no checkpoint location) each does nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from training.common.jobrecord import JobRecord
from training.launcher.bill import Census

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
        if self.record is None:
            return
        try:
            if not self._restored:
                self.census.load((self.record.host(self.instance_id) or {}).get("instances"))
                self._restored = True
            self.record.set_host(
                self.instance_id,
                group=self.group,
                address=self.address,
                **self.counters(),
                **state,
                instances=self.census.to_json(),
            )
        except Exception as e:  # Status only: never fatal.
            log.warning("could not update the job record: %s", e)
