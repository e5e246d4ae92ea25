"""A per-rank log of the samples each applied optimizer step trained on, for audits.

When ``HETERO_SAMPLE_LOG_DIR`` is set, each rank appends one JSON line per applied step to
``<dir>/rank-<RANK>.jsonl``::

    {"step": N, "rank": R, "world_size": W, "epoch": E, "sample_ids": [...], "time": t}

``sample_ids`` covers every micro-batch of the step, in order, without the blank ids (-1) of
padding or unreadable samples. A voided step (stopped while waiting for data) is not logged, as
it was not applied. Each line is flushed as it is written, so a rank killed mid-run leaves every
step it applied before. ``hetero rehearse`` reads these files to count samples lost or repeated
across interruptions (a resumed run appends to the same files).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

BLANK_ID = -1


class SampleLog:
    """Appends this rank's applied steps to ``<folder>/rank-<rank>.jsonl``."""

    def __init__(self, folder: Path, *, rank: int, world_size: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank-{rank}.jsonl"
        self.rank = rank
        self.world_size = world_size
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def append(self, step: int, epoch: int, sample_ids: Sequence[torch.Tensor]) -> None:
        """Record applied step ``step``: the ids of its micro-batches, blanks left out."""
        ids = [int(i) for t in sample_ids for i in t.tolist() if int(i) != BLANK_ID]
        line = {
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": epoch,
            "sample_ids": ids,
            "time": time.time(),
        }
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_sample_log(path: Path) -> list[dict[str, object]]:
    """The lines of one rank's log (a torn last line, from a kill mid-write, is skipped)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
