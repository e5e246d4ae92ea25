"""Checkpoints with torch.distributed.checkpoint (DCP) in ``<dir>/step-N/`` folders, optionally
mirrored to S3.

A save goes to ``step-N.partial/`` first; when every rank has written its shards, rank 0 renames
it to ``step-N/`` and then writes the ``COMPLETE`` marker, last. Resume trusts only folders with
the marker, so a save cut off half-way (a Spot instance reclaimed mid-write) is never loaded.
Every rank returns from a save (and logs it as saved) only after the marker is written: the
ranks agree after it, so no rank counts a step that another could not finish.

Without S3 the folder must be one that every trainer host sees (one host, or a shared
filesystem): DCP writes the ``.metadata`` file only on rank 0's host, and DDP's weights, which
are the same on every rank, are written once (deduplicated), so a host's own folder holds only
part of a checkpoint and no other host could load it. ``check_shared_folder`` finds out at start
(rank 0 writes a probe file; every host looks for it) and stops every rank with an error that
says to use an S3 URI when the hosts do not share the folder.

With an S3 URI (``S3CheckpointStore``) the local folder is each host's staging area and S3 is the
checkpoint: after ``dcp.save`` every host's local rank 0 uploads the files its host wrote, all
ranks agree that every upload succeeded, and only then does rank 0 upload the marker. Resume
downloads the newest complete S3 step on every host, so each has all shards before DCP loads.

``start_async`` / ``advance`` are the same save in the background (``dcp.async_save``): the
state is copied to host memory before ``start_async`` returns, the write (and with S3 the
upload) runs on threads, and the caller calls ``advance`` on every rank once every rank's
background work is done (``PendingSave.busy`` is False everywhere); the step is complete when
``advance`` returns its folder.

All checkpoint collectives run on ``group`` (a gloo group with a long timeout: a slow upload is
not a lost peer); DCP's own collectives in a background save run on ``async_group``, so the
background thread never shares a group with the training loop.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from training.common.files import write_atomically
from training.common.steps import MARKER, partial_name, step_name, step_of
from training.trainer.checkpoint_s3 import S3CheckpointStore
from training.trainer.config import ConfigError

log = logging.getLogger(__name__)

_PROBE_PREFIX = ".shared-probe-"


class TrainState(Protocol):
    """Plain training state (a few JSON values, the same on every rank) saved with every
    checkpoint: the non-finite step counters (``training.trainer.nonfinite``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointStorageError(RuntimeError):
    """A checkpoint could not be written or read (a local folder or S3); the message lists each
    rank's error. Raised on every rank alike; the previous complete checkpoint is untouched."""


@dataclass(frozen=True)
class Restored:
    """What a checkpoint holds besides the model and optimizer."""

    step: int
    path: Path
    data_state: list[Any]
    """One entry per rank of the run that saved it: each rank's input position."""
    world_size: int


@dataclass
class PendingSave:
    """A background save in flight (see ``Checkpointer.start_async``)."""

    step: int
    partial: Path
    final: Path
    write: Future[Any]
    """DCP's background write of this rank's shards."""
    staged: Future[Any] | None = None
    """Set when DCP copies the state to host memory in the background too."""
    upload: Future[Any] | None = None
    """With S3, on each host's local rank 0: the upload of this host's files."""
    phase: str = "write"
    """``write`` (DCP writing), then with S3 ``upload``."""
    started: float = field(default_factory=time.perf_counter)

    @property
    def _running(self) -> Future[Any] | None:
        return self.write if self.phase == "write" else self.upload

    @property
    def busy(self) -> bool:
        """True while this rank's background work of the current phase runs (no communication)."""
        return self._running is not None and not self._running.done()

    def wait_staged(self) -> None:
        """Return once the state has been copied out (the model may change after that)."""
        if self.staged is not None:
            self.staged.result()

    def wait(self) -> None:
        """Block until this rank's background work of the current phase is done (it may have
        failed: ``advance`` reports that)."""
        if self._running is not None:
            self._running.exception()  # Waits; never raises the work's own error.


def step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """Every ``step-N`` folder under ``directory`` (complete or not), oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        step = step_of(child.name)
        if step is not None and child.is_dir():
            found.append((step, child))
    return sorted(found)


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def latest_complete(directory: Path) -> tuple[int, Path] | None:
    """The newest ``step-N`` folder whose marker exists, with its N; incomplete ones are skipped
    and logged."""
    for step, path in reversed(step_dirs(directory)):
        if is_complete(path):
            return step, path
        log.warning("checkpoint %s has no %s marker (a cut-off save): ignored", path, MARKER)
    return None


def completed_at(path: Path) -> float | None:
    """When the checkpoint in ``path`` was marked complete (Unix seconds, from its marker), or
    None if the marker is missing or has no time (not collective)."""
    try:
        value = json.loads((path / MARKER).read_text()).get("time")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


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
        group: dist.ProcessGroup | None = None,
        async_group: dist.ProcessGroup | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"job.checkpoint.keep must be at least 1, got {keep}")
        self.directory = directory
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.store = store
        self.group = group
        """Checkpoint collectives (None: the default group)."""
        self.async_group = async_group
        """DCP's collectives in background saves (None: ``group``)."""
        self._uploader: ThreadPoolExecutor | None = None
        self.extra: dict[str, nn.Module] = {}
        """More modules saved and restored with every checkpoint, under their key (the weight
        EMA: ``"ema"``). A checkpoint without a key's state starts it from the model's."""
        self.train_state: dict[str, TrainState] = {}
        """Plain state saved with every checkpoint as JSON under ``train.<key>`` (the
        non-finite step counters: ``"nonfinite"``). A checkpoint without a key's state leaves
        it as it is."""

    @property
    def _distributed(self) -> bool:
        return dist.is_initialized() and self.world_size > 1

    @property
    def _where(self) -> str:
        return socket.gethostname()

    def from_rank0(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` on rank 0, its result on every rank; if it raised, every rank raises
        (rather than the others waiting for a broadcast that never comes)."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box = [(fn(), None)]
            except Exception as e:
                log.exception("%s failed", what)
                box = [(None, _error_text(e))]
        if self._distributed:
            dist.broadcast_object_list(box, src=0, group=self.group)
        value, error = box[0]
        if error is not None:
            raise CheckpointStorageError(f"{what} failed on rank 0: {error}")
        return value

    def _agree(self, error: str | None, what: str) -> None:
        """Every rank passes its own error (None: fine); every rank raises if any had one, with
        each failing rank's error and host (an all-gather, which is also the barrier)."""
        mine = None if error is None else f"rank {self.rank} on {self._where}: {error}"
        errors: list[str | None] = [mine]
        if self._distributed:
            errors = [None] * self.world_size
            dist.all_gather_object(errors, mine, group=self.group)
        failed = [e for e in errors if e is not None]
        if failed:
            raise CheckpointStorageError(f"{what} failed: " + "; ".join(failed))

    def _on_host_leaders(self, fn: Callable[[], None], what: str) -> None:
        """``fn()`` on each host's local rank 0, then wait for all ranks; if it raised on any
        host, every rank raises with each host's error."""
        error: str | None = None
        if self.local_rank == 0:
            try:
                fn()
            except Exception as e:
                log.exception("%s failed", what)
                error = _error_text(e)
        self._agree(error, what)

    # -- start -------------------------------------------------------------------------------

    def check_shared_folder(self) -> None:
        """Without S3 and with several hosts, make sure every host sees the same folder; else
        raise ``ConfigError`` on every rank (DCP's ``.metadata`` and DDP's deduplicated weights
        are written on rank 0's host only, so no other host could load a checkpoint from its
        own folder)."""
        if not self._distributed or self.store is not None:
            return

        def write_probe() -> str:
            self.directory.mkdir(parents=True, exist_ok=True)
            name = f"{_PROBE_PREFIX}{uuid.uuid4().hex}"
            (self.directory / name).write_text(self._where)
            return name

        probe = self.from_rank0(write_probe, f"writing a probe file into {self.directory}")
        mine = None
        if self.local_rank == 0:
            mine = (self.rank, self._where, (self.directory / probe).is_file())
        seen: list[Any] = [None] * self.world_size
        dist.all_gather_object(seen, mine, group=self.group)
        if self.rank == 0:
            (self.directory / probe).unlink(missing_ok=True)
        hosts = [s for s in seen if s is not None]
        blind = [f"rank {r} on {host}" for r, host, sees in hosts if not sees]
        if len(hosts) > 1 and blind:
            raise ConfigError(
                [
                    f"the checkpoint folder {self.directory} is not shared between the "
                    f"{len(hosts)} trainer hosts ({', '.join(blind)} cannot see rank 0's "
                    "files) and no S3 URI is set. A host's own folder would hold only part of "
                    "each checkpoint (DCP's .metadata and DDP's deduplicated weights are "
                    "written on rank 0's host only), so no other host could resume from it. "
                    "Keep checkpoints in S3: --checkpoint-s3-uri s3://BUCKET/PREFIX (the "
                    "launcher passes HETERO_CHECKPOINT_URI), or put job.checkpoint.dir on a "
                    "filesystem every host mounts"
                ]
            )

    # -- save --------------------------------------------------------------------------------

    def save(
        self, step: int, model: nn.Module, optimizer: Optimizer, data_state: Any
    ) -> Path | None:
        """Write ``step-N/`` and its marker (and, with a store, upload it: shards from every host
        first, marker last); returns the local folder (None if the step was already saved).
        Returns on every rank only once the marker is written. Raises
        ``CheckpointStorageError`` on every rank if any rank's write or upload failed; the
        step's marker is then absent, so the previous complete checkpoint stays the newest."""
        started = time.perf_counter()
        prepared = self._prepare(step)
        if prepared is None:
            return None
        partial, final = prepared
        try:
            state = self._state(step, model, optimizer, data_state)
            error = None
            try:
                # Returns on every rank only after all ranks have written.
                dcp.save(state, checkpoint_id=str(partial), process_group=self.group)
            except Exception as e:
                log.exception("writing checkpoint step %d failed", step)
                error = _error_text(e)
            self._agree(error, f"writing checkpoint step {step}")
            if self.store is None:
                self._finish_local(step, partial, final)
            else:
                self._upload_now(self.store, step, partial)
                self._finish_s3(self.store, step, partial, final)
        except CheckpointStorageError:
            self._discard(partial)
            raise
        log.info(
            "checkpoint step %d saved to %s in %.2fs", step, self._target(step), _since(started)
        )
        return final

    def start_async(
        self, step: int, model: nn.Module, optimizer: Optimizer, data_state: Any
    ) -> PendingSave | None:
        """Start saving ``step`` in the background; returns once the state is copied to host
        memory (or ``PendingSave.wait_staged`` says when), None if the step is already saved.
        Call ``advance`` on every rank when no rank's save is ``busy``."""
        prepared = self._prepare(step)
        if prepared is None:
            return None
        partial, final = prepared
        state = self._state(step, model, optimizer, data_state)
        response = dcp.async_save(
            state, checkpoint_id=str(partial), process_group=self.async_group or self.group
        )
        if isinstance(response, Future):
            return PendingSave(step, partial, final, write=response)
        return PendingSave(
            step,
            partial,
            final,
            write=response.upload_completion,
            staged=response.staging_completion,
        )

    def advance(self, pending: PendingSave) -> Path | None:
        """Take ``pending`` to its next phase once every rank's background work of this phase
        is done: the final folder when the step is complete (marker written, uploaded with S3),
        None while an upload phase runs in the background. Raises ``CheckpointStorageError``
        on every rank if any rank's write or upload failed."""
        step, store = pending.step, self.store
        try:
            if pending.phase == "write":
                error = pending.write.exception()
                if error is not None:
                    log.error("writing checkpoint step %d failed: %s", step, error)
                self._agree(
                    None if error is None else _error_text(error),
                    f"writing checkpoint step {step}",
                )
                if store is None:
                    self._finish_local(step, pending.partial, pending.final)
                    return self._saved(pending)
                pending.phase = "upload"
                if self.local_rank == 0:
                    if self._uploader is None:
                        self._uploader = ThreadPoolExecutor(
                            max_workers=1, thread_name_prefix="checkpoint-upload"
                        )
                    pending.upload = self._uploader.submit(
                        store.upload_files, pending.partial, step
                    )
                return None
            error = pending.upload.exception() if pending.upload is not None else None
            if error is not None:
                log.error("uploading checkpoint step %d failed: %s", step, error)
            self._agree(
                None if error is None else _error_text(error),
                f"uploading checkpoint step {step} to S3",
            )
            assert store is not None
            self._finish_s3(store, step, pending.partial, pending.final)
            return self._saved(pending)
        except CheckpointStorageError:
            self._discard(pending.partial)
            raise

    def _saved(self, pending: PendingSave) -> Path:
        log.info(
            "checkpoint step %d saved to %s in the background in %.2fs",
            pending.step, self._target(pending.step), _since(pending.started),
        )  # fmt: skip
        return pending.final

    def _target(self, step: int) -> str:
        return self.store.step_uri(step) if self.store else str(self.directory / step_name(step))

    def _prepare(self, step: int) -> tuple[Path, Path] | None:
        """Clear leftovers of an earlier save of ``step``; None if ``step`` is already complete
        (e.g. stopped right after resuming from it: rank 0 decides, so every rank agrees)."""
        final = self.directory / step_name(step)
        store = self.store
        done = self.from_rank0(
            (lambda: store.is_complete(step)) if store else (lambda: is_complete(final)),
            f"checking for checkpoint step {step}",
        )
        if done:
            return None
        partial = self.directory / partial_name(step)

        def clear_local() -> None:  # Each host clears its own leftovers of a cut-off save.
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)

        self._on_host_leaders(clear_local, f"preparing {partial}")
        if store is not None:
            # Files of a cut-off save of this step (no marker) must not mix with this one's.
            self.from_rank0(lambda: store.delete_step(step), f"clearing {store.step_uri(step)}")
        return partial, final

    def _state(
        self, step: int, model: nn.Module, optimizer: Optimizer, data_state: Any
    ) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        all_data = [data_state]
        if self._distributed:
            all_data = [None] * self.world_size
            dist.all_gather_object(all_data, data_state, group=self.group)
        train: dict[str, Any] = {
            "step": step,
            "world_size": self.world_size,
            "data": json.dumps(all_data),
        }
        for key, train_state in self.train_state.items():
            train[key] = json.dumps(train_state.state_dict(), sort_keys=True)
        state = {"model": model_sd, "optim": optim_sd, "train": train}
        for key, module in self.extra.items():
            state[key] = module.state_dict()
        return state

    def _finish_local(self, step: int, partial: Path, final: Path) -> None:
        """Rank 0 renames the folder into place, writes the marker and prunes; every rank
        returns after that (or raises with rank 0's error)."""

        def finish() -> None:
            shutil.rmtree(final, ignore_errors=True)  # A marker-less leftover.
            os.replace(partial, final)
            _write_marker(final, step)
            self._prune_local()

        self.from_rank0(finish, f"completing checkpoint step {step}")

    def _upload_now(self, store: S3CheckpointStore, step: int, partial: Path) -> None:
        """Each host's local rank 0 uploads its host's files of ``partial``; all ranks agree."""
        sent: list[int] = [0]
        t0 = time.perf_counter()

        def upload_host_files() -> None:
            sent[0] = store.upload_files(partial, step)

        self._on_host_leaders(upload_host_files, f"uploading checkpoint step {step} to S3")
        if self.local_rank == 0:
            log.info(
                "uploaded %.1f MB of step %d to %s in %.2fs",
                sent[0] / 1e6, step, store.step_uri(step), _since(t0),
            )  # fmt: skip

    def _finish_s3(self, store: S3CheckpointStore, step: int, partial: Path, final: Path) -> None:
        """Rename each host's staging folder, then (rank 0) write and upload the marker and
        prune; every rank returns once the marker is in S3 (or raises)."""

        def finish() -> None:
            if self.local_rank == 0:
                shutil.rmtree(final, ignore_errors=True)
                os.replace(partial, final)
                self._prune_local(complete_only=False)
            if self.rank == 0:
                _write_marker(final, step)
                store.upload_marker(final / MARKER, step)  # Last: now the step is loadable.
                try:
                    store.prune(self.keep)
                except Exception as e:  # Extra old steps cost storage, not correctness.
                    log.warning("pruning old checkpoints in %s failed: %s", store.uri, e)

        self._on_host_leaders(finish, f"completing checkpoint step {step} in S3")

    def _discard(self, partial: Path) -> None:
        """Drop this host's files of a failed save (not collective; best effort)."""
        if self.local_rank == 0:
            shutil.rmtree(partial, ignore_errors=True)

    # -- restore -----------------------------------------------------------------------------

    def restore_latest(self, model: nn.Module, optimizer: Optimizer) -> Restored | None:
        """Load the newest complete checkpoint into ``model`` and ``optimizer`` (None if none).
        Rank 0 picks the step; every host checks that it can read it (with a store: downloads
        it) before any rank loads, and every rank raises ``CheckpointStorageError`` naming the
        step and each host that cannot, rather than loading different steps or waiting."""
        store = self.store
        if store is None:
            found = self.from_rank0(
                lambda: latest_complete(self.directory), f"listing checkpoints in {self.directory}"
            )
            if found is None:
                return None
            newest = found[0]
            path = self.directory / step_name(newest)

            def readable() -> None:
                if not is_complete(path) or not (path / ".metadata").is_file():
                    raise FileNotFoundError(
                        f"{path} is missing or incomplete on this host (no {MARKER} or "
                        ".metadata); rank 0 chose it"
                    )

            self._on_host_leaders(readable, f"loading checkpoint step {newest}")
            return self.restore(path, model, optimizer)

        step = self.from_rank0(store.latest_complete, f"listing checkpoints in {store.uri}")
        if step is None:
            return None
        path = self.directory / step_name(step)

        def download() -> None:
            t0 = time.perf_counter()
            got = store.download(step, path)
            log.info(
                "downloaded %.1f MB of %s in %.2fs", got / 1e6, store.step_uri(step), _since(t0)
            )

        self._on_host_leaders(download, f"downloading checkpoint step {step} from {store.uri}")
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
        saved: set[str] = set()
        if self.extra or self.train_state:  # which of them this checkpoint holds
            saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        for key in self.train_state:
            if f"train.{key}" in saved:
                state["train"][key] = ""
            else:
                log.info("%s holds no %r state: it stays as it is", path, key)
        for key, module in self.extra.items():
            if any(k.startswith(f"{key}.") for k in saved):
                state[key] = module.state_dict()
            else:
                log.warning("%s holds no %r state: it starts from the current weights", path, key)
                inner = model.module if isinstance(model, DistributedDataParallel) else model
                module.load_state_dict(inner.state_dict())
        dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        for key, module in self.extra.items():
            if key in state:
                module.load_state_dict(state[key])
        train = state["train"]
        for key, train_state in self.train_state.items():
            if train.get(key):
                train_state.load_state_dict(json.loads(train[key]))
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

    def close(self) -> None:
        """Stop the upload thread without waiting for it (not collective)."""
        if self._uploader is not None:
            self._uploader.shutdown(wait=False, cancel_futures=True)
            self._uploader = None


def _write_marker(folder: Path, step: int) -> None:
    write_atomically(folder / MARKER, json.dumps({"step": step, "time": time.time()}), fsync=True)


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def describe(restored: Restored | None) -> Mapping[str, Any]:
    """A JSON-friendly summary for the run log."""
    if restored is None:
        return {"resumed": False}
    return {"resumed": True, "step": restored.step, "path": str(restored.path)}
