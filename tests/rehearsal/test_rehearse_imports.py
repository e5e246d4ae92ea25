"""`hetero rehearse` runs once per rehearsal, beside every instance's processes on the same
cores: it orders the dataset (torch's generator, for the every-sample-once check) but never
augments an image, so it loads neither timm nor torchvision (with torch._dynamo, which
torchvision's import pulls in: several seconds of a core per rehearsal, and its `--help`)."""

from __future__ import annotations

from pathlib import Path

from fresh_imports import loaded_modules


def top_level(*code: str) -> set[str]:
    return {m.split(".")[0] for m in loaded_modules(*code)}


def test_the_rehearse_command_loads_torch_but_not_timm_or_torchvision() -> None:
    code = (
        "from training.cli import build_parser",
        "argv = ['rehearse', '--spec', 'specs/rehearsal.toml', '--out', 'x']",
        "build_parser('rehearse').parse_args(argv)",
        "import training.rehearsal.rehearse",
    )
    loaded = top_level(*code)
    assert "torch" in loaded  # the probe sees what is loaded
    heavy = {"timm", "torchvision", "triton"}
    assert not loaded & heavy, sorted(loaded & heavy)


def test_a_folder_dataset_still_lists_with_torchvision_rules(tmp_path: Path) -> None:
    """torchvision's folder rules are imported where a folder is listed: an ImageFolder with a
    non-image file lists only its images."""
    from PIL import Image

    from training.data.datasets import FolderImages

    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        Image.new("RGB", (4, 4)).save(tmp_path / cls / "a.jpg")
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    folder = FolderImages(tmp_path)
    assert folder.classes == ["cat", "dog"]
    assert [(p.rsplit("/", 2)[-2], label) for p, label in folder.samples] == [
        ("cat", 0),
        ("dog", 1),
    ]
