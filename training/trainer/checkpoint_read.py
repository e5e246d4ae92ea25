"""Reading a checkpoint's weights for an export: which ``step-N`` to read, and its weights alone.

A checkpoint is read in one process without a process group: DCP's ``load(..., no_dist=True)``
reads every rank's shards and reshards them into full tensors, so a checkpoint written by N
ranks with DDP, FSDP or HSDP exports the same. Only the weights are read (never the optimizer
state). An S3 step is fetched into a local folder first (``training.trainer.s3_ranges``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from training.common import s3
from training.common.steps import MARKER, step_name, step_of
from training.trainer.checkpoint import is_complete, latest_complete, step_dirs
from training.trainer.checkpoint_s3 import S3CheckpointStore
from training.trainer.model_config import ExportError

EMA_KEY = "ema"
"""The checkpoint's top-level key of the weight EMA (absent without EMA)."""
MODEL_KEY = "model"
WEIGHTS_CHOICES = ("auto", EMA_KEY, MODEL_KEY)


@dataclass(frozen=True)
class StepRef:
    """A complete checkpoint step to export."""

    path: Path
    """The local ``step-N`` folder (for S3: where its files are fetched to)."""
    step: int
    source: str
    """The folder or ``s3://.../step-N/`` URI, for messages and ``config.json``."""
    store: S3CheckpointStore | None = None
    """Set for S3 steps: nothing is fetched yet (``fetch_weights``)."""


def find_step(checkpoint: str, staging: Path, *, client: Any | None = None) -> StepRef:
    """The step to read for ``checkpoint``: a complete ``step-N`` folder or a checkpoint root
    (its newest complete step), local or ``s3://`` (fetched into ``staging`` later, by
    ``fetch_weights``). ``ExportError`` when the folder is incomplete or holds no complete
    step."""
    if s3.is_s3_uri(checkpoint):
        try:
            bucket, prefix = s3.parse_s3_uri(checkpoint)
        except ValueError as e:
            raise ExportError(f"--checkpoint: {e}") from None
        parts = prefix.rstrip("/").rsplit("/", 1)
        step = step_of(parts[-1]) if prefix else None
        if step is None:
            store = S3CheckpointStore(checkpoint, client=client)
            step = store.latest_complete()
            if step is None:
                raise ExportError(f"{checkpoint} holds no complete step-N checkpoint")
        else:
            root = s3.s3_uri(bucket, parts[0] if len(parts) == 2 else "")
            store = S3CheckpointStore(root, client=client)
            if not store.is_complete(step):
                raise _incomplete(store.step_uri(step))
        return StepRef(staging / step_name(step), step, store.step_uri(step), store)
    path = Path(checkpoint).expanduser()
    if not path.is_dir():
        raise ExportError(f"{checkpoint} is not a folder (give a step-N folder or its root)")
    named = step_of(path.name)
    if named is not None:
        if not is_complete(path):
            raise _incomplete(str(path))
        return StepRef(path, named, str(path))
    if path.name.endswith(".partial"):
        raise ExportError(f"{path} is a save in progress or cut off (.partial), not a checkpoint")
    found = latest_complete(path)
    if found is None:
        seen = [p.name for _, p in step_dirs(path)]
        hint = f" ({', '.join(seen)} have no {MARKER} marker)" if seen else ""
        raise ExportError(f"{path} holds no complete step-N checkpoint{hint}")
    step, path = found
    return StepRef(path, step, str(path))


def _incomplete(where: str) -> ExportError:
    return ExportError(
        f"{where} is not a complete checkpoint (no {MARKER} marker: a save cut off or still "
        "running); give a complete step-N, or the checkpoint root to take its newest complete "
        "step"
    )


def saved_keys(step_dir: Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor the checkpoint holds (flattened names, e.g. ``model.cls_token``) with its
    full (global) size and dtype, from DCP's ``.metadata`` alone."""
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    return {
        k: v
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def choose_weights(step_dir: Path, weights: str = "auto") -> str:
    """``ema`` or ``model``: the weights to export from ``step_dir`` (its ``.metadata`` says
    which it has); ``auto`` takes the EMA weights when the checkpoint has them."""
    if weights not in WEIGHTS_CHOICES:
        raise ExportError(f"--weights must be one of {', '.join(WEIGHTS_CHOICES)}, got {weights!r}")
    has = {k.split(".", 1)[0] for k in saved_keys(step_dir)}
    key = (EMA_KEY if EMA_KEY in has else MODEL_KEY) if weights == "auto" else weights
    if key not in has:
        raise ExportError(f"{step_dir} holds no {key!r} weights (it has: {', '.join(sorted(has))})")
    return key


def read_weights(step_dir: Path, *, weights: str = "auto") -> tuple[dict[str, torch.Tensor], str]:
    """The full weights in ``step_dir`` and which ones (``choose_weights``). Read in this
    process without a process group (DCP reshards every rank's shards into full tensors);
    the optimizer state is not read."""
    key = choose_weights(step_dir, weights)
    prefix = f"{key}."
    state = {
        name[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in saved_keys(step_dir).items()
        if name.startswith(prefix)
    }
    with warnings.catch_warnings():  # no_dist is the intent here, which DCP warns about
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: state}, checkpoint_id=str(step_dir), no_dist=True)
    return state, key
