"""A split of a prepared dataset (``[job.dataset] source = "shards"``) as an image source.

Start-up reads one manifest (``training/data/manifest.py``), not a listing. Sample ``i`` is the
byte range ``offset[i], size[i]`` of its shard. A local dataset is read in place. A dataset in S3
is read a whole shard at a time into a local cache (``ShardCache``), through boto3's managed
download (concurrent ranged GETs for a large object), so a server makes one request per shard
part, not one per sample, and from the second epoch on reads mostly from its disk. The epoch order
(``shard_layout``: ``training.data.order.shard_epoch_order``) keeps a range of positions inside a
few shards.

The cache is bounded (``cache_gb``; default: the dataset's size, at most 80% of the free space)
and least-recently-used shards go first. Files are named by their checksum, so two datasets or
two versions never mix, and a shard is checked against it before it is used. The augmentation
workers of a server share the cache: a lock file per shard lets one download it while the others
wait for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from training.common import s3
from training.common.files import write_atomically
from training.common.names import ENV_SHARD_CACHE_DIR
from training.data.lazy_s3 import LazyS3Client
from training.data.manifest import (
    Manifest,
    ManifestError,
    Shard,
    SplitIndex,
    file_sha256,
    folder_of,
    load_manifest,
)
from training.data.names import shown_path

log = logging.getLogger(__name__)

CACHE_FREE_SHARE = 0.8
"""The default cache may take at most this share of the free space in its folder."""
DEFAULT_CACHE_FOLDER = "hetero-shards"


def default_cache_dir() -> Path:
    """``$HETERO_SHARD_CACHE_DIR`` (set by the instance's boot: the folder on instance store
    where the type has it), else ``$TMPDIR/hetero-shards``."""
    provisioned = os.environ.get(ENV_SHARD_CACHE_DIR)
    if provisioned:
        return Path(provisioned)
    return Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / DEFAULT_CACHE_FOLDER


class ShardCache:
    """Whole shards on local disk, at most ``capacity_bytes`` of them (least recently used go
    first; the shard being fetched never does). ``fetch(shard, path)`` writes a shard's bytes to
    ``path``; ``downloads`` counts this process's fetches."""

    def __init__(self, folder: Path, capacity_bytes: int) -> None:
        self.folder = folder
        self.capacity_bytes = capacity_bytes
        self.downloads = 0
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, shard: Shard) -> Path:
        return self.folder / f"{shard.sha256}.tar"

    @contextlib.contextmanager
    def _locked(self, shard: Shard) -> Iterator[None]:
        with (self.folder / f"{shard.sha256}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def get(self, shard: Shard, fetch: Any) -> Path:
        """The cached file of ``shard``, fetched (``fetch(shard, path)``) and checked first when
        it is not there."""
        path = self.path(shard)
        if _has_size(path, shard.bytes):
            with contextlib.suppress(OSError):
                os.utime(path)  # recently used
            return path
        with self._locked(shard):
            if _has_size(path, shard.bytes):  # another worker fetched it meanwhile
                return path

            def fetch_checked(partial: Path) -> None:
                fetch(shard, partial)
                got = file_sha256(partial)
                if got != shard.sha256:
                    raise OSError(
                        f"shard {shard.name} has sha256 {got}, the manifest says {shard.sha256}: "
                        "it changed or was corrupted; run hetero dataset verify"
                    )

            write_atomically(path, fetch_checked)
            self.downloads += 1
        self._evict(keep=path)
        return path

    def _evict(self, keep: Path) -> None:
        files = []
        for p in self.folder.glob("*.tar"):
            with contextlib.suppress(OSError):
                st = p.stat()
                files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= self.capacity_bytes:
                break
            if p == keep:
                continue
            with contextlib.suppress(OSError):
                p.unlink()
                total -= size
                log.debug("shard cache: evicted %s", p.name)


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """Keep the global random generators as they were: a worker reads a batch's images after it
    seeded them for that batch, and a download (boto3's transfer manager draws from ``random``)
    happens only on a cache miss, so it must not move the augmentation's random draws: the same
    batch is augmented the same way whether its shard was cached or not."""
    import numpy as np
    import torch

    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


class ShardImages(LazyS3Client):
    """The ``split`` (``"train"`` or ``"val"``) of the prepared dataset at ``path`` (its folder,
    ``s3://`` prefix or ``manifest.json``). ``window``: shards an epoch shuffles together. For
    S3, shards are cached under ``cache_dir`` (default: ``default_cache_dir()``) up to
    ``cache_bytes``. Picklable: each process makes its own S3 client and cache object over
    the same cache folder."""

    _not_pickled = ("_client", "_cache")

    def __init__(
        self,
        path: str,
        split: str = "train",
        *,
        window: int = 8,
        expected_sha256: str | None = None,
        cache_dir: str | Path | None = None,
        cache_bytes: int | None = None,
        client: Any | None = None,
        manifest: tuple[Manifest, str, str] | None = None,
    ) -> None:
        self._client = client
        manifest_, self.uri, self.sha256 = manifest or load_manifest(
            path, expected_sha256=expected_sha256, client=client
        )
        if split not in manifest_.splits:
            raise ManifestError(
                f"{self.uri} has no {split!r} split; prepare the dataset with `hetero dataset "
                "prep --val-src` or `--val-fraction` to have a validation split"
            )
        self.split = split
        self.index: SplitIndex = manifest_.splits[split]
        self.classes = list(manifest_.classes)
        self.num_classes = len(self.classes)
        self.window = window
        self.folder = folder_of(self.uri)
        self.remote = s3.is_s3_uri(self.uri)
        self._cache: ShardCache | None = None
        self._cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self._cache_bytes = cache_bytes

    # -- the source ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.index)

    def label(self, index: int) -> int:
        self.index.shard_of(index)  # the range check
        return self.index.label[index]

    def name(self, index: int) -> str:
        """``<the manifest's folder>/<shard file>[<n>]``: the sample's shard and its position
        in it."""
        shard = self.index.shards[self.index.shard_of(index)]
        return f"{shown_path(self.folder + shard.name)}[{index - shard.first}]"

    def shard_layout(self) -> tuple[list[int], int]:
        """(samples per shard, window): what the epoch order needs."""
        return self.index.shard_counts(), self.window

    def read(self, index: int) -> bytes:
        shard = self.index.shards[self.index.shard_of(index)]
        offset, size = self.index.offset[index], self.index.size[index]
        for attempt in (1, 2):
            try:
                with self._shard_file(shard).open("rb") as f:
                    f.seek(offset)
                    data = f.read(size)
                break
            except FileNotFoundError:  # evicted by another worker in between: fetch again
                if attempt == 2:
                    raise
        if len(data) != size:
            raise OSError(f"shard {shard.name} ends before sample {index} ({offset}+{size})")
        return data

    def describe(self) -> str:
        where = f"{self.uri} (sha256 {self.sha256[:12]})"
        return (
            f"shards {where}, split {self.split}: {len(self)} images in "
            f"{len(self.index.shards)} shards, {self.num_classes} classes"
        )

    # -- shards --------------------------------------------------------------------------------

    @property
    def cache(self) -> ShardCache:
        if self._cache is None:
            capacity = self._cache_bytes
            if capacity is None:
                total = sum(s.bytes for s in self.index.shards)
                self._cache_dir.mkdir(parents=True, exist_ok=True)
                free = shutil.disk_usage(self._cache_dir).free
                capacity = min(total, int(free * CACHE_FREE_SHARE))
            self._cache = ShardCache(self._cache_dir, capacity)
        return self._cache

    def _shard_file(self, shard: Shard) -> Path:
        if not self.remote:
            return Path(self.folder) / shard.name
        with _rng_kept():
            return self.cache.get(shard, self._download)

    def _download(self, shard: Shard, path: Path) -> None:
        bucket, key = s3.parse_s3_object(self.folder + shard.name)
        self.client.download_file(bucket, key, str(path))
        log.info("shard cache: fetched %s (%d bytes)", shard.name, shard.bytes)


def shard_splits(spec: Any) -> tuple[ShardImages, ShardImages | None]:
    """(training split, validation split or None) of ``[job.dataset]`` with source ``shards``:
    one manifest read for both."""
    assert spec.path is not None
    loaded = load_manifest(spec.path, expected_sha256=spec.manifest_sha256)
    kwargs: dict[str, Any] = {
        "window": spec.shuffle_shards,
        "cache_dir": spec.cache_dir,
        "cache_bytes": int(spec.cache_gb * 1e9) if spec.cache_gb else None,
        "manifest": loaded,
    }
    train = ShardImages(spec.path, "train", **kwargs)
    val = ShardImages(spec.path, "val", **kwargs) if "val" in loaded[0].splits else None
    return train, val
