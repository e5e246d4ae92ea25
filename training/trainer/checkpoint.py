"""Checkpoints with torch.distributed.checkpoint (DCP) in ``<dir>/step-N/`` folders, optionally
mirrored to S3.

A save goes to ``step-N.partial/`` first; when every rank has written its shards, rank 0 renames
it to ``step-N/`` and then writes the ``COMPLETE`` marker, last. Resume trusts only folders with
the marker, so a save cut off half-way (a Spot instance reclaimed mid-write) is never loaded.

With an S3 URI (``S3CheckpointStore``) the local folder is each host's staging area and S3 is the
checkpoint: after ``dcp.save`` every host's local rank 0 uploads the files its host wrote, all
ranks agree that every upload succeeded, and only then does rank 0 upload the marker. Resume
downloads the newest complete S3 step on every host, so each has all shards before DCP loads.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from training.trainer.checkpoint_s3 import S3CheckpointStore

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
_STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointStorageError(RuntimeError):
    """A checkpoint could not be written to or read from S3; the message lists each rank's
    error. The previous complete checkpoint is untouched."""


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
    (all ranks call it) unless it says otherwise. With ``store`` the checkpoints live in S3 and
    ``directory`` is this host's staging folder (``local_rank`` 0 moves its files)."""

    def __init__(
        self,
        directory: Path,
        *,
        keep: int,
        rank: int,
        world_size: int,
        local_rank: int = 0,
        store: S3CheckpointStore | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"job.checkpoint.keep must be at least 1, got {keep}")
        self.directory = directory
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.store = store

    @property
    def _distributed(self) -> bool:
        return dist.is_initialized() and self.world_size > 1

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier()

    def _from_rank0(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` on rank 0, its result on every rank; if it raised, every rank raises
        (rather than the others waiting for a broadcast that never comes)."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box = [(fn(), None)]
            except Exception as e:
                log.exception("%s failed", what)
                box = [(None, f"{type(e).__name__}: {e}")]
        if self._distributed:
            dist.broadcast_object_list(box, src=0)
        value, error = box[0]
        if error is not None:
            raise CheckpointStorageError(f"{what} failed on rank 0: {error}")
        return value

    def _on_host_leaders(self, fn: Callable[[], None], what: str) -> None:
        """``fn()`` on each host's local rank 0, then wait for all ranks; if it raised on any
        host, every rank raises with each host's error."""
        error: str | None = None
        if self.local_rank == 0:
            try:
                fn()
            except Exception as e:
                log.exception("%s failed", what)
                error = f"rank {self.rank} on {socket.gethostname()}: {type(e).__name__}: {e}"
        errors = [error]
        if self._distributed:
            errors = [None] * self.world_size
            dist.all_gather_object(errors, error)  # Also the barrier that ends the step.
        failed = [e for e in errors if e is not None]
        if failed:
            raise CheckpointStorageError(f"{what} failed: " + "; ".join(failed))

    def save(
        self, step: int, model: nn.Module, optimizer: Optimizer, data_state: Any
    ) -> Path | None:
        """Write ``step-N/`` and its marker (and, with a store, upload it: shards from every host
        first, marker last); returns the local folder (None if the step was already saved).
        Raises ``CheckpointStorageError`` on every rank if an upload failed; the step's marker
        is then absent, so the previous complete checkpoint stays the newest."""
        final = self.directory / f"step-{step}"
        store = self.store
        # Already saved (e.g. stopped right after resuming from this step): rank 0 decides, so
        # every rank takes the same branch.
        done = self._from_rank0(
            (lambda: store.is_complete(step)) if store else (lambda: is_complete(final)),
            f"checking for checkpoint step {step}",
        )
        if done:
            return None
        partial = self.directory / f"step-{step}.partial"
        started = time.perf_counter()
        if self.local_rank == 0:  # Each host clears its own leftovers of a cut-off save.
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        if store is not None:
            # Files of a cut-off save of this step (no marker) must not mix with this one's.
            self._from_rank0(lambda: store.delete_step(step), f"clearing {store.step_uri(step)}")
        self._barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        all_data = [data_state]
        if self._distributed:
            all_data = [None] * self.world_size
            dist.all_gather_object(all_data, data_state)
        state = {
            "model": model_sd,
            "optim": optim_sd,
            "train": {"step": step, "world_size": self.world_size, "data": json.dumps(all_data)},
        }
        # dcp.save returns on every rank only after all ranks have written (its final step
        # gathers every rank's write results to rank 0 and broadcasts back).
        dcp.save(state, checkpoint_id=str(partial))
        if store is None:
            if self.rank == 0:
                shutil.rmtree(final, ignore_errors=True)  # A marker-less leftover.
                os.replace(partial, final)
                _write_durably(final / MARKER, json.dumps({"step": step, "time": time.time()}))
                self._prune_local()
            self._barrier()
        else:
            self._save_to_s3(store, step, partial, final)
        log.info("checkpoint step %d saved to %s in %.2fs", step, final, _since(started))
        return final

    def _save_to_s3(self, store: S3CheckpointStore, step: int, partial: Path, final: Path) -> None:
        """Upload each host's files of ``partial``, then (rank 0) the marker, then prune."""
        sent: list[int] = [0]

        def upload_host_files() -> None:
            sent[0] = store.upload_files(partial, step)

        t0 = time.perf_counter()
        self._on_host_leaders(upload_host_files, f"uploading checkpoint step {step} to S3")
        if self.local_rank == 0:
            log.info(
                "uploaded %.1f MB of step %d to %s in %.2fs",
                sent[0] / 1e6, step, store.step_uri(step), _since(t0),
            )  # fmt: skip

        def finish() -> None:
            if self.local_rank == 0:
                shutil.rmtree(final, ignore_errors=True)
                os.replace(partial, final)
                self._prune_local(complete_only=False)
            if self.rank == 0:
                _write_durably(final / MARKER, json.dumps({"step": step, "time": time.time()}))
                store.upload_marker(final / MARKER, step)  # Last: now the step is loadable.
                try:
                    store.prune(self.keep)
                except Exception as e:  # Extra old steps cost storage, not correctness.
                    log.warning("pruning old checkpoints in %s failed: %s", store.uri, e)

        self._on_host_leaders(finish, f"completing checkpoint step {step} in S3")

    def restore_latest(self, model: nn.Module, optimizer: Optimizer) -> Restored | None:
        """Load the newest complete checkpoint into ``model`` and ``optimizer`` (None if none).
        With a store: the newest complete S3 step, downloaded first into every host's folder."""
        store = self.store
        if store is None:
            path = latest_complete(self.directory)
            return None if path is None else self.restore(path, model, optimizer)
        step = self._from_rank0(store.latest_complete, f"listing checkpoints in {store.uri}")
        if step is None:
            return None
        path = self.directory / f"step-{step}"

        def download() -> None:
            t0 = time.perf_counter()
            got = store.download(step, path)
            log.info(
                "downloaded %.1f MB of %s in %.2fs", got / 1e6, store.step_uri(step), _since(t0)
            )

        self._on_host_leaders(download, f"downloading {store.step_uri(step)}")
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

    def _prune_local(self, *, complete_only: bool = True) -> None:
        """Delete local checkpoints beyond ``keep``: complete ones (the local folder is the
        checkpoint), or any ``step-N`` (with S3, where it only stages this host's files)."""
        kept = [p for _, p in step_dirs(self.directory) if not complete_only or is_complete(p)]
        for old in kept[: -self.keep]:
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
