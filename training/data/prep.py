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

Resumable: each shard is written whole (locally as ``<name>.partial``, renamed; to S3 uploaded
from a local temporary file) and only then recorded in ``<out>/prep-state.json``, with the
inputs' identity. A rerun with the same inputs keeps the recorded shards that are still intact
(local: size and sha256; S3: size and the ETag of the upload) and goes on from the next one; the
manifest is written last, whole (local: temporary file and rename; S3: one PutObject).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from training.common import s3
from training.data.manifest import (
    FORMAT,
    MANIFEST_NAME,
    Manifest,
    Shard,
    SplitIndex,
    sha256_hex,
)
from training.data.prep_inputs import (
    DEFAULT_READ_THREADS,
    PrepError,
    SplitSource,
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


def _where(uri: str) -> str:
    """A source as the manifest names it: an ``s3://`` URI as given, a folder's absolute path."""
    return uri if s3.is_s3_uri(uri) else str(Path(uri).resolve())


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


def prep(request: PrepRequest, *, client: Any | None = None) -> PrepResult:
    """Pack ``request.src`` into shards and a manifest under ``request.out`` (see the module's
    docstring); raises ``PrepError`` naming the flag to change."""
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
        written=result_written,
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


__all__ = ["PrepRequest", "PrepResult", "prep"]
