"""Write-then-rename: a file's name only ever holds a whole file, its old content or its new."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path


def write_atomically(
    path: Path, data: bytes | str | Callable[[Path], object], *, fsync: bool = False
) -> None:
    """Put ``data`` (bytes, text, or ``write(temporary path)``) in ``path``'s folder under a name
    of this process's own, then rename it onto ``path``. ``fsync``: flushed to disk before the
    rename, for a file that must survive a power cut. A failed write leaves ``path`` as it was and
    no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        elif isinstance(data, str):
            tmp.write_text(data)
        else:
            data(tmp)
        if fsync:
            _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if fsync:
        _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
