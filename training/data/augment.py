"""Read, decode and augment samples into one uint8 NCHW array; unreadable samples are skipped
and reported by name (``Unreadable``). A large JPEG is decoded at reduced size where the training
crop allows it (``training/data/reduced_decode.py``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from training.data.batch import Unreadable
from training.data.datasets import ImageSource
from training.data.decode import CANNOT_READ, DECODE_ERRORS, decode_image, decode_problem
from training.data.names import shown_text
from training.data.reduced_decode import decode_for, transform_decoded
from training.data.transforms import Transform

log = logging.getLogger(__name__)


@dataclass
class AugmentedSamples:
    """A batch as arrays: ``pixels`` uint8 [N,3,S,S]; ``labels``/``sample_ids`` int64 [N];
    ``skipped`` names the requested samples that could not be read or decoded, in order."""

    pixels: np.ndarray
    labels: np.ndarray
    sample_ids: np.ndarray
    skipped: list[Unreadable] = field(default_factory=list)


def load_image(source: ImageSource, index: int) -> Image.Image | Unreadable:
    """Sample ``index`` decoded to RGB, or why it cannot be read or decoded (logged, with its
    name). An index out of range raises ``IndexError``."""
    data = _read(source, index)
    if isinstance(data, Unreadable):
        return data
    try:
        return decode_image(data)
    except DECODE_ERRORS as e:
        return _undecodable(source, index, data, e)


def augment_sample(
    source: ImageSource, index: int, transform: Transform
) -> torch.Tensor | Unreadable:
    """Sample ``index`` through ``transform`` (uint8 [3, S, S]), decoded at reduced size where
    the transform's crop allows it; or why it cannot be read or decoded, as ``load_image``."""
    data = _read(source, index)
    if isinstance(data, Unreadable):
        return data
    try:
        image, plan = decode_for(data, transform)
    except DECODE_ERRORS as e:
        return _undecodable(source, index, data, e)
    return transform_decoded(transform, image, plan)


def _read(source: ImageSource, index: int) -> bytes | Unreadable:
    try:
        return source.read(index)
    except IndexError:
        raise
    except Exception as e:  # any I/O failure (file gone, S3 error) skips the sample
        return _unreadable(source, index, f"{CANNOT_READ}: {e}")


def _undecodable(source: ImageSource, index: int, data: bytes, error: Exception) -> Unreadable:
    return _unreadable(source, index, f"not a readable image: {decode_problem(data, error)}")


def _unreadable(source: ImageSource, index: int, reason: str) -> Unreadable:
    # An error may quote a file name whose bytes are not UTF-8.
    skipped = Unreadable(index, source.name(index), shown_text(reason))
    log.warning("skipping sample %d (%s): %s", index, skipped.name, skipped.reason)
    return skipped


def list_unreadable(skipped: Iterable[Unreadable]) -> str:
    """``name: reason`` of each sample, for a log line."""
    return "; ".join(f"{u.name}: {u.reason}" for u in skipped)


def augment_samples(
    source: ImageSource, transform: Transform, indices: Sequence[int], image_size: int
) -> AugmentedSamples:
    """Augment ``indices`` in order into one contiguous array (the bytes the wire carries)."""
    pixels = np.empty((len(indices), 3, image_size, image_size), dtype=np.uint8)
    labels = np.empty(len(indices), dtype=np.int64)
    ids = np.empty(len(indices), dtype=np.int64)
    skipped: list[Unreadable] = []
    n = 0
    for index in indices:
        image = augment_sample(source, index, transform)
        if isinstance(image, Unreadable):
            skipped.append(image)
            continue
        pixels[n] = image.numpy()
        labels[n] = source.label(index)
        ids[n] = index
        n += 1
    return AugmentedSamples(pixels[:n], labels[:n], ids[:n], skipped)
