"""A folder that is a local path or an S3 prefix, with the same few operations on both.

Names are relative to the folder and use '/'. ``read`` gives None for a name that is not there;
``write`` is atomic (locally write-then-rename; in S3 one PutObject, which readers see whole or
not at all). Used by the job record, a prepared dataset's output and the model export.

Why not ``fsspec`` with ``s3fs``: s3fs reaches S3 through aiobotocore, and every aiobotocore
release pins botocore to a narrow range (3.10.0: ``>=1.43.115,<1.43.118``) that excludes the
botocore this project pins with boto3 (``containers/constraints.txt``). Taking it would tie boto3's
version to aiobotocore's release cadence for the image and every host; the operations needed here
are five, each one boto3 call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from training.common import aws, s3
from training.common.files import write_atomically


class Folder(Protocol):
    uri: str

    def url(self, name: str) -> str: ...
    def read(self, name: str) -> bytes | None: ...
    def write(self, name: str, data: bytes) -> None: ...
    def delete(self, name: str) -> None: ...
    def names(self, prefix: str = "", *, recursive: bool = True) -> list[str]: ...


class LocalFolder:
    def __init__(self, path: str | Path, *, fsync: bool = False) -> None:
        self.root = Path(path).expanduser()
        self.uri = str(self.root)
        self.fsync = fsync

    def url(self, name: str) -> str:
        return str(self.root / name)

    def read(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write(self, name: str, data: bytes) -> None:
        write_atomically(self.root / name, data, fsync=self.fsync)

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def names(self, prefix: str = "", *, recursive: bool = True) -> list[str]:
        """Files whose name starts with ``prefix`` (a sub-folder, ending in '/', or empty);
        ``recursive=False``: not those in sub-folders below it."""
        base = self.root / prefix
        if not base.is_dir():
            return []
        found = base.rglob("*") if recursive else base.iterdir()
        return sorted(p.relative_to(self.root).as_posix() for p in found if p.is_file())


class S3Folder:
    def __init__(self, uri: str, client: Any | None = None) -> None:
        self.bucket, self.prefix = s3.parse_s3_uri(uri)
        self.uri = s3.s3_uri(self.bucket, self.prefix)
        self.client = aws.client() if client is None else client

    def key(self, name: str) -> str:
        return self.prefix + name

    def url(self, name: str) -> str:
        return s3.s3_uri(self.bucket, self.key(name))

    def read(self, name: str) -> bytes | None:
        return s3.read_object(self.client, self.bucket, self.key(name))

    def write(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data)

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key(name))

    def head(self, name: str) -> dict[str, Any] | None:
        return s3.head_object(self.client, self.bucket, self.key(name))

    def names(self, prefix: str = "", *, recursive: bool = True) -> list[str]:
        keys = s3.list_keys(
            self.client, self.bucket, self.key(prefix), delimiter=None if recursive else "/"
        )
        return [k[len(self.prefix) :] for k in keys]


def open_folder(location: str | Path, *, s3_client: Any | None = None) -> Folder:
    """The folder at ``location``: ``s3://bucket/prefix`` or a local path."""
    if isinstance(location, str) and s3.is_s3_uri(location):
        return S3Folder(location, s3_client)
    return LocalFolder(location)
