"""Training and evaluation transforms, built with timm's transform factory; they output uint8
CHW tensors (the trainer normalises on its device).

What a data server is asked to make travels as a recipe string (``encode_recipe``): a preset
name (``standard``, ``randaugment``, ``none``) for a preset, else canonical JSON of the training
parameters (``{"train": {...}}``) or of the eval transform (``{"eval": {...}}``).
``decode_recipe`` validates it with the spec's own parser, so a server refuses exactly what
``hetero spec check`` refuses.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from PIL import Image
from timm.data import create_transform
from timm.data.auto_augment import RandAugment

from training.data.reduced_decode import ReducedDecodeTransform
from training.spec import (
    AugmentationSpec,
    EvalSpec,
    Interpolation,
    Recipe,
    SpecError,
    parse_augmentation,
)

# timm's RandAugment policy string used by the DeiT/ViT recipes: 2 ops, magnitude 9 with std 0.5,
# magnitude increasing with strength.
RANDAUGMENT_POLICY = "rand-m9-mstd0.5-inc1"
# Sampled magnitudes are clipped here rather than at timm's 10: at exactly 10 timm's
# PosterizeIncreasing keeps 0 bits, which Pillow >= 13 rejects with ValueError (~1% of images).
# Just below 10 it keeps 1 bit; every other op is unchanged to within 0.1%.
_RANDAUGMENT_MAGNITUDE_MAX = 9.99

# The presets' values for what a table leaves unset (ImageNet's RandomResizedCrop + flip).
_PRESET_SCALE = (0.08, 1.0)
_PRESET_RATIO = (3.0 / 4.0, 4.0 / 3.0)
_PRESET_HFLIP = 0.5

Transform = Callable[[Image.Image], torch.Tensor]


@dataclass(frozen=True)
class EvalTransform:
    """timm's eval transform: resize the shorter side to ``image_size / crop_pct``, centre
    crop ``image_size``. No randomness."""

    crop_pct: float = 0.875
    interpolation: Interpolation = Interpolation.BILINEAR

    @classmethod
    def from_spec(cls, spec: EvalSpec) -> EvalTransform:
        """The spec's values, these defaults where it leaves them unset (the trainer resolves
        them against ``job.model.init``'s weights first: ``training.trainer.data_config``)."""
        return cls(
            crop_pct=cls.crop_pct if spec.crop_pct is None else spec.crop_pct,
            interpolation=cls.interpolation if spec.interpolation is None else spec.interpolation,
        )


TransformSpec = AugmentationSpec | EvalTransform


def encode_recipe(recipe: TransformSpec) -> str:
    """The recipe string a ``StreamBatchesRequest`` carries for ``recipe``."""
    if isinstance(recipe, EvalTransform):
        return json.dumps({"eval": {"crop_pct": recipe.crop_pct,
                                    "interpolation": recipe.interpolation.value}},
                          sort_keys=True)  # fmt: skip
    if recipe.is_preset:
        return recipe.preset.value
    # JSON writes the enums (str) as their values and the tuples as arrays.
    table = {f.name: getattr(recipe, f.name) for f in fields(recipe)}
    return json.dumps({"train": {k: v for k, v in table.items() if v is not None}}, sort_keys=True)


def decode_recipe(text: str) -> TransformSpec:
    """The recipe a request names; raises ``ValueError`` saying what is wrong."""
    text = text.strip()
    if not text.startswith("{"):
        try:
            return AugmentationSpec(preset=Recipe(text))
        except ValueError:
            valid = ", ".join(r.value for r in Recipe)
            raise ValueError(
                f"unknown recipe {text!r}; use one of {valid} or a JSON recipe"
            ) from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"recipe is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in ("train", "eval"):
        raise ValueError('a JSON recipe is {"train": {...}} or {"eval": {...}}')
    kind, body = next(iter(raw.items()))
    if not isinstance(body, dict):
        raise ValueError(f"recipe {kind!r} must be an object, got {type(body).__name__}")
    if kind == "eval":
        unknown = set(body) - {"crop_pct", "interpolation"}
        if unknown:
            raise ValueError(f"eval recipe: unknown keys {sorted(unknown)}")
        crop = body.get("crop_pct", EvalTransform.crop_pct)
        if isinstance(crop, bool) or not isinstance(crop, int | float) or not 0 < crop <= 1:
            raise ValueError(f"eval recipe: crop_pct must be in (0, 1], got {crop!r}")
        try:
            interp = Interpolation(body.get("interpolation", "bilinear"))
        except ValueError:
            raise ValueError(f"eval recipe: bad interpolation {body['interpolation']!r}") from None
        if interp is Interpolation.RANDOM:
            raise ValueError("eval recipe: interpolation 'random' is for training")
        return EvalTransform(crop_pct=float(crop), interpolation=interp)
    try:
        return parse_augmentation(body, "train recipe")
    except SpecError as e:
        raise ValueError("; ".join(e.problems)) from None


def _check_size(image_size: int) -> None:
    if not 16 <= image_size <= 1024:
        raise ValueError(f"image_size must be between 16 and 1024, got {image_size}")


def build_eval_transform(recipe: EvalTransform, image_size: int) -> Transform:
    """timm's eval transform (``is_training=False``) to uint8 [3, S, S]."""
    _check_size(image_size)
    transform: Transform = create_transform(
        input_size=image_size,
        is_training=False,
        use_prefetcher=True,
        crop_pct=recipe.crop_pct,
        interpolation=recipe.interpolation.value,
    )
    return transform


def build_transform(recipe: TransformSpec | Recipe | str, image_size: int) -> Transform:
    """The transform for ``recipe`` (a spec, a preset or a preset's name). Training presets:
    RandomResizedCrop to ``image_size`` + horizontal flip (``standard``), plus RandAugment
    (``randaugment``); ``none`` resizes and centre-crops only. Table values are passed to timm's
    ``create_transform``. Returns uint8 [3, S, S] tensors, not normalised (the trainer
    normalises on its device, and applies random erasing there)."""
    if isinstance(recipe, str):
        try:
            recipe = AugmentationSpec(preset=Recipe(recipe))
        except ValueError:
            valid = ", ".join(r.value for r in Recipe)
            raise ValueError(
                f"unknown augmentation recipe {recipe!r}; use one of {valid}"
            ) from None
    if isinstance(recipe, EvalTransform):
        return build_eval_transform(recipe, image_size)
    _check_size(image_size)
    if recipe.preset is Recipe.NONE:
        # Pre-cropped data: the whole image, resized (crop_pct 1), no randomness.
        interp = recipe.interpolation or Interpolation.BILINEAR
        return build_eval_transform(EvalTransform(1.0, interp), image_size)
    policy = recipe.auto_augment
    if policy is None:
        policy = RANDAUGMENT_POLICY if recipe.preset is Recipe.RANDAUGMENT else ""
    transform: Transform = create_transform(
        input_size=image_size,
        is_training=True,
        # use_prefetcher: timm stops at a uint8 tensor, leaving normalisation to the device.
        use_prefetcher=True,
        scale=recipe.scale or _PRESET_SCALE,
        ratio=recipe.ratio or _PRESET_RATIO,
        hflip=_PRESET_HFLIP if recipe.hflip is None else recipe.hflip,
        vflip=recipe.vflip or 0.0,
        # None: no colour jitter (timm handles None although its annotation omits it).
        color_jitter=recipe.color_jitter,  # type: ignore[arg-type]
        auto_augment=policy or None,
        interpolation=(recipe.interpolation or Interpolation.BILINEAR).value,
    )
    if policy.startswith("rand"):
        # The policy string only takes an integer mmax, so the cap is set on the built ops.
        for step in getattr(transform, "transforms", ()):
            if isinstance(step, RandAugment):
                for op in step.ops:
                    op.magnitude_max = _RANDAUGMENT_MAGNITUDE_MAX
    # The same transform, which can also draw its crop before a large JPEG's decode.
    return ReducedDecodeTransform(transform)  # type: ignore[arg-type]
