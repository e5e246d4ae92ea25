"""Read, decode and augment samples into one uint8 NCHW array; unreadable samples are skipped
and reported by name (``Unreadable``). A JPEG is decoded only down to its training crop's last
row, and at reduced size where the crop allows it (``training/data/reduced_decode.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from training.data.batch import Unreadable
from training.data.datasets import ImageSource
from training.data.decode import CANNOT_READ, DECODE_ERRORS, decode_image, decode_problem
from training.data.names import shown_text
from training.data.reduced_decode import (
    CropPlan,
    decode_for,
    transform_decoded,
    transform_decoded_into,
)
from training.data.transforms import Transform

log = logging.getLogger(__name__)


@dataclass
class AugmentedSamples:
    """A batch as arrays: ``pixels`` uint8 [N,3,S,S]; ``labels``/``sample_ids`` int64 [N];
    ``skipped`` names the requested samples that could not be read or decoded, in order.

    Between a data server's worker and the server: ``in_slot`` (N) where the worker wrote the
    pixels into shared memory instead (``pixels`` is then empty), and ``release``, which the
    reader calls once done with pixels that are a view on that memory
    (``training.dataplane.handoff``)."""

    pixels: np.ndarray
    labels: np.ndarray
    sample_ids: np.ndarray
    skipped: list[Unreadable] = field(default_factory=list)
    in_slot: int | None = None
    release: Callable[[], None] | None = None


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
    decoded = _decoded(source, index, transform)
    if isinstance(decoded, Unreadable):
        return decoded
    return transform_decoded(transform, *decoded)


def augment_into(
    source: ImageSource, index: int, transform: Transform, out: np.ndarray
) -> Unreadable | None:
    """``augment_sample`` written into ``out`` (uint8 [3, S, S]): None once written, else why
    the sample cannot be read or decoded (``out`` then untouched)."""
    decoded = _decoded(source, index, transform)
    if isinstance(decoded, Unreadable):
        return decoded
    transform_decoded_into(transform, *decoded, out)
    return None


def _decoded(
    source: ImageSource, index: int, transform: Transform
) -> tuple[Image.Image, CropPlan | None] | Unreadable:
    data = _read(source, index)
    if isinstance(data, Unreadable):
        return data
    try:
        return decode_for(data, transform)
    except DECODE_ERRORS as e:
        return _undecodable(source, index, data, e)


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
    source: ImageSource,
    transform: Transform,
    indices: Sequence[int],
    image_size: int,
    out: np.ndarray | None = None,
) -> AugmentedSamples:
    """Augment ``indices`` in order into one contiguous array (the bytes the wire carries):
    ``out`` (uint8 [len(indices), 3, S, S]) where given, else a new one; the readable samples
    fill it from the start."""
    shape = (len(indices), 3, image_size, image_size)
    if out is not None and out.shape != shape:
        raise ValueError(f"out has shape {out.shape}, the batch needs {shape}")
    pixels = np.empty(shape, dtype=np.uint8) if out is None else out
    labels = np.empty(len(indices), dtype=np.int64)
    ids = np.empty(len(indices), dtype=np.int64)
    skipped: list[Unreadable] = []
    n = 0
    for index in indices:
        problem = augment_into(source, index, transform, pixels[n])
        if problem is not None:
            skipped.append(problem)
            continue
        labels[n] = source.label(index)
        ids[n] = index
        n += 1
    return AugmentedSamples(pixels[:n], labels[:n], ids[:n], skipped)
