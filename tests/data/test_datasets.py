"""Datasets, recipes, epoch order and the local loader, on small real images."""

from __future__ import annotations

import io
import os
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch
from moto import mock_aws
from PIL import Image

from training.data.augment import load_image
from training.data.batch import Unreadable
from training.data.datasets import FolderImages, S3Images, SyntheticImages
from training.data.decode import decode_image
from training.data.loader import local_loader
from training.data.order import epoch_order
from training.data.transforms import build_transform
from training.spec import DatasetSource, DatasetSpec, JobSpec


def _encoded(colour: tuple[int, int, int], fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((36, 44, 3), colour, dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def test_synthetic_images_are_deterministic_jpegs() -> None:
    source = SyntheticImages(20, 4, 32)
    assert source.read(7) == source.read(7) != source.read(8)
    assert source.read(7)[:2] == b"\xff\xd8"  # JPEG: decoding is part of the cost
    assert decode_image(source.read(7)).size == (37, 37)
    assert [source.label(i) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [source.name(i) for i in (0, 7, 19)] == ["synthetic:0", "synthetic:7", "synthetic:19"]
    with pytest.raises(IndexError, match="out of range"):
        source.read(20)
    with pytest.raises(IndexError, match="out of range"):
        source.name(20)


@pytest.mark.parametrize("recipe", ["standard", "randaugment"])
def test_recipes_make_uint8_chw(recipe: str) -> None:
    out = build_transform(recipe, 32)(decode_image(SyntheticImages(1, 1, 32).read(0)))
    assert out.dtype == torch.uint8 and tuple(out.shape) == (3, 32, 32)


def test_unknown_recipe_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'mixup'.*standard, randaugment"):
        build_transform("mixup", 32)


def test_epoch_order_is_a_seeded_permutation() -> None:
    a = epoch_order(1, 0, 50)
    assert sorted(a.tolist()) == list(range(50))
    assert torch.equal(a, epoch_order(1, 0, 50))
    assert not torch.equal(a, epoch_order(1, 1, 50))
    assert not torch.equal(a, epoch_order(2, 0, 50))


def test_folder_dataset_and_local_loader_skip_unreadable(tmp_path: Path) -> None:
    for c, cls in enumerate(["ant", "bee"]):
        (tmp_path / cls).mkdir()
        for i in range(3):
            (tmp_path / cls / f"{i}.jpg").write_bytes(_encoded((80 * c, 50, 30 * i), "JPEG"))
        (tmp_path / cls / "x.png").write_bytes(_encoded((10, 200, 80 * c), "PNG"))
    (tmp_path / "bee" / "truncated.jpg").write_bytes(_encoded((1, 2, 3), "JPEG")[:40])
    source = FolderImages(tmp_path)
    assert source.classes == ["ant", "bee"] and len(source) == 9
    job = JobSpec(
        batch_size=4,
        dataset=DatasetSpec(source=DatasetSource.FOLDER, path=str(tmp_path), image_size=32),
    )
    batches = list(local_loader(job, rank=0, world_size=1, epoch=0, num_workers=0))
    ids = [i for b in batches for i in b.sample_ids.tolist()]
    bad = next(i for i, (p, _) in enumerate(source.samples) if p.endswith("truncated.jpg"))
    assert sorted(ids) == sorted(set(range(9)) - {bad})
    assert [u for b in batches for u in b.skipped] == [
        Unreadable(
            bad,
            str(tmp_path / "bee" / "truncated.jpg"),
            "not a readable image: corrupt or truncated: Truncated File Read",
        )
    ]
    assert all(b.images.shape[1:] == (3, 32, 32) for b in batches)
    labels = {i: source.label(i) for i in ids}
    assert all(
        labels[i] == lab
        for b in batches
        for i, lab in zip(b.sample_ids.tolist(), b.labels.tolist(), strict=True)
    )


def test_local_loader_shards_are_disjoint() -> None:
    job = JobSpec(batch_size=4, dataset=DatasetSpec(num_samples=22, num_classes=3, image_size=16))
    shards = [
        [
            i
            for b in local_loader(job, rank=r, world_size=2, epoch=1, num_workers=0)
            for i in b.sample_ids.tolist()
        ]
        for r in range(2)
    ]
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(22))


def test_a_folder_sample_is_named_by_its_path_shown_as_text(tmp_path: Path) -> None:
    """A file name whose bytes are not UTF-8 is named with those bytes as ``\\xNN``: text that
    any log or message takes, and that the data path reports when the file is unreadable."""
    (tmp_path / "cat").mkdir()
    png = _encoded((9, 9, 9), "PNG")
    (tmp_path / "cat" / "a.png").write_bytes(png)
    folder = os.fsencode(tmp_path / "cat")
    with open(folder + b"/caf\xe9-\xff.png", "wb") as f:
        f.write(png)
    with open(folder + b"/\xfe.jpg", "wb"):
        pass  # empty: unreadable
    source = FolderImages(tmp_path)
    names = [source.name(i) for i in range(len(source))]
    assert names == [
        f"{tmp_path}/cat/a.png",
        f"{tmp_path}/cat/caf\\xe9-\\xff.png",
        f"{tmp_path}/cat/\\xfe.jpg",
    ]
    assert all(n.encode("utf-8") for n in names)
    assert source.read(1) == png
    assert load_image(source, 2) == Unreadable(
        2, f"{tmp_path}/cat/\\xfe.jpg", "not a readable image: empty file"
    )
    with pytest.raises(IndexError, match="out of range"):
        source.name(3)


def test_empty_folder_error_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"job\.dataset\.path"):
        FolderImages(tmp_path / "missing")


@mock_aws
def test_s3_prefix_dataset() -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="images")
    for cls in ("cat", "dog"):
        for i in range(2):
            s3.put_object(
                Bucket="images", Key=f"train/{cls}/{i}.jpg", Body=_encoded((i, 9, 9), "JPEG")
            )
    s3.put_object(Bucket="images", Key="train/README.txt", Body=b"not an image")
    s3.put_object(Bucket="images", Key="other/cat/9.jpg", Body=_encoded((0, 0, 0), "JPEG"))

    source = S3Images("s3://images/train", client=s3)
    assert source.classes == ["cat", "dog"] and len(source) == 4
    assert [source.label(i) for i in range(4)] == [0, 0, 1, 1]
    assert [source.name(i) for i in range(4)] == [
        "s3://images/train/cat/0.jpg",
        "s3://images/train/cat/1.jpg",
        "s3://images/train/dog/0.jpg",
        "s3://images/train/dog/1.jpg",
    ]
    with pytest.raises(IndexError, match="out of range"):
        source.name(4)
    assert decode_image(source.read(3)).size == (44, 36)
    # The source travels to worker processes without its client, which each one re-creates.
    import pickle

    clone = pickle.loads(pickle.dumps(source))
    assert clone.read(0) == source.read(0)

    with pytest.raises(ValueError, match="no images found"):
        S3Images("s3://images/nothing/", client=s3)
