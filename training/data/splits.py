"""The training and validation splits of ``[job.dataset]``: the one place that decides which
images are trained on and which are held out.

- No validation configured: the training split is ``build_dataset``'s whole source (unchanged).
- ``val_fraction``: a seeded split of the whole source (``split_indices``); both splits are
  ``SubsetImages`` of it and never share an image.
- ``val_path``: the training split is ``path``'s source, the validation split ``val_path``'s,
  with the same class names (so label ``i`` means the same class in both).
- source ``shards``: both splits are the prepared dataset's own (``hetero dataset prep`` made
  them; ``training/data/shard_source.py``), from one manifest.

Every consumer of training images (the local loader, the trainer's local input, the data
server and its worker processes) takes ``build_split(spec, "train")`` (or ``build_splits``), so
a validation image is never trained on.

Sample ids: a split is an ``ImageSource`` of its own, and the sample ids a batch carries
(``Batch.sample_ids``, the wire's ``sample_ids``/``unreadable``) are indices into that split's
source, ``0 .. len(split) - 1``: into the training split for training batches, into the
validation split for validation batches. ``SubsetImages.base_index`` maps one back to the
index in the whole source. With no validation configured, training ids are dataset indices as
before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import StrEnum

import numpy as np

from training.data.datasets import FolderImages, ImageSource, S3Images, SyntheticImages
from training.data.shard_source import shard_splits
from training.spec import SYNTHETIC_CLASSES, DatasetSource, DatasetSpec

log = logging.getLogger(__name__)

# Mixed into the split's seed so that it shares no stream with anything else seeded by a small
# integer (the epoch order, augmentation).
_SPLIT_TAG = 0x5B117


class Split(StrEnum):
    TRAIN = "train"
    VAL = "val"


def parse_split(name: str) -> Split:
    """The split a request or caller names (``""`` is training); ``ValueError`` otherwise."""
    if name == "":
        return Split.TRAIN
    try:
        return Split(name)
    except ValueError:
        raise ValueError(
            f"unknown split {name!r}; use 'train' (or empty) for training or 'val' for validation"
        ) from None


NO_VALIDATION = (
    "job.dataset has no validation set; set job.dataset.val_path (a validation folder or "
    "s3:// prefix beside the training one) or job.dataset.val_fraction (a held-out share)"
)


class SubsetImages:
    """The samples ``indices`` of ``source``, as a source of their own: sample ``i`` is
    ``source``'s sample ``indices[i]``. Picklable (when ``source`` is)."""

    def __init__(self, source: ImageSource, indices: Sequence[int] | np.ndarray) -> None:
        idx = np.array(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(source)):
            raise ValueError(
                f"subset indices must be in [0, {len(source)}), got {int(idx.min())}.."
                f"{int(idx.max())}"
            )
        self.source = source
        self.indices = idx
        self.num_classes = source.num_classes
        self.classes = list(source.classes)

    def __len__(self) -> int:
        return int(self.indices.size)

    def base_index(self, index: int) -> int:
        """The index in ``source`` of this subset's sample ``index``."""
        if not 0 <= index < self.indices.size:
            raise IndexError(
                f"sample index {index} out of range (dataset has {self.indices.size} samples)"
            )
        return int(self.indices[index])

    def read(self, index: int) -> bytes:
        return self.source.read(self.base_index(index))

    def label(self, index: int) -> int:
        return self.source.label(self.base_index(index))

    def name(self, index: int) -> str:
        return self.source.name(self.base_index(index))

    def describe(self) -> str:
        return f"{len(self)} samples of {self.source.describe()}"


def val_count(n: int, fraction: float) -> int:
    """Samples ``split_indices`` holds out of ``n`` for ``fraction`` (0: none)."""
    return max(1, round(n * fraction)) if fraction > 0 else 0


def split_indices(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train_indices, val_indices)`` of ``range(n)``: ``round(n * fraction)`` (at least 1)
    samples held out for validation, chosen by ``seed``; both sorted int64, disjoint, together
    all of ``range(n)``.

    Deterministic on any machine and any numpy version: the order comes from PCG64's raw output
    for a ``SeedSequence`` of the seed (both stable by numpy's contract), not from a sampling
    method whose algorithm may change, so a resumed job or another server never moves an image
    between the splits."""
    if not 0 < fraction < 1:
        raise ValueError(f"the validation fraction must be in (0, 1), got {fraction}")
    n_val = val_count(n, fraction)
    if n_val >= n:
        raise ValueError(
            f"job.dataset.val_fraction = {fraction:g} of {n} samples leaves no training sample; "
            "use a smaller fraction or a bigger dataset"
        )
    order = seeded_order(n, seed, _SPLIT_TAG)
    return np.sort(order[n_val:]).astype(np.int64), np.sort(order[:n_val]).astype(np.int64)


def seeded_order(n: int, seed: int, tag: int) -> np.ndarray:
    """A permutation of ``range(n)`` by ``seed`` (``tag``: the stream of one use), the same on
    any machine and numpy version: from PCG64's raw output for a ``SeedSequence``."""
    bits = np.random.PCG64(np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, tag]))
    return np.argsort(bits.random_raw(n), kind="stable")


def check_same_classes(
    train: Sequence[str], val: Sequence[str], val_where: str, train_where: str
) -> None:
    """ValueError unless the validation source's class names are the training source's, in the
    same order (label ``i`` means the same class in both); ``*_where``: each as the user named
    it (field or flag, and value)."""
    if list(val) == list(train):
        return
    missing = sorted(set(train) - set(val))
    extra = sorted(set(val) - set(train))
    differ = [f"missing there: {missing}"] if missing else []
    differ += [f"only there: {extra}"] if extra else []
    raise ValueError(
        f"{val_where} must have the same class names as {train_where}; "
        f"{'; '.join(differ) or 'their order differs'}"
    )


def build_dataset(spec: DatasetSpec) -> ImageSource:
    """The whole image source the spec's ``[job.dataset]`` describes (``path``; with
    ``val_fraction`` the validation share is still in it: train and evaluate on
    ``training.data.splits.build_split``); raises ``ValueError`` naming the field to fix when
    the folder or prefix holds no usable images."""
    source: ImageSource
    if spec.source is DatasetSource.SYNTHETIC:
        classes = spec.num_classes if spec.num_classes is not None else SYNTHETIC_CLASSES
        source = SyntheticImages(spec.num_samples, classes, spec.image_size)
    elif spec.source is DatasetSource.FOLDER:
        if not spec.path:
            raise ValueError("job.dataset.path is required for source 'folder'")
        source = FolderImages(spec.path)
    elif spec.source is DatasetSource.S3:
        if not spec.path:
            raise ValueError("job.dataset.path is required for source 's3'")
        source = S3Images(spec.path)
    elif spec.source is DatasetSource.SHARDS:
        if not spec.path:
            raise ValueError("job.dataset.path is required for source 'shards'")
        source = shard_splits(spec)[0]  # the training split: a prepared dataset is split
    else:  # pragma: no cover - the spec's enum is exhaustive
        raise ValueError(f"unknown dataset source {spec.source!r}")
    log.info("dataset: %s", source.describe())
    return source


def _val_source(spec: DatasetSpec) -> ImageSource:
    assert spec.val_path is not None
    field = "job.dataset.val_path"
    if spec.source is DatasetSource.FOLDER:
        return FolderImages(spec.val_path, field=field)
    if spec.source is DatasetSource.S3:
        return S3Images(spec.val_path, field=field)
    raise ValueError(
        f"{field}: source '{spec.source}' has no validation folder; use job.dataset.val_fraction"
    )


def build_splits(
    spec: DatasetSpec, *, full: ImageSource | None = None
) -> tuple[ImageSource, ImageSource | None]:
    """``(training source, validation source or None)`` for ``spec``. ``full`` is
    ``build_dataset(spec)`` when the caller has it already (it is not listed again). Raises
    ``ValueError`` naming the field to fix."""
    if spec.source is DatasetSource.SHARDS:
        train_shards, val_shards = shard_splits(spec)  # the split the manifest holds
        if val_shards is not None:
            log.info("validation split: %s", val_shards.describe())
        return train_shards, val_shards
    whole = full if full is not None else build_dataset(spec)
    if spec.val_path is not None:
        val = _val_source(spec)
        check_same_classes(
            whole.classes,
            val.classes,
            f"job.dataset.val_path {spec.val_path!r}",
            f"job.dataset.path {spec.path!r}",
        )
        log.info("validation split: %s", val.describe())
        return whole, val
    if spec.val_fraction > 0:
        train_idx, val_idx = split_indices(len(whole), spec.val_fraction, spec.split_seed)
        log.info(
            "split (val_fraction %g, split_seed %d): %d training, %d validation samples",
            spec.val_fraction, spec.split_seed, train_idx.size, val_idx.size,
        )  # fmt: skip
        return SubsetImages(whole, train_idx), SubsetImages(whole, val_idx)
    return whole, None


def build_split(spec: DatasetSpec, split: Split | str) -> ImageSource:
    """The ``"train"`` or ``"val"`` split of ``spec`` (see the module's docstring); ``"val"``
    with no validation configured raises ``ValueError`` naming the fields to set."""
    which = parse_split(split)
    if which is Split.VAL and not spec.has_validation:
        raise ValueError(NO_VALIDATION)
    train, val = build_splits(spec)
    if which is Split.TRAIN:
        return train
    if val is None:  # a prepared dataset without a validation split
        raise ValueError(
            f"job.dataset.path {spec.path!r}: the prepared dataset has no validation split; "
            "prepare it with `hetero dataset prep --val-src` or `--val-fraction`"
        )
    return val
