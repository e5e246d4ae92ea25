"""The classifier's width from the data: a folder's class folders, an S3 prefix's class
prefixes, a prepared dataset's manifest; a spec that sets another count refuses to start naming
both numbers; synthetic data keeps 1000 unless told. Through ``TrainerConfig.from_spec``, the
trainer's and ``hetero export``'s one entry."""

from __future__ import annotations

import io
from pathlib import Path

import boto3
import pytest
from moto import mock_aws
from PIL import Image

from training.data.datasets import S3Images
from training.data.prep import PrepRequest, prep
from training.spec import load_spec
from training.trainer.config import ConfigError, TrainerConfig

SPEC = """
name = "classes-test"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
[job]
batch_size = 4
steps = 1
[job.model]
name = "vit-cpu-tiny"
{model}
[job.dataset]
source = "{source}"
{path}
image_size = 32
{classes}
"""


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(out, format="PNG")
    return out.getvalue()


def folder(root: Path, classes: int = 3) -> Path:
    for c in range(classes):
        (root / f"class-{c}").mkdir(parents=True)
        (root / f"class-{c}" / "0.png").write_bytes(png())
    (root / "README.txt").write_text("not a class: a file")
    return root


def config(
    tmp_path: Path, source: str, path: str | None, classes: str = "", model: str = ""
) -> TrainerConfig:
    spec = tmp_path / "spec.toml"
    where = f'path = "{path}"' if path is not None else ""
    spec.write_text(SPEC.format(source=source, path=where, classes=classes, model=model))
    return TrainerConfig.from_spec(load_spec(spec), run_dir=tmp_path / "run", environ={})


def test_a_folder_gives_its_class_folders(tmp_path: Path) -> None:
    root = folder(tmp_path / "images")
    assert config(tmp_path, "folder", str(root)).model.num_classes == 3
    assert config(tmp_path, "folder", str(root), "num_classes = 3").model.num_classes == 3


def test_another_count_than_the_folders_is_refused_naming_both(tmp_path: Path) -> None:
    root = folder(tmp_path / "images")
    with pytest.raises(ConfigError) as e:
        config(tmp_path, "folder", str(root), "num_classes = 1000")
    assert (
        f"job.dataset.num_classes = 1000, but the dataset has 3 classes (the class folders "
        f"under {root}); set job.dataset.num_classes = 3, or leave it out: it defaults to the "
        "dataset's"
    ) in str(e.value)


def test_an_override_of_the_head_must_match_the_datas_count(tmp_path: Path) -> None:
    root = folder(tmp_path / "images")
    with pytest.raises(ConfigError, match=r"overrides\.num_classes = 5 but job\.dataset\."):
        config(tmp_path, "folder", str(root), model="overrides = { num_classes = 5 }")


@mock_aws
def test_an_s3_prefix_gives_its_class_prefixes(tmp_path: Path) -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="images")
    for c in range(4):
        for i in range(3):
            s3.put_object(Bucket="images", Key=f"train/n{c:03d}/{i}.png", Body=png())
    s3.put_object(Bucket="images", Key="other/n999/0.png", Body=png())  # outside the prefix
    for path in ("s3://images/train/", "s3://images/train"):
        assert config(tmp_path, "s3", path).model.num_classes == 4
    with pytest.raises(ConfigError, match=r"= 10, but the dataset has 4 classes \(the class pre"):
        config(tmp_path, "s3", "s3://images/train/", "num_classes = 10")


@mock_aws
def test_every_class_prefix_counts_as_s3images_labels_it(tmp_path: Path) -> None:
    """The count and the labels agree on a prefix that holds no image (a console "folder", a
    text file, only deeper keys): a class in both, as an empty class folder is."""
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="images")
    for key, body in [
        ("train/a/0.png", png()),
        ("train/b/", b""),
        ("train/c/notes.txt", b"not an image"),
        ("train/d/deeper/0.png", png()),
        ("train/e/0.png", png()),
        ("train/top.png", png()),  # directly under the prefix: no class
    ]:
        s3.put_object(Bucket="images", Key=key, Body=body)
    source = S3Images("s3://images/train/", client=s3)
    assert source.classes == ["a", "b", "c", "d", "e"]
    assert [source.name(i) for i in range(len(source))] == [
        "s3://images/train/a/0.png",
        "s3://images/train/e/0.png",
    ]
    assert [source.label(i) for i in range(len(source))] == [0, 4]
    assert config(tmp_path, "s3", "s3://images/train/").model.num_classes == 5


def test_a_prepared_dataset_gives_its_manifests_classes(tmp_path: Path) -> None:
    prep(PrepRequest(src=str(folder(tmp_path / "images", classes=5)), out=str(tmp_path / "out")))
    assert config(tmp_path, "shards", str(tmp_path / "out")).model.num_classes == 5


def test_data_that_cannot_be_listed_here_needs_the_count(tmp_path: Path) -> None:
    missing = str(tmp_path / "not-here")
    assert config(tmp_path, "folder", missing, "num_classes = 7").model.num_classes == 7
    with pytest.raises(ConfigError) as e:
        config(tmp_path, "folder", missing)
    assert "job.dataset.num_classes is not set and the dataset's classes cannot be listed here" in (
        str(e.value)
    )


def test_synthetic_data_has_1000_classes_unless_told(tmp_path: Path) -> None:
    assert config(tmp_path, "synthetic", None).model.num_classes == 1000
    assert config(tmp_path, "synthetic", None, "num_classes = 10").model.num_classes == 10
