"""``python -m benchmarks per_core``: a data server's images per CPU-second against a plain timm
loop on the same core and the same photographs (target: the server at >= 1.0x the loop).

The data tier is rented by the core, so a server that spends more CPU per image than the loop it
replaces makes every job rent more of it. The images are the two photographs scikit-learn ships
(``china.jpg`` and ``flower.jpg``: 640 x 427 JPEGs of 197 and 143 KB, ImageNet's size), copied
``--images`` times into a two-class folder (``--upscale N``: enlarged N times a side, where the
servers decode large JPEGs at reduced size and the plain loop does not). For each recipe,
``--rounds`` interleaved pairs on one core (``--core``, one torch thread):

- **loop**: what a user would write without the project: each file read, opened and converted to
  RGB as timm's ``ImageDataset`` does (``Image.open(...).convert("RGB")``), then the same timm
  transform the servers build (``build_transform``: timm's ``create_transform``), to a uint8
  array; images per CPU-second of this process;
- **worker's code**: what a server's augmentation worker runs on each part (``augment_samples``
  over the folder, into one batch array), in this process on the same core: the server's path
  before its hand-off and gRPC;
- **server**: one ``hetero serve`` process with one augmentation worker pinned to that core,
  streaming ``--batches`` timed batches to a client on another core
  (``training.planner.bench.measure_dataprep``, what ``hetero bench --only dataprep`` runs);
  images per CPU-second of the server's whole process tree (gRPC, the worker, the hand-off).

The ratio is server / loop per round (and worker's code / loop); the median per recipe is the
result. Prints a table and writes ``benchmarks/results/per_core.json`` with the machine. Two
photographs are not a dataset: decode cost varies with content, so the absolute rates speak for
these images; the ratio compares the paths on the same bytes.

``--store benchmarks/results/throughput.json`` also merges each recipe's server figure (the
median round's: images per vCPU, the client's receive cost) into the results store, the entry
``hetero bench --only dataprep`` writes, so ``hetero plan`` sizes the data tier from a whole
server on real JPEGs at this image size.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sklearn.datasets
from PIL import Image

from benchmarks.trainer_common import print_table, report, spec_data, write_spec
from training.data.augment import augment_samples
from training.data.datasets import FolderImages
from training.data.transforms import build_transform
from training.planner.bench import (
    DataprepFigure,
    common_fields,
    dataprep_record,
    measure_dataprep,
    merge,
    pinned,
)
from training.spec import AugmentationSpec, Recipe, load_spec

TARGET = 1.0
SOURCE = "python -m benchmarks per_core"
PHOTOS = ("china.jpg", "flower.jpg")


def make_folder(root: Path, images: int, upscale: int = 1) -> int:
    """``images`` copies of the photographs in two class folders (with ``upscale`` > 1, each
    enlarged that many times a side, bicubic, and saved as a JPEG of quality 90); their total
    bytes."""
    photos = Path(sklearn.datasets.__file__).parent / "images"
    total = 0
    for i in range(images):
        name = PHOTOS[i % len(PHOTOS)]
        folder = root / Path(name).stem
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"{i:05d}.jpg"
        if upscale == 1:
            shutil.copyfile(photos / name, target)
        else:
            with Image.open(photos / name) as photo:
                size = (photo.width * upscale, photo.height * upscale)
                photo.convert("RGB").resize(size, Image.Resampling.BICUBIC).save(target, quality=90)
        total += target.stat().st_size
    return total


def plain_loop(files: Sequence[Path], recipe: Recipe, size: int, images: int) -> float:
    """Images per CPU-second of timm's transform over ``files`` (cycled), as a plain loop on one
    torch thread (as each server worker runs)."""
    import torch

    transform = build_transform(AugmentationSpec(preset=recipe), size)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        started = time.process_time()
        for i in range(images):
            data = files[i % len(files)].read_bytes()
            image = Image.open(io.BytesIO(data)).convert("RGB")
            np.asarray(transform(image))
        return images / (time.process_time() - started)
    finally:
        torch.set_num_threads(threads)


def worker_code(root: Path, recipe: Recipe, size: int, images: int, batch: int) -> float:
    """Images per CPU-second of the code a server's augmentation worker runs on each part
    (``augment_samples`` over the folder, into one batch array), here in this process: what
    the server's path costs before its hand-off and gRPC."""
    import torch

    source = FolderImages(root)
    transform = build_transform(AugmentationSpec(preset=recipe), size)
    out = np.empty((batch, 3, size, size), dtype=np.uint8)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        started = time.process_time()
        for first in range(0, images, batch):
            indices = [i % len(source) for i in range(first, first + batch)]
            augment_samples(source, transform, indices, size, out)
        return images / (time.process_time() - started)
    finally:
        torch.set_num_threads(threads)


def measure(
    args: argparse.Namespace, root: Path, recipe: Recipe
) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """The rounds' figures, and the results store's data-server entry of the round whose server
    rate is the median (``hetero bench``'s entry, measured here)."""
    data = spec_data(
        name="per-core", model="vit_tiny_patch16_224", image_size=args.size,
        batch_size=args.batch, steps=1, dataprep={"count": 1},
        dataset={"source": "folder", "path": str(root)},
        job={"augmentation": {"preset": recipe.value},
             "dataplane": {"prefetch_batches": 8, "chunk_batches": 2}},
    )  # fmt: skip
    spec_path = write_spec(root.parent / f"spec-{recipe.value}.toml", data)
    spec = load_spec(spec_path)
    files = sorted(root.rglob("*.jpg"))
    others = sorted(set(os.sched_getaffinity(0)) - {args.core}) or [args.core]
    rounds, figures = [], []
    for r in range(args.rounds):
        images = args.batches * args.batch
        with pinned([args.core]):
            loop = plain_loop(files, recipe, args.size, images)
            worker = worker_code(root, recipe, args.size, images, args.batch)
        server = measure_dataprep(spec_path, spec, [args.core], args.batches, others)
        row = {
            "loop": loop,
            "worker_code": worker,
            "server": server.images_per_s_per_vcpu,
            "ratio": server.images_per_s_per_vcpu / loop,
            "worker_code_ratio": worker / loop,
        }
        print(f"{recipe.value} round {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
        rounds.append(row)
        figures.append(server)
    median: DataprepFigure = sorted(figures, key=lambda f: f.images_per_s_per_vcpu)[
        (len(figures) - 1) // 2
    ]
    common = common_fields(spec, None, SOURCE)
    return rounds, dataprep_record(spec, median, [args.core], common)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks per_core", description=__doc__)
    parser.add_argument("--recipes", default="standard,randaugment", help="comma-separated")
    parser.add_argument("--images", type=int, default=128, help="files in the folder")
    parser.add_argument("--batches", type=int, default=40, help="timed batches per measurement")
    parser.add_argument("--batch", type=int, default=32, help="images per batch")
    parser.add_argument("--size", type=int, default=224, help="crop size")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved loop/server pairs")
    parser.add_argument("--core", type=int, default=0, help="the core both paths run on")
    parser.add_argument(
        "--upscale", type=int, default=1,
        help="enlarge the photographs this many times a side (4: 2560 x 1708), where the "
        "servers decode at reduced size (training/data/reduced_decode.py); results then go to "
        "per_core_x<N>.json",
    )  # fmt: skip
    parser.add_argument(
        "--store", type=Path, default=None, metavar="PATH",
        help="also merge each recipe's server figure (the median round's) into this results "
        "store, as hetero bench --only dataprep would: benchmarks/results/throughput.json is "
        "where hetero plan reads its data tier's rate",
    )  # fmt: skip
    args = parser.parse_args(argv)
    recipes = [Recipe(r.strip()) for r in args.recipes.split(",") if r.strip()]
    results: dict[str, Any] = {}
    entries: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="per-core-") as tmp:
        root = Path(tmp) / "photos"
        source_bytes = make_folder(root, args.images, args.upscale)
        for recipe in recipes:
            rounds, entry = measure(args, root, recipe)
            entries.append(entry)
            results[recipe.value] = {
                "rounds": rounds,
                **{k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
            }
    shown = "" if args.upscale == 1 else f", the photographs x{args.upscale} a side"
    print_table(
        f"images per CPU-second on one core, {args.size} px{shown}, median of {args.rounds} rounds",
        ["recipe", "plain timm loop", "worker's code", "data server", "server / loop"],
        [
            (name, *(f"{r[k]:.0f}" for k in ("loop", "worker_code", "server")), f"{r['ratio']:.2f}")
            for name, r in results.items()
        ],
        left=1,
    )
    meets = all(r["ratio"] >= TARGET for r in results.values())
    result = {
        "target": f"server / loop >= {TARGET} for every recipe",
        "meets_target": meets,
        "settings": {
            **vars(args),
            "store": None if args.store is None else str(args.store),
            "photos": list(PHOTOS),
            "source_bytes": source_bytes,
        },
        "recipes": results,
    }
    if args.store is not None:
        merge(args.store, [], entries)
        print(f"data server figures -> {args.store}")
    name = "per_core" if args.upscale == 1 else f"per_core_x{args.upscale}"
    return report(name, result, {"meets_target": meets, **{
        name: round(r["ratio"], 3) for name, r in results.items()
    }})  # fmt: skip
