"""A prepared dataset as a source: the shard-aware epoch order, reads from local shards and from
S3 through the bounded shard cache (one download per shard, checked against its checksum), the
manifest pin, and the spec's ``source = "shards"``."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from moto import mock_aws
from realdata import write_digits
from shards_support import Prepared, write_prepared

from training.data.manifest import ManifestError, load_manifest
from training.data.order import order_for, shard_epoch_order
from training.data.shard_source import ShardImages
from training.data.splits import Split, build_split, build_splits
from training.spec import DatasetSource, SpecError, load_spec

PER_SHARD = 100


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    root = tmp_path_factory.mktemp("digits")
    digits = write_digits(root / "folders", val_every=5, size=16)
    return write_prepared(
        root / "shards", {"train": digits.train_dir, "val": digits.val_dir}, per_shard=PER_SHARD
    )


# -- the order ------------------------------------------------------------------------------


def test_shard_order_is_a_seeded_permutation_whose_runs_stay_in_their_shards() -> None:
    counts = [5, 7, 3, 9, 4, 6, 8]
    order = shard_epoch_order(3, 1, counts, window=3)
    assert sorted(order.tolist()) == list(range(sum(counts)))
    assert torch.equal(order, shard_epoch_order(3, 1, counts, window=3))
    assert not torch.equal(order, shard_epoch_order(3, 2, counts, window=3))
    assert not torch.equal(order, shard_epoch_order(4, 1, counts, window=3))
    starts = [sum(counts[:k]) for k in range(len(counts))]

    def shard(i: int) -> int:
        return max(k for k, s in enumerate(starts) if s <= i)

    # Walk the runs: each holds the whole of exactly `window` shards (the last, what is left).
    pos, seen = 0, 0
    while pos < len(order):
        first = shard(int(order[pos]))
        run_shards = {first}
        # Grow the run until it holds whole shards only.
        size = counts[first]
        while len(run_shards) < 3 and seen + len(run_shards) < len(counts):
            nxt = {shard(int(i)) for i in order[pos : pos + size + 1].tolist()} - run_shards
            if not nxt:
                break
            k = nxt.pop()
            run_shards.add(k)
            size += counts[k]
        run = order[pos : pos + size].tolist()
        assert {shard(i) for i in run} == run_shards
        assert sorted(run) == sorted(
            i for k in run_shards for i in range(starts[k], starts[k] + counts[k])
        )
        pos += size
        seen += len(run_shards)
    assert seen == len(counts)


def test_shard_order_refuses_bad_layouts() -> None:
    with pytest.raises(ValueError, match="shard_counts must be a non-empty list"):
        shard_epoch_order(0, 0, [], window=2)
    with pytest.raises(ValueError, match="window must be at least 1"):
        shard_epoch_order(0, 0, [3], window=0)


# -- local shards ---------------------------------------------------------------------------


def test_local_shards_read_every_image_and_label_of_both_splits(prepared: Prepared) -> None:
    for split in ("train", "val"):
        source = ShardImages(str(prepared.root), split, window=4)
        assert len(source) == len(prepared.images[split])
        assert source.classes == [str(d) for d in range(10)]
        for i in range(len(source)):
            assert source.read(i) == prepared.images[split][i]
            assert source.label(i) == prepared.labels[split][i]
        assert source.shard_layout() == (source.index.shard_counts(), 4)
    copy = pickle.loads(pickle.dumps(source))
    assert copy.read(3) == prepared.images["val"][3]
    with pytest.raises(IndexError, match="out of range"):
        source.read(len(source))


def test_a_shard_sample_is_named_by_its_shard_and_its_place_in_it(prepared: Prepared) -> None:
    source = ShardImages(str(prepared.root), "train")
    shards = prepared.manifest.splits["train"].shards
    assert len(shards) >= 2 and shards[1].first == PER_SHARD
    last = len(source) - 1
    assert [source.name(i) for i in (0, 99, PER_SHARD + 7, last)] == [
        f"{prepared.root}/train-000000.tar[0]",
        f"{prepared.root}/train-000000.tar[99]",
        f"{prepared.root}/train-000001.tar[7]",
        f"{prepared.root}/{shards[-1].name}[{last - shards[-1].first}]",
    ]
    assert ShardImages(str(prepared.root), "val").name(3) == f"{prepared.root}/val-000000.tar[3]"
    with pytest.raises(IndexError, match="out of range"):
        source.name(len(source))


def test_the_spec_builds_the_manifests_splits_and_their_shard_order(
    prepared: Prepared, tmp_path: Path
) -> None:
    spec = _spec(tmp_path, f'path = "{prepared.root}"\nshuffle_shards = 2')
    ds = spec.job.dataset
    assert ds.source is DatasetSource.SHARDS and ds.has_validation
    train, val = build_splits(ds)
    assert isinstance(train, ShardImages) and isinstance(val, ShardImages)
    assert (len(train), len(val)) == (len(prepared.images["train"]), len(prepared.images["val"]))
    assert build_split(ds, Split.VAL).read(0) == prepared.images["val"][0]
    counts = train.index.shard_counts()
    assert torch.equal(order_for(train, 7, 1), shard_epoch_order(7, 1, counts, 2))


def test_a_pinned_manifest_that_changed_is_refused(prepared: Prepared, tmp_path: Path) -> None:
    data = (prepared.root / "manifest.json").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    assert load_manifest(str(prepared.root), expected_sha256=digest.upper())[2] == digest
    with pytest.raises(ManifestError) as e:
        load_manifest(str(prepared.root), expected_sha256="0" * 64)
    assert str(e.value) == (
        f"{prepared.root}/manifest.json has sha256 {digest}, but job.dataset.manifest_sha256 "
        f"pins {'0' * 64}: the dataset changed since the job was planned; set the new checksum "
        "(hetero dataset verify prints it) or restore the manifest"
    )
    spec = _spec(tmp_path, f'path = "{prepared.root}"\nmanifest_sha256 = "{"1" * 64}"')
    with pytest.raises(ManifestError, match="pins 1111"):
        build_splits(spec.job.dataset)


# -- S3 and the cache -----------------------------------------------------------------------


@pytest.fixture
def s3_dataset(prepared: Prepared, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="data")
        for f in prepared.root.iterdir():
            s3.upload_file(str(f), "data", f"digits/{f.name}")
        yield s3


def test_s3_shards_are_read_whole_once_into_the_cache_and_then_from_disk(
    prepared: Prepared, s3_dataset: Any, tmp_path: Path
) -> None:
    calls: list[str] = []
    s3_dataset.meta.events.register(
        "before-parameter-build.s3.GetObject", lambda params, **_: calls.append(params["Key"])
    )
    cache = tmp_path / "cache"
    source = ShardImages("s3://data/digits/", "train", cache_dir=cache, client=s3_dataset)
    assert calls == ["digits/manifest.json"]
    for i in range(len(source)):
        assert source.read(i) == prepared.images["train"][i]
    shards = prepared.manifest.splits["train"].shards
    assert sorted(calls[1:]) == sorted(f"digits/{s.name}" for s in shards)  # one GET each
    assert source.cache.downloads == len(shards)
    assert sorted(p.name for p in cache.glob("*.tar")) == sorted(f"{s.sha256}.tar" for s in shards)
    # Another process (pickled, as the augmentation workers get it) reuses the files.
    worker = pickle.loads(pickle.dumps(source))
    worker._client = s3_dataset
    assert worker.read(0) == prepared.images["train"][0] and worker.cache.downloads == 0
    assert len(calls) == 1 + len(shards)


def test_an_s3_shard_sample_is_named_by_its_shard_uri(s3_dataset: Any, tmp_path: Path) -> None:
    source = ShardImages("s3://data/digits/", "train", cache_dir=tmp_path, client=s3_dataset)
    assert source.name(PER_SHARD + 2) == "s3://data/digits/train-000001.tar[2]"


def test_the_cache_goes_where_the_boot_provisioned_it_unless_the_spec_says(
    prepared: Prepared, s3_dataset: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a dataprep instance the boot names the cache's folder (instance store where the type
    has it) in ``HETERO_SHARD_CACHE_DIR``; a ``cache_dir`` in the spec still wins."""
    provisioned, tmp = tmp_path / "instance-store", tmp_path / "tmp"
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("HETERO_SHARD_CACHE_DIR", str(provisioned))
    shard = prepared.manifest.splits["train"].shards[0]
    ShardImages("s3://data/digits/", "train", client=s3_dataset).read(shard.first)
    assert [p.name for p in provisioned.glob("*.tar")] == [f"{shard.sha256}.tar"]
    spec_dir = tmp_path / "from-spec"
    ShardImages("s3://data/digits/", "train", cache_dir=spec_dir, client=s3_dataset).read(
        shard.first
    )
    assert [p.name for p in spec_dir.glob("*.tar")] == [f"{shard.sha256}.tar"]
    monkeypatch.delenv("HETERO_SHARD_CACHE_DIR")
    ShardImages("s3://data/digits/", "train", client=s3_dataset).read(shard.first)
    assert [p.name for p in (tmp / "hetero-shards").glob("*.tar")] == [f"{shard.sha256}.tar"]


def test_the_cache_keeps_at_most_its_size_least_recently_used_first(
    prepared: Prepared, s3_dataset: Any, tmp_path: Path
) -> None:
    shards = prepared.manifest.splits["train"].shards
    biggest = max(s.bytes for s in shards)
    source = ShardImages(
        "s3://data/digits/", "train", cache_dir=tmp_path, cache_bytes=2 * biggest,
        client=s3_dataset,
    )  # fmt: skip
    first, second, third = (s.first for s in shards[:3])
    for i in (first, second, third):
        source.read(i)
    kept = {p.name for p in tmp_path.glob("*.tar")}
    assert kept == {f"{shards[1].sha256}.tar", f"{shards[2].sha256}.tar"}
    assert source.read(first) == prepared.images["train"][first]  # fetched again
    assert source.cache.downloads == 4


def test_a_shard_that_changed_in_s3_is_refused_not_used(
    prepared: Prepared, s3_dataset: Any, tmp_path: Path
) -> None:
    shard = prepared.manifest.splits["train"].shards[0]
    body = bytearray((prepared.root / shard.name).read_bytes())
    body[600] ^= 0xFF
    s3_dataset.put_object(Bucket="data", Key=f"digits/{shard.name}", Body=bytes(body))
    source = ShardImages("s3://data/digits/", "train", cache_dir=tmp_path, client=s3_dataset)
    with pytest.raises(OSError) as e:
        source.read(0)
    assert str(e.value).startswith(f"shard {shard.name} has sha256 ")
    assert str(e.value).endswith(
        f"the manifest says {shard.sha256}: it changed or was corrupted; run hetero dataset verify"
    )
    # Nothing but the shard's lock file is left: no shard, no half-fetched temporary.
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{shard.sha256}.lock"]


# -- the spec -------------------------------------------------------------------------------

SPEC = """
name = "shards"
[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 1
[job]
batch_size = 8
[job.dataset]
source = "{source}"
image_size = 16
{extra}
"""


def _spec(tmp_path: Path, extra: str, source: str = "shards") -> Any:
    path = tmp_path / "spec.toml"
    path.write_text(SPEC.format(source=source, extra=extra))
    return load_spec(path)


@pytest.mark.parametrize(
    ("source", "extra", "message"),
    [
        ("shards", "", "job.dataset.path: source 'shards' needs path = the folder or s3:// prefix"),
        (
            "shards",
            'path = "/d"\nval_fraction = 0.1',
            "job.dataset.val_fraction: source 'shards' takes its validation split from the "
            "manifest",
        ),
        (
            "shards",
            'path = "/d"\nmanifest_sha256 = "abc"',
            "job.dataset.manifest_sha256: expected the 64 hex digits hetero dataset verify prints",
        ),
        (
            "shards",
            'path = "/d"\ncache_gb = 0',
            "job.dataset.cache_gb: expected a size in GB above 0",
        ),
        (
            "folder",
            'path = "/d"\nshuffle_shards = 4',
            "job.dataset.shuffle_shards: only for source 'shards'",
        ),
    ],
)
def test_bad_shards_settings_are_refused_with_the_fix(
    tmp_path: Path, source: str, extra: str, message: str
) -> None:
    with pytest.raises(SpecError) as e:
        _spec(tmp_path, extra, source)
    assert message in str(e.value)


def test_a_download_does_not_move_the_augmentations_random_draws(
    prepared: Prepared, s3_dataset: Any, tmp_path: Path
) -> None:
    """A worker seeds the global generators for a batch, then reads its images: whether a shard
    had to be downloaded (boto3's transfer manager draws from ``random``) must not change what
    the augmentation draws next."""
    import random

    import numpy as np

    source = ShardImages("s3://data/digits/", "train", cache_dir=tmp_path, client=s3_dataset)
    draws = []
    for _ in range(2):  # a cache miss, then a hit
        random.seed(5)
        np.random.seed(5)
        torch.manual_seed(5)
        source.read(0)
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(1))))
    assert source.cache.downloads == 1
    assert draws[0] == draws[1]
