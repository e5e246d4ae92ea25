"""A prepared dataset's shards in WebDataset's tar layout, byte for byte: each sample is member
``<key>.<ext>`` (the image bytes unchanged) then ``<key>.cls`` (its label), every header fixed
(mtime 0, uid/gid 0, no owner names, mode 0o644, ustar), so the same samples give the same bytes
and each image's offset in its shard follows from the sizes (``image_offsets``). Written by
``hetero dataset prep`` (``training/data/prep.py``), checked by ``hetero dataset verify``
(``training/data/verify.py``)."""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

_BLOCK = tarfile.BLOCKSIZE


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
    excluded: list[tuple[int, str]] = field(default_factory=list)
    """The source images (position in the split's order, reason) found unreadable and left out
    while this shard was written: its samples and these are the split's next ``consumed``."""

    @property
    def consumed(self) -> int:
        """How many of the split's source images this shard went through."""
        return self.count + len(self.excluded)

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
        if self.excluded:
            out["excluded"] = [[position, reason] for position, reason in self.excluded]
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
            excluded=[(int(p), str(r)) for p, r in value.get("excluded", [])],
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
