"""A small real image dataset for the tests that prove the trainer learns, and a check of a trained
model that shares none of the trainer's code.

The images are scikit-learn's ``load_digits``: 1,797 scanned handwritten digits (8x8 grayscale,
values 0..16, 10 classes), shipped inside the scikit-learn wheel, so no download is needed.
``write_digits`` writes them as RGB PNGs in ImageFolder layout with a fixed, non-overlapping split;
``independent_top1`` measures a model's validation top-1 with torchvision alone (ImageFolder and
timm's eval transform restated with ``torchvision.transforms``), never importing ``training``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

NUM_CLASSES = 10
# load_digits pixels are 0..16 (ink is high: light digits on a dark background).
_DIGITS_MAX = 16
# Upscaling from 8 px: bicubic gives smooth strokes rather than 4x4 blocks, and trains better (a
# 4-block ViT at 16 px, 300 steps, one seed: top-1 0.88 from bicubic, 0.79 from nearest PNGs).
_UPSCALE = Image.Resampling.BICUBIC


@dataclass(frozen=True)
class DigitsFolders:
    """Where ``write_digits`` put the images, and how many went to each split."""

    train_dir: Path
    val_dir: Path
    train_count: int
    val_count: int

    @property
    def total(self) -> int:
        return self.train_count + self.val_count


def write_digits(
    root: Path, *, val_every: int = 5, size: int = 32, classes: Iterable[int] | None = None
) -> DigitsFolders:
    """Write scikit-learn's digits as ``size`` x ``size`` RGB PNGs (bicubic upscaling from 8 px) to
    ``root/train/<class>/<idx>.png`` and ``root/val/<class>/<idx>.png``, ``idx`` being the
    sample's index in ``load_digits``. Sample ``i`` goes to validation iff ``i % val_every == 0``:
    a fixed split that never overlaps (with the default 5: 1,437 train, 360 val). ``classes``
    (default: all ten) writes only those digits, with the same split: two disjoint sets of
    classes give two datasets that share no image and no class."""
    from sklearn.datasets import load_digits  # a dev dependency: imported only when used

    if val_every < 2:
        raise ValueError(f"val_every must be at least 2, got {val_every}")
    if size < 8:
        raise ValueError(f"size must be at least 8 (the digits are 8x8), got {size}")
    labels = sorted(set(range(NUM_CLASSES) if classes is None else classes))
    if not labels or not set(labels) <= set(range(NUM_CLASSES)):
        raise ValueError(f"classes must be digits 0-9, at least one, got {labels}")
    digits = load_digits()
    images = np.rint(digits.images * (255 / _DIGITS_MAX)).astype(np.uint8)
    train_dir, val_dir = root / "train", root / "val"
    for split in (train_dir, val_dir):
        for label in labels:
            (split / str(label)).mkdir(parents=True, exist_ok=True)
    counts = {train_dir: 0, val_dir: 0}
    for index, (pixels, label) in enumerate(zip(images, digits.target, strict=True)):
        if int(label) not in labels:
            continue
        split = val_dir if index % val_every == 0 else train_dir
        image = Image.fromarray(pixels).resize((size, size), _UPSCALE).convert("RGB")
        image.save(split / str(int(label)) / f"{index}.png")
        counts[split] += 1
    return DigitsFolders(train_dir, val_dir, counts[train_dir], counts[val_dir])


def eval_transform(
    *,
    image_size: int,
    crop_pct: float,
    interpolation: str,
    mean: Sequence[float],
    std: Sequence[float],
) -> transforms.Compose:
    """timm's ``transforms_imagenet_eval`` (centre crop mode, square size) restated with
    torchvision: resize the shorter side to ``floor(image_size / crop_pct)``, centre-crop
    ``image_size``, scale to [0, 1], normalise."""
    return transforms.Compose(
        [
            transforms.Resize(
                math.floor(image_size / crop_pct),
                interpolation=transforms.InterpolationMode(interpolation),
            ),
            transforms.CenterCrop(image_size),
            transforms.ToTensor(),
            transforms.Normalize(mean=list(mean), std=list(std)),
        ]
    )


def independent_top1(
    model: torch.nn.Module,
    val_dir: Path,
    *,
    image_size: int,
    crop_pct: float,
    interpolation: str,
    mean: Sequence[float],
    std: Sequence[float],
    batch_size: int = 128,
) -> float:
    """Top-1 accuracy of ``model`` on the ImageFolder ``val_dir`` (classes sorted by folder name,
    as the trainer orders them), in eval mode, with ``eval_transform``."""
    transform = eval_transform(
        image_size=image_size, crop_pct=crop_pct, interpolation=interpolation, mean=mean, std=std
    )
    dataset = datasets.ImageFolder(str(val_dir), transform=transform)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0)
    was_training = model.training
    model.eval()
    correct = 0
    try:
        with torch.no_grad():
            for images, labels in loader:
                correct += int((model(images).argmax(dim=1) == labels).sum())
    finally:
        model.train(was_training)
    return correct / len(dataset)


def exported_top1(model_dir: Path, val_dir: Path) -> tuple[float, dict[str, Any]]:
    """An exported model (``model.safetensors`` + ``config.json``) loaded by plain timm, scored
    by ``independent_top1`` with the preprocessing its config names; (top-1, the config)."""
    import timm  # only here: the rest of this module needs no timm

    config = json.loads((model_dir / "config.json").read_text())
    model = timm.create_model(
        config["architecture"],
        pretrained=True,
        pretrained_cfg_overlay={
            "file": str(model_dir / "model.safetensors"),
            "num_classes": config["num_classes"],
        },
        **config["model_args"],
    )
    cfg = config["pretrained_cfg"]
    top1 = independent_top1(
        model, val_dir, image_size=cfg["input_size"][-1], crop_pct=cfg["crop_pct"],
        interpolation=cfg["interpolation"], mean=cfg["mean"], std=cfg["std"],
    )  # fmt: skip
    return top1, config
