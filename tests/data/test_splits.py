"""The validation split: seeded, deterministic, disjoint from training everywhere training
images are read (checked on the files themselves, not on split-local sample ids)."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from training.data.datasets import FolderImages, SyntheticImages
from training.data.loader import local_loader
from training.data.splits import (
    SubsetImages,
    build_dataset,
    build_split,
    build_splits,
    parse_split,
    split_indices,
)
from training.spec import DatasetSource, DatasetSpec, JobSpec
from training.trainer.inputs import LocalBatches

CLASSES = ["ant", "bee", "cat"]
# split_indices(20, 0.25, seed=0)'s validation indices, computed once (numpy 2, PCG64).
PINNED_VAL = [0, 4, 8, 10, 15]


def write_folder(root: Path, per_class: int = 7, classes: list[str] = CLASSES) -> Path:
    """An ImageFolder of small PNGs, each a distinct colour."""
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            buf = io.BytesIO()
            pixels = np.full((20, 24, 3), (60 * c, 9 * i, 100), dtype=np.uint8)
            Image.fromarray(pixels).save(buf, format="PNG")
            (root / name / f"{i:02d}.png").write_bytes(buf.getvalue())
    return root


def _paths(source: object) -> list[str]:
    """The file behind every sample of a FolderImages or a subset of one."""
    if isinstance(source, SubsetImages):
        assert isinstance(source.source, FolderImages)
        return [source.source.samples[source.base_index(i)][0] for i in range(len(source))]
    assert isinstance(source, FolderImages)
    return [p for p, _ in source.samples]


@pytest.mark.parametrize("n", [2, 3, 10, 97, 1000])
@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.25, 0.5])
def test_split_is_disjoint_sorted_and_covers_everything(n: int, fraction: float) -> None:
    train, val = split_indices(n, fraction, seed=5)
    assert len(val) == max(1, round(n * fraction))
    assert train.dtype == val.dtype == np.int64
    assert list(train) == sorted(train) and list(val) == sorted(val)
    assert not set(train.tolist()) & set(val.tolist())
    assert sorted(train.tolist() + val.tolist()) == list(range(n))


def test_split_is_fixed_by_its_seed() -> None:
    train, val = split_indices(200, 0.2, seed=3)
    again_train, again_val = split_indices(200, 0.2, seed=3)
    assert np.array_equal(train, again_train) and np.array_equal(val, again_val)
    assert not np.array_equal(val, split_indices(200, 0.2, seed=4)[1])
    # Pinned: the split may never change under a numpy upgrade or on another machine (a
    # resumed job would train on images it had held out).
    assert split_indices(20, 0.25, seed=0)[1].tolist() == PINNED_VAL


def test_split_is_the_same_in_another_process() -> None:
    code = (
        "from training.data.splits import split_indices; "
        "print(split_indices(1000, 0.3, 11)[1].tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == str(split_indices(1000, 0.3, 11)[1].tolist())


@pytest.mark.parametrize(
    ("n", "fraction", "message"),
    [
        (1, 0.5, "leaves no training sample"),
        (10, 0.0, r"must be in \(0, 1\)"),
        (10, 1.0, r"must be in \(0, 1\)"),
    ],
)
def test_impossible_splits_are_refused(n: int, fraction: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_indices(n, fraction, seed=0)


def test_val_fraction_splits_a_folder_into_disjoint_files(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "data")
    spec = DatasetSpec(
        source=DatasetSource.FOLDER, path=str(root), image_size=32, val_fraction=0.25
    )
    train, val = build_splits(spec)
    assert isinstance(train, SubsetImages) and isinstance(val, SubsetImages)
    assert (len(train), len(val)) == (16, 5)  # round(21 * 0.25) = 5
    assert train.classes == val.classes == CLASSES
    train_files, val_files = set(_paths(train)), set(_paths(val))
    assert not train_files & val_files
    assert train_files | val_files == set(_paths(build_dataset(spec)))
    # A subset's sample is its source's sample: same bytes, same label.
    whole = val.source
    for i in range(len(val)):
        assert val.read(i) == whole.read(val.base_index(i))
        assert val.label(i) == whole.label(val.base_index(i))
    # build_split gives the same splits (a server and its workers build them separately).
    assert _paths(build_split(spec, "train")) == _paths(train)
    assert _paths(build_split(spec, "val")) == _paths(val)
    other = DatasetSpec(
        source=DatasetSource.FOLDER, path=str(root), val_fraction=0.25, split_seed=1
    )
    assert _paths(build_split(other, "val")) != _paths(val)


def test_the_training_loader_never_reads_a_validation_file(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "data")
    dataset = DatasetSpec(
        source=DatasetSource.FOLDER, path=str(root), image_size=32, val_fraction=0.3
    )
    job = JobSpec(dataset=dataset, batch_size=4)
    train = build_split(dataset, "train")
    val_files = set(_paths(build_split(dataset, "val")))
    read: list[str] = []
    for batch in local_loader(job, num_workers=0):
        # Training sample ids are indices into the training split.
        read += [_paths(train)[i] for i in batch.sample_ids.tolist()]
    assert sorted(read) == sorted(_paths(train))
    assert not set(read) & val_files
    # The trainer's local input epochs over the training split only: 15 of 21 images.
    assert len(train) == 15
    assert LocalBatches(job, rank=0, world_size=1).batches_per_epoch == 15 // 4


def test_val_path_is_a_folder_of_its_own_with_the_same_classes(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "train")
    val_root = write_folder(tmp_path / "val", per_class=2)
    spec = DatasetSpec(
        source=DatasetSource.FOLDER, path=str(root), image_size=32, val_path=str(val_root)
    )
    train, val = build_splits(spec)
    assert isinstance(train, FolderImages) and isinstance(val, FolderImages)
    assert (len(train), len(val)) == (21, 6) and val.classes == CLASSES
    assert all(p.startswith(str(val_root)) for p in _paths(val))


def test_val_path_with_other_classes_is_refused(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "train")
    val_root = write_folder(tmp_path / "val", per_class=1, classes=["ant", "bee", "dog"])
    spec = DatasetSpec(source=DatasetSource.FOLDER, path=str(root), val_path=str(val_root))
    with pytest.raises(ValueError, match=r"job\.dataset\.val_path") as err:
        build_split(spec, "train")
    assert "missing there: ['cat']" in str(err.value)
    assert "only there: ['dog']" in str(err.value)
    missing = DatasetSpec(
        source=DatasetSource.FOLDER, path=str(root), val_path=str(tmp_path / "nope")
    )
    with pytest.raises(ValueError, match=r"job\.dataset\.val_path .* is not a folder"):
        build_split(missing, "val")


def test_no_validation_keeps_the_whole_dataset_and_refuses_val() -> None:
    spec = DatasetSpec(num_samples=12, num_classes=3, image_size=32)
    train = build_split(spec, "train")
    assert isinstance(train, SyntheticImages) and len(train) == 12
    assert train.classes == ["class_0", "class_1", "class_2"]
    with pytest.raises(ValueError, match=r"val_path .* or job\.dataset\.val_fraction"):
        build_split(spec, "val")
    with pytest.raises(ValueError, match="unknown split 'test'"):
        parse_split("test")
    assert parse_split("") == parse_split("train") == "train"


def test_a_subset_names_each_sample_as_its_source_does(tmp_path: Path) -> None:
    subset = SubsetImages(SyntheticImages(20, 4, 32), [3, 17, 5])
    assert [subset.name(i) for i in range(3)] == ["synthetic:3", "synthetic:17", "synthetic:5"]
    with pytest.raises(IndexError, match="out of range"):
        subset.name(3)
    root = write_folder(tmp_path / "data")
    val = build_split(
        DatasetSpec(source=DatasetSource.FOLDER, path=str(root), val_fraction=0.25), "val"
    )
    assert isinstance(val, SubsetImages)
    files = sorted(str(p) for p in root.glob("*/*.png"))
    assert [val.name(i) for i in range(len(val))] == [files[int(j)] for j in val.indices]


def test_a_subset_pickles_for_worker_processes() -> None:
    spec = DatasetSpec(num_samples=30, num_classes=3, image_size=32, val_fraction=0.2)
    val = build_split(spec, "val")
    copy = pickle.loads(pickle.dumps(val))
    assert len(copy) == len(val) == 6
    assert [copy.read(i) for i in range(6)] == [val.read(i) for i in range(6)]
    assert copy.classes == val.classes == ["class_0", "class_1", "class_2"]
    with pytest.raises(IndexError, match="out of range"):
        val.read(6)
