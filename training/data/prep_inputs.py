"""What ``hetero dataset prep`` packs: the ImageFolders it is given (local or ``s3://``), listed
as the trainer lists them (``FolderImages`` / ``S3Images``: classes sorted, then files sorted),
split into training and validation (``split_indices``, the trainer's own split for the same
``val_fraction``/``split_seed``, or a separate folder), each split in a seeded shuffled order
(``shuffle_order``), and their images read concurrently, in order (``read_ordered``), each checked
as it is read (``read_checked``: ``training/data/decode.py``). A file that cannot be read for a
reason of its own that a rerun would meet again (gone, a dangling link, not permitted, an S3
object denied or archived: ``read_problem``) is unreadable like one that does not decode; any
other read error (throttling, the network, too many open files) stops the prep, to be resumed.

File names are taken as the filesystem gives them: bytes that are not UTF-8 are kept (Python's
surrogate escapes) and shown as ``\\xNN`` (``shown_path``); only class folder names, which the
manifest and the model keep as text, must be UTF-8, and prep refuses any other before it reads
an image."""

from __future__ import annotations

import errno
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from training.common import s3
from training.data.datasets import FolderImages, S3Images
from training.data.decode import CANNOT_READ, image_problem
from training.data.manifest import Excluded
from training.data.names import shown_path
from training.data.splits import check_same_classes, seeded_order, split_indices

DEFAULT_READ_THREADS = 32
"""Concurrent reads of source images (S3 GetObjects are latency-bound, tens of ms each)."""


class PrepError(ValueError):
    """The prep cannot go on as asked; the message says why and which flag to change."""


class UnreadableImages(PrepError):
    """Images that cannot be read or decoded stop the prep (``--strict``, or a split with none
    readable); the message lists every one, by path, with its reason."""

    def __init__(self, headline: str, images: Sequence[Excluded]) -> None:
        self.images = sorted(images, key=lambda e: e.path)
        lines = "".join(f"\n  {e.path}: {e.reason}" for e in self.images)
        super().__init__(f"{headline}:{lines}")


def _is_text(name: str) -> bool:
    return shown_path(name) == name


_FILE_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.ELOOP, errno.EISDIR})
"""A local file's own lasting read errors: gone (a dangling link), not permitted, a link loop."""
_OBJECT_CODES = s3.NOT_FOUND | s3.DENIED | {"InvalidObjectState"}
"""An S3 object's own lasting GetObject errors: gone, denied, archived (Glacier, not restored)."""


def read_problem(location: str, error: Exception) -> str | None:
    """Why the file at ``location`` cannot be read (``CANNOT_READ``: ...) when ``error`` is
    the file's own and a rerun would meet it again; None for any other error (a throttled or
    failed request, the network, too many open files), which must stop the prep."""
    code = s3.error_code(error)  # botocore's ClientError: S3's error code
    if code:
        return f"{CANNOT_READ}: {error}" if code in _OBJECT_CODES else None
    if not isinstance(error, OSError) or error.errno not in _FILE_ERRNOS:
        return None
    why = error.strerror or type(error).__name__
    if error.errno == errno.ENOENT and os.path.islink(location):
        why += f" (a symbolic link to {shown_path(os.readlink(location))}, which is not there)"
    return f"{CANNOT_READ}: {why}"


@dataclass
class SplitSource:
    """The samples of one split, in order: where each image is, its label, and how to read it."""

    name: str
    items: list[tuple[str, int]]
    names: list[str]
    """Each sample's name relative to its root (``<class>/<file>``): the inputs' identity."""
    read: Callable[[str], bytes]
    root: str
    """The ImageFolder's absolute path or ``s3://`` prefix, ending in ``/``."""

    def ext(self, index: int) -> str:
        return Path(self.items[index][0]).suffix.lstrip(".").lower()

    def path(self, index: int) -> str:
        """Where sample ``index`` is, as messages and the manifest show it (``shown_path``)."""
        return shown_path(self.root + self.names[index])

    def read_checked(self, location: str) -> tuple[bytes, str | None]:
        """The image at ``location`` and why it cannot be read (no bytes) or does not decode
        (None: it does); a read error that is not the file's own (``read_problem``) is raised."""
        try:
            data = self.read(location)
        except Exception as e:
            problem = read_problem(location, e)
            if problem is None:
                raise
            return b"", problem
        return data, image_problem(data)

    def pick(self, name: str, indices: Iterable[int]) -> SplitSource:
        """Split ``name``: this one's samples ``indices``, in that order."""
        picked = [int(i) for i in indices]
        items, names = [self.items[i] for i in picked], [self.names[i] for i in picked]
        return SplitSource(name, items, names, self.read, self.root)


def list_images(
    uri: str, split: str, *, flag: str, client: Any | None
) -> tuple[list[str], SplitSource]:
    """(class names, split ``split`` of every image) of the ImageFolder at ``uri``, as the
    trainer lists it (same classes, same order)."""
    try:
        if s3.is_s3_uri(uri):
            images = S3Images(uri, client=client, field=flag)
            bucket, prefix, s3c = images.bucket, images.prefix, images.client

            def read_s3(key: str) -> bytes:
                return bytes(s3c.get_object(Bucket=bucket, Key=key)["Body"].read())

            names = [key[len(prefix) :] for key, _ in images.keys]
            source = SplitSource(
                split, list(images.keys), names, read_s3, f"s3://{bucket}/{prefix}"
            )
            return list(images.classes), source
        folder = FolderImages(uri, field=flag)
    except ValueError as e:
        raise PrepError(str(e)) from None
    _check_class_names(folder, flag)
    root = str(folder.root)
    items = [(path, label) for path, label in folder.samples]
    names = [os.path.relpath(path, root).replace(os.sep, "/") for path, _ in items]
    where = str(folder.root.resolve()).rstrip("/") + "/"
    source = SplitSource(split, items, names, lambda p: Path(p).read_bytes(), where)
    return list(folder.classes), source


def _check_class_names(folder: FolderImages, flag: str) -> None:
    """Refuse class folders whose names are not UTF-8: the manifest and the exported model keep
    the class names as text."""
    bad = [shown_path(str(folder.root / c)) for c in folder.classes if not _is_text(c)]
    if bad:
        raise PrepError(
            f"{flag}: the names of class folder(s) {', '.join(bad)} are not UTF-8, and class "
            "names are kept as text (the manifest's classes, the model's labels); rename them "
            "in UTF-8 (e.g. `convmv -f <their encoding> -t utf8 --notest -r "
            f"{shown_path(str(folder.root))}`)"
        )


_SHUFFLE_TAG = 0x5A4D


def shuffle_order(n: int, seed: int) -> list[int]:
    """A seeded permutation of ``range(n)``, the same on any machine and numpy version (from
    PCG64's raw output for a ``SeedSequence``, as ``split_indices``)."""
    return [int(i) for i in seeded_order(n, seed, _SHUFFLE_TAG)]


def plan_splits(
    src: str,
    val_src: str | None,
    *,
    val_fraction: float,
    split_seed: int,
    shuffle_seed: int | None,
    client: Any | None,
) -> tuple[list[str], list[SplitSource]]:
    """(class names, the splits to write in order), each split in ``shuffle_seed``'s order
    (None: the listing's, class by class)."""
    classes, train = list_images(src, "train", flag="--src", client=client)
    splits = [train]
    if val_src is not None:
        val_classes, val = list_images(val_src, "val", flag="--val-src", client=client)
        try:
            check_same_classes(classes, val_classes, f"--val-src {val_src!r}", f"--src {src!r}")
        except ValueError as e:
            raise PrepError(str(e)) from None
        splits = [train, val]
    elif val_fraction > 0:
        try:
            train_idx, val_idx = split_indices(len(train.items), val_fraction, split_seed)
        except ValueError as e:
            raise PrepError(str(e).replace("job.dataset.val_fraction", "--val-fraction")) from None
        splits = [train.pick("train", train_idx), train.pick("val", val_idx)]
    if shuffle_seed is None:
        return classes, splits
    return classes, [s.pick(s.name, shuffle_order(len(s.items), shuffle_seed)) for s in splits]


T = TypeVar("T")


def read_ordered(
    read: Callable[[str], T], locations: Sequence[str], pool: ThreadPoolExecutor, window: int
) -> Iterator[T]:
    """Each location's ``read``, in order, with up to ``window`` reads in flight."""
    pending: deque[Future[T]] = deque()
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
