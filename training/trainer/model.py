"""The model: ``timm.create_model`` with the spec's overrides, randomly initialised or from
``job.model.init``'s weights.

Presets are short names for small ViTs that finish CPU runs in seconds; any timm model name is
accepted as is. The input size and class count follow the dataset unless overridden.
"""

from __future__ import annotations

import difflib
import json
import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from training.common import aws, s3
from training.trainer.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

# name -> (timm model, overrides). The image size and class count come from the dataset.
PRESETS: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    # Two blocks of width 32: a training step on 32 px images takes milliseconds on one core.
    "vit-cpu-tiny": (
        "vit_tiny_patch16_224",
        {"patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2},
    ),
    # Four blocks of width 96 on 64 px images: the local heterogeneous demo.
    "vit-cpu-small": (
        "vit_tiny_patch16_224",
        {"patch_size": 8, "depth": 4, "embed_dim": 96, "num_heads": 3},
    ),
}


def resolve(config: ModelConfig) -> tuple[str, dict[str, Any]]:
    """The timm name and full keyword arguments for ``config``; raises ``ConfigError`` naming
    ``job.model.name`` when timm does not know the model."""
    name = config.name
    kwargs: dict[str, Any] = {}
    if name in PRESETS:
        name, preset = PRESETS[name]
        kwargs.update(preset)
    elif not timm.is_model(name):
        close = difflib.get_close_matches(name, [*PRESETS, *timm.list_models("vit*")], n=3)
        hint = f" (close: {', '.join(close)})" if close else ""
        raise ConfigError(
            [
                f"job.model.name = {config.name!r} is not a timm model or a preset{hint}; "
                f"presets: {', '.join(PRESETS)}"
            ]
        )
    kwargs.update(config.overrides)
    kwargs.setdefault("img_size", config.image_size)
    kwargs.setdefault("num_classes", config.num_classes)
    return name, kwargs


def build_model(config: ModelConfig, *, seed: int) -> nn.Module:
    """The model in fp32 on the CPU, identical on every rank for one seed (FSDP keeps each
    rank's shard of its local copy, so the copies must agree): randomly initialised, or with
    ``config.init``'s weights (``job.model.init``; see ``load_init``)."""
    name, kwargs = resolve(config)
    if config.init:
        return load_init(config, seed=seed)
    torch.manual_seed(seed)
    try:
        model = timm.create_model(name, pretrained=False, **kwargs)
    except TypeError as e:
        raise ConfigError([f"job.model.overrides: timm's {name!r} rejects them: {e}"]) from e
    params = sum(p.numel() for p in model.parameters())
    log.info("model %s (%s): %.2fM parameters", config.name, name, params / 1e6)
    return model


# -- job.model.init ----------------------------------------------------------------------------

INIT_FIELD = "job.model.init"
_INIT_CONFIG = "config.json"
"""timm's config beside a weights file (this project's export writes one); checked when there."""


@dataclass(frozen=True)
class InitPlan:
    """What loading an init file will do, decided before any weight is loaded."""

    file_classes: int
    """The classifier width in the file (0: the file has no classifier)."""
    reinit: tuple[str, ...]
    """Keys left at their seeded random init (the classifier, when the class counts differ)."""
    resampled: tuple[str, ...]
    """Keys timm resamples to the model's size (``pos_embed`` for another image size)."""
    tensors: int


def load_init(config: ModelConfig, *, seed: int) -> nn.Module:
    """The model with ``config.init``'s weights (a ``model.safetensors`` path or ``s3://`` URI;
    an S3 file is downloaded to a temporary folder, read and deleted). timm loads them
    (``create_model(..., pretrained=True, pretrained_cfg_overlay={"file": ...})``, which resamples
    ``pos_embed`` for another image size and drops the classifier when the class counts differ);
    the model is built after ``torch.manual_seed(seed)``, so a classifier left out is initialised
    the same on every rank. Everything else must match: ``ConfigError`` naming
    ``job.model.init`` and what differs (missing or unexpected tensors, shapes, and the
    architecture and arguments in a ``config.json`` beside the file)."""
    assert config.init
    name, kwargs = resolve(config)
    uri = config.init.strip()
    with tempfile.TemporaryDirectory(prefix="hetero-init-") as tmp:
        path, file_config = _fetch_init(uri, Path(tmp))
        plan = plan_init(config, path, file_config)
        torch.manual_seed(seed)
        overlay = {"file": str(path), "num_classes": plan.file_classes}
        try:
            model = timm.create_model(
                name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs
            )
        except TypeError as e:
            raise ConfigError([f"job.model.overrides: timm's {name!r} rejects them: {e}"]) from e
        except (RuntimeError, ValueError) as e:  # what the checks above did not foresee
            raise ConfigError([f"{INIT_FIELD} = {uri!r}: timm could not load it: {e}"]) from e
    params = sum(p.numel() for p in model.parameters())
    log.info(
        "model %s (%s): %.2fM parameters; loaded %d tensors from %s (%s)",
        config.name,
        name,
        params / 1e6,
        plan.tensors - len(plan.reinit),
        uri,
        f"{plan.file_classes} classes" if plan.file_classes else "no classifier",
    )
    if plan.reinit:
        log.info(
            "%s: re-initialised %s (seed %d): the file has %d classes, the model %d",
            INIT_FIELD,
            ", ".join(plan.reinit),
            seed,
            plan.file_classes,
            config.num_classes,
        )
    if plan.resampled:
        log.info(
            "%s: timm resampled %s to the model's image size %d",
            INIT_FIELD,
            ", ".join(plan.resampled),
            config.image_size,
        )
    return model


def _fetch_init(uri: str, tmp: Path) -> tuple[Path, dict[str, Any] | None]:
    """The local weights file for ``uri`` and the ``config.json`` beside it (None: none)."""
    if s3.is_s3_uri(uri):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            bucket, key = s3.parse_s3_object(uri)
        except ValueError:
            raise ConfigError(
                [f"{INIT_FIELD} = {uri!r}: give the file's URI, s3://bucket/path/model.safetensors"]
            ) from None
        client = aws.client()
        path = tmp / Path(key).name
        try:
            client.download_file(bucket, key, str(path))
        except (BotoCoreError, ClientError) as e:
            raise ConfigError([f"{INIT_FIELD} = {uri!r}: cannot download it: {e}"]) from e
        config_key = f"{key.rpartition('/')[0]}/{_INIT_CONFIG}".lstrip("/")
        try:
            client.download_file(bucket, config_key, str(tmp / _INIT_CONFIG))
        except ClientError:
            return path, None  # No config.json beside it: a bare timm weights file.
        return path, _read_config(uri, tmp / _INIT_CONFIG)
    path = Path(uri).expanduser()
    if not path.is_file():
        raise ConfigError(
            [f"{INIT_FIELD} = {uri!r} is not a file; give a model.safetensors path or s3:// URI"]
        )
    beside = path.parent / _INIT_CONFIG
    return path, _read_config(uri, beside) if beside.is_file() else None


def _read_config(uri: str, path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning(
            "%s = %r: the config.json beside it is unreadable (%s): not checked", INIT_FIELD, uri, e
        )
        return None
    return value if isinstance(value, dict) else None


def _classifier_keys(model: nn.Module) -> tuple[str, ...]:
    names = (getattr(model, "pretrained_cfg", None) or {}).get("classifier") or ()
    names = (names,) if isinstance(names, str) else tuple(names)
    return tuple(f"{n}.{p}" for n in names for p in ("weight", "bias"))


def plan_init(
    config: ModelConfig, path: Path, file_config: Mapping[str, Any] | None = None
) -> InitPlan:
    """Compare the file's tensors (names and shapes, read from its header) with the model
    ``config`` builds (on the meta device); ``ConfigError`` naming ``job.model.init`` and every
    difference that is not the classifier's class count or ``pos_embed``'s token count."""
    from safetensors import SafetensorError, safe_open

    uri = config.init or str(path)
    name, kwargs = resolve(config)
    problems: list[str] = []
    if file_config is not None:
        problems += _config_differences(name, kwargs, file_config)
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(
            [f"{INIT_FIELD} = {uri!r} is not a safetensors file ({e}); give a model.safetensors"]
        ) from e
    _, _, meta = meta_model(config)
    expected = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    head = _classifier_keys(meta)
    weight = head[0] if head else None
    file_classes = shapes[weight][0] if weight in shapes else 0
    model_classes = expected[weight][0] if weight in expected else 0
    reinit: tuple[str, ...] = ()
    if file_classes != model_classes:
        reinit = tuple(k for k in head if k in expected)
        expected = {k: v for k, v in expected.items() if k not in head}
        shapes = {k: v for k, v in shapes.items() if k not in head}
    resampled = []
    pos = "pos_embed"
    # timm resamples the position embedding to another grid; its width must agree.
    if (
        pos in expected
        and pos in shapes
        and shapes[pos] != expected[pos]
        and (shapes[pos][0], shapes[pos][-1]) == (expected[pos][0], expected[pos][-1])
    ):
        resampled.append(pos)
        shapes[pos] = expected[pos]
    missing, unexpected, changed = shape_differences(expected, shapes)
    if missing:
        problems.append(f"the model has tensors the file lacks: {some_keys(missing)}")
    if unexpected:
        problems.append(f"the file has tensors the model lacks: {some_keys(unexpected)}")
    if changed:
        problems.append(
            "shapes differ (file vs model): "
            + some_keys([f"{k} {list(shapes[k])} vs {list(expected[k])}" for k in changed])
        )
    if problems:
        what = f"{name}" + (f" with {dict(config.overrides)}" if config.overrides else "")
        raise ConfigError(
            [
                f"{INIT_FIELD} = {uri!r} does not fit job.model ({config.name!r}: {what}): {p}"
                for p in problems
            ]
        )
    return InitPlan(
        file_classes=file_classes,
        reinit=reinit,
        resampled=tuple(resampled),
        tensors=len(shapes) + len(reinit),
    )


_FREE_ARGS = frozenset({"num_classes", "img_size"})
"""Arguments a fine-tune may change: the classifier is re-initialised, pos_embed resampled."""


def _config_differences(
    name: str, kwargs: Mapping[str, Any], file_config: Mapping[str, Any]
) -> list[str]:
    """The architecture and arguments in the file's ``config.json`` that disagree with ours."""
    problems = []
    arch = file_config.get("architecture")
    if isinstance(arch, str) and arch.split(".", 1)[0] != name:
        problems.append(f"its config.json says architecture {arch!r}, the model is {name!r}")
    args = file_config.get("model_args")
    if isinstance(args, Mapping):
        for key in sorted(set(args) & set(kwargs) - _FREE_ARGS):
            theirs, ours = args[key], kwargs[key]
            if json.loads(json.dumps(theirs)) != json.loads(json.dumps(ours)):
                problems.append(f"its config.json has {key} = {theirs!r}, the model {ours!r}")
    return problems


def shape_differences(
    expected: Mapping[str, tuple[int, ...]], got: Mapping[str, tuple[int, ...]]
) -> tuple[list[str], list[str], list[str]]:
    """Tensor names (sorted) ``expected`` has and ``got`` lacks, ``got`` has and ``expected``
    lacks, and both have with other shapes."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    changed = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
    return missing, unexpected, changed


def some_keys(keys: list[str]) -> str:
    """The first five names, and how many more."""
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def meta_model(config: ModelConfig) -> tuple[str, dict[str, Any], nn.Module]:
    """The timm name, keyword arguments and the model on the meta device (no memory)."""
    name, kwargs = resolve(config)
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False, **kwargs)
    return name, kwargs, model


def training_flops_per_sample(config: ModelConfig) -> float:
    """FLOPs of one training sample (forward + backward), counted by torch's FlopCounterMode on
    the meta device (no memory, no compute): ~105e9 for ViT-B/16 at 224 px."""
    _, _, model = meta_model(config)
    x = torch.empty(1, 3, config.image_size, config.image_size, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return float(counter.get_total_flops())
