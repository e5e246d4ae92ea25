"""Spot and Auto Scaling watch: poll IMDS and act in time to checkpoint.

Three things can appear in instance metadata, and they are answered differently:

- ``spot/instance-action``: EC2 will stop or terminate this Spot instance in about two minutes
  (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html).
  Answer: stop (the trainer checkpoints at the next step boundary and exits "stopped").
- ``autoscaling/target-lifecycle-state`` = ``Terminated``: Auto Scaling is terminating this
  instance, for instance after Capacity Rebalancing launched its replacement. That is not a Spot
  notice; a termination lifecycle hook keeps the instance running until the launcher completes
  the lifecycle action (https://docs.aws.amazon.com/autoscaling/ec2/userguide/retrieving-target-lifecycle-state-through-imds.html).
  Answer: stop, like an interruption.
- ``events/recommendations/rebalance``: the instance is at elevated risk of interruption
  (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html).
  Answer: a proactive checkpoint, and training goes on; the watch continues.
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
TARGET_LIFECYCLE_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"

INSTANCE_ACTION = "instance-action"
ASG_TERMINATION = "asg-termination"
REBALANCE = "rebalance"


@dataclass(frozen=True)
class SpotNotice:
    """What IMDS announced."""

    kind: str
    """``instance-action``, ``asg-termination`` or ``rebalance``."""
    detail: str
    """IMDS's body, e.g. ``{"action": "terminate", "time": "..."}`` or ``Terminated``."""

    @property
    def stops(self) -> bool:
        """True when this host must stop (the instance is going away)."""
        return self.kind != REBALANCE

    def describe(self) -> str:
        if self.kind == ASG_TERMINATION:
            return "Auto Scaling termination (target lifecycle state Terminated)"
        try:
            body = json.loads(self.detail)
        except json.JSONDecodeError:
            return f"{self.kind}: {self.detail}"
        if self.kind == INSTANCE_ACTION:
            return f"Spot interruption notice: {body.get('action')} at {body.get('time')}"
        return f"Spot rebalance recommendation at {body.get('noticeTime')}"


class SpotWatcher(threading.Thread):
    """A daemon thread that polls IMDS every ``interval_s``. The first stopping notice
    (interruption or Auto Scaling termination) goes to ``on_notice`` and ends the watch; a
    rebalance recommendation goes to ``on_rebalance`` once (or, without one, to ``on_notice``,
    which then ends the watch). IMDS errors are logged and polling goes on."""

    def __init__(
        self,
        imds: ImdsClient,
        on_notice: Callable[[SpotNotice], None],
        *,
        interval_s: float = 5.0,
        on_rebalance: Callable[[SpotNotice], None] | None = None,
    ) -> None:
        super().__init__(name="spot-watcher", daemon=True)
        self._imds = imds
        self._on_notice = on_notice
        self._on_rebalance = on_rebalance
        self._interval_s = interval_s
        self._rebalance_seen = False
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def _get(self, path: str) -> str | None:
        try:
            return self._imds.get(path)
        except ImdsError as e:
            log.warning("Spot watch: %s", e)
            return None

    def check_once(self) -> SpotNotice | None:
        """One poll: a stopping notice first, else a rebalance recommendation not yet reported,
        else None."""
        body = self._get(INSTANCE_ACTION_PATH)
        if body:
            return SpotNotice(INSTANCE_ACTION, body)
        state = self._get(TARGET_LIFECYCLE_PATH)
        if state and state.strip() == "Terminated":
            return SpotNotice(ASG_TERMINATION, state.strip())
        if not self._rebalance_seen:
            body = self._get(REBALANCE_PATH)
            if body:
                return SpotNotice(REBALANCE, body)
        return None

    def run(self) -> None:
        while not self._stopped.is_set():
            notice = self.check_once()
            if notice is not None and not notice.stops and self._on_rebalance is not None:
                self._rebalance_seen = True
                log.warning("%s: taking a checkpoint now", notice.describe())
                self._on_rebalance(notice)
            elif notice is not None:
                log.warning("%s: stopping the role so it can checkpoint", notice.describe())
                self._on_notice(notice)
                return
            self._stopped.wait(self._interval_s)
