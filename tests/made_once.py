"""Work that `make test`'s two pytest runs share: the parallel run and the run of the tests
marked ``alone`` after it (`make test` names one folder for both in ``HETERO_TEST_SHARED`` and
removes it afterwards), so a fixture that both need is made once, not once per run."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

SHARED_ENV = "HETERO_TEST_SHARED"


def made_once(name: str, make: Callable[[Path], None], fallback: Path) -> Path:
    """The folder ``make(folder)`` filled: under ``$HETERO_TEST_SHARED`` once per `make test`
    (the first caller makes it under a file lock, later callers, in any process of the two
    runs, reuse it; a make that raised is retried by the next caller), else ``fallback``,
    made by this caller."""
    shared = os.environ.get(SHARED_ENV, "").strip()
    if not shared:
        make(fallback)
        return fallback
    folder = Path(shared) / name
    done = Path(shared) / f"{name}.made"
    with open(Path(shared) / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                make(folder)
                done.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder
