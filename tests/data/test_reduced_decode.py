"""A large JPEG decoded at reduced size where the training crop keeps its resolution
(training/data/reduced_decode.py), against timm's own transform on the full decode: the same
draws, the same output where no reduction is possible, close to it where one is, nothing drawn
for a sample that does not decode."""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
import sklearn.datasets
import torch
from PIL import Image

from training.data.augment import augment_sample, augment_samples
from training.data.batch import Unreadable
from training.data.decode import decode_image
from training.data.reduced_decode import ReducedDecodeTransform, decode_for
from training.data.transforms import build_transform
from training.spec import AugmentationSpec, Recipe

SIZE = 224
PHOTO = Path(sklearn.datasets.__file__).parent / "images" / "china.jpg"  # 640 x 427


class Blobs:
    """An ``ImageSource`` over encoded images in memory."""

    num_classes = 1
    classes = ["photo"]

    def __init__(self, *blobs: bytes) -> None:
        self.blobs = blobs

    def __len__(self) -> int:
        return len(self.blobs)

    def read(self, index: int) -> bytes:
        return self.blobs[index]

    def label(self, index: int) -> int:
        return 0

    def name(self, index: int) -> str:
        return f"blob-{index}"

    def describe(self) -> str:
        return "blobs"


def photo(times: int = 1, fmt: str = "JPEG") -> bytes:
    """scikit-learn's china.jpg, enlarged ``times`` a side and encoded as ``fmt``."""
    with Image.open(PHOTO) as im:
        image = im.convert("RGB").resize((im.width * times, im.height * times))
    out = io.BytesIO()
    image.save(out, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


def seed(k: int) -> None:
    random.seed(k)
    np.random.seed(k)
    torch.manual_seed(k)


def rngs() -> tuple[object, ...]:
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()


def timm_path(transform: ReducedDecodeTransform, data: bytes, k: int) -> torch.Tensor:
    """What timm's transform makes of the full decode (the draws left as after it)."""
    seed(k)
    return transform(decode_image(data))


def ours(transform: ReducedDecodeTransform, data: bytes, k: int) -> torch.Tensor:
    seed(k)
    out = augment_sample(Blobs(data), 0, transform)
    assert isinstance(out, torch.Tensor)
    return out


def crop(scale: tuple[float, float], recipe: Recipe = Recipe.STANDARD) -> ReducedDecodeTransform:
    transform = build_transform(AugmentationSpec(preset=recipe, scale=scale), SIZE)
    assert isinstance(transform, ReducedDecodeTransform)
    return transform


@pytest.mark.parametrize("recipe", [Recipe.STANDARD, Recipe.RANDAUGMENT])
def test_an_image_under_twice_the_output_is_timms_own_byte_for_byte(recipe: Recipe) -> None:
    transform = build_transform(recipe, SIZE)
    assert isinstance(transform, ReducedDecodeTransform)
    data = PHOTO.read_bytes()  # 427 px high: under 2 x 224, so no crop can be reduced
    heights = []
    for k in range(8):
        expected = timm_path(transform, data, k)
        after = rngs()
        assert torch.equal(ours(transform, data, k), expected), k
        assert rngs() == after  # the same draws, in the same order
        seed(k)
        image, plan = decode_for(data, transform)
        assert plan is not None and plan.reduction == 1
        # china.jpg is 4:4:4: its MCU rows are 8 pixels high, and two more are decoded.
        assert image.height == min(427, plan.top + plan.height + 16)
        heights.append(image.height)
    assert min(heights) < 427  # some crops end high enough for the decode to stop early


@pytest.mark.parametrize("recipe", [Recipe.STANDARD, Recipe.RANDAUGMENT])
def test_a_large_jpeg_whose_crop_allows_it_is_decoded_at_half_size_close_to_the_full_decode(
    recipe: Recipe,
) -> None:
    transform = crop((0.9, 1.0), recipe)  # crops of at least 1000 x 700 of 1280 x 854
    data = photo(2)
    seed(0)
    image, plan = decode_for(data, transform)
    assert plan is not None and plan.reduction == 2  # 854 px high: 2 x 224 fits, 4 x 224 not
    assert image.size == (640, 427)  # libjpeg decoded half the size
    for k in range(6):
        expected = timm_path(transform, data, k)
        after = rngs()
        got = ours(transform, data, k)
        assert rngs() == after  # the same draws: flip and RandAugment see what they saw
        assert torch.equal(ours(transform, data, k), got)  # deterministic
        diff = (got.int() - expected.int()).abs().float()
        # The scaled inverse DCT against PIL's antialiased downscale: under 2 of 255 on average.
        assert 0 < diff.mean().item() < 2.0, (k, diff.mean().item())


def test_a_crop_too_small_to_reduce_is_cut_from_the_full_decode_as_timm_cuts_it() -> None:
    transform = crop((0.08, 0.1))  # crops of at most about 330 x 330 of 1280 x 854
    data = photo(2)
    seed(0)
    image, plan = decode_for(data, transform)
    assert plan is not None and plan.reduction == 1
    # Decoded down to the crop's end and two MCU rows more (16 pixels each: PIL writes 4:2:0).
    assert image.size == (1280, plan.top + plan.height + 32)
    for k in range(6):
        assert torch.equal(ours(transform, data, k), timm_path(transform, data, k)), k


def test_a_large_png_is_decoded_whole() -> None:
    transform = crop((0.9, 1.0))
    data = photo(2, "PNG")
    assert decode_for(data, transform)[1] is None  # only JPEG decodes at reduced size
    assert torch.equal(ours(transform, data, 3), timm_path(transform, data, 3))


def test_a_large_jpeg_that_does_not_decode_takes_no_draws() -> None:
    transform = crop((0.9, 1.0))
    truncated = photo(2)[:20_000]  # the header is there, the scan is cut short
    seed(5)
    before = rngs()
    skipped = augment_sample(Blobs(truncated), 0, transform)
    assert isinstance(skipped, Unreadable) and skipped.name == "blob-0"
    assert skipped.reason.startswith("not a readable image: corrupt or truncated")
    assert rngs() == before  # the next sample sees the draws it saw before


@pytest.mark.parametrize("recipe", [Recipe.STANDARD, Recipe.RANDAUGMENT])
def test_a_batch_holds_what_the_transform_makes_of_each_readable_image(recipe: Recipe) -> None:
    """The batch path writes each image into the batch itself (``finish_into``): the same bytes
    as timm's tensor, sample after sample on the same draws."""
    transform = build_transform(recipe, SIZE)
    # A JPEG decoded down to its crop, a PNG decoded whole, a file that is no image, and a
    # large JPEG decoded at reduced size or down to its crop, by the draws.
    blobs = Blobs(PHOTO.read_bytes(), photo(1, "PNG"), b"not an image", photo(2))
    indices = [0, 1, 2, 3, 0, 3]
    seed(7)
    batch = augment_samples(blobs, transform, indices, SIZE)
    assert batch.sample_ids.tolist() == [0, 1, 3, 0, 3]
    assert [u.name for u in batch.skipped] == ["blob-2"]
    seed(7)
    one_by_one = [augment_sample(blobs, i, transform) for i in indices]
    tensors = [t for t in one_by_one if isinstance(t, torch.Tensor)]
    assert np.array_equal(batch.pixels, torch.stack(tensors).numpy())
    seed(7)  # and where nothing is reduced, timm's own transform on the full decode
    assert np.array_equal(batch.pixels[0], transform(decode_image(blobs.read(0))).numpy())
    assert np.array_equal(batch.pixels[1], transform(decode_image(blobs.read(1))).numpy())
