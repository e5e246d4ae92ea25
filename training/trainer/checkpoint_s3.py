"""Checkpoints kept in S3: ``s3://bucket/prefix/step-N/`` with a ``COMPLETE`` marker written last.

``S3CheckpointStore`` is the S3 side of ``training.trainer.checkpoint.Checkpointer``. Every trainer
host uploads the shard files its own ranks wrote; the marker goes up only after every host has
finished, so a step whose marker is missing (a save cut off by a Spot reclaim or a failed upload)
is never loaded. Pruning deletes a step's marker before its other files for the same reason.
boto3 takes its endpoint, region and credentials from the usual places (``AWS_ENDPOINT_URL``,
``AWS_REGION``, the instance role), so tests point it at a local moto server.

The client's waits are bounded (``training.common.aws.client``: a few seconds to connect or to
hear back, three attempts in all), so an S3 outage fails a save within seconds instead of hanging
it; the trainer decides what a failed save means (``training.trainer.checkpoint_policy``).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from training.common import aws, s3
from training.common.steps import MARKER, step_name, step_of

log = logging.getLogger(__name__)

_TRANSFER_THREADS = 8
"""Files moved at once: a host with 8 ranks writes 8 shard files per save."""


class S3CheckpointStore:
    """``step-N/`` folders under one S3 URI. Methods are plain (not collective); the
    ``Checkpointer`` decides which rank calls which. Errors from S3 propagate."""

    def __init__(self, uri: str, client: Any | None = None) -> None:
        self.uri = uri
        self.bucket, self.prefix = s3.parse_s3_uri(uri)
        self.client = aws.client() if client is None else client

    def step_uri(self, step: int) -> str:
        return s3.s3_uri(self.bucket, self._step_prefix(step))

    def _step_prefix(self, step: int) -> str:
        return f"{self.prefix}{step_name(step)}/"

    def steps(self) -> dict[int, list[str]]:
        """Step number -> every key under its ``step-N/`` (complete or not)."""
        found: dict[int, list[str]] = {}
        for key in s3.list_keys(self.client, self.bucket, self.prefix):
            step = step_of(key[len(self.prefix) :].split("/", 1)[0])
            if step is not None:
                found.setdefault(step, []).append(key)
        return found

    def _complete(self, steps: dict[int, list[str]]) -> list[int]:
        return sorted(n for n, keys in steps.items() if self._step_prefix(n) + MARKER in keys)

    def latest_complete(self) -> int | None:
        """The newest step whose marker is in S3 (None: a fresh start); marker-less steps
        newer than it are logged and skipped."""
        steps = self.steps()
        complete = self._complete(steps)
        newest = complete[-1] if complete else None
        for n in sorted(steps):
            if n not in complete and (newest is None or n > newest):
                log.warning(
                    "%s has no %s marker (a cut-off save): ignored", self.step_uri(n), MARKER
                )
        return newest

    def is_complete(self, step: int) -> bool:
        return step in self._complete(self.steps())

    def delete_step(self, step: int, keys: Sequence[str] | None = None) -> None:
        """Delete ``step-N/``, its marker first: a half-deleted step never looks complete."""
        keys = list(self.steps().get(step, [])) if keys is None else list(keys)
        marker = self._step_prefix(step) + MARKER
        if marker in keys:
            self.client.delete_object(Bucket=self.bucket, Key=marker)
            keys.remove(marker)
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys.
            self.client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
            )

    def upload_files(self, folder: Path, step: int) -> int:
        """Upload every file under ``folder`` (except a marker) to ``step-N/`` with the same
        relative paths; returns the bytes sent. ``folder`` may be named differently (the
        ``step-N.partial`` a save writes into)."""
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER)
        keys = [self._step_prefix(step) + p.relative_to(folder).as_posix() for p in files]
        _parallel(
            [
                partial(self.client.upload_file, str(p), self.bucket, k)
                for p, k in zip(files, keys, strict=True)
            ]
        )
        return sum(p.stat().st_size for p in files)

    def upload_marker(self, marker: Path, step: int) -> None:
        """Upload the marker file: call it only after every shard of ``step`` is in S3."""
        self.client.upload_file(str(marker), self.bucket, self._step_prefix(step) + MARKER)

    def download(self, step: int, dest: Path) -> int:
        """Replace ``dest`` with every file of ``step-N/``; returns the bytes received."""
        keys = self.steps().get(step, [])
        if self._step_prefix(step) + MARKER not in keys:
            raise FileNotFoundError(f"{self.step_uri(step)} is not a complete checkpoint")
        shutil.rmtree(dest, ignore_errors=True)
        targets = [dest / k[len(self._step_prefix(step)) :] for k in keys]
        for t in targets:
            t.parent.mkdir(parents=True, exist_ok=True)
        _parallel(
            [
                partial(self.client.download_file, self.bucket, k, str(t))
                for k, t in zip(keys, targets, strict=True)
            ]
        )
        return sum(t.stat().st_size for t in targets)

    def prune(self, keep: int) -> list[int]:
        """Delete complete steps beyond the newest ``keep`` and marker-less steps older than the
        newest complete one (cut-off saves); returns the steps deleted."""
        steps = self.steps()
        complete = self._complete(steps)
        if not complete:
            return []
        drop = complete[:-keep] + [n for n in steps if n not in complete and n < complete[-1]]
        for n in sorted(drop):
            self.delete_step(n, steps[n])
            log.info("checkpoint %s removed (keep=%d)", self.step_uri(n), keep)
        return sorted(drop)


def _parallel(calls: Sequence[Callable[[], object]]) -> None:
    """Run ``calls`` on a few threads (boto3 clients are thread-safe); the first error raises
    after all have finished."""
    if not calls:
        return
    with ThreadPoolExecutor(max_workers=min(_TRANSFER_THREADS, len(calls))) as pool:
        futures = [pool.submit(c) for c in calls]
    for f in futures:
        f.result()
