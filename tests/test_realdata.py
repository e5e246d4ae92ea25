"""The real-data fixture (tests/realdata.py): scikit-learn's digits written as a fixed,
non-overlapping ImageFolder split, and ``independent_top1``, whose eval transform gives exactly the
tensors timm's eval transform gives (so its top-1 is the one the project's evaluation reports)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from PIL import Image
from realdata import NUM_CLASSES, DigitsFolders, eval_transform, independent_top1, write_digits
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from torchvision import datasets

pytest.importorskip("sklearn", reason="scikit-learn (dev extra) ships the digits")

SIZE = 32
IMAGE_SIZE = 16
CROP_PCT = 0.875


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> DigitsFolders:
    return write_digits(tmp_path_factory.mktemp("digits"), size=SIZE)


def _indices(split: Path) -> dict[int, int]:
    """Source index -> class, from ``split/<class>/<index>.png``."""
    return {int(png.stem): int(png.parent.name) for png in split.glob("*/*.png")}


def test_split_is_fixed_complete_and_disjoint(digits: DigitsFolders) -> None:
    from sklearn.datasets import load_digits

    target = load_digits().target
    train, val = _indices(digits.train_dir), _indices(digits.val_dir)
    assert (digits.train_count, digits.val_count, digits.total) == (1437, 360, 1797)
    assert (len(train), len(val)) == (digits.train_count, digits.val_count)
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(range(1797))
    assert set(val) == {i for i in range(1797) if i % 5 == 0}
    # Every image sits in the folder of its own label.
    assert all(target[i] == label for i, label in {**train, **val}.items())
    for split in (digits.train_dir, digits.val_dir):
        assert sorted(p.name for p in split.iterdir()) == [str(c) for c in range(NUM_CLASSES)]
    with Image.open(next(digits.val_dir.glob("3/*.png"))) as image:
        assert (image.mode, image.size) == ("RGB", (SIZE, SIZE))


class _Oracle(torch.nn.Module):
    """Knows every validation image (as timm's eval transform makes it) and its label."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("images", images.flatten(1))
        self.register_buffer("labels", labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nearest = torch.cdist(x.flatten(1), self.images).argmin(dim=1)
        return torch.nn.functional.one_hot(self.labels[nearest], NUM_CLASSES).float()


class _Constant(torch.nn.Module):
    def __init__(self, label: int) -> None:
        super().__init__()
        self.label = label

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(x.shape[0], NUM_CLASSES)
        logits[:, self.label] = 1.0
        return logits


def _timm_eval(image_size: int, crop_pct: float, interpolation: str) -> object:
    return create_transform(
        input_size=(3, image_size, image_size),
        is_training=False,
        crop_pct=crop_pct,
        interpolation=interpolation,
        mean=IMAGENET_DEFAULT_MEAN,
        std=IMAGENET_DEFAULT_STD,
    )


def _top1(model: torch.nn.Module, digits: DigitsFolders) -> float:
    return independent_top1(
        model,
        digits.val_dir,
        image_size=IMAGE_SIZE,
        crop_pct=CROP_PCT,
        interpolation="bilinear",
        mean=IMAGENET_DEFAULT_MEAN,
        std=IMAGENET_DEFAULT_STD,
    )


def test_an_oracle_scores_one_and_a_constant_model_its_class_share(
    digits: DigitsFolders,
) -> None:
    val = datasets.ImageFolder(
        str(digits.val_dir), transform=_timm_eval(IMAGE_SIZE, CROP_PCT, "bilinear")
    )
    images = torch.stack([image for image, _ in val])
    oracle = _Oracle(images, torch.tensor(val.targets))
    oracle.train()
    assert _top1(oracle, digits) == 1.0
    assert oracle.training  # the mode the model came in with is restored
    share = val.targets.count(0) / len(val)
    assert _top1(_Constant(0), digits) == share
    assert 0.08 < share < 0.12


@pytest.mark.parametrize(
    ("image_size", "crop_pct", "interpolation"),
    [(16, 0.875, "bilinear"), (32, 0.875, "bicubic"), (24, 0.9, "bilinear"), (32, 1.0, "bilinear")],
)
def test_eval_transform_is_timms(
    digits: DigitsFolders, image_size: int, crop_pct: float, interpolation: str
) -> None:
    """Resize(floor(size / crop_pct)) + CenterCrop(size) + ToTensor + Normalize, restated with
    torchvision, gives bit-identical tensors to timm's ``create_transform(is_training=False)``."""
    ours = eval_transform(
        image_size=image_size,
        crop_pct=crop_pct,
        interpolation=interpolation,
        mean=IMAGENET_DEFAULT_MEAN,
        std=IMAGENET_DEFAULT_STD,
    )
    timms = _timm_eval(image_size, crop_pct, interpolation)
    val = datasets.ImageFolder(str(digits.val_dir))
    for path, _ in val.samples:
        image = val.loader(path)
        a, b = ours(image), timms(image)  # type: ignore[operator]
        assert a.shape == (3, image_size, image_size)
        assert torch.equal(a, b), path


def test_the_check_shares_no_code_with_the_trainer() -> None:
    """``independent_top1`` is the check that does not go through the project's code."""
    tree = ast.parse((Path(__file__).parent / "realdata.py").read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] in {"training", "infra"}}
