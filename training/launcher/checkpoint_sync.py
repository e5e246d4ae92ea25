"""Checkpoints kept in S3 for a trainer that writes to a filesystem path.

On EC2 the stack hands the launcher an ``s3://`` checkpoint URI; the trainer writes
``step-N/`` folders (``COMPLETE`` marker last) to a local folder. Before training the newest
complete checkpoint is downloaded, so a replacement Spot instance resumes from it; while training
(and once more after the trainer stops, inside the two-minute Spot notice) complete folders are
uploaded, marker last, and folders the trainer pruned are deleted from S3.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
"""The trainer's completion marker (written last into a finished ``step-N/``)."""
_STEP_RE = re.compile(r"^step-(\d+)$")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, key prefix ending in '/' or empty) of ``s3://bucket/prefix``."""
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri!r} is not an s3:// URI")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} has no bucket name")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def _remote_steps(s3: Any, bucket: str, prefix: str) -> dict[int, list[str]]:
    """step number -> every key under ``<prefix>step-N/``."""
    steps: dict[int, list[str]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            folder = obj["Key"][len(prefix) :].split("/", 1)[0]
            m = _STEP_RE.match(folder)
            if m:
                steps.setdefault(int(m.group(1)), []).append(obj["Key"])
    return steps


def download_latest(s3: Any, uri: str, local_dir: Path) -> Path | None:
    """Download the newest complete ``step-N/`` under ``uri`` into ``local_dir``; its path, or
    None when S3 holds no complete checkpoint (a fresh start)."""
    bucket, prefix = parse_s3_uri(uri)
    steps = _remote_steps(s3, bucket, prefix)
    complete = [n for n, keys in steps.items() if f"{prefix}step-{n}/{MARKER}" in keys]
    if not complete:
        log.info("no complete checkpoint under %s: starting fresh", uri)
        return None
    step = max(complete)
    target = local_dir / f"step-{step}"
    for key in steps[step]:
        dest = local_dir / key[len(prefix) :]
        dest.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, key, str(dest))
    log.info("downloaded checkpoint step %d from %s", step, uri)
    return target


def upload_complete(s3: Any, local_dir: Path, uri: str) -> list[int]:
    """Upload every complete local ``step-N/`` that S3 lacks (marker last), then delete S3
    folders the trainer has pruned locally. Returns the steps uploaded."""
    bucket, prefix = parse_s3_uri(uri)
    remote = _remote_steps(s3, bucket, prefix)
    local: dict[int, Path] = {}
    if local_dir.is_dir():
        for child in local_dir.iterdir():
            m = _STEP_RE.match(child.name)
            if m and (child / MARKER).is_file():
                local[int(m.group(1))] = child
    uploaded: list[int] = []
    for step, folder in sorted(local.items()):
        if f"{prefix}step-{step}/{MARKER}" in remote.get(step, []):
            continue
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER)
        for path in [*files, folder / MARKER]:  # the marker last: S3 never shows a half upload
            s3.upload_file(str(path), bucket, f"{prefix}{path.relative_to(local_dir).as_posix()}")
        uploaded.append(step)
        log.info("uploaded checkpoint step %d to %s", step, uri)
    if local:
        for step, keys in remote.items():
            if step not in local and step < max(local):
                for i in range(0, len(keys), 1000):
                    s3.delete_objects(
                        Bucket=bucket,
                        Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]},
                    )
    return uploaded


class CheckpointUploader(threading.Thread):
    """Uploads new complete checkpoints every ``interval_s`` until stopped; ``stop()`` makes one
    last upload (call it after the trainer has exited, so its final save is included)."""

    def __init__(self, s3: Any, local_dir: Path, uri: str, interval_s: float = 30.0) -> None:
        super().__init__(name="checkpoint-uploader", daemon=True)
        self._s3, self._local_dir, self._uri = s3, local_dir, uri
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def _upload(self) -> None:
        with self._lock:
            try:
                upload_complete(self._s3, self._local_dir, self._uri)
            except Exception as e:  # a failed upload is retried on the next round
                log.warning("checkpoint upload to %s failed: %s", self._uri, e)

    def run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self._upload()

    def stop(self) -> None:
        self._stopped.set()
        if self.is_alive():
            self.join()
        self._upload()
