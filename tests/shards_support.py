"""A small prepared dataset for the shard-source tests: real digit images (``tests/realdata``),
packed in WebDataset's layout with a manifest in ``training/data/manifest.py``'s format. Written
here with ``tarfile`` so the reader is tested against the format, not against its own writer.
``prep_digits`` instead prepares them with the real command, for the tests that train on them."""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from launcher.processes import run_watched
from realdata import DigitsFolders, write_digits

from training.data.manifest import MANIFEST_NAME, Manifest, Shard, SplitIndex
from training.data.splits import Split, build_split
from training.spec import DatasetSource, DatasetSpec


@dataclass(frozen=True)
class Prepared:
    root: Path
    manifest: Manifest
    images: dict[str, list[bytes]]
    """Split -> the image bytes of its samples, by split index."""
    labels: dict[str, list[int]]


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> int:
    """Add ``name`` holding ``data``; the offset of its data in the archive."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    offset = tar.offset + tarfile.BLOCKSIZE  # one header block (ustar, short names)
    tar.addfile(info, io.BytesIO(data))
    return offset


def write_prepared(
    root: Path, folders: dict[str, Path], *, per_shard: int, order_seed: int = 0
) -> Prepared:
    """Shard the ImageFolder ``folders`` (split -> folder) into ``root``: samples shuffled by
    ``order_seed`` (so each shard mixes the classes), ``per_shard`` samples per shard."""
    import numpy as np

    root.mkdir(parents=True, exist_ok=True)
    splits: dict[str, SplitIndex] = {}
    images: dict[str, list[bytes]] = {}
    labels: dict[str, list[int]] = {}
    classes: list[str] = []
    for split, folder in folders.items():
        source = build_split(
            DatasetSpec(source=DatasetSource.FOLDER, path=str(folder)), Split.TRAIN
        )
        classes = list(source.classes)
        order = np.random.default_rng(order_seed).permutation(len(source)).tolist()
        imgs = [source.read(i) for i in order]
        labs = [source.label(i) for i in order]
        shards, offsets, sizes = [], [], []
        for k, first in enumerate(range(0, len(imgs), per_shard)):
            name = f"{split}-{k:06d}.tar"
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for i in range(first, min(first + per_shard, len(imgs))):
                    offsets.append(_member(tar, f"{i:08d}.png", imgs[i]))
                    sizes.append(len(imgs[i]))
                    _member(tar, f"{i:08d}.cls", str(labs[i]).encode())
            data = buf.getvalue()
            (root / name).write_bytes(data)
            count = min(per_shard, len(imgs) - first)
            shards.append(Shard(name, len(data), hashlib.sha256(data).hexdigest(), first, count))
        splits[split] = SplitIndex(tuple(shards), tuple(offsets), tuple(sizes), tuple(labs))
        images[split], labels[split] = imgs, labs
    manifest = Manifest(classes=tuple(classes), splits=splits, source="tests")
    (root / MANIFEST_NAME).write_bytes(manifest.dumps())
    return Prepared(root, manifest, images, labels)


def prep_digits(root: Path) -> tuple[DigitsFolders, Path]:
    """The digits written as images under ``root/digits`` and prepared by ``hetero dataset prep``
    itself (the command a user runs) into ``root/shards``; (the image folders, the shards)."""
    folders = write_digits(root / "digits", size=32)
    shards = root / "shards"
    prep = [sys.executable, "-m", "training.cli", "dataset", "prep",
            "--src", str(folders.train_dir), "--val-src", str(folders.val_dir),
            "--out", str(shards), "--shard-mb", "0.1"]  # fmt: skip
    prepared = run_watched(prep, cwd=Path(__file__).resolve().parents[1], timeout_s=120)
    assert prepared.returncode == 0, prepared.output[-4000:]
    return folders, shards
