"""The heavy recipe runs every RandAugment op at its strongest without error."""

from __future__ import annotations

from PIL import Image
from timm.data.auto_augment import RandAugment

from training.data.transforms import build_transform
from training.spec import Recipe


def test_randaugment_ops_survive_their_strongest_magnitude() -> None:
    # At magnitude 10 timm's PosterizeIncreasing asks Pillow for 0 bits, which Pillow 13 refuses:
    # about 1% of images crashed a worker before the cap.
    transform = build_transform(Recipe.RANDAUGMENT, 32)
    (rand_augment,) = [s for s in transform.transforms if isinstance(s, RandAugment)]  # type: ignore[attr-defined]
    image = Image.new("RGB", (40, 40), (120, 30, 200))
    names = []
    for op in rand_augment.ops:
        op.prob, op.magnitude_std, op.magnitude = 1.0, 0.0, 10.0
        out = op(image)
        assert out.size == image.size
        names.append(op.name)
    assert "PosterizeIncreasing" in names
