"""The model: ``timm.create_model`` with the spec's overrides, randomly initialised.

Presets are short names for small ViTs that finish CPU runs in seconds; any timm model name is
accepted as is. The input size and class count follow the dataset unless overridden.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from typing import Any

import timm
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

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
    """A randomly initialised model in fp32 on the CPU; identical on every rank for one seed
    (FSDP keeps each rank's shard of its local copy, so the copies must agree)."""
    name, kwargs = resolve(config)
    torch.manual_seed(seed)
    try:
        model = timm.create_model(name, pretrained=False, **kwargs)
    except TypeError as e:
        raise ConfigError([f"job.model.overrides: timm's {name!r} rejects them: {e}"]) from e
    params = sum(p.numel() for p in model.parameters())
    log.info("model %s (%s): %.2fM parameters", config.name, name, params / 1e6)
    return model


def training_flops_per_sample(config: ModelConfig) -> float:
    """FLOPs of one training sample (forward + backward), counted by torch's FlopCounterMode on
    the meta device (no memory, no compute): ~105e9 for ViT-B/16 at 224 px."""
    name, kwargs = resolve(config)
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False, **kwargs)
    x = torch.empty(1, 3, config.image_size, config.image_size, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return float(counter.get_total_flops())
