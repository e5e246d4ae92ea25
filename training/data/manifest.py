"""A prepared dataset's manifest: its shards, where every sample is in them, its classes and its
train/validation split. ``hetero dataset prep`` writes it last (``training/data/prep.py``); a job
reads it instead of listing the dataset (one GET at start-up) and may pin its checksum
(``[job.dataset] manifest_sha256``).

Layout of a prepared dataset (WebDataset's: tar files whose members sharing a key form one
sample, readable by webdataset, wids and timm)::

    <root>/manifest.json
    <root>/train-000000.tar   # members 00000000.png, 00000000.cls, 00000001.jpg, ...
    <root>/val-000000.tar

``manifest.json``::

    {"format": "hetero-shards/1",
     "classes": ["cat", "dog"],
     "splits": {"train": {"shards": [{"name": "train-000000.tar", "bytes": 268431360,
                                      "sha256": "...", "first": 0, "count": 2391}, ...],
                          "offset": [1536, ...], "size": [110592, ...], "label": [0, ...]},
                "val": {...}},
     "source": "s3://bucket/imagenet/train/", "split": {"val_fraction": 0.02, "split_seed": 0},
     "excluded": [{"path": "s3://bucket/imagenet/train/cat/0001.jpg",
                   "reason": "corrupt or truncated: image file is truncated"}]}

A split's samples are numbered ``0 .. n-1`` in shard order: shard ``k`` holds samples
``first_k .. first_k + count_k - 1``, contiguous and in order. ``offset[i]``/``size[i]`` are the
byte range of sample ``i``'s image inside its shard (the tar member's data), ``label[i]`` its
class index into ``classes``. Sample ids on the wire are these split indices, as with the other
sources (``training/data/splits.py``). ``excluded``, present only when prep left files out, lists
each source image prep found unreadable (``training/data/decode.py``) and did not pack: its path
(bytes that are not UTF-8 shown as ``\\xNN``) and why.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.common import aws, s3

FORMAT = "hetero-shards/1"
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")


class ManifestError(ValueError):
    """A manifest that cannot be used; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Shard:
    name: str
    """File name, relative to the manifest's folder."""
    bytes: int
    sha256: str
    first: int
    """The split index of its first sample."""
    count: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "first": self.first,
            "count": self.count,
        }


@dataclass(frozen=True)
class SplitIndex:
    """One split: its shards and where each of its samples is."""

    shards: tuple[Shard, ...]
    offset: tuple[int, ...]
    size: tuple[int, ...]
    label: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.label)

    def shard_of(self, index: int) -> int:
        """The position in ``shards`` of the shard that holds sample ``index``."""
        if not 0 <= index < len(self.label):
            raise IndexError(f"sample index {index} out of range (split has {len(self)} samples)")
        lo, hi = 0, len(self.shards) - 1
        while lo < hi:  # the last shard whose first sample is at most ``index``
            mid = (lo + hi + 1) // 2
            if self.shards[mid].first <= index:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def shard_counts(self) -> list[int]:
        return [s.count for s in self.shards]

    def to_json(self) -> dict[str, Any]:
        return {
            "shards": [s.to_json() for s in self.shards],
            "offset": list(self.offset),
            "size": list(self.size),
            "label": list(self.label),
        }


@dataclass(frozen=True)
class Excluded:
    """A source image prep left out of the shards, and why."""

    path: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


@dataclass(frozen=True)
class Manifest:
    classes: tuple[str, ...]
    splits: Mapping[str, SplitIndex]
    source: str = ""
    split: Mapping[str, Any] | None = None
    """How the split was made (``val_fraction`` and ``split_seed``, or ``val_path``)."""
    excluded: tuple[Excluded, ...] = ()
    """The source images prep found unreadable and left out."""

    def to_json(self) -> dict[str, Any]:
        value: dict[str, Any] = {
            "format": FORMAT,
            "classes": list(self.classes),
            "splits": {name: s.to_json() for name, s in self.splits.items()},
            "source": self.source,
            "split": dict(self.split or {}),
        }
        if self.excluded:  # absent when empty: a clean dataset's manifest is as it always was
            value["excluded"] = [e.to_json() for e in self.excluded]
        return value

    def dumps(self) -> bytes:
        """The manifest file's bytes (stable: the same manifest, the same checksum)."""
        return (json.dumps(self.to_json(), separators=(",", ":")) + "\n").encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """A file's sha256, read in chunks (a shard may be hundreds of MB)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def manifest_uri(path: str) -> str:
    """``path`` names the manifest itself or the folder it is in: the manifest's path or URI."""
    if path.endswith(".json"):
        return path
    return path.rstrip("/") + "/" + MANIFEST_NAME


def folder_of(uri: str) -> str:
    """The folder (with a trailing ``/``) that holds the manifest ``uri`` and its shards."""
    return uri.rsplit("/", 1)[0] + "/" if "/" in uri else "./"


def read_bytes(uri: str, *, client: Any | None = None) -> bytes:
    """A local file's or an ``s3://`` object's bytes."""
    if not s3.is_s3_uri(uri):
        return Path(uri).read_bytes()
    bucket, key = s3.parse_s3_object(uri)
    data = s3.read_object(aws.client() if client is None else client, bucket, key)
    if data is None:
        raise FileNotFoundError(f"no such object: {uri}")
    return data


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ManifestError(f"{what} must be a list of whole numbers")
    return tuple(value)


def _split(name: str, value: Any, num_classes: int) -> SplitIndex:
    where = f"splits.{name}"
    if not isinstance(value, dict):
        raise ManifestError(f"{where} must be an object with shards, offset, size and label")
    raw_shards = value.get("shards")
    if not isinstance(raw_shards, list) or not raw_shards:
        raise ManifestError(f"{where}.shards must be a non-empty list")
    shards: list[Shard] = []
    expected_first = 0
    for i, s in enumerate(raw_shards):
        try:
            shard = Shard(
                name=str(s["name"]),
                bytes=int(s["bytes"]),
                sha256=str(s["sha256"]),
                first=int(s["first"]),
                count=int(s["count"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(
                f"{where}.shards[{i}] needs name, bytes, sha256, first, count: {e}"
            ) from None
        if shard.first != expected_first or shard.count < 1 or "/" in shard.name:
            raise ManifestError(
                f"{where}.shards[{i}] ({shard.name}): first {shard.first}, count {shard.count}; "
                f"expected first {expected_first}, a count of at least 1 and a plain file name"
            )
        expected_first += shard.count
        shards.append(shard)
    offset = _ints(value.get("offset"), f"{where}.offset")
    size = _ints(value.get("size"), f"{where}.size")
    label = _ints(value.get("label"), f"{where}.label")
    if not len(offset) == len(size) == len(label) == expected_first:
        raise ManifestError(
            f"{where}: offset, size and label have {len(offset)}, {len(size)} and {len(label)} "
            f"entries; its shards hold {expected_first} samples"
        )
    bad = next((i for i, v in enumerate(label) if not 0 <= v < num_classes), None)
    if bad is not None:
        raise ManifestError(f"{where}.label[{bad}] = {label[bad]} is not a class index")
    return SplitIndex(tuple(shards), offset, size, label)


def parse_manifest(data: bytes, *, source: str = "manifest") -> Manifest:
    """The manifest in ``data``; ``ManifestError`` naming ``source``, what is wrong and the fix."""
    fix = "prepare the dataset again with `hetero dataset prep`"
    try:
        value = json.loads(data)
    except ValueError as e:
        raise ManifestError(f"{source} is not JSON ({e}); {fix}") from None
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        got = value.get("format") if isinstance(value, dict) else type(value).__name__
        raise ManifestError(f"{source}: format must be {FORMAT!r}, got {got!r}; {fix}")
    classes = value.get("classes")
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        raise ManifestError(f"{source}: classes must be a non-empty list of names; {fix}")
    raw_splits = value.get("splits")
    if not isinstance(raw_splits, dict) or "train" not in raw_splits:
        raise ManifestError(f"{source}: splits must hold at least 'train'; {fix}")
    unknown = set(raw_splits) - set(SPLITS)
    if unknown:
        raise ManifestError(f"{source}: unknown split(s) {sorted(unknown)}; use train and val")
    try:
        splits = {n: _split(n, raw_splits[n], len(classes)) for n in SPLITS if n in raw_splits}
    except ManifestError as e:
        raise ManifestError(f"{source}: {e}; {fix}") from None
    split = value.get("split")
    return Manifest(
        classes=tuple(classes),
        splits=splits,
        source=str(value.get("source", "")),
        split=split if isinstance(split, dict) else None,
        excluded=_excluded(value.get("excluded", []), f"{source}: excluded", fix),
    )


def _excluded(value: Any, where: str, fix: str) -> tuple[Excluded, ...]:
    if not isinstance(value, list) or not all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("reason"), str)
        for e in value
    ):
        raise ManifestError(f'{where} must be a list of {{"path", "reason"}} strings; {fix}')
    return tuple(Excluded(e["path"], e["reason"]) for e in value)


def load_manifest(
    path: str, *, expected_sha256: str | None = None, client: Any | None = None
) -> tuple[Manifest, str, str]:
    """(manifest, its URI, its sha256) for ``path`` (the manifest or its folder). With
    ``expected_sha256`` (the job's pin) a manifest whose bytes differ is refused: the dataset
    changed under the job."""
    uri = manifest_uri(path)
    try:
        data = read_bytes(uri, client=client)
    except Exception as e:
        raise ManifestError(
            f"job.dataset.path: cannot read the manifest {uri}: {e}; point it at the folder "
            "`hetero dataset prep --out` wrote (or its manifest.json)"
        ) from e
    digest = sha256_hex(data)
    if expected_sha256 is not None and digest != expected_sha256.lower():
        raise ManifestError(
            f"{uri} has sha256 {digest}, but job.dataset.manifest_sha256 pins {expected_sha256}: "
            "the dataset changed since the job was planned; set the new checksum (hetero "
            "dataset verify prints it) or restore the manifest"
        )
    return parse_manifest(data, source=uri), uri, digest


def shard_counts(manifest: Manifest, split: str) -> Sequence[int]:
    return manifest.splits[split].shard_counts()
