"""Read, decode and augment samples into one uint8 NCHW array; unreadable samples are skipped."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from training.data.datasets import ImageSource
from training.data.decode import DECODE_ERRORS, decode_image
from training.data.transforms import Transform

log = logging.getLogger(__name__)


@dataclass
class AugmentedSamples:
    """A batch as arrays: ``pixels`` uint8 [N,3,S,S]; ``labels``/``sample_ids`` int64 [N];
    ``skipped_ids`` lists the requested samples that could not be read or decoded."""

    pixels: np.ndarray
    labels: np.ndarray
    sample_ids: np.ndarray
    skipped_ids: list[int] = field(default_factory=list)


def load_image(source: ImageSource, index: int) -> Image.Image | None:
    """Sample ``index`` decoded to RGB, or None (logged) when it cannot be read or decoded."""
    try:
        data = source.read(index)
    except IndexError:
        raise
    except Exception as e:  # any I/O failure (file gone, S3 error) skips the sample
        log.warning("skipping sample %d: cannot read it: %s", index, e)
        return None
    try:
        return decode_image(data)
    except DECODE_ERRORS as e:
        log.warning("skipping sample %d: not a readable image: %s", index, e)
        return None


def augment_samples(
    source: ImageSource, transform: Transform, indices: Sequence[int], image_size: int
) -> AugmentedSamples:
    """Augment ``indices`` in order into one contiguous array (the bytes the wire carries)."""
    pixels = np.empty((len(indices), 3, image_size, image_size), dtype=np.uint8)
    labels = np.empty(len(indices), dtype=np.int64)
    ids = np.empty(len(indices), dtype=np.int64)
    skipped: list[int] = []
    n = 0
    for index in indices:
        image = load_image(source, index)
        if image is None:
            skipped.append(index)
            continue
        pixels[n] = transform(image).numpy()
        labels[n] = source.label(index)
        ids[n] = index
        n += 1
    return AugmentedSamples(pixels[:n], labels[:n], ids[:n], skipped)
