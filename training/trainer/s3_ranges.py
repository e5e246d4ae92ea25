"""An S3 checkpoint step fetched for an export: its DCP ``.metadata``, then only the byte ranges
of its files that hold the weights (``fetch_weights``)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch.distributed.checkpoint as dcp

from training.common import s3
from training.trainer.checkpoint_read import StepRef

log = logging.getLogger(__name__)

_RANGE_GAP = 1 << 20
"""Byte ranges of one file closer than this are fetched as one."""
_RANGE_CHUNK = 32 << 20
"""Largest single ranged GET (the chunks of a file are fetched in parallel)."""


def fetch_metadata(ref: StepRef) -> None:
    """Fetch the S3 step's DCP ``.metadata`` into ``ref.path`` (a no-op for a local step)."""
    if ref.store is None:
        return
    bucket, prefix = s3.parse_s3_uri(ref.source)
    ref.path.mkdir(parents=True, exist_ok=True)
    ref.store.client.download_file(bucket, prefix + ".metadata", str(ref.path / ".metadata"))


def fetch_weights(ref: StepRef, key: str) -> int:
    """Fetch from S3 only the bytes of ``ref``'s files that hold the ``key`` tensors (the
    weights, not the optimizer state: a quarter of a checkpoint with AdamW and an EMA), each
    at its own offset in a local file of the same name, so DCP reads the folder as usual;
    returns the bytes fetched. The byte ranges come from DCP's ``.metadata`` (its file
    layout: ``relative_path``, ``offset``, ``length`` per item); a layout without them is
    downloaded whole."""
    store = ref.store
    if store is None:
        return 0
    bucket, prefix = s3.parse_s3_uri(ref.source)
    metadata = dcp.FileSystemReader(str(ref.path)).read_metadata()
    ranges: dict[str, list[tuple[int, int]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        if not index.fqn.startswith(f"{key}."):
            continue
        try:
            start, length = int(info.offset), int(info.length)
            name = str(info.relative_path)
        except (AttributeError, TypeError, ValueError):
            log.info("unknown DCP file layout: downloading %s whole", ref.source)
            return int(store.download(ref.step, ref.path))
        ranges.setdefault(name, []).append((start, start + length))
    pieces: list[tuple[str, int, int]] = []
    for name, spans in ranges.items():
        merged: list[list[int]] = []
        for start, end in sorted(spans):
            if merged and start - merged[-1][1] <= _RANGE_GAP:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            for a in range(start, end, _RANGE_CHUNK):
                pieces.append((name, a, min(end, a + _RANGE_CHUNK)))
        (ref.path / name).touch()

    def get(name: str, start: int, end: int) -> None:
        body = store.client.get_object(
            Bucket=bucket, Key=prefix + name, Range=f"bytes={start}-{end - 1}"
        )["Body"].read()
        if len(body) != end - start:
            raise OSError(f"{ref.source}{name}: got {len(body)} bytes of {start}-{end - 1}")
        with open(ref.path / name, "r+b") as f:
            f.seek(start)
            f.write(body)

    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(get, *piece) for piece in pieces]
    for future in futures:
        future.result()
    return sum(end - start for _, start, end in pieces)
