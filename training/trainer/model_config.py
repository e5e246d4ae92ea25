"""What an exported model is: its timm-style ``config.json`` and the weights it accepts.

``timm_config`` is the ``config.json`` in the form timm's hub code writes and reads
(``timm.models._hub`` ``save_config_for_hf`` / ``load_model_config_from_path``);
``check_weights`` refuses weights of another model than the spec's. ``training.trainer.export``
writes both files.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from training.data.splits import build_dataset
from training.spec import ClusterSpec
from training.trainer.config import ConfigError, ModelConfig, TrainerConfig
from training.trainer.data_config import DataConfig, job_data_config, needs_weights
from training.trainer.model import inspect_init, shape_differences, some_keys

log = logging.getLogger(__name__)


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message says why and what to give."""


def model_config_of(spec: ClusterSpec) -> ModelConfig:
    """The ``ModelConfig`` the trainer builds from ``spec`` (same validation, same defaults)."""
    return TrainerConfig.from_spec(spec, run_dir=".", synthetic=True, environ={}).model


def data_config_of(spec: ClusterSpec) -> DataConfig:
    """The data config a job of ``spec`` trains with (``job_data_config``): the values the
    spec leaves to ``job.model.init``'s weights are read from them again (their config only),
    so they must still be where the spec says. ``ExportError`` saying which fields to set
    otherwise."""
    weights = None
    if needs_weights(spec.job):
        try:
            weights = inspect_init(model_config_of(spec))
        except ConfigError as e:
            raise ExportError(
                "the data config (mean, std, interpolation, crop_pct) follows job.model.init's "
                f"weights, which cannot be read here ({'; '.join(e.problems)}); set "
                "job.model.mean, job.model.std, job.eval.interpolation and job.eval.crop_pct "
                "to what the job trained with"
            ) from None
    try:
        return job_data_config(
            spec.job, weights.data if weights else None,
            weights.data_from if weights else "the weights",
        )  # fmt: skip
    except ConfigError as e:
        raise ExportError("; ".join(e.problems)) from None


def class_names(spec: ClusterSpec, num_classes: int) -> list[str]:
    """The dataset's class names (``build_dataset(...).classes``), or ``"0"``, ``"1"``, ... when
    the source has none, cannot be opened here, or names a different number of classes."""
    fallback = [str(i) for i in range(num_classes)]
    try:
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
    name: str,
    kwargs: Mapping[str, Any],
    model: nn.Module,
    *,
    classes: Sequence[str],
    data: DataConfig,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` for the weights of ``model.meta_model``'s ``(name, kwargs, model)``, in
    timm's hub form: what ``timm.create_model("local-dir:...")`` needs to rebuild the model and
    what ``timm.data.resolve_data_config`` needs to preprocess as the trainer evaluated
    (``data``: the job's mean, std, interpolation and crop_pct). ``custom_load`` is false, as
    timm's own ``save_for_hf`` writes it: the file is a native timm state dict, so
    ``pretrained_cfg_overlay={**pretrained_cfg, "file": ...}`` loads it on any timm, also for an
    architecture whose registry weights are a ViT ``.npz``. ``extra`` goes under ``hetero``."""
    num_classes = int(getattr(model, "num_classes"))  # noqa: B009 - every timm classifier has it
    if len(classes) != num_classes:
        raise ExportError(f"{len(classes)} class names for a model of {num_classes} classes")
    default = dict(getattr(model, "pretrained_cfg", {}) or {})
    side = kwargs.get("img_size")
    size = [side, side] if isinstance(side, int) else list(side or default["input_size"][1:])
    in_chans = int(kwargs.get("in_chans", 3))
    same_size = list(default.get("input_size", (3, 0, 0))[1:]) == size
    pretrained_cfg = {
        "custom_load": False,
        "input_size": [in_chans, *size],
        "fixed_input_size": bool(default.get("fixed_input_size", False)),
        "interpolation": str(data.interpolation),
        "crop_pct": float(data.crop_pct),
        "crop_mode": "center",
        "mean": list(data.mean),
        "std": list(data.std),
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


def check_weights(state_dict: Mapping[str, torch.Tensor], model: nn.Module, what: str) -> None:
    """Raise ``ExportError`` unless ``state_dict`` has exactly ``model``'s keys and shapes."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
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
    if problems:
        raise ExportError(f"{what} do not match the spec's job.model: " + "; ".join(problems))
