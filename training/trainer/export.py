"""A model file out: ``model.safetensors`` and a timm-style ``config.json``.

A finished job, or ``hetero export`` from any complete checkpoint, writes the consolidated
weights (the EMA weights when the checkpoint holds them) in timm's own key names and a
``config.json`` in the form timm's hub code writes and reads (``timm.models._hub``
``save_config_for_hf`` / ``load_model_config_from_path``): ``architecture``, ``num_classes``,
``num_features``, ``global_pool``, ``model_args`` (the keyword arguments the trainer gave
``timm.create_model``), ``label_names`` and ``pretrained_cfg`` (input size and the job's data
config: mean/std, interpolation, crop_pct; ``training.trainer.data_config``). Plain timm
(>= 1.0.21) loads the folder:

    timm.create_model("local-dir:/path/to/folder")          # reads config.json
    timm.create_model(architecture, pretrained=True, **model_args,
                      pretrained_cfg_overlay={**pretrained_cfg,
                                              "file": ".../model.safetensors"})

(the whole ``pretrained_cfg`` in the overlay: without its ``num_classes`` timm compares the class
count with the architecture's default pretrained config, 1000 for ImageNet models, and drops the
classifier when they differ; without its ``custom_load`` false, timm < 1.0.31 hands the file to
the ViT's ``.npz`` loader for architectures whose registry weights are ``.npz``).

The checkpoint is read by ``training.trainer.checkpoint_read`` (one process, no process group,
the weights only; from S3 only their byte ranges, ``training.trainer.s3_ranges``) and the
``config.json`` comes from ``training.trainer.model_config``. Each file is written under a
temporary name and renamed into place, so an interrupted export never leaves a half
``model.safetensors``; to S3 both files go up after they are whole, ``config.json`` last.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from training.common import aws, s3
from training.common.files import write_atomically
from training.common.folder import S3Folder
from training.common.steps import step_name
from training.spec import ClusterSpec
from training.trainer.checkpoint_read import (
    EMA_KEY,
    MODEL_KEY,
    choose_weights,
    find_step,
    read_weights,
)
from training.trainer.config import CheckpointConfig, ModelConfig, TrainerConfig
from training.trainer.data_config import DataConfig
from training.trainer.model import meta_model, resolve
from training.trainer.model_config import (
    ExportError,
    check_weights,
    class_names,
    data_config_of,
    model_config_of,
    timm_config,
)
from training.trainer.parallelize import full_state_dict
from training.trainer.s3_ranges import fetch_metadata, fetch_weights

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MODEL_FOLDER = "model"
"""Where a finished job's model goes, beside its ``step-N`` folders (``model_location``)."""


@dataclass(frozen=True)
class ExportResult:
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


def write_model(
    state_dict: Mapping[str, torch.Tensor],
    *,
    model_config: ModelConfig,
    classes: Sequence[str],
    data: DataConfig,
    out_dir: Path,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``out_dir/model.safetensors`` (``state_dict`` as contiguous CPU fp32 tensors, timm's
    key names) and then ``out_dir/config.json`` (``timm_config``); returns ``out_dir``. The
    state dict must hold exactly the keys and shapes of the model ``model_config`` builds
    (``ExportError`` otherwise); DTensors (an FSDP model's own state dict) are refused: pass
    a full state dict."""
    from safetensors.torch import save_file

    name, kwargs, meta = meta_model(model_config)
    for key, value in state_dict.items():
        if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
            raise ExportError(
                f"{key} is a {type(value).__name__}, not a full tensor; gather the model's full "
                "state dict first (torch.distributed.checkpoint.state_dict.get_model_state_dict "
                "with StateDictOptions(full_state_dict=True, cpu_offload=True))"
            )
    check_weights(state_dict, meta, "the weights")
    tensors = {
        k: (
            v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()
        ).contiguous()
        for k, v in state_dict.items()
    }
    config = timm_config(name, kwargs, meta, classes=classes, data=data, extra=extra)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(
        out_dir / MODEL_FILE,
        lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
        fsync=True,
    )
    write_atomically(out_dir / CONFIG_FILE, json.dumps(config, indent=2) + "\n", fsync=True)
    return out_dir


def _write_out(
    state: Mapping[str, torch.Tensor],
    *,
    spec: ClusterSpec,
    model_config: ModelConfig,
    out: str,
    extra: Mapping[str, Any],
    client: Any | None,
    data: DataConfig,
    classes: Sequence[str] | None = None,
) -> tuple[str, str, str, int]:
    """(out, model file, config file, model file bytes), locally or to S3."""
    if classes is None:
        classes = class_names(spec, model_config.num_classes)

    def write(folder: Path) -> int:
        write_model(
            state,
            model_config=model_config,
            classes=classes,
            data=data,
            out_dir=folder,
            extra=extra,
        )
        return (folder / MODEL_FILE).stat().st_size

    if not s3.is_s3_uri(out):
        folder = Path(out).expanduser()
        return str(folder), str(folder / MODEL_FILE), str(folder / CONFIG_FILE), write(folder)
    try:
        target = S3Folder(out, client)
    except ValueError as e:
        raise ExportError(f"--out: {e}") from None
    with tempfile.TemporaryDirectory(prefix="hetero-export-") as tmp:
        size = write(Path(tmp))
        for name in (MODEL_FILE, CONFIG_FILE):  # config.json last
            target.client.upload_file(str(Path(tmp) / name), target.bucket, target.key(name))
    return out, target.url(MODEL_FILE), target.url(CONFIG_FILE), size


def export_checkpoint(
    checkpoint: str,
    *,
    spec: ClusterSpec,
    out: str,
    weights: str = "auto",
    client: Any | None = None,
    data: DataConfig | None = None,
) -> ExportResult:
    """Export ``checkpoint`` (a complete ``step-N`` folder, or a checkpoint root whose newest
    complete step is taken; local or ``s3://``) as ``model.safetensors`` + ``config.json`` in
    ``out`` (a local folder or an ``s3://`` prefix), for the model ``spec`` describes. One
    process, no process group. ``weights``: ``auto`` (EMA when present), ``ema`` or ``model``.
    ``client``: a boto3 S3 client (default: a bounded one from the environment). ``data``: the
    job's data config (default: ``data_config_of(spec)``)."""
    started = time.perf_counter()
    model_config_of(spec)  # a spec the trainer refuses fails before any download
    data = data or data_config_of(spec)
    with tempfile.TemporaryDirectory(prefix="hetero-export-ckpt-") as staging:
        s3_client = client
        if s3_client is None and (s3.is_s3_uri(checkpoint) or s3.is_s3_uri(out)):
            s3_client = aws.client()
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
    return export_weights(
        state, spec=spec, out=out, weights=key, step=step, source=source, client=s3_client,
        read_s=read_s, data=data,
    )  # fmt: skip


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
    read_s: float = 0.0,
    data: DataConfig | None = None,
) -> ExportResult:
    """Export a full (plain-tensor) state dict held in memory, as ``export_checkpoint`` does
    (not collective; ``export_trained`` gathers one from a running job). ``classes``: the class
    names (default: asked of the spec's dataset, which lists an S3 prefix again). ``read_s``:
    the seconds already spent reading the weights, counted in the result's ``seconds``.
    ``data``: the job's data config (default: ``data_config_of(spec)``)."""
    started = time.perf_counter() - read_s
    model_config = model_config_of(spec)
    data = data or data_config_of(spec)
    extra = {
        "source": source,
        "step": step,
        "weights": weights,
        "timm": timm.__version__,
        "torch": torch.__version__.split("+")[0],
    }
    t0 = time.perf_counter()
    try:
        folder, model_file, config_file, size = _write_out(
            state_dict, spec=spec, model_config=model_config, out=out, extra=extra, client=client,
            classes=classes, data=data,
        )  # fmt: skip
    except ExportError as e:
        raise ExportError(f"{source}: {e}") from None
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
        parameters=sum(v.numel() for v in state_dict.values()),
        bytes=size,
        seconds=time.perf_counter() - started,
        read_s=read_s,
        write_s=time.perf_counter() - t0,
    )
    log.info("exported %s to %s in %.2fs", result.describe(), folder, result.seconds)
    return result


def _beside_checkpoints(checkpoint: CheckpointConfig, name: str) -> str:
    """``name`` beside the ``step-N`` folders: in S3 when the checkpoints live there."""
    uri = checkpoint.s3_uri
    return f"{uri.rstrip('/')}/{name}" if uri else str(checkpoint.dir / name)


def model_location(checkpoint: CheckpointConfig) -> str:
    """Where a finished job's model goes: ``model/`` beside its ``step-N`` checkpoints (in S3
    when checkpoints live there); pruning and resume only ever look at ``step-N``."""
    return _beside_checkpoints(checkpoint, MODEL_FOLDER)


def export_trained(
    model: nn.Module,
    ema: nn.Module | None,
    *,
    config: TrainerConfig,
    step: int,
    rank: int,
    out: str | None = None,
    classes: Sequence[str] | None = None,
    data: DataConfig | None = None,
) -> ExportResult | None:
    """The end of a finished job: gather the EMA weights when ``ema`` is given (else the
    model's) and write them on rank 0 to ``out`` (default ``model_location``). Collective:
    every rank calls it; returns the result on rank 0, None on the others. If rank 0 cannot
    write (a full disk, S3 unreachable), every rank raises ``ExportError`` alike (rank 0
    broadcasts the outcome), so no rank waits in a later collective for a rank that raised.
    ``classes``: the dataset's class names when the caller has them (default: asked of the
    spec's dataset, which lists an S3 prefix again). ``data``: the job's data config (the
    trainer's; default: ``data_config_of(config.spec)``)."""
    weights = EMA_KEY if ema is not None else MODEL_KEY
    state = full_state_dict(ema if ema is not None else model)
    result: ExportResult | None = None
    error: str | None = None
    if rank == 0:
        target = out or model_location(config.checkpoint)
        source = _beside_checkpoints(config.checkpoint, step_name(step))
        try:
            result = export_weights(
                state, spec=config.spec, out=target, weights=weights, step=step, source=source,
                classes=classes, data=data,
            )  # fmt: skip
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
