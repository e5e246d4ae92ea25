"""The trainer's validation batches: every validation sample exactly once per pass across 1, 2
and 3 ranks, locally and through a data server on localhost, the same bytes both ways, the
same batches on every pass, and every rank the same forward-pass count."""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from training.data.batch import Batch, Unreadable
from training.data.datasets import FolderImages
from training.data.splits import SubsetImages, build_split
from training.data.transforms import EvalTransform
from training.dataplane.server import create_server
from training.dataplane.sources import AugmentingBatchSource
from training.spec import load_spec
from training.trainer.config import InputKind, TrainerConfig
from training.trainer.eval_data import ValidationBatches, eval_shard

# 30 images, val_fraction 0.37: 11 validation samples (not a multiple of 2 or 3), batches of 3.
VAL_SAMPLES = 11

SPEC = """
name = "eval-test"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 1
[job]
batch_size = 4
steps = 1
precision = "fp32"
[job.model]
name = "vit-cpu-tiny"
[job.dataset]
source = "folder"
path = "{path}"
num_classes = 3
image_size = 32
{validation}
[job.eval]
batch_size = 3
crop_pct = 0.9
[job.dataplane]
workers_per_server = 1
"""


def write_folder(root: Path) -> Path:
    for c in range(3):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(10):
            pixels = np.random.default_rng(10 * c + i).integers(0, 256, (36, 44, 3), np.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format="PNG")
            (root / f"c{c}" / f"{i}.png").write_bytes(buf.getvalue())
    return root


@pytest.fixture
def spec_path(tmp_path: Path) -> Path:
    path = tmp_path / "spec.toml"
    folder = write_folder(tmp_path / "images")
    path.write_text(SPEC.format(path=folder, validation="val_fraction = 0.37"))
    return path


def config(
    spec_path: Path, servers: list[str] | None = None, *, synthetic: bool = False
) -> TrainerConfig:
    return TrainerConfig.from_spec(
        load_spec(spec_path),
        run_dir=spec_path.parent / "run",
        data_servers=servers or [],
        synthetic=synthetic,
    )


@pytest.fixture
def server(spec_path: Path) -> Iterator[str]:
    """An in-process data server for the spec (augmenting in threads)."""
    job = load_spec(spec_path).job
    source = AugmentingBatchSource(
        job.dataset, eval_recipe=EvalTransform.from_spec(job.eval), workers=1, processes=False
    )
    srv, port = create_server(source, port=0)
    yield f"127.0.0.1:{port}"
    srv.stop(0).wait()
    source.close()


def one_pass(ranks: list[ValidationBatches]) -> list[list[Batch]]:
    return [list(r.iter_batches()) for r in ranks]


def check_exactly_once(passes: list[list[Batch]], ranks: list[ValidationBatches]) -> None:
    ids = [i for batches in passes for b in batches for i in b.sample_ids.tolist()]
    assert ids == list(range(VAL_SAMPLES))  # rank blocks in order, each sample once
    counts = [len(batches) for batches in passes]
    assert max(counts) == ranks[0].batches_per_rank
    assert all(r.batches_per_rank == ranks[0].batches_per_rank for r in ranks)
    assert counts == [r.batches for r in ranks]
    for batches in passes:
        assert all(len(b) <= 3 and b.images.shape[1:] == (3, 32, 32) for b in batches)


@pytest.mark.parametrize(("n", "world"), [(n, w) for n in range(0, 14) for w in range(1, 6)])
def test_eval_shard_covers_every_position_once(n: int, world: int) -> None:
    blocks = [eval_shard(n, r, world) for r in range(world)]
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    sizes = [stop - start for start, stop in blocks]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 0


def test_eval_shard_refuses_a_bad_rank() -> None:
    with pytest.raises(ValueError, match="rank must be in"):
        eval_shard(10, 2, 2)


@pytest.mark.parametrize(("world", "per_rank"), [(1, 4), (2, 2), (3, 2)])
def test_local_eval_covers_the_val_set_once_per_pass(
    spec_path: Path, world: int, per_rank: int
) -> None:
    cfg = config(spec_path)
    assert cfg.input.kind is InputKind.LOCAL
    ranks = [ValidationBatches(cfg, rank=r, world_size=world, num_workers=0) for r in range(world)]
    assert ranks[0].num_samples == VAL_SAMPLES and ranks[0].batches_per_rank == per_rank
    first = one_pass(ranks)
    check_exactly_once(first, ranks)
    # The labels are the validation split's own.
    val = build_split(load_spec(spec_path).job.dataset, "val")
    for batches in first:
        for b in batches:
            assert b.labels.tolist() == [val.label(i) for i in b.sample_ids.tolist()]
    second = one_pass(ranks)
    for a_rank, b_rank in zip(first, second, strict=True):
        for a, b in zip(a_rank, b_rank, strict=True):
            assert torch.equal(a.images, b.images) and torch.equal(a.sample_ids, b.sample_ids)


def test_more_ranks_than_samples_leave_some_blocks_empty(spec_path: Path) -> None:
    cfg = config(spec_path)
    last = ValidationBatches(cfg, rank=12, world_size=13, num_workers=0)
    assert last.block == (11, 11) and last.batches == 0 and last.batches_per_rank == 1
    assert list(last.iter_batches()) == []


@pytest.mark.parametrize("world", [1, 2, 3])
def test_data_plane_eval_covers_the_val_set_once_per_pass_with_local_bytes(
    spec_path: Path, server: str, world: int
) -> None:
    cfg = config(spec_path, [server])
    assert cfg.input.kind is InputKind.DATAPLANE
    ranks = [ValidationBatches(cfg, rank=r, world_size=world) for r in range(world)]
    try:
        first = one_pass(ranks)
        check_exactly_once(first, ranks)
        second = one_pass(ranks)  # the same clients, another pass
    finally:
        for r in ranks:
            r.close()
    local = ValidationBatches(config(spec_path), rank=0, world_size=1)  # default workers
    expected = torch.cat([b.images for b in local.iter_batches()])
    got = torch.cat([b.images for batches in first for b in batches])
    assert torch.equal(got, expected)  # the data plane's eval bytes are the local path's
    assert torch.equal(torch.cat([b.images for bs in second for b in bs]), expected)
    assert [b.sample_ids.tolist() for bs in second for b in bs] == [
        b.sample_ids.tolist() for bs in first for b in bs
    ]


def _break_val_samples(spec_path: Path, ids: list[int]) -> dict[int, str]:
    """Validation sample id -> the file, for each of ``ids``, now not an image."""
    val = build_split(load_spec(spec_path).job.dataset, "val")
    assert isinstance(val, SubsetImages) and isinstance(val.source, FolderImages)
    files = {i: val.source.samples[val.base_index(i)][0] for i in ids}
    for file in files.values():
        Path(file).write_bytes(b"not an image")
    return files


@pytest.mark.parametrize("dataplane", [False, True])
def test_an_unreadable_batch_still_counts(spec_path: Path, server: str, dataplane: bool) -> None:
    # All of the second batch, one of the last.
    files = _break_val_samples(spec_path, [3, 4, 5, 9])
    v = ValidationBatches(
        config(spec_path, [server] if dataplane else None), rank=0, world_size=1, num_workers=0
    )
    try:
        batches = list(v.iter_batches())
    finally:
        v.close()
    assert [b.sample_ids.tolist() for b in batches] == [[0, 1, 2], [], [6, 7, 8], [10]]
    assert len(batches) == v.batches_per_rank
    why = "not a readable image: not an image: no image format recognises its bytes"
    assert [b.skipped for b in batches] == [
        (),
        tuple(Unreadable(i, files[i], why) for i in (3, 4, 5)),
        (),
        (Unreadable(9, files[9], why),),
    ]


def test_synthetic_input_and_no_validation_are_refused(tmp_path: Path, spec_path: Path) -> None:
    with pytest.raises(ValueError, match="synthetic input has no images to evaluate"):
        ValidationBatches(config(spec_path, synthetic=True), rank=0, world_size=1)
    plain = tmp_path / "plain.toml"
    text = SPEC.format(path=tmp_path / "images", validation="").split("[job.eval]")[0]
    plain.write_text(text)
    with pytest.raises(ValueError, match=r"val_path .* or job\.dataset\.val_fraction"):
        ValidationBatches(config(plain), rank=0, world_size=1)
