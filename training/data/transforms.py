"""Augmentation recipes, built with timm's transform factory; output uint8 CHW tensors."""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
from PIL import Image
from timm.data import create_transform
from timm.data.auto_augment import RandAugment

from training.spec import Recipe

# timm's RandAugment policy string used by the DeiT/ViT recipes: 2 ops, magnitude 9 with std 0.5,
# magnitude increasing with strength.
RANDAUGMENT_POLICY = "rand-m9-mstd0.5-inc1"
# Sampled magnitudes are clipped here rather than at timm's 10: at exactly 10 timm's
# PosterizeIncreasing keeps 0 bits, which Pillow >= 13 rejects with ValueError (~1% of images).
# Just below 10 it keeps 1 bit; every other op is unchanged to within 0.1%.
_RANDAUGMENT_MAGNITUDE_MAX = 9.99

Transform = Callable[[Image.Image], torch.Tensor]


def build_transform(recipe: Recipe | str, image_size: int) -> Transform:
    """The training transform for ``recipe``: RandomResizedCrop to ``image_size`` + horizontal
    flip (``standard``), plus RandAugment (``randaugment``). Returns uint8 [3, S, S] tensors,
    not normalised (the trainer normalises on its device)."""
    try:
        recipe = Recipe(recipe)
    except ValueError:
        valid = ", ".join(r.value for r in Recipe)
        raise ValueError(f"unknown augmentation recipe {recipe!r}; use one of {valid}") from None
    if not 16 <= image_size <= 1024:
        raise ValueError(f"image_size must be between 16 and 1024, got {image_size}")
    transform: Transform = create_transform(
        input_size=image_size,
        is_training=True,
        # use_prefetcher: timm stops at a uint8 tensor, leaving normalisation to the device.
        use_prefetcher=True,
        hflip=0.5,
        # None: no colour jitter (timm handles None although its annotation omits it).
        color_jitter=None,  # type: ignore[arg-type]
        auto_augment=RANDAUGMENT_POLICY if recipe is Recipe.RANDAUGMENT else None,
        interpolation="bilinear",
    )
    if recipe is Recipe.RANDAUGMENT:
        # The policy string only takes an integer mmax, so the cap is set on the built ops.
        for step in getattr(transform, "transforms", ()):
            if isinstance(step, RandAugment):
                for op in step.ops:
                    op.magnitude_max = _RANDAUGMENT_MAGNITUDE_MAX
    return transform


def decode_image(data: bytes) -> Image.Image:
    """Decode JPEG/PNG/... bytes into an RGB PIL image; raises ``OSError`` (PIL's
    ``UnidentifiedImageError`` included) if the bytes are not a readable image."""
    image = Image.open(io.BytesIO(data))
    # convert() forces the full decode here, so a truncated file fails here, not later.
    return image.convert("RGB")
