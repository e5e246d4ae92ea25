"""Where ``hetero dataset prep`` puts a prepared dataset: a local folder or an S3 prefix
(``training.common.folder``), plus how a shard gets there whole. Locally a shard is written as
``<name>.partial`` and renamed; to S3 it is written to a local temporary file and uploaded. A
recorded shard is still intact when it has its size and (local) sha256 or (S3) upload's ETag."""

from __future__ import annotations

import os
import tempfile
from typing import IO, Any

from training.common import aws, s3
from training.common.folder import LocalFolder, S3Folder
from training.data.manifest import file_sha256
from training.data.prep_inputs import DEFAULT_READ_THREADS, PrepError
from training.data.tar_format import ShardRecord

CHUNK = 8 << 20
S3_ATTEMPTS = 5


def s3_client(threads: int = DEFAULT_READ_THREADS) -> Any:
    """A client for ``threads`` concurrent transfers, ``S3_ATTEMPTS`` attempts per request."""
    return aws.client(attempts=S3_ATTEMPTS, connections=max(10, threads))


class LocalOutput(LocalFolder):
    def __init__(self, path: str) -> None:
        super().__init__(path, fsync=True)
        self.root.mkdir(parents=True, exist_ok=True)

    def open_shard(self, name: str) -> IO[bytes]:
        """A file to write shard ``name`` into; nothing is under ``name`` until ``commit``."""
        return open(self.root / f"{name}.partial", "wb", buffering=CHUNK)

    def commit(self, f: IO[bytes], record: ShardRecord) -> ShardRecord:
        """Put the whole shard written to ``f`` (from ``open_shard``) in place under
        ``record.name`` and close ``f``; ``record`` with what the output learns of it then (S3:
        its ETag)."""
        with f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.root / f"{record.name}.partial", self.root / record.name)
        return record

    def discard(self, f: IO[bytes], name: str) -> None:
        """Close ``f`` (from ``open_shard``) and drop what was written to it."""
        f.close()
        (self.root / f"{name}.partial").unlink(missing_ok=True)

    def intact(self, record: ShardRecord) -> bool:
        """Whether the shard ``record`` describes is still there, unchanged."""
        path = self.root / record.name
        if not path.is_file() or path.stat().st_size != record.bytes:
            return False
        return file_sha256(path) == record.sha256


class S3Output(S3Folder):
    def open_shard(self, name: str) -> IO[bytes]:
        return tempfile.TemporaryFile(prefix="hetero-shard-", buffering=CHUNK)

    def commit(self, f: IO[bytes], record: ShardRecord) -> ShardRecord:
        with f:
            f.flush()
            f.seek(0)
            # Managed transfer: multipart (and concurrent parts) for big shards.
            self.client.upload_fileobj(f, self.bucket, self.key(record.name))
        head = self.head(record.name)
        if head is None or int(head["ContentLength"]) != record.bytes:
            raise PrepError(f"{self.url(record.name)} is not the shard just uploaded")
        record.etag = str(head["ETag"])
        return record

    def discard(self, f: IO[bytes], name: str) -> None:
        f.close()  # a temporary file: closing removes it

    def intact(self, record: ShardRecord) -> bool:
        head = self.head(record.name)
        return (
            head is not None
            and int(head["ContentLength"]) == record.bytes
            and str(head["ETag"]) == record.etag
        )


Output = LocalOutput | S3Output


def open_output(uri: str, client: Any) -> Output:
    """The output at ``uri`` (``client``: S3's); a malformed ``s3://`` URI is a ``PrepError``."""
    if not s3.is_s3_uri(uri):
        return LocalOutput(uri)
    try:
        return S3Output(uri, client)
    except ValueError as e:
        raise PrepError(str(e)) from None
