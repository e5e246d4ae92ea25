"""Spot interruption watch: poll IMDS and stop the role in time to checkpoint.

EC2 publishes ``spot/instance-action`` two minutes before it stops or terminates a Spot
instance, and ``events/recommendations/rebalance`` earlier, when the instance is at elevated
risk. Either is answered the same way: SIGTERM to the role's processes, which makes the trainer
write a checkpoint and exit, so the replacement instance resumes from it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from training.launcher.imds import ImdsClient, ImdsError

log = logging.getLogger(__name__)

INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"


@dataclass(frozen=True)
class SpotNotice:
    """What IMDS announced."""

    kind: str
    """``instance-action`` (interruption in ~2 minutes) or ``rebalance`` (elevated risk)."""
    detail: str
    """IMDS's JSON body, e.g. ``{"action": "terminate", "time": "..."}``."""

    def describe(self) -> str:
        try:
            body = json.loads(self.detail)
        except json.JSONDecodeError:
            return f"{self.kind}: {self.detail}"
        if self.kind == "instance-action":
            return f"Spot interruption notice: {body.get('action')} at {body.get('time')}"
        return f"Spot rebalance recommendation at {body.get('noticeTime')}"


class SpotWatcher(threading.Thread):
    """A daemon thread that polls IMDS every ``interval_s`` and calls ``on_notice`` once, with the
    first notice it sees, then stops. IMDS errors are logged and polling goes on."""

    def __init__(
        self,
        imds: ImdsClient,
        on_notice: Callable[[SpotNotice], None],
        *,
        interval_s: float = 5.0,
        watch_rebalance: bool = True,
    ) -> None:
        super().__init__(name="spot-watcher", daemon=True)
        self._imds = imds
        self._on_notice = on_notice
        self._interval_s = interval_s
        self._paths = [("instance-action", INSTANCE_ACTION_PATH)]
        if watch_rebalance:
            self._paths.append(("rebalance", REBALANCE_PATH))
        self._stopped = threading.Event()
        self.notice: SpotNotice | None = None

    def stop(self) -> None:
        self._stopped.set()

    def check_once(self) -> SpotNotice | None:
        """One poll of every watched path; the first notice found, or None."""
        for kind, path in self._paths:
            try:
                body = self._imds.get(path)
            except ImdsError as e:
                log.warning("Spot watch: %s", e)
                continue
            if body:
                return SpotNotice(kind, body)
        return None

    def run(self) -> None:
        while not self._stopped.is_set():
            notice = self.check_once()
            if notice is not None:
                self.notice = notice
                log.warning("%s: stopping the role so it can checkpoint", notice.describe())
                self._on_notice(notice)
                return
            self._stopped.wait(self._interval_s)
