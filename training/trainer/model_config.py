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
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import nn

from training.data import build_dataset
from training.data.transforms import EvalTransform
from training.spec import ClusterSpec
from training.trainer.config import ModelConfig, TrainerConfig
from training.trainer.model import shape_differences, some_keys

log = logging.getLogger(__name__)


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message says why and what to give."""


def model_config_of(spec: ClusterSpec) -> ModelConfig:
    """The ``ModelConfig`` the trainer builds from ``spec`` (same validation, same defaults)."""
    return TrainerConfig.from_spec(spec, run_dir=".", synthetic=True, environ={}).model


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
    eval_transform: EvalTransform,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` for the weights of ``model.meta_model``'s ``(name, kwargs, model)``, in
    timm's hub form: what ``timm.create_model("local-dir:...")`` needs to rebuild the model and
    what ``timm.data.resolve_data_config`` needs to preprocess as the trainer evaluated
    (mean/std: ImageNet's, as the trainer normalises). ``extra`` goes under the key ``hetero``."""
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
