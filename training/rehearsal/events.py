"""The rehearsal's event log: timestamped, thread-safe, echoed to the console one line each."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    t: float
    """Seconds since the rehearsal started (monotonic clock)."""
    wall: float
    """Wall-clock time (``time.time()``)."""
    kind: str
    """``instance-launched``, ``launcher-exited``, ``fault``, ``outcome``, ..."""
    message: str
    instance: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, {})}

    def line(self) -> str:
        where = f" {self.instance}" if self.instance else ""
        return f"[{self.t:7.1f}s] {self.kind:<18}{where} {self.message}"


class EventLog:
    """Events in the order they happened; ``echo`` (default: print) gets each as one line."""

    def __init__(self, echo: Callable[[str], None] | None = None) -> None:
        self._start = time.monotonic()
        self._start_wall = time.time()
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._echo = echo if echo is not None else (lambda line: print(line, flush=True))

    @property
    def started_wall(self) -> float:
        return self._start_wall

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def add(self, kind: str, message: str, *, instance: str | None = None, **data: Any) -> Event:
        event = Event(self.elapsed(), time.time(), kind, message, instance, dict(data))
        with self._lock:
            self._events.append(event)
        self._echo(event.line())
        return event

    def events(self, kind: str | None = None) -> list[Event]:
        with self._lock:
            return [e for e in self._events if kind is None or e.kind == kind]
