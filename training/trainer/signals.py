"""Graceful stop: SIGTERM (Spot interruption, forwarded by the launcher) or SIGINT set a flag;
the training loop checkpoints at the next step boundary and exits 0.

Ranks may receive the signal at different steps, so they agree through an all-reduce (MAX) of
the flag on a CPU (gloo) group: no GPU synchronisation per step, and no rank leaves a
collective the others are still in.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class StopSignal:
    """Records SIGTERM/SIGINT; ``agreed()`` tells every rank whether any rank got one, over
    ``group`` (None: the default group, which must then be a CPU/gloo one)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self._event = threading.Event()
        self._signum: int | None = None
        self._group = group
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignal:
        """Handle SIGTERM and SIGINT in this (main) thread from now on."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before ``install``."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: the loop decides when it is safe to stop.
        if not self._event.is_set():
            self._signum = signum
            self._event.set()

    @property
    def local(self) -> bool:
        """True once this process got a signal (no communication)."""
        return self._event.is_set()

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self._signum).name if self._signum is not None else None

    def request(self) -> None:
        """Ask for a stop as if a signal had arrived (used for ``--max-seconds``)."""
        self._event.set()

    def agreed(self) -> bool:
        """True on every rank when any rank has seen a stop request (collective)."""
        return self.agree()[0]

    def agree(self, void: bool = False) -> tuple[bool, bool]:
        """(any rank has seen a stop request, any rank says ``void``: this step must not be
        applied), the same on every rank (one collective)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.local, void
        flags = torch.tensor([int(self.local), int(void)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        stop, any_void = (bool(v) for v in flags.tolist())
        if stop and not self.local:
            log.info("another rank is stopping: stopping at this step too")
        return stop, any_void
