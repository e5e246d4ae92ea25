"""Checkpoints with torch.distributed.checkpoint (DCP) in ``<dir>/step-N/`` folders.

A save goes to ``step-N.partial/`` first; when every rank has written its shards, rank 0 renames
it to ``step-N/`` and then writes the ``COMPLETE`` marker, last. Resume trusts only folders with
the marker, so a save cut off half-way (a Spot instance reclaimed mid-write) is never loaded.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
_STEP_RE = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class Restored:
    """What a checkpoint holds besides the model and optimizer."""

    step: int
    path: Path
    data_state: list[Any]
    """One entry per rank of the run that saved it: each rank's input position."""
    world_size: int


def step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """Every ``step-N`` folder under ``directory`` (complete or not), oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def latest_complete(directory: Path) -> Path | None:
    """The newest ``step-N`` folder whose marker exists; incomplete ones are skipped and logged."""
    for _step, path in reversed(step_dirs(directory)):
        if is_complete(path):
            return path
        log.warning("checkpoint %s has no %s marker (a cut-off save): ignored", path, MARKER)
    return None


class Checkpointer:
    """Saves and restores model, optimizer, step and data position; every method is collective
    (all ranks call it) unless it says otherwise."""

    def __init__(self, directory: Path, *, keep: int, rank: int, world_size: int) -> None:
        if keep < 1:
            raise ValueError(f"job.checkpoint.keep must be at least 1, got {keep}")
        self.directory = directory
        self.keep = keep
        self.rank = rank
        self.world_size = world_size

    def _barrier(self) -> None:
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()

    def save(
        self, step: int, model: nn.Module, optimizer: Optimizer, data_state: Any
    ) -> Path | None:
        """Write ``step-N/`` and its marker; returns the folder (None if it already existed)."""
        final = self.directory / f"step-{step}"
        if is_complete(final):
            return None  # Already saved (e.g. stopped right after resuming from this step).
        partial = self.directory / f"step-{step}.partial"
        started = time.perf_counter()
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        self._barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        all_data = [data_state]
        if dist.is_initialized() and self.world_size > 1:
            all_data = [None] * self.world_size
            dist.all_gather_object(all_data, data_state)
        state = {
            "model": model_sd,
            "optim": optim_sd,
            "train": {"step": step, "world_size": self.world_size, "data": json.dumps(all_data)},
        }
        dcp.save(state, checkpoint_id=str(partial))
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)  # A marker-less leftover of a cut-off save.
            os.replace(partial, final)
            _write_durably(final / MARKER, json.dumps({"step": step, "time": time.time()}))
            self._prune()
        self._barrier()
        log.info("checkpoint step %d saved to %s in %.2fs", step, final, _since(started))
        return final

    def restore_latest(self, model: nn.Module, optimizer: Optimizer) -> Restored | None:
        """Load the newest complete checkpoint into ``model`` and ``optimizer`` (None if none)."""
        path = latest_complete(self.directory)
        if path is None:
            return None
        return self.restore(path, model, optimizer)

    def restore(self, path: Path, model: nn.Module, optimizer: Optimizer) -> Restored:
        """Load ``path`` (any parallel layout: DCP reshards) into ``model`` and ``optimizer``."""
        started = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "train": {"step": 0, "world_size": 0, "data": ""},
        }
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        train = state["train"]
        log.info("resumed from %s (step %d) in %.2fs", path, train["step"], _since(started))
        return Restored(
            step=int(train["step"]),
            path=path,
            data_state=list(json.loads(train["data"])),
            world_size=int(train["world_size"]),
        )

    def _prune(self) -> None:
        """Delete complete checkpoints beyond ``keep`` (rank 0 only)."""
        complete = [p for _, p in step_dirs(self.directory) if is_complete(p)]
        for old in complete[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
            log.info("checkpoint %s removed (keep=%d)", old, self.keep)


def _write_durably(path: Path, text: str) -> None:
    """Write ``text`` and fsync the file and its folder, so the marker survives a crash."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def describe(restored: Restored | None) -> Mapping[str, Any]:
    """A JSON-friendly summary for the run log."""
    if restored is None:
        return {"resumed": False}
    return {"resumed": True, "step": restored.step, "path": str(restored.path)}
