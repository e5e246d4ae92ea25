"""``hetero dataset prep``: an ImageFolder (local or ``s3://``, ``training/data/prep_inputs.py``)
packed into tar shards in WebDataset's layout (``training/data/tar_format.py``) plus the manifest
of ``training/data/manifest.py``, in a local folder or under an S3 prefix
(``training/data/prep_output.py``). ``hetero dataset verify`` checks a prepared dataset against
its manifest (``training/data/verify.py``).

Shards are deterministic: each split's samples (listed as the trainer lists them,
``FolderImages`` / ``S3Images``: classes sorted, then files sorted) go in a seeded shuffled order
(``--shuffle-seed``, ``shuffle_order``) so that every shard holds a random sample of the classes
(the shard-aware epoch order mixes a few shards at a time: ``training/data/order.py``); the
validation split is ``split_indices``' (the trainer's own set of images for the same
``val_fraction``/``split_seed``) or a separate folder, and every
tar header is fixed (mtime 0, uid/gid 0, no owner names, mode 0o644, ustar), so the same input
gives byte-identical shards and manifest. A shard is closed before the next sample would take it
past ``shard_bytes`` (a shard holds at least one sample).

Every image is checked as it is read, with the data servers' own decode and limits
(``training/data/decode.py``). One that cannot be read (``prep_inputs.read_problem``: its own
lasting error, such as a dangling link or an S3 object denied) or does not decode is left out
of the shards (the remaining samples keep their order and are numbered on) and named, with its
path and reason, in the manifest's ``excluded``; with ``strict`` the first one stops the
writing, the rest are only checked, and the prep is refused listing every one
(``UnreadableImages``), the shards this run wrote removed.

Resumable: each shard is written whole (locally as ``<name>.partial``, renamed; to S3 uploaded
from a local temporary file) and only then recorded in ``<out>/prep-state.json``, with the
inputs' identity. A rerun with the same inputs keeps the recorded shards that are still intact
(local: size and sha256; S3: size and the ETag of the upload) and goes on from the next one (the
state records the images each shard left out, so a resume knows where the next one starts); the
manifest is written last, whole (local: temporary file and rename; S3: one PutObject).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from training.common import s3
from training.data.manifest import (
    FORMAT,
    MANIFEST_NAME,
    Excluded,
    Manifest,
    Shard,
    SplitIndex,
    sha256_hex,
)
from training.data.names import shown_path
from training.data.prep_inputs import (
    DEFAULT_READ_THREADS,
    PrepError,
    SplitSource,
    UnreadableImages,
    plan_splits,
    read_ordered,
)
from training.data.prep_output import Output, open_output, s3_client
from training.data.tar_format import ShardRecord, ShardWriter, image_offsets

log = logging.getLogger(__name__)

STATE_NAME = "prep-state.json"
MIB = 1 << 20
DEFAULT_SHARD_MB = 256.0
_READ_AHEAD_PER_THREAD = 8
"""Images read ahead of the writer per thread: bounds memory to a few hundred images."""
IMAGE_CHECKS = "decode"
"""What prep checks of each image (``training/data/decode.py``), part of the inputs' identity: a
state written by a prep that packed images unchecked is not resumed."""


def _where(uri: str) -> str:
    """A source as the manifest names it: an ``s3://`` URI as given, a folder's absolute path
    (``shown_path``)."""
    return uri if s3.is_s3_uri(uri) else shown_path(str(Path(uri).resolve()))


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
    strict: bool = False
    """Refuse the dataset when an image does not decode, instead of leaving it out."""

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


def inputs_identity(request: PrepRequest, splits: Sequence[SplitSource]) -> dict[str, Any]:
    """What a resumed prep must share with the run that wrote the state: the same shards."""
    listing = hashlib.sha256()
    for split in splits:
        for name, (_, label) in zip(split.names, split.items, strict=True):
            # A file name's bytes that are not UTF-8 are Python's surrogate escapes: kept exactly.
            listing.update(f"{split.name}\t{label}\t{name}\n".encode("utf-8", "surrogateescape"))
    return {
        "format": FORMAT,
        "source": request.src,
        "val_src": request.val_src,
        "val_fraction": request.val_fraction,
        "split_seed": request.split_seed if request.val_fraction > 0 else None,
        "shuffle_seed": request.shuffle_seed,
        "shard_bytes": request.shard_bytes,
        "listing_sha256": listing.hexdigest(),
        "checks": IMAGE_CHECKS,
    }


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
        self.output.write(STATE_NAME, (json.dumps(body, separators=(",", ":")) + "\n").encode())


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
    # Deferred: rich is imported only when a prep runs.
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


Checked = tuple[int, bytes, str | None]
"""A source image as the packer gets it: its position in the split's order, its bytes and why
it does not decode (None: it does)."""


def _consumed(records: Sequence[ShardRecord], split: str) -> int:
    """How many of ``split``'s source images ``records`` went through (packed or left out)."""
    return sum(r.consumed for r in records if r.split == split)


def _finished(records: Sequence[ShardRecord], splits: Sequence[SplitSource]) -> bool:
    return all(_consumed(records, s.name) >= len(s.items) for s in splits)


def _excluded(splits: Sequence[SplitSource], records: Sequence[ShardRecord]) -> list[Excluded]:
    """The source images ``records`` left out, by path."""
    by_name = {s.name: s for s in splits}
    found = [
        Excluded(by_name[r.split].path(position), reason)
        for r in records
        for position, reason in r.excluded
    ]
    return sorted(found, key=lambda e: e.path)


class _Packer:
    """Writes each split's remaining source images into shards, in order, leaving out those that
    cannot be read or do not decode (recorded with the shard being written). ``strict``: the
    first such image stops the writing (the open shard is discarded) and the rest are only
    checked, each bad one collected in ``refused`` (given the kept shards' own: when there are
    any, nothing is written)."""

    def __init__(
        self,
        request: PrepRequest,
        output: Output,
        state: _State,
        pools: _Pools,
        refused: list[Excluded],
    ) -> None:
        self.request, self.output, self.state, self.pools = request, output, state, pools
        self.refused: list[Excluded] = refused
        self.written: list[str] = []
        self.stopped = bool(refused)
        """Whether the writing has stopped (strict: an image does not decode)."""
        self._committing: Future[None] | None = None

    def pack(self, split: SplitSource) -> None:
        mine = [r for r in self.state.shards if r.split == split.name]
        images = self._checked(split, _consumed(mine, split.name))
        item = next(images, None)
        number, first = len(mine), sum(r.count for r in mine)
        while item is not None and not self.stopped:
            item, count = self._pack_shard(split, number, first, item, images)
            number, first = number + 1, first + count
        while item is not None:  # strict, after an image that does not decode: check only
            position, _, problem = item
            if problem is not None:
                self.refused.append(Excluded(split.path(position), problem))
            self.pools.advance()
            item = next(images, None)

    def wait(self) -> None:
        """Until the last shard handed to the committer is in place and recorded."""
        if self._committing is not None:
            self._committing.result()
            self._committing = None

    def _checked(self, split: SplitSource, start: int) -> Iterator[Checked]:
        locations = [loc for loc, _ in split.items[start:]]
        reads = read_ordered(split.read_checked, locations, self.pools.read, self.pools.window)
        for position, (data, problem) in enumerate(reads, start):
            yield position, data, problem

    def _pack_shard(
        self, split: SplitSource, number: int, first: int, item: Checked, images: Iterator[Checked]
    ) -> tuple[Checked | None, int]:
        """Write shard ``number`` of ``split`` from ``item`` on; (the image it stopped at, None
        at the split's end; how many samples it holds)."""
        name = _shard_name(split.name, number)
        f = self.output.open_shard(name)
        try:
            writer = ShardWriter(split.name, name, first, f)
            left, excluded = self._fill(writer, split, item, images)
            if left is not None and left[2] is not None:  # strict: stop writing
                self.output.discard(f, name)
                self.stopped = True
                return left, 0
            if writer.count == 0:
                self.output.discard(f, name)
                paths = [Excluded(split.path(p), reason) for p, reason in excluded]
                raise UnreadableImages(
                    f"no image of the {split.name} split reads and decodes", paths
                )
            record = writer.close()
            record.excluded = excluded
            self.wait()  # the previous shard is in place and recorded
        except BaseException:
            f.close()
            raise
        self._committing = self.pools.commit.submit(self._commit, f, record)
        self.written.append(name)
        return left, record.count

    def _fill(
        self, writer: ShardWriter, split: SplitSource, item: Checked, images: Iterator[Checked]
    ) -> tuple[Checked | None, list[tuple[int, str]]]:
        """Add images from ``item`` on until the shard is full, the split ends or (strict) an
        image does not decode; (the image not added, those left out)."""
        excluded: list[tuple[int, str]] = []
        current: Checked | None = item
        while current is not None:
            position, data, problem = current
            label = split.items[position][1]
            if problem is not None:
                if self.request.strict:
                    break
                excluded.append((position, problem))
            elif writer.fits(len(data), label, self.request.shard_bytes):
                writer.add(split.ext(position), data, label)
            else:
                break
            self.pools.advance()
            current = next(images, None)
        return current, excluded

    def _commit(self, f: IO[bytes], record: ShardRecord) -> None:
        record = self.output.commit(f, record)
        self.state.shards.append(record)
        self.state.save()
        log.info("%s: %d samples, %d bytes", record.name, record.count, record.bytes)


@dataclass
class _Pools:
    """The readers, the one committer (it puts each finished shard in place, S3: uploads it, and
    records it, in order, while the next shard is written: at most two shards are on local
    disk) and the progress bar."""

    read: ThreadPoolExecutor
    commit: ThreadPoolExecutor
    window: int
    progress: Any
    task: Any

    def advance(self) -> None:
        self.progress.advance(self.task)


@contextmanager
def _pools(request: PrepRequest, total: int, done: int) -> Iterator[_Pools]:
    with (
        ThreadPoolExecutor(request.read_threads, thread_name_prefix="prep-read") as read,
        ThreadPoolExecutor(1, thread_name_prefix="prep-commit") as commit,
        _progress(total) as progress,
    ):
        task = progress.add_task("prep", total=total, completed=done)
        window = request.read_threads * _READ_AHEAD_PER_THREAD
        yield _Pools(read, commit, window, progress, task)


def _kept_shards(output: Output, state: _State, restart: bool) -> list[ShardRecord]:
    """The recorded shards, in order, up to the first one that is gone or changed (the state
    then records only those)."""
    kept: list[ShardRecord] = []
    for record in state.shards:
        if not output.intact(record):
            log.warning("%s changed or is gone: writing it again", output.url(record.name))
            break
        kept.append(record)
    if len(kept) != len(state.shards) or restart:
        state.shards = list(kept)
        state.save()
    return kept


def _undo(output: Output, state: _State, kept: list[ShardRecord], written: list[str]) -> None:
    """Take away the shards this run wrote: the output is as the run found it (but for an
    earlier manifest of other shards)."""
    for name in written:
        output.delete(name)
    state.shards = list(kept)
    if kept:
        state.save()
    else:
        output.delete(STATE_NAME)


def prep(request: PrepRequest, *, client: Any | None = None) -> PrepResult:
    """Pack ``request.src`` into shards and a manifest under ``request.out`` (see the module's
    docstring); raises ``PrepError`` naming the flag to change, ``UnreadableImages`` (one)
    listing every image that does not decode when ``request.strict``."""
    request.check()
    needs_s3 = any(s3.is_s3_uri(u or "") for u in (request.src, request.out, request.val_src))
    if needs_s3 and client is None:
        client = s3_client(request.read_threads)
    classes, splits = plan_splits(
        request.src,
        request.val_src,
        val_fraction=request.val_fraction,
        split_seed=request.split_seed,
        shuffle_seed=request.shuffle_seed,
        client=client,
    )
    output = open_output(request.out, client)
    state = _load_state(output, inputs_identity(request, splits), request.restart)
    kept = _kept_shards(output, state, request.restart)
    if not _finished(kept, splits):
        # Shards are about to change: a manifest of an earlier prep must not outlive them.
        output.delete(MANIFEST_NAME)
    # Strict, and the kept shards left images out: the dataset is refused, nothing is written.
    refused = _excluded(splits, kept) if request.strict else []
    total = sum(len(s.items) for s in splits)
    with _pools(request, total, sum(r.consumed for r in kept)) as pools:
        packer = _Packer(request, output, state, pools, refused)
        for split in splits:
            packer.pack(split)
        packer.wait()
    if refused:
        _undo(output, state, kept, packer.written)
        raise UnreadableImages(
            f"--strict: {len(refused)} image(s) cannot be read or decoded, so nothing is "
            "prepared (the shards this run wrote are removed); fix or remove them, or leave "
            "out --strict to prepare the dataset without them",
            refused,
        )
    manifest = build_manifest(
        classes, splits, state.shards, _where(request.src), request.split_settings()
    )
    data = manifest.dumps()
    output.write(MANIFEST_NAME, data)
    _remove_stale_shards(output, manifest)
    return PrepResult(
        manifest=manifest,
        uri=output.url(MANIFEST_NAME),
        sha256=sha256_hex(data),
        written=packer.written,
        kept=[r.name for r in kept],
    )


_SHARD_FILE = re.compile(r"^(train|val)-\d{6}\.tar(\.partial)?$")


def _remove_stale_shards(output: Output, manifest: Manifest) -> None:
    """Remove the shard files of an earlier prep (``--restart`` with other inputs) that the
    manifest does not name, so the folder holds one dataset."""
    current = {s.name for index in manifest.splits.values() for s in index.shards}
    for name in sorted(output.names(recursive=False)):
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
    indexes = {split.name: _split_index(split, records) for split in splits}
    excluded = tuple(_excluded(splits, records))
    return Manifest(tuple(classes), indexes, source=source, split=split_settings, excluded=excluded)


def _split_index(split: SplitSource, records: Sequence[ShardRecord]) -> SplitIndex:
    """The index of ``split``'s samples: its source images in order, less those left out."""
    mine = [r for r in records if r.split == split.name]
    left_out = {position for r in mine for position, _ in r.excluded}
    labels = [label for p, (_, label) in enumerate(split.items) if p not in left_out]
    offsets: list[int] = []
    sizes: list[int] = []
    for r in mine:
        offsets += image_offsets(r.size, labels[r.first : r.first + r.count])
        sizes += r.size
    assert len(sizes) == len(labels), (split.name, len(sizes), len(labels))
    return SplitIndex(
        shards=tuple(Shard(r.name, r.bytes, r.sha256, r.first, r.count) for r in mine),
        offset=tuple(offsets),
        size=tuple(sizes),
        label=tuple(labels),
    )


__all__ = ["PrepRequest", "PrepResult", "prep"]
