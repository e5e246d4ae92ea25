"""A JPEG decoded only as far as its training crop needs: down to the crop's last row
(``training/data/top_rows.py``), and at 1/2, 1/4 or 1/8 of its size where the crop keeps its
output resolution (libjpeg's DCT scaling, through PIL's ``draft``), for the data servers and the
local loader alike (``training/data/augment.py``: ``augment_sample``).

timm's training transform starts with ``RandomResizedCropAndInterpolation``: it draws a crop
from the image's size, then resizes the crop to the output size. The size is in the JPEG's
header, so the crop can be drawn before the decode, with the same draws in the same order
(``get_params``, then the interpolation where it is random). The decode then stops below the
crop's last row, which changes no pixel of the crop. Where the crop is at least ``r`` times the
output on both sides, the image is also decoded at ``1/r`` of its size and the crop, scaled by
``1/r``, is resized from there: the decode does ``1/r²`` of the work and the resize downscales
by less. What the model sees then differs from the full decode by the difference between
libjpeg's scaled inverse DCT and PIL's antialiased downscale over the same pixels
(docs/dataplane.md, "Per core", gives the measured size of it); everything after the crop (flip,
RandAugment, colour jitter) is timm's own, on the same draws.

Where no reduction is possible the output is exactly timm's, byte for byte: a crop too small for
``r = 2`` (every crop of an image under twice the output on a side) is cut and resized with
torchvision's ``resized_crop``, as timm's transform does; an image that is not a JPEG is decoded
whole and transformed by timm's transform itself; and a JPEG whose decode fails after its crop
was drawn gives the draws back, so the samples after an unreadable one see what they saw before.
In a batch (``finish_into``), timm's last step, the PIL image to a tensor, is one copy into the
batch array instead: the same bytes.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from timm.data.transforms import MaybePILToTensor, RandomResizedCropAndInterpolation
from torchvision.transforms import Compose
from torchvision.transforms import functional as F

from training.data.decode import finish_decode, open_image
from training.data.top_rows import decode_only_top

REDUCTIONS = (8, 4, 2)
"""The scales libjpeg decodes at (besides 1), largest first."""

_WIDEST_FILTER_SUPPORT = 3.0
"""The widest reach, in input pixels at scale 1, of PIL's resize filters (Lanczos)."""


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
        # timm's last step turns the PIL image into a tensor; ``finish_into`` copies the image
        # into the caller's array instead, the same bytes without the tensor's extra copy.
        ends_in_tensor = bool(rest) and isinstance(rest[-1], MaybePILToTensor)
        self.before_tensor = Compose(rest[:-1]) if ends_in_tensor else None

    def __call__(self, image: Image.Image) -> torch.Tensor:
        out: torch.Tensor = self.rest(self.crop(image))
        return out

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

    def rows_needed(self, plan: CropPlan) -> int:
        """The rows of the full-size image that ``finish`` reads for ``plan``, at any reduction
        up to ``plan.reduction``: down to the crop's last row, and at reduced size also the
        resize filter's reach below it (PIL reads up to its support past the box's edge)."""
        bottom = plan.top + plan.height
        r = plan.reduction
        if r == 1:
            return bottom
        support = _WIDEST_FILTER_SUPPORT * max(plan.height / r / self.out_h, 1.0)
        return r * (math.ceil(bottom / r + support) + 2)

    def finish(self, image: Image.Image, plan: CropPlan) -> torch.Tensor:
        """The rest of the transform on ``image``, decoded at ``1 / plan.reduction``."""
        out: torch.Tensor = self.rest(self._cropped(image, plan))
        return out

    def finish_into(self, image: Image.Image, plan: CropPlan | None, out: np.ndarray) -> None:
        """``finish`` (``self`` where there is no plan) written into ``out``, uint8 [3, H, W]."""
        cropped = self.crop(image) if plan is None else self._cropped(image, plan)
        if self.before_tensor is None:
            out[...] = self.rest(cropped).numpy()
            return
        last = self.before_tensor(cropped)
        if isinstance(last, Image.Image) and last.mode == "RGB":
            out[...] = np.asarray(last).transpose(2, 0, 1)  # HWC to CHW, as pil_to_tensor
        else:
            out[...] = self.transforms[-1](last).numpy()

    def _cropped(self, image: Image.Image, plan: CropPlan) -> Image.Image:
        """The crop of ``plan`` resized to the output, from ``image`` decoded at
        ``1 / plan.reduction``."""
        if plan.reduction == 1:
            cropped: Image.Image = F.resized_crop(
                image, plan.top, plan.left, plan.height, plan.width,
                list(self.crop.size), plan.interpolation,
            )  # fmt: skip
            return cropped
        r = plan.reduction
        box = (plan.left / r, plan.top / r,
               (plan.left + plan.width) / r, (plan.top + plan.height) / r)  # fmt: skip
        resample = F.pil_modes_mapping[plan.interpolation]
        return image.resize((self.out_w, self.out_h), resample, box=box)


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
    """``data`` decoded to RGB for ``transform``. Where ``transform`` is a
    ``ReducedDecodeTransform`` and the image a JPEG, the crop is drawn first and the decode
    makes only what it needs: the rows down to the crop's last (``top_rows``), at reduced size
    where the crop is large enough; else the image is decoded whole, with no plan. Raises what
    ``decode_image`` raises."""
    image = open_image(data)
    if not (isinstance(transform, ReducedDecodeTransform) and image.format == "JPEG"):
        return finish_decode(image), None
    draws = random.getstate()
    try:
        plan = transform.plan(image)
        decode_only_top(image, data, transform.rows_needed(plan))
        plan = _reduce(image, plan)
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


def transform_decoded_into(
    transform: Any, image: Image.Image, plan: CropPlan | None, out: np.ndarray
) -> None:
    """``transform_decoded`` written into ``out`` (uint8 [3, S, S])."""
    if isinstance(transform, ReducedDecodeTransform):
        transform.finish_into(image, plan, out)
    else:
        out[...] = transform_decoded(transform, image, plan).numpy()
