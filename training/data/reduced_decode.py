"""A large JPEG decoded at 1/2, 1/4 or 1/8 of its size where the training crop that follows
keeps its output resolution (libjpeg's DCT scaling, through PIL's ``draft``), for the data
servers and the local loader alike (``training/data/augment.py``: ``augment_sample``).

timm's training transform starts with ``RandomResizedCropAndInterpolation``: it draws a crop
from the image's size, then resizes the crop to the output size. The size is in the JPEG's
header, so the crop can be drawn before the decode, with the same draws in the same order
(``get_params``, then the interpolation where it is random). Where the crop is at least ``r``
times the output on both sides, the image is decoded at ``1/r`` of its size and the crop, scaled
by ``1/r``, is resized from there: the decode does ``1/r²`` of the work and the resize
downscales by less. What the model sees then differs from the full decode by the
difference between libjpeg's scaled inverse DCT and PIL's antialiased downscale over the same
pixels (docs/dataplane.md, "Per core", gives the measured size of it); everything after the
crop (flip, RandAugment, colour jitter) is timm's own, on the same draws.

Where no reduction is possible the output is exactly timm's: an image under twice the output
on either side is decoded and transformed as before, with no draw moved; a crop too small for
``r = 2`` is cut and resized with torchvision's ``resized_crop``, as timm's transform does; and
a JPEG whose decode fails after its crop was drawn gives the draws back, so the samples after
an unreadable one see what they saw before.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision.transforms import Compose
from torchvision.transforms import functional as F

from training.data.decode import finish_decode, open_image

REDUCTIONS = (8, 4, 2)
"""The scales libjpeg decodes at (besides 1), largest first."""


@dataclass(frozen=True)
class CropPlan:
    """A crop drawn from the full image's size, and the reduction its decode may use."""

    top: int
    left: int
    height: int
    width: int
    interpolation: Any
    """torchvision's ``InterpolationMode`` drawn for it."""
    reduction: int = 1


class ReducedDecodeTransform:
    """timm's training transform (``compose``: a ``RandomResizedCropAndInterpolation``, then the
    rest), which can also draw its crop from a JPEG's header (``plan``) and finish from an image
    decoded at reduced size (``finish``). Called on a decoded image, it is ``compose`` itself."""

    def __init__(self, compose: Compose) -> None:
        first, *rest = compose.transforms
        if not isinstance(first, RandomResizedCropAndInterpolation):
            raise TypeError(f"the transform starts with {type(first).__name__}, not a random crop")
        self.transforms = compose.transforms
        self.crop = first
        self.rest = Compose(rest)
        self.out_h, self.out_w = first.size

    def __call__(self, image: Image.Image) -> torch.Tensor:
        out: torch.Tensor = self.rest(self.crop(image))
        return out

    def worth_planning(self, size: tuple[int, int]) -> bool:
        """Whether some crop of an image of ``size`` (width, height) could be reduced."""
        width, height = size
        return width >= 2 * self.out_w and height >= 2 * self.out_h

    def plan(self, image: Image.Image) -> CropPlan:
        """The crop, drawn as the crop transform draws it (``image`` need not be decoded: its
        size is the header's), with the largest reduction that keeps it at the output size."""
        top, left, height, width = self.crop.get_params(image, self.crop.scale, self.crop.ratio)
        modes = self.crop.interpolation
        interpolation = random.choice(modes) if isinstance(modes, tuple | list) else modes
        reduction = next(
            (r for r in REDUCTIONS if width >= r * self.out_w and height >= r * self.out_h), 1
        )
        return CropPlan(top, left, height, width, interpolation, reduction)

    def finish(self, image: Image.Image, plan: CropPlan) -> torch.Tensor:
        """The rest of the transform on ``image``, decoded at ``1 / plan.reduction``."""
        if plan.reduction == 1:
            cropped = F.resized_crop(
                image, plan.top, plan.left, plan.height, plan.width,
                list(self.crop.size), plan.interpolation,
            )  # fmt: skip
        else:
            r = plan.reduction
            box = (plan.left / r, plan.top / r,
                   (plan.left + plan.width) / r, (plan.top + plan.height) / r)  # fmt: skip
            resample = F.pil_modes_mapping[plan.interpolation]
            cropped = image.resize((self.out_w, self.out_h), resample, box=box)
        out: torch.Tensor = self.rest(cropped)
        return out


def _reduce(image: Image.Image, plan: CropPlan) -> CropPlan:
    """Ask the decoder for ``plan``'s reduction; the plan with the one it will use."""
    if plan.reduction == 1:
        return plan
    width, height = image.size
    drafted = image.draft(None, (width // plan.reduction, height // plan.reduction))
    if drafted is None:  # a JPEG the decoder cannot scale: decoded whole
        return dataclasses.replace(plan, reduction=1)
    return dataclasses.replace(plan, reduction=round(width / drafted[1][2]))


def decode_for(data: bytes, transform: object) -> tuple[Image.Image, CropPlan | None]:
    """``data`` decoded to RGB for ``transform``: at reduced size, with the crop already drawn,
    where ``transform`` is a ``ReducedDecodeTransform`` and the image a JPEG large enough; else
    whole (``decode.decode_image``), with no plan. Raises what ``decode_image`` raises."""
    image = open_image(data)
    if not (
        isinstance(transform, ReducedDecodeTransform)
        and image.format == "JPEG"
        and transform.worth_planning(image.size)
    ):
        return finish_decode(image), None
    draws = random.getstate()
    try:
        plan = _reduce(image, transform.plan(image))
        return finish_decode(image), plan
    except BaseException:
        random.setstate(draws)  # an unreadable sample takes no draws, as before
        raise


def transform_decoded(transform: Any, image: Image.Image, plan: CropPlan | None) -> torch.Tensor:
    """``transform`` applied to what ``decode_for`` returned."""
    if plan is None:
        out: torch.Tensor = transform(image)
        return out
    assert isinstance(transform, ReducedDecodeTransform)
    return transform.finish(image, plan)
