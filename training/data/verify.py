"""``hetero dataset verify``: a prepared dataset (``training/data/prep.py``) checked against its
manifest: every shard there, with its size and sha256, every sample where the manifest says in
it (``training/data/tar_format.py``), and every sample's image one a data server can decode
(``training/data/decode.py``: the check prep made of each source image)."""

from __future__ import annotations

import hashlib
import os
import tarfile
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from training.common import s3
from training.common.folder import S3Folder
from training.data.decode import image_problem
from training.data.manifest import (
    Manifest,
    Shard,
    SplitIndex,
    folder_of,
    load_manifest,
    manifest_uri,
)
from training.data.prep_output import s3_client
from training.data.tar_format import label_bytes, sample_key

MAX_PROBLEMS_SHOWN = 20
_DECODE_BATCH = 64
"""Images of a shard decoded at a time (in threads: PIL's decoders release the GIL)."""


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
    if s3.is_s3_uri(folder):
        bucket = S3Folder(folder, client)
        head = bucket.head(name)
        if head is None:
            return None, None

        def fetch() -> IO[bytes]:
            f = tempfile.TemporaryFile(prefix="hetero-verify-")  # noqa: SIM115
            client.download_fileobj(bucket.bucket, bucket.key(name), f)
            f.seek(0)
            return f

        return int(head["ContentLength"]), fetch
    path = Path(folder) / name
    if not path.is_file():
        return None, None
    return path.stat().st_size, lambda: open(path, "rb")


def _check_members(
    split: str,
    shard: Shard,
    index: SplitIndex,
    f: IO[bytes],
    problems: list[str],
    pool: ThreadPoolExecutor,
) -> None:
    """Every sample of ``shard`` is where the manifest says: its image is member
    ``<key>.<ext>`` at ``offset``/``size``, and decodes, and its ``.cls`` member holds its
    label."""
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
    present: list[tuple[int, tarfile.TarInfo]] = []
    for i in range(shard.first, shard.first + shard.count):
        key = sample_key(i)
        image, label = images.get(key), cls.get(key)
        if image is None or label is None:
            problems.append(f"{where}: sample {i} has no {'image' if image is None else '.cls'}")
            continue
        present.append((i, image))
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
    _check_decodes(where, present, f, problems, pool)


def _check_decodes(
    where: str,
    images: Sequence[tuple[int, tarfile.TarInfo]],
    f: IO[bytes],
    problems: list[str],
    pool: ThreadPoolExecutor,
) -> None:
    """Each (sample, image member) of ``images`` decodes as a data server decodes it."""
    for start in range(0, len(images), _DECODE_BATCH):
        batch = images[start : start + _DECODE_BATCH]
        datas = []
        for _, member in batch:
            f.seek(member.offset_data)
            datas.append(f.read(member.size))
        for (i, member), problem in zip(batch, pool.map(image_problem, datas), strict=True):
            if problem is not None:
                problems.append(f"{where}: sample {i}: {member.name} does not decode ({problem})")


def verify(path: str, *, quick: bool = False, client: Any | None = None) -> VerifyReport:
    """Check the prepared dataset at ``path`` (its folder or manifest, local or ``s3://``)
    against its manifest. Raises ``ManifestError`` when the manifest is unreadable or invalid;
    otherwise the report lists every problem found (none: all is well)."""
    uri = manifest_uri(path)
    if s3.is_s3_uri(uri) and client is None:
        client = s3_client()
    manifest, uri, digest = load_manifest(uri, client=client)
    folder = folder_of(uri)
    problems: list[str] = []
    with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="verify-decode") as pool:
        for split, index in manifest.splits.items():
            for shard in index.shards:
                _check_shard(folder, split, shard, index, client, quick, problems, pool)
    return VerifyReport(manifest, uri, digest, problems)


def _check_shard(
    folder: str,
    split: str,
    shard: Shard,
    index: SplitIndex,
    client: Any,
    quick: bool,
    problems: list[str],
    pool: ThreadPoolExecutor,
) -> None:
    """Check one shard against the manifest, adding what is wrong to ``problems``."""
    where = f"{split}/{shard.name}"
    size, opener = _open_shard(folder, shard.name, client)
    if size is None:
        problems.append(f"{where}: missing")
        return
    if size != shard.bytes:
        problems.append(f"{where}: {size} bytes, the manifest says {shard.bytes}")
        return
    if quick:
        return
    with opener() as f:
        digest_now = hashlib.file_digest(f, "sha256").hexdigest()
        if digest_now != shard.sha256:
            problems.append(f"{where}: sha256 {digest_now}, the manifest says {shard.sha256}")
        f.seek(0)
        _check_members(split, shard, index, f, problems, pool)
