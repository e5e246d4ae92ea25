"""The trainer's sample logs: what every rank applied, step by step.

With ``HETERO_SAMPLE_LOG_DIR`` set, each trainer rank appends one JSON line per applied step to
``rank-<RANK>.jsonl``: ``{"step", "rank", "world_size", "epoch", "sample_ids", "time"}``. Ranks of
successive generations (after a resume) append to the same files, so a step redone after a
rollback appears twice. ``current_step`` is where the job is now: the highest step logged.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_RANK_FILE_RE = re.compile(r"^rank-(\d+)\.jsonl$")


@dataclass(frozen=True)
class SampleRecord:
    step: int
    rank: int
    world_size: int
    epoch: int
    sample_ids: tuple[int, ...]
    time: float
    order: int = 0
    """Position of the line in its rank file (later lines are later applications)."""


def parse_record(line: str, order: int = 0) -> SampleRecord | None:
    """One line, or None when it is torn or not a record (the writer may be mid-line)."""
    try:
        d = json.loads(line)
        return SampleRecord(
            step=int(d["step"]),
            rank=int(d["rank"]),
            world_size=int(d["world_size"]),
            epoch=int(d["epoch"]),
            sample_ids=tuple(int(i) for i in d["sample_ids"]),
            time=float(d["time"]),
            order=order,
        )
    except (ValueError, KeyError, TypeError):
        return None


def rank_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _RANK_FILE_RE.match(p.name))


def read_sample_logs(folder: Path) -> list[SampleRecord]:
    """Every complete record under ``folder``, each rank file in its own (append) order."""
    records: list[SampleRecord] = []
    for path in rank_files(folder):
        text = path.read_text(errors="replace")
        for i, line in enumerate(text.splitlines()):
            if line.strip():
                record = parse_record(line, order=i)
                if record is not None:
                    records.append(record)
                else:
                    log.warning("%s line %d is not a sample record: ignored", path, i + 1)
    return records


class StepWatcher:
    """Follows the rank files as they grow; ``current_step()`` is the highest step logged.

    Reads only what was appended since the last call, so polling it every few hundred
    milliseconds stays cheap over a long run. Thread-safe.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()
        self._offsets: dict[Path, int] = {}
        self._max_step = 0
        self._last_time = 0.0

    def current_step(self) -> int:
        with self._lock:
            for path in rank_files(self.folder):
                self._read_new(path)
            return self._max_step

    @property
    def last_record_time(self) -> float:
        """Wall time of the newest record read so far (0.0 before any)."""
        return self._last_time

    def _read_new(self, path: Path) -> None:
        offset = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind(b"\n")
        if end < 0:
            return  # no complete line yet
        for line in chunk[: end + 1].decode(errors="replace").splitlines():
            record = parse_record(line)
            if record is not None:
                self._max_step = max(self._max_step, record.step)
                self._last_time = max(self._last_time, record.time)
        self._offsets[path] = offset + end + 1


def current_step(folder: Path) -> int:
    """The highest step in the sample logs under ``folder`` (0 before the first)."""
    return StepWatcher(folder).current_step()
