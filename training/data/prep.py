"""``hetero dataset prep`` and ``hetero dataset verify``: an ImageFolder (local or ``s3://``) packed
into tar shards in WebDataset's layout plus the manifest of ``training/data/manifest.py``, and
the check of a prepared dataset against its manifest.

Shards are deterministic: each split's samples (listed as the trainer lists them,
``FolderImages`` / ``S3Images``: classes sorted, then files sorted) go in a seeded shuffled order
(``--shuffle-seed``, ``shuffle_order``) so that every shard holds a random sample of the classes
(the shard-aware epoch order mixes a few shards at a time: ``training/data/order.py``); the
validation split is ``split_indices``' (the trainer's own set of images for the same
``val_fraction``/``split_seed``) or a separate folder, and every
tar header is fixed (mtime 0, uid/gid 0, no owner names, mode 0o644, ustar), so the same input
gives byte-identical shards and manifest. A shard is closed before the next sample would take it
past ``shard_bytes`` (a shard holds at least one sample).

Resumable: each shard is written whole (locally as ``<name>.partial``, renamed; to S3 uploaded
from a local temporary file) and only then recorded in ``<out>/prep-state.json``, with the
inputs' identity. A rerun with the same inputs keeps the recorded shards that are still intact
(local: size and sha256; S3: size and the ETag of the upload) and goes on from the next one; the
manifest is written last, whole (local: temporary file and rename; S3: one PutObject).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tarfile
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from training.data.manifest import (
    FORMAT,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    Shard,
    SplitIndex,
    file_sha256,
    folder_of,
    load_manifest,
    manifest_uri,
    sha256_hex,
)

log = logging.getLogger(__name__)

STATE_NAME = "prep-state.json"
MIB = 1 << 20
DEFAULT_SHARD_MB = 256.0
DEFAULT_READ_THREADS = 32
"""Concurrent reads of source images (S3 GetObjects are latency-bound, tens of ms each)."""
_READ_AHEAD_PER_THREAD = 8
"""Images read ahead of the writer per thread: bounds memory to a few hundred images."""
_BLOCK = tarfile.BLOCKSIZE
_CHUNK = 8 * MIB
MAX_PROBLEMS_SHOWN = 20


class PrepError(ValueError):
    """The prep cannot go on as asked; the message says why and which flag to change."""


# --- the tar layout -------------------------------------------------------------------------


def sample_key(index: int) -> str:
    """A sample's WebDataset key: its split index, 8 digits."""
    return f"{index:08d}"


def _padded(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


def member_bytes(size: int) -> int:
    """Bytes one ustar member of ``size`` data bytes takes: a header block plus padded data."""
    return _BLOCK + _padded(size)


def label_bytes(label: int) -> bytes:
    """A sample's ``.cls`` member: its class index as ASCII decimal."""
    return str(label).encode("ascii")


def sample_bytes(size: int, label: int) -> int:
    return member_bytes(size) + member_bytes(len(label_bytes(label)))


def closed_size(body: int) -> int:
    """A shard's file size for ``body`` bytes of members: tarfile's two end blocks, then zeros
    up to a whole record (10240 bytes)."""
    return -(-(body + 2 * _BLOCK) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


def image_offsets(sizes: Sequence[int], labels: Sequence[int]) -> list[int]:
    """Where each sample's image data starts in its shard, for samples of ``sizes``/``labels``
    written in order (what ``ShardWriter`` does)."""
    offsets, at = [], 0
    for size, label in zip(sizes, labels, strict=True):
        offsets.append(at + _BLOCK)
        at += sample_bytes(size, label)
    return offsets


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.raw.write(view)
        self.digest.update(view)
        self.written += len(view)
        return len(view)

    def tell(self) -> int:
        return self.written


@dataclass
class ShardRecord:
    """A finished shard: what the manifest and the prep state keep of it."""

    split: str
    name: str
    bytes: int
    sha256: str
    first: int
    count: int
    size: list[int]
    """Each sample's image size (their offsets follow: ``image_offsets``)."""
    etag: str = ""
    """The S3 object's ETag (S3 outputs only): how a resume knows the object is unchanged."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "split": self.split,
            "name": self.name,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "first": self.first,
            "count": self.count,
            "size": self.size,
        }
        if self.etag:
            out["etag"] = self.etag
        return out

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> ShardRecord:
        return cls(
            split=str(value["split"]),
            name=str(value["name"]),
            bytes=int(value["bytes"]),
            sha256=str(value["sha256"]),
            first=int(value["first"]),
            count=int(value["count"]),
            size=[int(v) for v in value["size"]],
            etag=str(value.get("etag", "")),
        )


class ShardWriter:
    """One shard being written: samples ``first, first + 1, ...`` of a split, each as
    ``<key>.<ext>`` (the image bytes unchanged) and ``<key>.cls``."""

    def __init__(self, split: str, name: str, first: int, file: IO[bytes]) -> None:
        self.split, self.name, self.first = split, name, first
        self._out = _HashingWriter(file)
        self._tar = tarfile.open(fileobj=self._out, mode="w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115
        self.sizes: list[int] = []
        self.body = 0

    @property
    def count(self) -> int:
        return len(self.sizes)

    def fits(self, size: int, label: int, limit: int) -> bool:
        """Whether a sample of ``size`` image bytes keeps the shard within ``limit`` bytes (an
        empty shard takes any sample)."""
        return not self.sizes or closed_size(self.body + sample_bytes(size, label)) <= limit

    def add(self, ext: str, data: bytes, label: int) -> None:
        key = sample_key(self.first + self.count)
        cls = label_bytes(label)
        self._tar.addfile(_tarinfo(f"{key}.{ext}", len(data)), io.BytesIO(data))
        self._tar.addfile(_tarinfo(f"{key}.cls", len(cls)), io.BytesIO(cls))
        self.body += sample_bytes(len(data), label)
        self.sizes.append(len(data))
        # The manifest's offsets are computed from this layout; a different tarfile would show.
        assert self._tar.offset == self.body, (self._tar.offset, self.body)

    def close(self) -> ShardRecord:
        """Finish the tar (its end blocks) and return what was written."""
        self._tar.close()
        assert self._out.written == closed_size(self.body)
        return ShardRecord(
            split=self.split,
            name=self.name,
            bytes=self._out.written,
            sha256=self._out.digest.hexdigest(),
            first=self.first,
            count=self.count,
            size=list(self.sizes),
        )


# --- where the output goes -------------------------------------------------------------------


def _split_s3(uri: str) -> tuple[str, str]:
    """``checkpoint_s3.parse_s3_uri`` (bucket, prefix ending in '/'), refused as a PrepError."""
    from training.trainer.checkpoint_s3 import parse_s3_uri

    try:
        return parse_s3_uri(uri)
    except ValueError as e:
        raise PrepError(str(e)) from None


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def s3_client(threads: int = DEFAULT_READ_THREADS) -> Any:
    import boto3  # deferred: local preps never import boto3
    from botocore.config import Config

    config = Config(
        max_pool_connections=max(10, threads), retries={"total_max_attempts": 5, "mode": "standard"}
    )
    return boto3.client("s3", config=config)


class Output:
    """A prepared dataset's folder: local or an S3 prefix."""

    uri: str

    def url(self, name: str) -> str:
        return self.uri.rstrip("/") + "/" + name

    def read(self, name: str) -> bytes | None:
        raise NotImplementedError

    def put(self, name: str, data: bytes) -> None:
        """Write a small file whole (atomically)."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        """Remove ``name`` if it is there."""
        raise NotImplementedError

    def names(self) -> list[str]:
        """The names of the files in the folder (not in its sub-folders)."""
        raise NotImplementedError

    def open_shard(self, name: str) -> IO[bytes]:
        """A file to write shard ``name`` into; nothing is under ``name`` until ``commit``."""
        raise NotImplementedError

    def commit(self, f: IO[bytes], record: ShardRecord) -> ShardRecord:
        """Put the whole shard written to ``f`` (from ``open_shard``) in place under
        ``record.name`` and close ``f``; ``record`` with what the output learns of it then (S3:
        its ETag)."""
        raise NotImplementedError

    def intact(self, record: ShardRecord) -> bool:
        """Whether the shard ``record`` describes is still there, unchanged."""
        raise NotImplementedError


class LocalOutput(Output):
    def __init__(self, path: str) -> None:
        self.root = Path(path)
        self.uri = str(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def read(self, name: str) -> bytes | None:
        path = self.root / name
        return path.read_bytes() if path.exists() else None

    def put(self, name: str, data: bytes) -> None:
        tmp = self.root / f"{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / name)

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def names(self) -> list[str]:
        return [p.name for p in self.root.iterdir() if p.is_file()]

    def open_shard(self, name: str) -> IO[bytes]:
        return open(self.root / f"{name}.partial", "wb", buffering=_CHUNK)

    def commit(self, f: IO[bytes], record: ShardRecord) -> ShardRecord:
        with f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.root / f"{record.name}.partial", self.root / record.name)
        return record

    def intact(self, record: ShardRecord) -> bool:
        path = self.root / record.name
        if not path.is_file() or path.stat().st_size != record.bytes:
            return False
        return file_sha256(path) == record.sha256


class S3Output(Output):
    def __init__(self, uri: str, client: Any) -> None:
        self.bucket, self.prefix = _split_s3(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}"
        self.client = client

    def _head(self, name: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            return dict(self.client.head_object(Bucket=self.bucket, Key=self.prefix + name))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def read(self, name: str) -> bytes | None:
        if self._head(name) is None:
            return None
        body = self.client.get_object(Bucket=self.bucket, Key=self.prefix + name)["Body"]
        return bytes(body.read())

    def put(self, name: str, data: bytes) -> None:
        # One PutObject: S3 shows the old object or the new one, never a part.
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + name, Body=data)

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + name)

    def names(self) -> list[str]:
        found = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix, Delimiter="/"):
            found += [obj["Key"][len(self.prefix) :] for obj in page.get("Contents", [])]
        return found

    def open_shard(self, name: str) -> IO[bytes]:
        return tempfile.TemporaryFile(prefix="hetero-shard-", buffering=_CHUNK)

    def commit(self, f: IO[bytes], record: ShardRecord) -> ShardRecord:
        with f:
            f.flush()
            f.seek(0)
            # Managed transfer: multipart (and concurrent parts) for big shards.
            self.client.upload_fileobj(f, self.bucket, self.prefix + record.name)
        head = self._head(record.name)
        if head is None or int(head["ContentLength"]) != record.bytes:
            raise PrepError(f"{self.url(record.name)} is not the shard just uploaded")
        record.etag = str(head["ETag"])
        return record

    def intact(self, record: ShardRecord) -> bool:
        head = self._head(record.name)
        return (
            head is not None
            and int(head["ContentLength"]) == record.bytes
            and str(head["ETag"]) == record.etag
        )


def open_output(uri: str, client: Any | None = None) -> Output:
    if is_s3(uri):
        return S3Output(uri, client if client is not None else s3_client())
    return LocalOutput(uri)


# --- what goes in ----------------------------------------------------------------------------


@dataclass
class SplitSource:
    """The samples of one split, in order: where each image is, its label, and how to read it."""

    name: str
    items: list[tuple[str, int]]
    names: list[str]
    """Each sample's name relative to its root (``<class>/<file>``): the inputs' identity."""
    read: Callable[[str], bytes]

    def ext(self, index: int) -> str:
        return Path(self.items[index][0]).suffix.lstrip(".").lower()


@dataclass
class Listing:
    uri: str
    classes: list[str]
    items: list[tuple[str, int]]
    names: list[str]
    read: Callable[[str], bytes]


def list_images(uri: str, *, flag: str, client: Any | None) -> Listing:
    """The ImageFolder at ``uri`` as the trainer lists it (same classes, same order)."""
    from training.data.datasets import FolderImages, S3Images  # deferred: imports torchvision

    try:
        if is_s3(uri):
            s3 = S3Images(uri, client=client, field=flag)
            s3_items = list(s3.keys)
            bucket, prefix, s3c = s3.bucket, s3.prefix, s3.client

            def read_s3(key: str) -> bytes:
                return bytes(s3c.get_object(Bucket=bucket, Key=key)["Body"].read())

            names = [key[len(prefix) :] for key, _ in s3_items]
            return Listing(uri, list(s3.classes), s3_items, names, read_s3)
        folder = FolderImages(uri, field=flag)
    except ValueError as e:
        raise PrepError(str(e)) from None
    root = str(folder.root)
    items = [(path, label) for path, label in folder.samples]
    names = [os.path.relpath(path, root).replace(os.sep, "/") for path, _ in items]
    return Listing(uri, list(folder.classes), items, names, lambda p: Path(p).read_bytes())


def _where(uri: str) -> str:
    """A source as the manifest names it: an ``s3://`` URI as given, a folder's absolute path."""
    return uri if is_s3(uri) else str(Path(uri).resolve())


@dataclass(frozen=True)
class PrepRequest:
    """What ``hetero dataset prep`` was asked for."""

    src: str
    out: str
    val_src: str | None = None
    val_fraction: float = 0.0
    split_seed: int = 0
    shard_bytes: int = int(DEFAULT_SHARD_MB * MIB)
    read_threads: int = DEFAULT_READ_THREADS
    restart: bool = False
    shuffle_seed: int | None = 0
    """The seed of each split's sample order in the shards; None: the listing's order (class
    by class: only for datasets read whole, never with the shard-aware epoch order)."""

    def check(self) -> None:
        if self.val_src is not None and self.val_fraction > 0:
            raise PrepError("give --val-src or --val-fraction, not both")
        if self.val_fraction and not 0 < self.val_fraction < 1:
            raise PrepError(f"--val-fraction must be in (0, 1), got {self.val_fraction:g}")
        if self.shard_bytes < 1:
            raise PrepError("--shard-mb must be more than 0")
        if self.read_threads < 1:
            raise PrepError("--read-threads must be at least 1")

    def split_settings(self) -> dict[str, Any]:
        """The manifest's ``split``: how the splits were made (the sample order's seed, and the
        validation split's source or fraction)."""
        settings: dict[str, Any] = {"shuffle_seed": self.shuffle_seed}
        if self.val_src is not None:
            settings["val_path"] = _where(self.val_src)
        elif self.val_fraction > 0:
            settings.update(val_fraction=self.val_fraction, split_seed=self.split_seed)
        return settings


_SHUFFLE_TAG = 0x5A4D


def shuffle_order(n: int, seed: int) -> list[int]:
    """A seeded permutation of ``range(n)``, the same on any machine and numpy version (from
    PCG64's raw output for a ``SeedSequence``, as ``split_indices``)."""
    import numpy as np

    bits = np.random.PCG64(np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, _SHUFFLE_TAG]))
    return [int(i) for i in np.argsort(bits.random_raw(n), kind="stable")]


def _shuffled(split: SplitSource, seed: int | None) -> SplitSource:
    if seed is None:
        return split
    order = shuffle_order(len(split.items), seed)
    return SplitSource(
        split.name,
        [split.items[i] for i in order],
        [split.names[i] for i in order],
        split.read,
    )


def plan_splits(
    request: PrepRequest, client: Any | None
) -> tuple[list[str], list[SplitSource], str]:
    """(class names, the splits to write in order, the source's URI for the manifest)."""
    classes, splits, source = _listed_splits(request, client)
    return classes, [_shuffled(s, request.shuffle_seed) for s in splits], source


def _listed_splits(
    request: PrepRequest, client: Any | None
) -> tuple[list[str], list[SplitSource], str]:
    """The splits in the listing's order (class by class)."""
    from training.data.splits import split_indices  # deferred: imports torchvision

    train = list_images(request.src, flag="--src", client=client)
    source = _where(train.uri)
    if request.val_src is not None:
        val = list_images(request.val_src, flag="--val-src", client=client)
        if val.classes != train.classes:
            missing = sorted(set(train.classes) - set(val.classes))
            extra = sorted(set(val.classes) - set(train.classes))
            differ = [f"missing there: {missing}"] if missing else []
            differ += [f"only there: {extra}"] if extra else []
            raise PrepError(
                f"--val-src {request.val_src!r} must have the same class names as --src "
                f"{request.src!r}; {'; '.join(differ) or 'their order differs'}"
            )
        return (
            train.classes,
            [
                SplitSource("train", train.items, train.names, train.read),
                SplitSource("val", val.items, val.names, val.read),
            ],
            source,
        )
    if request.val_fraction > 0:
        try:
            train_idx, val_idx = split_indices(
                len(train.items), request.val_fraction, request.split_seed
            )
        except ValueError as e:
            raise PrepError(str(e).replace("job.dataset.val_fraction", "--val-fraction")) from None

        def subset(name: str, idx: Iterable[int]) -> SplitSource:
            picked = [int(i) for i in idx]
            return SplitSource(
                name,
                [train.items[i] for i in picked],
                [train.names[i] for i in picked],
                train.read,
            )

        return train.classes, [subset("train", train_idx), subset("val", val_idx)], source
    return train.classes, [SplitSource("train", train.items, train.names, train.read)], source


def inputs_identity(request: PrepRequest, splits: Sequence[SplitSource]) -> dict[str, Any]:
    """What a resumed prep must share with the run that wrote the state: the same shards."""
    listing = hashlib.sha256()
    for split in splits:
        for name, (_, label) in zip(split.names, split.items, strict=True):
            listing.update(f"{split.name}\t{label}\t{name}\n".encode())
    return {
        "format": FORMAT,
        "source": request.src,
        "val_src": request.val_src,
        "val_fraction": request.val_fraction,
        "split_seed": request.split_seed if request.val_fraction > 0 else None,
        "shuffle_seed": request.shuffle_seed,
        "shard_bytes": request.shard_bytes,
        "listing_sha256": listing.hexdigest(),
    }


# --- reading images concurrently ---------------------------------------------------------------


def read_ordered(
    read: Callable[[str], bytes], locations: Sequence[str], pool: ThreadPoolExecutor, window: int
) -> Iterator[bytes]:
    """Each location's bytes, in order, with up to ``window`` reads in flight."""
    pending: deque[Future[bytes]] = deque()
    it = iter(locations)
    for loc in it:
        pending.append(pool.submit(read, loc))
        if len(pending) >= window:
            break
    while pending:
        data = pending.popleft().result()
        nxt = next(it, None)
        if nxt is not None:
            pending.append(pool.submit(read, nxt))
        yield data


# --- prep --------------------------------------------------------------------------------------


@dataclass
class PrepResult:
    manifest: Manifest
    uri: str
    sha256: str
    written: list[str] = field(default_factory=list)
    """Shards written by this run (the others were kept from an interrupted one)."""
    kept: list[str] = field(default_factory=list)


class _State:
    """``prep-state.json``: the inputs' identity and each finished shard, in order."""

    def __init__(self, output: Output, identity: dict[str, Any]) -> None:
        self.output, self.identity = output, identity
        self.shards: list[ShardRecord] = []

    def save(self) -> None:
        body = {"identity": self.identity, "shards": [s.to_json() for s in self.shards]}
        self.output.put(STATE_NAME, (json.dumps(body, separators=(",", ":")) + "\n").encode())


def _load_state(output: Output, identity: dict[str, Any], restart: bool) -> _State:
    state = _State(output, identity)
    raw = output.read(STATE_NAME)
    if raw is None or restart:
        return state
    try:
        value = json.loads(raw)
        old_identity = value["identity"]
        records = [ShardRecord.from_json(s) for s in value["shards"]]
    except (ValueError, KeyError, TypeError) as e:
        raise PrepError(
            f"{output.url(STATE_NAME)} is unreadable ({e}); pass --restart to prepare from scratch"
        ) from None
    if old_identity != identity:
        differ = sorted(
            k for k in set(identity) | set(old_identity) if old_identity.get(k) != identity.get(k)
        )
        raise PrepError(
            f"{output.url(STATE_NAME)} records a prep of different inputs (differs: "
            f"{', '.join(differ)}); rerun with the same inputs to resume it, or pass --restart "
            "to prepare from scratch"
        )
    state.shards = records
    return state


def _shard_name(split: str, number: int) -> str:
    return f"{split}-{number:06d}.tar"


def _progress(total: int) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.0f} samples/s" if speed else "- samples/s")

    console = Console(stderr=True)
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )


def prep(request: PrepRequest, *, client: Any | None = None) -> PrepResult:
    """Pack ``request.src`` into shards and a manifest under ``request.out`` (see the module's
    docstring); raises ``PrepError`` naming the flag to change."""
    request.check()
    needs_s3 = is_s3(request.src) or is_s3(request.out) or is_s3(request.val_src or "")
    if needs_s3 and client is None:
        client = s3_client(request.read_threads)
    classes, splits, source = plan_splits(request, client)
    output = open_output(request.out, client)
    state = _load_state(output, inputs_identity(request, splits), request.restart)

    # Keep the recorded shards, in order, up to the first one that is gone or changed.
    kept: list[ShardRecord] = []
    for record in state.shards:
        if not output.intact(record):
            log.warning("%s changed or is gone: writing it again", output.url(record.name))
            break
        kept.append(record)
    if len(kept) != len(state.shards) or request.restart:
        state.shards = list(kept)
        state.save()
    result_written: list[str] = []
    if sum(r.count for r in kept) < sum(len(s.items) for s in splits):
        # Shards are about to change: a manifest of an earlier prep must not outlive them.
        output.delete(MANIFEST_NAME)

    def commit(f: IO[bytes], record: ShardRecord) -> None:
        record = output.commit(f, record)
        state.shards.append(record)
        state.save()
        log.info("%s: %d samples, %d bytes", record.name, record.count, record.bytes)

    total = sum(len(s.items) for s in splits)
    done = sum(r.count for r in kept)
    window = request.read_threads * _READ_AHEAD_PER_THREAD
    # One committer thread puts each finished shard in place (S3: uploads it) and records it,
    # in order, while the next shard is written: at most two shards are on local disk.
    committing: Future[None] | None = None
    with (
        ThreadPoolExecutor(request.read_threads, thread_name_prefix="prep-read") as pool,
        ThreadPoolExecutor(1, thread_name_prefix="prep-commit") as committer,
        _progress(total) as progress,
    ):
        task = progress.add_task("prep", total=total, completed=done)
        for split in splits:
            number = sum(1 for r in kept if r.split == split.name)
            start = sum(r.count for r in kept if r.split == split.name)
            if start >= len(split.items):
                continue
            locations = [loc for loc, _ in split.items[start:]]
            images = read_ordered(split.read, locations, pool, window)
            index = start
            held: bytes | None = None  # read, but for the next shard: it did not fit
            while index < len(split.items):
                name = _shard_name(split.name, number)
                f = output.open_shard(name)
                try:
                    writer = ShardWriter(split.name, name, index, f)
                    while index < len(split.items):
                        label = split.items[index][1]
                        data = held if held is not None else next(images)
                        held = None
                        if not writer.fits(len(data), label, request.shard_bytes):
                            held = data
                            break
                        writer.add(split.ext(index), data, label)
                        index += 1
                        progress.advance(task)
                    record = writer.close()
                    if committing is not None:
                        committing.result()  # the previous shard is in place and recorded
                except BaseException:
                    f.close()
                    raise
                committing = committer.submit(commit, f, record)
                result_written.append(name)
                number += 1
        if committing is not None:
            committing.result()

    manifest = build_manifest(classes, splits, state.shards, source, request.split_settings())
    data = manifest.dumps()
    output.put(MANIFEST_NAME, data)
    _remove_stale_shards(output, manifest)
    return PrepResult(
        manifest=manifest,
        uri=output.url(MANIFEST_NAME),
        sha256=sha256_hex(data),
        written=result_written,
        kept=[r.name for r in kept],
    )


_SHARD_FILE = re.compile(r"^(train|val)-\d{6}\.tar(\.partial)?$")


def _remove_stale_shards(output: Output, manifest: Manifest) -> None:
    """Remove the shard files of an earlier prep (``--restart`` with other inputs) that the
    manifest does not name, so the folder holds one dataset."""
    current = {s.name for index in manifest.splits.values() for s in index.shards}
    for name in sorted(output.names()):
        if _SHARD_FILE.match(name) and name not in current:
            log.info("removing %s: not a shard of this manifest", output.url(name))
            output.delete(name)


def build_manifest(
    classes: Sequence[str],
    splits: Sequence[SplitSource],
    records: Sequence[ShardRecord],
    source: str,
    split_settings: dict[str, Any],
) -> Manifest:
    indexes: dict[str, SplitIndex] = {}
    for split in splits:
        mine = [r for r in records if r.split == split.name]
        offsets: list[int] = []
        sizes: list[int] = []
        for r in mine:
            labels = [label for _, label in split.items[r.first : r.first + r.count]]
            offsets += image_offsets(r.size, labels)
            sizes += r.size
        assert len(sizes) == len(split.items), (split.name, len(sizes), len(split.items))
        indexes[split.name] = SplitIndex(
            shards=tuple(Shard(r.name, r.bytes, r.sha256, r.first, r.count) for r in mine),
            offset=tuple(offsets),
            size=tuple(sizes),
            label=tuple(label for _, label in split.items),
        )
    return Manifest(tuple(classes), indexes, source=source, split=split_settings)


# --- verify ------------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    manifest: Manifest
    uri: str
    sha256: str
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def _open_shard(folder: str, name: str, client: Any) -> tuple[int | None, Any]:
    """(size or None when missing, a callable giving a readable binary file of it)."""
    if is_s3(folder):
        from botocore.exceptions import ClientError

        bucket, prefix = _split_s3(folder)
        try:
            head = client.head_object(Bucket=bucket, Key=prefix + name)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None, None

            raise

        def fetch() -> IO[bytes]:
            f = tempfile.TemporaryFile(prefix="hetero-verify-")  # noqa: SIM115
            client.download_fileobj(bucket, prefix + name, f)
            f.seek(0)
            return f

        return int(head["ContentLength"]), fetch
    path = Path(folder) / name
    if not path.is_file():
        return None, None
    return path.stat().st_size, lambda: open(path, "rb")


def _check_members(
    split: str, shard: Shard, index: SplitIndex, f: IO[bytes], problems: list[str]
) -> None:
    """Every sample of ``shard`` is where the manifest says: its image is member
    ``<key>.<ext>`` at ``offset``/``size`` and its ``.cls`` member holds its label."""
    where = f"{split}/{shard.name}"
    images: dict[str, tarfile.TarInfo] = {}
    cls: dict[str, tarfile.TarInfo] = {}
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            members = tar.getmembers()
    except (tarfile.TarError, OSError) as e:
        problems.append(f"{where}: cannot read its tar headers ({e})")
        return
    wanted = {sample_key(i) for i in range(shard.first, shard.first + shard.count)}
    for m in members:
        key, _, ext = m.name.partition(".")
        if key not in wanted or not ext or not m.isfile():
            problems.append(f"{where}: member {m.name} is not a sample of this shard")
        elif ext == "cls":
            cls[key] = m
        elif key in images:
            problems.append(f"{where}: sample {key} has two images ({images[key].name}, {m.name})")
        else:
            images[key] = m
    for i in range(shard.first, shard.first + shard.count):
        key = sample_key(i)
        image, label = images.get(key), cls.get(key)
        if image is None or label is None:
            problems.append(f"{where}: sample {i} has no {'image' if image is None else '.cls'}")
            continue
        if (image.offset_data, image.size) != (index.offset[i], index.size[i]):
            problems.append(
                f"{where}: sample {i}: the manifest's offset {index.offset[i]}, size "
                f"{index.size[i]} is not its image {image.name} (offset {image.offset_data}, "
                f"size {image.size})"
            )
        f.seek(label.offset_data)
        got = f.read(label.size)
        if got != label_bytes(index.label[i]):
            problems.append(
                f"{where}: sample {i}: {label.name} holds {got[:20]!r}, the manifest's label is "
                f"{index.label[i]}"
            )


def verify(path: str, *, quick: bool = False, client: Any | None = None) -> VerifyReport:
    """Check the prepared dataset at ``path`` (its folder or manifest, local or ``s3://``)
    against its manifest. Raises ``ManifestError`` when the manifest is unreadable or invalid;
    otherwise the report lists every problem found (none: all is well)."""
    uri = manifest_uri(path)
    if is_s3(uri) and client is None:
        client = s3_client()
    manifest, uri, digest = load_manifest(uri, client=client)
    folder = folder_of(uri)
    problems: list[str] = []
    for split, index in manifest.splits.items():
        for shard in index.shards:
            where = f"{split}/{shard.name}"
            size, opener = _open_shard(folder, shard.name, client)
            if size is None:
                problems.append(f"{where}: missing")
                continue
            if size != shard.bytes:
                problems.append(f"{where}: {size} bytes, the manifest says {shard.bytes}")
                continue
            if quick:
                continue
            with opener() as f:
                digest_now = hashlib.sha256()
                while chunk := f.read(_CHUNK):
                    digest_now.update(chunk)
                if digest_now.hexdigest() != shard.sha256:
                    problems.append(
                        f"{where}: sha256 {digest_now.hexdigest()}, the manifest says "
                        f"{shard.sha256}"
                    )
                f.seek(0)
                _check_members(split, shard, index, f, problems)
    return VerifyReport(manifest, uri, digest, problems)


__all__ = [
    "ManifestError",
    "PrepError",
    "PrepRequest",
    "PrepResult",
    "ShardWriter",
    "VerifyReport",
    "prep",
    "verify",
]
