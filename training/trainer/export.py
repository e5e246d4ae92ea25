"""A model file out: ``model.safetensors`` and a timm-style ``config.json``.

A finished job, or ``hetero export`` from any complete checkpoint, writes the consolidated
weights (the EMA weights when the checkpoint holds them) in timm's own key names and a
``config.json`` in the form timm's hub code writes and reads (``timm.models._hub``
``save_config_for_hf`` / ``load_model_config_from_path``): ``architecture``, ``num_classes``,
``num_features``, ``global_pool``, ``model_args`` (the keyword arguments the trainer gave
``timm.create_model``), ``label_names`` and ``pretrained_cfg`` (input size, mean/std,
interpolation, crop_pct of the eval transform). Plain timm loads the folder:

    timm.create_model("local-dir:/path/to/folder")          # reads config.json
    timm.create_model(architecture, pretrained=True, **model_args,
                      pretrained_cfg_overlay={"file": ".../model.safetensors",
                                              "num_classes": num_classes})

(without ``num_classes`` in the overlay timm compares the class count with the architecture's
default pretrained config, 1000 for ImageNet models, and drops the classifier when they differ).

A checkpoint is read in one process without a process group: DCP's ``load(..., no_dist=True)``
reads every rank's shards and reshards them into full tensors, so a checkpoint written by N
ranks with DDP, FSDP or HSDP exports the same. Only the weights are read (never the optimizer
state). Each file is written under a temporary name and renamed into place, so an interrupted
export never leaves a half ``model.safetensors``; to S3 both files go up after they are whole,
``config.json`` last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from training.data.transforms import EvalTransform
from training.spec import ClusterSpec
from training.trainer.checkpoint import MARKER, is_complete, latest_complete, step_dirs
from training.trainer.checkpoint_s3 import S3CheckpointStore, bounded_client, parse_s3_uri
from training.trainer.config import CheckpointConfig, ConfigError, ModelConfig, TrainerConfig
from training.trainer.model import resolve, shape_differences, some_keys

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MODEL_FOLDER = "model"
"""Where a finished job's model goes, beside its ``step-N`` folders (``model_location``)."""
EMA_KEY = "ema"
"""The checkpoint's top-level key of the weight EMA (absent without EMA)."""
MODEL_KEY = "model"
WEIGHTS_CHOICES = ("auto", EMA_KEY, MODEL_KEY)
_STEP_RE = re.compile(r"^step-(\d+)$")


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message says why and what to give."""


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote."""

    out: str
    """The folder or ``s3://`` prefix that holds both files."""
    model_file: str
    config_file: str
    weights: str
    """``ema`` (the checkpoint's EMA weights) or ``model`` (the raw weights)."""
    step: int | None
    """The checkpoint step exported (None: weights given in memory without one)."""
    source: str
    """The ``step-N`` folder or URI read (or ``memory``)."""
    architecture: str
    num_classes: int
    parameters: int
    bytes: int
    """Size of ``model.safetensors``."""
    seconds: float
    """Wall time of the whole export (download and upload included)."""
    read_s: float = 0.0
    """Of which: finding and reading the checkpoint (download included)."""
    write_s: float = 0.0
    """Of which: writing both files (upload included)."""

    def describe(self) -> str:
        step = f" of step {self.step}" if self.step is not None else ""
        kind = "EMA weights" if self.weights == EMA_KEY else "weights"
        return (
            f"{kind}{step} from {self.source}: {self.architecture}, {self.num_classes} classes, "
            f"{self.parameters / 1e6:.2f}M parameters"
        )


# -- the files ---------------------------------------------------------------------------------


def model_config_of(spec: ClusterSpec) -> ModelConfig:
    """The ``ModelConfig`` the trainer builds from ``spec`` (same validation, same defaults)."""
    return TrainerConfig.from_spec(spec, run_dir=".", synthetic=True, environ={}).model


def class_names(spec: ClusterSpec, num_classes: int) -> list[str]:
    """The dataset's class names (``build_dataset(...).classes``), or ``"0"``, ``"1"``, ... when
    the source has none, cannot be opened here, or names a different number of classes."""
    fallback = [str(i) for i in range(num_classes)]
    try:
        from training.data import build_dataset

        source = build_dataset(spec.job.dataset)
    except (ValueError, OSError) as e:
        log.warning(
            "class names: the dataset cannot be opened here (%s); using 0..%d", e, num_classes - 1
        )
        return fallback
    except Exception as e:  # S3 without credentials, a network error: names are not worth failing
        log.warning("class names: listing the dataset failed (%s); using 0..%d", e, num_classes - 1)
        return fallback
    names = getattr(source, "classes", None)
    if names is None:
        return fallback
    names = [str(n) for n in names]
    if len(names) != num_classes:
        log.warning(
            "class names: the dataset has %d classes but the model %d; using 0..%d",
            len(names),
            num_classes,
            num_classes - 1,
        )
        return fallback
    return names


def _meta_model(model_config: ModelConfig) -> tuple[str, dict[str, Any], nn.Module]:
    """The timm name, keyword arguments and the model on the meta device (no memory)."""
    name, kwargs = resolve(model_config)
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False, **kwargs)
    return name, kwargs, model


def _global_pool(model: nn.Module) -> str | None:
    for pool in (
        getattr(getattr(model, "head", None), "global_pool", None),
        getattr(model, "global_pool", None),
    ):
        pool = getattr(pool, "pool_type", pool)
        if isinstance(pool, str):
            return pool
    return None


def timm_config(
    model_config: ModelConfig,
    *,
    classes: Sequence[str],
    eval_transform: EvalTransform,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` for ``model_config``'s weights, in timm's hub form: what
    ``timm.create_model("local-dir:...")`` needs to rebuild the model and what
    ``timm.data.resolve_data_config`` needs to preprocess as the trainer evaluated (mean/std:
    ImageNet's, as the trainer normalises). ``extra`` goes under the key ``hetero``."""
    name, kwargs, model = _meta_model(model_config)
    return _config(name, kwargs, model, classes=classes, eval_transform=eval_transform, extra=extra)


def _config(
    name: str,
    kwargs: Mapping[str, Any],
    model: nn.Module,
    *,
    classes: Sequence[str],
    eval_transform: EvalTransform,
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    num_classes = int(getattr(model, "num_classes"))  # noqa: B009 - every timm classifier has it
    if len(classes) != num_classes:
        raise ExportError(f"{len(classes)} class names for a model of {num_classes} classes")
    default = dict(getattr(model, "pretrained_cfg", {}) or {})
    side = kwargs.get("img_size")
    size = [side, side] if isinstance(side, int) else list(side or default["input_size"][1:])
    in_chans = int(kwargs.get("in_chans", 3))
    same_size = list(default.get("input_size", (3, 0, 0))[1:]) == size
    pretrained_cfg = {
        "input_size": [in_chans, *size],
        "fixed_input_size": bool(default.get("fixed_input_size", False)),
        "interpolation": str(eval_transform.interpolation),
        "crop_pct": float(eval_transform.crop_pct),
        "crop_mode": "center",
        "mean": list(IMAGENET_DEFAULT_MEAN),
        "std": list(IMAGENET_DEFAULT_STD),
        "num_classes": num_classes,
        # The default's pooled feature-map size only holds at its own input size (as timm's
        # save_config_for_hf does).
        "pool_size": default.get("pool_size") if same_size else None,
        "first_conv": default.get("first_conv"),
        "classifier": default.get("classifier"),
    }
    config: dict[str, Any] = {
        "architecture": name,
        "num_classes": num_classes,
        "num_features": int(getattr(model, "num_features", 0)),
    }
    pool = _global_pool(model)
    if pool is not None:
        config["global_pool"] = pool
    args = json.loads(json.dumps(dict(kwargs)))  # tuples become lists, as JSON has them
    config.update(model_args=args, label_names=list(classes), pretrained_cfg=pretrained_cfg)
    if extra:
        config["hetero"] = dict(extra)
    return config


def _check_weights(state_dict: Mapping[str, torch.Tensor], model: nn.Module, what: str) -> None:
    """Raise ``ExportError`` unless ``state_dict`` has exactly ``model``'s keys and shapes."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    problems = _differences(expected, got)
    if problems:
        raise ExportError(f"{what} do not match the spec's job.model: " + "; ".join(problems))


def _differences(
    expected: Mapping[str, tuple[int, ...]], got: Mapping[str, tuple[int, ...]]
) -> list[str]:
    missing, unexpected, shapes = shape_differences(expected, got)
    problems = []
    if missing:
        problems.append(f"missing {some_keys(missing)}")
    if unexpected:
        problems.append(f"unexpected {some_keys(unexpected)}")
    if shapes:
        problems.append(
            "shape of "
            + some_keys([f"{k} {list(got[k])} (expected {list(expected[k])})" for k in shapes])
        )
    return problems


def _write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """``write(temporary path)`` in ``path``'s folder, fsync, then rename onto ``path``: the
    name ``path`` only ever holds a whole file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_model(
    state_dict: Mapping[str, torch.Tensor],
    *,
    model_config: ModelConfig,
    classes: Sequence[str],
    eval_transform: EvalTransform,
    out_dir: Path,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``out_dir/model.safetensors`` (``state_dict`` as contiguous CPU fp32 tensors, timm's
    key names) and then ``out_dir/config.json`` (``timm_config``); returns ``out_dir``. The
    state dict must hold exactly the keys and shapes of the model ``model_config`` builds
    (``ExportError`` otherwise); DTensors (an FSDP model's own state dict) are refused: pass
    a full state dict."""
    from safetensors.torch import save_file

    name, kwargs, meta = _meta_model(model_config)
    for key, value in state_dict.items():
        if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
            raise ExportError(
                f"{key} is a {type(value).__name__}, not a full tensor; gather the model's full "
                "state dict first (torch.distributed.checkpoint.state_dict.get_model_state_dict "
                "with StateDictOptions(full_state_dict=True, cpu_offload=True))"
            )
    _check_weights(state_dict, meta, "the weights")
    tensors = {
        k: (
            v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()
        ).contiguous()
        for k, v in state_dict.items()
    }
    config = _config(
        name, kwargs, meta, classes=classes, eval_transform=eval_transform, extra=extra
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomically(
        out_dir / MODEL_FILE, lambda p: save_file(tensors, str(p), metadata={"format": "pt"})
    )
    _write_atomically(
        out_dir / CONFIG_FILE, lambda p: p.write_text(json.dumps(config, indent=2) + "\n")
    )
    return out_dir


# -- reading a checkpoint ----------------------------------------------------------------------


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
    if checkpoint.startswith("s3://"):
        try:
            bucket, prefix = parse_s3_uri(checkpoint)
        except ValueError as e:
            raise ExportError(f"--checkpoint: {e}") from None
        parts = prefix.rstrip("/").rsplit("/", 1)
        m = _STEP_RE.match(parts[-1]) if prefix else None
        if m:
            root = f"s3://{bucket}/{parts[0] if len(parts) == 2 else ''}"
            store = S3CheckpointStore(root, client=client)
            step = int(m.group(1))
            if not store.is_complete(step):
                raise ExportError(
                    f"{store.step_uri(step)} is not a complete checkpoint (no {MARKER} marker: "
                    "a save cut off or still running); give a complete step-N, or the "
                    "checkpoint root to take its newest complete step"
                )
        else:
            store = S3CheckpointStore(checkpoint, client=client)
            newest = store.latest_complete()
            if newest is None:
                raise ExportError(f"{checkpoint} holds no complete step-N checkpoint")
            step = newest
        return StepRef(staging / f"step-{step}", step, store.step_uri(step), store)
    path = Path(checkpoint).expanduser()
    if not path.is_dir():
        raise ExportError(f"{checkpoint} is not a folder (give a step-N folder or its root)")
    m = _STEP_RE.match(path.name)
    if m:
        if not is_complete(path):
            raise ExportError(
                f"{path} is not a complete checkpoint (no {MARKER} marker: a save cut off or "
                "still running); give a complete step-N, or the checkpoint root to take its "
                "newest complete step"
            )
        return StepRef(path, int(m.group(1)), str(path))
    if path.name.endswith(".partial"):
        raise ExportError(f"{path} is a save in progress or cut off (.partial), not a checkpoint")
    found = latest_complete(path)
    if found is None:
        seen = [p.name for _, p in step_dirs(path)]
        hint = f" ({', '.join(seen)} have no {MARKER} marker)" if seen else ""
        raise ExportError(f"{path} holds no complete step-N checkpoint{hint}")
    return StepRef(found, int(found.name.removeprefix("step-")), str(found))


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


_RANGE_GAP = 1 << 20
"""Byte ranges of one file closer than this are fetched as one."""
_RANGE_CHUNK = 32 << 20
"""Largest single ranged GET (the chunks of a file are fetched in parallel)."""


def fetch_metadata(ref: StepRef) -> None:
    """Fetch the S3 step's DCP ``.metadata`` into ``ref.path`` (a no-op for a local step)."""
    if ref.store is None:
        return
    bucket, prefix = parse_s3_uri(ref.source)
    ref.path.mkdir(parents=True, exist_ok=True)
    ref.store.client.download_file(bucket, prefix + ".metadata", str(ref.path / ".metadata"))


def fetch_weights(ref: StepRef, key: str) -> int:
    """Fetch from S3 only the bytes of ``ref``'s files that hold the ``key`` tensors (the
    weights, not the optimizer state: a quarter of a checkpoint with AdamW and an EMA), each
    at its own offset in a local file of the same name, so DCP reads the folder as usual;
    returns the bytes fetched. The byte ranges come from DCP's ``.metadata`` (its file
    layout: ``relative_path``, ``offset``, ``length`` per item); a layout without them is
    downloaded whole."""
    store = ref.store
    if store is None:
        return 0
    bucket, prefix = parse_s3_uri(ref.source)
    metadata = dcp.FileSystemReader(str(ref.path)).read_metadata()
    ranges: dict[str, list[tuple[int, int]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        if not index.fqn.startswith(f"{key}."):
            continue
        try:
            start, length = int(info.offset), int(info.length)
            name = str(info.relative_path)
        except (AttributeError, TypeError, ValueError):
            log.info("unknown DCP file layout: downloading %s whole", ref.source)
            return int(store.download(ref.step, ref.path))
        ranges.setdefault(name, []).append((start, start + length))
    pieces: list[tuple[str, int, int]] = []
    for name, spans in ranges.items():
        merged: list[list[int]] = []
        for start, end in sorted(spans):
            if merged and start - merged[-1][1] <= _RANGE_GAP:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            for a in range(start, end, _RANGE_CHUNK):
                pieces.append((name, a, min(end, a + _RANGE_CHUNK)))
        (ref.path / name).touch()

    def get(name: str, start: int, end: int) -> None:
        body = store.client.get_object(
            Bucket=bucket, Key=prefix + name, Range=f"bytes={start}-{end - 1}"
        )["Body"].read()
        if len(body) != end - start:
            raise OSError(f"{ref.source}{name}: got {len(body)} bytes of {start}-{end - 1}")
        with open(ref.path / name, "r+b") as f:
            f.seek(start)
            f.write(body)

    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(get, *piece) for piece in pieces]
    for future in futures:
        future.result()
    return sum(end - start for _, start, end in pieces)


# -- S3 out ------------------------------------------------------------------------------------


def _upload(folder: Path, out: str, client: Any | None) -> tuple[str, str]:
    """Upload ``model.safetensors`` then ``config.json`` under the ``out`` prefix."""
    bucket, prefix = parse_s3_uri(out)
    client = bounded_client() if client is None else client
    uris = []
    for name in (MODEL_FILE, CONFIG_FILE):  # config.json last
        client.upload_file(str(folder / name), bucket, prefix + name)
        uris.append(f"s3://{bucket}/{prefix}{name}")
    return uris[0], uris[1]


def _write_out(
    state: Mapping[str, torch.Tensor],
    *,
    spec: ClusterSpec,
    model_config: ModelConfig,
    out: str,
    extra: Mapping[str, Any],
    client: Any | None,
    classes: Sequence[str] | None = None,
) -> tuple[str, str, str, int]:
    """(out, model file, config file, model file bytes), locally or to S3."""
    eval_transform = EvalTransform.from_spec(spec.job.eval)
    if classes is None:
        classes = class_names(spec, model_config.num_classes)

    def write(folder: Path) -> int:
        write_model(
            state,
            model_config=model_config,
            classes=classes,
            eval_transform=eval_transform,
            out_dir=folder,
            extra=extra,
        )
        return (folder / MODEL_FILE).stat().st_size

    if out.startswith("s3://"):
        try:
            parse_s3_uri(out)
        except ValueError as e:
            raise ExportError(f"--out: {e}") from None
        with tempfile.TemporaryDirectory(prefix="hetero-export-") as tmp:
            size = write(Path(tmp))
            model_uri, config_uri = _upload(Path(tmp), out, client)
        return out, model_uri, config_uri, size
    folder = Path(out).expanduser()
    size = write(folder)
    return str(folder), str(folder / MODEL_FILE), str(folder / CONFIG_FILE), size


def _provenance(source: str, step: int | None, weights: str) -> dict[str, Any]:
    return {
        "source": source,
        "step": step,
        "weights": weights,
        "timm": timm.__version__,
        "torch": torch.__version__.split("+")[0],
    }


# -- the entry points --------------------------------------------------------------------------


def export_checkpoint(
    checkpoint: str,
    *,
    spec: ClusterSpec,
    out: str,
    weights: str = "auto",
    client: Any | None = None,
) -> ExportResult:
    """Export ``checkpoint`` (a complete ``step-N`` folder, or a checkpoint root whose newest
    complete step is taken; local or ``s3://``) as ``model.safetensors`` + ``config.json`` in
    ``out`` (a local folder or an ``s3://`` prefix), for the model ``spec`` describes. One
    process, no process group. ``weights``: ``auto`` (EMA when present), ``ema`` or ``model``.
    ``client``: a boto3 S3 client (default: a bounded one from the environment)."""
    started = time.perf_counter()
    model_config = model_config_of(spec)
    with tempfile.TemporaryDirectory(prefix="hetero-export-ckpt-") as staging:
        s3_client = client
        if s3_client is None and (checkpoint.startswith("s3://") or out.startswith("s3://")):
            s3_client = bounded_client()
        ref = find_step(checkpoint, Path(staging), client=s3_client)
        step, source = ref.step, ref.source
        if ref.store is not None:
            fetch_metadata(ref)
            t0 = time.perf_counter()
            got = fetch_weights(ref, choose_weights(ref.path, weights))
            log.info("fetched %.1f MB of %s in %.2fs", got / 1e6, source, time.perf_counter() - t0)
        state, key = read_weights(ref.path, weights=weights)
    read_s = time.perf_counter() - started
    note = " (the checkpoint has no EMA weights)" if key != weights and key == MODEL_KEY else ""
    log.info(
        "export: read the %s weights of step %d from %s in %.2fs%s", key, step, source, read_s, note
    )
    return _finish(
        state,
        spec=spec,
        model_config=model_config,
        out=out,
        weights=key,
        step=step,
        source=source,
        client=s3_client,
        started=started,
        read_s=read_s,
    )


def export_weights(
    state_dict: Mapping[str, torch.Tensor],
    *,
    spec: ClusterSpec,
    out: str,
    weights: str,
    step: int | None = None,
    source: str = "memory",
    client: Any | None = None,
    classes: Sequence[str] | None = None,
) -> ExportResult:
    """Export a full (plain-tensor) state dict held in memory, as ``export_checkpoint`` does
    (not collective; ``export_trained`` gathers one from a running job). ``classes``: the class
    names (default: asked of the spec's dataset, which lists an S3 prefix again)."""
    started = time.perf_counter()
    model_config = model_config_of(spec)
    return _finish(
        state_dict,
        spec=spec,
        model_config=model_config,
        out=out,
        weights=weights,
        step=step,
        source=source,
        client=client,
        started=started,
        read_s=0.0,
        classes=classes,
    )


def _finish(
    state: Mapping[str, torch.Tensor],
    *,
    spec: ClusterSpec,
    model_config: ModelConfig,
    out: str,
    weights: str,
    step: int | None,
    source: str,
    client: Any | None,
    started: float,
    read_s: float,
    classes: Sequence[str] | None = None,
) -> ExportResult:
    t0 = time.perf_counter()
    try:
        written = _write_out(
            state,
            spec=spec,
            model_config=model_config,
            out=out,
            extra=_provenance(source, step, weights),
            client=client,
            classes=classes,
        )
    except ExportError as e:
        raise ExportError(f"{source}: {e}") from None
    folder, model_file, config_file, size = written
    name, _ = resolve(model_config)
    result = ExportResult(
        out=folder,
        model_file=model_file,
        config_file=config_file,
        weights=weights,
        step=step,
        source=source,
        architecture=name,
        num_classes=model_config.num_classes,
        parameters=sum(v.numel() for v in state.values()),
        bytes=size,
        seconds=time.perf_counter() - started,
        read_s=read_s,
        write_s=time.perf_counter() - t0,
    )
    log.info("exported %s to %s in %.2fs", result.describe(), folder, result.seconds)
    return result


def model_location(checkpoint: CheckpointConfig) -> str:
    """Where a finished job's model goes: ``model/`` beside its ``step-N`` checkpoints (in S3
    when checkpoints live there); pruning and resume only ever look at ``step-N``."""
    if checkpoint.s3_uri:
        return checkpoint.s3_uri.rstrip("/") + f"/{MODEL_FOLDER}"
    return str(checkpoint.dir / MODEL_FOLDER)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s full weights on the CPU (collective when a process group is up: every rank
    calls it; rank 0 gets them, the others an empty dict). DDP's ``module.`` prefix and FSDP's
    shards are undone by torch's ``get_model_state_dict``."""
    if not dist.is_initialized():
        inner = getattr(module, "module", module)
        return {k: v.detach().cpu() for k, v in inner.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(module, options=options)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def export_trained(
    model: nn.Module,
    ema: nn.Module | None,
    *,
    config: TrainerConfig,
    step: int,
    rank: int,
    out: str | None = None,
    classes: Sequence[str] | None = None,
) -> ExportResult | None:
    """The end of a finished job: gather the EMA weights when ``ema`` is given (else the
    model's) and write them on rank 0 to ``out`` (default ``model_location``). Collective:
    every rank calls it; returns the result on rank 0, None on the others. If rank 0 cannot
    write (a full disk, S3 unreachable), every rank raises ``ExportError`` alike (rank 0
    broadcasts the outcome), so no rank waits in a later collective for a rank that raised.
    ``classes``: the dataset's class names when the caller has them (default: asked of the
    spec's dataset, which lists an S3 prefix again)."""
    weights = EMA_KEY if ema is not None else MODEL_KEY
    state = full_state_dict(ema if ema is not None else model)
    result: ExportResult | None = None
    error: str | None = None
    if rank == 0:
        target = out or model_location(config.checkpoint)
        ckpt = config.checkpoint
        source = (
            f"{ckpt.s3_uri.rstrip('/')}/step-{step}"
            if ckpt.s3_uri
            else str(ckpt.dir / f"step-{step}")
        )
        try:
            result = export_weights(
                state,
                spec=config.spec,
                out=target,
                weights=weights,
                step=step,
                source=source,
                classes=classes,
            )
        except Exception as e:
            log.exception("exporting the model to %s failed", target)
            error = f"exporting the model to {target} failed: {type(e).__name__}: {e}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        box: list[str | None] = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ExportError(error)
    return result


# -- hetero export -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", required=True, help="the cluster spec the job ran with")
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a complete step-N folder, or a checkpoint root (its newest complete step); "
        "local or s3://",
    )
    parser.add_argument("--out", required=True, help="a local folder or an s3:// prefix")
    parser.add_argument(
        "--weights",
        choices=WEIGHTS_CHOICES,
        default="auto",
        help="auto (default): the EMA weights when the checkpoint has them, else the model's",
    )


def run(args: argparse.Namespace) -> int:
    from training.spec import load_spec

    spec = load_spec(args.spec)
    try:
        result = export_checkpoint(args.checkpoint, spec=spec, out=args.out, weights=args.weights)
    except (ExportError, ConfigError) as e:
        print(f"hetero export: {e}", file=sys.stderr)
        return 2
    print(f"exported {result.describe()}")
    print(f"wrote {result.model_file} ({result.bytes / 1e6:.1f} MB)")
    print(f"wrote {result.config_file}")
    print(f"in {result.seconds:.2f}s (read {result.read_s:.2f}s, write {result.write_s:.2f}s)")
    return 0
