"""Image sources: where the bytes of sample ``i`` come from, and its label.

A source returns encoded image bytes (JPEG/PNG), so decoding is part of the augmentation cost
wherever it runs, exactly as with real data. Sources are picklable: the data server ships them to
its worker processes.

torchvision's folder rules (``find_classes``, ``make_dataset``, ``IMG_EXTENSIONS``) are imported
where a folder or a prefix is listed: importing torchvision loads all of it, ``torch._dynamo``
included (seconds of CPU), and a process that orders a dataset without reading it (the
rehearsal) must not pay that.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from training.common import s3
from training.data.lazy_s3 import LazyS3Client
from training.data.names import shown_path


class ImageSource(Protocol):
    """A dataset of encoded images with integer labels; ``classes[label]`` is a label's name."""

    num_classes: int
    classes: list[str]

    def __len__(self) -> int: ...

    def read(self, index: int) -> bytes:
        """The encoded image of sample ``index`` (may be unreadable: decoding is the caller's)."""
        ...

    def label(self, index: int) -> int: ...

    def name(self, index: int) -> str:
        """Where sample ``index`` is, as a person finds it (a file's path, an ``s3://`` URI):
        text that can be logged and sent anywhere (``training.data.names.shown_path``)."""
        ...

    def describe(self) -> str: ...


def _check_index(index: int, length: int) -> None:
    if not 0 <= index < length:
        raise IndexError(f"sample index {index} out of range (dataset has {length} samples)")


class SyntheticImages:
    """Images made on the fly, deterministically from the index: a class colour plus a smooth
    per-sample pattern and noise, JPEG-encoded. By default the source is a square of ~8/7 of the
    crop size (256 px for 224: cheap to make, decode and crop); ``source_size=(500, 375)`` makes
    images of ImageNet's most common size (~100 KB), for measurements of real decode cost."""

    def __init__(
        self,
        num_samples: int,
        num_classes: int,
        image_size: int,
        source_size: tuple[int, int] | None = None,
    ) -> None:
        if num_samples < 1 or num_classes < 1:
            raise ValueError("synthetic dataset needs num_samples >= 1 and num_classes >= 1")
        self.num_samples = num_samples
        self.num_classes = num_classes
        self.classes = [f"class_{i}" for i in range(num_classes)]
        side = max(16, round(image_size * 8 / 7))
        self.source_size: tuple[int, int] = source_size or (side, side)

    def __len__(self) -> int:
        return self.num_samples

    def label(self, index: int) -> int:
        _check_index(index, self.num_samples)
        return index % self.num_classes

    def name(self, index: int) -> str:
        _check_index(index, self.num_samples)
        return f"synthetic:{index}"

    def read(self, index: int) -> bytes:
        label = self.label(index)
        rng = np.random.default_rng(index)
        colour = np.random.default_rng(1_000_003 + label).integers(40, 216, size=3)
        # A coarse random grid upsampled bilinearly gives smooth structure that JPEG encodes
        # to a realistic size; the noise keeps it from compressing to nothing.
        coarse = rng.integers(-60, 60, size=(8, 8, 3)) + colour
        width, height = self.source_size
        base = Image.fromarray(np.clip(coarse, 0, 255).astype(np.uint8)).resize(
            (width, height), Image.Resampling.BILINEAR
        )
        noise = rng.integers(0, 25, size=(height, width, 3), dtype=np.uint8)
        # Scale to 0..229 first so adding 0..24 of noise cannot overflow uint8.
        pixels = ((np.asarray(base, dtype=np.uint16) * 230) >> 8).astype(np.uint8) + noise
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=90)
        return out.getvalue()

    def describe(self) -> str:
        return f"synthetic ({self.num_samples} samples, {self.num_classes} classes)"


class FolderImages:
    """A local folder in ImageFolder layout: ``root/<class>/<image>``; classes sorted by name.
    ``field`` is the spec field errors name (``job.dataset.path`` or ``job.dataset.val_path``)."""

    def __init__(self, root: str | Path, *, field: str = "job.dataset.path") -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(
                f"{field} {str(self.root)!r} is not a folder; point it at a folder of "
                "class sub-folders (ImageFolder layout)"
            )
        from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

        try:
            self.classes, class_to_idx = find_classes(str(self.root))
        except FileNotFoundError as e:
            raise ValueError(f"{field} {str(self.root)!r}: {e}") from e
        self.samples: list[tuple[str, int]] = make_dataset(
            str(self.root), class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True
        )
        if not self.samples:
            raise ValueError(
                f"{field} {str(self.root)!r} has class folders but no images "
                f"({', '.join(IMG_EXTENSIONS)})"
            )
        self.num_classes = len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def label(self, index: int) -> int:
        _check_index(index, len(self.samples))
        return self.samples[index][1]

    def name(self, index: int) -> str:
        _check_index(index, len(self.samples))
        return shown_path(self.samples[index][0])

    def read(self, index: int) -> bytes:
        _check_index(index, len(self.samples))
        with open(self.samples[index][0], "rb") as f:  # not Path: no path parsing per sample
            return f.read()

    def describe(self) -> str:
        return f"folder {self.root} ({len(self.samples)} images, {self.num_classes} classes)"


class S3Images(LazyS3Client):
    """Images under an S3 prefix: ``s3://bucket/prefix/<class>/<image>``. Every sub-prefix is a
    class, sorted by name, one without images too (as ``FolderImages`` takes every class folder,
    and as ``training/trainer/classes.py`` counts them: ``s3.sub_prefix``). Keys are listed
    once; each process makes its own boto3 client. ``field`` is the spec field errors name."""

    def __init__(
        self, uri: str, *, client: Any | None = None, field: str = "job.dataset.path"
    ) -> None:
        try:
            self.bucket, self.prefix = s3.parse_s3_uri(uri)
        except ValueError:
            raise ValueError(f"{field} {uri!r} must look like s3://bucket/prefix/") from None
        self.uri = uri
        self._client = client
        from torchvision.datasets.folder import IMG_EXTENSIONS

        by_class: dict[str, list[str]] = {}
        for key in s3.list_keys(self.client, self.bucket, self.prefix):
            cls = s3.sub_prefix(self.prefix, key)
            if cls is None:
                continue
            images = by_class.setdefault(cls, [])
            parts = key[len(self.prefix) :].split("/")
            if len(parts) == 2 and parts[1].lower().endswith(IMG_EXTENSIONS):
                images.append(key)
        if not any(by_class.values()):
            raise ValueError(
                f"{field} {uri!r}: no images found under <prefix>/<class>/ "
                f"({', '.join(IMG_EXTENSIONS)})"
            )
        self.classes = sorted(by_class)
        self.keys: list[tuple[str, int]] = [
            (key, i) for i, c in enumerate(self.classes) for key in sorted(by_class[c])
        ]
        self.num_classes = len(self.classes)

    def __len__(self) -> int:
        return len(self.keys)

    def label(self, index: int) -> int:
        _check_index(index, len(self.keys))
        return self.keys[index][1]

    def name(self, index: int) -> str:
        _check_index(index, len(self.keys))
        return s3.s3_uri(self.bucket, self.keys[index][0])

    def read(self, index: int) -> bytes:
        _check_index(index, len(self.keys))
        body = self.client.get_object(Bucket=self.bucket, Key=self.keys[index][0])["Body"]
        return bytes(body.read())

    def describe(self) -> str:
        return f"{self.uri} ({len(self.keys)} images, {self.num_classes} classes)"
